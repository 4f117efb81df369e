"""Target IR: platform-specific kernels, as the xDSL dialect `tessera_target`.

Tile IR says *what* a block computes; Target IR says *which hardware mechanism*
does it on one platform: a `tensor_core "wgmma"` instead of a `tile.mma`, a
`memcpy mechanism = "tma"` instead of a `tile.copy_async`. Every kernel carries
its `#tessera_target.platform<...>` and its launch configuration, and the
verifiers check both against the platform registry (`tessera.platforms`), so
an op the target cannot run (wgmma on sm_80, 200 KB of shared memory on sm_86)
is rejected here, before PTX is written.

Ops print in the seeds' style: a head (symbol, instruction string, operands),
then `keyword = value` properties, then ` : types`. The keyword part is driven
by each op's `KEYWORDS` table, shared by its printer and parser.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    IntegerAttr,
    MemRefType,
    StringAttr,
    SymbolNameConstraint,
    SymbolRefAttr,
    i1,
    i64,
)
from xdsl.ir import Attribute, Block, Dialect, Operation, ParametrizedAttribute, Region, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
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
    HasAncestor,
    HasParent,
    IsolatedFromAbove,
    IsTerminator,
    SymbolOpInterface,
    SymbolTable,
    SymbolUserOpInterface,
)
from xdsl.utils.exceptions import VerifyException

from .. import platforms
from ..platforms import Platform

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
    return parser.parse_comma_separated_list(parser.Delimiter.SQUARE, parser.parse_integer)


def _int_list_text(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


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


# ---------------------------------------------------------------------------
# Keyword properties: `name = value`, one printer and parser per value kind
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    """How one kind of property value reads in op text."""

    print: Callable[[Printer, Attribute], None]
    parse: Callable[[Parser], Attribute]


INT = _Kind(lambda pr, a: pr.print_string(str(a.value.data)),
            lambda pa: IntegerAttr(pa.parse_integer(), i64))
STR = _Kind(lambda pr, a: pr.print_string_literal(a.data),
            lambda pa: StringAttr(pa.parse_str_literal()))
BOOL = _Kind(lambda pr, a: pr.print_string("true" if a.value.data else "false"),
             lambda pa: IntegerAttr.from_bool(pa.parse_boolean()))
INTS = _Kind(lambda pr, a: pr.print_string(_int_list_text(a.iter_values())),
             lambda pa: DenseArrayBase.from_list(i64, _parse_int_list(pa)))
ATTR = _Kind(lambda pr, a: pr.print_attribute(a), lambda pa: pa.parse_attribute())

# An op's keyword properties, in print order: (property name, value kind).
_Keywords = tuple[tuple[str, _Kind], ...]


def _print_keywords(printer: Printer, op: IRDLOperation) -> None:
    for key, kind in op.KEYWORDS:
        if (value := op.properties.get(key)) is not None:
            printer.print_string(f" {key} = ")
            kind.print(printer, value)


def _parse_keywords(parser: Parser, keywords: _Keywords) -> dict[str, Attribute]:
    kinds = dict(keywords)
    props: dict[str, Attribute] = {}
    while (key := parser.parse_optional_keyword_in(kinds)) is not None:
        parser.parse_punctuation("=")
        props[key] = kinds[key].parse(parser)
    return props


def _print_attr_dict(printer: Printer, op: Operation) -> None:
    printer.print_op_attributes(op.attributes, print_keyword=True)


def _parse_attr_dict(parser: Parser) -> dict[str, Attribute]:
    attrs = parser.parse_optional_attr_dict_with_keyword()
    return dict(attrs.data) if attrs is not None else {}


def _print_operand_list(printer: Printer, values: Sequence[SSAValue], open_: str = "(", close: str = ")"):
    printer.print_string(open_)
    printer.print_list(values, printer.print_operand)
    printer.print_string(close)


def _parse_operand_list(parser: Parser, delimiter=Parser.Delimiter.PAREN):
    return parser.parse_comma_separated_list(delimiter, parser.parse_unresolved_operand)


def _print_signature(printer: Printer, operands: Sequence[SSAValue], results: Sequence[SSAValue]) -> None:
    if operands or results:
        printer.print_string(" : ")
        printer.print_function_type([o.type for o in operands], [r.type for r in results])


def _parse_signature(parser: Parser, operands) -> tuple[list[SSAValue], list[Attribute]]:
    """Parse an optional ` : (ins) -> outs` and resolve `operands` against it."""
    if parser.parse_optional_punctuation(":") is None:
        return [], []
    pos = parser.pos
    signature = parser.parse_function_type()
    return (list(parser.resolve_operands(operands, signature.inputs.data, pos)),
            list(signature.outputs.data))


def _set(value: int | str | bool | Sequence[int] | Attribute | None, kind: _Kind) -> Attribute | None:
    """A Python value as the property attribute `kind` stores."""
    if value is None or isinstance(value, Attribute):
        return value
    if kind is STR:
        return StringAttr(value)
    if kind is BOOL:
        return IntegerAttr.from_bool(value)
    if kind is INTS:
        return DenseArrayBase.from_list(i64, list(value))
    return IntegerAttr(value, i64)


def _props(op_cls, **values) -> dict[str, Attribute]:
    kinds = dict(op_cls.KEYWORDS)
    return {k: _set(v, kinds[k]) for k, v in values.items() if v is not None}


def _check_choice(op: Operation, what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise VerifyException(f"{op.name}: {what} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


class _KeywordOp(IRDLOperation):
    """Ops whose text is `name kw = v ... attributes {...}` with no operands."""

    KEYWORDS: ClassVar[_Keywords] = ()

    @classmethod
    def parse(cls, parser: Parser):
        op = cls.create(properties=_parse_keywords(parser, cls.KEYWORDS))
        op.attributes |= _parse_attr_dict(parser)
        return op

    def print(self, printer: Printer) -> None:
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)


class _InstrOp(IRDLOperation):
    """Ops whose text is `name "instr" (%operands) kw = v ... : (ins) -> outs`."""

    KEYWORDS: ClassVar[_Keywords] = ()
    HEAD: ClassVar[str] = "instruction"

    @classmethod
    def parse(cls, parser: Parser):
        head = StringAttr(parser.parse_str_literal())
        operands = _parse_operand_list(parser)
        props = _parse_keywords(parser, cls.KEYWORDS)
        attrs = _parse_attr_dict(parser)
        values, result_types = _parse_signature(parser, operands)
        op = cls.create(operands=values, result_types=result_types, properties={cls.HEAD: head, **props})
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_string_literal(self.properties[self.HEAD].data)
        printer.print_string(" ")
        _print_operand_list(printer, self.operands)
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)
        _print_signature(printer, self.operands, self.results)


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


@irdl_op_definition
class KernelOp(IRDLOperation):
    """`tessera_target.kernel @name(%args) config = #... platform = #... { ... }`."""

    name = "tessera_target.kernel"
    sym_name = prop_def(SymbolNameConstraint())
    function_type = prop_def(FunctionType)
    config = prop_def(KernelConfigAttr)
    platform = prop_def(PlatformAttr)
    opt_level = opt_prop_def(IntegerAttr)
    producer_warps = opt_prop_def(IntegerAttr)   # of the config's block: warps that only issue copies
    body = region_def("single_block")
    traits = traits_def(IsolatedFromAbove(), SymbolOpInterface())

    KEYWORDS: ClassVar[_Keywords] = (("config", ATTR), ("platform", ATTR), ("opt_level", INT),
                                     ("producer_warps", INT))

    def __init__(self, name: str, arg_types: Sequence[Attribute], config: KernelConfigAttr,
                 platform: PlatformAttr, body: Region | None = None, opt_level: int | None = None,
                 producer_warps: int | None = None):
        super().__init__(
            properties={"sym_name": StringAttr(name), "function_type": FunctionType.from_lists(arg_types, []),
                        **_props(KernelOp, config=config, platform=platform, opt_level=opt_level,
                                 producer_warps=producer_warps)},
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

    @classmethod
    def parse(cls, parser: Parser) -> KernelOp:
        name = parser.parse_symbol_name().data
        args = parser.parse_comma_separated_list(parser.Delimiter.PAREN, parser.parse_argument)
        props = _parse_keywords(parser, cls.KEYWORDS)
        attrs = _parse_attr_dict(parser)
        body = parser.parse_region(args)
        op = cls.create(properties={"sym_name": StringAttr(name),
                                    "function_type": FunctionType.from_lists([a.type for a in args], []),
                                    **props},
                        regions=[body])
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_symbol_name(self.sym_name.data)
        printer.print_string("(")
        printer.print_list(self.body.block.args, printer.print_block_argument)
        printer.print_string(")")
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)
        printer.print_string(" ")
        printer.print_region(self.body, print_entry_block_args=False)


@irdl_op_definition
class ReturnOp(_KeywordOp):
    """`tessera_target.return`: the end of a kernel."""

    name = "tessera_target.return"
    traits = traits_def(HasParent(KernelOp), IsTerminator())


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
    grid = prop_def(DenseArrayBase)
    block = prop_def(DenseArrayBase)
    shared = prop_def(IntegerAttr)
    args = var_operand_def()
    traits = traits_def(_LaunchSymbolUser())

    KEYWORDS: ClassVar[_Keywords] = (("grid", INTS), ("block", INTS), ("shared", INT))

    def __init__(self, kernel: str, args: Sequence[SSAValue], grid: Sequence[int], block: Sequence[int], shared: int):
        super().__init__(operands=[args], properties={
            "kernel": SymbolRefAttr(kernel), **_props(LaunchOp, grid=grid, block=block, shared=shared)})

    @classmethod
    def parse(cls, parser: Parser) -> LaunchOp:
        kernel = parser.parse_symbol_name()
        operands = _parse_operand_list(parser)
        props = _parse_keywords(parser, cls.KEYWORDS)
        attrs = _parse_attr_dict(parser)
        parser.parse_punctuation(":")
        pos = parser.pos
        types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type) if operands else []
        op = cls.create(operands=list(parser.resolve_operands(operands, types, pos)),
                        properties={"kernel": SymbolRefAttr(kernel), **props})
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_symbol_name(self.kernel.root_reference.data)
        _print_operand_list(printer, self.args)
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)
        printer.print_string(" : ")
        printer.print_list(self.args.types, printer.print_attribute)


# ---------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------

LAYOUTS = ("nn", "nt")


@irdl_op_definition
class TensorCoreOp(_InstrOp):
    """`%d = tessera_target.tensor_core "mma.sync" (%a, %b, %acc) shape = [m, n, k] layout = "nt"
    precision = "f16" : (...) -> acc type`: acc + a @ b on the platform's matrix units.

    `shape` is one instruction's shape, `precision` the MLIR element type of a
    and b; layout "nt" means b is N x K. The verifier accepts only a
    (family, shape, precision) the enclosing kernel's platform has.
    """

    name = "tessera_target.tensor_core"
    family = prop_def(StringAttr)
    shape = prop_def(DenseArrayBase)
    layout = prop_def(StringAttr)
    precision = prop_def(StringAttr)
    a = operand_def()
    b = operand_def()
    acc = operand_def()
    result = result_def()
    traits = traits_def(HasAncestor(KernelOp))

    HEAD: ClassVar[str] = "family"
    KEYWORDS: ClassVar[_Keywords] = (("shape", INTS), ("layout", STR), ("precision", STR))

    def __init__(self, family: str, a: SSAValue, b: SSAValue, acc: SSAValue, shape: Sequence[int],
                 layout: str, precision: str):
        super().__init__(operands=[a, b, acc], result_types=[acc.type], properties={
            "family": StringAttr(family), **_props(TensorCoreOp, shape=shape, layout=layout, precision=precision)})

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


@irdl_op_definition
class PTXInstrOp(_InstrOp):
    """`tessera_target.ptx_instr "cp.async.commit_group" (%ops) constraints = {...} latency = N
    predicate = %p : (...) -> (...)`: one PTX instruction the emitter writes as is.

    `constraints` maps operands to inline-asm constraint letters; `latency` is
    a scheduling hint in cycles; `predicate` guards the instruction.
    """

    name = "tessera_target.ptx_instr"
    instruction = prop_def(StringAttr)
    constraints = opt_prop_def(builtin.DictionaryAttr)
    latency = opt_prop_def(IntegerAttr)
    args = var_operand_def()
    predicate = opt_operand_def(i1)
    outs = var_result_def()
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    traits = traits_def(HasAncestor(KernelOp))

    KEYWORDS: ClassVar[_Keywords] = (("constraints", ATTR), ("latency", INT))
    VENDOR: ClassVar[str] = "nvidia"

    def __init__(self, instruction: str, args: Sequence[SSAValue] = (), result_types: Sequence[Attribute] = (),
                 constraints: builtin.DictionaryAttr | None = None, latency: int | None = None,
                 predicate: SSAValue | None = None):
        super().__init__(operands=[args, [predicate] if predicate is not None else []], result_types=[result_types],
                         properties={"instruction": StringAttr(instruction),
                                     **_props(PTXInstrOp, constraints=constraints, latency=latency)})

    def verify_(self) -> None:
        p = _platform_of(self)
        if p.vendor != self.VENDOR:
            raise VerifyException(f"{self.name} {self.instruction.data!r} in a kernel for {p.arch} ({p.vendor})")

    @classmethod
    def parse(cls, parser: Parser) -> PTXInstrOp:
        instruction = parser.parse_str_literal()
        args = _parse_operand_list(parser)
        props = _parse_keywords(parser, cls.KEYWORDS)
        predicate = None
        if parser.parse_optional_keyword("predicate") is not None:
            parser.parse_punctuation("=")
            predicate = parser.resolve_operand(parser.parse_unresolved_operand(), i1)
        attrs = _parse_attr_dict(parser)
        values, result_types = _parse_signature(parser, args)
        op = cls(instruction, values, result_types, predicate=predicate)
        op.properties |= props
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_string_literal(self.instruction.data)
        printer.print_string(" ")
        _print_operand_list(printer, self.args)
        _print_keywords(printer, self)
        if self.predicate is not None:
            printer.print_string(" predicate = ")
            printer.print_operand(self.predicate)
        _print_attr_dict(printer, self)
        _print_signature(printer, self.args, self.outs)


@irdl_op_definition
class HIPInstrOp(_InstrOp):
    """`tessera_target.hip_instr "v_wmma_f32_16x16x16_f16" (%ops) arch = "gfx1100"
    constraints = {...} latency = N : (...) -> (...)`: one AMD GCN/RDNA instruction."""

    name = "tessera_target.hip_instr"
    instruction = prop_def(StringAttr)
    arch = opt_prop_def(StringAttr)
    constraints = opt_prop_def(builtin.DictionaryAttr)
    latency = opt_prop_def(IntegerAttr)
    args = var_operand_def()
    outs = var_result_def()
    traits = traits_def(HasAncestor(KernelOp))

    KEYWORDS: ClassVar[_Keywords] = (("arch", STR), ("constraints", ATTR), ("latency", INT))
    VENDOR: ClassVar[str] = "amd"

    def __init__(self, instruction: str, args: Sequence[SSAValue] = (), result_types: Sequence[Attribute] = (),
                 arch: str | None = None, constraints: builtin.DictionaryAttr | None = None,
                 latency: int | None = None):
        super().__init__(operands=[args], result_types=[result_types], properties={
            "instruction": StringAttr(instruction),
            **_props(HIPInstrOp, arch=arch, constraints=constraints, latency=latency)})

    def verify_(self) -> None:
        p = _platform_of(self)
        if p.vendor != self.VENDOR or (self.arch is not None and self.arch.data != p.arch):
            raise VerifyException(f"{self.name} {self.instruction.data!r} in a kernel for {p.arch} ({p.vendor})")


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

POOLS = ("shared", "global", "register", "tmem")
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
class AllocateOp(_KeywordOp):
    """`%buf = tessera_target.allocate pool = "shared" align = 128 size = 16384 : memref<...>`."""

    name = "tessera_target.allocate"
    pool = prop_def(StringAttr)
    align = prop_def(IntegerAttr)
    size = prop_def(IntegerAttr)
    result = result_def(MemRefType)

    KEYWORDS: ClassVar[_Keywords] = (("pool", STR), ("align", INT), ("size", INT))

    def __init__(self, result_type: MemRefType, pool: str, size: int, align: int = 16):
        super().__init__(result_types=[result_type], properties=_props(AllocateOp, pool=pool, align=align, size=size))

    def verify_(self) -> None:
        _check_choice(self, "pool", self.pool.data, POOLS)
        align, size = self.align.value.data, self.size.value.data
        if align < 1 or align & (align - 1):
            raise VerifyException(f"allocate: align = {align} is not a power of two")
        if self.result.type.has_static_shape() and size < memref_bytes(self.result.type):
            raise VerifyException(f"allocate: size = {size} bytes is less than the "
                                  f"{memref_bytes(self.result.type)} bytes of {self.result.type}")

    @classmethod
    def parse(cls, parser: Parser) -> AllocateOp:
        props = _parse_keywords(parser, cls.KEYWORDS)
        attrs = _parse_attr_dict(parser)
        parser.parse_punctuation(":")
        op = cls.create(result_types=[parser.parse_type()], properties=props)
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        super().print(printer)
        printer.print_string(" : ")
        printer.print_attribute(self.result.type)


@irdl_op_definition
class MemcpyOp(IRDLOperation):
    """`tessera_target.memcpy %dst[%stage], %src[%i, %j] kind = "global_to_shared" async = true
    mechanism = "cp.async" tile_dims = [0, 1] padding = 0.0 : dst type, src type`.

    Copies the tile `dst[dst_indices]` from `src` at `src_indices` (a tile.load
    read: `tile_dims` are the src dims the tile spans, out-of-bounds elements
    read as `padding`). `mechanism` is how the hardware moves it.
    """

    name = "tessera_target.memcpy"
    dst = operand_def(MemRefType)
    dst_indices = var_operand_def(IndexType)
    src = operand_def(MemRefType)
    src_indices = var_operand_def(IndexType)
    kind = prop_def(StringAttr)
    is_async = prop_def(IntegerAttr, prop_name="async")
    mechanism = prop_def(StringAttr)
    tile_dims = opt_prop_def(DenseArrayBase)
    padding = opt_prop_def(FloatAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    traits = traits_def(HasAncestor(KernelOp))

    KEYWORDS: ClassVar[_Keywords] = (("kind", STR), ("async", BOOL), ("mechanism", STR), ("tile_dims", INTS),
                                     ("padding", ATTR))

    def __init__(self, dst: SSAValue, dst_indices: Sequence[SSAValue], src: SSAValue,
                 src_indices: Sequence[SSAValue], kind: str, is_async: bool, mechanism: str,
                 tile_dims: Sequence[int] | None = None, padding: FloatAttr | None = None):
        super().__init__(operands=[dst, dst_indices, src, src_indices], properties=_props(
            MemcpyOp, kind=kind, mechanism=mechanism, tile_dims=tile_dims, padding=padding, **{"async": is_async}))

    def verify_(self) -> None:
        _check_choice(self, "kind", self.kind.data, MEMCPY_KINDS)
        src_memory, dst_memory = self.kind.data.split("_to_")
        for role, value, memory in (("src", self.src, src_memory), ("dst", self.dst, dst_memory)):
            if _space(value.type) != MEMORY_SPACES[memory]:
                raise VerifyException(f"memcpy {self.kind.data}: {role} {value.type} is not in {memory} memory")
        p, padding = _platform_of(self), self.padding.value.data if self.padding is not None else 0.0
        _check_choice(self, f"mechanism on {p.arch} for padding {padding}", self.mechanism.data,
                      platforms.copy_mechanisms(p, padding))

    @classmethod
    def parse(cls, parser: Parser) -> MemcpyOp:
        dst = parser.parse_unresolved_operand()
        dst_indices = _parse_operand_list(parser, parser.Delimiter.SQUARE)
        parser.parse_punctuation(",")
        src = parser.parse_unresolved_operand()
        src_indices = _parse_operand_list(parser, parser.Delimiter.SQUARE)
        props = _parse_keywords(parser, cls.KEYWORDS)
        attrs = _parse_attr_dict(parser)
        parser.parse_punctuation(":")
        pos = parser.pos
        dst_type = parser.parse_type()
        parser.parse_punctuation(",")
        src_type = parser.parse_type()
        index = IndexType()
        dst_v, src_v = parser.resolve_operands([dst, src], [dst_type, src_type], pos)
        op = cls.create(
            operands=[dst_v, *parser.resolve_operands(dst_indices, [index] * len(dst_indices), pos),
                      src_v, *parser.resolve_operands(src_indices, [index] * len(src_indices), pos)],
            properties={**props, "operandSegmentSizes": DenseArrayBase.from_list(
                builtin.i32, [1, len(dst_indices), 1, len(src_indices)])})
        op.attributes |= attrs
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_operand(self.dst)
        _print_operand_list(printer, self.dst_indices, "[", "]")
        printer.print_string(", ")
        printer.print_operand(self.src)
        _print_operand_list(printer, self.src_indices, "[", "]")
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)
        printer.print_string(" : ")
        printer.print_list((self.dst.type, self.src.type), printer.print_attribute)


# ---------------------------------------------------------------------------
# Synchronisation and debugging
# ---------------------------------------------------------------------------

# Scope -> the platform feature it needs (None: every platform has it).
SYNC_SCOPES: dict[str, str | None] = {"block": None, "warp": None, "async_group": None, "cluster": "clusters",
                                     "mbarrier": "tma", "mma_group": "wgmma"}
#: scopes that count groups still in flight (`pending = N`)
_COUNTED_SCOPES = ("async_group", "mma_group")


@irdl_op_definition
class SyncOp(_KeywordOp):
    """`tessera_target.sync scope = "block"`, or `scope = "async_group" pending = N`:
    wait until at most N committed groups of async copies are in flight, or
    `scope = "mbarrier"`: the shared-memory stage read next waits until its TMA
    copies have landed (its mbarrier's phase completes), or `scope = "mma_group"
    pending = N`: wait until at most N committed groups of async mmas (wgmma) run."""

    name = "tessera_target.sync"
    scope = prop_def(StringAttr)
    pending = opt_prop_def(IntegerAttr)
    traits = traits_def(HasAncestor(KernelOp))

    KEYWORDS: ClassVar[_Keywords] = (("scope", STR), ("pending", INT))

    def __init__(self, scope: str, pending: int | None = None):
        super().__init__(properties=_props(SyncOp, scope=scope, pending=pending))

    def verify_(self) -> None:
        scope = self.scope.data
        _check_choice(self, "scope", scope, tuple(SYNC_SCOPES))
        if (self.pending is not None) != (scope in _COUNTED_SCOPES):
            raise VerifyException(f"sync: pending is required for scopes {_COUNTED_SCOPES} and only allowed there")
        p, feature = _platform_of(self), SYNC_SCOPES[scope]
        if feature is not None and not p.has(feature):
            raise VerifyException(f"sync: scope {scope!r} needs {feature}, which {p.arch} does not have")


class _LabelOp(_KeywordOp):
    KEYWORDS: ClassVar[_Keywords] = (("label", STR),)

    def __init__(self, label: str):
        super().__init__(properties={"label": StringAttr(label)})


@irdl_op_definition
class ProfileBeginOp(_LabelOp):
    """`tessera_target.profile_begin label = "mainloop"`: start of a timed region."""

    name = "tessera_target.profile_begin"
    label = prop_def(StringAttr)


@irdl_op_definition
class ProfileEndOp(_LabelOp):
    """`tessera_target.profile_end label = "mainloop"`: end of a timed region."""

    name = "tessera_target.profile_end"
    label = prop_def(StringAttr)


@irdl_op_definition
class BreakpointOp(_LabelOp):
    """`tessera_target.breakpoint label = "before_gemm"`: a debugger trap point."""

    name = "tessera_target.breakpoint"
    label = prop_def(StringAttr)


@irdl_op_definition
class AssertOp(IRDLOperation):
    """`tessera_target.assert %cond message = "..."`: trap with `message` when %cond is false."""

    name = "tessera_target.assert"
    condition = operand_def(i1)
    message = prop_def(StringAttr)

    KEYWORDS: ClassVar[_Keywords] = (("message", STR),)

    def __init__(self, condition: SSAValue, message: str):
        super().__init__(operands=[condition], properties={"message": StringAttr(message)})

    @classmethod
    def parse(cls, parser: Parser) -> AssertOp:
        condition = parser.resolve_operand(parser.parse_unresolved_operand(), i1)
        op = cls.create(operands=[condition], properties=_parse_keywords(parser, cls.KEYWORDS))
        op.attributes |= _parse_attr_dict(parser)
        return op

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_operand(self.condition)
        _print_keywords(printer, self)
        _print_attr_dict(printer, self)


TesseraTarget = Dialect(
    "tessera_target",
    [KernelOp, ReturnOp, LaunchOp, TensorCoreOp, PTXInstrOp, HIPInstrOp, AllocateOp, MemcpyOp, SyncOp,
     ProfileBeginOp, ProfileEndOp, AssertOp, BreakpointOp],
    [PlatformAttr, KernelConfigAttr],
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
