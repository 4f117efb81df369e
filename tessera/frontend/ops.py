"""The ops users call (`tsr.matmul`, `tsr.softmax`, `tsr.where`, ...).

Each op infers its result's dims and dtype, reports mistakes in the user's
terms (argument names, symbolic dims), and appends one Graph IR op to the
current trace. Composite ops (gelu, silu, relu) are written here in
terms of primitive ones, so every later level only sees the primitives.
"""
from __future__ import annotations

import math
from typing import Sequence

import builtins

import numpy as np

from .. import dtypes
from ..dims import Dynamic, DynamicDim, is_dynamic
from ..dtypes import DType
from ..errors import ArgumentKindError, DTypeError, ShapeError, TesseraError
from .tensor import DimExpr, SymInt, Tensor
from .trace import current_trace


def _graph():
    from ..ir import graph
    return graph


def _label(x: Tensor) -> str:
    return getattr(x, "label", None) or "a tensor"


def _make(value, dims, dt: DType, label: str | None = None) -> Tensor:
    t = Tensor(current_trace(), value, dims, dt)
    t.label = label
    return t


def _show(x: Tensor) -> str:
    trace = current_trace()
    return "[" + ", ".join(_dim_str(d, trace) for d in x.dims) + "]"


def _dim_str(d, trace) -> str:
    """`d` as errors show it: `S=128`, a dim taken at run time `S=?`, a constant `4`."""
    if not isinstance(d, str):
        return str(d)
    size = trace.size(d)
    return repr(size) if is_dynamic(size) else f"{d}={size}"


def _axis(x: Tensor, dim: int, what: str) -> int:
    if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        raise ShapeError(f"{what}: dim {dim} is out of range for {_label(x)} of rank {x.ndim} {_show(x)}")
    return dim % x.ndim


# --- scalars and elementwise ------------------------------------------------------

def _scalar_dtype(value, like: DType | None) -> DType:
    if isinstance(value, bool):
        return dtypes.bool_
    if isinstance(value, int):
        return like if like is not None and like != dtypes.bool_ else dtypes.int32
    return like if like is not None and like.is_float else dtypes.fp32


def constant(value, dt: DType) -> Tensor:
    g = _graph()
    if dt == dtypes.int32 and isinstance(value, int) and not -2 ** 31 <= value < 2 ** 31:
        raise DTypeError(f"the integer {value} does not fit int32, the widest integer Tessera computes in; "
                         f"use a float ({float(value)!r}) or a smaller value")
    op = current_trace().add(g.ConstantOp(float(value), g.TensorType.of((), dt)))
    return _make(op.res, (), dt, label=repr(value))


def dim_value(x, dt: DType = dtypes.int32) -> Tensor:
    """A dim taken at run time, or a `DimExpr` of such dims (`n - m`), as a rank-0 tensor of `dt`:
    a `graph.dim_size` per dim, cast to `dt` before it is scaled and summed (a float sum of large
    dims does not wrap as an int32 one would), terms of a negative coefficient subtracted (the
    form a mask's limit is read in, `masks._linear`)."""
    g = _graph()
    expr = DimExpr.of(x)

    def size(name: str, coef: int) -> Tensor:
        v = _make(current_trace().add(g.DimSizeOp(name)).res, (), dtypes.int32, name)
        v = v if dt == dtypes.int32 else cast(v, dt)
        return v if coef == 1 else v * coef

    total, const = None, expr.const
    for name, coef in expr.terms:
        if coef > 0:
            total = size(name, coef) if total is None else total + size(name, coef)
    if total is None:
        total, const = constant(const, dt), 0
    for name, coef in expr.terms:
        if coef < 0:
            total = total - size(name, -coef)
    return total + const if const else total


def _operands(xs: Sequence) -> list[Tensor]:
    """Tensors stay; Python numbers become constants of the tensors' dtype (weak typing, as in PyTorch)."""
    like = None
    for x in xs:
        if isinstance(x, Tensor):
            like = x.dtype if like is None else dtypes.promote(like, x.dtype)
    out = []
    for x in xs:
        if isinstance(x, Tensor):
            out.append(x)
        elif isinstance(x, (bool, int, float, np.bool_, np.number)) and np.ndim(x) == 0:
            x = x.item() if isinstance(x, np.generic) else x
            out.append(constant(x, _scalar_dtype(x, like)))
        elif is_dynamic(x) or isinstance(x, DimExpr):   # dims the compile takes at run time, and sums of them
            out.append(dim_value(x, _scalar_dtype(0, like)))
        else:
            raise ArgumentKindError(f"tessera ops take traced Tensors and Python numbers, got {_kind(x)}")
    return out


def _kind(x) -> str:
    """What a value the ops cannot take is, for an error message."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {type(x).__name__} of shape {tuple(x.shape)} (arrays are passed as arguments, not captured)"
    return f"a {type(x).__name__} ({x!r:.40})"


def _broadcast(xs: Sequence[Tensor], what: str) -> tuple:
    g = _graph()
    trace = current_trace()
    try:
        return g.broadcast_shapes([x.dims for x in xs], trace.bindings, what)
    except DynamicDim:   # two dims compared whose values the compile does not have
        raise
    except Exception as e:  # VerifyException from the shared broadcasting rule
        names = ", ".join(f"{_label(x)} {_show(x)}" for x in xs)
        raise ShapeError(f"{what}: shapes do not broadcast: {names}") from e


#: ops torch refuses on bool operands, with what it says to use instead
_NOT_ON_BOOL = {"neg": "to invert a mask use ~x or tsr.logical_not(x)",
                "sub": "use tsr.ne(a, b) (exclusive or) or cast to int32 first",
                "floor_divide": "cast to int32 first", "remainder": "cast to int32 first", "pow": "cast to int32 first"}


def elementwise(kind: str, *xs) -> Tensor:
    g = _graph()
    if kind == "pow" and isinstance(xs[1], (int, np.integer)) and not isinstance(xs[1], bool) and xs[1] < 0 \
            and isinstance(xs[0], Tensor) and not xs[0].dtype.is_float:
        raise DTypeError(f"pow: {xs[0].dtype} {_label(xs[0])} ** {xs[1]}: integers to negative integer powers are "
                         f"not allowed (as in torch); cast to a float type first")
    operands = _operands(xs)
    entry = g.ELEMENTWISE[kind]
    if kind == "where" and operands[0].dtype != dtypes.bool_:
        raise DTypeError(f"where: the condition must be bool, got {operands[0].dtype}")
    if kind in _NOT_ON_BOOL and all(x.dtype == dtypes.bool_ for x in operands):
        names = " and ".join(f"{_label(x)}" for x in operands)
        raise DTypeError(f"{kind} of bool {names} is not supported (as in torch): {_NOT_ON_BOOL[kind]}")
    for x in operands:
        if x.dtype.is_float and x.dtype.bits == 8:
            raise DTypeError(f"{kind} of {x.dtype} {_label(x)}: fp8 is a storage type (torch has no arithmetic "
                             f"on it either); cast to a wider float first with .to(tsr.fp32)")
    dims = _broadcast(operands, kind)
    dt = g.elementwise_result_dtype(entry, [x.dtype for x in operands])
    op = current_trace().add(g.ELEMENTWISE_OPS[kind]([x.value for x in operands], g.TensorType.of(dims, dt)))
    return _make(op.res, dims, dt)


def _unary(kind):
    def op(x):
        return elementwise(kind, x)
    op.__name__ = kind
    op.__doc__ = f"Elementwise {kind}."
    return op


def _binary(kind):
    def op(a, b):
        return elementwise(kind, a, b)
    op.__name__ = kind
    op.__doc__ = f"Elementwise {kind}, with NumPy broadcasting."
    return op


neg, abs, exp, exp2, log, log2, tanh, sqrt, rsqrt, sin, cos, erf, logical_not = (
    _unary(k) for k in ("neg", "abs", "exp", "exp2", "log", "log2", "tanh", "sqrt", "rsqrt", "sin", "cos",
                        "erf", "logical_not"))
add, sub, mul, div, maximum, minimum, pow, lt, le, gt, ge, eq, ne, logical_and, logical_or = (
    _binary(k) for k in ("add", "sub", "mul", "div", "maximum", "minimum", "pow", "lt", "le", "gt", "ge",
                         "eq", "ne", "logical_and", "logical_or"))
multiply, subtract, divide, true_divide = mul, sub, div, div
less, less_equal, greater, greater_equal, equal, not_equal = lt, le, gt, ge, eq, ne


def where(cond, a, b) -> Tensor:
    """`a` where `cond` else `b`, with broadcasting (e.g. a causal mask)."""
    return elementwise("where", cond, a, b)


def _in_fp32(composite):
    """Composites of 16-bit floats compute in fp32 and round once, as PyTorch's kernels do."""
    def wrapper(x, *args, **kwargs):
        if isinstance(x, Tensor) and x.dtype.is_float and x.dtype.bits < 32:
            return cast(composite(cast(x, dtypes.fp32), *args, **kwargs), x.dtype)
        return composite(x, *args, **kwargs)
    wrapper.__name__, wrapper.__doc__, wrapper.__module__ = composite.__name__, composite.__doc__, composite.__module__
    return wrapper


@_in_fp32
def sigmoid(x) -> Tensor:
    """1 / (1 + exp(-x)), as an op of its own: its division, whose denominator is at least 1, may
    then be approximate (one MUFU reciprocal instead of an IEEE division's dozen instructions)."""
    return elementwise("sigmoid", x)


#: the attribute of a graph.maximum / graph.minimum saying where its gradient goes at a tie, when
#: not halved between the operands (`maximum`'s, torch's): "first" (all to the first operand: a
#: clamp's x) or "neither" (relu at 0, whose gradient there is 0 in torch and JAX); of a max / min
#: graph.reduce, "first": all to the first extreme along its axis (`max(x, dim).values`, whose
#: gradient torch sends to the element its indices name), not split among the ties
TIES = "tessera.ties"
#: a max / min graph.reduce's TIES when it reduces the extremes an earlier dim's reduction of the
#: same call took (amax over (0, 1), `x.max()`: one reduction a dim): its gradient splits its
#: ties evenly over the elements of all of them (`autodiff.backward._tie_counts`), as torch's
#: one reduction; a reduction the user chained keeps torch's per-call split
JOINT = "joint"


def _with_ties(y: Tensor, ties: str, op=None) -> Tensor:
    """`y`, a maximum's, minimum's or (`op`) extreme reduction's result, its tie rule set (`TIES`)."""
    from xdsl.dialects.builtin import StringAttr

    op = y.value.owner if op is None else op
    if getattr(op, "name", None) in ("graph.maximum", "graph.minimum", "graph.reduce"):
        op.attributes[TIES] = StringAttr(ties)
    return y


def log_softmax_difference(x: Tensor, lse: Tensor) -> Tensor:
    """x - lse, marked as log_softmax's (`graph.LOG_SOFTMAX`)."""
    from xdsl.dialects.builtin import UnitAttr

    d = x - lse
    d.value.owner.attributes[_graph().LOG_SOFTMAX] = UnitAttr()
    return d


def ties_of(op) -> str | None:
    """A maximum's, minimum's or extreme reduction's tie rule (`TIES`), if it has one."""
    return op.attributes[TIES].data if TIES in op.attributes else None


def own_copy(x: Tensor) -> Tensor:
    """`x` as a value of its own (a select of it by itself, which fusion computes into a buffer of
    its own): a result that is another result, or an argument, as a function's result."""
    return where(True, x, x)


def relu(x) -> Tensor:
    """max(x, 0), whose gradient at 0 is 0 (torch's, JAX's)."""
    integer = isinstance(x, Tensor) and not x.dtype.is_float
    return _with_ties(maximum(x, 0 if integer else 0.0), "neither")   # (an int stays an int)


@_in_fp32
def silu(x) -> Tensor:
    return x * sigmoid(x)


@_in_fp32
def gelu(x, approximate: str = "none") -> Tensor:
    """GELU as in torch.nn.functional.gelu: exact (erf) or `approximate="tanh"`."""
    if approximate == "tanh":
        return 0.5 * x * (1.0 + tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return 0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))


def cast(x: Tensor, dt, storage: bool = False) -> Tensor:
    """`x` as dtype `dt`. `storage` (for autodiff's gradients): a float narrowed only where it is
    stored, kept in fp32 by a kernel computing on it (`graph.CastOp.storage`)."""
    g = _graph()
    dt = dtypes.lookup(dt)
    if dt == x.dtype:
        return x
    op = current_trace().add(g.CastOp(x.value, g.TensorType.of(x.dims, dt), storage))
    return _make(op.res, x.dims, dt, _label(x))


def rounded(x: Tensor) -> Tensor:
    """`x` rounded to its own dtype where a kernel computes it (in f32: a float narrower than f32;
    anything else is itself). What a test for the elements equal to a max or min of x must compare:
    the extreme another kernel took was stored in x's dtype, so rounded, while x, computed again,
    was not (argmax of a * b in fp16 found no element equal to the row's max and returned the row's
    length; the gradient of amax(a * b) was 0). Rounding is monotonic: the rounded max is the max
    of the rounded values, and values that round together tie, as in torch's rounded tensor."""
    if not (x.dtype.is_float and x.dtype.bits < 32):
        return x
    return cast(cast(x, dtypes.fp32), x.dtype)


def equals_extreme(x: Tensor, extreme: Tensor) -> Tensor:
    """Where `x` equals `extreme` (a max or min of it, broadcast along the reduced dim), both
    `rounded`: the same elements in a kernel as in the float64 reference."""
    return eq(rounded(x), rounded(extreme))


# --- views ---------------------------------------------------------------------

def permute(x: Tensor, *perm) -> Tensor:
    g = _graph()
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
        perm = tuple(perm[0])
    perm = tuple(_axis(x, p, "permute") for p in perm)
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"permute: {list(perm)} is not a permutation of the {x.ndim} dims of {_label(x)}")
    dims = tuple(x.dims[p] for p in perm)
    op = current_trace().add(g.TransposeOp(x.value, perm, g.TensorType.of(dims, x.dtype)))
    return _view(x, _make(op.res, dims, x.dtype, _label(x)), lambda base: permute(base, *perm))


def transpose(x: Tensor, d0: int, d1: int) -> Tensor:
    perm = list(range(x.ndim))
    a, b = _axis(x, d0, "transpose"), _axis(x, d1, "transpose")
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, *perm)


def reshape(x: Tensor, *shape) -> Tensor:
    g = _graph()
    trace = current_trace()
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if any(is_dynamic(trace.size(d)) for d in x.dims) or any(is_dynamic(s) for s in shape):
        dims = _dynamic_reshape_dims(x, shape)
        op = trace.add(g.ReshapeOp(x.value, g.TensorType.of(dims, x.dtype)))
        return _view(x, _make(op.res, tuple(dims), x.dtype, _label(x)), lambda base: _reshape_dims(base, dims))
    total = math.prod(trace.size(d) for d in x.dims)
    known = math.prod(int(s) for s in shape if int(s) != -1)
    if builtins.sum(1 for s in shape if int(s) == -1) > 1:
        raise ShapeError("reshape: only one dim can be -1")
    sizes = [total // known if int(s) == -1 and known else int(s) for s in shape]
    if math.prod(sizes) != total:
        raise ShapeError(f"reshape: cannot view {_label(x)} {_show(x)} ({total} elements) as {sizes}")
    dims = []
    for i, (s, size) in enumerate(zip(shape, sizes)):
        if isinstance(s, SymInt) and s.name:
            dims.append(s.name)
        elif i < x.ndim and trace.size(x.dims[i]) == size and isinstance(x.dims[i], str):
            dims.append(x.dims[i])
        else:
            dims.append(size)
    op = trace.add(g.ReshapeOp(x.value, g.TensorType.of(dims, x.dtype)))
    return _view(x, _make(op.res, tuple(dims), x.dtype, _label(x)), lambda base: _reshape_dims(base, dims))


def _dynamic_reshape_dims(x: Tensor, shape) -> list:
    """The dims of a reshape of `x` where a dim is taken at run time: each such dim stays whole
    and in order (`q.reshape(t, hk, h // hk, d)`, `x.reshape(-1, d)` with T dynamic: a -1 can stand
    for one), and the static dims between two of them regroup among themselves. Any other
    reshape that could hold (merging a dynamic dim with another, moving static dims across one)
    needs the value: `DynamicDim`, and the function compiles that dim as a constant; one that no
    value makes hold is a ShapeError."""
    trace = current_trace()
    sizes = [s.name if is_dynamic(s) else s for s in (trace.size(d) for d in x.dims)]
    have = [s for s in sizes if isinstance(s, str)]
    want = [s.name if is_dynamic(s) else int(s) for s in shape]
    holes = [i for i, s in enumerate(want) if s == -1]
    if len(holes) > 1:
        raise ShapeError("reshape: only one dim can be -1")
    named = [s for s in want if isinstance(s, str)]
    guessed = bool(holes) and len(named) == len(have) - 1
    if guessed:   # the -1 may be the dynamic dim the others leave out
        want[holes[0]] = next(n for i, n in enumerate(have) if i >= len(named) or named[i] != n)
    order = [s for s in want if isinstance(s, str)]
    if order != have:
        moved = next((h for h, w in zip(have, order) if h != w), (have + order)[min(len(have), len(order))])
        raise _needs_value(x, shape, moved)
    runs = []
    for k, (old_run, new_run) in enumerate(zip(_static_runs(sizes), _static_runs(want))):
        total, known = math.prod(old_run), math.prod(n for n in new_run if n != -1)
        new_run = [total // known if n == -1 and known else n for n in new_run]
        if math.prod(new_run) != total:
            static = math.prod(n for n in sizes if isinstance(n, int))
            fixed = math.prod(n for n in shape if not is_dynamic(n) and int(n) != -1)
            if guessed or (fixed and static % fixed == 0 if holes else static == fixed):
                raise _needs_value(x, shape, have[min(k, len(have) - 1)])
            raise ShapeError(f"reshape: cannot view {_label(x)} {_show(x)} as {_shown_shape(shape)}: its static dims "
                             f"hold {static} elements for each value of {', '.join(have)}, the new shape's {fixed}")
        runs.append(new_run)
    filled = iter(n for run in runs for n in run)
    dims = [s if isinstance(s, str) else next(filled) for s in want]
    return [s.name if isinstance(s, SymInt) and s.name and d == int(s) else d for s, d in zip(shape, dims)]


def _static_runs(entries: list) -> list[list[int]]:
    """The runs of static sizes before, between and after the dynamic dims (names) of `entries`."""
    runs: list[list[int]] = [[]]
    for e in entries:
        if isinstance(e, str):
            runs.append([])
        else:
            runs[-1].append(e)
    return runs


def _needs_value(x: Tensor, shape, dim: str) -> DynamicDim:
    return DynamicDim(dim, f"reshape of {_label(x)} {_show(x)} to {_shown_shape(shape)} moves or merges it")


def _shown_shape(shape) -> str:
    return "[" + ", ".join(repr(n) if is_dynamic(n) else str(int(n)) for n in shape) + "]"


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    dim = dim % (x.ndim + 1)
    return _reshape_dims(x, x.dims[:dim] + (1,) + x.dims[dim:])


def _reshape_dims(x: Tensor, dims) -> Tensor:
    g = _graph()
    op = current_trace().add(g.ReshapeOp(x.value, g.TensorType.of(dims, x.dtype)))
    return _view(x, _make(op.res, tuple(dims), x.dtype, _label(x)), lambda base: _reshape_dims(base, dims))


def _view(x: Tensor, view: Tensor, remake) -> Tensor:
    """`view`, registered as a view of `x` that `remake(x)` makes again: a store into `x` reaches
    it, as it reaches a NumPy or PyTorch view."""
    current_trace().note_view(x, view, remake)
    return view


def getitem(x: Tensor, index) -> Tensor:
    """NumPy-style indexing with `None` (new axis), `:`, `...`, ints, ranges, and an int32 tensor
    along the first dim (`gather`)."""
    items = index if isinstance(index, tuple) else (index,)
    items = tuple(int(i) if isinstance(i, np.integer) else i for i in items)   # (x[np.int32(0)] is x[0])
    for i in items:   # an index of a dim taken at run time (x[x.shape[0] - 1]) needs its value
        if is_dynamic(i) or isinstance(i, DimExpr):
            int(i)
    if any(isinstance(i, Tensor) for i in items):
        return _gather_item(x, items)
    if any(isinstance(i, int) or (isinstance(i, slice) and i != slice(None)) for i in items):
        from .torch_ops import index as index_static   # ints and ranges: a window of x
        return _view(x, index_static(x, items), lambda base: index_static(base, items))   # stores reach it
    if builtins.sum(1 for i in items if i is Ellipsis) > 1:
        raise ShapeError("indexing: at most one '...'")
    consumed = builtins.sum(1 for i in items if i is not None and i is not Ellipsis)
    if consumed > x.ndim:
        raise ShapeError(f"indexing: too many indices for {_label(x)} of rank {x.ndim}")
    dims: list = []
    src = 0
    for item in items:
        if item is None:
            dims.append(1)
        elif item is Ellipsis:
            n = x.ndim - consumed
            dims.extend(x.dims[src:src + n])
            src += n
        elif isinstance(item, slice) and item == slice(None):
            dims.append(x.dims[src])
            src += 1
        else:
            raise TesseraError(f"indexing: only None, ':' and '...' are supported, got {item!r}")
    dims.extend(x.dims[src:])
    return x if tuple(dims) == x.dims else _reshape_dims(x, dims)


def _gather_item(x: Tensor, items: tuple) -> Tensor:
    """`x[index]`, `x[index, ...]`, `x[index, :, ...]`: a gather along the first dim."""
    first, rest = items[0], items[1:]
    if not isinstance(first, Tensor) or any(isinstance(i, Tensor) for i in rest):
        raise TesseraError("indexing by a tensor is supported along the first dim only (x[index]); "
                           "move the dim first (x.transpose(...)[index]) and back")
    if any(i is not Ellipsis and i != slice(None) for i in rest):
        raise TesseraError(f"indexing {_label(x)} by a tensor: only ':' and '...' may follow the index; "
                           f"index the result further")
    return gather(x, first)


def gather(x: Tensor, index: Tensor) -> Tensor:
    """`x[index]`: rows of `x` picked by the int32 tensor `index` ([*index.shape, *x.shape[1:]]).
    An index outside [0, x.shape[0]) reads zeros (`graph.GatherOp`)."""
    g = _graph()
    index = _operands([index])[0] if not isinstance(index, Tensor) else index
    if index.dtype != dtypes.int32:
        hint = " (a bool mask selects a data-dependent number of rows, which Tessera does not trace)" \
            if index.dtype == dtypes.bool_ else ""
        raise TesseraError(f"indexing {_label(x)} by a tensor: the index must be int32, got {index.dtype.name}{hint}")
    if x.ndim < 1:
        raise ShapeError(f"indexing {_label(x)}: a scalar has no rows to pick")
    dims = (*index.dims, *x.dims[1:])
    op = current_trace().add(g.GatherOp(x.value, index.value, g.TensorType.of(dims, x.dtype)))
    return _make(op.res, dims, x.dtype, _label(x))


def setitem(x: Tensor, index, value) -> None:
    """`x[index] = value`, as in NumPy: every later read of `x` (and of the views taken of it)
    sees the store. In a @kernel a store into an argument makes it an output (`C[:] = ...`);
    anywhere else the store changes the traced value only (a @function returns its results).
    The value broadcasts to the indexed part; a partial store (`x[0] = v`, `x[:, 2:5] = v`)
    becomes `where(in the part, v, x)`."""
    trace = current_trace()
    parent = trace.view_parent.get(id(x))
    if parent is not None:
        raise TesseraError(f"store into a view of {_label(parent)} (a transpose, reshape, window or [None] of it): "
                           f"store into {_label(parent)} itself (for x[i] += y, which stores into the window "
                           f"x[i] first, write x[i] = x[i] + y)")
    value = _operands([value])[0] if not isinstance(value, Tensor) else value
    region = _store_region(x, index)
    stored = cast(_placed(x, region, value), x.dtype)
    mask = _region_mask(x, region)
    trace.rebind(x, stored if mask is None else elementwise("where", mask, stored, x))
    name = getattr(x, "argument", None)
    if name is not None:
        trace.stored[name] = x


def _store_region(x: Tensor, index) -> list:
    """Per dim of `x`, what a store index selects: slice(None) (all of it), an int, or a
    (start, stop) range. Supports ints, unit-step slices and one '...'."""
    items = list(index) if isinstance(index, tuple) else [index]
    if builtins.sum(1 for i in items if i is Ellipsis) > 1:
        raise ShapeError("store: at most one '...' in the index")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (x.ndim - len(items) + 1)
    if len(items) > x.ndim:
        raise ShapeError(f"store into {_label(x)} {_show(x)}: {len(items)} indices for rank {x.ndim}")
    items += [slice(None)] * (x.ndim - len(items))
    region = []
    for axis, item in enumerate(items):
        if item == slice(None):   # the whole dim, whatever its size (a dynamic one's too)
            region.append(slice(None))
            continue
        size = current_trace().size(x.dims[axis])
        dim = _dim_str(x.dims[axis], current_trace())
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, (int, np.integer, slice)):
            raise TesseraError(f"store into {_label(x)}: index {item!r} of dim {axis} ({dim}) is not supported; "
                               f"use ints, unit-step slices and '...'")
        if not isinstance(item, slice):
            if not -size <= item < size:
                raise ShapeError(f"store into {_label(x)}: index {item} is out of range for dim {axis} ({dim})")
            region.append(int(item) % size)
            continue
        start, stop, step = item.indices(size)
        if step != 1:
            raise TesseraError(f"store into {_label(x)}: slice {item.start}:{item.stop}:{item.step} of dim {axis} "
                               f"({dim}) has a step; only unit-step slices can be stored to")
        region.append(slice(None) if (start, stop) == (0, size) else (start, max(start, stop)))
    return region


def _placed(x: Tensor, region: list, value: Tensor) -> Tensor:
    """`value` broadcast (NumPy's rule) to the shape `x[region]` has, as a tensor of `x`'s rank:
    an int index's dim kept as size 1. Inside a part of a dim, the value must be constant along
    it (size 1): placing a varying value at an offset needs a shift no op expresses."""
    trace = current_trace()
    kept = [axis for axis, r in enumerate(region) if not isinstance(r, int)]
    sizes = {axis: (trace.size(x.dims[axis]) if r == slice(None) else r[1] - r[0])
             for axis, r in enumerate(region) if not isinstance(r, int)}
    if value.ndim > len(kept):
        raise ShapeError(f"store into {_label(x)} {_show(x)}: value {_show(value)} has more dims than the "
                         f"part stored to")
    leading = len(kept) - value.ndim
    dims: list = [1] * x.ndim
    for i, d in enumerate(value.dims):
        axis = kept[leading + i]
        size = trace.size(d)
        if size not in (1, sizes[axis]):
            raise ShapeError(f"store into {_label(x)} {_show(x)}: value {_show(value)} does not broadcast to "
                             f"the {sizes[axis]} elements of dim {axis} ({_dim_str(x.dims[axis], trace)}) stored to")
        if size != 1 and region[axis] != slice(None):
            raise TesseraError(f"store into {_label(x)}: the value varies along dim {axis} "
                               f"({_dim_str(x.dims[axis], trace)}) but fills only part of it; store a value of "
                               f"size 1 there, or a whole dim")
        dims[axis] = d
    placed = value if tuple(dims) == value.dims else _reshape_dims(value, dims)
    whole = all(r == slice(None) for r in region)
    if whole and [trace.size(d) for d in dims] != [trace.size(d) for d in x.dims]:   # a broadcast value
        return elementwise("where", constant(True, dtypes.bool_), placed, x)
    return placed


def _region_mask(x: Tensor, region: list) -> Tensor | None:
    """The bool tensor that holds where `region` lies in `x` (broadcast over the whole dims), or
    None for all of `x`."""
    mask = None
    for axis, r in enumerate(region):
        if r == slice(None):
            continue
        positions = arange(x.shape[axis])
        inside = eq(positions, r) if isinstance(r, int) else logical_and(ge(positions, r[0]), lt(positions, r[1]))
        shaped = _reshape_dims(inside, (1,) * axis + inside.dims + (1,) * (x.ndim - axis - 1))
        mask = shaped if mask is None else logical_and(mask, shaped)
    return mask


# --- matmul and reductions ------------------------------------------------------------

def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Batched matrix product with broadcast batch dims, like torch.matmul for rank >= 2. Of fp8
    operands (a storage type) the product is fp32, as the tensor cores accumulate it, so scales
    apply as ordinary math: `(tsr.matmul(a, b.T) * (sa * sb)).to(tsr.bf16)` (torch._scaled_mm)."""
    g = _graph()
    trace = current_trace()
    for name, x in (("first", a), ("second", b)):
        if not isinstance(x, Tensor):
            raise ArgumentKindError(f"matmul: the {name} operand must be a traced Tensor, got {_kind(x)}")
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"matmul needs rank >= 2 operands: {_label(a)} {_show(a)}, {_label(b)} {_show(b)}")
    ka, kb = a.dims[-1], b.dims[-2]
    if not g.same_dim(ka, kb, trace.bindings):
        raise ShapeError(f"matmul: contracting dims differ: {_label(a)} has {_dim_str(ka, trace)}, "
                         f"{_label(b)} has {_dim_str(kb, trace)}")
    if a.dtype != b.dtype and not (a.dtype in dtypes.FP8 and b.dtype in dtypes.FP8):
        raise DTypeError(f"matmul: operand dtypes differ: {_label(a)} is {a.dtype}, {_label(b)} is {b.dtype}; "
                         f"cast one with .to() (only the two fp8 formats mix, as the tensor cores take them)")
    if not a.dtype.is_float:
        raise DTypeError(f"matmul: operands must be floating point, got {a.dtype}")
    try:
        batch = g.broadcast_shapes([a.dims[:-2], b.dims[:-2]], trace.bindings, "matmul batch dims")
    except DynamicDim:
        raise
    except Exception as e:
        raise ShapeError(f"matmul: batch dims of {_label(a)} {_show(a)} and {_label(b)} {_show(b)} "
                         f"do not broadcast") from e
    if b.ndim == 2 and a.ndim >= 3 and a.dims[-2] == 1:
        # rows of one element each ([..., B, 1, K] @ [K, N], a decode step's h[:, None, :] @ w): one
        # GEMM over the B rows (dropping the unit axis and adding it back are views of the same memory)
        rows = matmul(_reshape_dims(a, (*a.dims[:-2], a.dims[-1])), b)
        return _reshape_dims(rows, (*rows.dims[:-1], 1, rows.dims[-1]))
    # a batched operand whose unit dim a view added ([B, K] -> [B, K, 1]): the GEMM template's tiles
    # read two dims of memory, so it reads a copy of its own
    a, b = (own_copy(x) if x.ndim >= 3 and isinstance(x.value.owner, g.ReshapeOp) and 1 in x.dims[-2:] else x
            for x in (a, b))
    if a.ndim == b.ndim == 2 and a.dtype not in dtypes.FP8 and 1 in (a.dims[0], b.dims[1]):
        # a matrix-vector product ([M, K] @ [K, 1], [1, K] @ [K, N]; a vector made a matrix, v[:, None],
        # is a view a GEMM's tiles cannot read): the products summed, a row or column reduction
        # reading each element once, where a tensor-core tile would be all padding but a row
        return sum(a * transpose(b, 0, 1), -1, keepdim=True) if b.dims[1] == 1 else \
            sum(transpose(a, 0, 1) * b, 0, keepdim=True)
    dims = (*batch, a.dims[-2], b.dims[-1])
    out = dtypes.fp32 if a.dtype in dtypes.FP8 else a.dtype
    op = trace.add(g.MatmulOp(a.value, b.value, g.TensorType.of(dims, out)))
    return _make(op.res, dims, out, "matmul result")


def reduced_axes(x: Tensor, dim, what: str) -> list[int]:
    """The axes a reduction's `dim` names, ascending: one, several, or every one for None or an
    empty tuple (torch's dim=())."""
    every = dim is None or isinstance(dim, (tuple, list)) and not dim
    dims = range(x.ndim) if every else (dim if isinstance(dim, (tuple, list)) else (dim,))
    return sorted({_axis(x, d, what) for d in dims})


def _reduce(x: Tensor, kind: str, dim, keepdim: bool) -> Tensor:
    """One graph.reduce per reduced dim, each keeping its dim; the requested shape is a view at the end.

    A rank-1 input is viewed as one row ([1, N]) first, so every reduction has rows to spread over
    programs; `x.sum()` of any tensor works the same way and ends in a rank-0 view. A sum or mean
    over several dims of a 16-bit float keeps its partial results in fp32, as PyTorch's single
    reduction does (rounding each partial to fp16 cost 2% on a 257-element fp16 sum the fuzzer drew).
    A logsumexp over several dims is one per dim, exactly: lse over (a, b) is lse_a(lse_b(x)).
    """
    g = _graph()
    axes = reduced_axes(x, dim, kind)[::-1]
    if kind in ("mean", "logsumexp") and not x.dtype.is_float:
        raise DTypeError(f"{kind} of {x.dtype} {_label(x)}: cast to a float type first")
    out_dt = dtypes.int32 if x.dtype == dtypes.bool_ and kind not in ("max", "min") else x.dtype   # (torch's any/all)
    final = tuple(d for i, d in enumerate(x.dims) if i not in axes or keepdim)
    final = tuple(1 if i in axes else d for i, d in enumerate(x.dims)) if keepdim else final
    label = f"{kind} of {_label(x)}"
    if x.ndim == 1:
        x, axes = _reshape_dims(x, (1, x.dims[0])), [1]
    partial_dt = dtypes.fp32 if kind in ("sum", "mean") and out_dt.is_float and out_dt.bits < 32 else out_dt
    for i, axis in enumerate(axes):
        dims = x.dims[:axis] + (1,) + x.dims[axis + 1:]
        dt = out_dt if i == len(axes) - 1 else partial_dt
        op = current_trace().add(g.ReduceOp(x.value, kind, axis, True, g.TensorType.of(dims, dt)))
        if i and kind in ("max", "min"):
            _with_ties(x, JOINT, op)   # (its operand is this call's previous dim's extreme)
        x = _make(op.res, dims, dt, label)
    return x if x.dims == final else _reshape_dims(x, final)


def sum(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _reduce(x, "sum", dim, keepdim)


def mean(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _reduce(x, "mean", dim, keepdim)


def amax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _reduce(x, "max", dim, keepdim)


def amin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    return _reduce(x, "min", dim, keepdim)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    g = _graph()
    if not x.dtype.is_float:
        raise DTypeError(f"softmax of {x.dtype} {_label(x)}: cast to a float type first")
    axis = _axis(x, dim, "softmax")
    if x.ndim == 1:  # one row: viewed as [1, N] so the kernel has a row to work on
        return _reshape_dims(softmax(_reshape_dims(x, (1, x.dims[0])), -1), x.dims)
    op = current_trace().add(g.SoftmaxOp(x.value, axis, g.TensorType.of(x.dims, x.dtype)))
    return _make(op.res, x.dims, x.dtype, "softmax result")


def _normalized_last(x: Tensor, normalized_shape, what: str) -> None:
    if not x.dtype.is_float:
        raise DTypeError(f"{what} of {x.dtype} {_label(x)}: cast to a float type first")
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, Dynamic)) else tuple(normalized_shape)
    size = current_trace().size(x.dims[-1])
    if len(shape) != 1 or not _same_size(shape[0], size):
        raise ShapeError(f"{what}: normalized_shape {list(shape)} must be the last dim of {_label(x)} "
                         f"{_show(x)} (normalizing over several dims is not supported)")


def _same_size(a, b) -> bool:
    """Whether two sizes are one: numbers equal, or dims taken at run time of one name (`x.shape[-1]`
    of a dim that varies is such a dim, not a number)."""
    if isinstance(a, Dynamic) or isinstance(b, Dynamic):
        return isinstance(a, Dynamic) and isinstance(b, Dynamic) and a.name == b.name
    return int(a) == int(b)


def _param(p, x: Tensor, what: str):
    if p is None:
        return None
    if not isinstance(p, Tensor) or p.ndim != 1:
        raise ShapeError(f"{what}: weight and bias must be rank-1 tensors over the last dim")
    if current_trace().size(p.dims[0]) != current_trace().size(x.dims[-1]):
        raise ShapeError(f"{what}: {_label(p)} {_show(p)} does not match the last dim of {_label(x)} {_show(x)}")
    return p.value


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.layer_norm over the last dim."""
    g = _graph()
    _normalized_last(x, normalized_shape, "layer_norm")
    op = current_trace().add(g.LayerNormOp(x.value, _param(weight, x, "layer_norm"), _param(bias, x, "layer_norm"),
                                           eps, g.TensorType.of(x.dims, x.dtype)))
    return _make(op.res, x.dims, x.dtype, "layer_norm result")


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """torch.nn.functional.rms_norm over the last dim. eps=None means torch's default: the machine
    epsilon of the type it computes in, fp32 for every Tessera dtype (fp16 and bf16 inputs too: their
    own epsilons, 1e-3 and 8e-3, would swamp the mean square of small inputs)."""
    g = _graph()
    _normalized_last(x, normalized_shape, "rms_norm")
    if eps is None:
        eps = float(np.finfo(np.float32).eps)
    op = current_trace().add(g.RmsNormOp(x.value, _param(weight, x, "rms_norm"), eps,
                                         g.TensorType.of(x.dims, x.dtype)))
    return _make(op.res, x.dims, x.dtype, "rms_norm result")


def norm_statistic(x: Tensor, kind: str, eps: float, centered: bool) -> Tensor:
    """A norm's row `mean` or `rstd` over the last dim, fp32 with that dim kept (graph.NormStatisticOp):
    what a norm's forward saves for its backward."""
    g = _graph()
    dims = (*x.dims[:-1], 1)
    op = current_trace().add(g.NormStatisticOp(x.value, kind, eps, centered, g.TensorType.of(dims, dtypes.fp32)))
    return _make(op.res, dims, dtypes.fp32, f"norm {kind}")


def arange(n) -> Tensor:
    """`[0, ..., n-1]` as int32; `n` is usually a symbolic dim such as `q.shape[-2]`."""
    g = _graph()
    dim = n.name if (isinstance(n, SymInt) and n.name) or is_dynamic(n) else int(n)   # (a dynamic dim: by name)
    op = current_trace().add(g.ArangeOp(g.TensorType.of((dim,), dtypes.int32)))
    return _make(op.res, (dim,), dtypes.int32, "arange")


from .torch_ops import (  # noqa: E402  (PyTorch's ops, built from the primitives above)
    ValuesIndices, argmax, argmin, cat, clamp, clip, concat, einsum, expand, flatten, floor_divide, log_softmax,
    logsumexp, masked_fill, mT, remainder, stack, std, std_mean, tril, triu, var, var_mean,
)
