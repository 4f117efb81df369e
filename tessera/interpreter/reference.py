"""The oracle: a NumPy interpreter of Graph IR.

Every graph op is evaluated in float64 (int64 for integers) on the same,
dtype-rounded, inputs the kernels get, and a float op's result stays float64:
only an explicit `graph.cast` rounds (to its destination type, as the kernels'
casts do; not a gradient's storage cast, which kernels round only where they store),
integer and bool results keep their dtype's values, and each result
is rounded once to its dtype at the end. So the reference is the exact answer
for the inputs, never less accurate than a fused kernel that computes in fp32
registers and rounds at its store (rounding every op's result to bf16, as the
oracle once did, made it less accurate than the kernel: 8e-2 against 2e-3 on
bf16 ALiBi attention). `run_graph(..., exact=False)` is the per-op-rounded
evaluation of old, PyTorch's eager semantics, for sensitivity estimates.

`tolerance` and `output_tolerances` give the accuracy a kernel's output must
have against it, from the output's dtype and its reduction length. `tessera
run`, `tessera demo` and the tests compare against this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import dtypes
from ..dtypes import DType
from ..dims import is_dynamic
from ..errors import DeviceAssertError
from ..ir import graph as g
from ..ir import provenance


def _wide(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x
    if np.issubdtype(x.dtype, np.integer):
        return x.astype(np.int64, copy=False)
    return x.astype(np.float64, copy=False)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax about the row max; a row of no elements is an empty softmax (as in torch), not an error."""
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(x - m)
        return e / np.sum(e, axis=axis, keepdims=True)


def _layer_norm(op: g.LayerNormOp, x, *params):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + op.eps.value.data)
    if op.weight is not None:
        y = y * params[0]
    if op.bias is not None:
        y = y + params[-1]
    return y


def _rms_norm(op: g.RmsNormOp, x, *params):
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + op.eps.value.data)
    return y * params[0] if op.weight is not None else y


def _norm_statistic(op: g.NormStatisticOp, x):
    mean = x.mean(axis=-1, keepdims=True) if op.centered.data else 0.0
    if op.kind.data == "mean":
        return mean
    return 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + op.eps.value.data)


def _logsumexp(x, axis: int, keepdims: bool):
    """log(sum(exp(x))) about the max, a max of +-inf taken as 0 (a row of -inf gives -inf, one
    with +inf gives inf), as torch.logsumexp."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m).astype(x.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis)


_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean, "logsumexp": _logsumexp}


def _reduce(op: g.ReduceOp, x):
    return _REDUCE[op.kind.data](x, axis=op.axis.data, keepdims=bool(op.keepdim.data))


def _concrete(t: g.TensorType, bindings: dict[str, int]) -> tuple[int, ...]:
    return tuple(g.dim_value(d, bindings) for d in t.shape)


def _evaluate(op, args: Sequence[np.ndarray], bindings: dict[str, int]) -> np.ndarray:
    """One op on wide (float64/int64/bool) operands."""
    if isinstance(op, g.ElementwiseOp):
        with np.errstate(all="ignore"):
            return g.ELEMENTWISE[op.kind].ref(*args)
    rule: Callable = _RULES[type(op)]
    return rule(op, *args, bindings=bindings) if type(op) in _NEEDS_BINDINGS else rule(op, *args)


_RULES: dict[type, Callable] = {
    g.MatmulOp: lambda op, a, b: np.matmul(a, b),
    g.TransposeOp: lambda op, x: np.transpose(x, op.permutation),
    g.ReshapeOp: lambda op, x, bindings: x.reshape(_concrete(op.res.type, bindings)),
    g.ReduceOp: _reduce,
    g.SoftmaxOp: lambda op, x: _softmax(x, op.axis.data),
    g.LayerNormOp: _layer_norm,
    g.RmsNormOp: _rms_norm,
    g.NormStatisticOp: _norm_statistic,
    g.ArangeOp: lambda op, bindings: np.arange(_concrete(op.res.type, bindings)[0], dtype=np.int64),
    g.ConstantOp: lambda op: np.array(op.value.value.data),
    g.DimSizeOp: lambda op, bindings: np.array(int(bindings[op.dim.data]), dtype=np.int64),
    g.CastOp: lambda op, x: x,
    g.SliceOp: lambda op, x, bindings: x[tuple(slice(s, s + n) for s, n in
                                               zip(op.offsets, _concrete(op.res.type, bindings)))],
    g.ConcatOp: lambda op, *xs: np.concatenate(xs, axis=op.axis.data),
    g.GatherOp: lambda op, x, index: _gather(x, index),
}


def _gather(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """x[index], an index outside [0, rows) reading zeros (graph.GatherOp)."""
    inside = (index >= 0) & (index < x.shape[0])
    rows = x[np.where(inside, index, 0)] if x.shape[0] else np.zeros((*index.shape, *x.shape[1:]), x.dtype)
    return np.where(inside.reshape(*index.shape, *[1] * (x.ndim - 1)), rows, 0).astype(x.dtype)
_NEEDS_BINDINGS = {g.ReshapeOp, g.ArangeOp, g.DimSizeOp, g.SliceOp}


def _check(op: g.AssertOp, cond: np.ndarray) -> None:
    """A device_assert on the whole tensor: the first failing element (no blocks at this level)."""
    if not cond.all():
        loc = provenance.loc_of(op)
        element = tuple(int(i) for i in np.argwhere(~cond)[0])
        raise DeviceAssertError(op.message.data, str(loc) if loc else None, element=element)


def run_graph(func_op, inputs: Sequence[np.ndarray], exact: bool = True) -> list[np.ndarray]:
    """Evaluate a graph `func.func` on NumPy inputs; returns one array per result, of its dtype.

    `exact`: float intermediates stay float64 (casts still round, but for storage casts:
    `graph.CastOp.rounds_inside_kernels`); each result is rounded to its
    dtype once, at the end. Otherwise every op's result is rounded to its dtype (eager PyTorch)."""
    from xdsl.dialects import func

    bindings = g.dim_bindings(func_op.body.block.first_op) if func_op.body.block.first_op else {}
    env: dict = {}
    for arg, x in zip(func_op.body.block.args, inputs, strict=True):
        env[arg] = np.asarray(x)
        for d, n in zip(g.tensor_type(arg).shape, env[arg].shape):   # a dynamic dim: the inputs' size
            if isinstance(d, str) and is_dynamic(bindings.get(d)):
                bindings[d] = n
    ops = list(func_op.body.block.ops)
    last_use = {v: i for i, op in enumerate(ops) for v in op.operands}
    for i, op in enumerate(ops):
        if i:   # float64 intermediates are big (S x S scores): each goes after its last read
            for v in ops[i - 1].operands:
                if last_use[v] == i - 1:
                    env.pop(v, None)
        if isinstance(op, func.ReturnOp):
            with np.errstate(all="ignore"):
                return [np.asarray(env[v]).astype(g.tensor_type(v).dtype.np) for v in op.arguments]
        if isinstance(op, g.AssertOp):
            _check(op, env[op.cond])
            continue
        out = _evaluate(op, [_wide(env[v]) for v in op.operands], bindings)
        dt = g.tensor_type(op.results[0]).dtype
        with np.errstate(all="ignore"):
            if exact and dt.is_float and not (isinstance(op, g.CastOp) and op.rounds_inside_kernels):
                env[op.results[0]] = np.asarray(out, dtype=np.float64)
            else:   # casts round as the kernels' do; integers wrap and bools stay bools
                env[op.results[0]] = np.asarray(out).astype(dt.np)
    raise ValueError("graph function has no return")


# --- how close a kernel's output must be ------------------------------------------------------

@dataclass(frozen=True)
class Tolerance:
    """What an output may differ from the reference by, both measured in float64."""

    relative: float   # ||out - ref|| / ||ref||
    max_abs: float    # max |out - ref|, as a fraction of max(1, max |ref|)


#: Relative error an output may have, in units of its dtype's roundoff (half an ulp of 1): its
#: own rounding, its intermediates' roundings where a kernel boundary stores them, fp32's
#: approximate instructions (ex2.approx, lg2.approx, ...) in the fp32 math of every dtype.
ROUNDOFF_UNITS = {"fp32": 128, "fp16": 16, "bf16": 8, "fp8_e4m3": 4, "fp8_e5m2": 4}
#: Plus this many fp32 roundoffs times sqrt(reduction length): kernels accumulate in fp32.
ACCUMULATION_UNITS = 16
#: The max-abs bound is this times the relative one.
MAX_ABS_FACTOR = 2.0


def roundoff(dt: DType) -> float:
    """Unit roundoff: half the distance from 1 to the next value of `dt`."""
    import ml_dtypes
    return float(ml_dtypes.finfo(dt.np).eps) / 2


def tolerance(dt, reduction: int = 1) -> Tolerance:
    """How close an output of float dtype `dt` computed over `reduction` accumulated terms (a matmul's
    K, a softmax's row, ... summed over its chain of reductions) must be to the exact answer.
    Integer and bool outputs must be exact."""
    dt = dtypes.lookup(dt)
    if not dt.is_float:
        return Tolerance(0.0, 0.0)
    if dt.name not in ROUNDOFF_UNITS:
        raise ValueError(f"no accuracy tolerance for {dt}; checks cover {', '.join(ROUNDOFF_UNITS)}")
    rel = (ROUNDOFF_UNITS[dt.name] * roundoff(dt)
           + ACCUMULATION_UNITS * roundoff(dtypes.fp32) * math.sqrt(max(1, reduction)))
    return Tolerance(rel, MAX_ABS_FACTOR * rel)


def least_precise(dts: Iterable[DType]) -> DType | None:
    """The float dtype with the largest roundoff among `dts` (None when none is a float)."""
    floats = [dtypes.lookup(d) for d in dts if dtypes.lookup(d).is_float]
    return max(floats, key=roundoff, default=None)


def reduction_length(op, bindings: dict[str, int]) -> int:
    """How many terms one result element of `op` accumulates (0 for ops that accumulate none)."""
    def size(v, axis):
        return g.dim_value(g.tensor_type(v).shape[axis], bindings)
    if isinstance(op, g.MatmulOp):
        return size(op.operands[0], -1)
    if isinstance(op, (g.ReduceOp, g.SoftmaxOp)):
        return size(op.operands[0], op.axis.data)
    if isinstance(op, (g.LayerNormOp, g.RmsNormOp, g.NormStatisticOp)):
        return size(op.operands[0], -1)
    return 0


def output_tolerances(func_op, sizes: dict[str, int] | None = None) -> list[Tolerance]:
    """Each result's tolerance: for the least precise float dtype among the values it is computed
    from (itself, intermediates, inputs: a kernel may store an intermediate in its dtype) and the
    sum of the reduction lengths of the ops it depends on; a dim compiled as a kernel argument at
    its value in `sizes` (the call's)."""
    from xdsl.dialects import func
    from xdsl.ir import Operation

    bindings = g.dim_bindings(func_op.body.block.first_op) if func_op.body.block.first_op else {}
    bindings = {d: (sizes[d] if is_dynamic(v) and sizes and d in sizes else v) for d, v in bindings.items()}
    ret = next(op for op in func_op.body.block.ops if isinstance(op, func.ReturnOp))
    out = []
    for result in ret.arguments:
        seen, stack, types, length = set(), [result], [], 0
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            types.append(g.tensor_type(v).dtype)
            owner = v.owner
            if isinstance(owner, Operation):
                length += reduction_length(owner, bindings)
                stack.extend(owner.operands)
        dt = least_precise(types) if g.tensor_type(result).dtype.is_float else g.tensor_type(result).dtype
        out.append(tolerance(dt or dtypes.fp32, length))
    return out
