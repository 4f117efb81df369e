"""cuda_tile programs as plain Python data.

NVIDIA's CUDA Tile IR (the `cuda_tile` MLIR dialect) is the second backend's target: Tessera writes
each kernel as one `cuda_tile.entry`, serializes it as bytecode (`bytecode.py`) and lets NVIDIA's
`tileiras` assemble it to a cubin. This module holds the program itself: types, SSA values, ops,
blocks and regions, the module, and a `Builder` with one small typed method per op.

One fact lives in one place: `SCHEMAS` says, for every op we emit, its operands (single, optional or
variadic), its attributes with their kinds and the bytecode version that introduced them, how many
results it has and how many regions. The printer (`text.py`) and the encoder (`bytecode.py`) both
read it, so an op added here is printed and encoded without a second list to keep in step.

Nothing here knows about files or tools; it needs neither xDSL nor NumPy (constants accept NumPy
arrays when given one).
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

# --------------------------------------------------------------------------------------------------
# Types
# --------------------------------------------------------------------------------------------------


class Type:
    """A cuda_tile type. Subclasses are frozen dataclasses, so types compare and hash by value."""


@dataclass(frozen=True)
class ScalarType(Type):
    """An element type: `i1` .. `i64`, `f16`, `bf16`, `f32`, `tf32`, `f64`, `f8E4M3FN`, `f8E5M2`."""
    name: str

    @property
    def is_float(self) -> bool:
        return not self.name.startswith("i")

    @property
    def bits(self) -> int:
        return _SCALAR_BITS[self.name]

    def __str__(self) -> str:
        return self.name


_SCALAR_BITS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "f16": 16, "bf16": 16,
                "f32": 32, "tf32": 19, "f64": 64, "f8E4M3FN": 8, "f8E5M2": 8}

I1, I8, I16, I32, I64 = (ScalarType(n) for n in ("i1", "i8", "i16", "i32", "i64"))
F16, BF16, F32, TF32, F64 = (ScalarType(n) for n in ("f16", "bf16", "f32", "tf32", "f64"))
F8E4M3FN, F8E5M2 = ScalarType("f8E4M3FN"), ScalarType("f8E5M2")
SCALAR_TYPES = {t.name: t for t in (I1, I8, I16, I32, I64, F16, BF16, F32, TF32, F64, F8E4M3FN, F8E5M2)}


@dataclass(frozen=True)
class PointerType(Type):
    """`ptr<elem>`: a global-memory address. Only ever used as a tile element (`tile<ptr<f32>>`)."""
    pointee: ScalarType

    def __str__(self) -> str:
        return f"ptr<{self.pointee}>"


@dataclass(frozen=True)
class TileType(Type):
    """`tile<d0 x d1 x elem>`: an immutable block-wide array; shape () is a 0-d tile (a scalar).
    Every dim must be a power of two (the dialect's rule)."""
    element: ScalarType | PointerType
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_element(self, element: ScalarType | PointerType) -> TileType:
        return TileType(element, self.shape)

    def with_shape(self, shape: Sequence[int]) -> TileType:
        return TileType(self.element, tuple(shape))


@dataclass(frozen=True)
class TensorViewType(Type):
    """`tensor_view<shape x elem, strides=[...]>`: a strided global array. A dim or stride of None is
    dynamic (`?`): it comes from a value at `make_tensor_view` time."""
    element: ScalarType
    shape: tuple[int | None, ...]
    strides: tuple[int | None, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.strides):
            raise ValueError(f"tensor_view shape {self.shape} and strides {self.strides} differ in rank")
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "strides", tuple(self.strides))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def num_dynamic_shape(self) -> int:
        return sum(d is None for d in self.shape)

    @property
    def num_dynamic_strides(self) -> int:
        return sum(s is None for s in self.strides)


PADDING_VALUES = ("zero", "neg_zero", "nan", "pos_inf", "neg_inf")


@dataclass(frozen=True)
class PartitionViewType(Type):
    """`partition_view<tile=(...), tensor_view<...>>`: a tensor view cut into a grid of tiles, indexed
    by tile coordinates. `padding` (one of PADDING_VALUES, or None for "unspecified") is what loads
    read outside the tensor: tail tiles load padding and their out-of-bounds stores are dropped.
    `dim_map[i]` is the tensor dim that tile dim i walks (identity when None)."""
    tile_shape: tuple[int, ...]
    tensor_view: TensorViewType
    dim_map: tuple[int, ...] | None = None
    padding: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "tile_shape", tuple(self.tile_shape))
        if self.dim_map is None:
            object.__setattr__(self, "dim_map", tuple(range(len(self.tile_shape))))
        else:
            object.__setattr__(self, "dim_map", tuple(self.dim_map))
        if self.padding is not None and self.padding not in PADDING_VALUES:
            raise ValueError(f"padding {self.padding!r} is not one of {PADDING_VALUES}")

    @property
    def rank(self) -> int:
        return len(self.tile_shape)


@dataclass(frozen=True)
class TokenType(Type):
    """`token`: orders memory operations that the dataflow alone does not order."""


TOKEN = TokenType()


def tile(element: ScalarType | PointerType, *shape: int) -> TileType:
    """`tile(F32, 128, 64)` is `tile<128x64xf32>`; `tile(I32)` is the 0-d `tile<i32>`."""
    return TileType(element, tuple(shape))


def ptr(pointee: ScalarType) -> PointerType:
    return PointerType(pointee)


# --------------------------------------------------------------------------------------------------
# Attribute values that are more than a Python scalar
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DivBy:
    """`assume div_by<n>`: the value (an integer, or a pointer's address in bytes) is a multiple of n.
    With `every`/`along`, only every `every`-th element along dim `along` is (for tiles)."""
    divisor: int
    every: int | None = None
    along: int | None = None


@dataclass(frozen=True)
class Bounded:
    """`assume bounded<lb, ub>`: lb <= value <= ub (either side may be None, printed `?`)."""
    lb: int | None
    ub: int | None


@dataclass(frozen=True)
class LoadStoreHints:
    """Per-load/store hints: `latency` (1..10, how long the scheduler should expect it to take) and
    `allow_tma` (False keeps a view load off the TMA unit)."""
    latency: int | None = None
    allow_tma: bool | None = None


@dataclass(frozen=True)
class EntryHints:
    """Per-kernel hints: `num_cta_in_cga` (cluster size, 1/2/4/8/16 on sm_90+), `occupancy` (CTAs per
    SM to aim for, 1..32) and `num_worker_warps_per_cta` (bytecode >= 13.3)."""
    num_cta_in_cga: int | None = None
    occupancy: int | None = None
    num_worker_warps_per_cta: int | None = None


@dataclass(frozen=True)
class DenseConstant:
    """A constant's value: `values` is one number (a splat) or a flat row-major tuple for `shape`."""
    element: ScalarType
    values: tuple

    @property
    def is_splat(self) -> bool:
        return len(self.values) == 1


# --------------------------------------------------------------------------------------------------
# Op schemas: the single table the printer and the encoder read
# --------------------------------------------------------------------------------------------------

V13_1, V13_2, V13_3, V13_4, V13_5 = (13, 1), (13, 2), (13, 3), (13, 4), (13, 5)

# Attribute kinds. `enum:<name>` attributes take one of ENUMS[name] (a string); `flag` is a unit
# attribute (present or not, carried only in the op's flags bits).
ENUMS: dict[str, tuple[str, ...]] = {
    "rounding": ("nearest_even", "zero", "negative_inf", "positive_inf", "approx", "full",
                 "nearest_int_to_zero", "nearest_away"),
    "signedness": ("unsigned", "signed"),
    "predicate": ("equal", "not_equal", "less_than", "less_than_or_equal", "greater_than",
                  "greater_than_or_equal"),
    "ordering": ("unordered", "ordered"),
    "overflow": ("none", "no_signed_wrap", "no_unsigned_wrap", "no_wrap"),
    "memory_ordering": ("weak", "relaxed", "acquire", "release", "acq_rel"),
    "memory_scope": ("tl_blk", "device", "sys"),
}
ATTR_KINDS = {"flag", "int", "bool", "str", "dense", "i32_array", "bool_array", "hints", "predicate",
              "identities"} | {f"enum:{e}" for e in ENUMS}


@dataclass(frozen=True)
class OperandSpec:
    name: str
    arity: str = "one"          # "one" | "optional" | "variadic"


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: str
    optional: bool = False      # optional attributes are absent when None (and take a flags bit)
    since: tuple[int, int] = V13_1
    default: Any = None         # the value an absent attribute means: the printer elides it, the
                                # encoder writes it, and versions before `since` imply it

    def __post_init__(self):
        assert self.kind in ATTR_KINDS, self.kind


@dataclass(frozen=True)
class OpSchema:
    """What an op carries. `results` is a count, or None for "as many as the op is given"."""
    name: str
    opcode: int
    operands: tuple[OperandSpec, ...] = ()
    attrs: tuple[AttrSpec, ...] = ()
    results: int | None = 1
    regions: int = 0
    since: tuple[int, int] = V13_1

    @property
    def variable_operand_groups(self) -> int:
        return sum(o.arity != "one" for o in self.operands)

    @property
    def segmented_operands(self) -> bool:
        """More than one variable-length operand group: each group is encoded on its own
        (MLIR's AttrSizedOperandSegments) instead of as one counted list."""
        return self.variable_operand_groups > 1

    @property
    def counted_results(self) -> bool:
        """The bytecode writes a result count before the result types for ops with a variadic
        operand group or variadic results (optional operands alone do not count)."""
        return self.results is None or any(o.arity == "variadic" for o in self.operands)

    def flag_fields(self) -> list[tuple[str, tuple[int, int]]]:
        """The op's flags bits in bit order: unit and optional attributes, then (segmented ops only)
        optional operands; fields added in later versions take the higher bits."""
        fields = [(a.name, a.since) for a in self.attrs if a.kind == "flag" or a.optional]
        if self.segmented_operands:
            fields += [(o.name, self.since) for o in self.operands if o.arity == "optional"]
        return sorted(fields, key=lambda f: f[1])   # stable: declaration order within a version


def _ops(*names: str) -> tuple[OperandSpec, ...]:
    """Operand specs from names; a trailing `?` marks optional, `*` variadic."""
    return tuple(OperandSpec(n.rstrip("?*"), "optional" if n.endswith("?") else
                             "variadic" if n.endswith("*") else "one") for n in names)


_RND = AttrSpec("rounding_mode", "enum:rounding", default="nearest_even")
_FTZ = AttrSpec("flush_to_zero", "flag")
_NAN = AttrSpec("propagate_nan", "flag")
_OVF = AttrSpec("overflow", "enum:overflow", default="none")
_SGN = AttrSpec("signedness", "enum:signedness")
_MEM = (AttrSpec("memory_ordering_semantics", "enum:memory_ordering"),
        AttrSpec("memory_scope", "enum:memory_scope", optional=True),
        AttrSpec("optimization_hints", "hints", optional=True))
_BIN = _ops("lhs", "rhs")
_UN = _ops("source")


def _schemas() -> dict[str, OpSchema]:
    s = [
        # arithmetic on floats
        OpSchema("absf", 0, _UN),
        OpSchema("addf", 2, _BIN, (_RND, _FTZ)),
        OpSchema("subf", 103, _BIN, (_RND, _FTZ)),
        OpSchema("mulf", 76, _BIN, (_RND, _FTZ)),
        OpSchema("divf", 20, _BIN, (_RND, _FTZ)),
        OpSchema("remf", 89, _BIN),
        OpSchema("negf", 79, _UN),
        OpSchema("maxf", 69, _BIN, (_NAN, _FTZ)),
        OpSchema("minf", 71, _BIN, (_NAN, _FTZ)),
        OpSchema("fma", 40, _ops("lhs", "rhs", "acc"), (_RND, _FTZ)),
        OpSchema("exp", 23, _UN, (AttrSpec("rounding_mode", "enum:rounding", since=V13_3, default="full"),)),
        OpSchema("exp2", 24, _UN, (_FTZ,)),
        OpSchema("log", 63, _UN),
        OpSchema("log2", 64, _UN),
        OpSchema("sqrt", 100, _UN, (_RND, _FTZ)),
        OpSchema("rsqrt", 93, _UN, (_FTZ,)),
        OpSchema("tanh", 106, _UN, (AttrSpec("rounding_mode", "enum:rounding", since=V13_2, default="full"),)),
        OpSchema("sin", 98, _UN),
        OpSchema("cos", 18, _UN),
        OpSchema("tan", 105, _UN),
        OpSchema("sinh", 99, _UN),
        OpSchema("cosh", 19, _UN),
        OpSchema("floor", 39, _UN),
        OpSchema("ceil", 13, _UN),
        OpSchema("fpowf", 84, _ops("source", "exponent")),
        OpSchema("cmpf", 14, _BIN, (AttrSpec("comparison_predicate", "enum:predicate"),
                                    AttrSpec("comparison_ordering", "enum:ordering"))),
        # arithmetic on integers
        OpSchema("absi", 1, _UN),
        OpSchema("addi", 3, _BIN, (_OVF,)),
        OpSchema("subi", 104, _BIN, (_OVF,)),
        OpSchema("muli", 78, _BIN, (_OVF,)),
        OpSchema("mulhii", 77, _ops("x", "y")),
        OpSchema("divi", 21, _BIN, (_SGN, AttrSpec("rounding", "enum:rounding", default="zero"))),
        OpSchema("remi", 90, _BIN, (_SGN,)),
        OpSchema("maxi", 70, _BIN, (_SGN,)),
        OpSchema("mini", 72, _BIN, (_SGN,)),
        OpSchema("negi", 80, _UN, (AttrSpec("overflow", "enum:overflow", since=V13_2, default="none"),)),
        OpSchema("andi", 4, _BIN),
        OpSchema("ori", 82, _BIN),
        OpSchema("xori", 108, _BIN),
        OpSchema("shli", 96, _BIN, (_OVF,)),
        OpSchema("shri", 97, _BIN, (_SGN,)),
        OpSchema("cmpi", 15, _BIN, (AttrSpec("comparison_predicate", "enum:predicate"), _SGN)),
        OpSchema("select", 95, _ops("cond", "val_if_true", "val_if_false")),
        # conversions
        OpSchema("ftof", 42, _ops("from"), (_RND,)),
        OpSchema("itof", 59, _ops("from"), (_SGN, _RND)),
        OpSchema("ftoi", 43, _ops("from"), (AttrSpec("saturating", "flag", since=V13_4), _SGN,
                                            AttrSpec("rounding_mode", "enum:rounding", default="nearest_int_to_zero"))),
        OpSchema("exti", 37, _ops("from"), (_SGN,)),
        OpSchema("trunci", 107, _ops("from"), (_OVF,)),
        OpSchema("bitcast", 9, _UN),
        OpSchema("int_to_ptr", 51, _UN),
        OpSchema("ptr_to_int", 86, _UN),
        # tile shape ops
        OpSchema("constant", 16, (), (AttrSpec("value", "dense"),)),
        OpSchema("iota", 58),
        OpSchema("broadcast", 11, _UN),
        OpSchema("reshape", 91, _UN),
        OpSchema("permute", 83, _UN, (AttrSpec("permutation", "i32_array"),)),
        OpSchema("cat", 12, _BIN, (AttrSpec("dim", "int"),)),
        OpSchema("extract", 38, _ops("source", "indices*")),
        # block coordinates and hints
        OpSchema("get_tile_block_id", 48, results=3),
        OpSchema("get_num_tile_blocks", 46, results=3),
        OpSchema("assume", 6, _ops("value"), (AttrSpec("predicate", "predicate"),)),
        # memory: views
        OpSchema("make_tensor_view", 67, _ops("base", "dynamicShape*", "dynamicStrides*")),
        OpSchema("make_partition_view", 66, _ops("tensor_view")),
        OpSchema("get_tensor_shape", 47, _ops("src"), results=None),
        OpSchema("load_view_tko", 62, _ops("view", "index*", "token?"),
                 _MEM + (AttrSpec("inbounds", "bool_array", since=V13_4, default=()),), results=2),
        OpSchema("store_view_tko", 102, _ops("tile", "view", "index*", "token?"),
                 _MEM + (AttrSpec("inbounds", "bool_array", since=V13_4, default=()),)),
        # memory: pointers (gather/scatter)
        OpSchema("offset", 81, _ops("ptr", "offset")),
        OpSchema("load_ptr_tko", 61, _ops("source", "mask?", "paddingValue?", "token?"), _MEM, results=2),
        OpSchema("store_ptr_tko", 101, _ops("destination", "value", "mask?", "token?"), _MEM),
        OpSchema("make_token", 68),
        OpSchema("join_tokens", 60, _ops("tokens*")),
        # tensor cores
        OpSchema("mmaf", 73, _ops("lhs", "rhs", "acc"), (AttrSpec("fast_acc", "flag", since=V13_3),)),
        OpSchema("mmai", 74, _ops("lhs", "rhs", "acc"), (AttrSpec("signedness_lhs", "enum:signedness"),
                                                        AttrSpec("signedness_rhs", "enum:signedness"))),
        # reductions and control flow
        OpSchema("reduce", 88, _ops("operands*"), (AttrSpec("dim", "int"), AttrSpec("identities", "identities")),
                 results=None, regions=1),
        OpSchema("for", 41, _ops("lowerBound", "upperBound", "step", "initValues*"),
                 (AttrSpec("unsignedCmp", "flag", since=V13_2),), results=None, regions=1),
        OpSchema("loop", 65, _ops("initValues*"), results=None, regions=1),
        OpSchema("if", 50, _ops("condition"), results=None, regions=2),
        OpSchema("yield", 109, _ops("operands*"), results=0),
        OpSchema("continue", 17, _ops("operands*"), results=0),
        OpSchema("break", 10, _ops("operands*"), results=0),
        OpSchema("return", 92, _ops("operands*"), results=0),
        OpSchema("assert", 5, _ops("condition"), (AttrSpec("message", "str"),), results=0),
    ]
    return {op.name: op for op in s}


SCHEMAS: dict[str, OpSchema] = _schemas()

# --------------------------------------------------------------------------------------------------
# Values, ops, blocks, regions, entries, modules
# --------------------------------------------------------------------------------------------------

_value_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """An SSA value. `name` is only a hint for the printer (`%x`); identity is the object."""
    type: Type
    name: str | None = None
    uid: int = field(default_factory=lambda: next(_value_ids))

    def __repr__(self) -> str:
        return f"Value({self.name or self.uid}: {self.type})"


@dataclass(eq=False)
class Block:
    args: list[Value] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)


@dataclass(eq=False)
class Region:
    block: Block = field(default_factory=Block)


@dataclass(eq=False)
class Op:
    """One op: `operands` maps each schema operand name to a Value, None (optional, absent) or a
    list (variadic); `attrs` maps attribute names to Python values."""
    name: str
    operands: dict[str, Value | list[Value] | None]
    attrs: dict[str, Any]
    results: list[Value]
    regions: list[Region] = field(default_factory=list)

    @property
    def schema(self) -> OpSchema:
        return SCHEMAS[self.name]

    def operand_values(self) -> list[Value]:
        """All operands in schema order, absent optionals skipped."""
        out: list[Value] = []
        for spec in self.schema.operands:
            v = self.operands.get(spec.name)
            if isinstance(v, list):
                out.extend(v)
            elif v is not None:
                out.append(v)
        return out

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"{self.name} has {len(self.results)} results, not one")
        return self.results[0]


@dataclass(eq=False)
class Entry:
    """A `cuda_tile.entry`: a kernel. Its arguments are the entry block's arguments; every kernel
    parameter is one argument (see the package docstring for the launch ABI)."""
    name: str
    body: Block
    hints: dict[str, EntryHints] = field(default_factory=dict)   # by target: "sm_90", or "default"

    @property
    def args(self) -> list[Value]:
        return self.body.args

    @property
    def arg_types(self) -> list[Type]:
        return [a.type for a in self.body.args]


@dataclass(eq=False)
class Module:
    """A `cuda_tile.module`: entries (kernels). The bytecode has no module op of its own: its function
    section is the module body and the name exists only in the text form."""
    name: str = "kernels"
    entries: list[Entry] = field(default_factory=list)

    def entry(self, name: str, arg_types: Sequence[Type], arg_names: Sequence[str] | None = None,
              hints: dict[str, EntryHints] | None = None) -> tuple[Entry, Builder]:
        """Add an entry taking `arg_types`; returns it and a Builder positioned in its body."""
        if any(e.name == name for e in self.entries):
            raise ValueError(f"entry @{name} is already defined")
        for t in arg_types:
            if not (isinstance(t, TileType) and t.rank == 0):
                raise TypeError(f"entry @{name}: argument type {t} is not a 0-d tile; the bytecode takes only "
                                "scalars and pointers (`tile<i32>`, `tile<ptr<f32>>`): build tensor views "
                                "in the body with make_tensor_view")
        names = list(arg_names) if arg_names is not None else [None] * len(arg_types)
        body = Block(args=[Value(t, n) for t, n in zip(arg_types, names, strict=True)])
        e = Entry(name, body, dict(hints or {}))
        self.entries.append(e)
        return e, Builder(body)


# --------------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------------


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _tile_of(v: Value, what: str) -> TileType:
    if not isinstance(v.type, TileType):
        raise TypeError(f"{what} must be a tile, got {v.type}")
    return v.type


def _flatten(x) -> list:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flatten(e)]
    return [x]


class LoopScope:
    """What a `for`/`loop`/`reduce` context hands the body: its block arguments; `results` is set
    when the context exits."""

    def __init__(self, op: Op):
        self.op = op

    @property
    def args(self) -> list[Value]:
        return self.op.regions[0].block.args

    @property
    def iv(self) -> Value:
        """The induction variable of a `for`."""
        return self.args[0]

    @property
    def iter_values(self) -> list[Value]:
        return self.args[1:] if self.op.name == "for" else self.args

    @property
    def results(self) -> list[Value]:
        return self.op.results


class IfScope:
    """What an `if` context hands the body: `then()` and `else_()` are nested contexts."""

    def __init__(self, builder: Builder, op: Op):
        self._b, self.op = builder, op

    def then(self):
        return self._b._in_block(self.op.regions[0].block)

    def else_(self):
        return self._b._in_block(self.op.regions[1].block)

    @property
    def results(self) -> list[Value]:
        return self.op.results


class Builder:
    """Appends ops to a block. Each method checks what the printer and encoder rely on (operand
    kinds, shapes that must agree) and returns the op's result(s)."""

    def __init__(self, block: Block):
        self.block = block

    # -- plumbing ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _in_block(self, block: Block) -> Iterator[Block]:
        saved, self.block = self.block, block
        try:
            yield block
        finally:
            self.block = saved

    def op(self, name: str, result_types: Sequence[Type], operands: dict | None = None,
           attrs: dict | None = None, regions: Sequence[Region] = (),
           result_names: Sequence[str | None] | None = None) -> Op:
        """Append any schema op. The typed methods below are the front door; this is the one place
        that checks an op against its schema."""
        schema = SCHEMAS[name]
        operands = dict(operands or {})
        attrs = {k: v for k, v in (attrs or {}).items() if v is not None}
        for spec in schema.operands:
            v = operands.get(spec.name)
            if spec.arity == "variadic":
                operands[spec.name] = list(v or [])
                if not all(isinstance(x, Value) for x in operands[spec.name]):
                    raise TypeError(f"{name}: operand group {spec.name} must be Values")
            elif spec.arity == "optional":
                if v is not None and not isinstance(v, Value):
                    raise TypeError(f"{name}: operand {spec.name} must be a Value or None")
            elif not isinstance(v, Value):
                raise TypeError(f"{name}: operand {spec.name} must be a Value, got {v!r}")
        unknown = set(operands) - {s.name for s in schema.operands}
        if unknown:
            raise TypeError(f"{name}: unknown operands {sorted(unknown)}")
        known = {a.name: a for a in schema.attrs}
        for k, v in attrs.items():
            if k not in known:
                raise TypeError(f"{name}: unknown attribute {k}")
            kind = known[k].kind
            if kind.startswith("enum:") and v not in ENUMS[kind[5:]]:
                raise ValueError(f"{name}: {k}={v!r} is not one of {ENUMS[kind[5:]]}")
        for a in schema.attrs:
            if not a.optional and a.kind != "flag" and a.name not in attrs and a.default is None:
                raise TypeError(f"{name}: attribute {a.name} is required")
        if schema.results is not None and len(result_types) != schema.results:
            raise TypeError(f"{name} has {schema.results} results, got {len(result_types)} types")
        if len(regions) != schema.regions:
            raise TypeError(f"{name} has {schema.regions} regions, got {len(regions)}")
        names = list(result_names) if result_names is not None else [None] * len(result_types)
        o = Op(name, operands, attrs, [Value(t, n) for t, n in zip(result_types, names, strict=True)],
               list(regions))
        self.block.ops.append(o)
        return o

    def _unary(self, name: str, x: Value, **attrs) -> Value:
        return self.op(name, [x.type], {"source": x}, attrs).result

    def _binary(self, name: str, a: Value, b: Value, **attrs) -> Value:
        if a.type != b.type:
            raise TypeError(f"{name}: operand types differ: {a.type} vs {b.type}")
        return self.op(name, [a.type], {"lhs": a, "rhs": b}, attrs).result

    # -- constants and indices --------------------------------------------------------------------

    def constant(self, value, type: TileType | ScalarType) -> Value:
        """A constant tile. `value` is one number (every element) or a nested sequence / NumPy array
        holding every element in row-major order. A ScalarType gives a 0-d tile."""
        t = type if isinstance(type, TileType) else TileType(type, ())
        if not isinstance(t.element, ScalarType):
            raise TypeError("constants of pointer tiles are not supported")
        vals = _flatten(value)
        n = math.prod(t.shape)
        if len(vals) not in (1, n):
            raise ValueError(f"constant of {t} needs 1 or {n} values, got {len(vals)}")
        if len(vals) == n > 1 and all(v == vals[0] for v in vals) and not t.element.is_float:
            vals = vals[:1]
        conv = float if t.element.is_float else int
        return self.op("constant", [t], attrs={"value": DenseConstant(t.element, tuple(conv(v) for v in vals))}).result

    def get_tile_block_id(self) -> tuple[Value, Value, Value]:
        """This block's (x, y, z) coordinates in the launch grid, as `tile<i32>`."""
        o = self.op("get_tile_block_id", [tile(I32)] * 3, result_names=["blockId_x", "blockId_y", "blockId_z"])
        return tuple(o.results)

    def get_num_tile_blocks(self) -> tuple[Value, Value, Value]:
        o = self.op("get_num_tile_blocks", [tile(I32)] * 3, result_names=["gridSize_x", "gridSize_y", "gridSize_z"])
        return tuple(o.results)

    def iota(self, n: int, element: ScalarType = I32) -> Value:
        """`[0, 1, ..., n-1]` as a 1-d integer tile."""
        return self.op("iota", [tile(element, n)]).result

    def assume(self, value: Value, predicate: DivBy | Bounded) -> Value:
        """The same value, with a fact the compiler may rely on (alignment, range)."""
        return self.op("assume", [value.type], {"value": value}, {"predicate": predicate}).result

    # -- shapes -----------------------------------------------------------------------------------

    def broadcast(self, x: Value, shape: Sequence[int]) -> Value:
        """Stretch size-1 dims to `shape` (same rank; reshape first to add dims)."""
        t = _tile_of(x, "broadcast source")
        if len(shape) != t.rank or any(s != d and s != 1 for s, d in zip(t.shape, shape)):
            raise ValueError(f"cannot broadcast {t} to {tuple(shape)}")
        return self._unary("broadcast", x) if tuple(shape) == t.shape else \
            self.op("broadcast", [t.with_shape(shape)], {"source": x}).result

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        t = _tile_of(x, "reshape source")
        if math.prod(shape) != math.prod(t.shape):
            raise ValueError(f"cannot reshape {t} to {tuple(shape)}")
        return self.op("reshape", [t.with_shape(shape)], {"source": x}).result

    def permute(self, x: Value, permutation: Sequence[int]) -> Value:
        t = _tile_of(x, "permute source")
        if sorted(permutation) != list(range(t.rank)):
            raise ValueError(f"{permutation} is not a permutation of {t.rank} dims")
        shape = [t.shape[p] for p in permutation]
        return self.op("permute", [t.with_shape(shape)], {"source": x}, {"permutation": tuple(permutation)}).result

    def cat(self, a: Value, b: Value, dim: int) -> Value:
        ta, tb = _tile_of(a, "cat lhs"), _tile_of(b, "cat rhs")
        shape = list(ta.shape)
        shape[dim] += tb.shape[dim]
        return self.op("cat", [ta.with_shape(shape)], {"lhs": a, "rhs": b}, {"dim": dim}).result

    def extract(self, x: Value, indices: Sequence[Value], shape: Sequence[int]) -> Value:
        """The `shape` slice of x at slice coordinates `indices` (0-d i32 tiles)."""
        t = _tile_of(x, "extract source")
        return self.op("extract", [t.with_shape(shape)], {"source": x, "indices": list(indices)}).result

    # -- float arithmetic -------------------------------------------------------------------------

    def addf(self, a, b, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self._binary("addf", a, b, rounding_mode=rounding, flush_to_zero=ftz or None)

    def subf(self, a, b, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self._binary("subf", a, b, rounding_mode=rounding, flush_to_zero=ftz or None)

    def mulf(self, a, b, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self._binary("mulf", a, b, rounding_mode=rounding, flush_to_zero=ftz or None)

    def divf(self, a, b, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self._binary("divf", a, b, rounding_mode=rounding, flush_to_zero=ftz or None)

    def remf(self, a, b) -> Value:
        return self._binary("remf", a, b)

    def maxf(self, a, b, propagate_nan: bool = False, ftz: bool = False) -> Value:
        return self._binary("maxf", a, b, propagate_nan=propagate_nan or None, flush_to_zero=ftz or None)

    def minf(self, a, b, propagate_nan: bool = False, ftz: bool = False) -> Value:
        return self._binary("minf", a, b, propagate_nan=propagate_nan or None, flush_to_zero=ftz or None)

    def fma(self, a, b, c, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self.op("fma", [a.type], {"lhs": a, "rhs": b, "acc": c},
                       {"rounding_mode": rounding, "flush_to_zero": ftz or None}).result

    def pow(self, x, exponent) -> Value:
        return self.op("fpowf", [x.type], {"source": x, "exponent": exponent}).result

    def negf(self, x) -> Value:
        return self._unary("negf", x)

    def absf(self, x) -> Value:
        return self._unary("absf", x)

    def exp(self, x, rounding: str | None = None) -> Value:
        """e**x; `rounding="approx"` (bytecode >= 13.3) allows the fast approximation."""
        return self._unary("exp", x, rounding_mode=rounding)

    def exp2(self, x, ftz: bool = False) -> Value:
        return self._unary("exp2", x, flush_to_zero=ftz or None)

    def log(self, x) -> Value:
        return self._unary("log", x)

    def log2(self, x) -> Value:
        return self._unary("log2", x)

    def sqrt(self, x, rounding: str = "nearest_even", ftz: bool = False) -> Value:
        return self._unary("sqrt", x, rounding_mode=rounding, flush_to_zero=ftz or None)

    def rsqrt(self, x, ftz: bool = False) -> Value:
        return self._unary("rsqrt", x, flush_to_zero=ftz or None)

    def tanh(self, x, rounding: str | None = None) -> Value:
        return self._unary("tanh", x, rounding_mode=rounding)

    def sin(self, x) -> Value:
        return self._unary("sin", x)

    def cos(self, x) -> Value:
        return self._unary("cos", x)

    def floor(self, x) -> Value:
        return self._unary("floor", x)

    def ceil(self, x) -> Value:
        return self._unary("ceil", x)

    def cmpf(self, predicate: str, a, b, ordered: bool = True) -> Value:
        """Compare floats: `predicate` from ENUMS["predicate"]; ordered comparisons are false on NaN."""
        t = _tile_of(a, "cmpf lhs")
        return self.op("cmpf", [t.with_element(I1)], {"lhs": a, "rhs": b},
                       {"comparison_predicate": predicate,
                        "comparison_ordering": "ordered" if ordered else "unordered"}).result

    # -- integer arithmetic -----------------------------------------------------------------------

    def addi(self, a, b, overflow: str = "none") -> Value:
        return self._binary("addi", a, b, overflow=overflow)

    def subi(self, a, b, overflow: str = "none") -> Value:
        return self._binary("subi", a, b, overflow=overflow)

    def muli(self, a, b, overflow: str = "none") -> Value:
        return self._binary("muli", a, b, overflow=overflow)

    def divi(self, a, b, signed: bool = True, rounding: str = "zero") -> Value:
        """Integer division; `rounding` is "zero" (C), "negative_inf" (floor) or "positive_inf" (ceil)."""
        return self._binary("divi", a, b, signedness="signed" if signed else "unsigned", rounding=rounding)

    def remi(self, a, b, signed: bool = True) -> Value:
        return self._binary("remi", a, b, signedness="signed" if signed else "unsigned")

    def maxi(self, a, b, signed: bool = True) -> Value:
        return self._binary("maxi", a, b, signedness="signed" if signed else "unsigned")

    def mini(self, a, b, signed: bool = True) -> Value:
        return self._binary("mini", a, b, signedness="signed" if signed else "unsigned")

    def andi(self, a, b) -> Value:
        return self._binary("andi", a, b)

    def ori(self, a, b) -> Value:
        return self._binary("ori", a, b)

    def xori(self, a, b) -> Value:
        return self._binary("xori", a, b)

    def shli(self, a, b, overflow: str = "none") -> Value:
        return self._binary("shli", a, b, overflow=overflow)

    def shri(self, a, b, signed: bool = True) -> Value:
        return self._binary("shri", a, b, signedness="signed" if signed else "unsigned")

    def negi(self, x) -> Value:
        return self._unary("negi", x)

    def absi(self, x) -> Value:
        return self._unary("absi", x)

    def cmpi(self, predicate: str, a, b, signed: bool = True) -> Value:
        t = _tile_of(a, "cmpi lhs")
        return self.op("cmpi", [t.with_element(I1)], {"lhs": a, "rhs": b},
                       {"comparison_predicate": predicate,
                        "signedness": "signed" if signed else "unsigned"}).result

    def select(self, cond, if_true, if_false) -> Value:
        if if_true.type != if_false.type:
            raise TypeError(f"select: {if_true.type} vs {if_false.type}")
        return self.op("select", [if_true.type], {"cond": cond, "val_if_true": if_true,
                                                  "val_if_false": if_false}).result

    # -- conversions ------------------------------------------------------------------------------

    def _convert(self, name: str, x: Value, to: ScalarType, **attrs) -> Value:
        return self.op(name, [_tile_of(x, name).with_element(to)], {"from": x}, attrs).result

    def ftof(self, x, to: ScalarType, rounding: str = "nearest_even") -> Value:
        return self._convert("ftof", x, to, rounding_mode=rounding)

    def itof(self, x, to: ScalarType, signed: bool = True, rounding: str = "nearest_even") -> Value:
        return self._convert("itof", x, to, signedness="signed" if signed else "unsigned", rounding_mode=rounding)

    def ftoi(self, x, to: ScalarType, signed: bool = True, rounding: str = "nearest_int_to_zero") -> Value:
        return self._convert("ftoi", x, to, signedness="signed" if signed else "unsigned", rounding_mode=rounding)

    def exti(self, x, to: ScalarType, signed: bool = True) -> Value:
        return self._convert("exti", x, to, signedness="signed" if signed else "unsigned")

    def trunci(self, x, to: ScalarType, overflow: str = "none") -> Value:
        return self._convert("trunci", x, to, overflow=overflow)

    def bitcast(self, x, to: ScalarType | PointerType) -> Value:
        return self.op("bitcast", [_tile_of(x, "bitcast").with_element(to)], {"source": x}).result

    # -- memory -----------------------------------------------------------------------------------

    def make_tensor_view(self, base: Value, type: TensorViewType, dynamic_shape: Sequence[Value] = (),
                         dynamic_strides: Sequence[Value] = ()) -> Value:
        """A tensor view at `base` (a `tile<ptr<elem>>`); one i32/i64 value per `?` dim and stride."""
        if len(dynamic_shape) != type.num_dynamic_shape or len(dynamic_strides) != type.num_dynamic_strides:
            raise ValueError(f"{type} needs {type.num_dynamic_shape} dynamic dims and "
                             f"{type.num_dynamic_strides} dynamic strides")
        return self.op("make_tensor_view", [type], {"base": base, "dynamicShape": list(dynamic_shape),
                                                    "dynamicStrides": list(dynamic_strides)}).result

    def make_partition_view(self, tensor_view: Value, tile_shape: Sequence[int], padding: str | None = None,
                            dim_map: Sequence[int] | None = None) -> Value:
        t = PartitionViewType(tuple(tile_shape), tensor_view.type, None if dim_map is None else tuple(dim_map), padding)
        return self.op("make_partition_view", [t], {"tensor_view": tensor_view}).result

    def make_token(self) -> Value:
        return self.op("make_token", [TOKEN]).result

    def join_tokens(self, tokens: Sequence[Value]) -> Value:
        return self.op("join_tokens", [TOKEN], {"tokens": list(tokens)}).result

    def load_view_tko(self, view: Value, index: Sequence[Value], token: Value | None = None,
                      ordering: str = "weak", scope: str | None = None,
                      hints: dict[str, LoadStoreHints] | None = None) -> tuple[Value, Value]:
        """Load the tile at tile coordinates `index` of a partition view; returns (tile, token)."""
        pv = view.type
        if not isinstance(pv, PartitionViewType):
            raise TypeError(f"load_view_tko needs a partition view, got {pv}")
        if len(index) != pv.rank:
            raise ValueError(f"partition view of rank {pv.rank} indexed with {len(index)} coordinates")
        t = TileType(pv.tensor_view.element, pv.tile_shape)
        o = self.op("load_view_tko", [t, TOKEN], {"view": view, "index": list(index), "token": token},
                    {"memory_ordering_semantics": ordering, "memory_scope": scope, "optimization_hints": hints},
                    result_names=["tile", "result_token"])
        return o.results[0], o.results[1]

    def store_view_tko(self, value: Value, view: Value, index: Sequence[Value], token: Value | None = None,
                       ordering: str = "weak", scope: str | None = None,
                       hints: dict[str, LoadStoreHints] | None = None) -> Value:
        """Store a tile at tile coordinates `index`; elements outside the tensor are dropped."""
        pv = view.type
        if not isinstance(pv, PartitionViewType) or len(index) != pv.rank:
            raise TypeError(f"store_view_tko needs a partition view indexed by {getattr(pv, 'rank', '?')} values")
        return self.op("store_view_tko", [TOKEN], {"tile": value, "view": view, "index": list(index), "token": token},
                       {"memory_ordering_semantics": ordering, "memory_scope": scope,
                        "optimization_hints": hints}).result

    def offset(self, pointers: Value, offsets: Value) -> Value:
        """`pointers + offsets` in elements, elementwise (a tile of pointers, same shape)."""
        return self.op("offset", [pointers.type], {"ptr": pointers, "offset": offsets}).result

    def load_ptr_tko(self, pointers: Value, mask: Value | None = None, padding: Value | None = None,
                     token: Value | None = None, ordering: str = "weak", scope: str | None = None,
                     hints: dict[str, LoadStoreHints] | None = None) -> tuple[Value, Value]:
        """Gather: load each pointer of a pointer tile where `mask` holds; `padding` (a tile) fills
        the rest. Returns (tile, token)."""
        t = _tile_of(pointers, "load_ptr_tko pointers")
        if not isinstance(t.element, PointerType):
            raise TypeError(f"load_ptr_tko needs a tile of pointers, got {t}")
        o = self.op("load_ptr_tko", [t.with_element(t.element.pointee), TOKEN],
                    {"source": pointers, "mask": mask, "paddingValue": padding, "token": token},
                    {"memory_ordering_semantics": ordering, "memory_scope": scope, "optimization_hints": hints},
                    result_names=["result", "result_token"])
        return o.results[0], o.results[1]

    def store_ptr_tko(self, pointers: Value, value: Value, mask: Value | None = None, token: Value | None = None,
                      ordering: str = "weak", scope: str | None = None,
                      hints: dict[str, LoadStoreHints] | None = None) -> Value:
        """Scatter: store `value` to each pointer where `mask` holds. Returns a token."""
        return self.op("store_ptr_tko", [TOKEN], {"destination": pointers, "value": value, "mask": mask,
                                                  "token": token},
                       {"memory_ordering_semantics": ordering, "memory_scope": scope,
                        "optimization_hints": hints}).result

    # -- tensor cores -----------------------------------------------------------------------------

    def mmaf(self, a: Value, b: Value, acc: Value) -> Value:
        """acc + a @ b on tensor cores: a [M,K], b [K,N], acc [M,N] (or batched with a leading dim)."""
        ta, tb, tc = _tile_of(a, "mmaf lhs"), _tile_of(b, "mmaf rhs"), _tile_of(acc, "mmaf acc")
        if ta.shape[-1] != tb.shape[-2] or tc.shape[-2:] != (ta.shape[-2], tb.shape[-1]):
            raise ValueError(f"mmaf shapes do not agree: {ta} x {tb} + {tc}")
        return self.op("mmaf", [tc], {"lhs": a, "rhs": b, "acc": acc}).result

    def mmai(self, a: Value, b: Value, acc: Value, signed_a: bool = True, signed_b: bool = True) -> Value:
        return self.op("mmai", [acc.type], {"lhs": a, "rhs": b, "acc": acc},
                       {"signedness_lhs": "signed" if signed_a else "unsigned",
                        "signedness_rhs": "signed" if signed_b else "unsigned"}).result

    # -- reductions and control flow --------------------------------------------------------------

    @contextlib.contextmanager
    def reduce(self, operands: Value | Sequence[Value], dim: int, identities: Sequence) -> Iterator[LoopScope]:
        """Reduce `operands` along `dim`. The body combines two elements per operand: its block args
        are (acc0, elem0, acc1, elem1, ...) as 0-d tiles and it must `yield` the combined values.
        `identities` holds one number per operand (e.g. -inf for max)."""
        ops = _as_list(operands)
        if len(identities) != len(ops):
            raise ValueError("reduce needs one identity per operand")
        region = Region()
        for v in ops:
            t = _tile_of(v, "reduce operand")
            region.block.args += [Value(TileType(t.element, ())), Value(TileType(t.element, ()))]
        results = []
        for v in ops:
            t = v.type
            results.append(t.with_shape(t.shape[:dim] + t.shape[dim + 1:]))
        idents = tuple((v.type.element, float(i) if v.type.element.is_float else int(i))
                       for v, i in zip(ops, identities))
        o = self.op("reduce", results, {"operands": ops}, {"dim": dim, "identities": idents}, [region])
        scope = LoopScope(o)
        with self._in_block(region.block):
            yield scope

    @contextlib.contextmanager
    def for_(self, lower: Value, upper: Value, step: Value, init: Sequence[Value] = ()) -> Iterator[LoopScope]:
        """`for iv in [lower, upper) step step` carrying `init` values; the body ends in `continue_`
        with the next values. `scope.iv`, `scope.iter_values`, then `scope.results` after the block."""
        region = Region(Block(args=[Value(lower.type, "iv")] + [Value(v.type) for v in init]))
        o = self.op("for", [v.type for v in init], {"lowerBound": lower, "upperBound": upper, "step": step,
                                                      "initValues": list(init)}, {}, [region])
        with self._in_block(region.block):
            yield LoopScope(o)

    @contextlib.contextmanager
    def loop(self, init: Sequence[Value] = (), result_types: Sequence[Type] | None = None) -> Iterator[LoopScope]:
        """An unbounded loop carrying `init`; `continue_` goes round again, `break_` leaves with the
        loop's results (types `result_types`, default those of `init`)."""
        region = Region(Block(args=[Value(v.type) for v in init]))
        rt = list(result_types) if result_types is not None else [v.type for v in init]
        o = self.op("loop", rt, {"initValues": list(init)}, {}, [region])
        with self._in_block(region.block):
            yield LoopScope(o)

    @contextlib.contextmanager
    def if_(self, condition: Value, result_types: Sequence[Type] = ()) -> Iterator[IfScope]:
        """`if condition` (a `tile<i1>`): use `with s.then(): ... b.yield_(...)` and `s.else_()`.
        Both regions must end in `yield_`; the else region is printed only when it holds ops."""
        o = self.op("if", list(result_types), {"condition": condition}, {}, [Region(), Region()])
        yield IfScope(self, o)
        for r in o.regions:   # an empty region is an implicit `yield` of nothing
            if not r.block.ops and not result_types:
                r.block.ops.append(Op("yield", {"operands": []}, {}, []))

    def yield_(self, values: Sequence[Value] = ()) -> None:
        self.op("yield", [], {"operands": list(values)})

    def continue_(self, values: Sequence[Value] = ()) -> None:
        self.op("continue", [], {"operands": list(values)})

    def break_(self, values: Sequence[Value] = ()) -> None:
        self.op("break", [], {"operands": list(values)})

    def return_(self) -> None:
        self.op("return", [], {"operands": []})
