"""`Tensor["B", "S", fp16]` annotations and the traced tensor values users compute with.

Tracing runs the user's Python function once with `Tensor` values that record
Graph IR ops. Dims are `SymInt`s: real ints (so `math.sqrt(q.shape[-1])` works
in plain Python) that remember their symbolic name (so `tsr.arange(S)` and
error messages can use it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import dtypes
from ..dims import Dynamic, DynamicDim, is_dynamic
from ..dtypes import DType
from ..errors import DTypeError, ShapeError, TesseraError


class TracedBoolError(TesseraError, TypeError):
    """Python control flow on a traced tensor's values."""


class SymInt(int):
    """An int that remembers the symbolic dim it came from."""

    name: str | None

    def __new__(cls, value: int, name: str | None = None):
        obj = super().__new__(cls, value)
        obj.name = name
        return obj

    def __repr__(self) -> str:
        return f"{self.name}={int(self)}" if self.name else str(int(self))


def _sym_int(value, d: str | int):
    return TracedDim(value) if is_dynamic(value) else SymInt(value, d if isinstance(d, str) else None)


class DimExpr:
    """`const` plus a sum of dims taken at run time, each times its integer coefficient (`terms`):
    what `k.shape[-2] - q.shape[-2]` is where N is such a dim (`TracedDim`). It adds, subtracts
    and scales by ints; in tensor math it becomes graph ops (`graph.dim_size`, read at run time);
    arithmetic or a comparison with a traced tensor is the tensor's. Anything that needs its value
    (int(), a float, a comparison with a number, an index) raises `DynamicDim`, and the function
    compiles the dim as a constant instead."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: tuple[tuple[str, int], ...], const: int = 0):
        self.terms, self.const = terms, const

    @staticmethod
    def of(x) -> "DimExpr | None":
        """`x` as an expression: a dim taken at run time, an expression, an int; else None."""
        if isinstance(x, DimExpr):
            return x
        if is_dynamic(x):
            return DimExpr(((x.name, 1),))
        if isinstance(x, int) and not isinstance(x, bool):
            return DimExpr((), int(x))
        return None

    def _plus(self, other, sign: int):
        o = DimExpr.of(other)
        if o is None:
            return self._other(other)
        coefs = dict(self.terms)
        for name, c in o.terms:
            coefs[name] = coefs.get(name, 0) + sign * c
        terms = tuple((n, c) for n, c in coefs.items() if c)
        const = self.const + sign * o.const
        return DimExpr(terms, const) if terms else const

    def __add__(self, other):
        return self._plus(other, 1)

    __radd__ = __add__

    def __sub__(self, other):
        return self._plus(other, -1)

    def __rsub__(self, other):
        o = DimExpr.of(other)
        return self._other(other) if o is None else o._plus(self, -1)

    def __neg__(self):
        return DimExpr((), 0)._plus(self, -1)

    def __pos__(self):
        return self

    def __mul__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            return DimExpr(tuple((n, c * other) for n, c in self.terms), self.const * other) if other else 0
        return self._other(other)

    __rmul__ = __mul__

    def __repr__(self) -> str:
        parts = [f"{'-' if c < 0 else '+'} {abs(c)}*{n}" if abs(c) != 1 else f"{'-' if c < 0 else '+'} {n}"
                 for n, c in self.terms] + ([f"{'-' if self.const < 0 else '+'} {abs(self.const)}"] if self.const else [])
        return " ".join(parts).lstrip("+ ")

    def _value(self, *_):
        raise DynamicDim(self.terms[0][0], f"{self!r} is used where a number is needed")

    def _other(self, other, *_):
        """Arithmetic or a comparison with a traced tensor is the tensor's (`NotImplemented` hands
        it over); with anything else (a float, a bool) it needs the value."""
        return NotImplemented if isinstance(other, Tensor) else self._value()

    __int__ = __index__ = __float__ = __bool__ = __hash__ = _value
    __abs__ = __round__ = __trunc__ = __floor__ = __ceil__ = _value
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _other
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _other
    __divmod__ = __rdivmod__ = __pow__ = __rpow__ = _other


class TracedDim(Dynamic):
    """A dim taken at run time, as `Tensor.shape` gives it: a `Dynamic` (which refuses to be used as
    a number) whose arithmetic is `DimExpr`'s."""

    __slots__ = ()

    def __init__(self, dynamic: Dynamic):
        super().__init__(dynamic.name, dynamic.hint, dynamic.index_bits, dynamic.multiple)

    def _expr(self) -> DimExpr:
        return DimExpr(((self.name, 1),))

    def __add__(self, other):
        return self._expr() + other

    def __radd__(self, other):
        return other + self._expr()

    def __sub__(self, other):
        return self._expr() - other

    def __rsub__(self, other):
        return other - self._expr()

    def __neg__(self):
        return -self._expr()

    def __pos__(self):
        return self

    def __mul__(self, other):
        return self._expr() * other

    __rmul__ = __mul__

    def _other(self, other, *_):
        return self._expr()._other(other)

    def __eq__(self, other):   # (with a tensor: the tensor's elementwise comparison)
        return NotImplemented if isinstance(other, Tensor) else super().__eq__(other)

    def __ne__(self, other):
        return NotImplemented if isinstance(other, Tensor) else super().__ne__(other)

    __hash__ = Dynamic.__hash__
    __abs__ = __round__ = __trunc__ = __floor__ = __ceil__ = Dynamic._value
    __lt__ = __le__ = __gt__ = __ge__ = _other
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _other
    __divmod__ = __rdivmod__ = __pow__ = __rpow__ = _other


@dataclass(frozen=True)
class TensorSpec:
    """What an annotation says: dims (names or ints) and optionally a dtype."""

    dims: tuple[str | int, ...]
    dtype: DType | None = None

    def __repr__(self) -> str:
        parts = [repr(d) for d in self.dims] + ([self.dtype.name] if self.dtype else [])
        return f"Tensor[{', '.join(parts)}]"


class Tensor:
    """A traced tensor. `Tensor[...]` in an annotation makes a `TensorSpec`."""

    def __class_getitem__(cls, item) -> TensorSpec:
        items = item if isinstance(item, tuple) else (item,)
        dims: list[str | int] = []
        dt = None
        for x in items:
            if isinstance(x, (DType,)):
                dt = x
            elif isinstance(x, str) and x in dtypes.BY_NAME and not x[:1].isupper():
                dt = dtypes.BY_NAME[x]
            elif isinstance(x, (str, int)):
                if isinstance(x, str) and not x.isidentifier():
                    raise ShapeError(f"dim name {x!r} in Tensor[...] must be an identifier")
                dims.append(x)
            else:
                raise TypeError(f"Tensor[...] takes dim names, ints and a dtype, got {x!r}")
        return TensorSpec(tuple(dims), dt)

    def __init__(self, trace, value, dims: Sequence[str | int], dt: DType):
        self._trace = trace
        self.value = value
        self.dims = tuple(dims)
        self.dtype = dt

    # --- shape ---------------------------------------------------------------
    @property
    def shape(self) -> tuple[SymInt, ...]:
        """The dims' values; a dim compiled as a kernel argument is a `TracedDim`, which adds and
        subtracts (`DimExpr`, read at run time in tensor math) but refuses to be used as a number
        (`tessera.dims`): code that needs its value compiles it as a constant."""
        return tuple(_sym_int(self._trace.size(d), d) for d in self.dims)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def __len__(self) -> int:
        return int(self.shape[0])

    def __repr__(self) -> str:
        return f"Tensor[{', '.join(map(str, self.dims))}, {self.dtype}]"

    def __bool__(self):
        raise TracedBoolError("a traced Tensor has no truth value (in `if`, `and`, `or`, `not`): its values "
                              "exist only when the kernel runs; use tsr.where(cond, a, b), & and | instead")

    # --- methods forwarding to ops ------------------------------------------------
    def transpose(self, d0: int, d1: int) -> "Tensor":
        return _ops().transpose(self, d0, d1)

    def permute(self, *perm) -> "Tensor":
        return _ops().permute(self, *perm)

    @property
    def T(self) -> "Tensor":
        return _ops().permute(self, *reversed(range(self.ndim)))

    def reshape(self, *shape) -> "Tensor":
        return _ops().reshape(self, *shape)

    view = reshape

    def unsqueeze(self, dim: int) -> "Tensor":
        return _ops().unsqueeze(self, dim)

    def to(self, dt) -> "Tensor":
        return _ops().cast(self, dt)

    cast = astype = to

    def float(self) -> "Tensor":
        return _ops().cast(self, dtypes.fp32)

    def half(self) -> "Tensor":
        return _ops().cast(self, dtypes.fp16)

    def sum(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().sum(self, dim, keepdim)

    def mean(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().mean(self, dim, keepdim)

    def max(self, dim=None, keepdim: bool = False):
        """torch.Tensor.max: the largest element; with `dim`, a (values, indices) named tuple; with
        a tensor, the elementwise maximum (`tsr.max`)."""
        return _torch_ops().max(self, dim, keepdim)

    def min(self, dim=None, keepdim: bool = False):
        """torch.Tensor.min: as `max`, for the smallest."""
        return _torch_ops().min(self, dim, keepdim)

    def amax(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().amax(self, dim, keepdim)

    def amin(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _ops().amin(self, dim, keepdim)

    def argmax(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _torch_ops().argmax(self, dim, keepdim)

    def argmin(self, dim=None, keepdim: bool = False) -> "Tensor":
        return _torch_ops().argmin(self, dim, keepdim)

    def var(self, dim=None, *, correction=1, keepdim: bool = False) -> "Tensor":
        return _torch_ops().var(self, dim, correction=correction, keepdim=keepdim)

    def std(self, dim=None, *, correction=1, keepdim: bool = False) -> "Tensor":
        return _torch_ops().std(self, dim, correction=correction, keepdim=keepdim)

    def logsumexp(self, dim, keepdim: bool = False) -> "Tensor":
        return _torch_ops().logsumexp(self, dim, keepdim)

    def log_softmax(self, dim: int = -1) -> "Tensor":
        return _torch_ops().log_softmax(self, dim)

    def clamp(self, min=None, max=None) -> "Tensor":
        return _torch_ops().clamp(self, min, max)

    clip = clamp

    def masked_fill(self, mask, value) -> "Tensor":
        return _torch_ops().masked_fill(self, mask, value)

    def tril(self, diagonal: int = 0) -> "Tensor":
        return _torch_ops().tril(self, diagonal)

    def triu(self, diagonal: int = 0) -> "Tensor":
        return _torch_ops().triu(self, diagonal)

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> "Tensor":
        return _torch_ops().flatten(self, start_dim, end_dim)

    def expand(self, *sizes) -> "Tensor":
        return _torch_ops().expand(self, *sizes)

    @property
    def mT(self) -> "Tensor":
        return _torch_ops().mT(self)

    def softmax(self, dim: int = -1) -> "Tensor":
        return _ops().softmax(self, dim)

    def exp(self) -> "Tensor":
        return _ops().exp(self)

    def tanh(self) -> "Tensor":
        return _ops().tanh(self)

    def sqrt(self) -> "Tensor":
        return _ops().sqrt(self)

    def abs(self) -> "Tensor":
        return _ops().abs(self)

    def __getitem__(self, index) -> "Tensor":
        return _ops().getitem(self, index)

    def __setitem__(self, index, value) -> None:
        _ops().setitem(self, index, value)

    # --- in place, as in NumPy: `x += y` stores into x, which every name of it (and its views) sees
    def __iadd__(self, o): self[...] = self + o; return self
    def __isub__(self, o): self[...] = self - o; return self
    def __imul__(self, o): self[...] = self * o; return self
    def __itruediv__(self, o): self[...] = self / o; return self
    def __ifloordiv__(self, o): self[...] = self // o; return self
    def __imod__(self, o): self[...] = self % o; return self
    def __ipow__(self, o): self[...] = self ** o; return self
    def __imatmul__(self, o): self[...] = self @ o; return self
    def __iand__(self, o): self[...] = self & o; return self
    def __ior__(self, o): self[...] = self | o; return self

    # --- NumPy's functions on a traced tensor (np.exp(x), np.where(...)): tessera ops, or refused
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        from . import numpy_compat
        return numpy_compat.array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        from . import numpy_compat
        return numpy_compat.array_function(func, args, kwargs)

    # --- operators -------------------------------------------------------------------
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(o, self)
    def __sub__(self, o): return _ops().sub(self, o)
    def __rsub__(self, o): return _ops().sub(o, self)
    def __mul__(self, o): return _ops().mul(self, o)
    def __rmul__(self, o): return _ops().mul(o, self)
    def __truediv__(self, o): return _ops().div(self, o)
    def __rtruediv__(self, o): return _ops().div(o, self)
    def __floordiv__(self, o): return _torch_ops().floor_divide(self, o)
    def __rfloordiv__(self, o): return _torch_ops().floor_divide(o, self)
    def __mod__(self, o): return _torch_ops().remainder(self, o)
    def __rmod__(self, o): return _torch_ops().remainder(o, self)
    def __pow__(self, o): return _ops().pow(self, o)
    def __rpow__(self, o): return _ops().pow(o, self)
    def __matmul__(self, o): return _ops().matmul(self, o)
    def __rmatmul__(self, o): return _ops().matmul(o, self)
    def __neg__(self): return _ops().neg(self)
    def __pos__(self): return Tensor(self._trace, self.value, self.dims, self.dtype)   # a copy, as in NumPy
    def __abs__(self): return _ops().abs(self)
    def __lt__(self, o): return _ops().lt(self, o)
    def __le__(self, o): return _ops().le(self, o)
    def __gt__(self, o): return _ops().gt(self, o)
    def __ge__(self, o): return _ops().ge(self, o)
    def __eq__(self, o): return _ops().eq(self, o)  # type: ignore[override]
    def __ne__(self, o): return _ops().ne(self, o)  # type: ignore[override]
    def __and__(self, o): return _ops().logical_and(self, o)
    def __or__(self, o): return _ops().logical_or(self, o)
    def __invert__(self): return _ops().logical_not(self)
    __hash__ = object.__hash__


def _ops():
    from . import ops
    return ops


def _torch_ops():
    from . import torch_ops
    return torch_ops


def check_dtype(name: str, want: DType | None, got: DType) -> None:
    if want is not None and want != got:
        raise DTypeError(f"argument {name!r} is annotated {want.name} but got {got.name}")
