"""The collectives a sharded call runs between its segments (`placement.Collective`), on
torch.distributed's process groups and the caller's current stream, with their gradients.

| kind           | forward                               | gradient                            |
|----------------|---------------------------------------|-------------------------------------|
| all_reduce     | sum over the ranks                    | the identity (Megatron-LM's g)      |
| reduce_scatter | sum, each rank keeping its rows       | all-gather                          |
| all_gather     | every rank's rows, concatenated       | reduce-scatter, or the own rows     |
| split          | the own rows (no communication)       | all-gather                          |
| enter          | the identity                          | all-reduce (Megatron-LM's f)        |

An all-gather's gradient is a reduce-scatter where every use of the gathered value enters
sharded math (its gradient is a partial sum), else the own rows of a replicated gradient
(`placement.Cut.grad`). Rows are along any dim: NCCL's reduce-scatter and all-gather work on
the leading one, so another dim moves there and back (a copy unless the dims before it are 1).
"""
from __future__ import annotations

from typing import Any


def run(x, kind: str, dim: int | None, groups: tuple, in_place: bool = False):
    """The forward of one collective on `x` (`in_place`: `x` is read by nothing else)."""
    import torch.distributed as dist

    if kind == "all_reduce":
        y = x if in_place else x.clone()
        for group in groups:
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y
    if kind == "enter":
        return x
    (group,) = groups
    if kind == "reduce_scatter":
        return _reduce_scatter(x, dim, group)
    if kind == "all_gather":
        return _all_gather(x, dim, group)
    return _own_rows(x, dim, group)   # split


def _leading(x, dim: int):
    return x.movedim(dim, 0).contiguous()


def _reduce_scatter(x, dim: int, group):
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rows = _leading(x, dim)
    out = rows.new_empty((rows.shape[0] // n, *rows.shape[1:]))
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, rows, op=dist.ReduceOp.SUM,
                                                                                  group=group)
    return out.movedim(0, dim).contiguous()


def _all_gather(x, dim: int, group):
    import torch.distributed as dist

    n = dist.get_world_size(group)
    rows = _leading(x, dim)
    out = rows.new_empty((rows.shape[0] * n, *rows.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, rows, group=group)
    return out.movedim(0, dim).contiguous()


def _own_rows(x, dim: int, group):
    import torch.distributed as dist

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    part = x.shape[dim] // n
    return x.narrow(dim, rank * part, part).contiguous()


#: each collective's gradient: (kind, ...) run on the incoming gradient; the all-gather's by its cut
_GRADIENT = {"all_reduce": None, "reduce_scatter": "all_gather", "split": "all_gather", "enter": "all_reduce"}


def gradient_kind(kind: str, grad: str = "split") -> str | None:
    """The collective a `kind` collective's gradient runs (None: the gradient passes as it is); an
    all-gather's is its cut's `grad` ("split": each rank keeps its own part, or "reduce_scatter")."""
    return grad if kind == "all_gather" else _GRADIENT[kind]


def apply(x, kind: str, dim: int | None, groups: tuple, grad: str = "split"):
    """`run` under torch autograd, its gradient as the module doc's table says."""
    return _autograd()[0].apply(x, kind, dim, groups, grad)


def all_reduce_async(x, groups: tuple, pending: list, training: bool):
    """An all-reduce over one group issued asynchronously: its work handle joins `pending`, which
    the caller waits for before reading the result (an overlapped segment's chunks)."""
    if training:
        return _autograd()[1].apply(x, groups, pending)
    return _issue_async(x.clone(), groups, pending)


def _issue_async(y, groups: tuple, pending: list):
    import torch.distributed as dist

    (group,) = groups
    pending.append(dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group, async_op=True))
    return y


_classes: tuple[Any, ...] | None = None


def _autograd():
    """The autograd.Functions, made on first use so that importing this module imports no torch."""
    global _classes
    if _classes is not None:
        return _classes
    import torch

    class Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, kind, dim, groups, grad):
            ctx.kind, ctx.dim, ctx.groups, ctx.grad = kind, dim, groups, grad
            return run(x, kind, dim, groups)

        @staticmethod
        def backward(ctx, dy):
            kind = gradient_kind(ctx.kind, ctx.grad)
            dx = dy if kind is None else run(dy.contiguous(), kind, ctx.dim, ctx.groups)
            return dx, None, None, None, None

    class AllReduceAsync(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, groups, pending):
            return _issue_async(x.clone(), groups, pending)

        @staticmethod
        def backward(ctx, dy):
            return dy, None, None

    _classes = (Collective, AllReduceAsync)
    return _classes
