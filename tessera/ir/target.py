"""Target IR: platform-specific kernels, as the xDSL dialect `tessera_target`.

Tile IR says *what* a block computes; Target IR says *which hardware mechanism*
does it on one platform: a `tensor_core "wgmma"` instead of a `tile.mma`, a
`memcpy mechanism = "tma"` instead of a `tile.copy_async`. Every kernel carries
its `#tessera_target.platform<...>` and its launch configuration, and the
verifiers check both against the platform registry (`tessera.platforms`), so
an op the target cannot run (wgmma on sm_80, 200 KB of shared memory on sm_86)
is rejected here, before PTX is written.

Ops print in the seeds' style: a head (symbol, instruction string, operands),
then `keyword = value` properties, then ` : types`, each written as an xDSL
declarative `assembly_format` (one text definition for printer and parser).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects import builtin
from xdsl.dialects.builtin import (
    ArrayAttr,
    DenseArrayBase,
    FloatAttr,
    FunctionType,
    IndexType,
    IntAttr,
    I1,
    I64,
    IntegerAttr,
    MemRefType,
    StringAttr,
    SymbolNameConstraint,
    SymbolRefAttr,
    UnitAttr,
    i1,
    i32,
    i64,
)
from xdsl.ir import (Attribute, Block, BlockArgument, Dialect, Operation, ParametrizedAttribute, Region, SSAValue,
                     TypeAttribute)
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    ParsePropInAttrDict,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.irdl.declarative_assembly_format import (
    CustomDirective,
    ParsingState,
    PrintingState,
    TypeDirective,
    irdl_custom_directive,
)
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.traits import (
    HasAncestor,
    HasParent,
    IsolatedFromAbove,
    IsTerminator,
    NoTerminator,
    SymbolOpInterface,
    SymbolTable,
    SymbolUserOpInterface,
)
from xdsl.utils.exceptions import VerifyException

from .. import dtypes, platforms
from ..runtime.interop import c_strides
from ..platforms import Platform
from .tile import MMA_TURN_ACTIONS

# ---------------------------------------------------------------------------
# Attributes
# ---------------------------------------------------------------------------


@irdl_attr_definition
class PlatformAttr(ParametrizedAttribute):
    """`#tessera_target.platform<"nvidia", "sm_90a", 132>`: vendor, arch, SM count.

    Limits other than the SM count come from the registry row of `arch`.
    """

    name = "tessera_target.platform"
    vendor: StringAttr
    arch: StringAttr
    sm_count: IntAttr

    @staticmethod
    def of(platform: Platform) -> PlatformAttr:
        return PlatformAttr(StringAttr(platform.vendor), StringAttr(platform.arch), IntAttr(platform.sm_count))

    @property
    def platform(self) -> Platform:
        """The registry Platform this attribute names, with its SM count."""
        return dataclasses.replace(platforms.get(self.arch.data), sm_count=self.sm_count.data)

    def verify(self) -> None:
        try:
            known = platforms.get(self.arch.data)
        except platforms.UnknownArchError as e:
            raise VerifyException(str(e)) from None
        if known.vendor != self.vendor.data:
            raise VerifyException(f"{self.arch.data} is an {known.vendor} target, not {self.vendor.data!r}")

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        vendor = StringAttr(parser.parse_str_literal())
        parser.parse_punctuation(",")
        arch = StringAttr(parser.parse_str_literal())
        parser.parse_punctuation(",")
        sm_count = IntAttr(parser.parse_integer())
        parser.parse_punctuation(">")
        return [vendor, arch, sm_count]

    def print_parameters(self, printer) -> None:
        printer.print_string(f'<"{self.vendor.data}", "{self.arch.data}", {self.sm_count.data}>')


def _int_array(values: Sequence[int]) -> ArrayAttr:
    return ArrayAttr([IntAttr(int(v)) for v in values])


def _parse_int_list(parser) -> list[int]:
    """`[1, 2, ?]`: a `?` is a dim taken at run time (`tile.DYNAMIC`, a dynamic dim)."""
    def item() -> int:
        return builtin.DYNAMIC_INDEX if parser.parse_optional_punctuation("?") is not None else parser.parse_integer()
    return parser.parse_comma_separated_list(parser.Delimiter.SQUARE, item)


def _int_list_text(values: Sequence[int]) -> str:
    return "[" + ", ".join("?" if v == builtin.DYNAMIC_INDEX else str(v) for v in values) + "]"


@irdl_attr_definition
class KernelConfigAttr(ParametrizedAttribute):
    """`#tessera_target.kernel_config<grid = [..], block = [..], shared = N, regs = R>`.

    The launch shape (3-D grid and block), the dynamic shared memory in bytes,
    and the registers per thread the kernel is compiled for.
    """

    name = "tessera_target.kernel_config"
    grid: ArrayAttr
    block: ArrayAttr
    shared: IntAttr
    regs: IntAttr

    @staticmethod
    def of(grid: Sequence[int], block: Sequence[int], shared: int, regs: int) -> KernelConfigAttr:
        return KernelConfigAttr(_int_array(grid), _int_array(block), IntAttr(shared), IntAttr(regs))

    @property
    def grid_dims(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.grid.data)

    @property
    def block_dims(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.block.data)

    @property
    def threads(self) -> int:
        return math.prod(self.block_dims)

    def verify(self) -> None:
        for what, dims in (("grid", self.grid_dims), ("block", self.block_dims)):
            if len(dims) != 3 or min(dims) < 1:
                raise VerifyException(f"kernel_config {what} must be 3 positive sizes, got {list(dims)}")

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        fields: dict[str, Attribute] = {}
        parser.parse_punctuation("<")
        for i, (key, parse) in enumerate(_CONFIG_FIELDS):
            if i:
                parser.parse_punctuation(",")
            parser.parse_keyword(key)
            parser.parse_punctuation("=")
            fields[key] = parse(parser)
        parser.parse_punctuation(">")
        return [fields[key] for key, _ in _CONFIG_FIELDS]

    def print_parameters(self, printer) -> None:
        printer.print_string(
            f"<grid = {_int_list_text(self.grid_dims)}, block = {_int_list_text(self.block_dims)}, "
            f"shared = {self.shared.data}, regs = {self.regs.data}>")


_CONFIG_FIELDS: tuple[tuple[str, Callable], ...] = (
    ("grid", lambda p: _int_array(_parse_int_list(p))),
    ("block", lambda p: _int_array(_parse_int_list(p))),
    ("shared", lambda p: IntAttr(p.parse_integer())),
    ("regs", lambda p: IntAttr(p.parse_integer())),
)


def _check_choice(op: Operation, what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise VerifyException(f"{op.name}: {what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _i64(value: int) -> IntegerAttr:
    return IntegerAttr(value, i64)


def _i64s(values: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, list(values))


def _present(**values: Attribute | None) -> dict[str, Attribute]:
    """The properties given a value: optional properties are absent, not None."""
    return {k: v for k, v in values.items() if v is not None}


@irdl_custom_directive
class TypeUnlessI1(CustomDirective):
    """` : type` of a value, written only when it is not i1 (an assert's condition: a scalar
    needs no type, a tile of i1 does); without it, the value parses as an i1."""

    value_type: TypeDirective

    def parse(self, parser: Parser, state: ParsingState) -> None:
        has_type = parser.parse_optional_punctuation(":") is not None
        self.value_type.set(state, (parser.parse_type() if has_type else i1,))

    def print(self, printer: Printer, state: PrintingState, op: IRDLOperation) -> None:
        (t,) = self.value_type.get(op)
        if t != i1:
            state.print_whitespace(printer)
            printer.print_string(": ")
            printer.print_attribute(t)


# ---------------------------------------------------------------------------
# Kernels and launches
# ---------------------------------------------------------------------------


def enclosing_kernel(op: Operation) -> KernelOp | None:
    """The tessera_target.kernel an op sits in, if any."""
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, KernelOp):
        parent = parent.parent_op()
    return parent


def _platform_of(op: Operation) -> Platform:
    kernel = enclosing_kernel(op)
    if kernel is None:
        raise VerifyException(f"'{op.name}' must be inside a tessera_target.kernel")
    return kernel.platform.platform


#: a kernel's optional integer properties, in print order
_KERNEL_INTS = ("opt_level", "producer_warps", "maxnreg", "min_blocks", "cluster")


#: a kernel attribute: the grid axes that grow with dynamic dims, as `tile.launch`'s `grid_dims`
#: ((axis, argument, dim, block) quadruples); the kernel config's grid holds their constant factors
GRID_DIMS = "tessera_target.grid_dims"


@irdl_op_definition
class KernelOp(IRDLOperation):
    """`tessera_target.kernel @name(%args) config = #... platform = #... { ... }`.

    Hand-written parse/print: the `(%a: T)` head declares the block arguments of the region
    parsed last, and xDSL's declarative format has no directive to carry them there.
    """

    name = "tessera_target.kernel"
    sym_name = prop_def(SymbolNameConstraint())
    function_type = prop_def(FunctionType)
    config = prop_def(KernelConfigAttr)
    platform = prop_def(PlatformAttr)
    opt_level = opt_prop_def(IntegerAttr[I64])
    producer_warps = opt_prop_def(IntegerAttr[I64])   # of the config's block: warps that only issue copies
    maxnreg = opt_prop_def(IntegerAttr[I64])          # registers per thread at launch (a register split's pool)
    min_blocks = opt_prop_def(IntegerAttr[I64])       # blocks per SM its registers must allow (tile.OCCUPANCY)
    cluster = opt_prop_def(IntegerAttr[I64])          # blocks of a thread-block cluster along grid x (tile.CLUSTER)
    body = region_def("single_block")
    traits = traits_def(IsolatedFromAbove(), SymbolOpInterface())

    def __init__(self, name: str, arg_types: Sequence[Attribute], config: KernelConfigAttr,
                 platform: PlatformAttr, body: Region | None = None, opt_level: int | None = None,
                 producer_warps: int | None = None, maxnreg: int | None = None, min_blocks: int | None = None,
                 cluster: int | None = None):
        ints = {k: v for k, v in zip(_KERNEL_INTS, (opt_level, producer_warps, maxnreg, min_blocks, cluster))
                if v is not None}
        super().__init__(
            properties={"sym_name": StringAttr(name), "function_type": FunctionType.from_lists(arg_types, []),
                        "config": config, "platform": platform, **{k: _i64(v) for k, v in ints.items()}},
            regions=[body if body is not None else Region(Block(arg_types=arg_types))])

    def verify_(self) -> None:
        name, p, cfg = self.sym_name.data, self.platform.platform, self.config
        if self.function_type.outputs.data:
            raise VerifyException(f"kernel @{name} must not return values")
        if tuple(self.body.block.arg_types) != self.function_type.inputs.data:
            raise VerifyException(f"kernel @{name}: block arguments {list(map(str, self.body.block.arg_types))} "
                                  f"do not match function_type inputs {list(map(str, self.function_type.inputs))}")
        if cfg.threads > p.max_threads_per_block:
            raise VerifyException(f"kernel @{name}: block {list(cfg.block_dims)} = {cfg.threads} threads exceeds "
                                  f"the {p.max_threads_per_block} threads per block of {p.arch}")
        if cfg.shared.data > p.max_shared_per_block:
            raise VerifyException(f"kernel @{name}: shared = {cfg.shared.data} bytes exceeds the "
                                  f"{p.max_shared_per_block} bytes per block of {p.arch}")
        if not 0 < cfg.regs.data <= p.max_regs_per_thread:
            raise VerifyException(f"kernel @{name}: regs = {cfg.regs.data} is outside 1..{p.max_regs_per_thread} "
                                  f"registers per thread of {p.arch}")
        if cfg.regs.data * cfg.threads > p.regs_per_sm:
            raise VerifyException(f"kernel @{name}: {cfg.threads} threads x {cfg.regs.data} registers exceeds the "
                                  f"{p.regs_per_sm} registers of one {p.arch} SM")
        if self.cluster is not None:
            size = self.cluster.value.data
            if not p.has("clusters"):
                raise VerifyException(f"kernel @{name}: clusters of {size} blocks, which {p.arch} does not have")
            if not 1 <= size <= platforms.MAX_CLUSTER:
                raise VerifyException(f"kernel @{name}: a cluster of {size} blocks; 1 to {platforms.MAX_CLUSTER} "
                                      f"are portable")
            if cfg.grid_dims[0] % size:
                raise VerifyException(f"kernel @{name}: grid {list(cfg.grid_dims)} is not whole clusters of {size} "
                                      f"along x")

    @classmethod
    def parse(cls, parser: Parser) -> KernelOp:
        name = parser.parse_symbol_name()
        args = parser.parse_comma_separated_list(parser.Delimiter.PAREN, parser.parse_argument)
        props = {"sym_name": name, "function_type": FunctionType.from_lists([a.type for a in args], [])}
        for key in ("config", "platform"):
            parser.parse_keyword(key)
            parser.parse_punctuation("=")
            props[key] = parser.parse_attribute()
        for key in _KERNEL_INTS:
            if parser.parse_optional_keyword(key) is not None:
                parser.parse_punctuation("=")
                props[key] = _i64(parser.parse_integer())
        attrs = parser.parse_optional_attr_dict_with_keyword()
        return cls.create(properties=props, attributes=dict(attrs.data) if attrs is not None else {},
                          regions=[parser.parse_region(args)])

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_symbol_name(self.sym_name.data)
        with printer.in_parens():
            printer.print_list(self.body.block.args, printer.print_block_argument)
        printer.print_string(" config = ")
        printer.print_attribute(self.config)
        printer.print_string(" platform = ")
        printer.print_attribute(self.platform)
        for key in _KERNEL_INTS:
            if (value := self.properties.get(key)) is not None:
                printer.print_string(f" {key} = {value.value.data}")
        printer.print_op_attributes(self.attributes, print_keyword=True)
        printer.print_string(" ")
        printer.print_region(self.body, print_entry_block_args=False)


@irdl_op_definition
class ReturnOp(IRDLOperation):
    """`tessera_target.return`: the end of a kernel."""

    name = "tessera_target.return"
    traits = traits_def(HasParent(KernelOp), IsTerminator())

    assembly_format = "attr-dict-with-keyword"


class _LaunchSymbolUser(SymbolUserOpInterface):
    def verify(self, op: Operation) -> None:
        assert isinstance(op, LaunchOp)
        name = op.kernel.root_reference.data
        kernel = SymbolTable.lookup_symbol(op, op.kernel)
        if not isinstance(kernel, KernelOp):
            raise VerifyException(f"launch: @{name} is not a tessera_target.kernel")
        expected = kernel.function_type.inputs.data
        if tuple(op.args.types) != expected:
            raise VerifyException(f"launch of @{name}: argument types {list(map(str, op.args.types))} "
                                  f"do not match the kernel's {list(map(str, expected))}")
        cfg = kernel.config
        launched = (tuple(op.grid.iter_values()), tuple(op.block.iter_values()), op.shared.value.data)
        if launched != (cfg.grid_dims, cfg.block_dims, cfg.shared.data):
            raise VerifyException(f"launch of @{name}: grid/block/shared {launched} differ from the kernel config "
                                  f"{(cfg.grid_dims, cfg.block_dims, cfg.shared.data)}")


@irdl_op_definition
class LaunchOp(IRDLOperation):
    """`tessera_target.launch @k(%args) grid = [..] block = [..] shared = N : types` (host side)."""

    name = "tessera_target.launch"
    kernel = prop_def(SymbolRefAttr)
    grid = prop_def(DenseArrayBase[I64])
    block = prop_def(DenseArrayBase[I64])
    shared = prop_def(IntegerAttr[I64])
    args = var_operand_def()
    traits = traits_def(_LaunchSymbolUser())

    assembly_format = ("$kernel `(` $args `)` `grid` `=` $grid `block` `=` $block `shared` `=` $shared "
                       "attr-dict-with-keyword `:` type($args)")

    def __init__(self, kernel: str, args: Sequence[SSAValue], grid: Sequence[int], block: Sequence[int], shared: int):
        super().__init__(operands=[args], properties={
            "kernel": SymbolRefAttr(kernel), "grid": _i64s(grid), "block": _i64s(block), "shared": _i64(shared)})


# ---------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------

#: how a and b are stored: "n" as M x K / K x N, "t" transposed (K x M / N x K)
LAYOUTS = ("nn", "nt", "tn", "tt")


@irdl_op_definition
class TensorCoreOp(IRDLOperation):
    """`%d = tessera_target.tensor_core "mma.sync" (%a, %b, %acc) shape = [m, n, k] layout = "nt"
    precision = "f16" : (...) -> acc type`: acc + a @ b on the platform's matrix units.

    `shape` is one instruction's shape, `precision` the MLIR element type of a
    and b; `layout` says how a and b are stored (BLAS's letters: "nt" means a is M x K and b is
    N x K, "tn" a is K x M and b is K x N). The verifier accepts only a
    (family, shape, precision) the enclosing kernel's platform has. A wgmma
    reads b, and a unless a is a register tile, through `wgmma_descriptor`s;
    every other family reads register tiles.
    """

    name = "tessera_target.tensor_core"
    family = prop_def(StringAttr)
    shape = prop_def(DenseArrayBase[I64])
    layout = prop_def(StringAttr)
    precision = prop_def(StringAttr)
    a = operand_def()
    b = operand_def()
    acc = operand_def()
    result = result_def()
    traits = traits_def(HasAncestor(KernelOp))

    assembly_format = ("$family ` ` `(` $a `,` $b `,` $acc `)` `shape` `=` $shape `layout` `=` $layout "
                       "`precision` `=` $precision attr-dict-with-keyword `:` functional-type(operands, results)")

    def __init__(self, family: str, a: SSAValue, b: SSAValue, acc: SSAValue, shape: Sequence[int],
                 layout: str, precision: str):
        super().__init__(operands=[a, b, acc], result_types=[acc.type], properties={
            "family": StringAttr(family), "shape": _i64s(shape), "layout": StringAttr(layout),
            "precision": StringAttr(precision)})

    def operand_shape(self, v: SSAValue) -> tuple[int, ...]:
        """The [rows, cols] of operand a or b, a register tile or a descriptor's stage, as stored."""
        t = v.type
        return t.shape_dims if isinstance(t, WgmmaDescriptorType) else tuple(t.get_shape())

    def verify_(self) -> None:
        _check_choice(self, "layout", self.layout.data, LAYOUTS)
        if self.result.type != self.acc.type:
            raise VerifyException(f"tensor_core: result type {self.result.type} must equal the accumulator's "
                                  f"{self.acc.type}")
        p, family, shape = _platform_of(self), self.family.data, tuple(self.shape.iter_values())
        same_family = [i for i in platforms.mma_instructions(p) if i.family == family]
        if not same_family:
            raise VerifyException(f"tensor_core: {family!r} is not available on {p.arch} "
                                  f"(available: {', '.join(sorted(platforms.mma_families(p))) or 'none'})")
        if not any(i.accepts(shape) and i.operand == self.precision.data for i in same_family):
            shown = ", ".join(f"{list(i.shape)} {i.operand}" for i in same_family)
            raise VerifyException(f"tensor_core: {family} on {p.arch} has no shape {list(shape)} with precision "
                                  f"{self.precision.data!r} (it has: {shown})")
        described = [isinstance(v.type, WgmmaDescriptorType) for v in (self.a, self.b)]
        b_element = str(self.b.type.element_type if described[1] else self.b.type.get_element_type())
        fp8 = {d.mlir for d in dtypes.FP8}
        if b_element != self.precision.data and not {b_element, self.precision.data} <= fp8:
            raise VerifyException(f"tensor_core: b is {b_element}, a {self.precision.data}: operands share an "
                                  f"element type, but for the two fp8 formats")
        if family == "wgmma" and not described[1]:
            raise VerifyException("tensor_core wgmma: b must be a !tessera_target.wgmma_descriptor")
        if family != "wgmma" and any(described):
            raise VerifyException(f"tensor_core {family}: reads register tiles, not wgmma descriptors")


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

POOLS = ("shared", "global", "register", "tmem")
#: shared tile buffer layouts: TMA's [rows, 64] boxes in its 128-byte swizzle (what wgmma descriptors
#: read), its [rows, 64] boxes of 8-bit elements in its 64-byte swizzle (`tensor_maps.box_row_bytes`),
#: or rows of 16-byte chunks XOR-swizzled by row (threads' cp.async writes, ldmatrix reads)
SWIZZLES = ("tma_128b", "tma_64b", "xor_16b")
# Memory space of each memref endpoint a memcpy kind names (builtin memref
# memory space attribute; global has none).
MEMORY_SPACES: dict[str, int | None] = {"global": None, "shared": 3}
MEMCPY_KINDS = tuple(f"{a}_to_{b}" for a in MEMORY_SPACES for b in MEMORY_SPACES)


def memref_bytes(t: MemRefType) -> int:
    """Bytes of a statically shaped memref (sub-byte types round up per element)."""
    return math.prod(t.get_shape()) * max(1, t.element_type.bitwidth // 8)


def _space(t: Attribute) -> int | None:
    space = t.memory_space if isinstance(t, MemRefType) else None
    return space.value.data if isinstance(space, IntegerAttr) else None


@irdl_op_definition
class AllocateOp(IRDLOperation):
    """`%buf = tessera_target.allocate pool = "shared" align = 128 size = 16384 offset = 0 swizzle = "xor_16b"
    : memref<...>`: a buffer of `size` bytes; in shared memory, at byte `offset` of the kernel's dynamic
    shared memory (set by the allocation pass, `tile_to_target.allocate_shared`), its stages laid
    out as `swizzle` says."""

    name = "tessera_target.allocate"
    pool = prop_def(StringAttr)
    align = prop_def(IntegerAttr[I64])
    size = prop_def(IntegerAttr[I64])
    offset = opt_prop_def(IntegerAttr[I64])     # bytes into dynamic shared memory (`allocate_shared`)
    swizzle = opt_prop_def(StringAttr)          # how a shared tile buffer's stages are laid out (SWIZZLES)
    result = result_def(MemRefType)

    assembly_format = ("`pool` `=` $pool `align` `=` $align `size` `=` $size (`offset` `=` $offset^)? "
                       "(`swizzle` `=` $swizzle^)? attr-dict-with-keyword `:` type($result)")

    def __init__(self, result_type: MemRefType, pool: str, size: int, align: int = 16, swizzle: str | None = None):
        super().__init__(result_types=[result_type], properties=_present(
            pool=StringAttr(pool), align=_i64(align), size=_i64(size),
            swizzle=StringAttr(swizzle) if swizzle is not None else None))

    def verify_(self) -> None:
        _check_choice(self, "pool", self.pool.data, POOLS)
        if self.swizzle is not None:
            _check_choice(self, "swizzle", self.swizzle.data, SWIZZLES)
        align, size = self.align.value.data, self.size.value.data
        if align < 1 or align & (align - 1):
            raise VerifyException(f"allocate: align = {align} is not a power of two")
        if self.result.type.has_static_shape() and size < memref_bytes(self.result.type):
            raise VerifyException(f"allocate: size = {size} bytes is less than the "
                                  f"{memref_bytes(self.result.type)} bytes of {self.result.type}")


@irdl_op_definition
class MemcpyOp(IRDLOperation):
    """`tessera_target.memcpy %dst[%stage], %src[%i, %j] kind = "global_to_shared" async = true
    mechanism = "cp.async" tile_dims = [0, 1] padding = 0.0 : dst type, src type`.

    Copies the tile `dst[dst_indices]` from `src` at `src_indices` (a tile.load
    read: `tile_dims` are the src dims the tile spans, out-of-bounds elements
    read as `padding`); with `dst_rows` = [start, count], only those rows of it
    (tile.copy_async's). `mechanism` is how the hardware moves it. `whole`: along its dims taken
    at run time, the tile's extent divides the size (tile.copy_async's), so a tile at a multiple
    of its extent is wholly inside `src` or wholly past its end.
    """

    name = "tessera_target.memcpy"
    dst = operand_def(MemRefType)
    dst_indices = var_operand_def(IndexType)
    src = operand_def(MemRefType)
    src_indices = var_operand_def(IndexType)
    kind = prop_def(StringAttr)
    is_async = prop_def(IntegerAttr[I1], prop_name="async")
    mechanism = prop_def(StringAttr)
    tile_dims = opt_prop_def(DenseArrayBase[I64])
    padding = opt_prop_def(FloatAttr)
    dst_rows = opt_prop_def(DenseArrayBase[I64])
    whole = opt_prop_def(UnitAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    traits = traits_def(HasAncestor(KernelOp))

    assembly_format = ("$dst `[` $dst_indices `]` `,` $src `[` $src_indices `]` `kind` `=` $kind "
                       "`async` `=` $async `mechanism` `=` $mechanism (`tile_dims` `=` $tile_dims^)? "
                       "(`padding` `=` $padding^)? (`dst_rows` `=` $dst_rows^)? (`whole` $whole^)? "
                       "attr-dict-with-keyword `:` type($dst) `,` type($src)")

    def __init__(self, dst: SSAValue, dst_indices: Sequence[SSAValue], src: SSAValue,
                 src_indices: Sequence[SSAValue], kind: str, is_async: bool, mechanism: str,
                 tile_dims: Sequence[int] | None = None, padding: FloatAttr | None = None,
                 dst_rows: Sequence[int] | None = None, whole: bool = False):
        super().__init__(operands=[dst, dst_indices, src, src_indices], properties=_present(
            kind=StringAttr(kind), mechanism=StringAttr(mechanism), padding=padding,
            tile_dims=_i64s(tile_dims) if tile_dims is not None else None,
            dst_rows=_i64s(dst_rows) if dst_rows is not None else None,
            whole=UnitAttr() if whole else None,
            **{"async": IntegerAttr.from_bool(is_async)}))

    @property
    def rows(self) -> tuple[int, int] | None:
        """(first row, rows) of the destination tile the copy fills; None: all of it."""
        return tuple(self.dst_rows.get_values()) if self.dst_rows is not None else None

    def verify_(self) -> None:
        _check_choice(self, "kind", self.kind.data, MEMCPY_KINDS)
        src_memory, dst_memory = self.kind.data.split("_to_")
        for role, value, memory in (("src", self.src, src_memory), ("dst", self.dst, dst_memory)):
            if _space(value.type) != MEMORY_SPACES[memory]:
                raise VerifyException(f"memcpy {self.kind.data}: {role} {value.type} is not in {memory} memory")
        p, padding = _platform_of(self), self.padding.value.data if self.padding is not None else 0.0
        _check_choice(self, f"mechanism on {p.arch} for padding {padding}", self.mechanism.data,
                      platforms.copy_mechanisms(p, padding))


# ---------------------------------------------------------------------------
# Debugging
# ---------------------------------------------------------------------------

class _ProfileOp(IRDLOperation):
    """`name %buffer label = "softmax" slot = N : memref<...xi32>`: a timestamp of profile region
    `label`, which one thread per block writes into slot `slot` of `buffer`, an i32 memref
    [grid z, grid y, grid x, slots, 4]: (begin, end) 64-bit stamps (`tessera.lowering.profile`).
    Written without a buffer (`name label = "..."`), it only marks the region."""

    buffer = var_operand_def(MemRefType)
    label = prop_def(StringAttr)
    slot = opt_prop_def(IntegerAttr[I64])
    traits = traits_def(HasAncestor(KernelOp))

    assembly_format = ("$buffer `label` `=` $label (`slot` `=` $slot^)? attr-dict-with-keyword "
                       "(`:` type($buffer)^)?")

    def __init__(self, label: str, buffer: SSAValue | None = None, slot: int | None = None):
        super().__init__(operands=[[buffer] if buffer is not None else []], properties=_present(
            label=StringAttr(label), slot=_i64(slot) if slot is not None else None))

    def verify_(self) -> None:
        if len(self.buffer) > 1 or (len(self.buffer) == 1) != (self.slot is not None):
            raise VerifyException(f"{self.name}: a buffer and a slot go together, one of each")


@irdl_op_definition
class ProfileBeginOp(_ProfileOp):
    """`tessera_target.profile_begin %stamps label = "mainloop" slot = 1 : memref<...>`: start of a timed region."""

    name = "tessera_target.profile_begin"


@irdl_op_definition
class ProfileEndOp(_ProfileOp):
    """`tessera_target.profile_end %stamps label = "mainloop" slot = 1 : memref<...>`: end of a timed region."""

    name = "tessera_target.profile_end"


@irdl_op_definition
class AssertOp(IRDLOperation):
    """`tessera_target.assert %cond message = "..."`: stop the kernel and report `message` (with the
    op's `tessera.loc` and the block and thread) when %cond, an i1, is false; for an i1 tile,
    `... : tensor<64x64xi1>`, when any element is."""

    name = "tessera_target.assert"
    condition = operand_def()
    message = prop_def(StringAttr)

    assembly_format = "$condition `message` `=` $message attr-dict-with-keyword custom<TypeUnlessI1>(type($condition))"
    custom_directives = (TypeUnlessI1,)

    def __init__(self, condition: SSAValue, message: str):
        super().__init__(operands=[condition], properties={"message": StringAttr(message)})

    def verify_(self) -> None:
        t = self.condition.type
        element = t.get_element_type() if isinstance(t, builtin.TensorType) else t
        if element != i1:
            raise VerifyException(f"assert: the condition must be i1 or a tile of i1, got {t}")


# ---------------------------------------------------------------------------
# Asynchrony, modelled on MLIR's NVGPU/NVVM dialects: mbarriers, TMA tensor
# maps and bulk tensor copies, cp.async groups, wgmma groups, fences, barriers
# and warp specialization. Every one is made by a lowering pass
# (tessera.lowering.async_pipelines / tile_to_target) and read by the
# async-hazard checker (tessera.passes.check_async) and the PTX backend.
# ---------------------------------------------------------------------------


def _parse_angle_ints(parser) -> list[int]:
    parser.parse_punctuation("<")
    values = [parser.parse_integer()]
    while parser.parse_optional_punctuation(",") is not None:
        values.append(parser.parse_integer())
    parser.parse_punctuation(">")
    return values


@irdl_attr_definition
class MBarriersType(ParametrizedAttribute, TypeAttribute):
    """`!tessera_target.mbarriers<N>`: N 8-byte mbarriers, one per pipeline stage, in shared memory."""

    name = "tessera_target.mbarriers"
    count: IntAttr

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        (count,) = _parse_angle_ints(parser)
        return [IntAttr(count)]

    def print_parameters(self, printer) -> None:
        printer.print_string(f"<{self.count.data}>")


@irdl_attr_definition
class TensorMapType(ParametrizedAttribute, TypeAttribute):
    """`!tessera_target.tensor_map<f16, [4096, 4096], box = [128, 64], swizzle = 128>`: a TMA
    descriptor of a tensor (its element type, shape, and element strides where they are not
    row-major's: `[2, 8, 64], strides = [8192, 64, 1]`) copied in boxes of `box` elements
    (outermost dim first) that land in shared memory with the given byte swizzle; elements
    outside the tensor read as zero."""

    name = "tessera_target.tensor_map"
    element_type: Attribute
    shape: ArrayAttr
    strides: ArrayAttr      # empty: row-major
    box: ArrayAttr
    swizzle: IntAttr

    @staticmethod
    def of(element_type: Attribute, shape: Sequence[int], box: Sequence[int], swizzle: int = 128,
           strides: Sequence[int] | None = None) -> TensorMapType:
        """A map of a `shape` tensor, laid out with element `strides` (None: row-major; a map over a
        dim taken at run time is always row-major)."""
        strides = () if strides is None or tuple(strides) == c_strides(shape) else strides
        return TensorMapType(element_type, _int_array(shape), _int_array(strides), _int_array(box), IntAttr(swizzle))

    @staticmethod
    def byte_a_rows(element_type: Attribute, shape: Sequence[int], strides: Sequence[int], rows: int, cols: int,
                    swizzle: int) -> TensorMapType:
        """A map of a tensor whose dims before the last are one run of rows (`rows_are_one_run`), read
        as rows in groups of 16, that copies boxes of `rows` rows (a multiple of 16) x `cols` with each
        16 permuted: box row 16h + 8g + 2t + e is tensor row 16h + 4t + 2g + e of the box's first
        (five dims [rows / 16, g, t, e, cols], the box's rows laid out in its dims' order). Keys read
        so make attention's scores a tile in `layouts.Mma.byte_a` order (`lowering.byte_fragments`)."""
        s = strides[-2]
        return TensorMapType.of(element_type, (math.prod(shape[:-1]) // 16, 2, 4, 2, shape[-1]),
                                (rows // 16, 2, 4, 2, cols), swizzle, strides=(16 * s, 2 * s, 4 * s, s, 1))

    @property
    def shape_dims(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.shape.data)

    @property
    def element_strides(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.strides.data) or c_strides(self.shape_dims)

    @property
    def box_dims(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.box.data)

    @property
    def box_bytes(self) -> int:
        return math.prod(self.box_dims) * max(1, self.element_type.bitwidth // 8)

    def verify(self) -> None:
        if len(self.box_dims) != len(self.shape_dims) or min(self.box_dims, default=1) < 1 or max(self.box_dims) > 256:
            raise VerifyException(f"tensor_map: box {list(self.box_dims)} must give 1..256 elements for each of the "
                                  f"{len(self.shape_dims)} dims of {list(self.shape_dims)}")

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        element = parser.parse_type()
        parser.parse_punctuation(",")
        shape = _int_array(_parse_int_list(parser))
        parser.parse_punctuation(",")
        strides = ()
        if parser.parse_optional_keyword("strides") is not None:
            parser.parse_punctuation("=")
            strides = _parse_int_list(parser)
            parser.parse_punctuation(",")
        parser.parse_keyword("box")
        parser.parse_punctuation("=")
        box = _int_array(_parse_int_list(parser))
        parser.parse_punctuation(",")
        parser.parse_keyword("swizzle")
        parser.parse_punctuation("=")
        swizzle = IntAttr(parser.parse_integer())
        parser.parse_punctuation(">")
        return [element, shape, _int_array(strides), box, swizzle]

    def print_parameters(self, printer) -> None:
        printer.print_string("<")
        printer.print_attribute(self.element_type)
        strides = f"strides = {_int_list_text(self.element_strides)}, " if self.strides.data else ""
        printer.print_string(f", {_int_list_text(self.shape_dims)}, {strides}box = {_int_list_text(self.box_dims)}, "
                             f"swizzle = {self.swizzle.data}>")


#: how a wgmma operand is stored in shared memory: its contraction dim contiguous ("k"), or its M/N dim
MAJORS = ("k", "mn")


@irdl_attr_definition
class WgmmaDescriptorType(ParametrizedAttribute, TypeAttribute):
    """`!tessera_target.wgmma_descriptor<f16, [128, 64], major = k>`: a 64-bit wgmma matrix
    descriptor of one stage ([rows, cols] elements, as stored) of a shared tile buffer, stored
    K-major or M/N-major."""

    name = "tessera_target.wgmma_descriptor"
    element_type: Attribute
    shape: ArrayAttr
    major: StringAttr

    @staticmethod
    def of(element_type: Attribute, shape: Sequence[int], major: str) -> WgmmaDescriptorType:
        return WgmmaDescriptorType(element_type, _int_array(shape), StringAttr(major))

    @property
    def shape_dims(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.shape.data)

    def verify(self) -> None:
        if self.major.data not in MAJORS:
            raise VerifyException(f"wgmma_descriptor: major must be one of {', '.join(MAJORS)}, got {self.major.data!r}")

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        element = parser.parse_type()
        parser.parse_punctuation(",")
        shape = _int_array(_parse_int_list(parser))
        parser.parse_punctuation(",")
        parser.parse_keyword("major")
        parser.parse_punctuation("=")
        major = StringAttr(parser.parse_identifier())
        parser.parse_punctuation(">")
        return [element, shape, major]

    def print_parameters(self, printer) -> None:
        printer.print_string("<")
        printer.print_attribute(self.element_type)
        printer.print_string(f", {_int_list_text(self.shape_dims)}, major = {self.major.data}>")


class _AsyncOp(IRDLOperation):
    """An async op: only inside a kernel."""

    traits = traits_def(HasAncestor(KernelOp))


def _require(op: Operation, feature: str) -> None:
    p = _platform_of(op)
    if not p.has(feature):
        raise VerifyException(f"{op.name} needs {feature}, which {p.arch} does not have")


def rows_are_one_run(t: MemRefType) -> bool:
    """Whether a static memref's dims before its last are one run of evenly spaced rows (each dim's
    stride the next one's extent times its stride; the last dim contiguous)."""
    shape, strides = t.get_shape(), t.get_strides()
    if builtin.DYNAMIC_INDEX in shape or None in strides or len(shape) < 2 or strides[-1] != 1:
        return False
    return all(strides[i] == shape[i + 1] * strides[i + 1] for i in range(len(shape) - 2))


@irdl_op_definition
class TensorMapOp(_AsyncOp):
    """`%m = tessera_target.tensor_map %arg : memref<..> -> !tessera_target.tensor_map<..>`: the
    kernel's by-value TMA descriptor of kernel argument %arg (a `.param` after the pointers; the
    runtime encodes it from the argument's address at launch)."""

    name = "tessera_target.tensor_map"
    tensor = operand_def(MemRefType)
    result = result_def(TensorMapType)
    byte_a_rows = opt_prop_def(UnitAttr)     # the map reads the tensor's rows permuted: `TensorMapType.byte_a_rows`
    irdl_options = (ParsePropInAttrDict(),)

    assembly_format = "$tensor attr-dict `:` type($tensor) `->` type($result)"

    def __init__(self, tensor: SSAValue, map_type: TensorMapType, byte_a_rows: bool = False):
        super().__init__(operands=[tensor], result_types=[map_type],
                         properties={"byte_a_rows": UnitAttr()} if byte_a_rows else {})

    def verify_(self) -> None:
        _require(self, "tma")
        t, m = self.tensor.type, self.result.type
        if not isinstance(self.tensor, BlockArgument) or not isinstance(self.tensor.owner.parent_op(), KernelOp):
            raise VerifyException("tensor_map: the tensor must be an argument of the kernel")
        if self.byte_a_rows is not None:
            if not rows_are_one_run(t):
                raise VerifyException(f"tensor_map: byte_a_rows reads {t} as one run of rows, which it is not")
            view = TensorMapType.byte_a_rows(t.element_type, t.get_shape(), t.get_strides(), 16, 1, 0)
            if (m.shape_dims, m.element_strides, m.element_type) != (view.shape_dims, view.element_strides,
                                                                    t.element_type):
                raise VerifyException(f"tensor_map: {m} is not {t} read with its rows in groups of 16")
            return
        if builtin.DYNAMIC_INDEX in t.get_shape():   # (row-major, its outer strides taken at run time)
            same_strides = not isinstance(t.layout, builtin.StridedLayoutAttr) and not m.strides.data
        else:
            same_strides = tuple(t.get_strides()) == m.element_strides
        if tuple(t.get_shape()) != m.shape_dims or not same_strides or t.element_type != m.element_type:
            raise VerifyException(f"tensor_map: {m} does not describe {t}")


@irdl_op_definition
class MBarrierAllocOp(_AsyncOp):
    """`%b = tessera_target.mbarrier_alloc offset = 196608 : !tessera_target.mbarriers<4>`: the
    mbarriers of one pipeline in dynamic shared memory (`offset` in bytes, set by the
    shared-memory allocation pass)."""

    name = "tessera_target.mbarrier_alloc"
    offset = opt_prop_def(IntegerAttr[I64])
    result = result_def(MBarriersType)

    assembly_format = "(`offset` `=` $offset^)? attr-dict `:` type($result)"

    def __init__(self, count: int):
        super().__init__(result_types=[MBarriersType(IntAttr(count))])

    def verify_(self) -> None:
        _require(self, "tma")


@irdl_op_definition
class MBarrierInitOp(_AsyncOp):
    """`tessera_target.mbarrier_init %b arrivals = 1 : !..mbarriers<4>`: one thread initialises every
    mbarrier of %b to expect `arrivals` arrivals per phase (phase 0 in progress)."""

    name = "tessera_target.mbarrier_init"
    barriers = operand_def(MBarriersType)
    arrivals = prop_def(IntegerAttr[I64])

    assembly_format = "$barriers `arrivals` `=` $arrivals attr-dict `:` type($barriers)"

    def __init__(self, barriers: SSAValue, arrivals: int):
        super().__init__(operands=[barriers], properties={"arrivals": IntegerAttr(arrivals, i64)})

    def verify_(self) -> None:
        if self.arrivals.value.data < 1:
            raise VerifyException(f"mbarrier_init: arrivals = {self.arrivals.value.data} must be positive")


@irdl_op_definition
class MBarrierArriveExpectTxOp(_AsyncOp):
    """`tessera_target.mbarrier_arrive_expect_tx %b[%stage] bytes = N : ..`: the issuing thread
    arrives on mbarrier %stage of %b and adds N bytes to the transactions its phase waits for
    (the bulk copies that complete on it)."""

    name = "tessera_target.mbarrier_arrive_expect_tx"
    barriers = operand_def(MBarriersType)
    stage = operand_def(IndexType)
    bytes = prop_def(IntegerAttr[I64])

    assembly_format = "$barriers `[` $stage `]` `bytes` `=` $bytes attr-dict `:` type($barriers)"

    def __init__(self, barriers: SSAValue, stage: SSAValue, nbytes: int):
        super().__init__(operands=[barriers, stage], properties={"bytes": IntegerAttr(nbytes, i64)})


#: who arrives on an mbarrier_arrive's mbarrier: each thread running it, one lane of each warp, or
#: the issuing thread on the same mbarrier of every block of the kernel's cluster (its `cluster`)
ARRIVERS = ("thread", "warp", "cluster")


@irdl_op_definition
class MBarrierArriveOp(_AsyncOp):
    """`tessera_target.mbarrier_arrive %b[%stage] per = "warp" : ..`: an arrival on mbarrier %stage
    of %b from each thread, or from one lane of each warp, that runs it; `per = "cluster"`: the
    issuing thread's arrival on mbarrier %stage of %b in every block of the kernel's cluster, its
    own included (blocks telling one another that a stage they all fill is free)."""

    name = "tessera_target.mbarrier_arrive"
    barriers = operand_def(MBarriersType)
    stage = operand_def(IndexType)
    per = prop_def(StringAttr)

    assembly_format = "$barriers `[` $stage `]` `per` `=` $per attr-dict `:` type($barriers)"

    def __init__(self, barriers: SSAValue, stage: SSAValue, per: str = "warp"):
        super().__init__(operands=[barriers, stage], properties={"per": StringAttr(per)})

    def verify_(self) -> None:
        _check_choice(self, "per", self.per.data, ARRIVERS)
        if self.per.data == "cluster":
            _require(self, "clusters")


@irdl_op_definition
class MBarrierTryWaitOp(_AsyncOp):
    """`tessera_target.mbarrier_try_wait %b[%stage] parity %p : ..`: every thread that runs it spins
    until the phase of mbarrier %stage with parity %p (0 or 1) has completed."""

    name = "tessera_target.mbarrier_try_wait"
    barriers = operand_def(MBarriersType)
    stage = operand_def(IndexType)
    parity = operand_def(i32)

    assembly_format = "$barriers `[` $stage `]` `parity` $parity attr-dict `:` type($barriers)"

    def __init__(self, barriers: SSAValue, stage: SSAValue, parity: SSAValue):
        super().__init__(operands=[barriers, stage, parity])


@irdl_op_definition
class TmaLoadOp(_AsyncOp):
    """`tessera_target.tma_load %map[%c0, %c1], %dst[%stage] + 16384, %b[%stage] : ..`: one bulk
    tensor copy (`cp.async.bulk.tensor`) of the box of %map at element coordinates %c (outermost
    first) into stage %stage of shared buffer %dst, `offset` bytes into the stage; it completes
    on mbarrier %stage of %b, counting the box's bytes. Issued by one thread.

    `multicast = c` (a kernel in clusters of c blocks): the cluster's blocks copy a tile they all
    need once for all of them. The op is the whole cluster's: c boxes stacked along the map's
    second-innermost dim, the block of rank r copying box r (coordinate + r * its box rows there,
    `offset` + r * box bytes) into the same place of every block of the cluster, completing on each
    one's mbarrier; every block then receives c boxes' bytes."""

    name = "tessera_target.tma_load"
    tensor_map = operand_def(TensorMapType)
    coords = var_operand_def(IndexType)
    dst = operand_def(MemRefType)
    stage = operand_def(IndexType)
    barriers = operand_def(MBarriersType)
    barrier_stage = operand_def(IndexType)
    offset = prop_def(IntegerAttr[I64])
    multicast = opt_prop_def(IntegerAttr[I64])
    irdl_options = (AttrSizedOperandSegments(as_property=True),)

    assembly_format = ("$tensor_map `[` $coords `]` `,` $dst `[` $stage `]` `+` $offset `,` "
                       "$barriers `[` $barrier_stage `]` (`multicast` `=` $multicast^)? attr-dict `:` "
                       "type($tensor_map) `,` type($dst) `,` type($barriers)")

    def __init__(self, tensor_map: SSAValue, coords: Sequence[SSAValue], dst: SSAValue, stage: SSAValue,
                 offset: int, barriers: SSAValue, multicast: int = 1):
        properties = {"offset": IntegerAttr(offset, i64)}
        if multicast > 1:
            properties["multicast"] = IntegerAttr(multicast, i64)
        super().__init__(operands=[tensor_map, coords, dst, stage, barriers, stage], properties=properties)

    @property
    def copies(self) -> int:
        """The boxes the op copies into each block (`multicast`, 1 without)."""
        return self.multicast.value.data if self.multicast is not None else 1

    def verify_(self) -> None:
        m: TensorMapType = self.tensor_map.type
        if len(self.coords) != len(m.shape_dims):
            raise VerifyException(f"tma_load: {len(self.coords)} coordinates for a {len(m.shape_dims)}-d tensor map")
        if _space(self.dst.type) != MEMORY_SPACES["shared"]:
            raise VerifyException(f"tma_load: destination {self.dst.type} is not in shared memory")
        stage_bytes = memref_bytes(self.dst.type) // self.dst.type.get_shape()[0]
        if not 0 <= self.offset.value.data <= stage_bytes - self.copies * m.box_bytes:
            boxes = f"a {m.box_bytes}-byte box" if self.copies == 1 else f"{self.copies} {m.box_bytes}-byte boxes"
            raise VerifyException(f"tma_load: {boxes} at offset {self.offset.value.data} does not fit a "
                                  f"{stage_bytes}-byte stage of {self.dst.type}")
        if self.copies > 1:
            _require(self, "clusters")
            if len(m.shape_dims) < 2:
                raise VerifyException("tma_load: a multicast copy stacks its boxes along a map's second-innermost dim")


#: the swizzles of Tessera's TMA buffers (`allocate swizzle = "tma_128b"` / `"tma_64b"`)
WGMMA_SWIZZLES = (128, 64)


@irdl_op_definition
class WgmmaDescriptorOp(_AsyncOp):
    """`%d = tessera_target.wgmma_descriptor %buf[%stage] leading = 16 stride = 1024 swizzle = 128
    per_warpgroup = 8192 : memref<..> -> !tessera_target.wgmma_descriptor<..>`: the matrix
    descriptor through which wgmma reads stage %stage of shared buffer %buf: the stage's address,
    plus `per_warpgroup` bytes for each warpgroup before the reader's (an A operand, whose rows
    the warpgroups split; 0 for B), with the leading and stride byte offsets and the swizzle of
    the buffer's layout. The wgmma steps along K and N from it."""

    name = "tessera_target.wgmma_descriptor"
    buffer = operand_def(MemRefType)
    stage = operand_def(IndexType)
    leading = prop_def(IntegerAttr[I64])
    stride = prop_def(IntegerAttr[I64])
    swizzle = prop_def(IntegerAttr[I64])
    per_warpgroup = prop_def(IntegerAttr[I64])
    result = result_def(WgmmaDescriptorType)

    assembly_format = ("$buffer `[` $stage `]` `leading` `=` $leading `stride` `=` $stride `swizzle` `=` $swizzle "
                       "`per_warpgroup` `=` $per_warpgroup attr-dict `:` type($buffer) `->` type($result)")

    def __init__(self, buffer: SSAValue, stage: SSAValue, major: str, leading: int, stride: int, swizzle: int,
                 per_warpgroup: int = 0):
        t: MemRefType = buffer.type
        super().__init__(operands=[buffer, stage], result_types=[WgmmaDescriptorType.of(
            t.element_type, t.get_shape()[1:], major)], properties={
            "leading": IntegerAttr(leading, i64), "stride": IntegerAttr(stride, i64),
            "swizzle": IntegerAttr(swizzle, i64), "per_warpgroup": IntegerAttr(per_warpgroup, i64)})

    def verify_(self) -> None:
        _require(self, "wgmma")
        t, d = self.buffer.type, self.result.type
        if _space(t) != MEMORY_SPACES["shared"]:
            raise VerifyException(f"wgmma_descriptor: {t} is not in shared memory")
        if tuple(t.get_shape()[1:]) != d.shape_dims or t.element_type != d.element_type:
            raise VerifyException(f"wgmma_descriptor: {d} does not describe a stage of {t}")
        for key in ("leading", "stride", "per_warpgroup"):
            value = getattr(self, key).value.data
            if value % 16 or not 0 <= value < 1 << 18:   # 14-bit fields of 16-byte units
                raise VerifyException(f"wgmma_descriptor: {key} = {value} is not a multiple of 16 below 2^18")
        if self.swizzle.value.data not in WGMMA_SWIZZLES:
            raise VerifyException(f"wgmma_descriptor: swizzle = {self.swizzle.value.data} is not one of "
                                  f"{', '.join(map(str, WGMMA_SWIZZLES))}")


class _CountedWaitOp(_AsyncOp):
    pending = prop_def(IntegerAttr[I64])

    assembly_format = "`pending` `=` $pending attr-dict"

    def __init__(self, pending: int):
        super().__init__(properties={"pending": IntegerAttr(pending, i64)})

    def verify_(self) -> None:
        if self.pending.value.data < 0:
            raise VerifyException(f"{self.name}: pending = {self.pending.value.data} must not be negative")


class _BareOp(_AsyncOp):
    assembly_format = "attr-dict"

    def __init__(self):
        super().__init__()


@irdl_op_definition
class CpAsyncCommitOp(_BareOp):
    """`tessera_target.cp_async_commit`: the cp.async copies this thread issued since the last
    commit form a group."""

    name = "tessera_target.cp_async_commit"


@irdl_op_definition
class CpAsyncWaitOp(_CountedWaitOp):
    """`tessera_target.cp_async_wait pending = N`: wait until at most N of this thread's committed
    cp.async groups are in flight (their data is then visible to this thread; a barrier publishes
    it to the block)."""

    name = "tessera_target.cp_async_wait"


@irdl_op_definition
class WgmmaFenceOp(_BareOp):
    """`tessera_target.wgmma_fence`: orders this warpgroup's earlier register and shared-memory
    accesses before the wgmma ops that follow."""

    name = "tessera_target.wgmma_fence"

    def verify_(self) -> None:
        _require(self, "wgmma")


@irdl_op_definition
class WgmmaCommitOp(_BareOp):
    """`tessera_target.wgmma_commit`: the wgmma ops issued since the last commit form a group."""

    name = "tessera_target.wgmma_commit"

    def verify_(self) -> None:
        _require(self, "wgmma")


@irdl_op_definition
class WgmmaWaitOp(_CountedWaitOp):
    """`tessera_target.wgmma_wait pending = N`: wait until at most N committed wgmma groups run;
    the accumulators and shared operands of the others are then free."""

    name = "tessera_target.wgmma_wait"

    def verify_(self) -> None:
        super().verify_()
        _require(self, "wgmma")


#: fence kinds -> the platform feature each needs
FENCES: dict[str, str] = {"mbarrier_init": "tma", "async_shared": "wgmma"}


@irdl_op_definition
class FenceOp(_AsyncOp):
    """`tessera_target.fence kind = "mbarrier_init"`: makes initialised mbarriers visible to the
    async proxy (TMA) and the rest of the block; `kind = "async_shared"`: makes the thread's
    shared-memory stores visible to the async proxy (a wgmma reading a tile the threads stored)."""

    name = "tessera_target.fence"
    kind = prop_def(StringAttr)

    assembly_format = "`kind` `=` $kind attr-dict"

    def __init__(self, kind: str):
        super().__init__(properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_choice(self, "kind", self.kind.data, tuple(FENCES))
        _require(self, FENCES[self.kind.data])


@irdl_op_definition
class BarrierOp(_AsyncOp):
    """`tessera_target.barrier`: every thread of the block meets here (barrier 0), or, with
    `id = 1 threads = 256`, the first `threads` threads meet at named barrier `id` (a warp-specialized
    kernel's computing warps, without its producer)."""

    name = "tessera_target.barrier"
    id = opt_prop_def(IntegerAttr[I64])
    threads = opt_prop_def(IntegerAttr[I64])

    assembly_format = "(`id` `=` $id^)? (`threads` `=` $threads^)? attr-dict"

    def __init__(self, id: int | None = None, threads: int | None = None):
        props = {} if id is None else {"id": IntegerAttr(id, i64), "threads": IntegerAttr(threads, i64)}
        super().__init__(properties=props)

    def verify_(self) -> None:
        if (self.id is None) != (self.threads is None):
            raise VerifyException("barrier: a named barrier gives both id and threads")
        if self.threads is not None and self.threads.value.data % 32:
            raise VerifyException(f"barrier: threads = {self.threads.value.data} is not whole warps")


@irdl_op_definition
class ClusterBarrierOp(_AsyncOp):
    """`tessera_target.cluster_barrier arrive` / `wait`: the two halves of the cluster's barrier
    (every thread of every block of the kernel's cluster arrives, then waits for all the others to
    have arrived; an arrive releases the thread's memory operations and a wait acquires the
    others'). A kernel with cluster gathers arrives at its start and waits before its first one,
    so that no block writes into another's shared memory (or its mbarriers, initialised at entry)
    before that block has started. Each `tile.cluster_gather` then writes its values into every
    block's buffer, completing that block's mbarrier, and waits for its own. It has a buffer of its
    own, two taken in turn in a loop (`DOUBLE_BUFFERED`): another block writes run e + 2's values
    into a buffer only once it has all of run e + 1's, which this block sends after it read run
    e's (its threads meet at a `barrier` before each such gather); and none exits while another may still write to it, as each
    waits for every value sent to it."""

    name = "tessera_target.cluster_barrier"
    phase = prop_def(StringAttr)

    assembly_format = "$phase attr-dict"

    def __init__(self, phase: str):
        super().__init__(properties={"phase": StringAttr(phase)})

    def verify_(self) -> None:
        _check_choice(self, "phase", self.phase.data, ("arrive", "wait"))
        _require(self, "clusters")


@irdl_op_definition
class BulkWaitOp(_CountedWaitOp):
    """`tessera_target.bulk_wait pending = N read`: wait until at most N of this thread's committed
    bulk groups (`bulk_reduce`) are in flight; with `read`, only until the others have read their
    shared memory (which may then be written again), not until their writes are done."""

    name = "tessera_target.bulk_wait"
    read = opt_prop_def(UnitAttr)

    assembly_format = "`pending` `=` $pending (`read` $read^)? attr-dict"

    def __init__(self, pending: int, read: bool = False):
        super().__init__(pending)
        if read:
            self.properties["read"] = UnitAttr()

    def verify_(self) -> None:
        super().verify_()
        _require(self, "tma")


@irdl_op_definition
class StageRowsOp(_AsyncOp):
    """`tessera_target.stage_rows %tile rows_dim = 0 {tessera_target.scratch = .., tessera_target.staging
    = <cols = C, pitch = P>}`: every thread writes its fragments of the fp32 register tile into the
    op's scratch buffer, the tile's axis `rows_dim` along the buffer's rows, a row every P bytes,
    each row's columns past the tile's up to C written as zeros: the buffer then holds the tile as
    a run of memory laid out as its destination (`bulk_reduce`'s source)."""

    name = "tessera_target.stage_rows"
    value = operand_def(builtin.TensorType)
    rows_dim = prop_def(IntegerAttr[I64])

    assembly_format = "$value `rows_dim` `=` $rows_dim attr-dict `:` type($value)"

    def __init__(self, value: SSAValue, rows_dim: int, scratch: Attribute, staging: Attribute):
        super().__init__(operands=[value], properties={"rows_dim": IntegerAttr(rows_dim, i64)},
                         attributes={SCRATCH: scratch, STAGING: staging})

    def verify_(self) -> None:
        if self.rows_dim.value.data not in (0, 1) or self.value.type.get_num_dims() != 2:
            raise VerifyException(f"stage_rows: rows_dim = {self.rows_dim.value.data} of a "
                                  f"{self.value.type.get_num_dims()}-d tile (a 2-d tile's 0 or 1)")
        _require_staged(self)


@irdl_op_definition
class BulkReduceOp(_AsyncOp):
    """`tessera_target.bulk_reduce %dst[%i, ..] tile_dims = [2, 3] rows = 64 {tessera_target.scratch =
    .., tessera_target.staging = <cols = C, pitch = P>} : memref<..>`: thread 0 adds the first `rows`
    rows of the op's scratch buffer (as `stage_rows` wrote them, P bytes a row) to the fp32 rows of
    %dst from the offsets on (the destination dims `tile_dims`: rows, then columns; rows past the
    destination's end left out), with one bulk reduction (`cp.reduce.async.bulk .add.f32`: the copy
    engine reads the buffer and adds in L2), and commits it as a bulk group."""

    name = "tessera_target.bulk_reduce"
    dst = operand_def(MemRefType)
    offsets = var_operand_def(IndexType)
    tile_dims = prop_def(DenseArrayBase[I64])
    rows = prop_def(IntegerAttr[I64])

    assembly_format = "$dst `[` $offsets `]` `tile_dims` `=` $tile_dims `rows` `=` $rows attr-dict `:` type($dst)"

    def __init__(self, dst: SSAValue, offsets: Sequence[SSAValue], tile_dims: Sequence[int], rows: int,
                 scratch: Attribute, staging: Attribute):
        super().__init__(operands=[dst, offsets],
                         properties={"tile_dims": _i64s(tile_dims), "rows": IntegerAttr(rows, i64)},
                         attributes={SCRATCH: scratch, STAGING: staging})

    def verify_(self) -> None:
        t: MemRefType = self.dst.type
        rank = t.get_num_dims()
        if _space(t) == MEMORY_SPACES["shared"] or t.get_element_type() != builtin.f32:
            raise VerifyException(f"bulk_reduce: destination {t} is not an f32 global memref")
        if len(self.offsets) != rank or tuple(self.tile_dims.get_values()) != (rank - 2, rank - 1):
            raise VerifyException(f"bulk_reduce: {len(self.offsets)} offsets and tile_dims "
                                  f"{list(self.tile_dims.get_values())} for a {rank}-d destination (its last two dims)")
        _require_staged(self)
        staging, scratch = self.attributes[STAGING], self.attributes[SCRATCH]
        if self.rows.value.data * staging.pitch.data > scratch.size.data:
            raise VerifyException(f"bulk_reduce: {self.rows.value.data} rows of {staging.pitch.data} bytes overrun "
                                  f"its {scratch.size.data}-byte scratch")
        _require(self, "tma")


def _require_staged(op: Operation) -> None:
    for key, kind in ((SCRATCH, ScratchAttr), (STAGING, StagingAttr)):
        if not isinstance(op.attributes.get(key), kind):
            raise VerifyException(f"{op.name}: needs a {key} attribute (the allocation pass's)")


@irdl_op_definition
class WarpSpecializeOp(_AsyncOp):
    """`tessera_target.warp_specialize producer_warps = 4 { producer } { consumer }`: the block's
    last `producer_warps` warps run the producer region (after its register split, one thread of
    them issues every copy; the others exit), the others run the consumer region. Each region
    starts with its `setmaxnreg` where the register split applies."""

    name = "tessera_target.warp_specialize"
    producer_warps = prop_def(IntegerAttr[I64])
    producer = region_def("single_block")
    consumer = region_def("single_block")
    traits = traits_def(HasAncestor(KernelOp), NoTerminator())

    assembly_format = "`producer_warps` `=` $producer_warps $producer $consumer attr-dict"

    def __init__(self, producer_warps: int, producer: Region, consumer: Region):
        super().__init__(properties={"producer_warps": IntegerAttr(producer_warps, i64)},
                         regions=[producer, consumer])


#: setmaxnreg actions: give registers back (the producer), take them (the consumers)
SETMAXNREG = ("dec", "inc")


@irdl_op_definition
class SetMaxNRegOp(_AsyncOp):
    """`tessera_target.setmaxnreg "inc" regs = 232`: this warpgroup's registers per thread become
    `regs`, given back to or taken from the block's pool (the register split of a
    warp-specialized kernel)."""

    name = "tessera_target.setmaxnreg"
    action = prop_def(StringAttr)
    regs = prop_def(IntegerAttr[I64])

    assembly_format = "$action `regs` `=` $regs attr-dict"

    def __init__(self, action: str, regs: int):
        super().__init__(properties={"action": StringAttr(action), "regs": IntegerAttr(regs, i64)})

    def verify_(self) -> None:
        _check_choice(self, "action", self.action.data, SETMAXNREG)
        _require(self, "setmaxnreg")
        regs = self.regs.value.data
        if regs % 8 or not 24 <= regs <= 256:
            raise VerifyException(f"setmaxnreg: regs = {regs} must be a multiple of 8 in 24..256")
        if not isinstance(self.parent_op(), WarpSpecializeOp):
            raise VerifyException("setmaxnreg: only at the start of a warp_specialize region")


#: the named barrier a warp-specialized kernel's computing warps meet at without its producer
#: (`BarrierOp(CONSUMER_BARRIER, threads)`)
CONSUMER_BARRIER = 1
#: the named barriers warpgroups taking turns meet at: warpgroup w waits at TURN_BARRIER + w
TURN_BARRIER = 2


@irdl_op_definition
class WarpgroupTurnOp(_AsyncOp):
    """`tessera_target.warpgroup_turn take` / `give` [`warpgroup = w`]: the computing warpgroups of a
    warp-specialized kernel issue their wgmmas in turns (`tile.mma_turn`). Warpgroup w takes its
    turn at named barrier TURN_BARRIER + w (bar.sync, the block's computing threads counted) and
    gives it at the next warpgroup's (bar.arrive); with `warpgroup`, only that warpgroup gives."""

    name = "tessera_target.warpgroup_turn"
    action = prop_def(StringAttr)
    warpgroup = opt_prop_def(IntegerAttr[I64])

    assembly_format = "$action (`warpgroup` `=` $warpgroup^)? attr-dict"

    def __init__(self, action: str, warpgroup: int | None = None):
        props = {"action": StringAttr(action)}
        if warpgroup is not None:
            props["warpgroup"] = IntegerAttr(warpgroup, i64)
        super().__init__(properties=props)

    def verify_(self) -> None:
        _check_choice(self, "action", self.action.data, MMA_TURN_ACTIONS)
        if self.warpgroup is not None and self.action.data != "give":
            raise VerifyException("warpgroup_turn: only a give names its warpgroup")


ASYNC_OPS = [TensorMapOp, MBarrierAllocOp, MBarrierInitOp, MBarrierArriveExpectTxOp, MBarrierArriveOp,
             MBarrierTryWaitOp, TmaLoadOp, WgmmaDescriptorOp, CpAsyncCommitOp, CpAsyncWaitOp, WgmmaFenceOp, WgmmaCommitOp,
             WgmmaWaitOp, FenceOp, BarrierOp, ClusterBarrierOp, WarpSpecializeOp, SetMaxNRegOp, BulkWaitOp,
             StageRowsOp, BulkReduceOp, WarpgroupTurnOp]
ASYNC_TYPES = [MBarriersType, TensorMapType, WgmmaDescriptorType]



# ---------------------------------------------------------------------------
# Register layouts: which thread holds which elements of a tile value
# (tessera.ir.layouts), attached to the ops that make tiles by the
# `assign-layouts` pass (tessera.lowering.assign_layouts).
# ---------------------------------------------------------------------------

#: a kernel launched as a programmatic dependent of the kernel before it in the stream (the
#: platform's `programmatic_launch`; every kernel of a call but the first): its body starts with
#: griddepcontrol.wait, which returns once the kernel before it has finished and its writes are
#: visible, so its launch and setup overlap that kernel's last blocks. No kernel triggers its
#: dependents early (griddepcontrol.launch_dependents): they launch as it exits. H100 GQA decode B=1
#: (two kernels), CUDA-graph medians: 8192 keys 13.7 -> 12.8-13.2 us, 32768 54.5 -> 53.5-54.8;
#: triggering at entry instead made the first 17.4 (bench/RESULTS.md, session 18). The launch passes
#: the attribute (`KernelLaunch.programmatic`); a plain launch of the same kernel (the C++
#: package's) waits for nothing.
PROGRAMMATIC_LAUNCH = "tessera_target.programmatic_launch"

#: the attribute on an op holding one layout per result (`#builtin.unit` for a non-tile result)
RESULT_LAYOUTS = "tessera_target.layouts"
#: the attribute on an scf.for holding one layout per argument of its body (the induction variable's unit)
ARG_LAYOUTS = "tessera_target.arg_layouts"


def _pair(values: Sequence[int]) -> str:
    return _int_list_text(values)


@irdl_attr_definition
class BlockedLayoutAttr(ParametrizedAttribute):
    """`#tessera_target.blocked<[128, 64], vec = 8, lanes = [4, 8], warps = [4, 1]>`: each thread holds
    `vec` consecutive columns; lanes span [rows, cols] of a warp's patch, warps [rows, cols] of the
    block's; the pattern repeats to cover the tile (Triton's blocked layout)."""

    name = "tessera_target.blocked"
    shape: ArrayAttr
    vec: IntAttr
    lanes: ArrayAttr
    warps: ArrayAttr

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        shape = _int_array(_parse_int_list(parser))
        fields = {}
        for key in ("vec", "lanes", "warps"):
            parser.parse_punctuation(",")
            parser.parse_keyword(key)
            parser.parse_punctuation("=")
            fields[key] = IntAttr(parser.parse_integer()) if key == "vec" else _int_array(_parse_int_list(parser))
        parser.parse_punctuation(">")
        return [shape, fields["vec"], fields["lanes"], fields["warps"]]

    def print_parameters(self, printer) -> None:
        ints = lambda a: [x.data for x in a.data]   # noqa: E731
        printer.print_string(f"<{_pair(ints(self.shape))}, vec = {self.vec.data}, lanes = {_pair(ints(self.lanes))}, "
                             f"warps = {_pair(ints(self.warps))}>")


@irdl_attr_definition
class MmaLayoutAttr(ParametrizedAttribute):
    """`#tessera_target.mma<[128, 256], warps = [8, 1]>`: the accumulator fragments of m16n8k16 matrix
    instructions (mma.sync's, and wgmma's per warp), warps split [rows, cols] over the tile;
    `#tessera_target.mma<[128, 256], warps = [8, 1], byte_a>`: its columns in 8-bit A-fragment order
    (`layouts.Mma.byte_a`: scores over keys loaded permuted, `lowering.byte_fragments`)."""

    name = "tessera_target.mma"
    shape: ArrayAttr
    warps: ArrayAttr
    byte_a: IntAttr

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        shape = _int_array(_parse_int_list(parser))
        parser.parse_punctuation(",")
        parser.parse_keyword("warps")
        parser.parse_punctuation("=")
        warps = _int_array(_parse_int_list(parser))
        byte_a = parser.parse_optional_punctuation(",") is not None
        if byte_a:
            parser.parse_keyword("byte_a")
        parser.parse_punctuation(">")
        return [shape, warps, IntAttr(int(byte_a))]

    def print_parameters(self, printer) -> None:
        printer.print_string(f"<{_pair([x.data for x in self.shape.data])}, "
                             f"warps = {_pair([x.data for x in self.warps.data])}"
                             f"{', byte_a' if self.byte_a.data else ''}>")


@irdl_attr_definition
class SliceLayoutAttr(ParametrizedAttribute):
    """`#tessera_target.slice<1, #tessera_target.mma<...>>`: a rank-1 tile along dim 1 (or 0) of its
    rank-2 parent layout (a row statistic, a column vector)."""

    name = "tessera_target.slice"
    keep: IntAttr
    parent: Attribute

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        keep = IntAttr(parser.parse_integer())
        parser.parse_punctuation(",")
        parent = parser.parse_attribute()
        parser.parse_punctuation(">")
        return [keep, parent]

    def print_parameters(self, printer) -> None:
        printer.print_string(f"<{self.keep.data}, ")
        printer.print_attribute(self.parent)
        printer.print_string(">")


def layout_attr(layout) -> Attribute:
    """The attribute of a `tessera.ir.layouts` layout."""
    from . import layouts as ly
    if isinstance(layout, ly.Blocked):
        return BlockedLayoutAttr(_int_array(layout.shape), IntAttr(layout.vec), _int_array((layout.tr, layout.tc)),
                                 _int_array((layout.wr, layout.wc)))
    if isinstance(layout, ly.Mma):
        return MmaLayoutAttr(_int_array(layout.shape), _int_array((layout.wm, layout.wn)), IntAttr(int(layout.byte_a)))
    return SliceLayoutAttr(IntAttr(layout.keep), layout_attr(layout.parent))


def layout_of(attr: Attribute):
    """The `tessera.ir.layouts` layout an attribute describes."""
    from . import layouts as ly
    ints = lambda a: tuple(x.data for x in a.data)   # noqa: E731
    if isinstance(attr, BlockedLayoutAttr):
        (tr, tc), (wr, wc) = ints(attr.lanes), ints(attr.warps)
        return ly.Blocked(ints(attr.shape), attr.vec.data, tc, tr, wc, wr)
    if isinstance(attr, MmaLayoutAttr):
        return ly.Mma(ints(attr.shape), *ints(attr.warps), byte_a=bool(attr.byte_a.data))
    if isinstance(attr, SliceLayoutAttr):
        return ly.Slice(layout_of(attr.parent), attr.keep.data)
    raise ValueError(f"{attr} is not a register layout")


LAYOUT_ATTRS = [BlockedLayoutAttr, MmaLayoutAttr, SliceLayoutAttr]


# ---------------------------------------------------------------------------
# Shared memory an op needs for itself, placed by the allocation pass
# (tessera.lowering.shared_memory) after the tile buffers and mbarriers.
# ---------------------------------------------------------------------------

#: the attribute on an op that uses shared memory of its own: where the allocation pass put it
SCRATCH = "tessera_target.scratch"
#: the attribute on a tile.store the allocation pass stages through per-warp shared buffers
STAGING = "tessera_target.staging"
#: the attribute on a tile.cluster_gather that runs in a loop: its scratch holds two buffers (and
#: mbarriers), which its runs take in turn, so that another block's next run may write one while
#: this block still reads the other (`ClusterBarrierOp`)
DOUBLE_BUFFERED = "tessera_target.double_buffered"


class _FieldsAttr(ParametrizedAttribute):
    """Attributes written `<key = int, ...>`, one integer per parameter, in declaration order."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def of(cls, **values: int):
        return cls(*(IntAttr(values[k]) for k in cls.FIELDS))

    @classmethod
    def parse_parameters(cls, parser) -> list[Attribute]:
        parser.parse_punctuation("<")
        values = []
        for i, key in enumerate(cls.FIELDS):
            if i:
                parser.parse_punctuation(",")
            parser.parse_keyword(key)
            parser.parse_punctuation("=")
            values.append(IntAttr(parser.parse_integer()))
        parser.parse_punctuation(">")
        return values

    def print_parameters(self, printer) -> None:
        printer.print_string("<" + ", ".join(f"{k} = {getattr(self, k).data}" for k in self.FIELDS) + ">")


@irdl_attr_definition
class ScratchAttr(_FieldsAttr):
    """`#tessera_target.scratch<offset = 98304, size = 18432>`: `size` bytes at byte `offset` of the
    kernel's dynamic shared memory, the op's own (a row reduction exchanging partials between warps,
    a staged store's per-warp buffers)."""

    name = "tessera_target.scratch"
    offset: IntAttr
    size: IntAttr
    FIELDS: ClassVar[tuple[str, ...]] = ("offset", "size")


@irdl_attr_definition
class StagingAttr(_FieldsAttr):
    """`#tessera_target.staging<cols = 64, pitch = 144>`: the store writes each warp's accumulator
    fragments into its own shared buffer 16 rows x `cols` columns at a time, rows `pitch` bytes
    apart, and reads them back as row-contiguous 16-byte vectors (`shared_memory.Staging`). On a
    `tile.atomic_add` (and the `stage_rows` and `bulk_reduce` it becomes): the block writes the
    whole tile into one shared buffer laid out as its destination, a row (`cols` fp32) of it every
    `pitch` bytes, and adds it to global memory with one bulk reduction
    (`shared_memory.bulk_reduction_pitch`)."""

    name = "tessera_target.staging"
    cols: IntAttr
    pitch: IntAttr
    FIELDS: ClassVar[tuple[str, ...]] = ("cols", "pitch")


SHARED_ATTRS = [ScratchAttr, StagingAttr]


TesseraTarget = Dialect(
    "tessera_target",
    [KernelOp, ReturnOp, LaunchOp, TensorCoreOp, AllocateOp, MemcpyOp, ProfileBeginOp, ProfileEndOp, AssertOp,
     *ASYNC_OPS],
    [PlatformAttr, KernelConfigAttr, *ASYNC_TYPES, *LAYOUT_ATTRS, *SHARED_ATTRS],
)


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------


def target_context() -> Context:
    """A context for Target IR modules: every dialect Tessera prints (Tile IR for the host code
    and the ops lowering keeps, with its arith on tiles)."""
    from . import context
    return context()


def parse_target_module(text: str) -> builtin.ModuleOp:
    """Parse Target IR text into a builtin.module."""
    return Parser(target_context(), text).parse_module()


def print_module(op: Operation) -> str:
    """Target IR text of `op`; `parse_target_module` reads it back to the same text."""
    from . import print_ir
    return print_ir(op)
