"""Graph IR: whole-tensor ops with symbolic dims, as the xDSL dialect `graph`.

A traced function becomes a `func.func` whose block arguments and results are
`!graph.tensor<[B, H, S, D], f16>` values. Dims are symbolic names (bound to
concrete values by the function's `tessera.dims` attribute) or integers.

Elementwise ops are generated from one table (`ELEMENTWISE`): its row gives an
op's arity, dtype rule and NumPy reference, which the tracer and the reference
interpreter use as they are. A new op also needs its Python name in
`frontend/ops.py` (the `_unary`/`_binary` lists) and its tile-level builder in
`lowering/emit.py`'s `ELEMENTWISE`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    ArrayAttr,
    BFloat16Type,
    DenseArrayBase,
    DictionaryAttr,
    Float8E4M3FNType,
    Float8E5M2Type,
    Float16Type,
    Float32Type,
    FloatAttr,
    IntAttr,
    IntegerAttr,
    StringAttr,
    UnitAttr,
    f64,
    i1,
    i32,
    i64,
)
from xdsl.ir import Attribute, Dialect, Operation, ParametrizedAttribute, SSAValue, TypeAttribute
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    var_operand_def,
)
from xdsl.utils.exceptions import VerifyException

from .. import dtypes
from ..dims import Dynamic, hint, is_dynamic
from ..dtypes import DType

Dim = str | int

_ELEMENT_TYPES: dict[str, Attribute] = {
    "f32": Float32Type(),
    "f16": Float16Type(),
    "bf16": BFloat16Type(),
    "f8E4M3FN": Float8E4M3FNType(),
    "f8E5M2": Float8E5M2Type(),
    "i32": i32,
    "i1": i1,
}


def element_type(dt: DType) -> Attribute:
    """The builtin MLIR element type of a Tessera dtype."""
    return _ELEMENT_TYPES[dt.mlir]


def dtype_of_element(t: Attribute) -> DType:
    for name, attr in _ELEMENT_TYPES.items():
        if attr == t:
            return dtypes.BY_MLIR[name]
    raise VerifyException(f"unsupported element type {t}")


@irdl_attr_definition
class TensorType(ParametrizedAttribute, TypeAttribute):
    """`!graph.tensor<[B, H, S, D], f16>`: a tensor with symbolic or literal dims."""

    name = "graph.tensor"
    dims: ArrayAttr
    element: Attribute

    @staticmethod
    def of(dims: Sequence[Dim], dt: DType) -> "TensorType":
        return TensorType(
            ArrayAttr([StringAttr(d) if isinstance(d, str) else IntAttr(int(d)) for d in dims]),
            element_type(dt),
        )

    @property
    def shape(self) -> tuple[Dim, ...]:
        return tuple(d.data for d in self.dims.data)

    @property
    def dtype(self) -> DType:
        return dtype_of_element(self.element)

    @property
    def rank(self) -> int:
        return len(self.dims.data)

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")

        def parse_dim() -> Attribute:
            value = parser.parse_optional_integer()
            if value is not None:
                return IntAttr(value)
            return StringAttr(parser.parse_identifier())

        dims = parser.parse_comma_separated_list(parser.Delimiter.SQUARE, parse_dim)
        parser.parse_punctuation(",")
        element = parser.parse_type()
        parser.parse_punctuation(">")
        return [ArrayAttr(dims), element]

    def print_parameters(self, printer) -> None:
        printer.print_string("<[" + ", ".join(str(d) for d in self.shape) + "], ")
        printer.print_attribute(self.element)
        printer.print_string(">")


def tensor_type(value: SSAValue) -> TensorType:
    if not isinstance(value.type, TensorType):
        raise VerifyException(f"expected a !graph.tensor, got {value.type}")
    return value.type


# --- dims --------------------------------------------------------------------

def dim_bindings(op) -> dict[str, int]:
    """The concrete values of symbolic dims, from the enclosing function's `tessera.dims`."""
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, func.FuncOp):
        parent = parent.parent_op()
    if parent is None or "tessera.dims" not in parent.attributes:
        return {}
    return bindings_of(parent)


#: a function's dims compiled as kernel arguments (`tessera.dims`): their names, an array of strings
DYNAMIC_DIMS = "tessera.dynamic_dims"
#: the offset width of the kernels over them (`tessera.dims.index_bits`): 32 or 64
INDEX_BITS = "tessera.index_bits"
#: of those dims, the ones every value is a multiple of more than 1 of (`tessera.dims.ALIGNMENT`):
#: name -> multiple. On a host function, the dims whose kernels' code depends on their multiple
#: (`tessera.dims.whole_blocks`), each with the compile's (1 where it took any value), which each
#: call's shapes are checked against (`tessera.dims.bind_shapes`)
DIM_MULTIPLES = "tessera.dim_multiples"


def bindings_of(f) -> dict:
    """A function's dim bindings (`tessera.dims`): each dim's value, or for a dim it compiles as a
    kernel argument (`tessera.dynamic_dims`) a `tessera.dims.Dynamic`, which refuses to be used as
    a number."""
    dynamic = dynamic_dims(f)
    bits = f.attributes[INDEX_BITS].value.data if INDEX_BITS in f.attributes else 64
    multiples = dim_multiples(f)
    return {k: Dynamic(k, v.value.data, bits, multiples.get(k, 1)) if k in dynamic else v.value.data
            for k, v in f.attributes["tessera.dims"].data.items()}


def dim_multiples(f) -> dict[str, int]:
    """`DIM_MULTIPLES` of a function (or of the host function that copies it): name -> multiple."""
    attr = f.attributes.get(DIM_MULTIPLES)
    return {} if attr is None else {k: v.value.data for k, v in attr.data.items()}


def dynamic_dims(f) -> tuple[str, ...]:
    """The dims a function compiles as kernel arguments."""
    attr = f.attributes.get(DYNAMIC_DIMS)
    return () if attr is None else tuple(a.data for a in attr.data)


def dims_attr(bindings: dict) -> DictionaryAttr:
    """`tessera.dims`: each dim's value (a dynamic dim's hint: `bindings_of` reads it back as dynamic)."""
    return DictionaryAttr({k: IntegerAttr(hint(v), 64) for k, v in bindings.items()})


def dynamic_dims_attr(bindings: dict) -> ArrayAttr:
    return ArrayAttr([StringAttr(k) for k, v in bindings.items() if is_dynamic(v)])


def dim_multiples_attr(bindings: dict) -> DictionaryAttr | None:
    """`DIM_MULTIPLES` of these bindings, None where no dynamic dim has a multiple."""
    multiples = {k: IntegerAttr(v.multiple, 64) for k, v in bindings.items() if is_dynamic(v) and v.multiple > 1}
    return DictionaryAttr(multiples) if multiples else None


def strides_attr(strides: dict[str, Sequence[int]]) -> DictionaryAttr:
    """`tessera.arg_strides`: the element strides of each argument the call passed in another
    layout than C-contiguous (the others are absent), which the compile specializes on."""
    return DictionaryAttr({name: DenseArrayBase.from_list(i64, tuple(st)) for name, st in strides.items()})


def arg_strides(f) -> dict[str, tuple[int, ...]]:
    """A graph function's `tessera.arg_strides`, by argument name (empty: every argument contiguous)."""
    attr = f.attributes.get("tessera.arg_strides")
    return {} if attr is None else {name: tuple(v.get_values()) for name, v in attr.data.items()}


def dim_value(d: Dim, bindings: dict[str, int]) -> int | None:
    return d if isinstance(d, int) else bindings.get(d)


def is_unit_reshape(op: ReshapeOp, bindings: dict[str, int]) -> bool:
    """A reshape that only adds or removes size-1 dims (an index map, not a data movement); not one
    to rank 0: kernels need a dim to tile, so that stays a host view."""
    sizes = [[dim_value(d, bindings) for d in tensor_type(v).shape] for v in (op.input, op.res)]
    return bool(sizes[1]) and [n for n in sizes[0] if n != 1] == [n for n in sizes[1] if n != 1]


def same_dim(a: Dim, b: Dim, bindings: dict[str, int]) -> bool:
    if a == b:
        return True
    va, vb = dim_value(a, bindings), dim_value(b, bindings)
    return va is not None and va == vb


def broadcast_shapes(shapes: Sequence[Sequence[Dim]], bindings: dict[str, int],
                     what: str = "operands") -> tuple[Dim, ...]:
    """NumPy broadcasting over symbolic dims. A dim broadcasts when it is 1."""
    rank = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(rank):
        column = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        chosen: Dim = 1
        for d in column:
            if dim_value(d, bindings) == 1 and d == 1:
                continue
            if chosen == 1:
                chosen = d
            elif not same_dim(chosen, d, bindings):
                if dim_value(d, bindings) == 1:
                    continue
                if dim_value(chosen, bindings) == 1:
                    chosen = d
                    continue
                shown = " vs ".join(_show(s, bindings) for s in shapes)
                raise VerifyException(
                    f"{what} do not broadcast: dim {chosen}{_eq(chosen, bindings)} "
                    f"vs {d}{_eq(d, bindings)} ({shown})")
        out.append(chosen)
    return tuple(out)


def _eq(d: Dim, bindings) -> str:
    v = dim_value(d, bindings)
    return f"={v}" if isinstance(d, str) and v is not None else ""


def _show(shape: Sequence[Dim], bindings) -> str:
    return "[" + ", ".join(f"{d}{_eq(d, bindings)}" for d in shape) + "]"


# --- the elementwise table -----------------------------------------------------

@dataclass(frozen=True)
class Elementwise:
    """One elementwise op: `result` is "same" (the promoted operand dtype), "bool", or "float"."""

    name: str
    arity: int
    ref: Callable
    result: str = "same"


def _erf(x):
    """math.erf per element, in x's float type (float64 for ints and bools, as np.exp would be)."""
    return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype if x.dtype.kind == "f" else np.float64)


def _rsqrt(x):
    return 1.0 / np.sqrt(x)


def _pow(x, y):
    """x ** y; of two ints torch's integer pow, wrapping as int32 does where the result is stored,
    and for a negative exponent 1 for x = 1, +-1 for x = -1, else 0 (torch's CUDA kernels; NumPy
    refuses it)."""
    if x.dtype.kind == "f" or np.asarray(y).dtype.kind == "f":
        return np.power(x, y)
    x, y = np.broadcast_arrays(np.asarray(x, np.int64), np.asarray(y, np.int64))
    with np.errstate(over="ignore"):
        positive = np.power(x, np.maximum(y, 0))
    negative = np.where(x == 1, 1, np.where(x == -1, np.where(y % 2 == 1, -1, 1), 0))
    return np.where(y < 0, negative, positive)


def _sigmoid(x):
    """1 / (1 + exp(-x)) as exp(-softplus(-x)): no overflow warning for very negative x, and no
    cancellation in its tiny values (0.5 (1 + tanh(x / 2)) rounds them to 0)."""
    return np.exp(-np.logaddexp(0, -x))


ELEMENTWISE: dict[str, Elementwise] = {e.name: e for e in [
    Elementwise("neg", 1, np.negative),
    Elementwise("abs", 1, np.abs),
    Elementwise("exp", 1, np.exp, "float"),
    Elementwise("exp2", 1, np.exp2, "float"),
    Elementwise("log", 1, np.log, "float"),
    Elementwise("log2", 1, np.log2, "float"),
    Elementwise("tanh", 1, np.tanh, "float"),
    Elementwise("sigmoid", 1, _sigmoid, "float"),
    Elementwise("sqrt", 1, np.sqrt, "float"),
    Elementwise("rsqrt", 1, _rsqrt, "float"),
    Elementwise("sin", 1, np.sin, "float"),
    Elementwise("cos", 1, np.cos, "float"),
    Elementwise("erf", 1, _erf, "float"),
    Elementwise("logical_not", 1, np.logical_not, "bool"),
    Elementwise("add", 2, np.add),
    Elementwise("sub", 2, np.subtract),
    Elementwise("mul", 2, np.multiply),
    Elementwise("div", 2, np.divide, "float"),
    Elementwise("maximum", 2, np.maximum),
    Elementwise("minimum", 2, np.minimum),
    Elementwise("pow", 2, _pow),
    Elementwise("floor_divide", 2, np.floor_divide),
    Elementwise("remainder", 2, np.remainder),
    Elementwise("lt", 2, np.less, "bool"),
    Elementwise("le", 2, np.less_equal, "bool"),
    Elementwise("gt", 2, np.greater, "bool"),
    Elementwise("ge", 2, np.greater_equal, "bool"),
    Elementwise("eq", 2, np.equal, "bool"),
    Elementwise("ne", 2, np.not_equal, "bool"),
    Elementwise("logical_and", 2, np.logical_and, "bool"),
    Elementwise("logical_or", 2, np.logical_or, "bool"),
    Elementwise("where", 3, np.where),
]}


def elementwise_result_dtype(e: Elementwise, operand_dtypes: Sequence[DType]) -> DType:
    if e.result == "bool":
        return dtypes.bool_
    values = operand_dtypes[1:] if e.name == "where" else operand_dtypes
    out = values[0]
    for d in values[1:]:
        out = dtypes.promote(out, d)
    if e.result == "float" and not out.is_float:
        return dtypes.fp32
    return out


class ElementwiseOp(IRDLOperation):
    """Base of the generated elementwise ops; `ELEMENTWISE[op.kind]` describes it."""

    inputs = var_operand_def(TensorType)
    res = result_def(TensorType)
    assembly_format = "$inputs attr-dict `:` type($inputs) `->` type($res)"

    def __init__(self, inputs: Sequence[SSAValue], result_type: TensorType):
        super().__init__(operands=[list(inputs)], result_types=[result_type])

    @property
    def kind(self) -> str:
        return self.name.removeprefix("graph.")

    def verify_(self) -> None:
        entry = ELEMENTWISE[self.kind]
        if len(self.inputs) != entry.arity:
            raise VerifyException(f"{self.name} takes {entry.arity} operands, got {len(self.inputs)}")
        bindings = dim_bindings(self)
        shapes = [tensor_type(v).shape for v in self.inputs]
        expected = broadcast_shapes(shapes, bindings, what=f"{self.name} operands")
        out = tensor_type(self.res)
        if len(out.shape) != len(expected) or not all(
                same_dim(a, b, bindings) for a, b in zip(out.shape, expected)):
            raise VerifyException(f"{self.name}: result shape {list(out.shape)} is not the broadcast "
                                  f"shape {list(expected)}")
        want = elementwise_result_dtype(entry, [tensor_type(v).dtype for v in self.inputs])
        if out.dtype != want:
            raise VerifyException(f"{self.name}: result dtype {out.dtype} should be {want}")
        if self.kind == "where" and tensor_type(self.inputs[0]).dtype != dtypes.bool_:
            raise VerifyException("where: the condition must be bool")


def _make_elementwise(entry: Elementwise) -> type[ElementwiseOp]:
    cls = type(f"{entry.name.title().replace('_', '')}Op", (ElementwiseOp,),
               {"name": f"graph.{entry.name}", "__doc__": f"Elementwise {entry.name}."})
    return irdl_op_definition(cls)


ELEMENTWISE_OPS: dict[str, type[ElementwiseOp]] = {n: _make_elementwise(e) for n, e in ELEMENTWISE.items()}


# --- structural ops --------------------------------------------------------------

def _ints(values: Sequence[int]) -> ArrayAttr:
    return ArrayAttr([IntAttr(int(v)) for v in values])


@irdl_op_definition
class MatmulOp(IRDLOperation):
    """Batched matrix product `[..., M, K] x [..., K, N] -> [..., M, N]` with broadcast batch dims."""

    name = "graph.matmul"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    res = result_def(TensorType)
    assembly_format = "$lhs `,` $rhs attr-dict `:` type($lhs) `,` type($rhs) `->` type($res)"

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: TensorType):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b = tensor_type(self.lhs), tensor_type(self.rhs)
        bindings = dim_bindings(self)
        if a.rank < 2 or b.rank < 2:
            raise VerifyException(f"matmul needs operands of rank >= 2, got ranks {a.rank} and {b.rank}")
        if not same_dim(a.shape[-1], b.shape[-2], bindings):
            raise VerifyException(f"matmul: contracting dims differ: lhs has {a.shape[-1]}{_eq(a.shape[-1], bindings)}, "
                                  f"rhs has {b.shape[-2]}{_eq(b.shape[-2], bindings)}")
        batch = broadcast_shapes([a.shape[:-2], b.shape[:-2]], bindings, "matmul batch dims")
        want = (*batch, a.shape[-2], b.shape[-1])
        if len(want) != tensor_type(self.res).rank:
            raise VerifyException(f"matmul: result rank should be {len(want)}")


@irdl_op_definition
class TransposeOp(IRDLOperation):
    """Permutes dims: result dim i is operand dim `perm[i]`."""

    name = "graph.transpose"
    input = operand_def(TensorType)
    perm = prop_def(ArrayAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, perm: Sequence[int], result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type], properties={"perm": _ints(perm)})

    @property
    def permutation(self) -> tuple[int, ...]:
        return tuple(p.data for p in self.perm.data)

    def verify_(self) -> None:
        src = tensor_type(self.input)
        if sorted(self.permutation) != list(range(src.rank)):
            raise VerifyException(f"transpose: {list(self.permutation)} is not a permutation of {src.rank} dims")
        if tuple(src.shape[p] for p in self.permutation) != tensor_type(self.res).shape:
            raise VerifyException("transpose: result shape does not match the permutation")


class _OneTensorOp(IRDLOperation):
    """An op from one tensor to one tensor whose result type says everything (reshape, cast)."""

    input = operand_def(TensorType)
    res = result_def(TensorType)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type])


@irdl_op_definition
class ReshapeOp(_OneTensorOp):
    """Reinterprets a contiguous tensor with a new shape of the same element count."""

    name = "graph.reshape"

    def verify_(self) -> None:
        bindings = dim_bindings(self)
        sizes = [[dim_value(d, bindings) for d in tensor_type(v).shape] for v in (self.input, self.res)]
        if any(None in s for s in sizes):
            return
        # a dynamic dim's value is unknown: the same dynamic dims on both sides, and the same
        # product of the others
        counts = [(math.prod(n for n in s if not is_dynamic(n)), sorted(n.name for n in s if is_dynamic(n)))
                  for s in sizes]
        if counts[0] != counts[1]:
            raise VerifyException(f"reshape: {sizes[0]} and {sizes[1]} have different element counts")


#: `logsumexp` is log(sum(exp(x))) about the row max (a max of -inf taken as 0, +inf giving +inf,
#: as torch): one reduction, so one kernel computes it, and an attention kernel, which has a row's
#: max and sum of exponentials anyway, writes it beside its output (`fusion`, the saved residual of
#: an attention backward)
REDUCTIONS = ("sum", "max", "min", "mean", "logsumexp")
#: the value each reduction leaves unchanged: what masked or padded elements contribute
NEUTRAL = {"sum": 0.0, "mean": 0.0, "max": -math.inf, "min": math.inf}


@irdl_op_definition
class ReduceOp(IRDLOperation):
    """Reduces one axis (`kind` in `REDUCTIONS`); `keepdim` keeps it with size 1."""

    name = "graph.reduce"
    input = operand_def(TensorType)
    kind = prop_def(StringAttr)
    axis = prop_def(IntAttr)
    keepdim = prop_def(IntAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, kind: str, axis: int, keepdim: bool, result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type], properties={
            "kind": StringAttr(kind), "axis": IntAttr(axis), "keepdim": IntAttr(int(keepdim))})

    def verify_(self) -> None:
        if self.kind.data not in REDUCTIONS:
            raise VerifyException(f"reduce: unknown kind {self.kind.data!r}; expected one of {REDUCTIONS}")
        if not 0 <= self.axis.data < tensor_type(self.input).rank:
            raise VerifyException(f"reduce: axis {self.axis.data} out of range")


@irdl_op_definition
class SoftmaxOp(IRDLOperation):
    name = "graph.softmax"
    input = operand_def(TensorType)
    axis = prop_def(IntAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, axis: int, result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type], properties={"axis": IntAttr(axis)})

    def verify_(self) -> None:
        if not 0 <= self.axis.data < tensor_type(self.input).rank:
            raise VerifyException(f"softmax: axis {self.axis.data} out of range")


class _NormOp(IRDLOperation):
    """Normalization over the last dim; optional affine operands follow `x`."""

    inputs = var_operand_def(TensorType)
    eps = prop_def(FloatAttr)
    has_weight = prop_def(IntAttr)
    has_bias = opt_prop_def(IntAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$inputs attr-dict `:` type($inputs) `->` type($res)"

    @property
    def x(self) -> SSAValue:
        return self.inputs[0]

    @property
    def weight(self) -> SSAValue | None:
        return self.inputs[1] if self.has_weight.data else None

    @property
    def bias(self) -> SSAValue | None:
        if self.has_bias is None or not self.has_bias.data:
            return None
        return self.inputs[1 + self.has_weight.data]

    def verify_(self) -> None:
        want = 1 + self.has_weight.data + (self.has_bias.data if self.has_bias else 0)
        if len(self.inputs) != want:
            raise VerifyException(f"{self.name}: expected {want} operands, got {len(self.inputs)}")
        bindings = dim_bindings(self)
        last = tensor_type(self.x).shape[-1]
        for param in (self.weight, self.bias):
            if param is not None:
                shape = tensor_type(param).shape
                if len(shape) != 1 or not same_dim(shape[0], last, bindings):
                    raise VerifyException(f"{self.name}: weight/bias must have shape [{last}], got {list(shape)}")


@irdl_op_definition
class LayerNormOp(_NormOp):
    name = "graph.layer_norm"

    def __init__(self, x, weight, bias, eps: float, result_type: TensorType):
        inputs = [v for v in (x, weight, bias) if v is not None]
        super().__init__(operands=[inputs], result_types=[result_type], properties={
            "eps": FloatAttr(eps, f64), "has_weight": IntAttr(int(weight is not None)),
            "has_bias": IntAttr(int(bias is not None))})


@irdl_op_definition
class RmsNormOp(_NormOp):
    name = "graph.rms_norm"

    def __init__(self, x, weight, eps: float, result_type: TensorType):
        inputs = [v for v in (x, weight) if v is not None]
        super().__init__(operands=[inputs], result_types=[result_type], properties={
            "eps": FloatAttr(eps, f64), "has_weight": IntAttr(int(weight is not None))})


#: the row statistics of a norm (`NormStatisticOp`)
NORM_STATISTICS = ("mean", "rstd")


@irdl_op_definition
class NormStatisticOp(IRDLOperation):
    """A row statistic of a norm over the last dim, fp32 with that dim kept as 1: the `mean`, or
    `rstd` = 1 / sqrt(mean((x - mean)^2) + eps) (`centered`, a layer_norm's) or 1 / sqrt(mean(x^2)
    + eps) (an rms_norm's). What a norm's forward saves for its backward: fusion makes it a second
    output of the norm's kernel, which computes it anyway."""

    name = "graph.norm_statistic"
    input = operand_def(TensorType)
    kind = prop_def(StringAttr)
    eps = prop_def(FloatAttr)
    centered = prop_def(IntAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, kind: str, eps: float, centered: bool, result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type], properties={
            "kind": StringAttr(kind), "eps": FloatAttr(eps, f64), "centered": IntAttr(int(centered))})

    def verify_(self) -> None:
        if self.kind.data not in NORM_STATISTICS:
            raise VerifyException(f"norm_statistic: unknown kind {self.kind.data!r}; expected one of "
                                  f"{NORM_STATISTICS}")
        if self.kind.data == "mean" and not self.centered.data:
            raise VerifyException("norm_statistic: an rms_norm has no mean (centered = 0 takes rstd only)")
        x, r = tensor_type(self.input), tensor_type(self.res)
        if r.dtype != dtypes.fp32 or r.rank != x.rank or r.shape[:-1] != x.shape[:-1] or dim_value(r.shape[-1], {}) != 1:
            raise VerifyException(f"norm_statistic: the result must be fp32 {[*x.shape[:-1], 1]}, got {r}")


@irdl_op_definition
class ArangeOp(IRDLOperation):
    """`[0, 1, ..., n-1]` as int32 over one (usually symbolic) dim."""

    name = "graph.arange"
    res = result_def(TensorType)
    assembly_format = "attr-dict `:` type($res)"

    def __init__(self, result_type: TensorType):
        super().__init__(result_types=[result_type])

    def verify_(self) -> None:
        t = tensor_type(self.res)
        if t.rank != 1 or t.dtype != dtypes.int32:
            raise VerifyException("arange must produce a rank-1 int32 tensor")


@irdl_op_definition
class DimSizeOp(IRDLOperation):
    """The size of dim `dim`, which the compile takes at run time (`tessera.dims.Dynamic`), as a
    rank-0 int32: what `k.shape[-2] - q.shape[-2]` becomes in a shape-generic trace (a decode
    step's query offset). A kernel reads it from a buffer of that dim (`tile.dim`)."""

    name = "graph.dim_size"
    dim = prop_def(StringAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "attr-dict `:` type($res)"

    def __init__(self, dim: str):
        super().__init__(result_types=[TensorType.of((), dtypes.int32)], properties={"dim": StringAttr(dim)})

    def verify_(self) -> None:
        t = tensor_type(self.res)
        if t.rank != 0 or t.dtype != dtypes.int32:
            raise VerifyException("dim_size must produce a rank-0 int32 tensor")


@irdl_op_definition
class ConstantOp(IRDLOperation):
    """A scalar (rank-0) constant; Python numbers in user code become these."""

    name = "graph.constant"
    value = prop_def(FloatAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "attr-dict `:` type($res)"

    def __init__(self, value: float, result_type: TensorType):
        super().__init__(result_types=[result_type], properties={"value": FloatAttr(float(value), f64)})

    def verify_(self) -> None:
        if tensor_type(self.res).rank != 0:
            raise VerifyException("constant must be rank 0")


@irdl_op_definition
class CastOp(_OneTensorOp):
    """Converts the element type; the result type names the new dtype. A `storage` cast narrows a
    float only for where the value is stored: a gradient given its primal's dtype (the VJP
    convention, `autodiff.backward.fit`). A kernel computing on such a value keeps it in fp32 and
    rounds it once, where it stores it or feeds it to a matmul, as FlashAttention scales dS in fp32
    and rounds it for its matmuls (the attention backward's dS was rounded, widened, scaled and
    rounded again: an F2F conversion, a special-function-unit op, an element)."""

    name = "graph.cast"
    storage = opt_prop_def(UnitAttr)
    irdl_options = (ParsePropInAttrDict(),)

    def __init__(self, x: SSAValue, result_type: TensorType, storage: bool = False):
        super().__init__(x, result_type)
        if storage:
            self.storage = UnitAttr()

    @property
    def rounds_inside_kernels(self) -> bool:
        """Whether a kernel rounds the value where it computes on it (not a float `storage` cast)."""
        floats = tensor_type(self.input).dtype.is_float and tensor_type(self.res).dtype.is_float
        return self.storage is None or not floats

    def verify_(self) -> None:
        if tensor_type(self.input).shape != tensor_type(self.res).shape:
            raise VerifyException("cast must keep the shape")


@irdl_op_definition
class SliceOp(IRDLOperation):
    """`res[i, j, ...] = input[starts[0] + i, starts[1] + j, ...]`: a window of unit step (`x[:, 1:3]`,
    `x[..., 2]` before its dim is dropped). Kernels read it by shifting their tile, never by copying."""

    name = "graph.slice"
    input = operand_def(TensorType)
    starts = prop_def(ArrayAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$input attr-dict `:` type($input) `->` type($res)"

    def __init__(self, x: SSAValue, starts: Sequence[int], result_type: TensorType):
        super().__init__(operands=[x], result_types=[result_type], properties={"starts": _ints(starts)})

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(s.data for s in self.starts.data)

    def verify_(self) -> None:
        src, out = tensor_type(self.input), tensor_type(self.res)
        if len(self.offsets) != src.rank or out.rank != src.rank:
            raise VerifyException(f"slice: {len(self.offsets)} starts and a rank-{out.rank} result for a "
                                  f"rank-{src.rank} input")
        bindings = dim_bindings(self)
        for d, (start, n, m) in enumerate(zip(self.offsets, src.shape, out.shape)):
            n, m = dim_value(n, bindings), dim_value(m, bindings)
            if start < 0 or (n is not None and m is not None and start + m > n):
                raise VerifyException(f"slice: dim {d} takes [{start}, {start}+{m}) of a dim of size {n}")


@irdl_op_definition
class ConcatOp(IRDLOperation):
    """`torch.cat(inputs, axis)`: the inputs one after another along `axis`, the other dims equal.
    One kernel computes it, each element read from the input whose range holds it."""

    name = "graph.concat"
    inputs = var_operand_def(TensorType)
    axis = prop_def(IntAttr)
    res = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$inputs attr-dict `:` type($inputs) `->` type($res)"

    def __init__(self, inputs: Sequence[SSAValue], axis: int, result_type: TensorType):
        super().__init__(operands=[list(inputs)], result_types=[result_type], properties={"axis": IntAttr(axis)})

    def verify_(self) -> None:
        out, axis, bindings = tensor_type(self.res), self.axis.data, dim_bindings(self)
        if not 0 <= axis < out.rank:
            raise VerifyException(f"concat: axis {axis} out of range for rank {out.rank}")
        total = 0
        for i, v in enumerate(self.inputs):
            shape = tensor_type(v).shape
            if len(shape) != out.rank or not all(same_dim(a, b, bindings) for d, (a, b) in
                                                 enumerate(zip(shape, out.shape)) if d != axis):
                raise VerifyException(f"concat: input {i} {list(shape)} does not match {list(out.shape)} "
                                      f"off axis {axis}")
            n = dim_value(shape[axis], bindings)
            total = None if n is None or total is None else total + n
        n = dim_value(out.shape[axis], bindings)
        if total is not None and n is not None and total != n:
            raise VerifyException(f"concat: the inputs' sizes along axis {axis} add to {total}, not {n}")


@irdl_op_definition
class GatherOp(IRDLOperation):
    """`res[i..., j...] = input[index[i...], j...]`: NumPy's `input[index]` for an int32 `index` (rows
    of `input` picked by a tensor of row numbers: an embedding lookup, a paged KV cache's pages
    through its block table). An index outside [0, rows) reads zeros: a kernel never reads past
    `input`, and a table's unused entries (-1, or stale) cost no fault.

    Fusion reads a gather whose pages are merged into one dim (`cache[table].reshape(B, J * page,
    ...)`) as an attention's keys or values page by page (`paged_view`); any other gather is a
    kernel of its own, one row of `input` a program, or, for rows of one element, an element a
    row of its index tile (`tile.load_gather`)."""

    name = "graph.gather"
    input = operand_def(TensorType)
    index = operand_def(TensorType)
    res = result_def(TensorType)
    assembly_format = "$input `[` $index `]` attr-dict `:` type($input) `,` type($index) `->` type($res)"

    def __init__(self, x: SSAValue, index: SSAValue, result_type: TensorType):
        super().__init__(operands=[x, index], result_types=[result_type])

    def verify_(self) -> None:
        src, index, out = tensor_type(self.input), tensor_type(self.index), tensor_type(self.res)
        if index.dtype != dtypes.int32:
            raise VerifyException(f"gather: the index must be int32, got {index.dtype}")
        if src.rank < 1:
            raise VerifyException("gather: the indexed tensor needs at least one dim")
        if out.dtype != src.dtype:
            raise VerifyException(f"gather: the result is {out.dtype}, the indexed tensor {src.dtype}")
        bindings = dim_bindings(self)
        want = (*index.shape, *src.shape[1:])
        if len(want) != out.rank or not all(same_dim(a, b, bindings) for a, b in zip(want, out.shape)):
            raise VerifyException(f"gather: the result {_show(out.shape, bindings)} should be the index's dims "
                                  f"then the indexed tensor's after its first, {_show(want, bindings)}")


def swaps_last_dims(v: SSAValue) -> bool:
    """Whether `v` is a transpose exchanging its operand's last two dims (`b.T` of a matmul's B:
    the transpose of a K-contiguous [N, K] tensor), whatever it does to the dims before them."""
    op = v.owner
    rank = len(op.permutation) if isinstance(op, TransposeOp) else 0
    return rank >= 2 and op.permutation[-2:] == (rank - 1, rank - 2)


def functions(module) -> list[func.FuncOp]:
    """The functions of a Graph IR module."""
    return [f for f in module.ops if isinstance(f, func.FuncOp)]


def structure(v: SSAValue):
    """A key equal for values computed by the same ops from the same function arguments (the
    copies `recompute.py` makes of a score tree for each sink, a prologue's cast cloned into each
    of its readers)."""
    op = v.owner
    if not isinstance(op, Operation):
        return v
    return op.name, tuple(structure(x) for x in op.operands), op_settings(op), \
        op.results.index(v) if len(op.results) > 1 else 0


def op_settings(op: Operation) -> tuple:
    """What besides its operands makes an op compute what it does: its properties and attributes
    (its source location aside) and its result types."""
    attrs = tuple(sorted((k, str(a)) for k, a in {**op.properties, **op.attributes}.items() if k != "tessera.loc"))
    return attrs, tuple(str(r.type) for r in op.results)


def float_constant_value(op: "ConstantOp") -> float:
    """A float graph.constant's value as its dtype holds it (finfo(fp32).min in fp16 is -inf)."""
    with np.errstate(over="ignore"):
        return float(np.asarray(op.value.value.data, tensor_type(op.res).dtype.np))


def masks_rows_or_keys(shape: Sequence[Dim], scores: Sequence[Dim]) -> bool:
    """Whether a tensor of `shape` added to attention scores of shape `scores` ([..., M, N]) may
    mask keys or whole query rows: its last dim is the keys' ([B, 1, M, N], [N]), or one of its
    last two the queries' ([B, 1, M, 1], or [B, M] viewed as that inside the function; not ALiBi's
    [H, 1, 1] slopes, unless M is 1)."""
    return bool(shape) and (shape[-1] == scores[-1] or scores[-2] in tuple(shape[-2:]))


#: the attribute of log_softmax's graph.sub `x - logsumexp(x)` (a unit attribute, set by
#: `ops.log_softmax_difference`): the row kernel computes it as (x - max) - log(sum), torch's
#: log_softmax, from the row's online statistics (`schedule_to_tile._log_softmax_differences`);
#: x - logsumexp(x) written out keeps torch's order (a row all of finfo.min gives 0 there: its
#: logsumexp rounds to the fill)
LOG_SOFTMAX = "tessera.log_softmax"


def computed_from(v: SSAValue, op: Operation) -> bool:
    """Whether `v` is `op`'s result or computed from it, through any ops."""
    work, seen = [v], set()
    while work:
        x = work.pop()
        if x.owner is op:
            return True
        if isinstance(x.owner, Operation) and x.owner not in seen:
            seen.add(x.owner)
            work.extend(x.owner.operands)
    return False


def paged_view(op: ReshapeOp, bindings: dict[str, int]) -> GatherOp | None:
    """The gather a reshape merges pages of: `cache[table]` ([..., J, page, ...]: the table's dims,
    then the cache's) with the table's last dim and the cache's page dim (dim 1) merged into one
    ([..., J * page, ...]), every other dim kept. None for any other reshape."""
    gather = op.input.owner
    if not isinstance(gather, GatherOp):
        return None
    src = [dim_value(d, bindings) for d in tensor_type(op.input).shape]
    dst = [dim_value(d, bindings) for d in tensor_type(op.res).shape]
    k = tensor_type(gather.index).rank
    if k < 1 or len(src) <= k or None in src or None in dst or any(is_dynamic(n) for n in src + dst):
        return None
    merged = src[:k - 1] + [src[k - 1] * src[k]] + src[k + 1:]
    return gather if merged == dst else None


@irdl_op_definition
class AssertOp(IRDLOperation):
    """`tsr.device_assert`: every element of the bool tensor `cond` must hold, else the kernel stops
    and reports `message`. No result, and no Pure trait: nothing may drop it as dead."""

    name = "graph.assert"
    cond = operand_def(TensorType)
    message = prop_def(StringAttr)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$cond attr-dict `:` type($cond)"

    def __init__(self, cond: SSAValue, message: str):
        super().__init__(operands=[cond], properties={"message": StringAttr(message)})

    def verify_(self) -> None:
        if tensor_type(self.cond).dtype != dtypes.bool_:
            raise VerifyException(f"assert: the condition must be bool, got {tensor_type(self.cond).dtype}")


#: ops of no operands whose values every kernel makes for itself where it reads them
SOURCE_OPS = (ConstantOp, ArangeOp, DimSizeOp)

STRUCTURAL_OPS = [MatmulOp, TransposeOp, ReshapeOp, ReduceOp, SoftmaxOp, LayerNormOp, RmsNormOp, NormStatisticOp,
                  ArangeOp, DimSizeOp, ConstantOp, CastOp, SliceOp, ConcatOp, GatherOp, AssertOp]

Graph = Dialect("graph", [*ELEMENTWISE_OPS.values(), *STRUCTURAL_OPS], [TensorType])
