"""Generating tile code for fused Graph IR ops.

Every kernel template (elementwise, row reduction, gemm, flash attention) has
the same problem: evaluate some graph values on a tile of an iteration space.
This module solves it once.

* An *index map* says, for each dim of a graph value, which iteration axis it
  walks (or `None` when the dim has size 1 and broadcasts). Maps flow from a
  template's roots back through elementwise broadcasting, transposes and
  unsqueezes as the emitter recurses, so `k.transpose(-2, -1)` is a load with
  swapped tile dims, never a copy, and `i[:, None] >= i[None, :]` reads one
  `arange` along two different axes.
* A `TileCtx` says which axes the tile spans (with their offsets and sizes)
  and which are single indices (batch dims, from the program id).
* `Emitter.value(v, map, ctx)` returns `v` as a register tile spanning all of the
  context's tiled axes, computed in f32 (i32 for ints, i1 for bools): group
  inputs become `tile.load`s, `arange` becomes `tile.arange`, elementwise ops
  become `arith`/`math` ops.

Every op built for a graph op carries that op's provenance (`Builder.origin`): its source line
and profile regions, for line info and profiling (`tessera.ir.provenance`).
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Callable, Sequence

from xdsl.dialects import arith, math
from xdsl.dialects.builtin import FloatAttr, IndexType, IntegerAttr, TensorType, UnitAttr, f32, i1, i32
from xdsl.ir import Attribute, Block, Operation, SSAValue

from ..errors import TesseraError
from ..ir import graph as g
from ..ir.index_maps import Map, operand_maps
from ..ir import provenance
from ..ir import tile as t



@dataclass
class TileCtx:
    """The tile being computed: `tiled` axes (name -> (offset, size)) in tile order, and `scalars`."""

    tiled: dict[str, tuple[SSAValue, int]]
    scalars: dict[str, SSAValue] = field(default_factory=dict)

    @property
    def shape(self) -> list[int]:
        return [size for _, size in self.tiled.values()]


class Builder:
    """Appends ops to the innermost open block, stamped with the innermost `origin`'s provenance."""

    def __init__(self, block: Block):
        self.blocks = [block]
        self.origins: list[dict[str, Attribute]] = []

    def __call__(self, op) -> SSAValue:
        if self.origins:
            op.attributes = {**self.origins[-1], **op.attributes}
        self.blocks[-1].add_op(op)
        return op.results[0] if op.results else None

    @contextlib.contextmanager
    def origin(self, graph_op: Operation, regions: bool = True) -> Iterator[None]:
        """Ops built inside come from `graph_op`: they carry its source line and (unless `regions`
        is False) its profile regions; what it lacks they inherit from the enclosing origin."""
        inherited = self.origins[-1] if self.origins else {}
        self.origins.append({**inherited, **provenance.provenance(graph_op, regions)})
        try:
            yield
        finally:
            self.origins.pop()

    def index(self, value: int) -> SSAValue:
        """A constant index; of a dynamic dim's stand-in, `DynamicDim` (a template that needs its value)."""
        return self(arith.ConstantOp(IntegerAttr(operator.index(value), IndexType())))

    def f32(self, value: float) -> SSAValue:
        return self(arith.ConstantOp(FloatAttr(value, f32)))

    def i32(self, value: int) -> SSAValue:
        return self(arith.ConstantOp(IntegerAttr(value, i32)))

    def splat(self, scalar: SSAValue, shape: Sequence[int]) -> SSAValue:
        return self(t.BroadcastOp(scalar, (), shape))

    def full(self, value: float, shape: Sequence[int]) -> SSAValue:
        return self.splat(self.f32(value), shape)


def compare(b: Builder, x: SSAValue, y: SSAValue, predicate: str) -> SSAValue:
    """`arith.cmpf`/`arith.cmpi` on tiles (the tile dialect's tensor-typed versions)."""
    cls = t.CmpfOp if x.type.get_element_type() == f32 else t.CmpiOp
    return b(cls(x, y, predicate))


def select(b: Builder, cond: SSAValue, x: SSAValue, y: SSAValue) -> SSAValue:
    return b(t.SelectOp(cond, x, y))


# --- compute types -------------------------------------------------------------------

def compute_element(dt) -> Attribute:
    """Registers hold f32 for every float dtype, i32 for ints, i1 for bools."""
    return f32 if dt.is_float else (i1 if dt.bits == 1 else i32)


def to_compute(b: Builder, v: SSAValue, dt) -> SSAValue:
    """Widens a loaded tile to its compute type."""
    if dt.is_float and v.type.get_element_type() != f32:
        return b(arith.ExtFOp(v, TensorType(f32, v.type.get_shape())))
    return v


def to_storage(b: Builder, v: SSAValue, dt, in_range: bool = False) -> SSAValue:
    """Rounds a compute tile to a dtype's storage type (for stores and tensor-core operands);
    `in_range`: the caller knows every value is finite in that type (`tile.IN_RANGE`)."""
    target = g.element_type(dt)
    if v.type.get_element_type() == target:
        return v
    if isinstance(v.owner, arith.ExtFOp) and v.owner.input.type.get_element_type() == target:
        return v.owner.input     # (a value widened and narrowed back is itself: a copy moves bits)
    shape = v.type.get_shape()
    narrowed = b(arith.TruncFOp(v, TensorType(target, shape)))
    if in_range:
        narrowed.owner.attributes[t.IN_RANGE] = UnitAttr()
    return narrowed


def convert(b: Builder, v: SSAValue, want: Attribute) -> SSAValue:
    """Converts a compute tile between f32 / i32 / i1."""
    have = v.type.get_element_type()
    if have == want:
        return v
    shape = v.type.get_shape()
    if have == i1:
        one, zero = (b.f32(1.0), b.f32(0.0)) if want == f32 else (b.i32(1), b.i32(0))
        return select(b, v, b.splat(one, shape), b.splat(zero, shape))
    if want == i1:
        zero = b.splat(b.f32(0.0) if have == f32 else b.i32(0), shape)
        return compare(b, v, zero, "une" if have == f32 else "ne")
    return b((t.SIToFPOp if want == f32 else t.FPToSIOp)(v, want))


# --- elementwise op table ----------------------------------------------------------------

def _float_or_int(fop, iop):
    def build(b: Builder, x, y):
        return b(fop(x, y) if x.type.get_element_type() == f32 else iop(x, y))
    return build


def _unary_math(op):
    return lambda b, x: b(op(x))


def _neg(b: Builder, x):
    if x.type.get_element_type() == f32:
        return b(arith.NegfOp(x))
    return b(arith.SubiOp(b.splat(b.i32(0), x.type.get_shape()), x))


def _abs(b: Builder, x):
    return b(math.AbsFOp(x) if x.type.get_element_type() == f32 else math.AbsIOp(x))


#: an arith.divf the backends may compute approximately, flushing subnormals (PTX div.approx.ftz: a
#: reciprocal on the MUFU unit and a multiply; 2 ulp for denominators in [2^-126, 2^126], 0 for larger
#: ones; CUDA Tile IR's divf with approx rounding and flush_to_zero)
APPROXIMATE = arith.FastMathFlagsAttr(["afn"])


#: math functions with a fast hardware approximation -> its relative error, in bits (PTX ISA:
#: tanh.approx.f32, 2^-10.987 at most). A graph op whose result's dtype rounds at least
#: `APPROXIMATION_MARGIN` bits coarser takes it (`approximate`): bf16 (2^-8 relative), not fp16
#: (2^-11). Its error then stays a quarter of the rounding the graph itself asks for, even where a
#: cancellation magnifies both: tanh's gradient 1 - y^2 near saturation (|x| = 4: 1.3e-3), which fp16
#: would get 70% wrong where its own rounding of y gives 35%.
APPROXIMATION_BITS = {"tanh": 10.987}
APPROXIMATION_MARGIN = 2


def approximate(kind: str, dt) -> bool:
    """Whether elementwise `kind` computing a `dt` result may use its fast approximation
    (`APPROXIMATION_BITS`): its math op is then marked `afn`, which a backend with the instruction
    takes (PTX tanh.approx.f32: one MUFU op an element, where the accurate tanh takes ex2, rcp and
    five more; a soft-capped attention evaluates one a score, forward and backward). A gelu's tanh
    computes in fp32 (`ops._in_fp32`), so it stays accurate."""
    return kind in APPROXIMATION_BITS and dt.is_float and \
        dt.significand_bits - 1 + APPROXIMATION_MARGIN <= APPROXIMATION_BITS[kind]


def _sigmoid(b: Builder, x):
    """1 / (1 + exp(-x)). The denominator is at least 1 (or inf, whose quotient 0 is sigmoid's limit),
    so its division is approximate: an IEEE division is a dozen instructions and a slow-path branch
    an element, and its temporaries spilled a 256-column GEMM epilogue (silu)."""
    one = b.splat(b.f32(1.0), x.type.get_shape())
    denominator = b(arith.AddfOp(one, b(math.ExpOp(b(arith.NegfOp(x))))))
    return b(arith.DivfOp(one, denominator, APPROXIMATE))


def _floor_divide(b: Builder, x, y):
    """Python's and torch's `//`: the quotient rounded down (towards -inf, not towards zero)."""
    if x.type.get_element_type() == f32:
        return _float_division(b, x, y)[0]
    return b(arith.FloorDivSIOp(x, y))


def _remainder(b: Builder, x, y):
    """Python's and torch's `%`: x - (x // y) * y, so the sign follows the divisor's."""
    if x.type.get_element_type() == f32:
        return _float_division(b, x, y)[1]
    q = _floor_divide(b, x, y)
    return b(arith.SubiOp(x, b(arith.MuliOp(q, y))))


def _float_division(b: Builder, x, y) -> tuple[SSAValue, SSAValue]:
    """(x // y, x % y) of floats as torch computes them, from the exact remainder of C's fmod
    (`tile.RemFOp`): r = fmod(x, y), moved by y where its sign is not the divisor's; q = (x - r) / y
    (x - fmod(x, y) is a multiple of y), one less where r moved, then the nearest integer below
    (above where the quotient rounded more than half below one), a zero quotient signed as x / y.
    By zero, x // 0 is x / 0. So 1.0 // 0.1 is 9 (1 / 0.1 rounds to 10), 1e-8 % -1.5 is -1.5, 7 %
    inf is 7 and -7 % inf inf, an infinite x gives NaN, and quotients past 2^24 stay exact: 1e9 %
    3.3 is 1.3496 (x - floor(x / y) * y gave 7.95)."""
    shape = x.type.get_shape()
    zero, one, half = (b.full(v, shape) for v in (0.0, 1.0, 0.5))
    r = b(t.RemFOp(x, y))
    q = b(arith.DivfOp(b(arith.SubfOp(x, r)), y))
    moved = b(arith.AndIOp(compare(b, r, zero, "one"),
                           b(arith.XOrIOp(compare(b, y, zero, "olt"), compare(b, r, zero, "olt")))))
    r = select(b, moved, b(arith.AddfOp(r, y)), r)
    q = select(b, moved, b(arith.SubfOp(q, one)), q)
    floor = b(math.FloorOp(q))
    floor = select(b, compare(b, b(arith.SubfOp(q, floor)), half, "ogt"), b(arith.AddfOp(floor, one)), floor)
    signed_zero = b(arith.MulfOp(b(arith.DivfOp(x, y)), zero))   # (finite there: |x| < |y|)
    q = select(b, compare(b, q, zero, "une"), floor, signed_zero)
    q = select(b, compare(b, y, zero, "oeq"), b(arith.DivfOp(x, y)), q)
    return q, r


def _int_pow(b: Builder, x, y):
    """x ** y of int32 tiles as torch's integer pow (`graph._pow`): by squaring, over the exponent's
    bits (those of a constant exponent only), wrapping as int32 does; for a negative exponent 1
    for x = 1, +-1 for x = -1, else 0."""
    shape = x.type.get_shape()

    def c(v: int):
        return b.splat(b.i32(v), shape)
    known = splat_constant(y)
    width = 31 if known is None else max(known, 0).bit_length()
    result, base = c(1), x
    for i in range(width):
        if known is None:
            bit_set = compare(b, b(arith.AndIOp(y, c(1 << i))), c(0), "ne")
            result = select(b, bit_set, b(arith.MuliOp(result, base)), result)
        elif known >> i & 1:
            result = b(arith.MuliOp(result, base))
        if i + 1 < width:
            base = b(arith.MuliOp(base, base))
    if known is not None and known >= 0:
        return result
    odd = compare(b, b(arith.AndIOp(y, c(1))), c(0), "ne")
    negative = select(b, compare(b, x, c(1), "eq"), c(1),
                      select(b, compare(b, x, c(-1), "eq"), select(b, odd, c(-1), c(1)), c(0)))
    return select(b, compare(b, y, c(0), "slt"), negative, result)


def splat_constant(v: SSAValue) -> float | int | None:
    """The value of a tile that is a constant broadcast (a scale, an exponent), else None."""
    op = v.owner
    if isinstance(op, t.BroadcastOp) and isinstance(op.x.owner, arith.ConstantOp):
        return op.x.owner.value.value.data
    return None


def _compare(fpred: str, ipred: str):
    def build(b: Builder, x, y):
        return compare(b, x, y, fpred if x.type.get_element_type() == f32 else ipred)
    return build


def _logical_not(b: Builder, x):
    return b(arith.XOrIOp(x, b.splat(b(arith.ConstantOp(IntegerAttr(1, i1))), x.type.get_shape())))


#: graph elementwise op -> builder on compute tiles (operands already converted)
ELEMENTWISE: dict[str, Callable] = {
    "neg": _neg,
    "abs": _abs,
    "exp": _unary_math(math.ExpOp),
    "exp2": _unary_math(math.Exp2Op),
    "log": _unary_math(math.LogOp),
    "log2": _unary_math(math.Log2Op),
    "tanh": _unary_math(math.TanhOp),
    "sigmoid": _sigmoid,
    "sqrt": _unary_math(math.SqrtOp),
    "rsqrt": _unary_math(math.RsqrtOp),
    "sin": _unary_math(math.SinOp),
    "cos": _unary_math(math.CosOp),
    "erf": _unary_math(math.ErfOp),
    "logical_not": _logical_not,
    "add": _float_or_int(arith.AddfOp, arith.AddiOp),
    "sub": _float_or_int(arith.SubfOp, arith.SubiOp),
    "mul": _float_or_int(arith.MulfOp, arith.MuliOp),
    "div": lambda b, x, y: b(arith.DivfOp(x, y)),
    "maximum": _float_or_int(arith.MaximumfOp, arith.MaxSIOp),
    "minimum": _float_or_int(arith.MinimumfOp, arith.MinSIOp),
    "pow": lambda b, x, y: b(math.PowFOp(x, y)) if x.type.get_element_type() == f32 else _int_pow(b, x, y),
    "floor_divide": _floor_divide,
    "remainder": _remainder,
    "lt": _compare("olt", "slt"),
    "le": _compare("ole", "sle"),
    "gt": _compare("ogt", "sgt"),
    "ge": _compare("oge", "sge"),
    "eq": _compare("oeq", "eq"),
    "ne": _compare("une", "ne"),
    "logical_and": lambda b, x, y: b(arith.AndIOp(x, y)),
    "logical_or": lambda b, x, y: b(arith.OrIOp(x, y)),
    "where": select,
}


#: the smallest and largest normal f32 magnitudes (a folded constant outside them is not folded)
F32_TINY, F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e+38


def scalar_constant(v: SSAValue) -> float | None:
    """The value of a rank-0 float `graph.constant` (a scale), else None."""
    op = v.owner
    if isinstance(op, g.ConstantOp) and not g.tensor_type(v).shape and g.tensor_type(v).dtype.is_float:
        return float(op.value.value.data)
    return None


def operand_compute_type(op: g.ElementwiseOp) -> Attribute:
    """The type an elementwise op computes in: its result's, or for comparisons its operands'.
    Arithmetic on bools (`a + b`, `maximum`, `a < b`) computes on 0/1 in i32, as NumPy's and torch's
    do; the i1 result is the i32 one compared with zero wherever it is converted or stored."""
    entry = g.ELEMENTWISE[op.kind]
    operand_dts = [g.tensor_type(v).dtype for v in op.inputs]
    if entry.result == "bool" and op.kind not in ("logical_and", "logical_or", "logical_not"):
        promoted = operand_dts[0]
        for d in operand_dts[1:]:
            promoted = g.dtypes.promote(promoted, d)
        element = compute_element(promoted)
    else:
        element = compute_element(g.tensor_type(op.res).dtype)
    return i32 if element == i1 else element


# --- the emitter ---------------------------------------------------------------------------

class Emitter:
    """Emits graph values as register tiles inside one tile kernel."""

    def __init__(self, b: Builder, params: dict[SSAValue, SSAValue], bindings):
        self.b = b
        self.params = params          # group block argument -> kernel memref parameter
        self.bindings = bindings
        self.overrides: dict[SSAValue, SSAValue] = {}
        #: a dim's size as the kernel sees it, an int or (dynamic) read at run time from a buffer of
        #: that dim: its builder's (`schedule_to_tile.KernelBuild.extent`)
        self.extent: Callable[[str], int | SSAValue] | None = None
        self._memo: dict = {}
        self._contexts: dict = {}     # shifted tile contexts of slices and concatenations
        #: `where` ops whose condition holds on every element of the tile being emitted (a mask that
        #: cuts none of a block: `schedule_to_tile.lower_flash_chain`): each is its kept operand
        self.kept_wheres: frozenset[Operation] = frozenset()

    def value(self, v: SSAValue, m: Map, ctx: TileCtx) -> SSAValue:
        """`v` (whose dims walk the axes in `m`) as a compute tile over `ctx`."""
        if v in self.overrides:
            return self.overrides[v]
        key = (v, m, id(ctx))
        if key not in self._memo:
            self._memo[key] = self._emit(v, m, ctx)
        return self._memo[key]

    def provide(self, v: SSAValue, m: Map, ctx: TileCtx, tile: SSAValue) -> None:
        """`tile` is `v` (whose dims walk `m`) over `ctx`, computed already (a load issued ahead)."""
        self._memo[(v, m, id(ctx))] = tile

    def forget_erased(self) -> None:
        """Drops memoized tiles whose ops a lowering erased (after folding them into others)."""
        self._memo = {k: v for k, v in self._memo.items()
                      if not (isinstance(v.owner, Operation) and v.owner.parent is None)}

    def _emit(self, v: SSAValue, m: Map, ctx: TileCtx) -> SSAValue:
        if v in self.params:
            return self.load(v, m, ctx)
        op = v.owner
        # constants and aranges are built wherever they are first read, so they lend no region
        with self.b.origin(op, regions=not isinstance(op, g.SOURCE_OPS)):
            return self._emit_op(op, v, m, ctx)

    def _emit_op(self, op: Operation, v: SSAValue, m: Map, ctx: TileCtx) -> SSAValue:
        dt = g.tensor_type(v).dtype
        if isinstance(op, g.ConstantOp):
            return self._constant(op.value.value.data, dt, ctx.shape)
        if isinstance(op, g.ArangeOp):
            return self._arange(m[0], ctx)
        if isinstance(op, g.DimSizeOp):
            return self.b.splat(self.b(arith.IndexCastOp(self.dim_size(op.dim.data), i32)), ctx.shape)
        if isinstance(op, g.SliceOp):
            return self.value(op.input, *self._sliced(op, m, ctx))
        if isinstance(op, g.ConcatOp):
            return self._concat(op, m, ctx)
        if isinstance(op, g.GatherOp):
            return self._gather(op, m, ctx)
        if op in self.kept_wheres:
            kept = self.value(op.inputs[1], operand_maps(op, m, self.bindings)[1], ctx)
            return convert(self.b, kept, compute_element(dt))
        if isinstance(op, g.ElementwiseOp) and op.kind == "mul" and (folded := self._folded_product(op, m, ctx)):
            return folded
        operands = [self.value(x, xm, ctx) for x, xm in zip(op.operands, operand_maps(op, m, self.bindings))]
        if isinstance(op, (g.TransposeOp, g.ReshapeOp)):
            return operands[0]
        if isinstance(op, g.CastOp):
            if not self._rounds(op):   # (a widening cast, or a gradient's storage cast: rounded where stored)
                return convert(self.b, operands[0], compute_element(dt))
            return self._cast(operands[0], g.tensor_type(op.input).dtype, dt)
        if isinstance(op, g.ElementwiseOp):
            want = operand_compute_type(op)
            args = operands
            if op.kind == "where":
                result_t = compute_element(dt)
                args = [convert(self.b, args[0], i1)] + [convert(self.b, a, result_t) for a in args[1:]]
            elif op.kind in ("logical_and", "logical_or", "logical_not"):
                args = [convert(self.b, a, i1) for a in args]
            else:
                args = [convert(self.b, a, want) for a in args]
            result = ELEMENTWISE[op.kind](self.b, *args)
            if approximate(op.kind, dt):
                result.owner.properties["fastmath"] = APPROXIMATE
            return result
        raise TesseraError(f"{op.name} cannot be computed inside a fused elementwise region")

    def _folded_product(self, op: g.ElementwiseOp, m: Map, ctx: TileCtx) -> SSAValue | None:
        """`(x * c1) * c2`, both constants scalars, as `x * (c1 c2)` (the product rounded once to
        f32), where the result's dtype is a float far coarser than f32 (bf16, fp16, fp8), whose graph
        rounds `x * c1` anyway: attention's `q @ k^T * (1 / sqrt(d))` scaled again by a soft-cap's
        `1 / cap` took two multiplies a score, forward and backward (ptxas keeps both: IEEE)."""
        if not (g.tensor_type(op.res).dtype.is_float and g.tensor_type(op.res).dtype.significand_bits < 24):
            return None
        maps = operand_maps(op, m, self.bindings)
        for i in (0, 1):
            c2, inner, inner_map = scalar_constant(op.inputs[i]), op.inputs[1 - i], maps[1 - i]
            if c2 is None:
                continue
            while isinstance(inner.owner, g.CastOp) and inner not in self.overrides \
                    and g.tensor_type(inner.owner.input).dtype.is_float and not self._rounds(inner.owner):
                inner = inner.owner.input   # (a widening cast: the same f32 value)
            inner_op = inner.owner
            if inner in self.overrides or not (
                    isinstance(inner_op, g.ElementwiseOp) and inner_op.kind == "mul"
                    and g.tensor_type(inner).dtype.is_float):
                return None
            inner_maps = operand_maps(inner_op, inner_map, self.bindings)
            for j in (0, 1):
                c1 = scalar_constant(inner_op.inputs[j])
                product = c1 * c2 if c1 is not None else 0.0
                if product != 0.0 and F32_TINY <= abs(product) <= F32_MAX:
                    x = convert(self.b, self.value(inner_op.inputs[1 - j], inner_maps[1 - j], ctx), f32)
                    return self.b(arith.MulfOp(x, self.b.full(product, ctx.shape)))
            return None
        return None

    @staticmethod
    def _rounds(op: g.CastOp) -> bool:
        """Whether a cast's value in a kernel is more than its operand's converted to the compute
        type (`_cast`): a cast to a float narrower than f32 rounds, unless it is a storage cast."""
        dst = g.tensor_type(op.res).dtype
        return op.rounds_inside_kernels and not (dst.is_float and dst.bits >= 32)

    def _shifted(self, ctx: TileCtx, shifts: dict, fixed: dict, clamp: dict | None = None) -> TileCtx:
        """`ctx` with axis a's index moved by shifts[a] (tiles start there, scalars are there) and
        the new scalar axes in `fixed` (name -> index); a shifted scalar axis in `clamp` (name ->
        extent) stays inside [0, extent), as the tile it picks is then unused. Built once per
        (ctx, shifts): the tiles computed in it are memoized by its identity."""
        key = (id(ctx), tuple(sorted(shifts.items())), tuple(sorted(fixed.items())),
               tuple(sorted((clamp or {}).items())))
        if key not in self._contexts:
            def moved(index, by, axis):
                index = self.b(arith.AddiOp(index, self.b.index(by))) if by else index
                if clamp and axis in clamp:
                    index = self.b(arith.MaxSIOp(index, self.b.index(0)))
                    index = self.b(arith.MinSIOp(index, self.b.index(clamp[axis] - 1)))
                return index
            tiled = {a: (moved(o, shifts.get(a, 0), None), n) for a, (o, n) in ctx.tiled.items()}
            scalars = {a: moved(i, shifts.get(a, 0), a) for a, i in ctx.scalars.items()}
            scalars.update({a: self.b.index(i) for a, i in fixed.items()})
            self._contexts[key] = (ctx, TileCtx(tiled, scalars))   # (keeps ctx, so its id stays unique)
        return self._contexts[key][1]

    def _sliced(self, op: g.SliceOp, m: Map, ctx: TileCtx) -> tuple[Map, TileCtx]:
        """The map and context a slice's operand is read in: each sliced axis starts `start` further
        on; a dim the result has only one element of (so no axis) reads the fixed index `start`."""
        src = [g.dim_value(d, self.bindings) for d in g.tensor_type(op.input).shape]
        inner, shifts, fixed = list(m), {}, {}
        for d, (axis, start) in enumerate(zip(m, op.offsets)):
            if axis is None and src[d] != 1:
                inner[d] = f"slice{len(self._contexts)}_{d}"
                fixed[inner[d]] = start
            elif axis is not None and start:
                shifts[axis] = start
        return tuple(inner), self._shifted(ctx, shifts, fixed)

    def _concat(self, op: g.ConcatOp, m: Map, ctx: TileCtx) -> SSAValue:
        """Each element from the input whose range along the axis holds it: every input is read in
        a context shifted back by its start (tiles partly before an input's start load padding,
        scalar indices outside it are clamped), and selects pick by the axis index."""
        axis_dim = op.axis.data
        axis = m[axis_dim]
        sizes = [g.dim_value(g.tensor_type(v).shape[axis_dim], self.bindings) for v in op.inputs]
        element = compute_element(g.tensor_type(op.res).dtype)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if axis is None:   # one element along the axis: it is the first input's with an element
            (first,) = [v for v, n in zip(op.inputs, sizes) if n]
            return convert(self.b, self.value(first, m, ctx), element)
        tiles = [convert(self.b, self.value(v, m, self._shifted(ctx, {axis: -start}, {}, {axis: n})), element)
                 for v, start, n in zip(op.inputs, starts, sizes)]
        index = self._arange(axis, ctx)
        out = tiles[-1]
        for tile, end in reversed(list(zip(tiles[:-1], starts[1:]))):
            below = compare(self.b, index, self.b.splat(self.b.i32(end), ctx.shape), "slt")
            out = select(self.b, below, tile, out)
        return out

    def source(self, v: SSAValue, m: Map, what: str,
               stop: Callable[[Operation], bool] | None = None) -> tuple[SSAValue, Map]:
        """The kernel input `v` views (through transposes and unit reshapes) and its map; `what`
        names `v` in the error where it is computed in the kernel instead. With `stop`, the walk
        ends early at the first view it holds for (its result and map)."""
        while v not in self.params:
            op = v.owner
            if stop is not None and stop(op):
                break
            if not isinstance(op, (g.TransposeOp, g.ReshapeOp)):
                raise TesseraError(f"{what} must be an input (or a view of one), not the result of "
                                   f"{getattr(op, 'name', 'an argument')} inside the same kernel")
            (m,) = operand_maps(op, m, self.bindings)
            v = op.input
        return v, m

    def index_at(self, v: SSAValue, m: Map, ctx: TileCtx, reduce: str | None = None) -> SSAValue:
        """Int tensor `v`'s element at this tile, as an index: each of its dims (walking `m`) a
        program index (a scalar axis, or a tiled one of one element); `v` an input read through
        views (a gather's index, a sequence's length), an `arange` (that index itself) or a
        constant. An offset outside the input (a concatenation's shifted context reads every
        input at every row) is clamped into it: what is read there is not used. With `reduce`
        ("min" or "max"), a dim walking a tiled axis of several elements is read whole (those of
        its elements inside the input) and reduced: a query block's per-row limits."""
        while v not in self.params:
            op = v.owner
            if isinstance(op, g.ArangeOp):
                return self._program_index(m[0], ctx)
            if isinstance(op, g.DimSizeOp):
                return self.dim_size(op.dim.data)
            if isinstance(op, g.ConstantOp) and float(op.value.value.data).is_integer():
                return self.b.index(int(op.value.value.data))
            if not isinstance(op, (g.TransposeOp, g.ReshapeOp)):
                raise TesseraError(f"a tensor read as an index (a gather's rows, a length) must be an input, a view "
                                   f"of one or an arange, not the result of {getattr(op, 'name', 'an argument')} "
                                   f"inside the same kernel")
            (m,) = operand_maps(op, m, self.bindings)
            v = op.input
        memref = self.params[v]
        offsets, run = [], None
        for d, (axis, n) in enumerate(zip(m, memref.type.get_shape())):
            if reduce is not None and axis in ctx.tiled and ctx.tiled[axis][1] > 1:
                run = (d, ctx.tiled[axis][1])   # the tile's offset along it lies inside the input
                offsets.append(ctx.tiled[axis][0])
                continue
            index = self._program_index(axis, ctx)
            if axis is not None:
                extent = self.b(t.DimOp(memref, d)) if n == t.DYNAMIC else self.b.index(n)
                index = self.b(arith.MaxSIOp(self.b(arith.MinSIOp(index, self.b(arith.SubiOp(
                    extent, self.b.index(1))))), self.b.index(0)))
            offsets.append(index)
        if run is not None:
            return self.b(t.LoadIndexReduceOp(memref, offsets, reduce, *run))
        return self.b(t.LoadIndexOp(memref, offsets))

    def dim_size(self, name: str) -> SSAValue:
        """The size of dim `name` as an index (`graph.dim_size`): `extent`'s."""
        n = self.extent(name)
        return self.b.index(n) if isinstance(n, int) else n

    def _program_index(self, axis: str | None, ctx: TileCtx) -> SSAValue:
        """This program's index along `axis`: a scalar axis, or a tiled one of one element."""
        if axis is None:
            return self.b.index(0)
        if axis in ctx.scalars:
            return ctx.scalars[axis]
        if axis in ctx.tiled and ctx.tiled[axis][1] == 1:
            return ctx.tiled[axis][0]
        raise TesseraError(f"a tensor read as an index walks axis {axis} in tiles of {ctx.tiled[axis][1]}: "
                           f"each of its elements must be a program's own (fusion's _gather_blocks)")

    def _gather(self, op: g.GatherOp, m: Map, ctx: TileCtx) -> SSAValue:
        """`input[index]` on the tile: where the tile holds one element along each of the index's
        axes, the tile's row of `input` is one index (`index_at`), which becomes a scalar axis
        along input's first dim; a row outside `input` reads row 0, and the tile is zeros there
        (graph.GatherOp): a scalar offset is never out of bounds. Where it holds several (rows of
        one element of an input, fusion's `_gather_blocks`), each element reads its own
        (`tile.load_gather`)."""
        k = g.tensor_type(op.index).rank
        if any(a in ctx.tiled and ctx.tiled[a][1] > 1 for a in m[:k]):
            return self._gather_elements(op, m, ctx)
        rows = int(g.dim_value(g.tensor_type(op.input).shape[0], self.bindings))   # (a dynamic one: DynamicDim)
        key = ("gather", id(ctx), op, m)
        if key not in self._contexts:   # (keeps ctx, so its id stays unique)
            row, axis = self.index_at(op.index, m[:k], ctx), f"gather{len(self._contexts)}"
            inside = self.b(t.CmpiOp(row, self.b.index(rows), "ult"))
            safe = self.b(t.SelectOp(inside, row, self.b.index(0)))
            self._contexts[key] = (ctx, TileCtx(ctx.tiled, {**ctx.scalars, axis: safe}), inside, axis)
        _, inner, inside, axis = self._contexts[key]
        tile = self.value(op.input, (axis, *m[k:]), inner)
        zeros = self._constant(0, g.tensor_type(op.res).dtype, ctx.shape)
        return select(self.b, self.b.splat(inside, ctx.shape), convert(self.b, tile, zeros.type.get_element_type()), zeros)

    def _gather_elements(self, op: g.GatherOp, m: Map, ctx: TileCtx) -> SSAValue:
        """`input[index]` of rows of one element, an element a row of the index tile."""
        k, rows_axis = g.tensor_type(op.index).rank, "gathered rows"
        src, src_map = self.source(op.input, (rows_axis,) + (None,) * (g.tensor_type(op.input).rank - 1),
                                   "a tensor whose rows of one element a gather reads an element a row")
        memref = self.params[src]
        tile = self.b(t.LoadGatherOp(memref, self.value(op.index, m[:k], ctx),
                                     [self.b.index(0)] * memref.type.get_num_dims(), src_map.index(rows_axis)))
        return convert(self.b, tile, compute_element(g.tensor_type(op.res).dtype))

    def _constant(self, value: float, dt, shape) -> SSAValue:
        element = compute_element(dt)
        if element == f32:
            scalar = self.b.f32(value)
        else:
            scalar = self.b(arith.ConstantOp(IntegerAttr(int(value), element)))
        return self.b.splat(scalar, shape)

    def _cast(self, x: SSAValue, src, dst) -> SSAValue:
        """A cast rounds like the reference: through the destination's storage type."""
        x = convert(self.b, x, compute_element(dst))
        if dst.is_float and dst.bits < 32:
            x = to_compute(self.b, to_storage(self.b, x, dst), dst)
        return x

    def _arange(self, axis, ctx: TileCtx) -> SSAValue:
        shape = ctx.shape
        if axis in ctx.tiled:
            offset, size = ctx.tiled[axis]
            r = self.b(t.ArangeOp(offset, size))
            return self.b(t.BroadcastOp(r, (list(ctx.tiled).index(axis),), shape))
        index = ctx.scalars[axis] if axis in ctx.scalars else self.b.index(0)
        return self.b.splat(self.b(arith.IndexCastOp(index, i32)), shape)

    def access(self, m: Map, ctx: TileCtx) -> tuple[list[SSAValue], list[int], list[int]]:
        """Offsets, tile dims and the tiled-axis positions they cover, for a tensor with map `m`."""
        offsets, tile_dims, covered = [], [], []
        zero = None
        for axis in ctx.tiled:
            if axis in m:
                tile_dims.append(m.index(axis))
                covered.append(list(ctx.tiled).index(axis))
        for d, axis in enumerate(m):
            if axis in ctx.tiled:
                offsets.append(ctx.tiled[axis][0])
            elif axis in ctx.scalars:
                offsets.append(ctx.scalars[axis])
            else:
                zero = zero or self.b.index(0)
                offsets.append(zero)
        return offsets, tile_dims, covered

    def load(self, v: SSAValue, m: Map, ctx: TileCtx, padding: float = 0.0) -> SSAValue:
        offsets, tile_dims, covered = self.access(m, ctx)
        sizes = [ctx.shape[c] for c in covered]
        tile = self.b(t.LoadOp(self.params[v], offsets, tile_dims, sizes, padding))
        tile = to_compute(self.b, tile, g.tensor_type(v).dtype)
        if len(covered) == len(ctx.tiled):
            return tile
        return self.b(t.BroadcastOp(tile, covered, ctx.shape))

    def inside(self, m: Map, ctx: TileCtx, sizes: Sequence[int]) -> SSAValue | None:
        """i1 tile: which elements of the tile lie inside a tensor of `sizes` whose dims walk `m`;
        None when every tile does (tiles start at multiples of their size, as every template's do)."""
        inside = None
        for pos, (axis, (offset, size)) in enumerate(ctx.tiled.items()):
            if axis not in m or sizes[m.index(axis)] % size == 0:
                continue
            index = self.b(t.ArangeOp(offset, size))
            below = compare(self.b, index, self.b.splat(self.b.i32(sizes[m.index(axis)]), [size]), "slt")
            ok = below if len(ctx.tiled) == 1 else self.b(t.BroadcastOp(below, (pos,), ctx.shape))
            inside = ok if inside is None else self.b(arith.AndIOp(inside, ok))
        return inside

    def check(self, op: g.AssertOp, m: Map, ctx: TileCtx) -> None:
        """`op`'s condition on the tile (its dims walking `m`) as a tile.assert; elements outside the
        tensor (a tail tile's padding) hold."""
        with self.b.origin(op):
            ok = convert(self.b, self.value(op.cond, m, ctx), i1)
            inside = self.inside(m, ctx, [g.dim_value(d, self.bindings) for d in g.tensor_type(op.cond).shape])
            if inside is not None:
                holds = self.b.splat(self.b(arith.ConstantOp(IntegerAttr(1, i1))), ctx.shape)
                ok = select(self.b, inside, ok, holds)
            self.b(t.AssertOp(ok, op.message.data))

    def store(self, tile: SSAValue, dst: SSAValue, dst_map: Map, ctx: TileCtx, dt) -> None:
        offsets, tile_dims, _ = self.access(dst_map, ctx)
        value = convert(self.b, tile, compute_element(dt))
        self.b(t.StoreOp(to_storage(self.b, value, dt), dst, offsets, tile_dims))

