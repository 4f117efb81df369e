"""Print a cuda_tile `Module` as MLIR text, in the form NVIDIA's `tileirdisasm` prints bytecode.

The point of matching the disassembler: a test can encode a module, disassemble the bytecode and
compare the two texts (modulo SSA names and whitespace), which checks the encoder op by op without
a reader of our own. So this follows tileirdisasm's choices: short op names (`addf`, not
`cuda_tile.addf`), attributes at their default value left out, results an op names one by one
(`%tile, %result_token = load_view_tko ...`) printed one by one and others grouped (`%for:2`), and the
implicit terminators of `if` (`yield`) and `for` (`continue`) left out when they carry nothing.
The bytecode has no module op, so `print_module` wraps the entries in `cuda_tile.module @name`;
`print_entry` prints one entry as the disassembler does.
"""
from __future__ import annotations

import re
import struct

from tessera.backends.cuda_tile import ir

# ops whose results the dialect names one by one; other multi-result ops print as `%x:N`
SEPARATELY_NAMED = {"get_tile_block_id", "get_num_tile_blocks", "load_view_tko", "load_ptr_tko"}
# (parent op, terminator) pairs that are implicit and left out when they carry no values
IMPLICIT_TERMINATORS = {("if", "yield"), ("for", "continue")}

# --------------------------------------------------------------------------------------------------
# Types and attribute values
# --------------------------------------------------------------------------------------------------


def _dims(dims) -> str:
    return "x".join("?" if d is None else str(d) for d in dims)


def type_str(t) -> str:
    if isinstance(t, (ir.ScalarType, ir.PointerType)):
        return str(t)
    if isinstance(t, ir.TokenType):
        return "token"
    if isinstance(t, ir.TileType):
        return f"tile<{_dims(t.shape) + 'x' if t.shape else ''}{t.element}>"
    if isinstance(t, ir.TensorViewType):
        strides = ",".join("?" if s is None else str(s) for s in t.strides)
        return f"tensor_view<{_dims(t.shape) + 'x' if t.shape else ''}{t.element}, strides=[{strides}]>"
    if isinstance(t, ir.PartitionViewType):
        parts = [f"tile=({_dims(t.tile_shape)})"]
        if t.padding is not None:
            parts.append(f"padding_value = {t.padding}")
        parts.append(type_str(t.tensor_view))
        if t.dim_map != tuple(range(t.rank)):
            parts.append(f"dim_map=[{', '.join(map(str, t.dim_map))}]")
        return f"partition_view<{', '.join(parts)}>"
    raise TypeError(f"no text for type {t!r}")


def _types(values) -> str:
    return ", ".join(type_str(v.type) for v in values)


def float_str(value: float, element: ir.ScalarType) -> str:
    """MLIR's float spelling: `%.6e` when that reads back to the same value in `element`, else the
    bit pattern in hex (always for inf and NaN)."""
    from tessera.backends.cuda_tile.bytecode import float_bits
    bits = float_bits(value, element)
    if value == value and abs(value) != float("inf"):
        rounded = _from_bits(bits, element)
        short = f"{rounded:.6e}"
        if float_bits(float(short), element) == bits:
            return short
        return repr(rounded)
    width = max(element.bits, 8) // 4
    return f"0x{bits:0{width}X}"


def _from_bits(bits: int, element: ir.ScalarType) -> float:
    if element.name == "f32":
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if element.name == "f64":
        return struct.unpack("<d", struct.pack("<Q", bits))[0]
    if element.name == "f16":
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    import ml_dtypes
    import numpy as np
    dtype = {"bf16": ml_dtypes.bfloat16, "f8E4M3FN": ml_dtypes.float8_e4m3fn, "f8E5M2": ml_dtypes.float8_e5m2}
    raw = np.array(bits, dtype=np.uint16 if element.bits == 16 else np.uint8)
    return float(raw.view(dtype[element.name]))


def scalar_str(value, element: ir.ScalarType) -> str:
    if element.name == "i1":
        return "true" if value else "false"
    return float_str(value, element) if element.is_float else str(int(value))


def hints_str(hints: dict) -> str:
    """`<sm_90 = {allow_tma = false, latency = 3}>` (keys sorted, as in an MLIR dictionary)."""
    parts = []
    for target, h in hints.items():
        items = []
        for key in sorted(vars(h)):
            v = getattr(h, key)
            if v is not None:
                items.append(f"{key} = {str(v).lower() if isinstance(v, bool) else v}")
        parts.append(f"{target} = {{{', '.join(items)}}}")
    return f"<{', '.join(parts)}>"


def predicate_str(p) -> str:
    if isinstance(p, ir.DivBy):
        extra = (f", every {p.every}" if p.every is not None else "") + (f" along {p.along}" if p.along is not None else "")
        return f"div_by<{p.divisor}{extra}>"
    return f"bounded<{'?' if p.lb is None else p.lb}, {'?' if p.ub is None else p.ub}>"


# --------------------------------------------------------------------------------------------------
# Printer
# --------------------------------------------------------------------------------------------------


class _Printer:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.used: set[str] = set()
        self.counter = 0
        self.lines: list[str] = []

    # -- names ------------------------------------------------------------------------------------

    def _fresh(self, hint: str | None) -> str:
        if hint is None:
            while str(self.counter) in self.used:
                self.counter += 1
            name = str(self.counter)
            self.counter += 1
        else:
            name, i = hint, 0
            while name in self.used:
                name, i = f"{hint}_{i}", i + 1
        self.used.add(name)
        return name

    def define(self, v: ir.Value, hint: str | None = None) -> str:
        self.names[v.uid] = "%" + self._fresh(v.name or hint)
        return self.names[v.uid]

    def ref(self, v: ir.Value) -> str:
        if v.uid not in self.names:
            raise ValueError(f"{v!r} is used before it is defined")
        return self.names[v.uid]

    def refs(self, values) -> str:
        return ", ".join(self.ref(v) for v in values)

    # -- structure --------------------------------------------------------------------------------

    def entry(self, e: ir.Entry, indent: str) -> None:
        args = ", ".join(f"{self.define(a, f'arg{i}')}: {type_str(a.type)}" for i, a in enumerate(e.args))
        hints = f" optimization_hints={hints_str(e.hints)}" if e.hints else ""
        self.lines.append(f"{indent}entry @{e.name}({args}){hints} {{")
        self.block_ops(e.body, indent + "  ", None)
        self.lines.append(f"{indent}}}")

    def block_ops(self, block: ir.Block, indent: str, parent: str | None) -> None:
        ops = block.ops
        if ops and (parent, ops[-1].name) in IMPLICIT_TERMINATORS and not ops[-1].operand_values():
            ops = ops[:-1]
        for op in ops:
            self.op(op, indent)

    def results(self, op: ir.Op) -> str:
        if not op.results:
            return ""
        if len(op.results) == 1 or op.name in SEPARATELY_NAMED:
            return ", ".join(self.define(r) for r in op.results) + " = "
        base = "%" + self._fresh(op.results[0].name)
        for i, r in enumerate(op.results):
            self.names[r.uid] = f"{base}#{i}"
        return f"{base}:{len(op.results)} = "

    def op(self, op: ir.Op, indent: str) -> None:
        fn = _FORMATS.get(op.name)
        if fn is None:
            raise ValueError(f"no text form for op {op.name}")
        fn(self, op, indent)


def _attr(op: ir.Op, name: str):
    """The attribute's value, or its schema default when absent."""
    v = op.attrs.get(name)
    if v is None:
        spec = next((a for a in op.schema.attrs if a.name == name), None)
        v = spec.default if spec is not None else None
    return v


def _suffix(op: ir.Op) -> str:
    """Attributes printed after the operands: signedness, non-default rounding and overflow, unit flags."""
    out = []
    for a in op.schema.attrs:
        v = _attr(op, a.name)
        if a.kind == "enum:signedness" and op.name not in ("cmpi", "mmai"):
            out.append(v)
        elif a.kind in ("enum:rounding", "enum:overflow") and v is not None and v != a.default:
            out.append(f"{'overflow' if a.kind == 'enum:overflow' else 'rounding'}<{v}>")
    flags = [a.name for a in op.schema.attrs if a.kind == "flag" and op.attrs.get(a.name)]
    out += sorted(flags) if op.name in ("maxf", "minf") else flags
    return "".join(" " + s for s in out)


def _line(p: _Printer, op: ir.Op, indent: str, body: str) -> None:
    p.lines.append(f"{indent}{p.results(op)}{op.name} {body}".rstrip())


def _same_type(p, op, indent):          # addf %a, %b rounding<zero> : tile<4xf32>
    _line(p, op, indent, f"{p.refs(op.operand_values())}{_suffix(op)} : {type_str(op.result.type)}")


def _convert(p, op, indent):            # ftof %x : tile<4xf32> -> tile<4xf16>
    (src,) = op.operand_values()
    _line(p, op, indent, f"{p.ref(src)}{_suffix(op)} : {type_str(src.type)} -> {type_str(op.result.type)}")


def _compare(p, op, indent):
    a, b = op.operand_values()
    pred = op.attrs["comparison_predicate"]
    if op.name == "cmpf":
        body = f"{pred} {op.attrs['comparison_ordering']} {p.ref(a)}, {p.ref(b)}"
    else:
        body = f"{pred} {p.ref(a)}, {p.ref(b)}, {op.attrs['signedness']}"
    _line(p, op, indent, f"{body} : {type_str(a.type)} -> {type_str(op.result.type)}")


def _constant(p, op, indent):
    c: ir.DenseConstant = op.attrs["value"]
    vals = [scalar_str(v, c.element) for v in c.values]
    text = vals[0] if c.is_splat else f"[{', '.join(vals)}]"
    _line(p, op, indent, f"<{c.element}: {text}> : {type_str(op.result.type)}")


def _nullary(p, op, indent):            # iota : tile<8xi32>;  get_tile_block_id : tile<i32>
    _line(p, op, indent, f": {type_str(op.results[0].type)}")


def _select(p, op, indent):
    c = op.operands["cond"]
    _line(p, op, indent, f"{p.refs(op.operand_values())} : {type_str(c.type)}, {type_str(op.result.type)}")


def _permute(p, op, indent):
    src = op.operands["source"]
    perm = ", ".join(map(str, op.attrs["permutation"]))
    _line(p, op, indent, f"{p.ref(src)} [{perm}] : {type_str(src.type)} -> {type_str(op.result.type)}")


def _cat(p, op, indent):
    a, b = op.operand_values()
    _line(p, op, indent, f"{p.ref(a)}, {p.ref(b)} dim = {op.attrs['dim']} : {type_str(a.type)}, "
                         f"{type_str(b.type)} -> {type_str(op.result.type)}")


def _extract(p, op, indent):
    src = op.operands["source"]
    _line(p, op, indent, f"{p.ref(src)}[{p.refs(op.operands['indices'])}] : {type_str(src.type)} -> "
                         f"{type_str(op.result.type)}")


def _assume(p, op, indent):
    v = op.operands["value"]
    _line(p, op, indent, f"{predicate_str(op.attrs['predicate'])}, {p.ref(v)} : {type_str(v.type)}")


def _offset(p, op, indent):
    a, b = op.operand_values()
    _line(p, op, indent, f"{p.ref(a)}, {p.ref(b)} : {type_str(a.type)}, {type_str(b.type)} -> "
                         f"{type_str(op.result.type)}")


def _tensor_view(p, op, indent):
    t: ir.TensorViewType = op.result.type
    dyn_shape, dyn_strides = iter(op.operands["dynamicShape"]), iter(op.operands["dynamicStrides"])
    shape = ", ".join(p.ref(next(dyn_shape)) if d is None else str(d) for d in t.shape)
    strides = ", ".join(p.ref(next(dyn_strides)) if s is None else str(s) for s in t.strides)
    dynamic = op.operands["dynamicShape"] + op.operands["dynamicStrides"]
    index_type = f"{type_str(dynamic[0].type)} -> " if dynamic else ""
    _line(p, op, indent, f"{p.ref(op.operands['base'])}, shape = [{shape}], strides = [{strides}] : "
                         f"{index_type}{type_str(t)}")


def _partition_view(p, op, indent):
    _line(p, op, indent, f"{p.ref(op.operands['tensor_view'])} : {type_str(op.result.type)}")


def _memory_prefix(op: ir.Op) -> str:
    scope = op.attrs.get("memory_scope")
    return op.attrs["memory_ordering_semantics"] + (f" {scope}" if scope else "")


def _hints_suffix(op: ir.Op) -> str:
    h = op.attrs.get("optimization_hints")
    return f" optimization_hints = {hints_str(h)}" if h else ""


def _view_access(p, op, indent):
    view, index, token = op.operands["view"], op.operands["index"], op.operands.get("token")
    tok = f" token = {p.ref(token)}" if token is not None else ""
    idx_type = type_str(index[0].type) if index else ""
    if op.name == "load_view_tko":
        head = f"{p.ref(view)}[{p.refs(index)}]"
        types = f"{type_str(view.type)}, {idx_type} -> {type_str(op.results[0].type)}, token"
    else:
        t = op.operands["tile"]
        head = f"{p.ref(t)}, {p.ref(view)}[{p.refs(index)}]"
        types = f"{type_str(t.type)}, {type_str(view.type)}, {idx_type} -> token"
    _line(p, op, indent, f"{_memory_prefix(op)} {head}{tok}{_hints_suffix(op)} : {types}")


def _pointer_access(p, op, indent):
    names = ("source", "mask", "paddingValue") if op.name == "load_ptr_tko" else ("destination", "value", "mask")
    present = [op.operands.get(n) for n in names if op.operands.get(n) is not None]
    token = op.operands.get("token")
    tok = f" token={p.ref(token)}" if token is not None else ""
    outs = f"{type_str(op.results[0].type)}, token" if op.name == "load_ptr_tko" else "token"
    _line(p, op, indent, f"{_memory_prefix(op)} {p.refs(present)}{tok}{_hints_suffix(op)} : "
                         f"{_types(present)} -> {outs}")


def _mma(p, op, indent):
    vals = op.operand_values()
    sign = f" {op.attrs['signedness_lhs']} {op.attrs['signedness_rhs']}" if op.name == "mmai" else _suffix(op)
    _line(p, op, indent, f"{p.refs(vals)}{sign} : {_types(vals)}")


def _tokens(p, op, indent):
    _line(p, op, indent, f"{p.refs(op.operands['tokens'])} : token")


def _terminator(p, op, indent):         # yield %a, %b : tile<f32>, tile<i32>
    vals = op.operand_values()
    _line(p, op, indent, f"{p.refs(vals)} : {_types(vals)}" if vals else "")


def _assert(p, op, indent):
    c = op.operands["condition"]
    _line(p, op, indent, f'{p.ref(c)}, "{op.attrs["message"]}" : {type_str(c.type)}')


def _for(p, op, indent):
    lb, ub, step = (op.operands[n] for n in ("lowerBound", "upperBound", "step"))
    init = op.operands["initValues"]
    block = op.regions[0].block
    head = f"{p.results(op)}for "
    bounds = f"({p.ref(lb)} to {p.ref(ub)}, step {p.ref(step)})"
    unsigned = " unsigned" if op.attrs.get("unsignedCmp") else ""
    iv = p.define(block.args[0], "loopIdx")
    iters = ""
    if init:
        pairs = ", ".join(f"{p.define(a, f'iterArg{i}')} = {p.ref(v)}" for i, (a, v) in enumerate(zip(block.args[1:], init)))
        iters = f" iter_values({pairs}) -> ({_types(op.results)})"
    p.lines.append(f"{indent}{head}{unsigned.strip() + ' ' if unsigned else ''}{iv} in {bounds} : "
                   f"{type_str(lb.type)}{iters} {{")
    p.block_ops(block, indent + "  ", "for")
    p.lines.append(f"{indent}}}")


def _loop(p, op, indent):
    init = op.operands["initValues"]
    block = op.regions[0].block
    head = f"{indent}{p.results(op)}loop"
    if init:
        pairs = ", ".join(f"{p.define(a)} = {p.ref(v)}" for a, v in zip(block.args, init))
        head += f" iter_values({pairs}) : {_types(init)}"
    if op.results:
        head += f" -> {_types(op.results)}" if init else f" : {_types(op.results)}"
    p.lines.append(head + " {")
    p.block_ops(block, indent + "  ", "loop")
    p.lines.append(f"{indent}}}")


def _if(p, op, indent):
    res = f" -> ({_types(op.results)})" if op.results else ""
    p.lines.append(f"{indent}{p.results(op)}if {p.ref(op.operands['condition'])}{res} {{")
    then, other = op.regions
    p.block_ops(then.block, indent + "  ", "if")
    if other.block.ops:
        p.lines.append(f"{indent}}} else {{")
        p.block_ops(other.block, indent + "  ", "if")
    p.lines.append(f"{indent}}}")


def _reduce(p, op, indent):
    vals = op.operands["operands"]
    idents = ", ".join(f"{scalar_str(v, e)} : {e}" for e, v in op.attrs["identities"])
    head = f"{indent}{p.results(op)}reduce {p.refs(vals)} dim={op.attrs['dim']} identities=[{idents}] : " \
           f"{_types(vals)} -> {_types(op.results)}"
    block = op.regions[0].block
    many = len(vals) > 1
    args = []
    for i, a in enumerate(block.args):
        side = "lhs" if i % 2 == 0 else "rhs"
        hint = f"reduce_{side}{i // 2}" if many else f"reduce_{side}"
        args.append(f"{p.define(a, hint)}: {type_str(a.type)}")
    p.lines.append(head)
    p.lines.append(f"{indent}({', '.join(args)}) {{")
    p.block_ops(block, indent + "  ", "reduce")
    p.lines.append(f"{indent}}}")


_FORMATS = {
    **{n: _same_type for n in (
        "absf", "addf", "subf", "mulf", "divf", "remf", "negf", "maxf", "minf", "fma", "exp", "exp2", "log",
        "log2", "sqrt", "rsqrt", "tanh", "sin", "cos", "tan", "sinh", "cosh", "floor", "ceil", "fpowf",
        "absi", "addi", "subi", "muli", "mulhii", "divi", "remi", "maxi", "mini", "negi", "andi", "ori", "xori",
        "shli", "shri")},
    **{n: _convert for n in ("ftof", "itof", "ftoi", "exti", "trunci", "bitcast", "int_to_ptr", "ptr_to_int",
                             "broadcast", "reshape")},
    "cmpf": _compare, "cmpi": _compare, "select": _select, "constant": _constant,
    "iota": _nullary, "make_token": _nullary, "get_tile_block_id": _nullary, "get_num_tile_blocks": _nullary,
    "permute": _permute, "cat": _cat, "extract": _extract, "assume": _assume, "offset": _offset,
    "make_tensor_view": _tensor_view, "make_partition_view": _partition_view,
    "load_view_tko": _view_access, "store_view_tko": _view_access,
    "load_ptr_tko": _pointer_access, "store_ptr_tko": _pointer_access,
    "join_tokens": _tokens, "mmaf": _mma, "mmai": _mma,
    "yield": _terminator, "continue": _terminator, "break": _terminator, "return": _terminator,
    "assert": _assert, "for": _for, "loop": _loop, "if": _if, "reduce": _reduce,
}


def print_entry(entry: ir.Entry, indent: str = "") -> str:
    """One entry as tileirdisasm prints it."""
    p = _Printer()
    p.entry(entry, indent)
    return "\n".join(p.lines) + "\n"


def print_module(module: ir.Module) -> str:
    """The whole module: `cuda_tile.module @name { entry ... }`."""
    body = "\n".join(print_entry(e, "  ").rstrip("\n") for e in module.entries)
    return f"cuda_tile.module @{module.name} {{\n{body}\n}}\n"


# --------------------------------------------------------------------------------------------------
# Comparing texts
# --------------------------------------------------------------------------------------------------

_NAME = r"%[A-Za-z0-9_$.\-]+"
_SSA = re.compile(_NAME + r"(?::\d+)?(?:#\d+)?")
_RESULTS = re.compile(rf"^((?:{_NAME}(?::\d+)?, )*{_NAME}(?::\d+)?) = ")
_FLOAT_LIST = re.compile(r"<(f16|bf16|f32|f64|f8E4M3FN|f8E5M2): ([^>]*)>")
_FLOAT_IDENTITY = re.compile(r"(\S+) : (f16|bf16|f32|f64|f8E4M3FN|f8E5M2)\b")
_NUMBER = re.compile(r"0x[0-9A-Fa-f]+|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan")


def _canonical_float(literal: str, element: str) -> str:
    """A float literal as the hex bits it denotes in `element`: decimal spellings of one value agree."""
    from tessera.backends.cuda_tile.bytecode import float_bits
    if literal.startswith("0x"):
        return literal.upper().replace("0X", "0x")
    bits = float_bits(float(literal), ir.SCALAR_TYPES[element])
    return f"0x{bits:X}"


def _canonical_floats(line: str) -> str:
    line = _FLOAT_LIST.sub(lambda m: f"<{m.group(1)}: " + _NUMBER.sub(
        lambda n: _canonical_float(n.group(0), m.group(1)), m.group(2)) + ">", line)
    return _FLOAT_IDENTITY.sub(lambda m: (_canonical_float(m.group(1), m.group(2))
                                          if _NUMBER.fullmatch(m.group(1)) else m.group(1)) + f" : {m.group(2)}", line)


def normalize(text: str) -> str:
    """Text for comparing two printers: each SSA definition renamed `%v<N>` in order (uses follow
    the latest definition of their name, so names a printer reuses in sibling regions stay apart;
    grouped results keep their `:N`/`#i`), float literals as their bits, whitespace collapsed and
    the module wrapper dropped."""
    lines = [ln.strip() for ln in text.splitlines()]
    if lines and lines[0].startswith("cuda_tile.module"):
        lines = lines[1:-1] if lines[-1] == "}" else lines[1:]
    current: dict[str, str] = {}
    counter = [0]

    def define(base: str) -> str:
        current[base] = f"%v{counter[0]}"
        counter[0] += 1
        return current[base]

    def rename_use(m: re.Match) -> str:
        tok = m.group(0)
        base = re.match(_NAME, tok).group(0)
        return current.get(base, base) + tok[len(base):]

    out = []
    for ln in lines:
        if not ln:
            continue
        ln = re.sub(r"\s+", " ", _canonical_floats(ln))
        results = _RESULTS.match(ln)
        head, rest = (results.group(1), ln[results.end():]) if results else ("", ln)
        # definitions inside the line: block and entry arguments (`%x: T`), iter_values (`%x = %y`)
        # and the `for` induction variable; rename uses first so `%x = %x` reads the outer one
        rest = _SSA.sub(lambda m: m.group(0) if _is_definition(rest, m) else rename_use(m), rest)
        rest = re.sub(rf"({_NAME})(?=: | = |\sin\s\()", lambda m: define(m.group(1)), rest)
        if head:
            head = re.sub(_NAME, lambda m: define(m.group(0)), head) + " = "
        out.append(head + rest)
    return "\n".join(out) + "\n"


def _is_definition(line: str, m: re.Match) -> bool:
    after = line[m.end():m.end() + 4]
    return after.startswith(": ") or after.startswith(" = ") or after.startswith(" in ")
