"""A NumPy interpreter of cuda_tile programs: what the lowering emits, run on the CPU.

tileiras checks that a cuda_tile program is well formed; nothing but a GPU checks that it computes
the right thing. This module runs an entry (`ir.Entry`) with NumPy so the CPU tests can compare the
lowering's programs with Tessera's own tile interpreter and the float64 reference.

The model:
- every tile is a NumPy array (0-d tiles: 0-d arrays or NumPy scalars) of its element's storage
  type: f16 as np.float16, bf16 as ml_dtypes.bfloat16, f32 as np.float32, i32 as np.int32 (integer
  arithmetic wraps), i1 as bool. Float math on f16/bf16 tiles is done in f32 and rounded back after
  every op, as the GPU rounds every op's result; `mmaf` multiplies in f32 and accumulates in the
  accumulator's type;
- a pointer is (buffer index, element offset): a `tile<ptr<T>>` is a `Pointers` of one buffer and
  an int64 array of offsets into that buffer seen flat. Each entry argument of pointer type is bound
  to one contiguous NumPy buffer, which stores write in place;
- a tensor view is a strided NumPy view of its buffer; a partition view adds (statically, from its
  type) the tile shape, dim map and padding. `load_view_tko` reads the tile at tile coordinates
  `index` (element start = index * tile shape), with out-of-bounds elements reading the view's
  padding (an unspecified padding reads NaN, or the integer minimum, so a result that depends on
  it shows); `store_view_tko` drops out-of-bounds elements. An index outside the view's index
  space (a tile wholly outside the tensor) is undefined behaviour in the dialect: `InterpError`.
  `load_ptr_tko`/`store_ptr_tko` gather and scatter where the mask holds; an address outside the
  buffer where the mask holds raises `InterpError` (a GPU would read or corrupt other memory);
- tokens are None: ops run in program order, blocks one after another (x fastest). The dialect
  lets tileiras reorder memory ops that no token orders; that is not checked within a block. Across
  blocks, which a GPU runs in any order or at once, it is: on every buffer the entry stores to,
  an element that one block writes and another block reads or writes raises `InterpError` (a race);
- `assume` checks its predicate (div_by, bounded) and raises `InterpError` when the program assumes
  something false.

Speed: each entry is compiled once (cached on the Entry) into a list of closures over a frame (a
Python list indexed by value slot). Ops whose operands are all constants (the lowering's splatted
constants, iotas and index arithmetic on them) are evaluated once at compile time. A `reduce`
whose combiner is one commutative op (addf, maxf, addi, ...) is one NumPy reduction; any other
combiner runs on whole tiles as a tree (halving the reduced dim each step).

Entry points: `run_entry(entry, grid, buffers)` runs one kernel over a grid; `run_kernels(kernels,
tile_module, *inputs)` runs a whole compiled function the way `Compiled.run` runs its Tile IR module
(outputs and intermediates allocated NaN-poisoned, kernels launched in host order).
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from ...errors import TesseraError
from . import ir as ct

__all__ = ["InterpError", "Pointers", "np_dtype", "run_entry", "run_kernels"]


class InterpError(TesseraError):
    """A cuda_tile program that does something undefined: an access outside its buffer, a false
    `assume`, an op or attribute the interpreter does not model."""


# --------------------------------------------------------------------------------------------------
# Element types
# --------------------------------------------------------------------------------------------------

DTYPES: dict[str, np.dtype] = {
    "i1": np.dtype(np.bool_), "i8": np.dtype(np.int8), "i16": np.dtype(np.int16), "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
    "f8E4M3FN": np.dtype(ml_dtypes.float8_e4m3fn), "f8E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
UNSIGNED = {np.dtype(np.int8): np.dtype(np.uint8), np.dtype(np.int16): np.dtype(np.uint16),
            np.dtype(np.int32): np.dtype(np.uint32), np.dtype(np.int64): np.dtype(np.uint64),
            np.dtype(np.bool_): np.dtype(np.bool_)}
F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def np_dtype(t: ct.ScalarType | ct.TileType) -> np.dtype:
    """The NumPy storage type of a cuda_tile element type (or of a tile's elements)."""
    if isinstance(t, ct.TileType):
        t = t.element
    if isinstance(t, ct.PointerType):
        raise InterpError("a pointer tile has no NumPy element type (it is a Pointers)")
    try:
        return DTYPES[t.name]
    except KeyError:
        raise InterpError(f"cuda_tile interpreter: element type {t} is not modelled") from None


def _compute(dt: np.dtype) -> np.dtype:
    """Where float math on `dt` happens: f32 for f16/bf16/fp8 (rounded back after each op)."""
    return dt if dt in (F32, F64) else F32


def _poison(shape, dt: np.dtype) -> np.ndarray:
    fill = False if dt == np.bool_ else (np.iinfo(dt).min if dt.kind in "iu" else np.nan)
    return np.full(tuple(shape), fill, dt)


PADDING = {"zero": 0.0, "neg_zero": -0.0, "nan": math.nan, "pos_inf": math.inf, "neg_inf": -math.inf}


class Pointers:
    """A tile of pointers into one buffer: `buf` (its index among the entry's buffers) and `off`,
    element offsets (an int64 array of the tile's shape) from the buffer's start."""

    __slots__ = ("buf", "off")

    def __init__(self, buf: int, off):
        self.buf, self.off = buf, np.asarray(off, np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.off.shape

    def __repr__(self) -> str:
        return f"Pointers(buf={self.buf}, off={self.off!r})"


def _on_pointers(fn: Callable) -> Callable:
    """A shape op (broadcast, reshape, permute, ...) that also takes pointer tiles."""
    def g(x, *rest):
        if isinstance(x, Pointers):
            return Pointers(x.buf, fn(x.off, *rest))
        return fn(x, *rest)
    return g


# --------------------------------------------------------------------------------------------------
# Numerics
# --------------------------------------------------------------------------------------------------


def _u(x, dt: np.dtype):
    """x (of signed integer type dt) as its unsigned bit pattern."""
    return np.asarray(x).view(UNSIGNED[dt])


def _float_fn(fn: Callable, dt: np.dtype, arity: int) -> Callable:
    """fn on tiles of dt, computed in f32 for the narrow types and rounded back."""
    if dt in (F32, F64):
        return fn
    if arity == 1:
        return lambda a: np.asarray(fn(a.astype(F32))).astype(dt)
    if arity == 2:
        return lambda a, b: np.asarray(fn(a.astype(F32), b.astype(F32))).astype(dt)
    return lambda *xs: np.asarray(fn(*(x.astype(F32) for x in xs))).astype(dt)


def _flush(dt: np.dtype) -> Callable:
    tiny = np.finfo(_compute(dt)).tiny if dt in (F32, F64) else np.finfo(F32).tiny

    def flush(x):
        return np.where(np.abs(x) < tiny, np.copysign(np.zeros((), x.dtype), x), x)
    return flush


def _fma(a, b, c):
    dt = np.asarray(c).dtype
    wide = np.longdouble if dt == F64 else F64
    return (np.multiply(a, b, dtype=wide) + c).astype(dt)


def _rsqrt(x):
    dt = np.asarray(x).dtype
    return (1.0 / np.sqrt(np.asarray(x, F64))).astype(dt)


FLOAT_UNARY: dict[str, Callable] = {
    "absf": np.abs, "negf": np.negative, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
    "sqrt": np.sqrt, "rsqrt": _rsqrt, "tanh": np.tanh, "sin": np.sin, "cos": np.cos, "tan": np.tan,
    "sinh": np.sinh, "cosh": np.cosh, "floor": np.floor, "ceil": np.ceil,
}
FLOAT_BINARY: dict[str, Callable] = {
    "addf": np.add, "subf": np.subtract, "mulf": np.multiply, "divf": np.divide, "remf": np.fmod,
    "fpowf": np.power,
}
#: rounding modes that mean "round to nearest even" for the ops that take them
NEAREST = {None, "nearest_even", "full", "approx"}


def _divi(signed: bool, rounding: str, dt: np.dtype) -> Callable:
    if rounding not in ("zero", "negative_inf", "positive_inf"):
        raise InterpError(f"divi rounding {rounding} is not modelled")

    def div(a, b):
        if not signed:
            a, b = _u(a, dt), _u(b, dt)
        q = np.floor_divide(a, b)
        r = np.asarray(a - q * b)
        if rounding == "positive_inf":
            q = q + (r != 0)
        elif rounding == "zero" and signed:
            q = q + ((r != 0) & ((np.asarray(a) < 0) != (np.asarray(b) < 0)))
        q = np.asarray(q).astype(UNSIGNED[dt] if not signed else dt, copy=False)
        return q.view(dt) if not signed else q
    return div


def _remi(signed: bool, dt: np.dtype) -> Callable:
    if signed:
        return np.fmod    # C remainder: the sign of the dividend
    return lambda a, b: np.asarray(np.remainder(_u(a, dt), _u(b, dt))).view(dt)


def _unsigned(fn: Callable, dt: np.dtype, keep_bits: bool = True) -> Callable:
    """fn applied to the unsigned bit patterns of a and b; results of integer type reinterpreted."""
    def g(a, b):
        r = np.asarray(fn(_u(a, dt), _u(b, dt)))
        return r.view(dt) if keep_bits and r.dtype != np.bool_ else r
    return g


CMP = {"equal": np.equal, "not_equal": np.not_equal, "less_than": np.less, "less_than_or_equal": np.less_equal,
       "greater_than": np.greater, "greater_than_or_equal": np.greater_equal}


def _cmpf(predicate: str, ordered: bool) -> Callable:
    fn = CMP[predicate]
    if ordered:
        if predicate == "not_equal":   # NumPy's != is true on NaN
            return lambda a, b: (a != b) & (a == a) & (b == b)
        return fn                      # NumPy's other comparisons are false on NaN
    if predicate == "not_equal":
        return fn
    return lambda a, b: fn(a, b) | np.isnan(a) | np.isnan(b)


def _ftoi(dt: np.dtype, signed: bool) -> Callable:
    """Float to integer, toward zero, saturating (NaN -> 0), as the GPU's cvt.rzi.sat."""
    target = dt if signed or dt == np.bool_ else UNSIGNED[dt]
    info = np.iinfo(target)

    def ftoi(x):
        r = np.trunc(np.asarray(x, F64))
        r = np.where(np.isnan(r), 0.0, np.clip(r, info.min, info.max))
        out = r.astype(target)
        return out if target == dt else out.view(dt)
    return ftoi


def _itof(dt: np.dtype, src: np.dtype, signed: bool) -> Callable:
    def itof(x):
        x = np.asarray(x)
        if not signed and src != np.bool_:
            x = x.view(UNSIGNED[src])
        return x.astype(F64).astype(dt)
    return itof


def _exti(dt: np.dtype, src: np.dtype, signed: bool) -> Callable:
    def exti(x):
        x = np.asarray(x)
        if src == np.bool_:
            return -x.astype(dt) if signed else x.astype(dt)
        if not signed:
            x = x.view(UNSIGNED[src])
        return x.astype(dt)
    return exti


def _trunci(dt: np.dtype) -> Callable:
    if dt == np.bool_:
        return lambda x: (np.asarray(x) & 1).astype(np.bool_)
    return lambda x: np.asarray(x).astype(dt)


def _ftof(dt: np.dtype, src: np.dtype) -> Callable:
    if src in (F32, F64) or dt in (F32, F64):
        return lambda x: np.asarray(x).astype(dt)
    return lambda x: np.asarray(x).astype(F32).astype(dt)    # f16 <-> bf16 through f32 (exact)


# --------------------------------------------------------------------------------------------------
# The compiled form: a frame of slots and a list of steps per block
# --------------------------------------------------------------------------------------------------

Step = Callable[[list], object]


class _Context:
    """What one launch's blocks share: the buffers (and their flat views), the grid, this block's
    id, and the tensor views built so far."""

    __slots__ = ("buffers", "flat", "grid", "bid", "block", "views", "writer", "reader")

    def __init__(self, buffers: list, grid: tuple[int, int, int], stored: set[int]):
        self.buffers = buffers
        self.flat = [b.reshape(-1) if isinstance(b, np.ndarray) else None for b in buffers]
        self.grid = tuple(np.int32(g) for g in grid)
        self.bid = (np.int32(0),) * 3
        self.block = -1                 # the block's linear id
        self.views: dict = {}
        # for each buffer the entry may store to: which block wrote each element (-1: none) and
        # which block read it (-1: none, -2: several)
        self.writer = {i: np.full(self.flat[i].size, -1, np.int64) for i in stored}
        self.reader = {i: np.full(self.flat[i].size, -1, np.int64) for i in stored}

    def race(self, what: str, idx: np.ndarray, others: np.ndarray, buf: int) -> None:
        bad = int(np.argmax(others))
        raise InterpError(f"race: {what} element {int(idx.reshape(-1)[bad])} of buffer {buf} in block "
                          f"{tuple(int(b) for b in self.bid)}, which another block of the launch "
                          f"{'reads' if what == 'store to' else 'writes'}; blocks run in no fixed order")

    def read(self, buf: int, idx: np.ndarray) -> None:
        """Block `self.block` reads elements `idx` of a buffer the launch writes."""
        w = self.writer[buf][idx]
        others = (w != -1) & (w != self.block)
        if others.any():
            self.race("load of", idx, others, buf)
        r = self.reader[buf]
        seen = r[idx]
        r[idx] = np.where((seen == -1) | (seen == self.block), self.block, -2)

    def write(self, buf: int, idx: np.ndarray) -> None:
        w = self.writer[buf][idx]
        others = (w != -1) & (w != self.block)
        if others.any():
            self.race("second store to", idx, others, buf)
        r = self.reader[buf][idx]
        others = (r != -1) & (r != self.block)
        if others.any():
            self.race("store to", idx, others, buf)
        self.writer[buf][idx] = self.block


class _Block:
    __slots__ = ("steps", "kind", "term")

    def __init__(self, steps: list[Step], kind: str, term: list[int]):
        self.steps, self.kind, self.term = steps, kind, term

    def run(self, f: list) -> tuple[str, list]:
        """Runs the steps; returns (terminator, its values). A step returns non-None only for a
        `break`/`continue`/`return` escaping a nested region, which ends this block too."""
        for s in self.steps:
            r = s(f)
            if r is not None:
                return r
        return self.kind, [f[i] for i in self.term]


class _Entry:
    def __init__(self, entry: ct.Entry):
        self.slots: dict[ct.Value, int] = {}
        self.known: dict[int, object] = {}     # slot -> value computed at compile time
        self.defs: dict[ct.Value, ct.Op] = {}
        self.stores: list[ct.Op] = []
        self.arg_slots = [self.slot(a) for a in entry.args]
        self.arg_types = entry.arg_types
        self.body = self.block(entry.body)
        self.stored = {i for op in self.stores for i in self._roots(op.operand_values()[1 if op.name == "store_view_tko"
                                                                                         else 0], entry.args)}
        self.template = [None] * (len(self.slots) + 1)
        for s, v in self.known.items():
            self.template[s] = v

    def _roots(self, v: ct.Value, args: list[ct.Value]) -> set[int]:
        """The entry arguments a pointer or view value is derived from."""
        if v in args:
            return {args.index(v)}
        op = self.defs.get(v)
        if op is None:
            return set(range(len(args)))     # unknown: any
        sources = {"make_tensor_view": ["base"], "make_partition_view": ["tensor_view"], "offset": ["ptr"],
                   "select": ["val_if_true", "val_if_false"], "cat": ["lhs", "rhs"]}.get(op.name)
        if sources is None:
            sources = ["source"] if "source" in op.operands else ["value"] if op.name == "assume" else []
        if not sources:
            return set(range(len(args)))
        return set().union(*(self._roots(op.operands[k], args) for k in sources))

    def slot(self, v: ct.Value) -> int:
        s = self.slots.get(v)
        if s is None:
            s = self.slots[v] = len(self.slots) + 1    # slot 0 holds the launch's _Context
        return s

    def block(self, block: ct.Block) -> _Block:
        steps = []
        for op in block.ops:
            if op.name in TERMINATORS:
                if op is not block.ops[-1]:
                    raise InterpError(f"{op.name} before the end of its block")
                return _Block(steps, op.name, [self.slot(v) for v in op.operands["operands"]])
            step = self.op(op)
            if step is not None:
                steps.append(step)
        return _Block(steps, "yield", [])

    def op(self, op: ct.Op) -> Step | None:
        for r in op.results:
            self.defs[r] = op
        if op.name in ("store_view_tko", "store_ptr_tko"):
            self.stores.append(op)
        builder = BUILDERS.get(op.name)
        if builder is None:
            raise InterpError(f"cuda_tile interpreter: op {op.name} is not modelled")
        step = builder(self, op)
        if step is None or op.name not in PURE:
            return step
        ins = [self.slot(v) for v in op.operand_values()]
        if all(s in self.known for s in ins):       # constant operands: run it now, once
            scratch = _Scratch(self.known)
            step(scratch)
            return None
        return step

    def ins(self, op: ct.Op) -> list[int]:
        return [self.slot(v) for v in op.operand_values()]

    def out(self, op: ct.Op) -> int:
        return self.slot(op.result)


class _Scratch(dict):
    """A frame for evaluating an op at compile time: reads and writes the known values."""

    def __init__(self, known: dict):
        super().__init__()
        self.known = known

    def __getitem__(self, k):
        return self.known[k]

    def __setitem__(self, k, v):
        self.known[k] = v


def _apply(fn: Callable, ins: list[int], out: int) -> Step:
    if len(ins) == 1:
        a, = ins

        def step(f): f[out] = fn(f[a])
    elif len(ins) == 2:
        a, b = ins

        def step(f): f[out] = fn(f[a], f[b])
    elif len(ins) == 3:
        a, b, c = ins

        def step(f): f[out] = fn(f[a], f[b], f[c])
    else:
        def step(f): f[out] = fn(*[f[i] for i in ins])
    return step


TERMINATORS = {"yield", "continue", "break", "return"}

# -- builders: (compiled entry, op) -> step ---------------------------------------------------------


def _result_dtype(op: ct.Op) -> np.dtype:
    return np_dtype(op.results[0].type)


def _check_rounding(op: ct.Op, attr: str = "rounding_mode") -> None:
    mode = op.attrs.get(attr)
    if mode not in NEAREST:
        raise InterpError(f"{op.name} rounding {mode} is not modelled")


def _float_unary(c: _Entry, op: ct.Op) -> Step:
    _check_rounding(op)
    dt = _result_dtype(op)
    fn = _float_fn(FLOAT_UNARY[op.name], dt, 1)
    if op.attrs.get("flush_to_zero"):
        flush, inner = _flush(dt), fn
        fn = lambda x: flush(inner(flush(x)))  # noqa: E731
    return _apply(fn, c.ins(op), c.out(op))


def _float_binary(c: _Entry, op: ct.Op) -> Step:
    _check_rounding(op)
    dt = _result_dtype(op)
    fn = _float_fn(FLOAT_BINARY[op.name], dt, 2)
    if op.attrs.get("flush_to_zero"):
        flush, inner = _flush(dt), fn
        fn = lambda a, b: flush(inner(flush(a), flush(b)))  # noqa: E731
    return _apply(fn, c.ins(op), c.out(op))


def _maxmin_f(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    is_max = op.name == "maxf"
    if op.attrs.get("propagate_nan"):
        base = np.maximum if is_max else np.minimum
    else:
        base = np.fmax if is_max else np.fmin
    fn = _float_fn(base, dt, 2)
    if op.attrs.get("flush_to_zero"):
        flush, inner = _flush(dt), fn
        fn = lambda a, b: flush(inner(flush(a), flush(b)))  # noqa: E731
    return _apply(fn, c.ins(op), c.out(op))


def _fma_step(c: _Entry, op: ct.Op) -> Step:
    _check_rounding(op)
    return _apply(_fma, c.ins(op), c.out(op))


def _cmpf_step(c: _Entry, op: ct.Op) -> Step:
    fn = _cmpf(op.attrs["comparison_predicate"], op.attrs["comparison_ordering"] == "ordered")
    dt = np_dtype(op.operands["lhs"].type)
    if dt not in (F32, F64):
        inner = fn
        fn = lambda a, b: inner(a.astype(F32), b.astype(F32))  # noqa: E731
    return _apply(fn, c.ins(op), c.out(op))


INT_BINARY = {"addi": np.add, "subi": np.subtract, "muli": np.multiply, "andi": np.bitwise_and,
              "ori": np.bitwise_or, "xori": np.bitwise_xor, "shli": np.left_shift}


def _int_binary(c: _Entry, op: ct.Op) -> Step:
    return _apply(INT_BINARY[op.name], c.ins(op), c.out(op))


def _int_signed_binary(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    signed = op.attrs.get("signedness", "signed") == "signed"
    name = op.name
    if name == "divi":
        fn = _divi(signed, op.attrs.get("rounding", "zero"), dt)
    elif name == "remi":
        fn = _remi(signed, dt)
    else:
        base = {"maxi": np.maximum, "mini": np.minimum, "shri": np.right_shift}[name]
        fn = base if signed else _unsigned(base, dt)
    return _apply(fn, c.ins(op), c.out(op))


def _cmpi_step(c: _Entry, op: ct.Op) -> Step:
    fn = CMP[op.attrs["comparison_predicate"]]
    if op.attrs.get("signedness", "signed") != "signed":
        fn = _unsigned(fn, np_dtype(op.operands["lhs"].type), keep_bits=False)
    return _apply(fn, c.ins(op), c.out(op))


def _int_unary(c: _Entry, op: ct.Op) -> Step:
    return _apply({"negi": np.negative, "absi": np.abs}[op.name], c.ins(op), c.out(op))


def _mulhii(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    bits = dt.itemsize * 8
    if bits > 32:
        raise InterpError("mulhii of 64-bit integers is not modelled")
    return _apply(lambda a, b: ((np.asarray(a, np.int64) * np.asarray(b, np.int64)) >> bits).astype(dt),
                  c.ins(op), c.out(op))


def _select(c: _Entry, op: ct.Op) -> Step:
    def select(cond, a, b):
        if isinstance(a, Pointers):
            if a.buf != b.buf:
                raise InterpError("select between pointers into different buffers is not modelled")
            return Pointers(a.buf, np.where(cond, a.off, b.off))
        return np.where(cond, a, b)
    return _apply(select, c.ins(op), c.out(op))


def _convert(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    src = np_dtype(op.operands["from"].type)
    signed = op.attrs.get("signedness", "signed") == "signed"
    name = op.name
    if name == "ftof":
        _check_rounding(op)
        fn = _ftof(dt, src)
    elif name == "itof":
        _check_rounding(op)
        fn = _itof(dt, src, signed)
    elif name == "ftoi":
        if op.attrs.get("rounding_mode", "nearest_int_to_zero") != "nearest_int_to_zero":
            raise InterpError(f"ftoi rounding {op.attrs['rounding_mode']} is not modelled")
        fn = _ftoi(dt, signed)
    elif name == "exti":
        fn = _exti(dt, src, signed)
    else:
        fn = _trunci(dt)
    return _apply(fn, c.ins(op), c.out(op))


def _bitcast(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    return _apply(lambda x: np.asarray(x).view(dt), c.ins(op), c.out(op))


def _constant(c: _Entry, op: ct.Op) -> None:
    t: ct.TileType = op.result.type
    value: ct.DenseConstant = op.attrs["value"]
    dt = np_dtype(t)
    if value.is_splat:
        arr = np.full(t.shape, value.values[0], dt)
    else:
        arr = np.array(value.values, dt).reshape(t.shape)
    arr.flags.writeable = False
    c.known[c.out(op)] = arr
    return None


def _iota(c: _Entry, op: ct.Op) -> None:
    t = op.result.type
    arr = np.arange(t.shape[0], dtype=np_dtype(t))
    arr.flags.writeable = False
    c.known[c.out(op)] = arr
    return None


def _broadcast(c: _Entry, op: ct.Op) -> Step:
    shape = op.result.type.shape
    return _apply(_on_pointers(lambda x: np.broadcast_to(x, shape)), c.ins(op), c.out(op))


def _reshape(c: _Entry, op: ct.Op) -> Step:
    shape = op.result.type.shape
    return _apply(_on_pointers(lambda x: np.reshape(x, shape)), c.ins(op), c.out(op))


def _permute(c: _Entry, op: ct.Op) -> Step:
    perm = tuple(op.attrs["permutation"])
    return _apply(_on_pointers(lambda x: np.transpose(x, perm)), c.ins(op), c.out(op))


def _cat(c: _Entry, op: ct.Op) -> Step:
    dim = op.attrs["dim"]

    def cat(a, b):
        if isinstance(a, Pointers):
            if a.buf != b.buf:
                raise InterpError("cat of pointers into different buffers is not modelled")
            return Pointers(a.buf, np.concatenate([a.off, b.off], dim))
        return np.concatenate([a, b], dim)
    return _apply(cat, c.ins(op), c.out(op))


def _extract(c: _Entry, op: ct.Op) -> Step:
    shape = op.result.type.shape
    src, idx, out = c.slot(op.operands["source"]), [c.slot(v) for v in op.operands["indices"]], c.out(op)

    def step(f):
        x = f[src]
        where = tuple(slice(int(f[i]) * n, int(f[i]) * n + n) for i, n in zip(idx, shape))
        f[out] = Pointers(x.buf, x.off[where]) if isinstance(x, Pointers) else np.array(x[where])
    return step


def _block_id(c: _Entry, op: ct.Op) -> Step:
    x, y, z = (c.slot(r) for r in op.results)

    def step(f): f[x], f[y], f[z] = f[0].bid
    return step


def _num_blocks(c: _Entry, op: ct.Op) -> Step:
    x, y, z = (c.slot(r) for r in op.results)

    def step(f): f[x], f[y], f[z] = f[0].grid
    return step


def _assume(c: _Entry, op: ct.Op) -> Step:
    pred = op.attrs["predicate"]
    src, out = c.slot(op.operands["value"]), c.out(op)

    def check(f, x):
        if isinstance(pred, ct.DivBy):
            if isinstance(x, Pointers):
                v = x.off * f[0].buffers[x.buf].itemsize   # buffers are allocated aligned
            else:
                v = np.asarray(x, np.int64)
            if pred.every is not None:
                v = np.take(v, np.arange(0, v.shape[pred.along], pred.every), axis=pred.along)
            ok = np.all(v % pred.divisor == 0)
        elif isinstance(pred, ct.Bounded):
            v = np.asarray(x.off if isinstance(x, Pointers) else x)
            ok = (pred.lb is None or np.all(v >= pred.lb)) and (pred.ub is None or np.all(v <= pred.ub))
        else:
            ok = True
        if not ok:
            raise InterpError(f"assume {pred} does not hold for {x!r}")

    def step(f):
        x = f[src]
        check(f, x)
        f[out] = x
    return step


def _tokens(c: _Entry, op: ct.Op) -> Step:
    out = c.out(op)

    def step(f): f[out] = None
    return step


# -- memory -----------------------------------------------------------------------------------------


class _TensorView:
    """A tensor view: `arr`, a strided NumPy view of buffer `buf` starting at element `start`."""

    __slots__ = ("arr", "buf", "start", "strides")

    def __init__(self, arr: np.ndarray, buf: int, start: int, strides: tuple[int, ...]):
        self.arr, self.buf, self.start, self.strides = arr, buf, start, strides

    def elements(self, src: tuple[slice, ...]) -> np.ndarray:
        """The flat buffer indices of `arr[src]`."""
        idx = np.asarray(self.start, np.int64)
        for d, (s, stride) in enumerate(zip(src, self.strides)):
            shape = [1] * len(src)
            shape[d] = s.stop - s.start
            idx = idx + (np.arange(s.start, s.stop, dtype=np.int64) * stride).reshape(shape)
        return idx


def _make_tensor_view(c: _Entry, op: ct.Op) -> Step:
    tv: ct.TensorViewType = op.result.type
    dt = np_dtype(tv.element)
    base = c.slot(op.operands["base"])
    dyn_shape = [c.slot(v) for v in op.operands["dynamicShape"]]
    dyn_strides = [c.slot(v) for v in op.operands["dynamicStrides"]]
    out = c.out(op)

    def step(f):
        ctx = f[0]
        p = f[base]
        if p.off.ndim:
            raise InterpError("make_tensor_view of a pointer tile that is not 0-d")
        ds, dst = iter(dyn_shape), iter(dyn_strides)
        shape = tuple(int(f[next(ds)]) if d is None else d for d in tv.shape)
        strides = tuple(int(f[next(dst)]) if s is None else s for s in tv.strides)
        key = (p.buf, int(p.off), shape, strides)
        view = ctx.views.get(key)
        if view is None:
            flat = ctx.flat[p.buf]
            if flat.dtype != dt:
                raise InterpError(f"make_tensor_view of {tv.element} over a {flat.dtype} buffer")
            start = int(p.off)
            if any(s < 0 for s in strides) or any(d < 0 for d in shape):
                raise InterpError(f"tensor view shape {shape} strides {strides} is not modelled")
            last = start + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else start - 1
            if start < 0 or last >= flat.size:
                raise InterpError(f"tensor view of shape {shape}, strides {strides} at element {start} reaches "
                                  f"element {last} of a buffer of {flat.size}")
            arr = np.lib.stride_tricks.as_strided(flat[start:], shape, tuple(s * dt.itemsize for s in strides))
            view = ctx.views[key] = _TensorView(arr, p.buf, start, strides)
        f[out] = view
    return step


def _make_partition_view(c: _Entry, op: ct.Op) -> Step:
    # the partition view's tile shape, dim map and padding are static (its type): its value is the
    # tensor view, which the loads and stores read with their view operand's type
    return _apply(lambda view: view, c.ins(op), c.out(op))


def _window(pv: ct.PartitionViewType):
    """(tile coordinates, tensor shape) -> (tensor slices, tile slices, whole) of one tile; an index
    outside the view's index space (the tile lies wholly outside the tensor) raises."""
    ts, dm = pv.tile_shape, pv.dim_map
    rank = len(ts)
    if sorted(dm) != list(range(rank)) or pv.tensor_view.rank != rank:
        raise InterpError(f"partition view dim_map {dm} of a rank-{pv.tensor_view.rank} view is not modelled")

    def window(coords, shape):
        src, dst = [None] * rank, [None] * rank
        whole = True
        for i in range(rank):
            d, n = dm[i], ts[i]
            start = coords[i] * n
            lo, hi = start, min(start + n, shape[d])
            if start < 0 or hi <= lo:
                space = tuple(-(-shape[dm[j]] // ts[j]) for j in range(rank))
                raise InterpError(f"partition view index {tuple(coords)} is outside its index space {space} "
                                  f"(tile {ts} of a tensor {tuple(shape)}): undefined behaviour")
            if hi != start + n:
                whole = False
            src[d] = slice(lo, hi)
            dst[i] = slice(0, hi - start)
        return tuple(src), tuple(dst), whole
    return window


def _load_view(c: _Entry, op: ct.Op) -> Step:
    pv: ct.PartitionViewType = op.operands["view"].type
    dt = np_dtype(pv.tensor_view.element)
    ts, dm = pv.tile_shape, pv.dim_map
    identity = list(dm) == sorted(dm)
    window = _window(pv)
    if pv.padding is None:
        padded = _poison(ts, dt)
    else:
        padded = np.full(ts, PADDING[pv.padding] if dt.kind in "fV" else 0, dt)
    padded.flags.writeable = False
    view, idx = c.slot(op.operands["view"]), [c.slot(v) for v in op.operands["index"]]
    out, tok = c.slot(op.results[0]), c.slot(op.results[1])

    def step(f):
        tv = f[view]
        arr = tv.arr
        src, dst, whole = window([int(f[i]) for i in idx], arr.shape)
        if tv.buf in f[0].writer:
            f[0].read(tv.buf, tv.elements(src))
        region = arr[src]
        if not identity:
            region = region.transpose(dm)
        if whole:
            f[out] = region.copy()
        else:
            t = padded.copy()
            t[dst] = region
            f[out] = t
        f[tok] = None
    return step


def _store_view(c: _Entry, op: ct.Op) -> Step:
    pv: ct.PartitionViewType = op.operands["view"].type
    value_t: ct.TileType = op.operands["tile"].type
    if value_t.element != pv.tensor_view.element or value_t.shape != pv.tile_shape:
        raise InterpError(f"store_view_tko of {value_t} into tiles of {pv.tile_shape} x {pv.tensor_view.element}")
    dm = pv.dim_map
    identity = list(dm) == sorted(dm)
    inverse = tuple(int(i) for i in np.argsort(dm))
    window = _window(pv)
    value, view = c.slot(op.operands["tile"]), c.slot(op.operands["view"])
    idx, out = [c.slot(v) for v in op.operands["index"]], c.out(op)

    def step(f):
        tv = f[view]
        src, dst, whole = window([int(f[i]) for i in idx], tv.arr.shape)
        if tv.buf in f[0].writer:
            f[0].write(tv.buf, tv.elements(src))
        v = np.asarray(f[value])
        v = v if whole else v[dst]
        tv.arr[src] = v if identity else v.transpose(inverse)
        f[out] = None
    return step


def _offset(c: _Entry, op: ct.Op) -> Step:
    return _apply(lambda p, o: Pointers(p.buf, p.off + np.asarray(o, np.int64)), c.ins(op), c.out(op))


def _addresses(ctx: _Context, p: Pointers, mask, dt: np.dtype, what: str):
    """The flat buffer of pointer tile p and its offsets (masked-off ones as 0), bounds-checked."""
    flat = ctx.flat[p.buf]
    if flat.dtype != dt:
        raise InterpError(f"{what} of {dt} through pointers into a {flat.dtype} buffer")
    off = p.off if mask is None else np.where(mask, p.off, 0)
    if off.size and (off.min() < 0 or off.max() >= flat.size):
        bad = np.argwhere((off < 0) | (off >= flat.size))[0]
        raise InterpError(f"{what} at element {int(off[tuple(bad)])} of a buffer of {flat.size} "
                          f"(tile index {tuple(int(i) for i in bad)}, block {tuple(int(b) for b in ctx.bid)})")
    return flat, off


def _load_ptr(c: _Entry, op: ct.Op) -> Step:
    dt = _result_dtype(op)
    shape = op.results[0].type.shape
    src = c.slot(op.operands["source"])
    mask = op.operands.get("mask")
    mask = None if mask is None else c.slot(mask)
    pad = op.operands.get("paddingValue")
    pad = None if pad is None else c.slot(pad)
    poison = _poison(shape, dt)
    out, tok = c.slot(op.results[0]), c.slot(op.results[1])

    def step(f):
        m = None if mask is None else f[mask]
        p = f[src]
        flat, off = _addresses(f[0], p, m, dt, "load_ptr_tko")
        if p.buf in f[0].writer:
            f[0].read(p.buf, off if m is None else off[np.broadcast_to(m, off.shape)])
        x = flat[off]
        if m is not None:
            x = np.where(m, x, poison if pad is None else f[pad])
        f[out] = x
        f[tok] = None
    return step


def _store_ptr(c: _Entry, op: ct.Op) -> Step:
    dt = np_dtype(op.operands["value"].type)
    dst, value = c.slot(op.operands["destination"]), c.slot(op.operands["value"])
    mask = op.operands.get("mask")
    mask = None if mask is None else c.slot(mask)
    out = c.out(op)

    def step(f):
        p = f[dst]
        m = None if mask is None else np.broadcast_to(f[mask], p.shape)
        flat, off = _addresses(f[0], p, m, dt, "store_ptr_tko")
        v = np.broadcast_to(f[value], p.shape)
        if m is not None:
            off, v = off[m], v[m]
        if p.buf in f[0].writer:
            f[0].write(p.buf, off)
        flat[off] = v
        f[out] = None
    return step


# -- tensor cores -----------------------------------------------------------------------------------


def _mmaf(c: _Entry, op: ct.Op) -> Step:
    rd = _result_dtype(op)
    cd = F64 if rd == F64 else F32

    def mmaf(a, b, acc):
        return (np.asarray(acc, cd) + np.matmul(np.asarray(a).astype(cd), np.asarray(b).astype(cd))).astype(rd)
    return _apply(mmaf, c.ins(op), c.out(op))


def _mmai(c: _Entry, op: ct.Op) -> Step:
    rd = _result_dtype(op)
    sa = op.attrs["signedness_lhs"] == "signed"
    sb = op.attrs["signedness_rhs"] == "signed"
    da, db = np_dtype(op.operands["lhs"].type), np_dtype(op.operands["rhs"].type)

    def mmai(a, b, acc):
        a = np.asarray(a) if sa else _u(a, da)
        b = np.asarray(b) if sb else _u(b, db)
        return (np.asarray(acc, np.int64) + np.matmul(a.astype(np.int64), b.astype(np.int64))).astype(rd)
    return _apply(mmai, c.ins(op), c.out(op))


# -- reductions and control flow ----------------------------------------------------------------------

#: one-op combiners reduced by one NumPy call: op name -> (reduction, combine, signed-sensitive)
FAST_COMBINERS = {"addf": (np.add.reduce, np.add), "mulf": (np.multiply.reduce, np.multiply),
                  "addi": (np.add.reduce, np.add), "muli": (np.multiply.reduce, np.multiply),
                  "andi": (np.bitwise_and.reduce, np.bitwise_and), "ori": (np.bitwise_or.reduce, np.bitwise_or),
                  "xori": (np.bitwise_xor.reduce, np.bitwise_xor)}


def _fast_combiner(op: ct.Op):
    """(reduce(x, axis), combine(a, b)) when the combiner region is one commutative op of its two
    arguments whose result it yields, else None."""
    block = op.regions[0].block
    if len(block.ops) != 2 or block.ops[1].name != "yield" or len(block.args) != 2:
        return None
    body, term = block.ops
    if len(body.results) != 1 or len(term.operands["operands"]) != 1 or term.operands["operands"][0] is not body.result:
        return None
    lhs, rhs = body.operands.get("lhs"), body.operands.get("rhs")
    if lhs is None or rhs is None or {id(lhs), id(rhs)} != {id(a) for a in block.args}:
        return None
    if body.attrs.get("flush_to_zero") or body.attrs.get("rounding_mode") not in NEAREST:
        return None
    if body.name in ("maxf", "minf"):
        nan = body.attrs.get("propagate_nan")
        fn = (np.maximum if nan else np.fmax) if body.name == "maxf" else (np.minimum if nan else np.fmin)
        return fn.reduce, fn
    if body.name in ("maxi", "mini"):
        if body.attrs.get("signedness", "signed") != "signed":
            return None
        fn = np.maximum if body.name == "maxi" else np.minimum
        return fn.reduce, fn
    return FAST_COMBINERS.get(body.name)


def _reduce(c: _Entry, op: ct.Op) -> Step:
    dim = op.attrs["dim"]
    operands = [c.slot(v) for v in op.operands["operands"]]
    results = [c.slot(r) for r in op.results]
    dts = [np_dtype(v.type) for v in op.operands["operands"]]
    identities = [np.asarray(value, np_dtype(el)) for el, value in op.attrs["identities"]]
    fast = _fast_combiner(op) if len(operands) == 1 else None
    if fast is not None:
        reduce, combine = fast
        dt, x_slot, out = dts[0], operands[0], results[0]
        cd = _compute(dt) if dt.kind in "fV" else dt
        identity = identities[0].astype(cd)

        def step(f):
            x = f[x_slot]
            if cd != dt:
                x = x.astype(cd)
            f[out] = np.asarray(combine(identity, reduce(x, axis=dim))).astype(dt, copy=False)
        return step

    region = c.block(op.regions[0].block)
    if region.kind != "yield":
        raise InterpError(f"reduce combiner ends in {region.kind}")
    args = [c.slot(a) for a in op.regions[0].block.args]
    accs, elems = args[0::2], args[1::2]

    def combine(f, lhs, rhs):
        for s, v in zip(accs, lhs):
            f[s] = v
        for s, v in zip(elems, rhs):
            f[s] = v
        _, vals = region.run(f)
        return [np.broadcast_to(v, np.broadcast(a, b).shape).astype(dt, copy=False)
                for v, a, b, dt in zip(vals, lhs, rhs, dts)]

    def step(f):
        xs = [np.asarray(f[s]) for s in operands]
        n = xs[0].shape[dim]
        width = 1 << max(n - 1, 0).bit_length()
        if width != n:     # pad the reduced dim to a power of two with the identities
            pads = []
            for x, ident in zip(xs, identities):
                shape = list(x.shape)
                shape[dim] = width - n
                pads.append(np.concatenate([x, np.full(shape, ident, x.dtype)], dim))
            xs = pads
        while width > 1:
            width //= 2
            lhs = [np.take(x, np.arange(width), axis=dim) for x in xs]
            rhs = [np.take(x, np.arange(width, 2 * width), axis=dim) for x in xs]
            xs = combine(f, lhs, rhs)
        xs = [np.squeeze(x, dim) for x in xs]
        xs = combine(f, [np.broadcast_to(i, x.shape) for i, x in zip(identities, xs)], xs)
        for s, v in zip(results, xs):
            f[s] = v
    return step


def _for(c: _Entry, op: ct.Op) -> Step:
    lb, ub, st = (c.slot(op.operands[k]) for k in ("lowerBound", "upperBound", "step"))
    inits = [c.slot(v) for v in op.operands["initValues"]]
    results = [c.slot(r) for r in op.results]
    region_block = op.regions[0].block
    iv, *iters = [c.slot(a) for a in region_block.args]
    body = c.block(region_block)
    idt = np_dtype(op.operands["lowerBound"].type)
    unsigned = bool(op.attrs.get("unsignedCmp"))

    def as_int(x):
        v = int(x)
        return v % (1 << (8 * idt.itemsize)) if unsigned else v

    def step(f):
        i, hi, inc = as_int(f[lb]), as_int(f[ub]), int(f[st])
        if inc <= 0:
            raise InterpError(f"for with step {inc}: the step must be positive")
        vals = [f[s] for s in inits]
        while i < hi:
            f[iv] = idt.type(i) if not unsigned else np.array(i, UNSIGNED[idt]).view(idt)[()]
            for s, v in zip(iters, vals):
                f[s] = v
            kind, vals = body.run(f)
            if kind == "break":
                break
            if kind not in ("continue", "yield"):
                return kind, vals
            i += inc
        for s, v in zip(results, vals):
            f[s] = v
    return step


def _loop(c: _Entry, op: ct.Op) -> Step:
    inits = [c.slot(v) for v in op.operands["initValues"]]
    results = [c.slot(r) for r in op.results]
    iters = [c.slot(a) for a in op.regions[0].block.args]
    body = c.block(op.regions[0].block)

    def step(f):
        vals = [f[s] for s in inits]
        while True:
            for s, v in zip(iters, vals):
                f[s] = v
            kind, vals = body.run(f)
            if kind == "break":
                break
            if kind != "continue":
                return kind, vals
        for s, v in zip(results, vals):
            f[s] = v
    return step


def _if(c: _Entry, op: ct.Op) -> Step:
    cond = c.slot(op.operands["condition"])
    then, other = (c.block(r.block) for r in op.regions)
    results = [c.slot(r) for r in op.results]

    def step(f):
        kind, vals = (then if f[cond] else other).run(f)
        if kind != "yield":
            return kind, vals
        for s, v in zip(results, vals):
            f[s] = v
    return step


def _assert(c: _Entry, op: ct.Op) -> Step:
    cond, message = c.slot(op.operands["condition"]), op.attrs["message"]

    def step(f):
        if not np.all(f[cond]):
            raise InterpError(f"cuda_tile assert failed: {message} (block {tuple(int(b) for b in f[0].bid)})")
    return step


def _get_tensor_shape(c: _Entry, op: ct.Op) -> Step:
    src = c.slot(op.operands["src"])
    outs = [c.slot(r) for r in op.results]
    dts = [np_dtype(r.type) for r in op.results]

    def step(f):
        for s, d, dt in zip(outs, f[src].arr.shape, dts):
            f[s] = dt.type(d)
    return step


BUILDERS: dict[str, Callable[[_Entry, ct.Op], Step | None]] = {
    **{name: _float_unary for name in FLOAT_UNARY},
    **{name: _float_binary for name in FLOAT_BINARY},
    "maxf": _maxmin_f, "minf": _maxmin_f, "fma": _fma_step, "cmpf": _cmpf_step,
    **{name: _int_binary for name in INT_BINARY},
    **{name: _int_signed_binary for name in ("divi", "remi", "maxi", "mini", "shri")},
    "cmpi": _cmpi_step, "negi": _int_unary, "absi": _int_unary, "mulhii": _mulhii, "select": _select,
    **{name: _convert for name in ("ftof", "itof", "ftoi", "exti", "trunci")}, "bitcast": _bitcast,
    "constant": _constant, "iota": _iota, "broadcast": _broadcast, "reshape": _reshape, "permute": _permute,
    "cat": _cat, "extract": _extract, "get_tile_block_id": _block_id, "get_num_tile_blocks": _num_blocks,
    "assume": _assume, "make_tensor_view": _make_tensor_view, "make_partition_view": _make_partition_view,
    "get_tensor_shape": _get_tensor_shape, "load_view_tko": _load_view, "store_view_tko": _store_view,
    "offset": _offset, "load_ptr_tko": _load_ptr, "store_ptr_tko": _store_ptr,
    "make_token": _tokens, "join_tokens": _tokens, "mmaf": _mmaf, "mmai": _mmai,
    "reduce": _reduce, "for": _for, "loop": _loop, "if": _if, "assert": _assert,
}
#: ops with no effects: evaluated at compile time when every operand is a constant
PURE = ({*FLOAT_UNARY, *FLOAT_BINARY, *INT_BINARY, "maxf", "minf", "fma", "cmpf", "divi", "remi", "maxi", "mini",
         "shri", "cmpi", "negi", "absi", "mulhii", "select", "ftof", "itof", "ftoi", "exti", "trunci", "bitcast",
         "broadcast", "reshape", "permute", "cat", "extract", "mmaf", "mmai"})


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(entry: ct.Entry) -> _Entry:
    """The entry's compiled form, built once per Entry (build a new Entry after changing one)."""
    prog = _COMPILED.get(entry)
    if prog is None:
        prog = _COMPILED[entry] = _Entry(entry)
    return prog


def run_entry(entry: ct.Entry, grid: Sequence[int], buffers: Sequence) -> None:
    """Runs `entry` once per block of `grid` ((x, y, z), x fastest). Each `tile<ptr<T>>` argument
    takes the next of `buffers`, a C-contiguous NumPy array of T that stores update in place; a
    scalar argument (`tile<i32>`, ...) takes a number."""
    prog = _compiled(entry)
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if len(buffers) != len(prog.arg_types):
        raise InterpError(f"entry @{entry.name} takes {len(prog.arg_types)} arguments, got {len(buffers)}")
    frame = list(prog.template)
    for i, (t, slot, x) in enumerate(zip(prog.arg_types, prog.arg_slots, buffers)):
        if isinstance(t.element, ct.PointerType):
            dt = np_dtype(t.element.pointee)
            if not isinstance(x, np.ndarray) or x.dtype != dt or not x.flags.c_contiguous:
                raise InterpError(f"argument {i} of @{entry.name} must be a C-contiguous {dt} array, got "
                                  f"{type(x).__name__} {getattr(x, 'dtype', '')}")
            frame[slot] = Pointers(i, 0)
        else:
            frame[slot] = np_dtype(t).type(x)
    ctx = _Context(list(buffers), grid, prog.stored)
    frame[0] = ctx
    body = prog.body
    with np.errstate(all="ignore"):
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    ctx.bid = (np.int32(x), np.int32(y), np.int32(z))
                    ctx.block += 1
                    body.run(frame)


def _storage(x: np.ndarray, memref_type) -> np.ndarray:
    """The flat storage a strided parameter's pointer addresses, as a GPU kernel sees it: `x`'s
    elements at their strides (`tile.element_strides`), NaN (or the poison) where none lies."""
    from ...interpreter.tile_interp import poison
    from ...ir import tile as t

    flat = poison((t.reach(memref_type),), x.dtype).reshape(-1)
    itemsize = x.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(flat, x.shape, [st * itemsize for st in t.element_strides(memref_type)])
    view[...] = x
    return flat


def run_kernels(kernels: dict, tile_module, *inputs: np.ndarray) -> list[np.ndarray]:
    """Runs a compiled function's cuda_tile kernels (`Compiled.stage("cuda_tile")`) the way
    `Compiled.run` runs its Tile IR module (`tile_module`, `Compiled.stage("tile")`): the host
    `func.func` is walked in order; outputs (the host arguments after the inputs) and
    `tile.alloc_global` intermediates start poisoned (NaN), `tile.view` reshapes a buffer in place,
    and each `tile.launch` runs its kernel's entry over its grid on those buffers."""
    from xdsl.dialects import func

    from ...interpreter.tile_interp import np_dtype as memref_dtype
    from ...interpreter.tile_interp import poison
    from ...ir import tile as t

    hosts = [op for op in tile_module.ops if isinstance(op, func.FuncOp)]
    if len(hosts) != 1:
        raise InterpError(f"the tile module has {len(hosts)} host functions, not one")
    host = hosts[0]
    params = list(host.body.block.args)
    if len(inputs) > len(params):
        raise InterpError(f"{host.sym_name.data} takes {len(params)} buffers, got {len(inputs)} inputs")
    env: dict = {}
    for p, x in zip(params, inputs):
        want = (tuple(p.type.get_shape()), memref_dtype(p.type))
        if (x.shape, x.dtype) != want:
            raise InterpError(f"{host.sym_name.data}: input of shape {x.shape} and dtype {x.dtype}, expected {want}")
        env[p] = _storage(x, p.type) if t.is_strided(p.type) else np.ascontiguousarray(x)
    outputs = [poison(p.type.get_shape(), memref_dtype(p.type)) for p in params[len(inputs):]]
    env.update(zip(params[len(inputs):], outputs))
    for op in host.body.block.ops:
        if isinstance(op, t.AllocGlobalOp):
            env[op.result] = poison(op.result.type.get_shape(), memref_dtype(op.result.type))
        elif isinstance(op, t.ViewOp):
            view = env[op.source].reshape(tuple(op.result.type.get_shape()))
            if not np.shares_memory(view, env[op.source]):
                raise InterpError("tile.view of a buffer that is not contiguous")
            env[op.result] = view
        elif isinstance(op, t.LaunchOp):
            name = op.kernel.string_value()
            if name not in kernels:
                raise InterpError(f"tile.launch of @{name}, which is not among the cuda_tile kernels")
            module = kernels[name].module
            if len(module.entries) != 1:
                raise InterpError(f"kernel {name}'s cuda_tile module has {len(module.entries)} entries, not one")
            run_entry(module.entries[0], t.int_values(op.grid), [env[a] for a in op.args])
        elif isinstance(op, func.ReturnOp):
            break
        else:
            raise InterpError(f"host op {op.name} is not modelled")
    return outputs
