"""Random Tessera programs as data, for the differential fuzzer (tests/fuzz/test_fuzz_cpu.py on the CPU
interpreter, tests/gpu/test_fuzz_gpu.py on the GPU).

A `Program` is a small SSA list of `Node`s over input tensors, with the dims' sizes and one float
dtype. It is both

- rendered to DSL source (`source`), a `@tsr.function` that `function` builds with exec (the source is
  what a failure prints, shrunk by hypothesis, runnable with `tessera run FILE --shape ... --dtype ...`);
- evaluated by `evaluate` in NumPy float64, from the op table's own NumPy formulas (never through
  Tessera's graph, its Graph IR oracle, or its op library).

Ops are data: `ELEMENTWISE` (unary / binary / where, each a DSL template and a NumPy formula),
`REDUCTIONS`, `NORMS` and `SCORE_MODS` (attention score modifications: causal, ALiBi, soft-capping,
where-masks, biases). Adding an op is adding a row (e.g. `clamp`: `Op("clamp", 1, "tsr.clamp({0}, -1.0,
{c})", lambda a, c: np.clip(a, -1.0, c), consts=(0.5, 2.0))`), and the generator draws it.

`programs(device)` is the hypothesis strategy. Families: elementwise chains over broadcast shapes,
reductions (sum/mean/max/min over any dims, keepdim or not, of a value or its transpose) with prologue
and epilogue, norms (softmax over any axis, layer_norm, rms_norm; of a value or its transpose) with
prologue and epilogue, matmul (NN, NT, TN, batched) with epilogues, attention with random score
modifications; sometimes an intermediate is a second result. Shapes are drawn from sizes that hit tile
tails: 1, primes, non-multiples of 16/64, and 0 when `ZERO_SIZE_DIMS` is on.

`check` compares a kernel's outputs with the float64 evaluation. Tolerances: `tessera.interpreter.
reference.tolerance(dtype, reduction length)` (the dtype's roundoff, fp32 accumulation over the
reduction), plus a sensitivity term: a kernel may round an intermediate to its dtype wherever a kernel
boundary stores it, so it may also be off by SENSITIVITY times what rounding every intermediate to the
dtype costs (`evaluate(..., rounded=True)`, where a reduction over several dims is one per dim, each
rounded, as in Tessera's Graph IR; small for well-conditioned programs, which the generator aims for by
bounding every value's magnitude).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

#: every dim's sizes include 0 (a call with a zero-size dim launches nothing and returns empty results)
ZERO_SIZE_DIMS = True

#: dim sizes: tile tails (1, primes, one past and one short of powers of two). First = what shrinking aims for.
SIZES = {
    "cpu": (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 64, 67),
    "gpu": (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 64, 67, 97, 128, 129, 255, 300),
}
#: the few larger sizes a last dim takes (long rows: several column tiles)
LONG = {"cpu": (100, 257), "gpu": (1000, 1031, 4097)}
#: batch-like dims (B, H, A) stay small: they only repeat the same program
BATCH = (1, 2, 3)
#: head dims of attention (the kernel's D, E)
HEAD = {"cpu": (1, 8, 16, 17, 32, 64), "gpu": (1, 8, 16, 17, 32, 64, 80, 128)}

DTYPES = ("fp16", "bf16", "fp32")
#: dtypes of matmuls and attention per device: a GPU matmul of fp32 operands has no matrix instruction
#: (the PTX backend refuses it: a documented limitation, README "matmuls of fp32 operands have no GPU path")
MATMUL_DTYPES = {"cpu": ("fp16", "bf16", "fp32"), "gpu": ("fp16", "bf16")}
NP_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}

#: how many times the all-intermediates-rounded evaluation's error a kernel may be off by, on top of
#: the dtype's tolerance
SENSITIVITY = 4.0
#: errors of RMS this fraction of the relative tolerance times max(1, max |result|) always pass (a result
#: that cancels to almost nothing has no relative accuracy: fp32's approximate sin and ex2 err by ~5e-7)
ABSOLUTE_FLOOR = 0.25
#: values the generator keeps |x| below (a heuristic bound, so exp and products do not overflow fp16)
MAX_BOUND = 64.0

#: Documented limitations the generator stays inside (each raises a "not supported yet" TesseraError):
#: "norm_rank": layer_norm and rms_norm need rank >= 2 ("graph.layer_norm over a rank-1 tensor is not
#: supported yet"); "rank0_results": no rank-0 output ("scalar (rank-0) results are not supported yet"),
#: so a reduction over every dim keeps them. Set "norm_rank" to 1 and "rank0_results" to True to draw them.
KNOWN_LIMITS = {"norm_rank": 2, "rank0_results": False}

#: constants: dyadic, so exact in every dtype and in fp32 arithmetic
CONSTS = (2.0, 0.5, -1.5, 0.25, 3.0, -0.75)


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


_erf = np.frompyfunc(math.erf, 1, 1)


def _erf64(a):
    return _erf(a).astype(np.float64) if a.size else np.zeros_like(a)


# --- the op table -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """An elementwise op: a DSL template over operand names ({0}, {1}, {2}) and a constant {c}, its
    float64 NumPy formula (operands, then c when `consts`), and a bound on |result| from the operands'.
    `max_in`: the op is drawn only for operands bounded by this. A "where" op's operand 0 is a raw input
    (its comparison with 0.0 must be exact in every dtype)."""

    name: str
    arity: int
    dsl: str
    ref: Callable
    bound: Callable = lambda *b: max(b)
    consts: tuple = ()
    max_in: float = math.inf

    def render(self, args: Sequence[str], c=None) -> str:
        return self.dsl.format(*args, c=c)

    def apply(self, args, c=None):
        return self.ref(*args, c) if self.consts else self.ref(*args)


ELEMENTWISE: dict[str, Op] = {op.name: op for op in [
    Op("add", 2, "{0} + {1}", np.add, lambda a, b: a + b),
    Op("sub", 2, "{0} - {1}", np.subtract, lambda a, b: a + b),
    Op("mul", 2, "{0} * {1}", np.multiply, lambda a, b: a * b),
    Op("div", 2, "{0} / ({1} * {1} + 1.0)", lambda a, b: a / (b * b + 1.0), lambda a, b: a),
    Op("maximum", 2, "tsr.maximum({0}, {1})", np.maximum),
    Op("minimum", 2, "tsr.minimum({0}, {1})", np.minimum),
    Op("where", 3, "tsr.where({0} > 0.0, {1}, {2})", lambda m, a, b: np.where(m > 0.0, a, b),
       lambda m, a, b: max(a, b)),
    Op("scale", 1, "{0} * {c}", lambda a, c: a * c, lambda a: 3.0 * a, consts=CONSTS),
    Op("shift", 1, "{0} + {c}", lambda a, c: a + c, lambda a: a + 3.0, consts=CONSTS),
    Op("rsub", 1, "{c} - {0}", lambda a, c: c - a, lambda a: a + 3.0, consts=CONSTS),
    Op("neg", 1, "-{0}", np.negative),
    Op("abs", 1, "tsr.abs({0})", np.abs),
    Op("exp", 1, "tsr.exp({0})", np.exp, lambda a: math.exp(a), max_in=4.0),
    Op("exp2", 1, "tsr.exp2({0})", np.exp2, lambda a: 2.0 ** a, max_in=5.0),
    Op("log", 1, "tsr.log({0} * {0} + 0.5)", lambda a: np.log(a * a + 0.5), lambda a: 2 * math.log(a + 1) + 1),
    Op("log2", 1, "tsr.log2(tsr.abs({0}) + 0.25)", lambda a: np.log2(np.abs(a) + 0.25),
       lambda a: math.log2(a + 1) + 2),
    Op("tanh", 1, "tsr.tanh({0})", np.tanh, lambda a: 1.0),
    Op("sqrt", 1, "tsr.sqrt(tsr.abs({0}) + 0.25)", lambda a: np.sqrt(np.abs(a) + 0.25), lambda a: math.sqrt(a) + 1),
    Op("rsqrt", 1, "tsr.rsqrt({0} * {0} + 0.25)", lambda a: 1.0 / np.sqrt(a * a + 0.25), lambda a: 2.0),
    Op("sin", 1, "tsr.sin({0})", np.sin, lambda a: 1.0),
    Op("cos", 1, "tsr.cos({0})", np.cos, lambda a: 1.0),
    Op("erf", 1, "tsr.erf({0})", _erf64, lambda a: 1.0),
    Op("pow", 1, "tsr.pow(tsr.abs({0}) + 0.5, {c})", lambda a, c: np.power(np.abs(a) + 0.5, c),
       lambda a: (a + 0.5) ** 2 + 2.0, consts=(2.0, 0.5, 1.5, -1.0), max_in=7.0),
    Op("sigmoid", 1, "tsr.sigmoid({0})", _sigmoid, lambda a: 1.0),
    Op("relu", 1, "tsr.relu({0})", lambda a: np.maximum(a, 0.0)),
    Op("silu", 1, "tsr.silu({0})", lambda a: a * _sigmoid(a)),
    Op("gelu", 1, "tsr.gelu({0})", lambda a: 0.5 * a * (1.0 + _erf64(a / math.sqrt(2.0)))),
    Op("gelu_tanh", 1, 'tsr.gelu({0}, approximate="tanh")',
       lambda a: 0.5 * a * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a ** 3)))),
    Op("clamp", 1, "tsr.clamp({0}, -{c}, {c})", lambda a, c: np.clip(a, -c, c), lambda a: 2.0,
       consts=(0.5, 2.0)),
    # a mask op like where: drawn with it (operand 0 a raw input), not among the binary ops
    Op("masked_fill", 2, "{1}.masked_fill({0} > 0.0, {c})", lambda m, a, c: np.where(m > 0.0, c, a),
       lambda m, a: max(a, 3.0), consts=CONSTS),
]}
UNARY = tuple(n for n, op in ELEMENTWISE.items() if op.arity == 1)
BINARY = tuple(n for n, op in ELEMENTWISE.items() if op.arity == 2 and n != "masked_fill")


@dataclass(frozen=True)
class Reduction:
    name: str
    function: str              # the DSL function: tsr.sum(x, dim=..., keepdim=...)
    ref: Callable
    empty_ok: bool = True      # defined over zero elements


REDUCTIONS: dict[str, Reduction] = {r.name: r for r in [
    Reduction("sum", "tsr.sum", np.sum),
    Reduction("mean", "tsr.mean", np.mean),
    Reduction("max", "tsr.amax", np.max, empty_ok=False),
    Reduction("min", "tsr.amin", np.min, empty_ok=False),
    Reduction("logsumexp", "tsr.logsumexp", lambda x, axis, keepdims: _logsumexp(x, axis, keepdims),
              empty_ok=False),
]}


def _logsumexp(x, axis, keepdims):
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def _softmax(x, axis):
    m = np.max(x, axis=axis, keepdims=True) if x.shape[axis] else 0.0
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _layer_norm(x, w=None, b=None, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    y = y * w if w is not None else y
    return y + b if b is not None else y


def _rms_norm(x, w=None, eps=1e-6):
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


@dataclass(frozen=True)
class Norm:
    """A normalization over one axis: its DSL (operands {0}, weights {1}, {2}; {axis}), its NumPy
    formula, and how many [N] weight inputs it takes (a weight count drawn from `weights`)."""

    name: str
    dsl: Callable[[Sequence[str], int], str]
    ref: Callable
    weights: tuple[int, ...] = (0,)
    any_axis: bool = False
    min_rank: int = 1


NORMS: dict[str, Norm] = {n.name: n for n in [
    Norm("softmax", lambda a, axis: f"tsr.softmax({a[0]}, dim={axis})",
         lambda x, *w, axis: _softmax(x, axis), any_axis=True),
    Norm("log_softmax", lambda a, axis: f"tsr.log_softmax({a[0]}, dim={axis})",
         lambda x, *w, axis: np.log(_softmax(x, axis)), any_axis=True),
    Norm("layer_norm", lambda a, axis: "tsr.layer_norm({0}, ({0}.shape[-1],){1})".format(
        a[0], "".join(", " + w for w in a[1:])), lambda x, *w, axis: _layer_norm(x, *w), weights=(0, 1, 2),
         min_rank=KNOWN_LIMITS["norm_rank"]),
    Norm("rms_norm", lambda a, axis: "tsr.rms_norm({0}, ({0}.shape[-1],){1}, eps=1e-6)".format(
        a[0], "".join(", " + w for w in a[1:])), lambda x, *w, axis: _rms_norm(x, *w), weights=(0, 1),
         min_rank=KNOWN_LIMITS["norm_rank"]),
]}


def _rows(s):
    return np.arange(s.shape[-2])[:, None]


def _cols(s):
    return np.arange(s.shape[-1])[None, :]


@dataclass(frozen=True)
class ScoreMod:
    """A modification of attention scores s [B, H, Sq, Sk] between softmax and Q @ K^T; `extra` names
    the input it reads (slopes [H], a mask or bias [Sq, Sk]), if any."""

    name: str
    dsl: str                   # over {0} = s, {1} = the extra input, {c}
    ref: Callable              # (s, extra, c) -> s'
    extra: tuple | None = None
    consts: tuple = (None,)


SCORE_MODS: dict[str, ScoreMod] = {m.name: m for m in [
    ScoreMod("causal", "tsr.where(tsr.arange({0}.shape[-2])[:, None] >= tsr.arange({0}.shape[-1])[None, :], "
             "{0}, -math.inf)", lambda s, e, c: np.where(_rows(s) >= _cols(s), s, -np.inf)),
    # ALiBi: a per-head slope (an input, scaled down as ALiBi's 2^(-8h/H) are) times (key - query)
    ScoreMod("alibi", "{0} + ({1} * 0.0625)[:, None, None] * (tsr.arange({0}.shape[-1])[None, :] - "
             "tsr.arange({0}.shape[-2])[:, None])",
             lambda s, e, c: s + (e * 0.0625)[:, None, None] * (_cols(s) - _rows(s)), extra=("H",)),
    ScoreMod("softcap", "{c} * tsr.tanh({0} * (1.0 / {c}))", lambda s, e, c: c * np.tanh(s * (1.0 / c)),
             consts=(4.0, 20.0, 50.0)),
    # -inf where the mask input is <= 0, keeping key 0 so that no row is all -inf
    ScoreMod("mask", "tsr.where(({1} > 0.0) | (tsr.arange({0}.shape[-1])[None, :] == 0), {0}, -math.inf)",
             lambda s, e, c: np.where((e > 0.0) | (_cols(s) == 0), s, -np.inf), extra=("S", "T")),
    ScoreMod("mask_fill", "tsr.where({1} > 0.0, {0}, {c})", lambda s, e, c: np.where(e > 0.0, s, c),
             extra=("S", "T"), consts=(-1000.0, 0.0)),
    ScoreMod("bias", "{0} + {1}", lambda s, e, c: s + e, extra=("S", "T")),
    ScoreMod("causal_fill", "{0}.masked_fill(tsr.arange({0}.shape[-2])[:, None] < tsr.arange({0}.shape[-1])"
             "[None, :], -math.inf)", lambda s, e, c: np.where(_rows(s) < _cols(s), -np.inf, s)),
    ScoreMod("clamp", "tsr.clamp({0}, -{c}, {c})", lambda s, e, c: np.clip(s, -c, c), consts=(2.0, 8.0)),
    ScoreMod("scale", "{0} * {c}", lambda s, e, c: s * c, consts=(0.5, 2.0)),
]}


# --- programs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """One SSA value: `kind` (elementwise, reduce, norm, matmul, matmul_nt, score, attention_scale), the
    op's name in its table, operand value ids (inputs first, then nodes), and the op's parameters."""

    kind: str
    op: str
    args: tuple[int, ...]
    params: tuple = ()


@dataclass(frozen=True)
class Program:
    dtype: str
    sizes: tuple[tuple[str, int], ...]          # dim name -> size
    inputs: tuple[tuple[str | int, ...], ...]   # each input's dims (names, or 1)
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]                    # value ids
    family: str = ""

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.sizes)

    def shapes(self) -> list[tuple[int, ...]]:
        d = self.dims
        return [tuple(d[x] if isinstance(x, str) else x for x in dims) for dims in self.inputs]

    def shape_arg(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.sizes)


def _name(program: Program, v: int) -> str:
    n = len(program.inputs)
    return f"x{v}" if v < n else f"t{v - n}"


def _expr(program: Program, node: Node) -> str:
    a = [_name(program, v) for v in node.args]
    if node.kind == "elementwise":
        return ELEMENTWISE[node.op].render(a, *node.params)
    if node.kind == "reduce":
        dim, keepdim = node.params
        return f"{REDUCTIONS[node.op].function}({a[0]}, dim={dim!r}, keepdim={keepdim})"
    if node.kind == "norm":
        return NORMS[node.op].dsl(a, *node.params)
    if node.kind == "transpose":
        return f"{a[0]}.transpose(-2, -1)"
    if node.kind == "matmul":
        return f"tsr.matmul({a[0]}, {a[1]})"
    if node.kind == "matmul_nt":
        return f"tsr.matmul({a[0]}, {a[1]}.transpose(-2, -1))"
    if node.kind == "attention_scale":
        return f"tsr.matmul({a[0]}, {a[1]}.transpose(-2, -1)) * (1.0 / math.sqrt({a[0]}.shape[-1]))"
    if node.kind == "score":
        return SCORE_MODS[node.op].dsl.format(*a, c=node.params[0] if node.params else None)
    raise ValueError(node.kind)


def source(program: Program) -> str:
    """The program as a @tsr.function named `fuzz`."""
    args = ", ".join(f"{_name(program, i)}: Tensor[{', '.join(repr(d) for d in dims)}, {program.dtype!r}]"
                     for i, dims in enumerate(program.inputs))
    lines = ["@tsr.function", f"def fuzz({args}):"]
    n = len(program.inputs)
    for i, node in enumerate(program.nodes):
        lines.append(f"    {_name(program, n + i)} = {_expr(program, node)}")
    lines.append(f"    return {', '.join(_name(program, v) for v in program.outputs)}")
    return "\n".join(lines) + "\n"


HEADER = "import math\n\nimport tessera as tsr\nfrom tessera import Tensor\n\n\n"


def describe(program: Program) -> str:
    """What a failure prints: the DSL file, and how to run it."""
    return (f"{HEADER}{source(program)}\n# tessera run FILE.py --shape {program.shape_arg()} "
            f"--dtype {program.dtype}   ({program.family})\n")


@functools.lru_cache(maxsize=4096)
def _function_of(text: str):
    import tessera as tsr
    from tessera import Tensor

    namespace = {"tsr": tsr, "Tensor": Tensor, "math": math}
    exec(compile(text, "<fuzz program>", "exec"), namespace)
    return namespace["fuzz"]


def function(program: Program):
    """The @tsr.function the program's source defines (one per distinct source)."""
    return _function_of(source(program))


# --- the float64 evaluation ------------------------------------------------------------------------

def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(NP_DTYPES[dtype]).astype(np.float64)


def _node_value(node: Node, args: list[np.ndarray]) -> np.ndarray:
    if node.kind == "elementwise":
        return ELEMENTWISE[node.op].apply(args, *node.params)
    if node.kind == "reduce":
        dim, keepdim = node.params
        axis = tuple(dim) if isinstance(dim, tuple) else dim
        return np.asarray(REDUCTIONS[node.op].ref(args[0], axis=axis, keepdims=keepdim), dtype=np.float64)
    if node.kind == "norm":
        return NORMS[node.op].ref(*args, axis=node.params[0])
    if node.kind == "transpose":
        return np.swapaxes(args[0], -1, -2)
    if node.kind == "matmul":
        return np.matmul(args[0], args[1])
    if node.kind == "matmul_nt":
        return np.matmul(args[0], np.swapaxes(args[1], -1, -2))
    if node.kind == "attention_scale":
        return np.matmul(args[0], np.swapaxes(args[1], -1, -2)) * (1.0 / math.sqrt(args[0].shape[-1]))
    if node.kind == "score":
        mod = SCORE_MODS[node.op]
        return mod.ref(args[0], args[1] if len(args) > 1 else None, node.params[0] if node.params else None)
    raise ValueError(node.kind)


def _staged_reduction(node: Node, x: np.ndarray, dtype: str) -> np.ndarray:
    """A reduction over several dims as Tessera's Graph IR has it: one reduction per dim, the last dim
    first, each result of the dtype (rounded) and keeping its dim; the requested shape at the end."""
    dim, keepdim = node.params
    axes = range(x.ndim) if dim is None else (dim if isinstance(dim, tuple) else (dim,))
    axes = sorted({a % max(1, x.ndim) for a in axes}, reverse=True)
    y = x
    for a in axes:
        y = _round(np.asarray(REDUCTIONS[node.op].ref(y, axis=a, keepdims=True), dtype=np.float64), dtype)
    return y if keepdim else y.reshape([n for i, n in enumerate(y.shape) if i not in axes])


def _layer_norm_with_mean_error(x, w=None, b=None, eps=1e-5):
    """layer_norm as a kernel computes it, for the sensitivity estimate: its row mean, accumulated in
    fp32, is off by up to ~log2(n) units of fp32 roundoff of the row's largest |x|, and x - mean
    amplifies that by 1 / sqrt(var + eps) (a constant row: 316x, at eps = 1e-5)."""
    n = x.shape[-1]
    if n == 0:
        return _layer_norm(x, w, b, eps)
    slip = np.abs(x).max(axis=-1, keepdims=True) * 2.0 ** -24 * (math.log2(n) + 1)
    amplified = slip / np.sqrt(np.var(x, axis=-1, keepdims=True) + eps) * (np.abs(w) if w is not None else 1.0)
    return _layer_norm(x, w, b, eps) + amplified


def evaluate(program: Program, inputs: Sequence[np.ndarray], rounded: bool = False,
             every_value: bool = False) -> list[np.ndarray]:
    """Each output in float64 from the (dtype-valued) inputs; `rounded`: every node's result rounded to
    the program's dtype first (eager per-op semantics: a sensitivity estimate). `every_value`: the
    inputs' and every node's values instead of the outputs'."""
    values = [np.asarray(x).astype(np.float64) for x in inputs]
    with np.errstate(all="ignore"):
        for node in program.nodes:
            args = [values[a] for a in node.args]
            if rounded and node.kind == "reduce":
                v = _staged_reduction(node, args[0], program.dtype)
            elif rounded and node.kind == "norm" and node.op == "layer_norm":
                v = _layer_norm_with_mean_error(*args)
            else:
                v = np.asarray(_node_value(node, args), dtype=np.float64)
            values.append(_round(v, program.dtype) if rounded else v)
    return values if every_value else [values[v] for v in program.outputs]


def random_inputs(program: Program, seed: int) -> list[np.ndarray]:
    """Standard normal inputs in the program's dtype."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(NP_DTYPES[program.dtype]) for shape in program.shapes()]


def _reduction_terms(node: Node, shapes: list[tuple]) -> int:
    if node.kind in ("matmul", "attention_scale", "matmul_nt"):
        return shapes[node.args[0]][-1]
    if node.kind == "reduce":
        shape, dim = shapes[node.args[0]], node.params[0]
        axes = range(len(shape)) if dim is None else (dim if isinstance(dim, tuple) else (dim,))
        return math.prod(shape[a] for a in axes)
    if node.kind == "norm":
        return shapes[node.args[0]][node.params[0]]
    return 0


def reduction_length(program: Program, output: int, shapes: list[tuple]) -> int:
    """The terms accumulated on the way to value `output` (the sum over the reductions it depends on);
    `shapes`: every value's shape."""
    n = len(program.inputs)
    total, stack, seen = 0, [output], set()
    while stack:
        v = stack.pop()
        if v in seen or v < n:
            continue
        seen.add(v)
        node = program.nodes[v - n]
        total += _reduction_terms(node, shapes)
        stack.extend(node.args)
    return total


class Mismatch(AssertionError):
    """A wrong result; the message ends with the program's DSL source."""

    def __init__(self, program: Program, detail: str):
        super().__init__(f"{detail}\n\nminimal program:\n{describe(program)}")
        self.program = program


def check(program: Program, inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray], what: str = "") -> None:
    """Raises `Mismatch` unless each output matches the float64 evaluation (see the module docstring)."""
    from tessera.interpreter.reference import tolerance

    values = evaluate(program, inputs, every_value=True)
    shapes = [v.shape for v in values]
    exact = [values[v] for v in program.outputs]
    rough = evaluate(program, inputs, rounded=True)
    assert len(outputs) == len(exact), f"{len(outputs)} outputs, expected {len(exact)}"
    for i, (out, ex, ro) in enumerate(zip(outputs, exact, rough)):
        label = f"{what}output {i} ({program.dtype}, {program.shape_arg()})"
        out = np.asarray(out)
        if out.shape != ex.shape:
            raise Mismatch(program, f"{label}: shape {out.shape}, expected {ex.shape}")
        o = out.astype(np.float64)
        r = _round(ex, program.dtype)   # the exact answer, rounded once (overflow included)
        nan_o, nan_r = np.isnan(o), np.isnan(r)
        if (nan_o & ~nan_r).any():
            raise Mismatch(program, f"{label}: {int((nan_o & ~nan_r).sum())} of {o.size} elements are NaN "
                                    f"(never written?), first at {tuple(np.argwhere(nan_o & ~nan_r)[0])}")
        if (nan_r & ~nan_o).any():
            raise Mismatch(program, f"{label}: NaN expected at {tuple(np.argwhere(nan_r & ~nan_o)[0])}")
        inf = np.isinf(r) | np.isinf(o)
        if not np.array_equal(o[inf], r[inf]):
            raise Mismatch(program, f"{label}: infinities differ, first at {tuple(np.argwhere(inf & (o != r))[0])}")
        finite = np.isfinite(r) & np.isfinite(o)
        o, e, rr = o[finite], ex[finite], ro[finite]
        if o.size == 0:
            continue
        tol = tolerance(program.dtype, reduction_length(program, program.outputs[i], shapes))
        norm = float(np.linalg.norm(e))
        denom = norm if norm > 0 else 1.0
        diff = np.abs(o - e)
        scale = max(1.0, float(np.abs(e).max()))
        rel = float(np.linalg.norm(o - e)) / denom
        # where the result cancels to almost nothing, errors are measured against its scale instead
        floor = ABSOLUTE_FLOOR * tol.relative * scale * math.sqrt(o.size) / denom
        rel_bound = tol.relative + SENSITIVITY * float(np.linalg.norm(rr - e)) / denom + floor
        abs_bound = tol.max_abs * scale + SENSITIVITY * float(np.abs(rr - e).max())
        if rel > rel_bound or diff.max() > abs_bound:
            worst = int(diff.argmax())
            index = tuple(int(j) for j in np.argwhere(finite)[worst])
            raise Mismatch(program, f"{label}: relative error {rel:.3e} (bound {rel_bound:.3e}), max abs error "
                                    f"{diff.max():.3e} (bound {abs_bound:.3e}) at {index}: got {float(o[worst])!r}, "
                                    f"expected {float(e[worst])!r}")


# --- the generator ------------------------------------------------------------------------------

class _Builder:
    """A program under construction: inputs, nodes, and each value's dims and magnitude bound."""

    def __init__(self, draw, device: str, dtype: str, sizes: dict[str, int]):
        self.draw, self.device, self.dtype, self.sizes = draw, device, dtype, sizes
        self.inputs: list[tuple] = []
        self.nodes: list[Node] = []
        self.dims: list[tuple] = []     # per value id
        self.bounds: list[float] = []

    def input(self, dims: tuple) -> int:
        assert not self.nodes, "inputs come first"
        self.inputs.append(tuple(dims))
        self.dims.append(tuple(dims))
        self.bounds.append(4.0)
        return len(self.dims) - 1

    def node(self, kind: str, op: str, args: tuple, params: tuple, dims: tuple, bound: float) -> int:
        self.nodes.append(Node(kind, op, tuple(args), tuple(params)))
        self.dims.append(tuple(dims))
        self.bounds.append(min(bound, 1e6))
        return len(self.dims) - 1

    def program(self, outputs: Sequence[int], family: str) -> Program:
        """The program of the values `outputs` read: unused inputs and dead nodes dropped."""
        n = len(self.inputs)
        live, stack = set(), list(outputs)
        while stack:
            v = stack.pop()
            if v not in live:
                live.add(v)
                stack.extend(self.nodes[v - n].args if v >= n else ())
        keep = sorted(live)
        renumber = {v: i for i, v in enumerate(keep)}
        inputs = tuple(self.inputs[v] for v in keep if v < n)
        nodes = tuple(Node(node.kind, node.op, tuple(renumber[a] for a in node.args), node.params)
                      for node in (self.nodes[v - n] for v in keep if v >= n))
        used = {d for dims in inputs for d in dims if isinstance(d, str)}
        sizes = tuple((k, v) for k, v in self.sizes.items() if k in used)
        return Program(self.dtype, sizes, inputs, nodes, tuple(renumber[v] for v in outputs), family)


def _transpose(b: _Builder, v: int) -> int:
    """`v` with its last two dims swapped (a view: an index map of the loads that read it)."""
    dims = b.dims[v]
    return b.node("transpose", "transpose", (v,), (), (*dims[:-2], dims[-1], dims[-2]), b.bounds[v])


def _outputs(b: _Builder, main: int) -> list[int]:
    """`main`, and sometimes an intermediate too (a function of several results)."""
    others = [v for v in range(len(b.inputs), len(b.dims)) if v != main]
    if others and b.draw(st.integers(0, 4)) == 0:
        return [main, b.draw(st.sampled_from(others))]
    return [main]


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    """Right-aligned broadcast by dim name (a name meets itself or 1); None when they do not."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(reversed(out))


def _elementwise_step(b: _Builder, pool: list[int], x: int | None = None) -> int:
    """One elementwise node over values of `pool` (often the newest, so chains form), reading `x`."""
    draw = b.draw
    if x is None:
        x = pool[-1] if draw(st.booleans()) else draw(st.sampled_from(pool))
    arity = draw(st.sampled_from((1, 2, 2, 3)))
    inputs = [v for v in pool if v < len(b.inputs)]
    if arity == 3 and inputs and draw(st.integers(0, 2)) == 2:
        m = draw(st.sampled_from(inputs))
        dims = _broadcast(b.dims[m], b.dims[x])
        if dims == b.dims[x]:   # torch's masked_fill keeps x's shape: the mask broadcasts to it
            c = draw(st.sampled_from(CONSTS))
            return b.node("elementwise", "masked_fill", (m, x), (c,), dims, max(b.bounds[x], 3.0))
    if arity == 3 and inputs:
        m = draw(st.sampled_from(inputs))
        y = draw(st.sampled_from(pool))
        dims = _broadcast(b.dims[m], b.dims[x])
        dims = dims and _broadcast(dims, b.dims[y])
        if dims is not None:
            return b.node("elementwise", "where", (m, x, y), (), dims, max(b.bounds[x], b.bounds[y]))
    if arity >= 2:
        y = draw(st.sampled_from(pool))
        dims = _broadcast(b.dims[x], b.dims[y])
        if dims is not None:
            if draw(st.booleans()):
                x, y = y, x
            names = [n for n in BINARY if ELEMENTWISE[n].bound(b.bounds[x], b.bounds[y]) <= MAX_BOUND]
            if names:
                op = ELEMENTWISE[draw(st.sampled_from(names))]
                return b.node("elementwise", op.name, (x, y), (), dims, op.bound(b.bounds[x], b.bounds[y]))
    names = [n for n in UNARY if ELEMENTWISE[n].max_in >= b.bounds[x]
             and ELEMENTWISE[n].bound(b.bounds[x]) <= MAX_BOUND]
    op = ELEMENTWISE[draw(st.sampled_from(names))]
    c = (draw(st.sampled_from(op.consts)),) if op.consts else ()
    return b.node("elementwise", op.name, (x,), c, b.dims[x], op.bound(b.bounds[x]))


def _chain(b: _Builder, start: int, extra_inputs: list[int], max_len: int) -> int:
    """0..max_len elementwise nodes from `start`, which may read `extra_inputs`; returns the last value."""
    v = start
    for _ in range(b.draw(st.integers(0, max_len))):
        v = _elementwise_step(b, [*extra_inputs, v], v)
    return v


def _sub_dims(draw, full: tuple) -> tuple:
    """A shape that broadcasts to `full`: a suffix of it, some dims 1."""
    rank = draw(st.integers(1, len(full)))
    return tuple(1 if draw(st.integers(0, 3)) == 0 else d for d in full[-rank:])


def _zero(draw) -> bool:
    """Whether a dim is 0: one dim in 16, and shrinking moves away from it (an empty result checks
    nothing, so a failure's minimal program should not be empty)."""
    return ZERO_SIZE_DIMS and draw(st.integers(0, 15)) == 15


def _size(draw, device: str, long_ok: bool = True) -> int:
    if _zero(draw):
        return 0
    return draw(st.sampled_from(SIZES[device] + (LONG[device] if long_ok else ())))


def _batch(draw) -> int:
    return 0 if _zero(draw) else draw(st.sampled_from(BATCH))


def _extra_inputs(b: _Builder, full: tuple, most: int) -> list[int]:
    return [b.input(_sub_dims(b.draw, full)) for _ in range(b.draw(st.integers(0, most)))]


def _elementwise_program(draw, device, dtype) -> Program:
    rank = draw(st.integers(1, 3))
    full = ("A", "M", "N")[-rank:]
    sizes = {"A": _batch(draw), "M": _size(draw, device, False), "N": _size(draw, device)}
    b = _Builder(draw, device, dtype, sizes)
    x = b.input(full)
    others = _extra_inputs(b, full, 2)
    v = x
    for _ in range(draw(st.integers(1, 6))):
        v = _elementwise_step(b, [x, *others, *range(len(b.inputs), len(b.dims))])
    return b.program(_outputs(b, v), "elementwise")


def _reduce_program(draw, device, dtype) -> Program:
    rank = draw(st.integers(1, 3))
    full = ("A", "M", "N")[-rank:]
    sizes = {"A": _batch(draw), "M": _size(draw, device, False), "N": _size(draw, device)}
    b = _Builder(draw, device, dtype, sizes)
    x = b.input(full)
    others = _extra_inputs(b, full, 1)
    v = _chain(b, x, others, 2)
    if rank >= 2 and draw(st.integers(0, 3)) == 0:
        v = _transpose(b, v)
    full = b.dims[v]
    kind = draw(st.sampled_from(tuple(REDUCTIONS)))
    how = draw(st.sampled_from(("one", "one", "all", "several")))
    axes: tuple = tuple(range(rank))
    if how == "one" or rank == 1:
        dim = draw(st.integers(-rank, rank - 1))
        axes = (dim % rank,)
    elif how == "several":
        axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=2, max_size=rank))))
        dim = axes
    else:
        dim = None
    if not REDUCTIONS[kind].empty_ok and any(sizes[full[a]] == 0 for a in axes):
        kind = "sum"
    # rank-0 results are a documented limitation ("scalar (rank-0) results are not supported yet"):
    # a reduction over every dim keeps them
    keepdim = draw(st.booleans()) or (len(axes) == rank and not KNOWN_LIMITS["rank0_results"])
    dims = tuple(1 if i in axes else d for i, d in enumerate(full)) if keepdim else \
        tuple(d for i, d in enumerate(full) if i not in axes)
    terms = math.prod(sizes[full[a]] for a in axes)
    bound = b.bounds[v] * (2 * math.sqrt(terms) + 1 if kind == "sum" else 1)
    r = b.node("reduce", kind, (v,), (dim, keepdim), dims, bound)
    out = _chain(b, r, [x, *others] if keepdim else [], 2)
    return b.program(_outputs(b, out), "reduce")


def _norm_program(draw, device, dtype) -> Program:
    kind = draw(st.sampled_from(tuple(NORMS)))
    norm = NORMS[kind]
    rank = draw(st.integers(norm.min_rank, 3))
    full = ("A", "M", "N")[-rank:]
    sizes = {"A": _batch(draw), "M": _size(draw, device, False), "N": _size(draw, device)}
    b = _Builder(draw, device, dtype, sizes)
    n_weights = draw(st.sampled_from(norm.weights))
    transposed = rank >= 2 and draw(st.integers(0, 3)) == 0
    last = full[-2] if transposed else full[-1]
    x = b.input(full)
    weights = [b.input((last,)) for _ in range(n_weights)]
    others = _extra_inputs(b, full, 1)
    v = _chain(b, x, others, 2)
    if transposed:
        v = _transpose(b, v)
    axis = draw(st.integers(-rank, rank - 1)) if norm.any_axis else -1
    bound = 1.0 if kind == "softmax" else 4.0 * math.sqrt(max(1, sizes[last])) * (4.0 if weights else 1.0) + 4.0
    r = b.node("norm", kind, (v, *weights), (axis,), b.dims[v], bound)
    out = _chain(b, r, [x, *others], 2)
    return b.program(_outputs(b, out), "norm")


def _matmul_program(draw, device, dtype) -> Program:
    sizes = {"A": _batch(draw), "M": _size(draw, device, False), "K": _size(draw, device),
             "N": _size(draw, device, False)}
    b = _Builder(draw, device, dtype, sizes)
    layout = draw(st.sampled_from(("nn", "nt", "tn", "batched", "batched_b")))
    a = b.input(("A", "M", "K") if layout.startswith("batched") else ("K", "M") if layout == "tn" else ("M", "K"))
    w = b.input(("N", "K") if layout == "nt" else ("A", "K", "N") if layout == "batched_b" else ("K", "N"))
    out_dims = ("A", "M", "N") if layout.startswith("batched") else ("M", "N")
    bias = [b.input(d) for d in draw(st.lists(st.sampled_from([("N",), ("M", 1), out_dims]), max_size=2))]
    lhs = _chain(b, a, [], 1)
    if layout == "tn":
        lhs = _transpose(b, lhs)
    kind = "matmul_nt" if layout == "nt" else "matmul"
    mm = b.node(kind, "matmul", (lhs, w), (), out_dims,
                b.bounds[lhs] * 4.0 * 0.5 * math.sqrt(max(1, sizes["K"])))
    out = _chain(b, mm, bias, 3)
    return b.program(_outputs(b, out), "matmul")


def _attention_program(draw, device, dtype) -> Program:
    sizes = {"B": _batch(draw), "H": _batch(draw), "S": _size(draw, device, False),
             "T": _size(draw, device, False), "D": draw(st.sampled_from(HEAD[device])),
             "E": draw(st.sampled_from(HEAD[device]))}
    if draw(st.booleans()):
        sizes["T"] = sizes["S"]
    if draw(st.booleans()):
        sizes["E"] = sizes["D"]
    b = _Builder(draw, device, dtype, sizes)
    q = b.input(("B", "H", "S", "D"))
    k = b.input(("B", "H", "T", "D"))
    v = b.input(("B", "H", "T", "E"))
    mods = draw(st.lists(st.sampled_from(tuple(SCORE_MODS)), max_size=3))
    extras = {}
    for name in mods:
        extra = SCORE_MODS[name].extra
        if extra is not None and extra not in extras:
            extras[extra] = b.input(extra)
    s = b.node("attention_scale", "scale", (q, k), (), ("B", "H", "S", "T"), 4.0)
    for name in mods:
        mod = SCORE_MODS[name]
        c = draw(st.sampled_from(mod.consts))
        args = (s, extras[mod.extra]) if mod.extra is not None else (s,)
        s = b.node("score", name, args, (c,) if c is not None else (), ("B", "H", "S", "T"), 64.0)
    p = b.node("norm", "softmax", (s,), (-1,), ("B", "H", "S", "T"), 1.0)
    o = b.node("matmul", "matmul", (p, v), (), ("B", "H", "S", "E"), 4.0)
    out = _chain(b, o, [], 2)
    return b.program(_outputs(b, out), "attention")


FAMILIES = {
    "elementwise": _elementwise_program,
    "reduce": _reduce_program,
    "norm": _norm_program,
    "matmul": _matmul_program,
    "attention": _attention_program,
}


@st.composite
def programs(draw, device: str = "cpu", families: Sequence[str] = tuple(FAMILIES)) -> Program:
    """A random program for `device` ("cpu": the tile interpreter, "gpu": generated PTX)."""
    family = draw(st.sampled_from(tuple(families)))
    matmuls = family in ("matmul", "attention")
    dtype = draw(st.sampled_from(MATMUL_DTYPES[device] if matmuls else DTYPES))
    return FAMILIES[family](draw, device, dtype)


# --- GPU compiles, shared across processes -----------------------------------------------------------

def has_zero_size(program: Program) -> bool:
    """A program with a zero-size dim: a call of it launches nothing, so there is nothing to compile."""
    return any(n == 0 for _, n in program.sizes)


def compile_for_gpu(program: Program, arch: str, sm_count: int | None, path: str):
    """The program compiled for a GPU through its cubins (which land in the on-disk cubin cache)."""
    fn = function(program)
    compiled = fn.compile(fn.arg_specs_for(program.dims), arch=arch, sm_count=sm_count, path=path)
    compiled.stage("cubin")
    return compiled


def precompile(job: tuple) -> str | None:
    """For a process pool: compile (program, arch, sm_count, path) so the checking process finds its
    cubins in the cache; returns the error, if any (the check then reports it on a shrunk program)."""
    try:
        compile_for_gpu(*job)
    except Exception as e:   # noqa: BLE001 - reported by the check
        return f"{type(e).__name__}: {e}"
    return None
