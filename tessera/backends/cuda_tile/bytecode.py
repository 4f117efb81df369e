"""Serialize a cuda_tile `Module` as the Tile IR bytecode that NVIDIA's `tileiras` assembles.

The format, as the cuda-tile project defines it:

* a 12-byte header: magic `\\x7fTileIR\\0`, major, minor (one byte each), a 16-bit tag;
* sections, each `id | 0x80-if-aligned`, a varint length, (if aligned) a varint alignment and 0xCB
  padding up to it, then the payload: function table, constants, debug info, types, strings (in
  that order), then a 0 byte;
* the string, type and constant sections are tables: a varint count, fixed-width offsets, then the
  concatenated items. Everything else refers to items by index: ops name types by type index,
  attribute strings by string index, dense constants by constant index;
* a function is its name, signature type, a kind byte (entry), a debug-location index, its
  optimization hints, then its body: ops back to back. An op is a varint opcode, its result types
  (counted when the op has a variadic operand group or variadic results), a varint of flag bits
  (unit attributes, present optional attributes and, for ops with several variable operand groups,
  present optional operands), the attributes that are present in schema order, the operands as
  value indices, then its regions. Values are numbered in definition order: the entry's arguments,
  then each op's results; a region's block arguments and ops take the next numbers and give them
  back when the region ends.

Every per-op fact comes from `ir.SCHEMAS`; this module only knows how each kind of field is laid out.

Version: the default is 13.1, the oldest version `tileiras` accepts. Everything a tile compiler
needs — views with padding, tokens, gather/scatter, `mmaf`, reductions, loops, `assume` and the
per-arch load/entry hints — is there from 13.1, so the oldest toolkit that runs Tile IR (CUDA 13.1)
can assemble what we write. Later versions only add what we do not use yet (`exp`'s approximate
rounding, `for` with unsigned compare at 13.2, "default" (arch-independent) hints, `mmaf
fast_acc` and `num_worker_warps_per_cta` at 13.3, `inbounds` at 13.4). Pass `version=` to use them;
an attribute newer than the target raises instead of being dropped silently.
"""
from __future__ import annotations

import struct
from typing import Iterable, Sequence

from tessera.backends.cuda_tile import ir

MAGIC = b"\x7fTileIR\x00"
SUPPORTED_VERSIONS = (ir.V13_1, ir.V13_2, ir.V13_3, ir.V13_4, ir.V13_5)
DEFAULT_VERSION = ir.V13_1
DYNAMIC = -(1 << 63)             # a `?` dim or stride in a tensor_view type


class EncodeError(ValueError):
    """The module cannot be written at the requested version (or is malformed)."""


# --------------------------------------------------------------------------------------------------
# Primitive encodings
# --------------------------------------------------------------------------------------------------


def varint(x: int) -> bytes:
    """Unsigned LEB128: 7 bits a byte, low bits first, high bit set on all but the last byte."""
    if x < 0:
        raise EncodeError(f"varint of negative {x}")
    out = bytearray()
    while True:
        low, x = x & 0x7F, x >> 7
        out.append(low | (0x80 if x else 0))
        if not x:
            return bytes(out)


def signed_varint(x: int) -> bytes:
    """Zigzag (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) then varint."""
    return varint((x << 1) if x >= 0 else ((-x << 1) - 1))


def int_list(values: Sequence[int], width: int) -> bytes:
    """A varint count then each value as a `width`-byte little-endian signed integer."""
    return varint(len(values)) + b"".join(int(v).to_bytes(width, "little", signed=True) for v in values)


# --------------------------------------------------------------------------------------------------
# Scalars: type tags and element bytes
# --------------------------------------------------------------------------------------------------

SCALAR_TAGS = {"i1": 0x00, "i8": 0x01, "i16": 0x02, "i32": 0x03, "i64": 0x04, "f16": 0x05, "bf16": 0x06,
               "f32": 0x07, "tf32": 0x08, "f64": 0x09, "f8E4M3FN": 0x0A, "f8E5M2": 0x0B}
TYPE_TAGS = {"pointer": 0x0C, "tile": 0x0D, "tensor_view": 0x0E, "partition_view": 0x0F, "function": 0x10,
             "token": 0x11}
ATTR_TAGS = {"int": 0x01, "float": 0x02, "bool": 0x03, "type": 0x04, "str": 0x05, "array": 0x06,
             "dense": 0x07, "div_by": 0x08, "same_elements": 0x09, "dict": 0x0A, "hints": 0x0B,
             "bounded": 0x0C}
SECTION_IDS = {"end": 0x00, "string": 0x01, "func": 0x02, "debug": 0x03, "constant": 0x04, "type": 0x05,
               "global": 0x06}
ENTRY_KIND_KERNEL, ENTRY_HAS_HINTS = 0x02, 0x04


def float_bits(value: float, element: ir.ScalarType) -> int:
    """The IEEE (or OCP fp8) bit pattern of `value` rounded to `element`."""
    name = element.name
    if name == "f64":
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    if name == "f32":
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if name == "f16":
        return struct.unpack("<H", struct.pack("<e", value))[0]
    import ml_dtypes
    import numpy as np
    dtype = {"bf16": ml_dtypes.bfloat16, "f8E4M3FN": ml_dtypes.float8_e4m3fn,
             "f8E5M2": ml_dtypes.float8_e5m2}.get(name)
    if dtype is None:
        raise EncodeError(f"no constant encoding for {name}")
    return int(np.array(value, dtype=dtype).view(np.uint16 if element.bits == 16 else np.uint8))


def element_bytes(value, element: ir.ScalarType) -> bytes:
    """One element of a dense constant (MLIR's DenseElementsAttr layout: a true i1 is 0xFF)."""
    if element.name == "i1":
        return b"\xff" if value else b"\x00"
    width = (element.bits + 7) // 8
    if element.is_float:
        return float_bits(float(value), element).to_bytes(width, "little")
    return (int(value) & ((1 << (8 * width)) - 1)).to_bytes(width, "little")


def dense_bytes(c: ir.DenseConstant) -> bytes:
    if c.element.name == "i1" and not c.is_splat:     # MLIR bit-packs non-splat booleans
        bits = sum(1 << i for i, v in enumerate(c.values) if v)
        return bits.to_bytes((len(c.values) + 7) // 8, "little")
    return b"".join(element_bytes(v, c.element) for v in c.values)


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


class _Table:
    """Interned byte strings, numbered in first-use order."""

    def __init__(self, first_id: int = 0):
        self.items: dict[bytes, int] = {}
        self.first_id = first_id

    def index(self, item: bytes) -> int:
        if item not in self.items:
            self.items[item] = len(self.items) + self.first_id
        return self.items[item]

    def __len__(self) -> int:
        return len(self.items)

    def payload(self, offset_width: int) -> bytes:
        """count, padding to the offset width, offsets, data (positions relative to an aligned start)."""
        out = bytearray(varint(len(self.items)))
        _pad(out, offset_width)
        pos = 0
        for item in self.items:
            out += pos.to_bytes(offset_width, "little")
            pos += len(item)
        for item in self.items:
            out += item
        return bytes(out)


def _pad(buf: bytearray, alignment: int) -> None:
    buf.extend(b"\xcb" * (-len(buf) % alignment))


class _Context:
    """The module-wide tables and the version, shared by every function."""

    def __init__(self, version: tuple[int, int]):
        self.version = version
        self.strings = _Table()
        self.constants = _Table()
        self.types = _Table()
        self.type_index(ir.I1)      # the format predefines i1 = 0 and i32 = 1
        self.type_index(ir.I32)

    def string(self, s: str) -> int:
        return self.strings.index(s.encode())

    def constant(self, data: bytes) -> int:
        return self.constants.index(varint(len(data)) + data)

    def need(self, since: tuple[int, int], what: str) -> None:
        if self.version < since:
            raise EncodeError(f"{what} needs bytecode {since[0]}.{since[1]}, "
                              f"targeting {self.version[0]}.{self.version[1]}")

    # -- types ------------------------------------------------------------------------------------

    def type_index(self, t) -> int:
        return self.types.index(self._type_bytes(t))

    def _type_bytes(self, t) -> bytes:
        v = self.version
        if isinstance(t, ir.ScalarType):
            return bytes([SCALAR_TAGS[t.name]])
        if isinstance(t, ir.TokenType):
            return bytes([TYPE_TAGS["token"]])
        if isinstance(t, ir.PointerType):
            flags = varint(0) if v >= ir.V13_4 else b""      # 13.4 added an optional pointer attribute
            return bytes([TYPE_TAGS["pointer"]]) + flags + varint(self.type_index(t.pointee))
        if isinstance(t, ir.TileType):
            return bytes([TYPE_TAGS["tile"]]) + varint(self.type_index(t.element)) + int_list(t.shape, 8)
        if isinstance(t, ir.TensorViewType):
            flags = varint(0) if v >= ir.V13_4 else b""
            dyn = [DYNAMIC if d is None else d for d in t.shape]
            strides = [DYNAMIC if s is None else s for s in t.strides]
            return (bytes([TYPE_TAGS["tensor_view"]]) + flags + varint(self.type_index(t.element))
                    + int_list(dyn, 8) + int_list(strides, 8))
        if isinstance(t, ir.PartitionViewType):
            pad = b"" if t.padding is None else bytes([ir.PADDING_VALUES.index(t.padding)])
            body = int_list(t.tile_shape, 4) + varint(self.type_index(t.tensor_view)) + int_list(t.dim_map, 4)
            if v >= ir.V13_3:
                return bytes([TYPE_TAGS["partition_view"]]) + varint(int(t.padding is not None)) + body + pad
            return bytes([TYPE_TAGS["partition_view"]]) + body + varint(int(t.padding is not None)) + pad
        if isinstance(t, tuple) and t and t[0] == "function":
            _, params, results = t
            return (bytes([TYPE_TAGS["function"]]) + varint(len(params))
                    + b"".join(varint(self.type_index(p)) for p in params)
                    + varint(len(results)) + b"".join(varint(self.type_index(r)) for r in results))
        raise EncodeError(f"no bytecode for type {t!r}")

    # -- tagged attributes (self-describing: hints, assume predicates, reduce identities) ---------

    def tagged_int(self, value: int, element: ir.ScalarType = ir.I32) -> bytes:
        mask = (1 << max(element.bits, 1)) - 1
        return bytes([ATTR_TAGS["int"]]) + varint(self.type_index(element)) + varint(value & mask)

    def tagged_float(self, value: float, element: ir.ScalarType) -> bytes:
        bits = float_bits(value, element)
        ap = bytes([bits]) if element.bits <= 8 else signed_varint(bits)
        return bytes([ATTR_TAGS["float"]]) + varint(self.type_index(element)) + ap

    def tagged_dict(self, items: Iterable[tuple[str, bytes]]) -> bytes:
        items = sorted(items)
        return bytes([ATTR_TAGS["dict"]]) + varint(len(items)) + b"".join(
            varint(self.string(k)) + v for k, v in items)

    def hints_dict(self, hints_by_target: dict) -> bytes:
        """Optimization hints, untagged: per target ("sm_90", or "default" from 13.3) a dictionary."""
        out = bytearray(varint(len(hints_by_target)))
        for target, h in hints_by_target.items():
            if target == "default":
                self.need(ir.V13_3, 'hints for the "default" target')
            out += varint(self.string(target))
            items: list[tuple[str, bytes]] = []
            if isinstance(h, ir.LoadStoreHints):
                if h.allow_tma is not None:
                    items.append(("allow_tma", bytes([ATTR_TAGS["bool"], int(h.allow_tma)])))
                if h.latency is not None:
                    items.append(("latency", self.tagged_int(h.latency)))
            elif isinstance(h, ir.EntryHints):
                if h.num_cta_in_cga is not None:
                    items.append(("num_cta_in_cga", self.tagged_int(h.num_cta_in_cga)))
                if h.occupancy is not None:
                    items.append(("occupancy", self.tagged_int(h.occupancy)))
                if h.num_worker_warps_per_cta is not None:
                    self.need(ir.V13_3, "num_worker_warps_per_cta")
                    items.append(("num_worker_warps_per_cta", self.tagged_int(h.num_worker_warps_per_cta)))
            else:
                raise EncodeError(f"hints for {target} must be LoadStoreHints or EntryHints, got {h!r}")
            out += self.tagged_dict(items)
        return bytes(out)

    def predicate(self, p) -> bytes:
        if isinstance(p, ir.DivBy):
            out = bytearray([ATTR_TAGS["div_by"]]) + varint(p.divisor)
            out.append(int(p.every is not None) | (int(p.along is not None) << 1))
            out += (signed_varint(p.every) if p.every is not None else b"") + \
                   (signed_varint(p.along) if p.along is not None else b"")
            return bytes(out)
        if isinstance(p, ir.Bounded):
            out = bytearray([ATTR_TAGS["bounded"], int(p.lb is not None) | (int(p.ub is not None) << 1)])
            out += (signed_varint(p.lb) if p.lb is not None else b"") + \
                   (signed_varint(p.ub) if p.ub is not None else b"")
            return bytes(out)
        raise EncodeError(f"assume predicate {p!r} is not DivBy or Bounded")

    # -- op attributes (untagged: the schema says what each one is) --------------------------------

    def op_attr(self, spec: ir.AttrSpec, value, op: ir.Op) -> bytes:
        k = spec.kind
        if k.startswith("enum:"):
            return bytes([ir.ENUMS[k[5:]].index(value)])
        if k == "int":
            return varint(value)
        if k == "bool":
            return bytes([int(bool(value))])
        if k == "str":
            return varint(self.string(value))
        if k == "dense":
            return varint(self.constant(dense_bytes(value)))
        if k == "i32_array":
            return int_list(value, 4)
        if k == "bool_array":
            return int_list([int(bool(x)) for x in value], 1)
        if k == "hints":
            return self.hints_dict(value)
        if k == "predicate":
            return self.predicate(value)
        if k == "identities":
            out = bytearray(varint(len(value)))
            for element, ident in value:
                out += self.tagged_float(ident, element) if element.is_float else self.tagged_int(ident, element)
            return bytes(out)
        raise EncodeError(f"{op.name}: no encoding for attribute kind {k}")


# --------------------------------------------------------------------------------------------------
# Functions and ops
# --------------------------------------------------------------------------------------------------


class _FunctionWriter:
    """Encodes one entry's body, numbering values as the format does."""

    def __init__(self, ctx: _Context, entry: ir.Entry):
        self.ctx = ctx
        self.ids: dict[int, int] = {}
        self.next_id = 0
        self.num_ops = 0
        for a in entry.args:
            self._define(a)

    def _define(self, v: ir.Value) -> None:
        self.ids[v.uid] = self.next_id
        self.next_id += 1

    def _ref(self, v: ir.Value, op: ir.Op) -> bytes:
        if v.uid not in self.ids:
            raise EncodeError(f"{op.name}: operand {v!r} is not defined before use (or out of scope)")
        return varint(self.ids[v.uid])

    def ops(self, ops: Sequence[ir.Op]) -> bytes:
        return b"".join(self.op(o) for o in ops)

    def op(self, op: ir.Op) -> bytes:
        s, ctx, v = op.schema, self.ctx, self.ctx.version
        if v < s.since:
            ctx.need(s.since, f"op {op.name}")
        self.num_ops += 1
        out = bytearray(varint(s.opcode))
        # result types
        if s.counted_results:
            out += varint(len(op.results))
        for r in op.results:
            out += varint(ctx.type_index(r.type))
        # flags
        fields = s.flag_fields()
        present = {a: op.attrs.get(a) is not None for a, _ in fields}
        for o in s.operands:
            if o.arity == "optional":
                present[o.name] = op.operands.get(o.name) is not None
        if fields and v >= min(since for _, since in fields):
            bits = 0
            for i, (name, since) in enumerate(fields):
                if present[name]:
                    ctx.need(since, f"{op.name} {name}")
                    bits |= 1 << i
            out += varint(bits)
        else:
            for name, since in fields:
                if present[name]:
                    ctx.need(since, f"{op.name} {name}")
        # attributes
        for a in s.attrs:
            if a.kind == "flag":
                continue
            value = op.attrs.get(a.name)
            if v < a.since:
                if value is not None and value != a.default:
                    ctx.need(a.since, f"{op.name} {a.name}={value!r}")
                continue
            if value is None:
                if a.optional:
                    continue
                value = self._implied(op, a)
            out += ctx.op_attr(a, value, op)
        # operands
        if s.segmented_operands:
            for o in s.operands:
                x = op.operands.get(o.name)
                if o.arity == "variadic":
                    out += varint(len(x)) + b"".join(self._ref(y, op) for y in x)
                elif x is not None:
                    out += self._ref(x, op)
        else:
            values = op.operand_values()
            if s.variable_operand_groups:
                out += varint(len(values))
            out += b"".join(self._ref(x, op) for x in values)
        # regions: values defined inside give their numbers back when the region ends
        if s.regions:
            out += varint(len(op.regions))
            for region in op.regions:
                saved = self.next_id
                block = region.block
                out += varint(1) + varint(len(block.args))
                for a in block.args:
                    out += varint(ctx.type_index(a.type))
                    self._define(a)
                out += varint(len(block.ops)) + self.ops(block.ops)
                self.next_id = saved
        for r in op.results:
            self._define(r)
        return bytes(out)

    def _implied(self, op: ir.Op, a: ir.AttrSpec):
        """A required attribute newer than the op that the builder left unset: its neutral value."""
        if a.kind == "bool_array":      # `inbounds`: one "not known in bounds" per index
            return [False] * len(op.operands.get("index") or [])
        if a.default is not None:
            return a.default
        raise EncodeError(f"{op.name}: attribute {a.name} is required")


def encode(module: ir.Module, version: tuple[int, int] = DEFAULT_VERSION) -> bytes:
    """The bytecode of `module` at `version` (major, minor)."""
    version = tuple(version)
    if version not in SUPPORTED_VERSIONS:
        raise EncodeError(f"bytecode version {version} is not one of {SUPPORTED_VERSIONS}")
    ctx = _Context(version)
    funcs = bytearray(varint(len(module.entries)))
    ops_per_function = []
    for i, entry in enumerate(module.entries):
        funcs += varint(ctx.string(entry.name))
        funcs += varint(ctx.type_index(("function", tuple(entry.arg_types), ())))
        if version >= ir.V13_5:       # 13.5: hints always present, flag bit dropped, arg attrs added
            funcs.append(ENTRY_KIND_KERNEL)
            funcs += varint(i + 1)
            funcs += bytes([ATTR_TAGS["hints"]]) + ctx.hints_dict(entry.hints)
            funcs += bytes([ATTR_TAGS["array"]]) + varint(0)
        else:
            funcs.append(ENTRY_KIND_KERNEL | (ENTRY_HAS_HINTS if entry.hints else 0))
            funcs += varint(i + 1)
            if entry.hints:
                funcs += bytes([ATTR_TAGS["hints"]]) + ctx.hints_dict(entry.hints)
        w = _FunctionWriter(ctx, entry)
        body = w.ops(entry.body.ops)
        funcs += varint(len(body)) + body
        ops_per_function.append(w.num_ops)

    out = bytearray(MAGIC + bytes([version[0], version[1]]) + (0).to_bytes(2, "little"))
    _section(out, "func", bytes(funcs), 8)
    _section(out, "constant", ctx.constants.payload(8), 8)
    _section(out, "debug", _debug_payload(ops_per_function), 8)
    _section(out, "type", ctx.types.payload(4), 4)
    _section(out, "string", ctx.strings.payload(4), 4)
    out.append(SECTION_IDS["end"])
    return bytes(out)


def _section(out: bytearray, name: str, payload: bytes, alignment: int) -> None:
    out.append(SECTION_IDS[name] | (0x80 if alignment > 1 else 0))
    out += varint(len(payload))
    if alignment > 1:
        out += varint(alignment)
        _pad(out, alignment)
    out += payload


def _debug_payload(ops_per_function: Sequence[int]) -> bytes:
    """No source locations: every function and op points at index 0 ("unknown"). The reader wants a
    non-empty attribute table, so it holds one placeholder entry."""
    out = bytearray(varint(len(ops_per_function)))
    _pad(out, 4)
    start = 0
    for n in ops_per_function:
        out += start.to_bytes(4, "little")
        start += n + 1                     # the function itself, then each op
    out += varint(start)
    _pad(out, 8)
    out += bytes(8 * start)
    table = _Table(first_id=1)
    table.index(b"\x00")
    out += table.payload(4)
    return bytes(out)
