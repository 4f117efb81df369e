"""The oracle: a NumPy interpreter of Graph IR.

Every graph op is evaluated in float64 (int64 for integers) and rounded to its
result dtype, as PyTorch rounds each op's result. CPU tests and GPU tests both
compare generated kernels against this.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import DeviceAssertError
from ..ir import graph as g
from ..ir import provenance


def _wide(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x
    if np.issubdtype(x.dtype, np.integer):
        return x.astype(np.int64)
    return x.astype(np.float64)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
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


_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}


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
    g.ArangeOp: lambda op, bindings: np.arange(_concrete(op.res.type, bindings)[0], dtype=np.int64),
    g.ConstantOp: lambda op: np.array(op.value.value.data),
    g.CastOp: lambda op, x: x,
}
_NEEDS_BINDINGS = {g.ReshapeOp, g.ArangeOp}


def _check(op: g.AssertOp, cond: np.ndarray) -> None:
    """A device_assert on the whole tensor: the first failing element (no blocks at this level)."""
    if not cond.all():
        loc = provenance.loc_of(op)
        element = tuple(int(i) for i in np.argwhere(~cond)[0])
        raise DeviceAssertError(op.message.data, str(loc) if loc else None, element=element)


def run_graph(func_op, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Evaluate a graph `func.func` on NumPy inputs; returns one array per result."""
    from xdsl.dialects import func

    bindings = g.dim_bindings(func_op.body.block.first_op) if func_op.body.block.first_op else {}
    env: dict = {}
    for arg, x in zip(func_op.body.block.args, inputs, strict=True):
        env[arg] = np.asarray(x)
    for op in func_op.body.block.ops:
        if isinstance(op, func.ReturnOp):
            return [env[v] for v in op.arguments]
        if isinstance(op, g.AssertOp):
            _check(op, env[op.cond])
            continue
        out = _evaluate(op, [_wide(env[v]) for v in op.operands], bindings)
        dt = g.tensor_type(op.results[0]).dtype
        with np.errstate(all="ignore"):
            env[op.results[0]] = np.asarray(out).astype(dt.np)
    raise ValueError("graph function has no return")
