"""Vector-Jacobian products of the Graph IR ops, as one table: `VJP_RULES[rule_key(op)]`.

A rule is `rule(op, g, y, *xs) -> one gradient (or None) per operand of op`: `op` the forward
op (for its properties), `g` the cotangent of its result, `y` its result and `xs` its operands,
all traced `Tensor`s of the backward function being built. Rules are written with the frontend's
ops (`tsr.mul`, `tsr.sum`, `tsr.matmul`, ...), so a backward graph is made of the same Graph IR
ops as any traced function and goes through the same fusion, lowering and targets.

A rule may return a gradient in the broadcast shape of the op's result (an elementwise op's
`g * b`, a batched matmul's broadcast batch dims) and in any float dtype: the caller sums it back
to the operand's shape and casts it to the operand's dtype (`backward.fit`).

None means no gradient: comparisons, logical ops, `floor_divide` (piecewise constant), `where`'s
condition. Ops whose results are not floats (comparisons, argmax's int32 indices, aranges) are
never differentiated at all. Ties follow torch: `maximum`/`minimum` split the gradient in half
between equal operands, but a clamp's go to x at its bounds and relu's is 0 at 0 (`ops.TIES`);
`amax`/`amin` (`graph.reduce` max/min) split it evenly among the elements equal to the extreme,
over all the dims reduced; `abs` has gradient 0 at 0.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .. import dtypes
from ..errors import DTypeError, TesseraError
from ..frontend import ops, torch_ops
from ..frontend.tensor import Tensor

Rule = Callable[..., Sequence["Tensor | None"]]


def rule_key(op) -> str:
    """The table key of a forward op: its name, with the kind of a reduction (`graph.reduce.max`)."""
    return f"{op.name}.{op.kind.data}" if op.name == "graph.reduce" else op.name


# --- helpers ------------------------------------------------------------------------------------

def full(shape: Sequence[int], value: float, dt) -> Tensor:
    """`value` in every element of `shape` (a broadcast constant: it fuses into its readers)."""
    return torch_ops.expand(ops.constant(value, dt), *shape)


def _wide(x: Tensor) -> Tensor:
    """16-bit floats computed in fp32, as the forward's composites are (`ops._in_fp32`)."""
    return ops.cast(x, dtypes.fp32) if x.dtype.is_float and x.dtype.bits < 32 else x


def _with_axis(g: Tensor, x: Tensor, axis: int, keepdim: bool) -> Tensor:
    """A reduction's `g` with the reduced axis kept (size 1), broadcast to x's shape."""
    if not keepdim:
        g = ops.unsqueeze(g, axis)
    return torch_ops.expand(g, *x.shape)


# --- elementwise ops -----------------------------------------------------------------------------

def _abs(op, g, y, x):
    return (ops.where(x > 0, g, ops.where(x < 0, -g, 0.0)),)


def _extreme(larger: bool):
    """maximum / minimum: the gradient goes to the chosen operand, halved between equal ones
    (torch's maximum); where the op says otherwise (`ops.TIES`: a clamp's bound, relu at 0), all
    of it to the first operand or to neither."""
    def rule(op, g, y, a, b):
        a_loses, b_loses = (a < b, b < a) if larger else (a > b, b > a)
        ties = ops.ties_of(op)
        if ties == "first":
            return ops.where(a_loses, 0.0, g), ops.where(a_loses, g, 0.0)
        if ties == "neither":
            return ops.where(a_loses | (a == b), 0.0, g), ops.where(b_loses | (a == b), 0.0, g)
        share = ops.where(a == b, g * 0.5, g)
        return ops.where(a_loses, 0.0, share), ops.where(b_loses, 0.0, share)
    return rule


def _pow(op, g, y, a, b):
    """torch's pow: no gradient to the base where the exponent is 0, none to the exponent where the
    base is 0 and the exponent is >= 0 (where log(base) is -inf or nan)."""
    da = ops.where(b == 0, 0.0, g * b * a ** (b - 1.0))
    db = ops.where((a == 0) & (b >= 0), 0.0, g * y * ops.log(a))
    return da, db


_ELEMENTWISE: dict[str, Rule] = {
    "neg": lambda op, g, y, x: (-g,),
    "abs": _abs,
    "exp": lambda op, g, y, x: (g * y,),
    "exp2": lambda op, g, y, x: (g * y * math.log(2.0),),
    "log": lambda op, g, y, x: (g / x,),
    "log2": lambda op, g, y, x: (g / (x * math.log(2.0)),),
    "tanh": lambda op, g, y, x: (g * (1.0 - y * y),),
    "sigmoid": lambda op, g, y, x: (g * (y * (1.0 - y)),),
    "sqrt": lambda op, g, y, x: (g * 0.5 / y,),
    "rsqrt": lambda op, g, y, x: (g * -0.5 * y * y * y,),
    "sin": lambda op, g, y, x: (g * ops.cos(x),),
    "cos": lambda op, g, y, x: (-g * ops.sin(x),),
    "erf": lambda op, g, y, x: (g * (2.0 / math.sqrt(math.pi)) * ops.exp(-(x * x)),),
    "add": lambda op, g, y, a, b: (g, g),
    "sub": lambda op, g, y, a, b: (g, -g),
    "mul": lambda op, g, y, a, b: (g * b, g * a),
    "div": lambda op, g, y, a, b: (g / b, -g * y / b),
    "maximum": _extreme(larger=True),
    "minimum": _extreme(larger=False),
    "pow": _pow,
    "floor_divide": lambda op, g, y, a, b: (None, None),
    "remainder": lambda op, g, y, a, b: (g, -g * torch_ops.floor_divide(a, b)),
    "where": lambda op, g, y, c, a, b: (None, ops.where(c, g, 0.0), ops.where(c, 0.0, g)),
}


# --- views and casts -----------------------------------------------------------------------------

def _transpose(op, g, y, x):
    inverse = [0] * len(op.permutation)
    for i, p in enumerate(op.permutation):
        inverse[p] = i
    return (ops.permute(g, *inverse),)


def _slice(op, g, y, x):
    """The window's gradient placed back in x's shape: zeros before and after it along each
    sliced dim (a concat, which one kernel computes)."""
    for axis, start in enumerate(op.offsets):
        size, taken = int(x.shape[axis]), int(g.shape[axis])
        pieces = []
        for count in (start, size - start - taken):
            shape = [*g.shape[:axis], count, *g.shape[axis + 1:]]
            pieces.append(full(shape, 0.0, g.dtype) if count else None)
        parts = [p for p in (pieces[0], g, pieces[1]) if p is not None]
        g = torch_ops.cat(parts, axis) if len(parts) > 1 else g
    return (g,)


def _concat(op, g, y, *xs):
    axis, start, grads = op.axis.data, 0, []
    for x in xs:
        starts = [start if d == axis else 0 for d in range(g.ndim)]
        sizes = [x.shape[d] if d == axis else g.shape[d] for d in range(g.ndim)]
        grads.append(torch_ops._window(g, starts, sizes))
        start += int(x.shape[axis])
    return grads


# --- reductions ----------------------------------------------------------------------------------

def _reduce_sum(op, g, y, x):
    return (_with_axis(g, x, op.axis.data, op.keepdim.data),)


def _reduce_mean(op, g, y, x):
    return (_with_axis(g / float(x.shape[op.axis.data]), x, op.axis.data, op.keepdim.data),)


def _reduce_extreme(op, g, y, x, counts: Tensor | None = None):
    """amax / amin as torch: the gradient split evenly among the elements equal to the extreme;
    with `counts` (x the extremes of an earlier dim's reduction: `backward._tie_counts`), each
    element of x weighted by the elements it stands for."""
    axis, keepdim = op.axis.data, op.keepdim.data
    extreme = y if keepdim else ops.unsqueeze(y, axis)
    hit = ops.equals_extreme(x, extreme)
    if ops.ties_of(op) == "first":   # (as max(x, dim)'s indices name)
        n = x.shape[axis]
        index = ops.reshape(ops.arange(n), *[n if i == axis else 1 for i in range(x.ndim)])
        first = ops.amin(ops.where(hit, index, n), axis, True)
        return (ops.where(index == first, g if keepdim else ops.unsqueeze(g, axis), 0.0),)
    weights = ops.cast(hit, g.dtype) if counts is None else ops.where(hit, counts, 0.0)
    ties = ops.sum(weights, axis, keepdim=True)
    share = (g if keepdim else ops.unsqueeze(g, axis)) / ties
    return (ops.where(hit, share if counts is None else share * counts, 0.0),)


#: the rule keys of amax / amin (`backward._tie_counts` follows their chains over several dims)
EXTREMES = ("graph.reduce.max", "graph.reduce.min")


def _reduce_logsumexp(op, g, y, x):
    """softmax(x) along the axis times the cotangent (exp(x - y), y the log-sum-exp: one fused
    elementwise kernel, no second reduction)."""
    axis, keepdim = op.axis.data, op.keepdim.data
    lse = _wide(y if keepdim else ops.unsqueeze(y, axis))
    share = _wide(g if keepdim else ops.unsqueeze(g, axis))
    return (ops.exp(_wide(x) - lse) * share,)


# --- matmul, softmax, norms ----------------------------------------------------------------------

def _matmul(op, g, y, a, b):
    """dA = dC @ B^T, dB = A^T @ dC; broadcast batch dims are summed back by the caller."""
    if a.dtype in dtypes.FP8:
        raise DTypeError(f"no gradient through a matmul of {a.dtype} operands (an fp8 tensor is storage, as "
                         f"in torch._scaled_mm): differentiate the bf16 or fp16 computation, and quantize "
                         f"outside it")
    return ops.matmul(g, torch_ops.mT(b)), ops.matmul(torch_ops.mT(a), g)


def _softmax(op, g, y, x, rowsum: Tensor | None = None):
    """y * (g - sum(g * y)); `rowsum`, when the caller knows sum(g * y) another way (an attention's
    rowsum(dO * O): `backward._Reverse._attention_rowsum`)."""
    axis = op.axis.data
    g, y = _wide(g), _wide(y)
    return (y * (g - (ops.sum(g * y, axis, keepdim=True) if rowsum is None else rowsum)),)


def _layer_norm(op, g, y, x, *params, mean: Tensor | None = None, rstd: Tensor | None = None):
    """The row's `mean` and `rstd` as the forward saved them (`backward.saved_values`), else
    recomputed from x."""
    g, x = _wide(g), _wide(x)
    centered = x - (ops.mean(x, -1, keepdim=True) if mean is None else mean)
    if rstd is None:
        rstd = ops.rsqrt(ops.mean(centered * centered, -1, keepdim=True) + op.eps.value.data)
    normalized = centered * rstd
    gn = g * _wide(params[0]) if op.weight is not None else g
    dx = rstd * (gn - ops.mean(gn, -1, keepdim=True) - normalized * ops.mean(gn * normalized, -1, keepdim=True))
    weight = [g * normalized] if op.weight is not None else []
    bias = [g] if op.bias is not None else []
    return (dx, *weight, *bias)


def _rms_norm(op, g, y, x, *params, rstd: Tensor | None = None):
    """`rstd` as the forward saved it, else recomputed from x."""
    g, x = _wide(g), _wide(x)
    if rstd is None:
        rstd = ops.rsqrt(ops.mean(x * x, -1, keepdim=True) + op.eps.value.data)
    normalized = x * rstd
    gn = g * _wide(params[0]) if op.weight is not None else g
    dx = rstd * (gn - normalized * ops.mean(gn * normalized, -1, keepdim=True))
    return (dx, g * normalized) if op.weight is not None else (dx,)


def _norm_statistic(op, g, y, x):
    """mean: g / n to every element; rstd = (mean(c^2) + eps)^-1/2 with c = x - mean(x) (centered)
    or x: -g rstd^3 c / n (the mean's own derivative cancels: c sums to 0)."""
    g, x = _wide(g), _wide(x)
    n = x.shape[-1]
    if op.kind.data == "mean":
        return (g * full(x.shape, 1.0 / n, g.dtype),)
    c = x - ops.mean(x, -1, keepdim=True) if op.centered.data else x
    return (-(g * y * y * y) * c * (1.0 / n),)


def _gather(op, g, y, x, index):
    raise TesseraError("the gradient of x[index] (a gather) with respect to x is a scatter-add (a row picked "
                       "twice gets both gradients), which Tessera does not have yet; pass x as a constant "
                       "(argnums) or compute the lookup outside the differentiated function")


VJP_RULES: dict[str, Rule] = {
    "graph.gather": _gather,
    **{f"graph.{kind}": rule for kind, rule in _ELEMENTWISE.items()},
    "graph.cast": lambda op, g, y, x: (g,),
    "graph.transpose": _transpose,
    "graph.reshape": lambda op, g, y, x: (ops._reshape_dims(g, x.dims),),
    "graph.slice": _slice,
    "graph.concat": _concat,
    "graph.reduce.sum": _reduce_sum,
    "graph.reduce.mean": _reduce_mean,
    "graph.reduce.max": _reduce_extreme,
    "graph.reduce.min": _reduce_extreme,
    "graph.reduce.logsumexp": _reduce_logsumexp,
    "graph.matmul": _matmul,
    "graph.softmax": _softmax,
    "graph.layer_norm": _layer_norm,
    "graph.rms_norm": _rms_norm,
    "graph.norm_statistic": _norm_statistic,
}
