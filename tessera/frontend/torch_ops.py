"""PyTorch's ops with its names, signatures and semantics, written in terms of the primitives of
`ops.py` (elementwise ops, reductions, views, matmul), so no later level sees them: each fuses
wherever its primitives do (`clamp` and `masked_fill` in a GEMM epilogue or an attention score
modification, `logsumexp` and `log_softmax` as row reductions with their prologue and epilogue).

Where Tessera differs from torch it is for want of a dtype: indices (`argmax`, `x.max(dim)`) are
int32, as Tessera has no int64.
"""
from __future__ import annotations

import builtins
import math
import re
from typing import NamedTuple

from .. import dtypes
from ..errors import DTypeError, ShapeError
from . import ops
from .ops import _axis, _label, _show
from .tensor import Tensor

floor_divide = ops._binary("floor_divide")
remainder = ops._binary("remainder")
floor_divide.__doc__ = "`a // b` as in torch: the quotient rounded down (ints stay ints)."
remainder.__doc__ = "`a % b` as in torch (Python's modulo): the result has the divisor's sign."
floor_divide.__module__ = remainder.__module__ = __name__


# --- elementwise --------------------------------------------------------------------------------

def clamp(x, min=None, max=None) -> Tensor:
    """torch.clamp: `min` and `max` are numbers or tensors (broadcast); either may be None. At a
    bound the gradient goes to x, as torch's (`ops.TIES`)."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    if min is not None:
        x = ops._with_ties(ops.maximum(x, min), "first")
    return x if max is None else ops._with_ties(ops.minimum(x, max), "first")


clip = clamp


def masked_fill(x: Tensor, mask: Tensor, value) -> Tensor:
    """torch.Tensor.masked_fill: `value` where the bool `mask` (broadcast to x) holds, else x;
    the result keeps x's shape and dtype."""
    if not isinstance(mask, Tensor) or mask.dtype != dtypes.bool_:
        raise DTypeError(f"masked_fill: the mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
    filled = ops.where(mask, ops.cast(value, x.dtype) if isinstance(value, Tensor) else value, x)
    if [int(s) for s in filled.shape] != [int(s) for s in x.shape]:
        raise ShapeError(f"masked_fill: mask {_show(mask)} does not broadcast to {_label(x)} {_show(x)}")
    return ops.cast(filled, x.dtype)


def _triangle(x: Tensor, diagonal: int, lower: bool, what: str) -> Tensor:
    """Keeps the elements with col - row <= diagonal (lower) or >= diagonal (upper), zeroes the rest;
    the mask is two aranges, so it costs no memory and fuses into whatever reads the result."""
    if not isinstance(x, Tensor) or x.ndim < 2:
        raise ShapeError(f"{what}: input must have at least 2 dims, got {getattr(x, 'ndim', 0)}")
    rows, cols = ops.arange(x.shape[-2]), ops.arange(x.shape[-1])
    offset = cols[None, :] - rows[:, None]
    keep = offset <= diagonal if lower else offset >= diagonal
    return ops.where(keep, x, False if x.dtype == dtypes.bool_ else 0)


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
    """torch.tril: the lower triangle of the last two dims (on and below `diagonal`)."""
    return _triangle(x, diagonal, True, "tril")


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
    """torch.triu: the upper triangle of the last two dims (on and above `diagonal`)."""
    return _triangle(x, diagonal, False, "triu")


# --- views ---------------------------------------------------------------------------------------

def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """torch.flatten: dims start_dim..end_dim merged into one (a view of the contiguous tensor)."""
    if x.ndim == 0:
        return ops.reshape(x, 1)
    start, end = _axis(x, start_dim, "flatten"), _axis(x, end_dim, "flatten")
    if start > end:
        raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} for {_label(x)} {_show(x)}")
    if start == end:
        return x
    shape = x.shape
    return ops.reshape(x, *shape[:start], math.prod(shape[start:end + 1]), *shape[end + 1:])


def expand(x: Tensor, *sizes) -> Tensor:
    """torch.Tensor.expand: size-1 dims repeated to `sizes` (-1 keeps a dim), new dims in front.
    Nothing is copied: the result is x read through a broadcast, which fuses into its readers."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    if len(sizes) < x.ndim:
        raise ShapeError(f"expand: {list(sizes)} has fewer dims than {_label(x)} {_show(x)}")
    lead = len(sizes) - x.ndim
    have = (1,) * lead + tuple(x.shape)
    grow = []
    for i, (want, size) in enumerate(zip(sizes, have)):
        if int(want) == -1:
            if i < lead:
                raise ShapeError(f"expand: -1 is not allowed for the new leading dim {i}")
            continue
        if int(want) != int(size):
            if int(size) != 1:
                raise ShapeError(f"expand: dim {i - lead} of {_label(x)} {_show(x)} has size {int(size)}, "
                                 f"which cannot expand to {int(want)} (only size-1 dims can)")
            grow.append((i, want))
        elif i < lead:
            grow.append((i, want))
    if not grow:
        return x
    # a bool tensor over the grown dims only (true everywhere) broadcasts x without arithmetic
    cond = None
    for i, want in grow:
        shape = [1] * len(sizes)
        shape[i] = want
        axis = ops.reshape(ops.arange(want), *shape) >= 0   # the view first: then where's kernel has it
        cond = axis if cond is None else ops.logical_and(cond, axis)
    return ops.where(cond, x, x)


def mT(x: Tensor) -> Tensor:
    """torch.Tensor.mT: the last two dims swapped."""
    if x.ndim < 2:
        raise ShapeError(f".mT needs at least 2 dims, {_label(x)} has {x.ndim}")
    return ops.transpose(x, -2, -1)


# --- slicing and concatenation -------------------------------------------------------------------------

def _window(x: Tensor, starts: list[int], sizes: list) -> Tensor:
    """graph.slice: x[starts[d] : starts[d] + sizes[d]] per dim (x itself when that is all of it)."""
    g = ops._graph()
    if all(s == 0 for s in starts) and [int(n) for n in sizes] == [int(n) for n in x.shape]:
        return x
    dims = tuple(x.dims[d] if start == 0 and int(n) == int(x.shape[d]) else int(n)
                 for d, (start, n) in enumerate(zip(starts, sizes)))
    op = ops.current_trace().add(g.SliceOp(x.value, starts, g.TensorType.of(dims, x.dtype)))
    return ops._make(op.res, dims, x.dtype, _label(x))


def _strided(x: Tensor, d: int, start: int, step: int, count: int) -> Tensor:
    """Elements start, start + step, ... (count of them) along dim d: the window of count * step
    elements (padded past the end of x), viewed as [count, step] along d, of which column 0."""
    n = int(x.shape[d])
    span = step * count
    starts = [0] * x.ndim
    starts[d] = start
    sizes = list(x.shape)
    sizes[d] = builtins.min(span, n - start)
    y = _window(x, starts, sizes)
    if span > n - start:   # the padding is never picked: only multiples of step are
        pad_shape = list(x.shape)
        pad_shape[d] = span - (n - start)
        y = cat([y, expand(ops.constant(0, x.dtype), *pad_shape)], d)
    y = ops.reshape(y, *y.shape[:d], count, step, *y.shape[d + 1:])
    column = _window(y, [0] * y.ndim, [*y.shape[:d + 1], 1, *y.shape[d + 2:]])
    return ops._reshape_dims(column, column.dims[:d + 1] + column.dims[d + 2:])


def index(x: Tensor, items: tuple) -> Tensor:
    """x[...] with ints, slices (any positive step) and None/'...' as in torch: a window (graph.slice,
    which kernels read by shifting their tiles), then views dropping the ints' dims and adding None's."""
    if builtins.sum(1 for i in items if i is Ellipsis) > 1:
        raise ShapeError("indexing: at most one '...'")
    consumed = builtins.sum(1 for i in items if i is not None and i is not Ellipsis)
    if consumed > x.ndim:
        raise ShapeError(f"indexing: {consumed} indices for {_label(x)} of rank {x.ndim} {_show(x)}")
    if Ellipsis not in items:
        items = (*items, Ellipsis)
    at = items.index(Ellipsis)
    items = (*items[:at], *[slice(None)] * (x.ndim - consumed), *items[at + 1:])
    starts, sizes, steps, out, d = [], [], [], [], 0
    for item in items:
        if item is None:
            out.append(("new", None))
            continue
        n = int(x.shape[d])
        if isinstance(item, slice):
            start, stop, step = item.indices(n)
            if step <= 0:
                raise ShapeError(f"indexing: step {step} along dim {d} of {_label(x)}: steps must be positive")
            count = len(range(start, stop, step))
            if count == 0:
                raise ShapeError(f"indexing: {item} selects nothing from dim {d} (size {n}) of {_label(x)}")
            out.append(("keep", d))
        elif isinstance(item, int) and not isinstance(item, bool):
            if not -n <= item < n:
                raise ShapeError(f"indexing: index {int(item)} is out of range for dim {d} of {_label(x)} "
                                 f"{_show(x)}")
            start, count, step = int(item) % n, 1, 1
            out.append(("drop", d))
        else:
            raise ShapeError(f"indexing: only ints, slices, None and '...' are supported, got {item!r}")
        starts.append(start)
        sizes.append(x.shape[d] if (start, count, step) == (0, n, 1) else count)
        steps.append(step)
        d += 1
    y = _window(x, [s if k == 1 else 0 for s, k in zip(starts, steps)],
                [n if k == 1 else x.shape[i] for i, (n, k) in enumerate(zip(sizes, steps))])
    for dim, (start, step, count) in enumerate(zip(starts, steps, sizes)):
        if step != 1:
            y = _strided(y, dim, start, step, int(count))
    dims = [1 if kind == "new" else y.dims[d] for kind, d in out if kind != "drop"]
    return y if tuple(dims) == y.dims else ops._reshape_dims(y, dims)


def cat(tensors, dim: int = 0) -> Tensor:
    """torch.cat: the tensors one after another along `dim` (the others equal; dtypes promoted).
    One kernel computes the result, each element read from the input that holds it, and fuses
    with the elementwise ops that read or produce its inputs."""
    g = ops._graph()
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError("cat takes a non-empty sequence of Tensors")
    first = tensors[0]
    axis = _axis(first, dim, "cat")
    dt = first.dtype
    for t in tensors[1:]:
        dt = dtypes.promote(dt, t.dtype)
    for i, t in enumerate(tensors):
        if t.ndim != first.ndim or any(int(a) != int(b) for d, (a, b) in enumerate(zip(t.shape, first.shape))
                                       if d != axis):
            raise ShapeError(f"cat: tensor {i} {_label(t)} {_show(t)} does not match tensor 0 {_label(first)} "
                             f"{_show(first)} in every dim but {dim}")
    if len(tensors) == 1:
        return ops.cast(first, dt)
    size = builtins.sum(int(t.shape[axis]) for t in tensors)
    dims = tuple(size if d == axis else first.dims[d] for d in range(first.ndim))
    values = [ops.cast(t, dt).value for t in tensors]
    op = ops.current_trace().add(g.ConcatOp(values, axis, g.TensorType.of(dims, dt)))
    return ops._make(op.res, dims, dt, "cat result")


concat = concatenate = cat


def stack(tensors, dim: int = 0) -> Tensor:
    """torch.stack: the tensors (all of one shape) along a new dim `dim`."""
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError("stack takes a non-empty sequence of Tensors")
    shapes = {tuple(int(n) for n in t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ShapeError(f"stack: the tensors' shapes differ: {', '.join(_label(t) + ' ' + _show(t) for t in tensors)}")
    if not -tensors[0].ndim - 1 <= dim <= tensors[0].ndim:
        raise ShapeError(f"stack: dim {dim} is out of range for rank-{tensors[0].ndim} tensors")
    return cat([ops.unsqueeze(t, dim) for t in tensors], dim)


# --- reductions ---------------------------------------------------------------------------------

class ValuesIndices(NamedTuple):
    """What `max(x, dim)` / `min(x, dim)` return, as torch's `torch.return_types.max`."""

    values: Tensor
    indices: Tensor


def _arg_extreme(x: Tensor, dim, keepdim: bool, largest: bool) -> Tensor:
    """The index of the first largest (smallest) element along `dim`, as torch: a NaN counts as the
    largest and smallest, so the first NaN's index. Two row reductions: the extreme, then the least
    index where the row holds it. dim=None: the index into the flattened tensor."""
    if dim is None:
        flat = ops.reshape(x, -1)
        out = _arg_extreme(flat, 0, False, largest)
        return ops.reshape(out, *([1] * x.ndim)) if keepdim else out
    axis = _axis(x, dim, "argmax" if largest else "argmin")
    if x.dtype == dtypes.bool_:
        x = ops.cast(x, dtypes.int32)
    extreme = (ops.amax if largest else ops.amin)(x, axis, True)
    hit = ops.logical_or(ops.equals_extreme(x, extreme), ops.ne(x, x))
    n = x.shape[axis]
    index = ops.reshape(ops.arange(n), *[n if i == axis else 1 for i in range(x.ndim)])
    return ops.amin(ops.where(hit, index, int(n)), axis, keepdim)


def argmax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.argmax (indices int32): the first index of the largest element along `dim`."""
    return _arg_extreme(x, dim, keepdim, True)


def argmin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """torch.argmin (indices int32): the first index of the smallest element along `dim`."""
    return _arg_extreme(x, dim, keepdim, False)


def _extreme(x: Tensor, other, dim, keepdim: bool, largest: bool):
    """torch.max / torch.min in their three forms: of everything (a tensor), along `dim` (values
    and indices, `ValuesIndices`), or elementwise against another tensor (`other`)."""
    if isinstance(other, Tensor):
        if dim is not None:
            raise TypeError(f"{'max' if largest else 'min'}(input, other) takes no dim")
        return (ops.maximum if largest else ops.minimum)(x, other)
    if other is not None:
        dim = other
    if dim is None:
        if keepdim:
            raise TypeError(f"{'max' if largest else 'min'}(input) takes no keepdim; give a dim")
        return (ops.amax if largest else ops.amin)(x)
    if isinstance(dim, (tuple, list)):
        raise TypeError(f"{'max' if largest else 'min'}(input, dim) takes one dim (amax/amin take several)")
    values = (ops.amax if largest else ops.amin)(x, dim, keepdim)
    reduce = values.value.owner
    if reduce.name == "graph.reshape":   # (keepdim=False: a view of the reduction's result)
        reduce = reduce.operands[0].owner
    ops._with_ties(values, "first", reduce)   # (its gradient to the element `indices` names, as torch's)
    return ValuesIndices(values, _arg_extreme(x, dim, keepdim, largest))


def max(input: Tensor, dim=None, keepdim: bool = False, *, other=None):
    """torch.max: `max(x)` the largest element; `max(x, dim, keepdim=False)` a (values, indices)
    named tuple; `max(a, b)` with a tensor `b` the elementwise maximum."""
    if isinstance(dim, Tensor):
        dim, other = None, dim
    return _extreme(input, other, dim, keepdim, True)


def min(input: Tensor, dim=None, keepdim: bool = False, *, other=None):
    """torch.min: `min(x)`, `min(x, dim, keepdim=False)` -> (values, indices), or `min(a, b)`."""
    if isinstance(dim, Tensor):
        dim, other = None, dim
    return _extreme(input, other, dim, keepdim, False)


def _count(x: Tensor, dim) -> int:
    return math.prod(int(x.shape[a]) for a in ops.reduced_axes(x, dim, "reduction"))


def _squeezed(r: Tensor, x: Tensor, dim, keepdim: bool) -> Tensor:
    """A reduction `r` of x computed with keepdim=True, viewed without the reduced dims unless
    `keepdim` (the reductions end in a view, so no kernel has a rank-0 result)."""
    if keepdim:
        return r
    axes = ops.reduced_axes(x, dim, "reduction")
    return ops.reshape(r, *[n for i, n in enumerate(r.shape) if i not in axes])


def _var(x: Tensor, dim, correction, mean: Tensor | None = None) -> Tensor:
    """Variance with the reduced dims kept: sum((x - mean)^2) / (N - correction), in two passes
    (the mean, then the squares about it: one kernel over rows, fusion's merge_row_chains), which
    keeps the cancellation of E[x^2] - E[x]^2 out; N - correction <= 0 gives inf or nan, as torch."""
    d = x - (ops.mean(x, dim, True) if mean is None else mean)
    total = ops.sum(d * d, dim, True)
    denominator = builtins.max(_count(x, dim) - int(correction), 0)
    return total / denominator if denominator else total * math.inf


def _reduced_in_fp32(x: Tensor, compute, dim, keepdim: bool, what: str) -> Tensor:
    """`compute(x)` (a reduction with its dims kept) in fp32, rounded once to x's dtype, then viewed
    without the reduced dims: every kernel keeps a dim, so even a reduction of everything runs."""
    if not x.dtype.is_float:
        raise DTypeError(f"{what} of {x.dtype} {_label(x)}: cast to a float type first")
    wide = ops.cast(x, dtypes.fp32) if x.dtype.bits < 32 else x
    return _squeezed(ops.cast(compute(wide), x.dtype), x, dim, keepdim)


def var(x: Tensor, dim=None, *, correction=1, keepdim: bool = False) -> Tensor:
    """torch.var over `dim` (all dims when None); the default correction=1 is Bessel's (unbiased)."""
    return _reduced_in_fp32(x, lambda w: _var(w, dim, correction), dim, keepdim, "var")


def std(x: Tensor, dim=None, *, correction=1, keepdim: bool = False) -> Tensor:
    """torch.std: the square root of `var` (same correction default, 1)."""
    return _reduced_in_fp32(x, lambda w: ops.sqrt(_var(w, dim, correction)), dim, keepdim, "std")


def _with_mean(x: Tensor, compute, dim, correction, keepdim: bool, what: str) -> tuple[Tensor, Tensor]:
    """(compute(var), mean) over `dim` in fp32, each rounded once to x's dtype: torch.var_mean's
    pair, one kernel over rows (the mean is the variance's first statistic, written beside it)."""
    if not x.dtype.is_float:
        raise DTypeError(f"{what} of {x.dtype} {_label(x)}: cast to a float type first")
    wide = ops.cast(x, dtypes.fp32) if x.dtype.bits < 32 else x
    mean = ops.mean(wide, dim, True)
    return tuple(_squeezed(ops.cast(r, x.dtype), x, dim, keepdim)
                 for r in (compute(_var(wide, dim, correction, mean)), mean))


def var_mean(x: Tensor, dim=None, *, correction=1, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """torch.var_mean: (var, mean) over `dim` (all dims when None), Bessel's correction by default."""
    return _with_mean(x, lambda v: v, dim, correction, keepdim, "var_mean")


def std_mean(x: Tensor, dim=None, *, correction=1, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """torch.std_mean: (std, mean) over `dim` (all dims when None), Bessel's correction by default."""
    return _with_mean(x, ops.sqrt, dim, correction, keepdim, "std_mean")


def _logsumexp(x: Tensor, dim) -> Tensor:
    """log(sum(exp(x))) with the reduced dims kept: one `graph.reduce` of kind logsumexp per dim
    (computed about the row max; a row of -inf gives -inf and one with +inf gives inf, as torch)."""
    return ops._reduce(x, "logsumexp", dim, True)


def logsumexp(x: Tensor, dim, keepdim: bool = False) -> Tensor:
    """torch.logsumexp along `dim`: one row reduction per dim, in fp32."""
    return _reduced_in_fp32(x, lambda w: _logsumexp(w, dim), dim, keepdim, "logsumexp")


@ops._in_fp32
def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """torch.log_softmax: x - logsumexp(x) along `dim` (accurate where log(softmax(x)) underflows);
    a row holding +inf is NaN throughout, as torch's (x - inf gave -inf beside it)."""
    if not x.dtype.is_float:
        raise DTypeError(f"log_softmax of {x.dtype} {_label(x)}: cast to a float type first")
    lse = _logsumexp(x, dim)
    return ops.where(ops.eq(lse, math.inf), math.nan, ops.log_softmax_difference(x, lse))


# --- einsum -----------------------------------------------------------------------------------------

def einsum(equation: str, *operands) -> Tensor:
    """torch.einsum for one or two operands (no repeated index within an operand, no '...'):
    indices only one operand has and the output lacks are summed first; with two operands the
    shared indices the output keeps are batch dims, the shared ones it drops are contracted by
    one matmul (several are merged into one dim), and the output is a permutation of the result.
    Where either operand has no free index (a matrix-vector product, a dot) or nothing is
    contracted, it is a broadcast product summed over the contracted indices instead."""
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    inputs, output = _parse_einsum(equation, operands)
    if len(operands) == 1:
        (x,), (spec,) = operands, inputs
        x, spec = _sum_out(x, spec, set(output))
        return _arrange(x, spec, output)
    a, b = operands
    sa, sb = inputs
    a, sa = _sum_out(a, sa, set(output) | set(sb))
    b, sb = _sum_out(b, sb, set(output) | set(sa))
    contracted = [c for c in sa if c in sb and c not in output]
    batch = [c for c in sa if c in sb and c in output]
    free_a = [c for c in sa if c not in sb]
    free_b = [c for c in sb if c not in sa]
    if not (contracted and free_a and free_b):
        # no matrix product: a broadcast product, summed over what is contracted (a row reduction
        # for a matrix-vector product or a dot)
        spec = output + "".join(contracted)
        product = _broadcast_product(a, sa, b, sb, spec)
        return product if not contracted else ops.sum(product, list(range(len(output), len(spec))))
    a = _grouped(a, sa, [batch, free_a, contracted])
    b = _grouped(b, sb, [batch, contracted, free_b])
    sizes = {**dict(zip(sa, operands[0].shape)), **dict(zip(sb, operands[1].shape))}
    product = ops.matmul(a, b)
    spec = batch + free_a + free_b
    want = [sizes[c] for c in spec]
    if [int(n) for n in product.shape] != [int(n) for n in want]:
        product = ops.reshape(product, *want)
    return _arrange(product, spec, output)


def _parse_einsum(equation: str, operands) -> tuple[list[str], str]:
    eq = equation.replace(" ", "")
    if "..." in eq:
        raise ShapeError(f"einsum {equation!r}: '...' is not supported; name every dim")
    lhs, arrow, out = eq.partition("->")
    inputs = lhs.split(",")
    if len(inputs) != len(operands) or len(operands) not in (1, 2):
        raise ShapeError(f"einsum {equation!r}: {len(inputs)} operand specs for {len(operands)} tensors "
                         f"(one or two operands are supported)")
    for i, (spec, x) in enumerate(zip(inputs, operands)):
        if not re.fullmatch(r"[a-zA-Z]*", spec) or len(set(spec)) != len(spec):
            raise ShapeError(f"einsum {equation!r}: operand {i} spec {spec!r} must be distinct letters "
                             f"(diagonals such as 'ii' are not supported)")
        if not isinstance(x, Tensor) or len(spec) != x.ndim:
            raise ShapeError(f"einsum {equation!r}: operand {i} spec {spec!r} has {len(spec)} dims, "
                             f"the tensor {getattr(x, 'ndim', '?')}")
    if not arrow:
        counts = {c: lhs.count(c) for c in set(lhs.replace(",", ""))}
        out = "".join(sorted(c for c, n in counts.items() if n == 1))
    if len(set(out)) != len(out) or any(c not in lhs for c in out):
        raise ShapeError(f"einsum {equation!r}: the output {out!r} must name distinct input indices")
    sizes: dict[str, int] = {}
    for i, (spec, x) in enumerate(zip(inputs, operands)):
        for c, n in zip(spec, x.shape):
            if sizes.setdefault(c, int(n)) != int(n) and int(n) != 1 and sizes[c] != 1:
                raise ShapeError(f"einsum {equation!r}: index {c!r} is {sizes[c]} in one operand and "
                                 f"{int(n)} in operand {i}")
    return [list(s) for s in inputs], out


def _sum_out(x: Tensor, spec: list[str], keep: set[str]) -> tuple[Tensor, list[str]]:
    """Sums the dims whose index nobody else needs."""
    drop = [i for i, c in enumerate(spec) if c not in keep]
    if not drop:
        return x, spec
    return ops.sum(x, drop), [c for c in spec if c in keep]


def _arrange(x: Tensor, spec: list[str], output: str) -> Tensor:
    """x (dims named by `spec`) permuted to the output's order."""
    perm = [spec.index(c) for c in output]
    return x if perm == list(range(len(perm))) else ops.permute(x, *perm)


def _grouped(x: Tensor, spec: list[str], groups: list[list[str]]) -> Tensor:
    """x permuted to batch..., then its two matrix groups each viewed as one dim (a missing group
    is a size-1 dim)."""
    batch, first, second = groups
    x = _arrange(x, spec, "".join(batch + first + second))
    shape = x.shape
    nb, nf = len(batch), len(first)
    rows = math.prod(int(s) for s in shape[nb:nb + nf])
    cols = math.prod(int(s) for s in shape[nb + nf:])
    if nf == 1 and len(second) == 1:
        return x
    return ops.reshape(x, *shape[:nb], shape[nb] if nf == 1 else rows,
                       shape[nb + nf] if len(second) == 1 else cols)


def _broadcast_product(a: Tensor, sa: list[str], b: Tensor, sb: list[str], output: str) -> Tensor:
    """a * b with each viewed over all output indices (size 1 where it lacks one), in output order."""
    def spread(x, spec):
        x = _arrange(x, spec, "".join(c for c in output if c in spec))
        shape = dict(zip([c for c in output if c in spec], x.shape))
        return ops.reshape(x, *[shape.get(c, 1) for c in output])
    return ops.mul(spread(a, sa), spread(b, sb))
