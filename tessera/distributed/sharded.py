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


@dataclass(frozen=True)
class _Plan:
    """The communication of one call signature: per result, the mesh axes it is all-reduced over
    (none: it is whole, or sharded, already); per float argument, its gradient's (filled on the
    first backward)."""

    results: tuple[tuple[str, ...], ...]
    grads: dict


class ShardedFunction:
    """`fn` over `mesh` with the dims named in `dims` split over the mesh axes they map to."""

    def __init__(self, fn: Function, mesh: DeviceMesh, dims: dict[str, str]):
        if not isinstance(fn, Function):
            raise TesseraError(f"shard takes a @tessera.function, got {type(fn).__name__}")
        named = {d for spec in fn.annotations.values() for d in spec.dims if isinstance(d, str)}
        for dim, axis in dims.items():
            mesh.size(axis)   # the axis exists
            if dim not in named:
                raise TesseraError(f"shard of {fn.name}: no argument of it has a dim named {dim!r} (its annotations "
                                   f"name {', '.join(sorted(named)) or 'no dims'})")
        self.fn, self.mesh, self.dims = fn, mesh, dict(dims)
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
        results = self.fn(*args)
        many = isinstance(results, tuple)
        reduce = _AllReduce.apply if training else _all_reduce   # a result of a plain call is ours to overwrite
        results = [reduce(r, self._groups(axes)) if axes else r
                   for r, axes in zip(results if many else (results,), plan.results)]
        return tuple(results) if many else results[0]

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
            plan = self._plans[key] = _Plan(results, {})
        return plan

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


def shard(fn: Function, mesh: DeviceMesh, dims: dict[str, str]) -> ShardedFunction:
    """`fn` run on shards over `mesh`: each dim named in `dims` split over the mesh axis it maps
    to, the communication derived from the function's math (module doc)."""
    return ShardedFunction(fn, mesh, dims)


def _all_reduce(x, groups: tuple):
    import torch.distributed as dist

    for group in groups:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def _autograd():
    import torch

    class AllReduce(torch.autograd.Function):
        """Sums a partial result over the ranks; its gradient is each rank's own (Megatron's g)."""

        @staticmethod
        def forward(ctx, x, groups):
            return _all_reduce(x.clone(), groups)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class ReduceGrad(torch.autograd.Function):
        """The identity, whose backward sums the gradient's partial terms (Megatron's f)."""

        @staticmethod
        def forward(ctx, x, groups):
            ctx.groups = groups
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return _all_reduce(grad.clone(), ctx.groups), None
    return AllReduce, ReduceGrad


class _Lazy:
    """An autograd.Function made on first use, so that importing this module imports no torch."""

    classes: tuple | None = None

    def __init__(self, index: int):
        self.index = index

    def apply(self, *args: Any):
        if _Lazy.classes is None:
            _Lazy.classes = _autograd()
        return _Lazy.classes[self.index].apply(*args)


_AllReduce, _ReduceGrad = _Lazy(0), _Lazy(1)
