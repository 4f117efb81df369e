"""NumPy's functions on traced tensors: `np.exp(x)`, `np.maximum(x, 0.0)`, `np.where(c, x, 0)`, ...

NumPy hands a call that has an argument defining `__array_ufunc__` or
`__array_function__` to that argument; `Tensor` hands it here. A ufunc or
function that a Tessera op means the same as becomes that op (ufuncs by name,
so an op added to `tessera.frontend.ops` under NumPy's name is found without a
table entry); any other is refused with its name, where NumPy would otherwise
turn the traced tensor into an object array and fail far from the user's line.
"""
from __future__ import annotations

import numpy as np

from ..errors import TesseraError

#: NumPy ufunc names whose Tessera op is called something else.
UFUNC_ALIASES = {"absolute": "abs", "negative": "neg", "true_divide": "div", "divide": "div", "power": "pow",
                 "subtract": "sub", "multiply": "mul", "less": "lt", "less_equal": "le", "greater": "gt",
                 "greater_equal": "ge", "equal": "eq", "not_equal": "ne"}

def _ops():
    from . import ops
    return ops


def _refuse(name: str, why: str = "") -> TesseraError:
    return TesseraError(f"np.{name} on a traced tensor{why}: NumPy cannot compute with traced values (they "
                        f"exist only when the kernel runs); use the tessera op (tsr.exp, tsr.where, tsr.sum, ...)")


def array_ufunc(ufunc, method: str, inputs, kwargs):
    """`np.exp(x)`, `np.add(x, 1)`, `np.float32(2) * x`: the Tessera op of the ufunc's name."""
    name = ufunc.__name__
    if method != "__call__":
        raise _refuse(f"{name}.{method}")
    if kwargs:
        raise _refuse(name, f" with {', '.join(f'{k}=' for k in kwargs)}")
    op = getattr(_ops(), UFUNC_ALIASES.get(name, name), None)
    if not callable(op):
        raise _refuse(name)
    return op(*inputs)


def _reduction(op):
    def call(a, axis=None, keepdims=False, **unsupported):
        if unsupported:
            raise _refuse(op.__name__, f" with {', '.join(f'{k}=' for k in unsupported)}")
        return op(a, axis, bool(keepdims))
    return call


def _transpose(a, axes=None):
    ops = _ops()
    return ops.permute(a, *(axes if axes is not None else reversed(range(a.ndim))))


def _reshape(a, shape, *rest, **kwargs):
    if rest or kwargs:
        raise _refuse("reshape", " with an order")
    return _ops().reshape(a, shape)


def _functions() -> dict:
    """NumPy function -> what it does on traced tensors."""
    ops = _ops()
    return {np.where: ops.where, np.sum: _reduction(ops.sum), np.mean: _reduction(ops.mean),
            np.max: _reduction(ops.amax), np.amax: _reduction(ops.amax), np.min: _reduction(ops.amin),
            np.amin: _reduction(ops.amin), np.transpose: _transpose, np.reshape: _reshape,
            np.shape: lambda a: a.shape, np.ndim: lambda a: a.ndim}


def array_function(func, args, kwargs):
    """`np.where(c, x, 0)`, `np.sum(x, axis=-1)`, `np.transpose(x)`: the Tessera op, else refused."""
    implementation = _functions().get(func)
    if implementation is None:
        raise _refuse(getattr(func, "__name__", str(func)))
    return implementation(*args, **kwargs)
