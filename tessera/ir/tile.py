"""The `tile` dialect: Tessera's block-level program IR (see docs/IR.md, "Tile IR").

A `tile.kernel` is the program one thread block runs for one program id of its
grid; its values are register tiles (builtin `tensor`), scalars, global tensors
(builtin `memref`) and shared-memory buffers (`memref<..., 3>`).  Elementwise
math stays in `arith`/`math` and loops in `scf`, so only what those dialects
cannot say lives here: moving tiles between memories, tensor-core products,
reductions/broadcasts, program ids and the host-side launch.

Conventions fixed by this module (the lowering and the interpreter rely on them):
- integer properties (`axis`, `pending`, `num_warps`, `num_stages`) are
  `IntegerAttr` of type i64;
- integer lists (`tile_dims`, `dims`, `grid`) are `DenseArrayBase` of i64,
  printed `array<i64: 0, 1>`; `tile.launch`'s `grid` always has 3 entries;
- `padding` is an f64 `FloatAttr` whatever the element type (it is converted on
  load, so -inf pads a max-reduction and 0 pads a sum);
- `transpose_a` / `transpose_b` are optional `UnitAttr`s: present means A is K x M / B is N x K
  (each tile as its operand is stored: the copy into shared memory never transposes).

xDSL 0.74 types arith.cmpi/cmpf/select/sitofp/fptosi as scalar-only; the
tensor-capable `CmpiOp`, `CmpfOp`, `SelectOp`, `SIToFPOp`, `FPToSIOp` below are
the same ops with MLIR's typing, registered by `tile_context` in their place.

Every op has a custom assembly format; `print_module` and `parse_tile_module`
round-trip it exactly.
"""
from __future__ import annotations

import math as pymath

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects import arith, math
from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    DenseArrayBase,
    ArrayAttr,
    DictionaryAttr,
    f32,
    f64,
    FloatAttr,
    FunctionType,
    i1,
    I64,
    i32,
    i64,
    IndexType,
    IntegerAttr,
    MemRefType,
    ModuleOp,
    StridedLayoutAttr,
    StringAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
)
from xdsl.ir import Attribute, Block, Dialect, Operation, Region, SSAValue
from xdsl.irdl import (
    AnyAttr,
    IRDLOperation,
    ParsePropInAttrDict,
    VarConstraint,
    base,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import (
    HasParent,
    IsolatedFromAbove,
    IsTerminator,
    Pure,
    SymbolOpInterface,
    SymbolTable,
)
from xdsl.utils.exceptions import VerifyException

from ..runtime.interop import c_strides

SHARED_SPACE = IntegerAttr(3, i64)
"""`memref` memory space of shared-memory buffers (as in NVVM: 3 = shared)."""

REDUCE_KINDS = ("sum", "max", "min")

Value = SSAValue | Operation


# ---------------------------------------------------------------- attribute helpers


def _i64(value: int | IntegerAttr) -> IntegerAttr:
    return value if isinstance(value, IntegerAttr) else IntegerAttr(value, i64)


def _i64_array(values: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, tuple(values))


@dataclass(frozen=True)
class GridDim:
    """A grid axis that grows with a dim taken at run time: `factor` * cdiv(size of dim `dim` of
    the kernel's argument `arg`, `block`) programs (a lowering returns one in place of an int)."""

    arg: int
    dim: int
    block: int
    factor: int = 1


def split_grid(grid: Sequence[int | GridDim]) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """(the constant part of each grid axis, the (axis, arg, dim, block) terms of the dynamic ones)."""
    constants, terms = [], []
    for axis, g in enumerate(grid):
        if isinstance(g, GridDim):
            constants.append(g.factor)
            terms.append((axis, g.arg, g.dim, g.block))
        else:
            constants.append(g)
    return constants, terms


def grid_dims_attr(terms) -> DenseArrayBase:
    return _i64_array([x for term in terms for x in term])


def grid_terms(attr: DenseArrayBase | None) -> tuple[tuple[int, int, int, int], ...]:
    values = () if attr is None else int_values(attr)
    return tuple(tuple(values[i:i + 4]) for i in range(0, len(values), 4))


def int_values(attr: DenseArrayBase) -> tuple[int, ...]:
    """The ints of an i64 array property (`tile_dims`, `dims`, `grid`)."""
    return tuple(attr.get_values())


def shared_memref(shape: Sequence[int], element_type: Attribute) -> MemRefType:
    """The type of a shared-memory buffer: a static memref in memory space 3."""
    return MemRefType(element_type, shape, memory_space=SHARED_SPACE)


def is_shared(t: Attribute) -> bool:
    return isinstance(t, MemRefType) and t.memory_space == SHARED_SPACE


def _fmt(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def static_shape(t: Attribute) -> tuple[int, ...]:
    """Static shape of a tensor/memref type; () for a scalar."""
    return t.get_shape() if isinstance(t, TensorType | MemRefType) else ()


def _element_type(t: Attribute) -> Attribute:
    return t.get_element_type() if isinstance(t, TensorType | MemRefType) else t


def _require(cond: bool, op: Operation, message: str) -> None:
    if not cond:
        raise VerifyException(f"'{op.name}': {message}")


def _require_static(op: Operation, what: str, t: Attribute) -> None:
    _require(all(d >= 0 for d in static_shape(t)), op, f"{what} must have a static shape, got {t}")


#: a memref dim whose size the kernel takes at run time (`?` in the text; `tessera.dims`)
DYNAMIC = DYNAMIC_INDEX
#: on a kernel over dynamic dims: the width of its element offsets, 32 or 64 (`tessera.dims.index_bits`;
#: `reach` is unknown where a dim is)
INDEX_BITS = "tessera.index_bits"
#: the names of buffers' dynamic dims (one a buffer), which the host binds per call from the arguments' shapes:
#: on a host function, an array of one string per argument ("" where none is dynamic); on a
#: `tile.alloc_global`, a string; on a kernel, an array over its first params (one size param a
#: name: buffers of one dim share it, and the bounds checks of their accesses)
BUFFER_DIMS = "tessera.buffer_dims"


def is_dynamic_memref(t: Attribute) -> bool:
    return isinstance(t, MemRefType) and DYNAMIC in t.get_shape()


def symbolic_shape(t: MemRefType, name: str) -> tuple[int | str, ...]:
    """A global buffer's shape with its dynamic dim as `name` (`BUFFER_DIMS`), which a call binds
    from its arguments' shapes (`tessera.dims.bind_shapes`)."""
    return tuple(name if n == DYNAMIC else n for n in t.get_shape())


def _require_global_shape(op: Operation, what: str, t: Attribute) -> None:
    """A global tensor's shape: static, but for one dim of dynamic size (`?`) of a contiguous layout
    (a strided layout keeps its strides as constants; a contiguous one's grow with the dim)."""
    dynamic = static_shape(t).count(DYNAMIC)
    _require(dynamic == 0 or (dynamic == 1 and not is_strided(t)), op,
             f"{what} must have a static shape but for one dynamic dim of a contiguous layout, got {t}")


def _require_tile_dims(op: Operation, tile_dims: Sequence[int], rank: int, tile_rank: int,
                       tile_what: str) -> None:
    """Shared by load/store/copy_async: tile_dims names distinct memref dims, one per tile dim."""
    _require(len(tile_dims) == tile_rank, op,
             f"tile_dims {list(tile_dims)} has {len(tile_dims)} entries but {tile_what} has rank {tile_rank}")
    _require(len(set(tile_dims)) == len(tile_dims), op, f"tile_dims {list(tile_dims)} are not distinct")
    bad = [d for d in tile_dims if not 0 <= d < rank]
    _require(not bad, op, f"tile_dims {list(tile_dims)}: {bad} out of range for a rank-{rank} memref")


def _require_offsets(op: Operation, offsets: Sequence[SSAValue], memref_type: MemRefType) -> None:
    rank = memref_type.get_num_dims()
    _require(len(offsets) == rank, op,
             f"{len(offsets)} offsets given for rank-{rank} memref {memref_type}; need one per dim")


def _require_same_element(op: Operation, a_what: str, a: Attribute, b_what: str, b: Attribute) -> None:
    ea, eb = _element_type(a), _element_type(b)
    _require(ea == eb, op, f"{a_what} element type {ea} differs from {b_what} element type {eb}")


# ---------------------------------------------------------------- kernel structure


@irdl_op_definition
class KernelOp(IRDLOperation):
    """A block program; its entry block's arguments are the kernel parameters."""

    name = "tile.kernel"

    body = region_def("single_block")
    sym_name = prop_def(StringAttr)
    function_type = prop_def(FunctionType)
    num_warps = prop_def(IntegerAttr)
    num_stages = prop_def(IntegerAttr)

    traits = traits_def(IsolatedFromAbove(), SymbolOpInterface())

    _PROPS: ClassVar = ("num_warps", "num_stages")

    def __init__(self, name: str, function_type: FunctionType, body: Region, num_warps: int | IntegerAttr,
                 num_stages: int | IntegerAttr, attributes: dict[str, Attribute] | None = None):
        super().__init__(
            properties={"sym_name": StringAttr(name), "function_type": function_type,
                        "num_warps": _i64(num_warps), "num_stages": _i64(num_stages)},
            regions=[body], attributes=attributes)

    @classmethod
    def build_kernel(cls, name: str, arg_types: Sequence[Attribute], num_warps: int = 4,
                     num_stages: int = 2) -> KernelOp:
        """A kernel with an empty entry block whose arguments have `arg_types`; fill
        `op.body.block` and end it with `ReturnOp()`."""
        return cls(name, FunctionType.from_lists(arg_types, []), Region(Block(arg_types=arg_types)),
                   num_warps, num_stages)

    def verify_(self) -> None:
        inputs = self.function_type.inputs.data
        _require(not self.function_type.outputs.data, self,
                 f"kernel @{self.sym_name.data} must not return values (outputs are written to memrefs)")
        _require(tuple(self.body.block.arg_types) == inputs, self,
                 f"kernel @{self.sym_name.data}: block arguments {list(map(str, self.body.block.arg_types))} "
                 f"differ from function_type inputs {list(map(str, inputs))}")
        _require(self.num_warps.value.data > 0, self, f"num_warps must be positive, got {self.num_warps.value.data}")
        _require(self.num_stages.value.data > 0, self,
                 f"num_stages must be positive, got {self.num_stages.value.data}")

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_symbol_name(self.sym_name.data)
        with printer.in_parens():
            printer.print_list(self.body.block.args, printer.print_block_argument)
        printer.print_op_attributes({"num_warps": self.num_warps, "num_stages": self.num_stages}
                                    | dict(self.attributes), print_keyword=True)
        printer.print_string(" ")
        printer.print_region(self.body, print_entry_block_args=False)

    @classmethod
    def parse(cls, parser: Parser) -> KernelOp:
        name = parser.parse_symbol_name().data
        args = parser.parse_comma_separated_list(Parser.Delimiter.PAREN, parser.parse_argument)
        attrs = dict((parser.parse_optional_attr_dict_with_keyword() or DictionaryAttr({})).data)
        missing = [p for p in cls._PROPS if p not in attrs]
        if missing:
            parser.raise_error(f"tile.kernel @{name} needs {', '.join(missing)} in its attributes")
        num_warps, num_stages = (attrs.pop(p) for p in cls._PROPS)
        body = parser.parse_region(args)
        return cls(name, FunctionType.from_lists([a.type for a in args], []), body, num_warps, num_stages, attrs)


#: A tile.kernel attribute: warps added to the kernel's `num_warps` that only issue its copies (a
#: warp-specialized kernel, on a target whose copies are asynchronous bulk copies); one warpgroup.
PRODUCER_WARPS = "producer_warps"
WARPGROUP_WARPS = 4
#: An arith.truncf attribute: its input is within the finite range of the narrower type, which a
#: template knows and a backend cannot see; the backend may convert with saturation, which then
#: never applies (PTX: one `cvt.rn.satfinite` an fp8 element, without the overflow check a cast
#: otherwise needs to give NaN as torch does). Attention's probabilities, cast for P @ V, are
#: 2^(s c - m c) with the row max's product m c rounded: at most 2^(half its ulp), which is 1 for
#: |m c| < 2^24 and stays below e4m3's 448 up to about 1.5e8, where float32 scores have long lost
#: the softmax's precision.
IN_RANGE = "tessera.in_range"
#: A tile.kernel attribute: the blocks per SM its schedule asks for (its `occupancy` param): a hint
#: to tileiras, and to ptxas the registers that many blocks need at most (`.minnctapersm`).
OCCUPANCY = "tessera.occupancy"
#: A tile.kernel attribute: the blocks of one thread-block cluster, consecutive along grid axis 0
#: (whose size is then a multiple of it); they exchange values through distributed shared memory
#: (`ClusterGatherOp`), or take shared tiles copied once for all of them (`CopyAsyncOp`'s
#: `cluster_shared`). A row kernel splits a long row across them, a GEMM gives them consecutive tile
#: rows of one tile column (the `cluster` param of each).
CLUSTER = "tessera.cluster"
#: tile.kernel attributes: the backend that compiles it (`tessera.backends.BACKENDS`) and the rule
#: or option that chose it, its schedule.kernel's `backend` and `backend_why`. The Target IR lowers
#: the "ptx" ones and leaves the others as they are.
BACKEND = "tessera.backend"
BACKEND_WHY = "tessera.backend_why"


def kernel_backend(kernel) -> str:
    """The backend of a tile.kernel (`BACKEND`; a kernel without one is the PTX backend's)."""
    attr = kernel.attributes.get(BACKEND)
    return attr.data if attr is not None else "ptx"


def kernels_of(module, backend: str) -> list:
    """The tile.kernels of `module` that `backend` compiles, in the module's order."""
    return [op for op in module.ops if isinstance(op, KernelOp) and kernel_backend(op) == backend]
#: A host function attribute: {argument name: why it is copied to a contiguous buffer first}, for
#: each argument passed strided that the kernels cannot address in place; the runtime copies them.
COPIED_ARGS = "tessera.copied_args"


def is_strided(t: Attribute) -> bool:
    """Whether a global memref has a layout of its own (`strided<[...]>`), not the row-major default."""
    return isinstance(t, MemRefType) and isinstance(t.layout, StridedLayoutAttr)


def element_strides(t: MemRefType) -> tuple[int, ...]:
    """A memref's element strides: its layout's, or row-major's (the default layout); of a dim
    before a dynamic one, not a constant (`stride_factors`)."""
    strides = tuple(t.get_strides())
    if None in strides:
        raise ValueError(f"{t}: the strides of the dims before its dynamic dim are taken at run time")
    return strides


def stride_factors(t: MemRefType) -> tuple[int, ...]:
    """Per dim, a constant its element stride is a multiple of: the stride where it is a constant,
    else (a dim before a dynamic one, whose stride is the product of the dims after it) the product
    of the static dims after it. What an alignment check needs."""
    if DYNAMIC not in t.get_shape():
        return element_strides(t)
    return c_strides([1 if n == DYNAMIC else n for n in t.get_shape()])


def strides_problem(strides: Sequence[int]) -> str | None:
    """Why kernels cannot address a tensor with these element strides in place (None: they
    can): its innermost dim must be contiguous, and no stride negative."""
    if strides and strides[-1] != 1:
        return f"its innermost dim has stride {strides[-1]}, not 1"
    negative = [d for d, st in enumerate(strides) if st < 0]
    return f"dim {negative[0]} has a negative stride" if negative else None


def rows_aligned(t: MemRefType, elements: int) -> bool:
    """Whether every row of a memref starts at a multiple of `elements` from its base: every
    stride but the innermost is a multiple (with the row-major layout, its last dim's length is)."""
    return all(st % elements == 0 for st in stride_factors(t)[:-1])


def reach(t: MemRefType, index_bits: int = 64) -> int:
    """How many elements from its base a memref's addressing spans: its element count when
    contiguous, more when strided (what decides whether 32-bit offsets reach every element). Of
    a dynamic dim's memref, what the kernel's `INDEX_BITS` promise: under 2^31, or anything."""
    shape = t.get_shape()
    if 0 in shape:
        return 0
    if DYNAMIC in shape:
        return 2 ** 31 - 1 if index_bits == 32 else 2 ** 62
    return 1 + sum((n - 1) * st for n, st in zip(shape, element_strides(t)))


@irdl_op_definition
class ReturnOp(IRDLOperation):
    """Ends a kernel."""

    name = "tile.return"
    traits = traits_def(IsTerminator(), HasParent(KernelOp))
    assembly_format = "attr-dict"

    def __init__(self):
        super().__init__()


@irdl_op_definition
class ProgramIdOp(IRDLOperation):
    """This program's coordinate along grid axis 0, 1 or 2."""

    name = "tile.program_id"
    axis = prop_def(IntegerAttr)
    result = result_def(IndexType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "attr-dict"

    def __init__(self, axis: int):
        super().__init__(properties={"axis": _i64(axis)}, result_types=[IndexType()])

    def verify_(self) -> None:
        axis = self.axis.value.data
        _require(axis in (0, 1, 2), self, f"axis must be 0, 1 or 2, got {axis}")


@irdl_op_definition
class DimOp(IRDLOperation):
    """The size of dim `axis` of a kernel's global memref, a dim it takes at run time (`?`)."""

    name = "tile.dim"
    source = operand_def(MemRefType)
    axis = prop_def(IntegerAttr)
    result = result_def(IndexType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$source attr-dict `:` type($source)"

    def __init__(self, source: Value, axis: int):
        super().__init__(operands=[source], properties={"axis": _i64(axis)}, result_types=[IndexType()])

    def verify_(self) -> None:
        t, axis = self.source.type, self.axis.value.data
        _require(not is_shared(t) and 0 <= axis < t.get_num_dims() and t.get_shape()[axis] == DYNAMIC, self,
                 f"axis {axis} of {t} is not a dynamic dim of a global memref")


# ---------------------------------------------------------------- global memory


@irdl_op_definition
class LoadOp(IRDLOperation):
    """Reads a register tile from a global memref; out-of-bounds elements read `padding`."""

    name = "tile.load"
    src = operand_def(MemRefType)
    offsets = var_operand_def(IndexType)
    tile_dims = prop_def(DenseArrayBase)
    padding = prop_def(FloatAttr, default_value=FloatAttr(0.0, f64))
    result = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$src `[` $offsets `]` attr-dict `:` type($src) `->` type($result)"

    def __init__(self, src: Value, offsets: Sequence[Value], tile_dims: Sequence[int],
                 result_shape: Sequence[int], padding: float = 0.0):
        element = SSAValue.get(src).type.get_element_type()
        super().__init__(
            operands=[src, offsets],
            properties={"tile_dims": _i64_array(tile_dims), "padding": FloatAttr(padding, f64)},
            result_types=[TensorType(element, result_shape)])

    def verify_(self) -> None:
        src_t, res_t = self.src.type, self.result.type
        _require_global_shape(self, "source memref", src_t)
        _require_static(self, "result tile", res_t)
        _require(not is_shared(src_t), self, "source must be a global memref; use tile.load_shared for shared memory")
        _require_offsets(self, self.offsets, src_t)
        _require_tile_dims(self, int_values(self.tile_dims), src_t.get_num_dims(), res_t.get_num_dims(),
                           f"result tile {res_t}")
        _require_same_element(self, "source", src_t, "result", res_t)


def _require_index_source(op: Operation) -> None:
    """`op.src` holds indices in global memory and `op.offsets` place one element of it."""
    src_t = op.src.type
    _require_global_shape(op, "source memref", src_t)
    _require(not is_shared(src_t), op, "source must be a global memref")
    _require(_element_type(src_t) == i32, op, f"source must hold i32 indices, got {src_t}")
    _require_offsets(op, op.offsets, src_t)


@irdl_op_definition
class LoadIndexOp(IRDLOperation):
    """One int32 element of a global memref as an index, uniform over the program: a gather's row
    (a block table's page), a sequence's length bounding a key loop. Its offsets lie inside `src`,
    as every scalar offset does; what the element may be (a row outside the gathered tensor) is
    the reader's to check, in ops a dump shows."""

    name = "tile.load_index"
    src = operand_def(MemRefType)
    offsets = var_operand_def(IndexType)
    result = result_def(IndexType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$src `[` $offsets `]` attr-dict `:` type($src)"

    def __init__(self, src: Value, offsets: Sequence[Value]):
        super().__init__(operands=[src, offsets], result_types=[IndexType()])

    def verify_(self) -> None:
        _require_index_source(self)


@irdl_op_definition
class LoadIndexReduceOp(IRDLOperation):
    """The min or max (`kind`) of `count` consecutive int32 elements of a global memref along dim
    `axis`, from `offsets` (those past the dim's end not read), as an index uniform over the
    program: the extreme of a query block's per-row limits (each packed sequence's first and last
    key, varlen attention), which bounds its key loop. The offset along `axis` lies inside `src`."""

    name = "tile.load_index_reduce"
    src = operand_def(MemRefType)
    offsets = var_operand_def(IndexType)
    kind = prop_def(StringAttr)
    axis = prop_def(IntegerAttr)
    count = prop_def(IntegerAttr)
    result = result_def(IndexType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$src `[` $offsets `]` attr-dict `:` type($src)"

    def __init__(self, src: Value, offsets: Sequence[Value], kind: str, axis: int, count: int):
        super().__init__(operands=[src, offsets], result_types=[IndexType()],
                         properties={"kind": StringAttr(kind), "axis": _i64(axis), "count": _i64(count)})

    def verify_(self) -> None:
        src_t, axis = self.src.type, self.axis.value.data
        _require_index_source(self)
        _require(self.kind.data in ("min", "max"), self, f"kind must be min or max, got {self.kind.data!r}")
        _require(0 <= axis < src_t.get_num_dims(), self, f"axis {axis} out of range for {src_t}")
        _require(self.count.value.data >= 1, self, f"count must be positive, got {self.count.value.data}")


@irdl_op_definition
class LoadGatherOp(IRDLOperation):
    """A register tile of single elements of a global memref picked by a tile of indices: element i
    is `src[offsets]` with the offset along dim `axis` replaced by `index[i]`, and 0 where that lies
    outside [0, size of `axis`) (graph.gather of rows of one element: each packed query's sequence's
    first key, `cu_seqlens[seq]`). The other offsets lie inside `src`."""

    name = "tile.load_gather"
    src = operand_def(MemRefType)
    index = operand_def(TensorType)
    offsets = var_operand_def(IndexType)
    axis = prop_def(IntegerAttr)
    result = result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = ("$src `[` $offsets `]` `rows` $index attr-dict `:` type($src) `,` type($index) `->` "
                       "type($result)")

    def __init__(self, src: Value, index: Value, offsets: Sequence[Value], axis: int):
        shape = SSAValue.get(index).type.get_shape()
        super().__init__(operands=[src, index, offsets], properties={"axis": _i64(axis)},
                         result_types=[TensorType(SSAValue.get(src).type.get_element_type(), shape)])

    def verify_(self) -> None:
        src_t, index_t, axis = self.src.type, self.index.type, self.axis.value.data
        _require_global_shape(self, "source memref", src_t)
        _require(not is_shared(src_t), self, "source must be a global memref")
        _require_offsets(self, self.offsets, src_t)
        _require(0 <= axis < src_t.get_num_dims(), self, f"axis {axis} out of range for {src_t}")
        _require(index_t.get_element_type() == i32, self, f"index must be an i32 tile, got {index_t}")
        _require(self.result.type.get_shape() == index_t.get_shape(), self,
                 f"result {self.result.type} must have the index's shape {_fmt(index_t.get_shape())}")
        _require_same_element(self, "source", src_t, "result", self.result.type)


#: the ops that read indices from memory into scalars: page tables, lengths, per-row limits
INDEX_READS = (LoadIndexOp, LoadIndexReduceOp)


class _TileWrite(IRDLOperation):
    """A register tile written into a global memref at `offsets` (its in-bounds part)."""

    value = operand_def(TensorType)
    dst = operand_def(MemRefType)
    offsets = var_operand_def(IndexType)
    tile_dims = prop_def(DenseArrayBase)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$value `,` $dst `[` $offsets `]` attr-dict `:` type($value) `,` type($dst)"
    WHAT: ClassVar[str] = "stored tile"   # (verifier messages name the tile so)

    def __init__(self, value: Value, dst: Value, offsets: Sequence[Value], tile_dims: Sequence[int]):
        super().__init__(operands=[value, dst, offsets], properties={"tile_dims": _i64_array(tile_dims)})

    def verify_(self) -> None:
        val_t, dst_t = self.value.type, self.dst.type
        _require_global_shape(self, "destination memref", dst_t)
        _require_static(self, self.WHAT, val_t)
        _require(not is_shared(dst_t), self, "destination must be a global memref, not shared memory")
        _require_offsets(self, self.offsets, dst_t)
        _require_tile_dims(self, int_values(self.tile_dims), dst_t.get_num_dims(), val_t.get_num_dims(),
                           f"{self.WHAT} {val_t}")
        _require_same_element(self, self.WHAT, val_t, "destination", dst_t)


@irdl_op_definition
class StoreOp(_TileWrite):
    """Writes the in-bounds part of a register tile to a global memref."""

    name = "tile.store"


@irdl_op_definition
class AtomicAddOp(_TileWrite):
    """Adds the in-bounds part of an fp32 register tile to a global memref, element by element and
    atomically: programs of one launch may add to the same elements (a flash_chain kernel's dQ,
    summed over its key blocks' programs). The sums' order is the hardware's, so their last bits
    may differ from run to run."""

    name = "tile.atomic_add"
    WHAT: ClassVar[str] = "added tile"

    def verify_(self) -> None:
        super().verify_()
        _require(self.dst.type.get_element_type() == f32, self,
                 f"destination {self.dst.type} must hold f32 (atomic sums)")


@irdl_op_definition
class AllocGlobalOp(IRDLOperation):
    """Host side: a global intermediate buffer (its contents start undefined)."""

    name = "tile.alloc_global"
    result = result_def(MemRefType)
    assembly_format = "attr-dict `:` type($result)"

    def __init__(self, shape: Sequence[int], element_type: Attribute):
        super().__init__(result_types=[MemRefType(element_type, shape)])

    def verify_(self) -> None:
        _require_global_shape(self, "result", self.result.type)
        _require(not is_shared(self.result.type), self, "global buffers cannot live in shared memory (space 3)")


@irdl_op_definition
class ViewOp(IRDLOperation):
    """Host side: the same contiguous buffer seen with another shape (a reshape that
    merges or splits dims costs no copy and no kernel)."""

    name = "tile.view"
    source = operand_def(MemRefType)
    result = result_def(MemRefType)
    assembly_format = "$source attr-dict `:` type($source) `->` type($result)"

    def __init__(self, source: Value, shape: Sequence[int]):
        src_t = SSAValue.get(source).type
        super().__init__(operands=[source], result_types=[MemRefType(src_t.get_element_type(), shape)])

    def verify_(self) -> None:
        src_t, res_t = self.source.type, self.result.type
        _require_global_shape(self, "source", src_t)
        _require_global_shape(self, "result", res_t)
        _require_same_element(self, "source", src_t, "result", res_t)
        _require(not is_strided(src_t), self, f"a view needs a contiguous source, not {src_t}")
        dynamic = [is_dynamic_memref(t) for t in (src_t, res_t)]
        _require(dynamic[0] == dynamic[1], self, f"a view of {src_t} as {res_t}: both or neither have a dynamic dim")
        n_src, n_res = (pymath.prod(t.get_shape()[dynamic[0]:]) for t in (src_t, res_t))
        _require(n_src == n_res, self, f"a view of {_fmt(src_t.get_shape())} ({n_src} elements) cannot have "
                                       f"shape {_fmt(res_t.get_shape())} ({n_res} elements)")


# ---------------------------------------------------------------- shared memory and async copies


@irdl_op_definition
class AllocSharedOp(IRDLOperation):
    """A shared-memory buffer; its leading dim indexes pipeline stages."""

    name = "tile.alloc_shared"
    result = result_def(MemRefType)
    assembly_format = "attr-dict `:` type($result)"

    def __init__(self, shape: Sequence[int], element_type: Attribute):
        super().__init__(result_types=[shared_memref(shape, element_type)])

    def verify_(self) -> None:
        t = self.result.type
        _require(is_shared(t), self, f"result {t} must be in shared memory space 3")
        _require_static(self, "result", t)
        _require(t.get_num_dims() >= 2, self, f"result {t} needs a stage dim plus at least one tile dim")


@irdl_op_definition
class CopyAsyncOp(IRDLOperation):
    """Starts copying a tile of global `src` into stage `stage` of shared `dst`: the whole stage,
    or with `dst_rows` = [start, count] its rows start .. start + count - 1 (a stage filled by
    several copies: a paged KV cache's key block, a page a copy). `whole`: along every tile dim
    taken at run time, the compile promises a size that the tile's extent divides (its class's
    multiple: `dims.whole_if_relied_on`), so a tile at a multiple of its extent is wholly inside
    the source or wholly past its end, and one check decides the copy. `cluster_shared`: every
    block of the kernel's cluster (`CLUSTER`) copies the same tile at the same step into the same
    stage (a GEMM's B tile, shared by the cluster's tile rows), so a backend may copy it once for
    them all (TMA multicast); a backend that does not copies it in each block, as without it."""

    name = "tile.copy_async"
    src = operand_def(MemRefType)
    dst = operand_def(MemRefType)
    stage = operand_def(IndexType)
    offsets = var_operand_def(IndexType)
    tile_dims = prop_def(DenseArrayBase)
    padding = prop_def(FloatAttr, default_value=FloatAttr(0.0, f64))
    dst_rows = opt_prop_def(DenseArrayBase)
    whole = opt_prop_def(UnitAttr)
    cluster_shared = opt_prop_def(UnitAttr)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = ("$src `[` $offsets `]` `,` $dst `[` $stage `]` attr-dict "
                       "`:` type($src) `,` type($dst)")

    def __init__(self, src: Value, dst: Value, stage: Value, offsets: Sequence[Value],
                 tile_dims: Sequence[int], padding: float = 0.0, dst_rows: tuple[int, int] | None = None,
                 whole: bool = False, cluster_shared: bool = False):
        properties = {"tile_dims": _i64_array(tile_dims), "padding": FloatAttr(padding, f64)}
        if dst_rows is not None:
            properties["dst_rows"] = _i64_array(dst_rows)
        if whole:
            properties["whole"] = UnitAttr()
        if cluster_shared:
            properties["cluster_shared"] = UnitAttr()
        super().__init__(operands=[src, dst, stage, offsets], properties=properties)

    @property
    def rows(self) -> tuple[int, int]:
        """(first row, rows) of the stage the copy fills."""
        if self.dst_rows is None:
            return 0, self.dst.type.get_shape()[1]
        start, count = int_values(self.dst_rows)
        return start, count

    @property
    def tile_shape(self) -> list[int]:
        return [self.rows[1], *self.dst.type.get_shape()[2:]]

    def verify_(self) -> None:
        src_t, dst_t = self.src.type, self.dst.type
        _require_global_shape(self, "source memref", src_t)
        _require(not is_shared(src_t), self, "source must be a global memref")
        _require(is_shared(dst_t), self, f"destination {dst_t} must be in shared memory space 3")
        _require_offsets(self, self.offsets, src_t)
        start, count = self.rows
        _require(self.dst_rows is None or (len(int_values(self.dst_rows)) == 2 and start >= 0 and count > 0
                                           and start + count <= dst_t.get_shape()[1]), self,
                 f"dst_rows {list(int_values(self.dst_rows or _i64_array([])))} must be [start, count] inside a "
                 f"stage of {dst_t}")
        _require_tile_dims(self, int_values(self.tile_dims), src_t.get_num_dims(), len(self.tile_shape),
                           f"the copied part of a stage of {dst_t} ({_fmt(self.tile_shape)})")
        _require_same_element(self, "source", src_t, "destination", dst_t)


@irdl_op_definition
class AsyncCommitOp(IRDLOperation):
    """Closes the current group of async copies."""

    name = "tile.async_commit"
    assembly_format = "attr-dict"

    def __init__(self):
        super().__init__()


class _WaitOp(IRDLOperation):
    """A wait until at most `pending` groups of some asynchronous work are still in flight."""

    pending = prop_def(IntegerAttr)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "attr-dict"

    def __init__(self, pending: int = 0):
        super().__init__(properties={"pending": _i64(pending)})

    def verify_(self) -> None:
        _require(self.pending.value.data >= 0, self, f"pending must be >= 0, got {self.pending.value.data}")


@irdl_op_definition
class AsyncWaitOp(_WaitOp):
    """Waits until at most `pending` committed groups of async copies are in flight."""

    name = "tile.async_wait"


@irdl_op_definition
class MmaWaitOp(_WaitOp):
    """Waits until at most `pending` issued `tile.mma`s are still running. Where a matrix unit
    runs mmas asynchronously (wgmma), an mma's operands stay in use and its result is not
    ready until a wait covers it; elsewhere mmas finish when issued and this is a no-op.
    Templates put one after an mma they overlap with the next step's, and `pending = 0`
    before the accumulator is read."""

    name = "tile.mma_wait"


#: what a `tile.mma_turn` does: wait for this warpgroup's turn, or pass it on
MMA_TURN_ACTIONS = ("take", "give")


@irdl_op_definition
class MmaTurnOp(IRDLOperation):
    """`tile.mma_turn take` / `give` [`warpgroup = w`]: the warpgroups computing a block take
    turns issuing their mmas (FlashAttention-3's ping-pong), so that one's softmax runs while the
    other's mmas do rather than all of them contending for the matrix unit at once. `take` waits
    for this warpgroup's turn, `give` passes it to the next warpgroup; with `warpgroup = w` only
    warpgroup w gives (the first turn, before any take, and the last one, which the next
    warpgroup does not take). Each give must meet its take. An order of issue only, no value
    depends on it: where mmas do not run asynchronously, or no producer warps leave the computing
    warpgroups free of block barriers, it goes (`tessera.lowering.async_pipelines`)."""

    name = "tile.mma_turn"
    action = prop_def(StringAttr)
    warpgroup = opt_prop_def(IntegerAttr[I64])
    assembly_format = "$action (`warpgroup` `=` $warpgroup^)? attr-dict"

    def __init__(self, action: str, warpgroup: int | None = None):
        props = {"action": StringAttr(action)}
        if warpgroup is not None:
            props["warpgroup"] = _i64(warpgroup)
        super().__init__(properties=props)

    def verify_(self) -> None:
        _require(self.action.data in MMA_TURN_ACTIONS, self, f"action must be one of {MMA_TURN_ACTIONS}")
        _require(self.warpgroup is None or self.action.data == "give", self, "only a give names its warpgroup")


@irdl_op_definition
class BarrierOp(IRDLOperation):
    """Block-wide barrier (makes finished shared-memory writes visible to all threads)."""

    name = "tile.barrier"
    assembly_format = "attr-dict"

    def __init__(self):
        super().__init__()


@irdl_op_definition
class ReleaseStageOp(IRDLOperation):
    """`tile.release_stage %buf[%stage]`: every thread of the block is done reading stage `stage`
    of the pipeline that fills shared buffer `buf` (a `tile.barrier` before it says so). Where the
    blocks of a cluster fill the pipeline's stages together (a `CopyAsyncOp` `cluster_shared`), a
    copy into a stage waits until every block of the cluster has released it once more than it
    was filled before; elsewhere the barrier says all there is to say and the op goes."""

    name = "tile.release_stage"
    buf = operand_def(MemRefType)
    stage = operand_def(IndexType)
    assembly_format = "$buf `[` $stage `]` attr-dict `:` type($buf)"

    def __init__(self, buf: Value, stage: Value):
        super().__init__(operands=[buf, stage])

    def verify_(self) -> None:
        _require(is_shared(self.buf.type), self, f"buffer {self.buf.type} must be in shared memory space 3")


#: ops that read a shared stage themselves (an mma through its fragments, wgmma through a
#: descriptor): a `tile.load_shared` that only these read moves nothing into registers by itself
SHARED_TILE_READERS = frozenset({"tile.mma", "tessera_target.tensor_core", "tessera_target.wgmma_descriptor"})


@irdl_op_definition
class LoadSharedOp(IRDLOperation):
    """Reads stage `stage` of a shared buffer into a register tile: for the mmas that read it
    (`SHARED_TILE_READERS`), or, `into_registers`, for ops computing on it (a row walk's rows)."""

    name = "tile.load_shared"
    src = operand_def(MemRefType)
    stage = operand_def(IndexType)
    result = result_def(TensorType)
    assembly_format = "$src `[` $stage `]` attr-dict `:` type($src) `->` type($result)"

    def __init__(self, src: Value, stage: Value):
        src_t = SSAValue.get(src).type
        super().__init__(operands=[src, stage],
                         result_types=[TensorType(src_t.get_element_type(), src_t.get_shape()[1:])])

    @property
    def into_registers(self) -> bool:
        """Whether ops computing in registers read the tile, not only mmas (`SHARED_TILE_READERS`)."""
        return any(use.operation.name not in SHARED_TILE_READERS for use in self.result.uses)

    def verify_(self) -> None:
        src_t, res_t = self.src.type, self.result.type
        _require(is_shared(src_t), self, f"source {src_t} must be in shared memory space 3")
        stage_shape = src_t.get_shape()[1:]
        _require(res_t.get_shape() == stage_shape, self,
                 f"result shape {_fmt(res_t.get_shape())} differs from one stage of {src_t} ({_fmt(stage_shape)})")
        _require_same_element(self, "source", src_t, "result", res_t)


@irdl_op_definition
class StoreSharedOp(IRDLOperation):
    """Writes a register tile into stage `stage` of a shared buffer (the whole stage), in the
    buffer's layout: a tile computed in registers that an mma then reads from shared memory (a
    flash_chain kernel's dS, the A operand of dQ = dS @ K). Readers wait behind a `tile.barrier`."""

    name = "tile.store_shared"
    value = operand_def(TensorType)
    dst = operand_def(MemRefType)
    stage = operand_def(IndexType)
    assembly_format = "$value `,` $dst `[` $stage `]` attr-dict `:` type($value) `,` type($dst)"

    def __init__(self, value: Value, dst: Value, stage: Value):
        super().__init__(operands=[value, dst, stage])

    def verify_(self) -> None:
        val_t, dst_t = self.value.type, self.dst.type
        _require(is_shared(dst_t), self, f"destination {dst_t} must be in shared memory space 3")
        stage_shape = dst_t.get_shape()[1:]
        _require(val_t.get_shape() == stage_shape, self,
                 f"stored tile {_fmt(val_t.get_shape())} differs from one stage of {dst_t} ({_fmt(stage_shape)})")
        _require_same_element(self, "stored tile", val_t, "destination", dst_t)


# ---------------------------------------------------------------- register-tile compute


@irdl_op_definition
class MmaOp(IRDLOperation):
    """`acc + a @ b` on tensor cores (`a` is K x M when `transpose_a` is set, `b` N x K when
    `transpose_b` is)."""

    name = "tile.mma"
    T: ClassVar = VarConstraint("T", base(TensorType))
    a = operand_def(TensorType)
    b = operand_def(TensorType)
    acc = operand_def(T)
    transpose_a = opt_prop_def(UnitAttr)
    transpose_b = opt_prop_def(UnitAttr)
    result = result_def(T)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$a `,` $b `,` $acc attr-dict `:` type($a) `,` type($b) `,` type($acc)"

    def __init__(self, a: Value, b: Value, acc: Value, transpose_b: bool = False, transpose_a: bool = False):
        acc_t = SSAValue.get(acc).type
        super().__init__(operands=[a, b, acc], properties={"transpose_a": UnitAttr() if transpose_a else None,
                                                           "transpose_b": UnitAttr() if transpose_b else None},
                         result_types=[acc_t])

    @property
    def mnk(self) -> tuple[int, int, int]:
        """(m, n, k) of the product, whatever the operands' storage."""
        (m, k), (_, n) = self.a_shape, self.acc.type.get_shape()
        return m, n, k

    @property
    def a_shape(self) -> tuple[int, int]:
        """A's (rows, cols) as M x K."""
        rows, cols = self.a.type.get_shape()
        return (cols, rows) if self.transpose_a else (rows, cols)

    def verify_(self) -> None:
        a, b, acc = (v.type.get_shape() for v in (self.a, self.b, self.acc))
        _require(len(a) == len(b) == len(acc) == 2, self,
                 f"a, b and acc must be 2-D tiles, got {_fmt(a)}, {_fmt(b)} and {_fmt(acc)}")
        (m, k), (m_acc, n_acc) = (a[::-1] if self.transpose_a else a), acc
        kb, n = (b[1], b[0]) if self.transpose_b else b
        b_layout = "NxK" if self.transpose_b else "KxN"
        _require(k == kb, self, f"a is {_fmt(a)} (MxK, K={k}) but b is {_fmt(b)} ({b_layout}, K={kb})")
        _require((m_acc, n_acc) == (m, n), self, f"acc is {_fmt(acc)} but a @ b is {m}x{n} (MxN)")


@irdl_op_definition
class ReduceOp(IRDLOperation):
    """Sum/max/min of a tile along one axis; the result drops that axis."""

    name = "tile.reduce"
    x = operand_def(TensorType)
    kind = prop_def(StringAttr)
    axis = prop_def(IntegerAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$x attr-dict `:` type($x) `->` type($result)"

    def __init__(self, x: Value, kind: str, axis: int):
        x_t = SSAValue.get(x).type
        shape = x_t.get_shape()
        super().__init__(operands=[x], properties={"kind": StringAttr(kind), "axis": _i64(axis)},
                         result_types=[TensorType(x_t.get_element_type(), shape[:axis] + shape[axis + 1:])])

    def verify_(self) -> None:
        shape, axis, kind = self.x.type.get_shape(), self.axis.value.data, self.kind.data
        _require(kind in REDUCE_KINDS, self, f"kind must be one of {', '.join(REDUCE_KINDS)}, got {kind!r}")
        _require(0 <= axis < len(shape), self, f"axis {axis} out of range for a {_fmt(shape)} tile")
        expect = shape[:axis] + shape[axis + 1:]
        _require(self.result.type.get_shape() == expect, self,
                 f"reducing {_fmt(shape)} over axis {axis} gives {_fmt(expect)}, "
                 f"result is {_fmt(self.result.type.get_shape())}")
        _require_same_element(self, "input", self.x.type, "result", self.result.type)


@irdl_op_definition
class ClusterGatherOp(IRDLOperation):
    """Each 1-D tile operand's value in every block of the kernel's cluster (`CLUSTER` blocks along
    grid axis 0, rank = program id 0 mod the cluster size): the results are operand 0's from ranks
    0, 1, ..., then operand 1's, and so on, the same in every block. The operands are exchanged
    together, in one round. Every block of a cluster executes it the same number of times: a row
    split across a cluster reduces each block's share (`tile.reduce`), gathers the shares'
    statistics and combines them (in rank order: every block computes the same values)."""

    name = "tile.cluster_gather"
    xs = var_operand_def(TensorType)
    gathered = var_result_def(TensorType)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$xs attr-dict `:` type($xs) `->` type($gathered)"

    def __init__(self, xs: Sequence[Value], cluster: int):
        types = [SSAValue.get(x).type for x in xs]
        super().__init__(operands=[list(xs)], result_types=[[ty for ty in types for _ in range(cluster)]])

    @property
    def cluster(self) -> int:
        """The blocks of the cluster (results per operand)."""
        return len(self.gathered) // len(self.xs)

    def of(self, i: int) -> list[SSAValue]:
        """Operand `i`'s values, in rank order."""
        return list(self.gathered)[i * self.cluster:(i + 1) * self.cluster]

    def verify_(self) -> None:
        _require(len(self.xs) > 0 and len(self.gathered) % len(self.xs) == 0, self,
                 f"{len(self.gathered)} results for {len(self.xs)} operands: not a whole cluster's each")
        for i, x in enumerate(self.xs):
            _require(x.type.get_num_dims() == 1, self,
                     f"a cluster gathers 1-D tiles (row statistics), got {_fmt(x.type.get_shape())}")
            _require(all(r.type == x.type for r in self.of(i)), self, f"operand {i}'s results differ from {x.type}")


def cluster_size(kernel) -> int:
    """The blocks of a tile.kernel's cluster (`CLUSTER`), 1 without one."""
    attr = kernel.attributes.get(CLUSTER)
    return attr.value.data if attr is not None else 1


@irdl_op_definition
class BroadcastOp(IRDLOperation):
    """Like `broadcast_in_dim`: input dim i becomes output dim `dims[i]` (size equal or 1)."""

    name = "tile.broadcast"
    x = operand_def(AnyAttr())
    dims = prop_def(DenseArrayBase)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$x attr-dict `:` type($x) `->` type($result)"

    def __init__(self, x: Value, dims: Sequence[int], shape: Sequence[int]):
        element = _element_type(SSAValue.get(x).type)
        super().__init__(operands=[x], properties={"dims": _i64_array(dims)},
                         result_types=[TensorType(element, shape)])

    def verify_(self) -> None:
        _require(not isinstance(self.x.type, MemRefType), self, f"input must be a tile or a scalar, got {self.x.type}")
        in_shape, out_shape, dims = static_shape(self.x.type), self.result.type.get_shape(), int_values(self.dims)
        _require(len(dims) == len(in_shape), self,
                 f"dims {list(dims)} has {len(dims)} entries for a rank-{len(in_shape)} input ({_fmt(in_shape)})")
        _require(all(0 <= d < len(out_shape) for d in dims), self,
                 f"dims {list(dims)} out of range for rank-{len(out_shape)} result {_fmt(out_shape)}")
        _require(all(a < b for a, b in zip(dims, dims[1:])), self, f"dims {list(dims)} must be strictly increasing")
        bad = [(i, s, d) for i, (s, d) in enumerate(zip(in_shape, dims)) if s not in (1, out_shape[d])]
        _require(not bad, self, "; ".join(f"input dim {i} (size {s}) cannot broadcast to result dim {d} "
                                          f"(size {out_shape[d]})" for i, s, d in bad))
        _require_same_element(self, "input", self.x.type, "result", self.result.type)


@irdl_op_definition
class ExtractOp(IRDLOperation):
    """The element of a rank-0 tile as a scalar (MLIR's `tensor.extract` of no index): a value
    uniform over the program, such as a scale read from a one-element tensor, where an op needs
    a scalar (an `scf.if`'s condition)."""

    name = "tile.extract"
    x = operand_def(TensorType)
    result = result_def(AnyAttr())
    traits = traits_def(Pure())
    assembly_format = "$x attr-dict `:` type($x) `->` type($result)"

    def __init__(self, x: Value):
        super().__init__(operands=[x], result_types=[_element_type(SSAValue.get(x).type)])

    def verify_(self) -> None:
        _require(self.x.type.get_num_dims() == 0, self, f"input must be a rank-0 tile, got {self.x.type}")
        _require_same_element(self, "input", self.x.type, "result", self.result.type)


@irdl_op_definition
class ArangeOp(IRDLOperation):
    """`start + [0, 1, ..., N-1]` as a `tensor<Nxi32>`."""

    name = "tile.arange"
    start = operand_def(IndexType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$start attr-dict `:` type($result)"

    def __init__(self, start: Value, length: int):
        super().__init__(operands=[start], result_types=[TensorType(i32, [length])])

    def verify_(self) -> None:
        t = self.result.type
        _require(t.get_num_dims() == 1 and t.get_element_type() == i32, self,
                 f"result must be a 1-D i32 tile, got {t}")


# ---------------------------------------------------------------- debugging


@irdl_op_definition
class AssertOp(IRDLOperation):
    """`tsr.device_assert` in a block: every element of `cond` (an i1 tile, or an i1) must hold, else
    the kernel stops and reports `message`, the op's `tessera.loc` and the block. Not Pure: it is
    never dead code."""

    name = "tile.assert"
    cond = operand_def(AnyAttr())
    message = prop_def(StringAttr)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$cond attr-dict `:` type($cond)"

    def __init__(self, cond: Value, message: str):
        super().__init__(operands=[cond], properties={"message": StringAttr(message)})

    def verify_(self) -> None:
        _require(_element_type(self.cond.type) == i1 and not isinstance(self.cond.type, MemRefType), self,
                 f"condition must be i1 or a tile of i1, got {self.cond.type}")


#: the last dim of a profile buffer: a slot's (begin, end) stamps, each a 64-bit count held in two
#: i32 words, low first (i32: a type every runtime allocates)
PROFILE_WORDS = 4


class _ProfileOp(IRDLOperation):
    """A timestamp of profile region `label`, written by one thread per block into slot `slot` of
    `buffer`, an i32 memref [grid z, grid y, grid x, slots, 4] (`PROFILE_WORDS`;
    `tessera.lowering.profile`)."""

    buffer = operand_def(MemRefType)
    label = prop_def(StringAttr)
    slot = prop_def(IntegerAttr)
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$buffer attr-dict `:` type($buffer)"

    def __init__(self, buffer: Value, label: str, slot: int):
        super().__init__(operands=[buffer], properties={"label": StringAttr(label), "slot": _i64(slot)})

    def verify_(self) -> None:
        t = self.buffer.type
        _require(t.get_element_type() == i32 and t.get_num_dims() == 5 and t.get_shape()[-1] == PROFILE_WORDS,
                 self, f"buffer must be an i32 memref [z, y, x, slots, {PROFILE_WORDS}], got {t}")
        _require(0 <= self.slot.value.data < t.get_shape()[3], self,
                 f"slot {self.slot.value.data} out of range for {t.get_shape()[3]} slots")


@irdl_op_definition
class ProfileBeginOp(_ProfileOp):
    """Stamps the start of region `label` (stamp 0 of its slot)."""

    name = "tile.profile_begin"


@irdl_op_definition
class ProfileEndOp(_ProfileOp):
    """Stamps the end of region `label` (stamp 1 of its slot)."""

    name = "tile.profile_end"


# ---------------------------------------------------------------- host side


@irdl_op_definition
class LaunchOp(IRDLOperation):
    """Host side: runs kernel `@kernel` once per program id of the 3-D `grid`."""

    name = "tile.launch"
    kernel = prop_def(SymbolRefAttr)
    grid = prop_def(DenseArrayBase)
    #: grid axes that grow with dims taken at run time: (axis, arg, dim, block) quadruples, each
    #: multiplying grid axis `axis` by cdiv(size of dim `dim` of argument `arg`, block) (`GridDim`)
    grid_dims = opt_prop_def(DenseArrayBase)
    args = var_operand_def()
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "$kernel `(` $args `)` attr-dict `:` type($args)"

    def __init__(self, kernel: str, grid: Sequence[int | GridDim], args: Sequence[Value]):
        constants, dims = split_grid(grid)
        properties = {"kernel": SymbolRefAttr(kernel), "grid": _i64_array(constants)}
        if dims:
            properties["grid_dims"] = grid_dims_attr(dims)
        super().__init__(operands=[args], properties=properties)

    @property
    def dynamic_grid(self) -> tuple[tuple[int, int, int, int], ...]:
        """The (axis, arg, dim, block) terms of the grid (`grid_dims`)."""
        return grid_terms(self.grid_dims)

    def verify_(self) -> None:
        grid = int_values(self.grid)
        _require(len(grid) == 3 and all(g > 0 for g in grid), self,
                 f"grid must be 3 positive sizes, got {list(grid)}")
        for axis, arg, dim, block in self.dynamic_grid:
            _require(0 <= axis < 3 and 0 <= arg < len(self.args) and block > 0, self,
                     f"grid term ({axis}, {arg}, {dim}, {block}) out of range")
            t = self.args[arg].type
            _require(isinstance(t, MemRefType) and 0 <= dim < t.get_num_dims() and t.get_shape()[dim] == DYNAMIC,
                     self, f"grid term: dim {dim} of argument {arg} ({t}) is not dynamic")
        kernel = SymbolTable.lookup_symbol(self, self.kernel)
        name = self.kernel.string_value()
        _require(isinstance(kernel, KernelOp), self, f"@{name} is not a tile.kernel in this module")
        params = kernel.function_type.inputs.data
        got = tuple(a.type for a in self.args)
        _require(got == params, self, f"@{name} takes ({', '.join(map(str, params))}) "
                                      f"but is launched with ({', '.join(map(str, got))})")


# ---------------------------------------------------------------- arith on tiles
#
# xDSL 0.74 types arith.cmpi/cmpf as returning a scalar i1, arith.select as taking a
# scalar i1 condition, and arith.sitofp/fptosi as scalar-only, although MLIR applies
# all of them elementwise to tensors.  These classes are the same ops (same names and
# text) with MLIR's tensor typing; `tile_context` registers them in place of xDSL's.
# Build tile comparisons, masks and int<->float tile casts with these classes.


def _mask_type(t: Attribute) -> Attribute:
    """i1 shaped like `t` (a tensor of i1 for a tensor, i1 for a scalar)."""
    return TensorType(i1, t.get_shape()) if isinstance(t, TensorType) else i1


def _retyped(t: Attribute, element: Attribute) -> Attribute:
    return TensorType(element, t.get_shape()) if isinstance(t, TensorType) else element


class _TileComparison(arith.ComparisonOperation):
    """cmpi/cmpf with an i1 result shaped like the operands."""

    PREDICATES: ClassVar[list[str]]

    predicate = prop_def(IntegerAttr)
    result = result_def(AnyAttr())

    def _init(self, lhs: Value, rhs: Value, predicate: int | str, properties: dict[str, Attribute]):
        lhs, rhs = SSAValue.get(lhs), SSAValue.get(rhs)
        self._validate_operand_types(lhs, rhs)
        if isinstance(predicate, str):
            _require(predicate in self.PREDICATES, self, f"unknown predicate {predicate!r}")
            predicate = self.PREDICATES.index(predicate)
        IRDLOperation.__init__(self, operands=[lhs, rhs], result_types=[_mask_type(lhs.type)],
                               properties={"predicate": IntegerAttr(predicate, i64)} | properties)

    def verify_(self) -> None:
        expect = _mask_type(self.lhs.type)
        _require(self.result.type == expect, self, f"result type {self.result.type} must be {expect}")

    # MLIR's `$predicate, $lhs, $rhs [flags] attr-dict : type($lhs)`; xDSL's printers drop the attributes
    def print(self, printer: Printer) -> None:
        printer.print_string(f" {self.PREDICATES[self.predicate.value.data]}, ")
        printer.print_list((self.lhs, self.rhs), printer.print_operand)
        self._print_flags(printer)
        printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        printer.print_attribute(self.lhs.type)

    @classmethod
    def parse(cls, parser: Parser) -> _TileComparison:
        predicate = parser.parse_identifier()
        parser.parse_punctuation(",")
        operands = parser.parse_comma_separated_list(Parser.Delimiter.NONE, parser.parse_unresolved_operand)
        flags = cls._parse_flags(parser)
        attrs = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        pos, operand_type = parser.pos, parser.parse_type()
        op = cls(*parser.resolve_operands(operands, [operand_type] * 2, pos), predicate, **flags)
        op.attributes.update(attrs)
        return op

    def _print_flags(self, printer: Printer) -> None:
        pass

    @classmethod
    def _parse_flags(cls, parser: Parser) -> dict[str, Attribute]:
        return {}


@irdl_op_definition
class CmpiOp(_TileComparison):
    """arith.cmpi on scalars or tiles."""

    name = "arith.cmpi"
    PREDICATES: ClassVar = arith.CMPI_COMPARISON_OPERATIONS
    lhs = operand_def(arith.signlessIntegerLike)
    rhs = operand_def(arith.signlessIntegerLike)
    traits = traits_def(Pure())

    def __init__(self, lhs: Value, rhs: Value, predicate: int | str):
        self._init(lhs, rhs, predicate, {})


@irdl_op_definition
class CmpfOp(_TileComparison):
    """arith.cmpf on scalars or tiles."""

    name = "arith.cmpf"
    PREDICATES: ClassVar = arith.CMPF_COMPARISON_OPERATIONS
    lhs = operand_def(arith.floatingPointLike)
    rhs = operand_def(arith.floatingPointLike)
    fastmath = prop_def(arith.FastMathFlagsAttr, default_value=arith.FastMathFlagsAttr("none"))
    traits = traits_def(Pure())

    def __init__(self, lhs: Value, rhs: Value, predicate: int | str,
                 fastmath: arith.FastMathFlagsAttr = arith.FastMathFlagsAttr("none")):
        self._init(lhs, rhs, predicate, {"fastmath": fastmath})

    def _print_flags(self, printer: Printer) -> None:
        if self.fastmath != arith.FastMathFlagsAttr("none"):
            printer.print_string(" fastmath")
            self.fastmath.print_parameter(printer)

    @classmethod
    def _parse_flags(cls, parser: Parser) -> dict[str, Attribute]:
        if parser.parse_optional_keyword("fastmath") is None:
            return {}
        return {"fastmath": arith.FastMathFlagsAttr(arith.FastMathFlagsAttr.parse_parameter(parser))}


@irdl_op_definition
class SelectOp(IRDLOperation):
    """arith.select with a scalar or elementwise (tile of i1) condition.

    Text as in MLIR: `arith.select %c, %a, %b : T` for a scalar condition,
    `arith.select %c, %a, %b : tensor<..xi1>, T` for a mask."""

    name = "arith.select"
    T: ClassVar = VarConstraint("T", AnyAttr())
    cond = operand_def(AnyAttr())
    lhs = operand_def(T)
    rhs = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())

    def __init__(self, cond: Value, lhs: Value, rhs: Value):
        super().__init__(operands=[cond, lhs, rhs], result_types=[SSAValue.get(lhs).type])

    def verify_(self) -> None:
        mask = _mask_type(self.result.type)
        _require(self.cond.type in (i1, mask), self, f"condition type {self.cond.type} must be i1 or {mask}")

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_list((self.cond, self.lhs, self.rhs), printer.print_operand)
        printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        if self.cond.type != i1:
            printer.print_attribute(self.cond.type)
            printer.print_string(", ")
        printer.print_attribute(self.result.type)

    @classmethod
    def parse(cls, parser: Parser) -> SelectOp:
        operands = parser.parse_comma_separated_list(Parser.Delimiter.NONE, parser.parse_unresolved_operand)
        attrs = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        types = parser.parse_comma_separated_list(Parser.Delimiter.NONE, parser.parse_type)
        cond_t, t = types if len(types) == 2 else (i1, types[0])
        op = cls(*parser.resolve_operands(operands, [cond_t, t, t], parser.pos))
        op.attributes.update(attrs)
        return op


class _TileConversion(IRDLOperation):
    """int <-> float conversion of a scalar or, elementwise, of a tile."""

    assembly_format = "$input attr-dict `:` type($input) `to` type($result)"

    def __init__(self, x: Value, target: Attribute):
        """`target` is the result element type (or the whole result type)."""
        x_t = SSAValue.get(x).type
        super().__init__(operands=[x], result_types=[_retyped(x_t, _element_type(target))])

    def verify_(self) -> None:
        _require(static_shape(self.input.type) == static_shape(self.result.type), self,
                 f"input {self.input.type} and result {self.result.type} differ in shape")


@irdl_op_definition
class SIToFPOp(_TileConversion):
    """arith.sitofp on scalars or tiles."""

    name = "arith.sitofp"
    input = operand_def(arith.signlessIntegerLike)
    result = result_def(arith.floatingPointLike)
    traits = traits_def(Pure())


@irdl_op_definition
class FPToSIOp(_TileConversion):
    """arith.fptosi on scalars or tiles (rounds toward zero)."""

    name = "arith.fptosi"
    input = operand_def(arith.floatingPointLike)
    result = result_def(arith.signlessIntegerLike)
    traits = traits_def(Pure())


@irdl_op_definition
class RemFOp(arith.FloatingPointLikeBinaryOperation):
    """arith.remf (MLIR's; xDSL lacks it): C's fmod, x - trunc(x / y) * y computed exactly, the sign
    x's. Float `//` and `%` are built from it (`lowering.emit._float_division`), as torch's are."""

    name = "arith.remf"
    traits = traits_def(Pure())


TILE_ARITH_OPS = (CmpiOp, CmpfOp, SelectOp, SIToFPOp, FPToSIOp, RemFOp)

ArithOnTiles = Dialect(
    "arith",
    [op for op in arith.Arith.operations if op.name not in {t.name for t in TILE_ARITH_OPS}]
    + list(TILE_ARITH_OPS),
    list(arith.Arith.attributes),
)
"""xDSL's arith dialect with the tile-capable ops above in place of its scalar-only ones."""


Tile = Dialect(
    "tile",
    [KernelOp, ReturnOp, ProgramIdOp, DimOp, LoadOp, LoadIndexOp, LoadIndexReduceOp, LoadGatherOp, StoreOp,
     AllocGlobalOp, ViewOp, AllocSharedOp, CopyAsyncOp, AsyncCommitOp, AsyncWaitOp, MmaWaitOp, MmaTurnOp, BarrierOp,
     ReleaseStageOp, LoadSharedOp, StoreSharedOp, AtomicAddOp, MmaOp, ReduceOp, ClusterGatherOp, BroadcastOp,
     ExtractOp, ArangeOp, LaunchOp, AssertOp, ProfileBeginOp, ProfileEndOp],
    [],
)


def tile_context() -> Context:
    """A context that knows every dialect a tile module may contain (and every other level's)."""
    from . import context
    return context()


def parse_tile_module(text: str) -> ModuleOp:
    """Parse a tile module printed by `print_module` (or written by hand)."""
    return Parser(tile_context(), text).parse_module()


def print_module(op: Operation) -> str:
    """MLIR text of `op` in the custom formats; `parse_tile_module` reads it back exactly."""
    from . import print_ir
    return print_ir(op)
