"""`tessera.distributed.shard`: a Tessera function run on shards over a device mesh.

    mesh = DeviceMesh("cuda", (2,), ("tp",))
    mlp_tp = shard(mlp, mesh, {"F": "tp"})        # the hidden dim F split over axis tp
    x, w1, b1, w2 = mlp_tp.local(x, w1, b1, w2)   # this rank's shards of whole tensors
    y = mlp_tp(x, w1, b1, w2)                     # the whole y on every rank

Each rank runs the function on its shards (compiled for the local sizes like any call), then the
communication the math needs follows from `placement.propagate` on the function's Graph IR: a
result that is a partial sum over mesh axes is all-reduced over them. Under torch autograd the
same pass over the backward graph says which gradients are partial sums, and those are
all-reduced in the backward: a replicated input of sharded math (the MLP's x), a replicated
weight under data parallelism (`{"N": "dp"}`: its gradient sums over the batch shards).

The collectives are torch.distributed's on the mesh's process groups, issued on the caller's
current stream after the Tessera kernels (which run on it too). A result that is sharded stays
the rank's shard (the next sharded function takes it as it is, as Megatron-LM's layers do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ArgumentKindError, ShapeError, TesseraError
from ..frontend.function import Function
from .mesh import DeviceMesh


#: the fewest rows a chunk of an overlapped call gets: smaller GEMMs lose more to their tails
#: than hiding the collective gains
MIN_CHUNK_ROWS = 512


@dataclass(frozen=True)
class _Plan:
    """The communication of one call signature: per result, the mesh axes it is all-reduced over
    (none: it is whole, or sharded, already); per float argument, its gradient's (filled on the
    first backward); and the overlap: (dim name, chunks, per result the index of that dim) when
    the call runs in chunks along a dim the function is independent along, each chunk's
    all-reduce overlapping the next chunk's kernels, else None."""

    results: tuple[tuple[str, ...], ...]
    grads: dict
    overlap: tuple[str, int, tuple[int, ...]] | None = None

    def describe(self, name: str) -> str:
        """The schedule in words (the sharded function's compile report)."""
        lines = []
        for i, axes in enumerate(self.results):
            if not axes:
                lines.append(f"{name} result {i}: no communication")
            elif self.overlap:
                dim, chunks, _ = self.overlap
                lines.append(f"{name} result {i}: all-reduce over {', '.join(axes)} in {chunks} chunks along {dim}, "
                             f"each chunk's all-reduce overlapping the next chunk's kernels")
            else:
                lines.append(f"{name} result {i}: all-reduce over {', '.join(axes)} after the kernels")
        grads = [f"{n} (over {', '.join(a)})" for n, a in self.grads.items() if a]
        if grads:
            lines.append(f"{name} backward: all-reduce of the gradients of {', '.join(grads)}")
        return "\n".join(lines)


class ShardedFunction:
    """`fn` over `mesh` with the dims named in `dims` split over the mesh axes they map to."""

    def __init__(self, fn: Function, mesh: DeviceMesh, dims: dict[str, str], chunks: int = 1):
        if not isinstance(fn, Function):
            raise TesseraError(f"shard takes a @tessera.function, got {type(fn).__name__}")
        named = {d for spec in fn.annotations.values() for d in spec.dims if isinstance(d, str)}
        for dim, axis in dims.items():
            mesh.size(axis)   # the axis exists
            if dim not in named:
                raise TesseraError(f"shard of {fn.name}: no argument of it has a dim named {dim!r} (its annotations "
                                   f"name {', '.join(sorted(named)) or 'no dims'})")
        self.fn, self.mesh, self.dims, self.chunks = fn, mesh, dict(dims), chunks
        self.name = fn.name
        self._plans: dict[tuple, _Plan] = {}

    def local(self, *args) -> list:
        """This rank's shards of whole-tensor arguments: each dim named in `dims` cut into equal
        parts along its mesh axis (a ShapeError naming the dim and argument when it does not
        divide); other arguments as they are."""
        out = []
        for name, x in zip(self.fn.signature.parameters, args):
            spec = self.fn.annotations.get(name)
            if spec is None or not hasattr(x, "shape"):
                out.append(x)
                continue
            for i, d in enumerate(spec.dims):
                if d in self.dims:
                    axis = self.dims[d]
                    n, size = self.mesh.size(axis), x.shape[i]
                    if size % n:
                        raise ShapeError(f"shard of {self.name}: dim {d}={size} of argument {name!r} does not divide "
                                         f"over mesh axis {axis!r} of {n} ranks; pad it to a multiple of {n}")
                    part = size // n
                    x = x.narrow(i, self.mesh.rank(axis) * part, part)
            out.append(x.contiguous())
        return out

    def __call__(self, *args):
        import torch

        tensors, constants = self.fn._split_args(args)
        for name, x in tensors:
            if not isinstance(x, torch.Tensor):
                raise ArgumentKindError(f"shard of {self.name}: argument {name!r} is a {type(x).__name__}; a sharded "
                                        f"function takes torch tensors (its collectives are torch.distributed's)")
        plan = self._plan(tensors, constants)
        training = torch.is_grad_enabled() and any(x.requires_grad for _, x in tensors)
        if training:
            grads = self._gradient_axes(plan, tensors, constants)
            args = [_ReduceGrad.apply(a, self._groups(grads[n])) if grads.get(n) and getattr(a, "requires_grad", False)
                    else a for n, a in zip(self.fn.signature.parameters, args)]
        if plan.overlap:
            return self._overlapped(plan, args, training)
        results = self.fn(*args)
        many = isinstance(results, tuple)
        reduce = _AllReduce.apply if training else _all_reduce   # a result of a plain call is ours to overwrite
        results = [reduce(r, self._groups(axes)) if axes else r
                   for r, axes in zip(results if many else (results,), plan.results)]
        return tuple(results) if many else results[0]

    def _overlapped(self, plan: _Plan, args, training: bool):
        """The call in chunks along the plan's dim: each chunk's kernels, then its results'
        all-reduces issued asynchronously (NCCL's stream waits for the kernels, the next chunk's
        kernels do not wait for it), all waited for before the chunks are joined."""
        import torch

        dim, chunks, result_dims = plan.overlap
        pending: list = []
        parts: list[list] = []
        for i in range(chunks):
            results = self.fn(*self._chunk(args, dim, i, chunks))
            results = results if isinstance(results, tuple) else (results,)
            parts.append([_AllReduceAsync.apply(r, self._groups(axes), pending) if axes else r
                          for r, axes in zip(results, plan.results)])
        for work in pending:
            work.wait()
        joined = [torch.cat([p[j] for p in parts], dim=d) for j, d in enumerate(result_dims)]
        return tuple(joined) if len(joined) > 1 else joined[0]

    def _chunk(self, args, dim: str, index: int, chunks: int) -> list:
        out = []
        for name, x in zip(self.fn.signature.parameters, args):
            spec = self.fn.annotations.get(name)
            if spec is not None and dim in spec.dims and hasattr(x, "narrow"):
                axis = spec.dims.index(dim)
                part = x.shape[axis] // chunks
                x = x.narrow(axis, index * part, part)
            out.append(x)
        return out

    def report(self, *args) -> str:
        """What a call with these arguments communicates, and when (module doc)."""
        tensors, constants = self.fn._split_args(args)
        plan = self._plan(tensors, constants)
        return plan.describe(self.name)

    def placements(self, *args):
        """The placement (`placement.Placement`) of each result for a call with these arguments."""
        from . import placement

        tensors, constants = self.fn._split_args(args)
        return placement.propagate(self._trace(tensors, constants)[0], self.dims)

    def _groups(self, axes: Sequence[str]) -> tuple:
        return tuple(self.mesh.group(a) for a in axes)

    def _key(self, tensors, constants) -> tuple:
        return tuple((n, tuple(x.shape), str(x.dtype)) for n, x in tensors), tuple(sorted(constants.items()))

    def _trace(self, tensors, constants):
        _, specs = self.fn.arg_specs(tensors)
        return self.fn.trace(specs, constants), specs

    def _plan(self, tensors, constants) -> _Plan:
        key = self._key(tensors, constants)
        plan = self._plans.get(key)
        if plan is None:
            from . import placement

            module, _ = self._trace(tensors, constants)
            results = tuple(tuple(sorted(p.partial)) for p in placement.propagate(module, self.dims))
            plan = self._plans[key] = _Plan(results, {}, self._overlap(module, results, tensors))
        return plan

    def _overlap(self, module, results, tensors):
        """(dim, chunks, per result that dim's index) for an overlapped call: when some result is
        a partial sum over one mesh axis, and a dim every result has, along which the function is
        independent (`placement.independent_dims`), splits into `chunks` equal parts of at least
        MIN_CHUNK_ROWS (the largest such dim); else None."""
        from ..ir import graph as g
        from . import placement

        if self.chunks < 2 or not any(results) or any(len(axes) > 1 for axes in results):
            return None
        (f,) = [op for op in module.ops if op.name == "func.func"]
        shapes = [g.tensor_type(v).shape for v in f.body.block.last_op.operands]
        sizes = {d: int(x.shape[i]) for (n, x) in tensors for i, d in
                 enumerate(self.fn.annotations[n].dims if n in self.fn.annotations else ()) if isinstance(d, str)}
        candidates = [d for d in placement.independent_dims(module) if all(d in s for s in shapes)
                      and d in sizes and sizes[d] % self.chunks == 0 and sizes[d] // self.chunks >= MIN_CHUNK_ROWS]
        if not candidates:
            return None
        dim = max(candidates, key=sizes.__getitem__)
        return dim, self.chunks, tuple(list(s).index(dim) for s in shapes)

    def _gradient_axes(self, plan: _Plan, tensors, constants) -> dict[str, tuple[str, ...]]:
        """Per float argument, the mesh axes its gradient is a partial sum over."""
        if not plan.grads:
            _, specs = self.fn.arg_specs(tensors)
            for name, p in gradient_placements(self.fn, specs, constants, self.dims).items():
                plan.grads[name] = tuple(sorted(p.partial))
        return plan.grads


def gradient_placements(fn: Function, specs, constants: dict, dims: dict[str, str]) -> dict:
    """Per float argument of `fn` (by name), its gradient's placement: `placement.propagate` on
    the backward graph, whose cotangents are placed as the results are once reduced (whole, or
    sharded by their dims' names)."""
    from ..autodiff.api import _vjp_function
    from ..frontend.trace import ArgSpec
    from ..ir import graph as g
    from . import placement

    (f,) = [op for op in fn.trace(specs, constants).ops if op.name == "func.func"]
    bindings = {k: v.value.data for k, v in f.attributes["tessera.dims"].data.items()}
    types = [g.tensor_type(v) for v in f.body.block.last_op.operands]
    floats = tuple(i for i, t in enumerate(types) if t.dtype.is_float)
    derivative = _vjp_function(fn, floats, 0)
    cotangents = [ArgSpec(name, tuple(g.dim_value(d, bindings) for d in types[i].shape), types[i].dtype,
                          tuple(types[i].shape)) for name, i in zip(derivative.cotangent_names, floats)]
    backward = derivative.trace([*specs, *cotangents], constants)
    wrt = [s.name for s in specs if s.dtype.is_float]
    return dict(zip(wrt, placement.propagate(backward, dims)))


def shard(fn: Function, mesh: DeviceMesh, dims: dict[str, str], chunks: int = 1) -> ShardedFunction:
    """`fn` run on shards over `mesh`: each dim named in `dims` split over the mesh axis it maps
    to, the communication derived from the function's math (module doc). With `chunks` > 1, a
    partial result's all-reduce overlaps the kernels of the call split into that many chunks,
    where the function allows (`ShardedFunction.report` says). Off by default: on 2 H200s a
    SwiGLU MLP in 4 chunks of 2048 tokens took 2.77 ms against 2.50 unsplit (its all-reduce:
    0.31 ms), the smaller GEMMs losing more than the overlap hid (bench/tensor_parallel.py)."""
    return ShardedFunction(fn, mesh, dims, chunks)


def _all_reduce(x, groups: tuple):
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _autograd():
    import torch
    import torch.distributed as dist

    class AllReduce(torch.autograd.Function):
        """Sums a partial result over the ranks; its gradient is each rank's own (Megatron's g)."""

        @staticmethod
        def forward(ctx, x, groups):
            return _all_reduce(x.clone(), groups)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class AllReduceAsync(torch.autograd.Function):
        """AllReduce issued asynchronously: its work handle joins `pending`, which the caller waits
        for before reading the result (the overlapped call)."""

        @staticmethod
        def forward(ctx, x, groups, pending):
            (group,) = groups
            y = x.clone()
            pending.append(dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group, async_op=True))
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    class ReduceGrad(torch.autograd.Function):
        """The identity, whose backward sums the gradient's partial terms (Megatron's f)."""

        @staticmethod
        def forward(ctx, x, groups):
            ctx.groups = groups
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return _all_reduce(grad.clone(), ctx.groups), None
    return AllReduce, ReduceGrad, AllReduceAsync


class _Lazy:
    """An autograd.Function made on first use, so that importing this module imports no torch."""

    classes: tuple | None = None

    def __init__(self, index: int):
        self.index = index

    def apply(self, *args: Any):
        if _Lazy.classes is None:
            _Lazy.classes = _autograd()
        return _Lazy.classes[self.index].apply(*args)


_AllReduce, _ReduceGrad, _AllReduceAsync = _Lazy(0), _Lazy(1), _Lazy(2)
