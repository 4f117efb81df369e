"""Where a sharded function needs communication: placements propagated through Graph IR.

A sharded function (`tessera.distributed.shard`) names the dims that are split across mesh axes
(`{"F": "tp"}`: every dim named F, in every argument and every value, holds 1/tp of its extent on
each rank). Each rank runs the function on its shards, compiled as usual for the local sizes.
Whether that computes the right thing, and what communication turns its results into the
function's results, follows from the ops: this pass walks the Graph IR once and gives each value
the mesh axes over which it is a *partial sum* (each rank holds one term of the sum over the
ranks of that axis; `Placement.partial`):

- a matmul contracting a sharded dim sums only its rank's slice of the products: partial;
- a sum over a sharded dim likewise; any other reduction over one (max, softmax, norms) needs a
  distributed reduction this pass does not insert, so it is refused;
- linear ops keep partials (negation, casts, views, sums, a matmul or product with a value that
  is not partial, division by one) and add/subtract two partials over the same axes; anything
  else that reads a partial (a nonlinearity, adding a replicated bias) is refused, naming the op
  and the matmul the partial came from: the function must end there (its caller all-reduces);
- an index (arange) over a sharded dim would count from 0 on every rank, and a window (slice,
  concatenation) along one would cut each rank's shard: refused; so is a value with a sharded
  dim twice (a score matrix of a sharded sequence would need ring attention).

A result that is a partial sum gets an all-reduce (or a reduce-scatter, where the caller asks
for it sharded) after the call; the same pass over the backward graph finds the gradients that
are partial sums (a replicated input feeding sharded math; a weight's gradient under data
parallelism), which the backward all-reduces. Attention with its heads sharded needs nothing;
a column- then row-parallel MLP needs one all-reduce of its output and one of its input's
gradient: Megatron-LM's f and g operators, derived rather than placed by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from ..errors import TesseraError
from ..ir import graph as g
from ..ir.provenance import loc_of

#: elementwise ops linear in each operand alone: a partial operand times anything not partial
SCALING = {"mul"}
#: linear in their first operand only (a partial divided by something that is not partial)
SCALING_FIRST = {"div"}
#: sums of their operands: partial only if every operand is, over the same axes
SUMS = {"add", "sub"}
#: one-operand linear ops
LINEAR_UNARY = {"neg"}


class ShardingError(TesseraError):
    """The function's math cannot run on shards as declared (module doc)."""


@dataclass(frozen=True)
class Placement:
    """How a result is spread over the mesh: its sharded dims (by index: the mesh axis each is
    split over) and the mesh axes over which it is a partial sum."""

    sharded: tuple[tuple[int, str], ...]
    partial: frozenset[str]


def propagate(module, dims: dict[str, str]) -> list[Placement]:
    """The placements of the function's results when the dims named in `dims` are split over
    the mesh axes they map to (a ShardingError for math that cannot run so: module doc)."""
    (f,) = [op for op in module.ops if isinstance(op, func.FuncOp)]
    state = _Propagation(f, dims)
    for op in f.body.block.ops:
        state.visit(op)
    ret = f.body.block.last_op
    return [state.placement(v) for v in ret.operands]


class _Propagation:
    def __init__(self, f: func.FuncOp, dims: dict[str, str]):
        self.f, self.dims = f, dims
        self.partial: dict[SSAValue, frozenset[str]] = {}
        self.origin: dict[SSAValue, Operation] = {}   # a partial value -> the op that made it partial
        for arg in f.body.block.args:
            self._check_value(arg, None)

    def placement(self, v: SSAValue) -> Placement:
        shape = g.tensor_type(v).shape
        return Placement(tuple((i, self.dims[d]) for i, d in enumerate(shape) if d in self.dims),
                         self.partial.get(v, frozenset()))

    def axis_of(self, d) -> str | None:
        return self.dims.get(d) if isinstance(d, str) else None

    def visit(self, op: Operation) -> None:
        if isinstance(op, func.ReturnOp) or not op.results:
            if isinstance(op, g.AssertOp) and any(self.partial.get(v) for v in op.operands):
                self._refuse(op, "a device assert reads", op.operands)
            return
        partial = self._rule(op)
        for r in op.results:
            if partial:
                self.partial[r] = partial
                self.origin[r] = self._first_origin(op)
            self._check_value(r, op)

    def _first_origin(self, op: Operation) -> Operation:
        for v in op.operands:
            if v in self.origin:
                return self.origin[v]
        return op

    def _rule(self, op: Operation) -> frozenset[str]:
        ins = [self.partial.get(v, frozenset()) for v in op.operands]
        if isinstance(op, g.MatmulOp):
            if ins[0] and ins[1]:
                self._refuse(op, "a matmul of two partial sums reads", op.operands)
            k_lhs, k_rhs = g.tensor_type(op.lhs).shape[-1], g.tensor_type(op.rhs).shape[-2]
            if self.axis_of(k_lhs) != self.axis_of(k_rhs):
                raise ShardingError(f"{self._where(op)}: the matmul contracts dim {k_lhs} of its left operand "
                                    f"with dim {k_rhs} of its right one, and only one of them is sharded")
            contracted = self.axis_of(k_lhs)
            return ins[0] | ins[1] | ({contracted} if contracted else set())
        if isinstance(op, g.ReduceOp):
            axis = self.axis_of(g.tensor_type(op.input).shape[op.axis.data])
            if (axis or ins[0]) and op.kind.data != "sum":
                what = f"the {op.kind.data} over the sharded dim {g.tensor_type(op.input).shape[op.axis.data]}" \
                    if axis else f"a {op.kind.data}"
                self._refuse(op, f"{what} reads", op.operands, needs=not axis)
            return ins[0] | ({axis} if axis else set())
        if isinstance(op, (g.SoftmaxOp, g.LayerNormOp, g.RmsNormOp)):
            x = g.tensor_type(op.operands[0])
            axes = [op.axis.data] if isinstance(op, g.SoftmaxOp) else [x.rank - 1]
            sharded = [x.shape[a] for a in axes if self.axis_of(x.shape[a])]
            if sharded:
                raise ShardingError(f"{self._where(op)}: {op.name.removeprefix('graph.')} normalizes over the sharded "
                                    f"dim {sharded[0]}, which would need a reduction across the mesh; shard another "
                                    f"dim (heads, batch) or keep {sharded[0]} whole")
            if any(ins):
                self._refuse(op, f"{op.name.removeprefix('graph.')} reads", op.operands)
            return frozenset()
        if isinstance(op, (g.TransposeOp, g.ReshapeOp, g.CastOp)):
            return ins[0]
        if isinstance(op, (g.SliceOp, g.ConcatOp)):
            out = g.tensor_type(op.results[0]).shape
            cut = [d for v in op.operands for d, o in zip(g.tensor_type(v).shape, out) if d != o]
            if any(self.axis_of(d) for d in cut) or any(ins):
                raise ShardingError(f"{self._where(op)}: a {op.name.removeprefix('graph.')} along a sharded dim or of a "
                                    f"partial sum would cut each rank's shard, not the whole tensor")
            return frozenset()
        if isinstance(op, g.ArangeOp):
            (d,) = g.tensor_type(op.res).shape
            if self.axis_of(d):
                raise ShardingError(f"{self._where(op)}: an arange over the sharded dim {d} would count from 0 on "
                                    f"every rank (a mask over a sharded sequence); shard another dim")
            return frozenset()
        if isinstance(op, g.ElementwiseOp):
            return self._elementwise(op, ins)
        if any(ins):
            self._refuse(op, f"{op.name} reads", op.operands)
        return frozenset()

    def _elementwise(self, op: g.ElementwiseOp, ins: list[frozenset[str]]) -> frozenset[str]:
        if not any(ins):
            return frozenset()
        kind = op.kind
        if kind in LINEAR_UNARY:
            return ins[0]
        if kind in SUMS and all(p == ins[0] for p in ins):
            return ins[0]
        if kind in SCALING and sum(bool(p) for p in ins) == 1:
            return ins[0] | ins[1]
        if kind in SCALING_FIRST and ins[0] and not ins[1]:
            return ins[0]
        self._refuse(op, f"{kind} reads", op.operands)

    def _check_value(self, v: SSAValue, op: Operation | None) -> None:
        shape = g.tensor_type(v).shape
        named = [d for d in shape if self.axis_of(d)]
        twice = sorted({d for d in named if named.count(d) > 1})
        if twice:
            raise ShardingError(f"{self._where(op) if op else 'an argument'}: a value with the sharded dim {twice[0]} "
                                f"twice ({list(shape)}) would need every rank's shard of the other (ring attention "
                                f"over a sharded sequence is not supported); shard another dim")
        axes = {self.axis_of(d) for d in named}
        both = sorted(axes & self.partial.get(v, frozenset()))
        if both:
            raise ShardingError(f"{self._where(op)}: a value both sharded over mesh axis {both[0]!r} and a partial "
                                f"sum over it: each rank holds a term for a different shard")

    def _refuse(self, op: Operation, what: str, operands, needs: bool = True) -> None:
        partial = [v for v in operands if self.partial.get(v)]
        if not partial or not needs:
            raise ShardingError(f"{self._where(op)}: {what} a sharded dim, which would need a reduction across "
                                f"the mesh; keep that dim whole")
        v = partial[0]
        axes = ", ".join(sorted(self.partial[v]))
        raise ShardingError(f"{self._where(op)}: {what} a partial sum over mesh axis {axes} (made by the "
                            f"{self._describe(self.origin[v])}): only linear math may follow one; end the "
                            f"function before this op, so that its result is all-reduced, and apply the op "
                            f"after")

    def _describe(self, op: Operation) -> str:
        if isinstance(op, g.MatmulOp):
            k = g.tensor_type(op.lhs).shape[-1]
            return f"matmul contracting the sharded dim {k} at {loc_of(op) or '?'}"
        return f"{op.name.removeprefix('graph.')} at {loc_of(op) or '?'}"

    def _where(self, op: Operation | None) -> str:
        if op is None:
            return self.f.sym_name.data
        loc = loc_of(op)
        return f"{self.f.sym_name.data}: {op.name.removeprefix('graph.')}" + (f" at {loc}" if loc else "")


def independent_dims(module) -> set[str]:
    """The dim names along which the function's results are computed row by row: no op reduces,
    contracts, normalizes, indexes (arange), slices or concatenates along them, and no reshape
    makes or drops them. Running the function on chunks of such a dim (every argument that has
    it cut the same way) computes the same chunks of the results: what lets a sharded function
    all-reduce one chunk's partial result while the next chunk's kernels run."""
    (f,) = [op for op in module.ops if isinstance(op, func.FuncOp)]
    named = {d for v in f.body.block.args for d in g.tensor_type(v).shape if isinstance(d, str)}
    for op in f.body.block.ops:
        named -= _dims_crossed(op)
    return named


def _dims_crossed(op: Operation) -> set:
    """The dims an op reads across (so a chunk of them would see only part of what it needs)."""
    shape = [g.tensor_type(v).shape for v in op.operands if isinstance(v.type, g.TensorType)]
    if isinstance(op, g.MatmulOp):
        return {shape[0][-1]}
    if isinstance(op, g.ReduceOp):
        return {shape[0][op.axis.data]}
    if isinstance(op, g.SoftmaxOp):
        return {shape[0][op.axis.data]}
    if isinstance(op, (g.LayerNormOp, g.RmsNormOp)):
        return {shape[0][-1]}
    if isinstance(op, g.ArangeOp):
        return set(g.tensor_type(op.res).shape)
    if isinstance(op, (g.SliceOp, g.ConcatOp)):
        out = g.tensor_type(op.results[0]).shape
        return {d for s in shape for d, o in zip(s, out) if d != o} | {o for s in shape for d, o in zip(s, out) if d != o}
    if isinstance(op, g.ReshapeOp):
        before, after = set(shape[0]), set(g.tensor_type(op.res).shape)
        return before ^ after
    return set()
