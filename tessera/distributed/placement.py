"""Where a sharded function needs communication: placements propagated through Graph IR, and the
collectives that keep them consistent, placed where the math needs them.

A sharded function (`tessera.distributed.shard`) names the dims that are split across mesh axes
(`{"F": "tp"}`: every argument's dim named F holds 1/tp of its extent on each rank). Each rank
runs the function's math on its shards; this pass walks the Graph IR once and gives each value a
`State`: which of its dims are sharded over which mesh axes, and the axes over which it is a
*partial sum* (each rank holds one term of the sum over the ranks of that axis):

- a matmul contracting a sharded dim sums only its rank's slice of the products: partial; so
  does a sum over a sharded dim;
- linear math keeps partials (negation, casts, views, slices, sums, a product or quotient with a
  value that does not vary over those axes, a matmul with one); any other op that reads a partial
  sum (a nonlinearity, a norm, adding a replicated bias) gets it *all-reduced* first;
- an op may not read across a sharded dim other than by summing it (a softmax, a norm, a max, an
  arange, a slice along it, a value with it twice as attention scores over a sharded sequence
  would have): refused, naming the op, its line and the way out.

Sequence parallelism (`sequence=("S", "tp")`, Megatron-LM's): the arguments' dim S is split over
tp as well, the norms, residual adds and other row-wise math between the tensor-parallel regions
run on 1/tp of the rows, and a partial sum read by such math is *reduce-scattered* along S
instead of all-reduced; a value sharded along S that meets math that needs all of S, or a
weight sharded over the same axis, is *all-gathered* first; a replicated value with S that
meets one sharded along it is *split* (each rank keeps its rows, no communication).

For training, a value that does not vary over a mesh axis read by an op whose result does (x
entering a column-parallel matmul, a weight under data parallelism, a sequence-parallel norm's
weight) *enters* the sharded math: the identity, whose gradient is a partial sum over those axes
and so all-reduced in the backward (Megatron-LM's f; its g, the all-reduce, has the identity as
its gradient). An all-gather whose every use enters sharded math reduce-scatters its gradient,
which does both.

Each collective is a `Cut` of a value; the function is then split at the cuts into `Segment`s
(`segments`), each an ordinary function compiled by the usual pipeline, run in order with the
collectives between them on the caller's stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

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
    """How a value is spread over the mesh: its sharded dims (index, mesh axis) and the mesh axes
    over which it is a partial sum."""

    sharded: tuple[tuple[int, str], ...]
    partial: frozenset[str]


@dataclass(frozen=True)
class State(Placement):
    """A value's placement during the pass; `seq`: the index of its dim that is sharded for
    sequence parallelism (one of `sharded`), which collectives may gather, else None."""

    seq: int | None = None

    def axis_at(self, i: int) -> str | None:
        return dict(self.sharded).get(i)

    @property
    def varying(self) -> frozenset[str]:
        """The mesh axes along which ranks hold different data."""
        return frozenset(a for _, a in self.sharded) | self.partial

    def placement(self) -> Placement:
        return Placement(self.sharded, self.partial)


REPLICATED = State((), frozenset())


@dataclass(frozen=True)
class Collective:
    """`kind`: all_reduce, reduce_scatter, all_gather, split (a replicated value's own rows: no
    communication) or enter (the identity; its gradient all-reduced); over mesh `axes`; along the
    value's dim `dim` (reduce_scatter, all_gather, split)."""

    kind: str
    axes: tuple[str, ...]
    dim: int | None = None


@dataclass(eq=False)
class Cut:
    """A collective applied to a value (`source`: a Graph IR value or another cut). `grad` says
    what an all-gather's gradient takes: reduce_scatter when every use of the gathered value
    enters sharded math (its gradient is then a partial sum), else split."""

    source: Key
    collective: Collective
    grad: str = "split"


Key = Union[SSAValue, Cut]


class _Need(Exception):
    """The op needs operand `index` converted (`what`: reduce, gather or split) before it can run."""

    def __init__(self, index: int, what: str):
        self.index, self.what = index, what


@dataclass
class Analysis:
    """The pass's result over one function: each use's value (the Graph IR value, or a cut of it),
    each value's state, and the function's results (values or cuts)."""

    f: func.FuncOp
    dims: dict[str, str]
    sequence: tuple[str, str] | None
    uses: dict[tuple[Operation, int], Key] = field(default_factory=dict)
    states: dict = field(default_factory=dict)
    results: list[Key] = field(default_factory=list)
    before: list[State] = field(default_factory=list)   # the results' states before their collectives

    def cuts(self) -> list[Cut]:
        """Every cut, sources before the cuts of them."""
        seen: dict[int, Cut] = {}

        def add(k):
            if isinstance(k, Cut) and id(k) not in seen:
                add(k.source)
                seen[id(k)] = k
        for k in [*self.uses.values(), *self.results]:
            add(k)
        return list(seen.values())


def analyze(module, dims: dict[str, str], sequence: tuple[str, str] | None = None,
            gradients: bool = False) -> Analysis:
    """The states of the function's values and the collectives its math needs when the dims
    named in `dims` are split over the mesh axes they map to (and, with `sequence` = (dim, axis),
    that dim over that axis between tensor-parallel regions); with `gradients`, the values that
    enter sharded math too (module doc). A ShardingError for math that cannot run so."""
    (f,) = [op for op in module.ops if isinstance(op, func.FuncOp)]
    return _Propagation(f, dims, sequence, gradients).run()


def propagate(module, dims: dict[str, str]) -> list[Placement]:
    """The placements of the function's results as its math leaves them (a partial sum is
    all-reduced by the caller): `analyze` without sequence parallelism."""
    return [s.placement() for s in analyze(module, dims).before]


class _Propagation:
    def __init__(self, f: func.FuncOp, dims: dict[str, str], sequence, gradients: bool):
        self.a = Analysis(f, dict(dims), sequence)
        self.f, self.dims, self.sequence, self.gradients = f, dims, sequence, gradients
        self.bindings = g.bindings_of(f)
        self.cache: dict[tuple, Cut] = {}
        self.differentiable: set[SSAValue] = set()   # values computed from a float argument
        self.eager: set[SSAValue] = set()   # partial values with several readers: reduced where made
        for arg in f.body.block.args:
            self.a.states[arg] = self._argument_state(arg)
            if g.tensor_type(arg).dtype.is_float:
                self.differentiable.add(arg)

    def run(self) -> Analysis:
        for op in self.f.body.block.ops:
            if isinstance(op, func.ReturnOp):
                self._returns(op)
            else:
                self._visit(op)
        self._absorb_enters()
        return self.a

    # --- states -----------------------------------------------------------------------------
    def _argument_state(self, arg: SSAValue) -> State:
        shape = g.tensor_type(arg).shape
        sharded = [(i, self.dims[d]) for i, d in enumerate(shape) if isinstance(d, str) and d in self.dims]
        seq = None
        if self.sequence and self.sequence[0] in shape:
            seq = shape.index(self.sequence[0])
            sharded.append((seq, self.sequence[1]))
        state = State(tuple(sorted(sharded)), frozenset(), seq)
        self._check_twice(state, shape, None)
        return state

    def _check_twice(self, state: State, shape, op) -> None:
        axes = [a for _, a in state.sharded]
        twice = sorted({a for a in axes if axes.count(a) > 1})
        if twice:
            names = [shape[i] for i, a in state.sharded if a == twice[0]]
            raise ShardingError(f"{self._where(op)}: a value with the sharded dim {names[-1]} twice ({list(shape)}) "
                                f"would need every rank's shard of the other (ring attention over a sharded "
                                f"sequence is not supported); shard another dim")

    def state_of(self, k: Key) -> State:
        return self.a.states[k]

    # --- ops ----------------------------------------------------------------------------------
    def _visit(self, op: Operation) -> None:
        keys: list[Key] = list(op.operands)
        failed_scatter: set[int] = set()
        for i, v in enumerate(op.operands):
            if v in self.eager:
                keys[i] = self._convert(op, keys, _Need(i, "reduce"), failed_scatter)
        for _ in range(8 + 4 * len(keys)):
            try:
                result = self._rule(op, [self.state_of(k) for k in keys])
                break
            except _Need as need:
                keys[need.index] = self._convert(op, keys, need, failed_scatter)
        else:
            raise ShardingError(f"{self._where(op)}: no placement of its operands lets it run on shards")
        if self.gradients and op.results:
            keys = [self._enter(k, v, result) for k, v in zip(keys, op.operands)]
        for i, k in enumerate(keys):
            self.a.uses[(op, i)] = k
        if any(v in self.differentiable for v in op.operands):
            self.differentiable.update(r for r in op.results if g.tensor_type(r).dtype.is_float)
        for r in op.results:
            self.a.states[r] = result
            self._check_twice(result, g.tensor_type(r).shape, op)
            if result.partial and sum(1 for _ in r.uses) > 1:
                self.eager.add(r)   # reduced once, not once per consumer that needs it whole

    def _convert(self, op: Operation, keys: list[Key], need: _Need, failed_scatter: set[int]) -> Key:
        i, k = need.index, keys[need.index]
        state = self.state_of(k)
        if need.what == "reduce":
            return self._reduction(k, scatter=i not in failed_scatter)
        if need.what == "gather":
            if isinstance(k, Cut) and k.collective.kind == "reduce_scatter" and i not in failed_scatter:
                failed_scatter.add(i)   # the op needs the whole value: all-reduce instead
                return self._cut(k.source, Collective("all_reduce", tuple(sorted(self.state_of(k.source).partial))))
            if state.seq is None:
                raise ShardingError(f"{self._where(op)}: reads across a sharded dim of "
                                    f"{self._show(op.operands[i])}, which would need a reduction across the mesh; "
                                    f"keep that dim whole")
            return self._cut(k, Collective("all_gather", (self.sequence[1],), state.seq))
        seq = self._seq_index(k)
        if seq is None:
            raise ShardingError(f"{self._where(op)}: {self._show(op.operands[i])} meets a value sharded along the "
                                f"sequence dim {self.sequence[0]} where it has no dim of that name")
        return self._cut(k, Collective("split", (self.sequence[1],), seq))

    def _enter(self, k: Key, v: SSAValue, result: State) -> Key:
        """`k`, or its enter cut where the op's result varies over axes it does not (module doc)."""
        extra = result.varying - self.state_of(k).varying
        if not extra or v not in self.differentiable:
            return k
        return self._cut(k, Collective("enter", tuple(sorted(extra))))

    def _cut(self, k: Key, collective: Collective) -> Cut:
        key = (id(k), collective)
        if key not in self.cache:
            cut = self.cache[key] = Cut(k, collective)
            self.a.states[cut] = self._after(self.state_of(k), collective)
        return self.cache[key]

    def _after(self, s: State, c: Collective) -> State:
        axes = set(c.axes)
        if c.kind == "all_reduce":
            return State(s.sharded, s.partial - axes, s.seq)
        if c.kind == "reduce_scatter":
            return State(tuple(sorted({*s.sharded, (c.dim, c.axes[0])})), s.partial - axes, c.dim)
        if c.kind == "all_gather":
            return State(tuple(x for x in s.sharded if x[0] != c.dim), s.partial, None)
        if c.kind == "split":
            return State(tuple(sorted({*s.sharded, (c.dim, c.axes[0])})), s.partial, c.dim)
        return s   # enter

    def _reduction(self, k: Key, scatter: bool = True) -> Cut:
        """The cut reducing partial sum `k`: a reduce-scatter along the sequence dim where it is partial
        over the sequence axis only (and `scatter`), else an all-reduce."""
        state, seq = self.state_of(k), self._seq_index(k)
        if scatter and self.sequence and state.partial == {self.sequence[1]} and seq is not None:
            return self._cut(k, Collective("reduce_scatter", (self.sequence[1],), seq))
        return self._cut(k, Collective("all_reduce", tuple(sorted(state.partial))))

    def _seq_index(self, k: Key) -> int | None:
        """The index of the sequence dim in the value `k` (by name), if sequence parallel."""
        v = k
        while isinstance(v, Cut):
            v = v.source
        shape = g.tensor_type(v).shape
        return shape.index(self.sequence[0]) if self.sequence and self.sequence[0] in shape else None

    def _returns(self, ret: func.ReturnOp) -> None:
        for v in ret.operands:
            k: Key = v
            state = self.state_of(k)
            self.a.before.append(state)
            seq = self._seq_index(k)
            if state.partial:
                k = self._reduction(k)
            elif seq is not None and self.sequence[1] not in state.varying:
                k = self._cut(k, Collective("split", (self.sequence[1],), seq))
            self.a.results.append(k)

    def _absorb_enters(self) -> None:
        """An all-gather whose every use enters sharded math over its axis takes the enters'
        gradient all-reduce into its own gradient (a reduce-scatter does both)."""
        for cut in self.a.cuts():
            if cut.collective.kind != "all_gather" or any(r is cut for r in self.a.results):
                continue
            uses = [u for u, k in self.a.uses.items() if k is cut or (isinstance(k, Cut) and k.source is cut)]
            entering = [u for u in uses if self.a.uses[u] is not cut
                        and self.a.uses[u].collective == Collective("enter", cut.collective.axes)]
            if uses and len(entering) == len(uses) and not any(r.source is cut for r in self.a.results
                                                                  if isinstance(r, Cut)):
                cut.grad = "reduce_scatter"
                for u in entering:
                    self.a.uses[u] = cut

    # --- rules --------------------------------------------------------------------------------
    def _rule(self, op: Operation, st: list[State]) -> State:
        if isinstance(op, g.MatmulOp):
            return self._matmul(op, st)
        if isinstance(op, g.ElementwiseOp):
            self._elementwise_partials(op, st)
            return self._broadcast(op, st, [g.tensor_type(v).shape for v in op.operands])
        if isinstance(op, g.ReduceOp):
            return self._reduce(op, st[0])
        if isinstance(op, (g.SoftmaxOp, g.LayerNormOp, g.RmsNormOp, g.NormStatisticOp)):
            self._no_partials(st)
            x = g.tensor_type(op.operands[0])
            axis = op.axis.data % x.rank if isinstance(op, g.SoftmaxOp) else x.rank - 1
            if st[0].axis_at(axis):
                if st[0].seq == axis:
                    raise _Need(0, "gather")
                raise ShardingError(f"{self._where(op)}: {op.name.removeprefix('graph.')} normalizes over the "
                                    f"sharded dim {x.shape[axis]}, which would need a reduction across the mesh; "
                                    f"shard another dim (heads, batch) or keep {x.shape[axis]} whole")
            return self._broadcast(op, st, [g.tensor_type(v).shape for v in op.operands])
        if isinstance(op, g.CastOp):
            if not g.tensor_type(op.res).dtype.is_float:   # truncating or comparing each rank's share
                self._no_partials(st)                        # is not doing it to the sum
            return st[0]
        if isinstance(op, g.TransposeOp):
            perm = op.permutation
            s = st[0]
            return State(tuple(sorted((perm.index(i), a) for i, a in s.sharded)), s.partial,
                         None if s.seq is None else perm.index(s.seq))
        if isinstance(op, g.ReshapeOp):
            return self._reshape(op, st[0])
        if isinstance(op, (g.SliceOp, g.ConcatOp)):
            return self._window(op, st)
        if isinstance(op, g.ArangeOp):
            (d,) = g.tensor_type(op.res).shape
            if isinstance(d, str) and d in self.dims:
                raise ShardingError(f"{self._where(op)}: an arange over the sharded dim {d} would count from 0 on "
                                    f"every rank (a mask over a sharded sequence); shard another dim")
            return REPLICATED
        if isinstance(op, g.DimSizeOp):
            if op.dim.data in self.dims:
                raise ShardingError(f"{self._where(op)}: the size of the sharded dim {op.dim.data} would be each "
                                    f"rank's share of it; shard another dim")
            return REPLICATED
        if isinstance(op, g.AssertOp):
            self._no_partials(st)
            return REPLICATED
        if any(s.varying for s in st):
            raise ShardingError(f"{self._where(op)}: {op.name} has no sharding rule; call it outside the "
                                f"sharded function")
        return REPLICATED

    def _no_partials(self, st: list[State]) -> None:
        for i, s in enumerate(st):
            if s.partial:
                raise _Need(i, "reduce")

    def _elementwise_partials(self, op: g.ElementwiseOp, st: list[State]) -> None:
        partial = [i for i, s in enumerate(st) if s.partial]
        if not partial:
            return
        kind = op.kind
        if kind in LINEAR_UNARY:
            return
        if kind in SUMS and all(s.partial == st[0].partial for s in st):
            return
        (first,) = partial if len(partial) == 1 else (None,)
        if first is not None and (kind in SCALING or (kind in SCALING_FIRST and first == 0)) and \
                not any(s.varying & st[first].partial for i, s in enumerate(st) if i != first):
            return
        raise _Need(partial[0], "reduce")

    def _broadcast(self, op: Operation, st: list[State], shapes, rank: int | None = None,
                   offsets=None) -> State:
        """The state of an op whose operands' dims align from the right (NumPy broadcasting), each
        result dim sharded as the operands' non-broadcast dims there are; a mismatch is resolved
        by gathering or splitting along the sequence dim, or refused."""
        rank = max(len(s) for s in shapes) if rank is None else rank
        offsets = offsets or [rank - len(s) for s in shapes]
        sharded, seq = {}, None
        for pos in range(rank):
            here = [(i, pos - offsets[i]) for i in range(len(shapes)) if 0 <= pos - offsets[i] < len(shapes[i])
                    and (g.dim_value(shapes[i][pos - offsets[i]], self.bindings) != 1
                         or st[i].axis_at(pos - offsets[i]))]   # a shard of one row is no broadcast
            axes = {st[i].axis_at(j) for i, j in here}
            if len(axes) > 1:
                self._resolve(op, st, here)
            (axis,) = axes or {None}
            if axis:
                sharded[pos] = axis
                if any(st[i].seq == j for i, j in here):
                    seq = pos
        axes = list(sharded.values())
        seqs = [i for i, s in enumerate(st) if s.seq is not None]
        if len(set(axes)) < len(axes) and seqs:
            raise _Need(seqs[0], "gather")
        partial = frozenset().union(*(s.partial for s in st))
        if set(sharded.values()) & partial:
            raise _Need(next(i for i, s in enumerate(st) if s.partial), "reduce")
        return State(tuple(sorted(sharded.items())), partial, seq)

    def _resolve(self, op: Operation, st: list[State], here) -> None:
        seq = [(i, j) for i, j in here if st[i].seq == j]
        others = [(i, j) for i, j in here if st[i].seq != j]
        if seq:
            for i, j in others:
                if self.sequence[1] not in st[i].varying and st[i].axis_at(j) is None:
                    raise _Need(i, "split")
            raise _Need(seq[0][0], "gather")
        i, j = here[0]
        raise ShardingError(f"{self._where(op)}: its operands' dims {', '.join(str(g.tensor_type(op.operands[i]).shape[j]) for i, j in here)} "
                            f"line up but are sharded differently; name them the same in the annotations")

    def _matmul(self, op: g.MatmulOp, st: list[State]) -> State:
        a, b = st
        if a.partial and b.partial:
            raise _Need(0, "reduce")
        for i, j in ((0, 1), (1, 0)):
            if st[i].partial and st[j].varying & st[i].partial:
                raise _Need(i, "reduce")
        sa, sb = g.tensor_type(op.lhs).shape, g.tensor_type(op.rhs).shape
        ka, kb = a.axis_at(len(sa) - 1), b.axis_at(len(sb) - 2)
        if ka != kb:
            if a.seq == len(sa) - 1 or b.seq == len(sb) - 2:
                raise _Need(0 if a.seq == len(sa) - 1 else 1, "gather")
            raise ShardingError(f"{self._where(op)}: the matmul contracts dim {sa[-1]} of its left operand "
                                f"with dim {sb[-2]} of its right one, and only one of them is sharded")
        rank = max(len(sa), len(sb))
        batch = self._broadcast(op, [_drop_last(a, len(sa), 2), _drop_last(b, len(sb), 2)],
                                [sa[:-2], sb[:-2]], rank - 2)
        sharded = dict(batch.sharded)
        seq = batch.seq
        if a.axis_at(len(sa) - 2):
            sharded[rank - 2] = a.axis_at(len(sa) - 2)
            seq = rank - 2 if a.seq == len(sa) - 2 else seq
        if b.axis_at(len(sb) - 1):
            if b.axis_at(len(sb) - 1) in sharded.values() and (a.seq, b.seq) != (None, None):
                raise _Need(0 if a.seq is not None else 1, "gather")   # else _check_twice refuses it
            sharded[rank - 1] = b.axis_at(len(sb) - 1)
            seq = rank - 1 if b.seq == len(sb) - 1 else seq
        partial = a.partial | b.partial | ({ka} if ka else set())
        if set(sharded.values()) & partial:
            seqs = [i for i, s in enumerate(st) if s.seq is not None]
            if seqs:
                raise _Need(seqs[0], "gather")
            raise ShardingError(f"{self._where(op)}: a value both sharded over mesh axis {ka!r} and a partial "
                                f"sum over it: each rank holds a term for a different shard")
        return State(tuple(sorted(sharded.items())), frozenset(partial), seq)

    def _reduce(self, op: g.ReduceOp, x: State) -> State:
        axis = op.axis.data
        shape = g.tensor_type(op.input).shape
        if x.partial and op.kind.data != "sum":
            raise _Need(0, "reduce")
        sharded_axis = x.axis_at(axis)
        if sharded_axis and op.kind.data != "sum":
            if x.seq == axis:
                raise _Need(0, "gather")
            raise ShardingError(f"{self._where(op)}: the {op.kind.data} over the sharded dim {shape[axis]} reads "
                                f"a sharded dim, which would need a reduction across the mesh; keep that dim whole")
        keep = op.keepdim.data
        sharded = tuple((i if keep or i < axis else i - 1, a) for i, a in x.sharded if i != axis)
        seq = None if x.seq in (None, axis) else (x.seq if keep or x.seq < axis else x.seq - 1)
        return State(sharded, x.partial | ({sharded_axis} if sharded_axis else set()), seq)

    def _reshape(self, op: g.ReshapeOp, x: State) -> State:
        src, dst = g.tensor_type(op.input).shape, g.tensor_type(op.res).shape
        if not x.sharded:
            return x
        if x.seq is not None and src[x.seq] not in dst:
            raise _Need(0, "gather")   # a sequence-sharded value keeps its dim by name (segments rebind it)
        sizes = [g.dim_value(d, self.bindings) for d in src], [g.dim_value(d, self.bindings) for d in dst]
        groups = _reshape_groups(*sizes)
        sharded, seq = {}, None
        for ins, outs in groups or ():
            for i in ins:
                axis = x.axis_at(i)
                if axis is None:
                    continue
                before = ins[:ins.index(i)]
                if any(x.axis_at(j) or sizes[0][j] != 1 for j in before) or not outs:
                    if x.seq == i:
                        raise _Need(0, "gather")
                    raise ShardingError(f"{self._where(op)}: a reshape of {list(src)} to {list(dst)} merges the "
                                        f"sharded dim {src[i]} after another dim, so that a rank's shard is not a "
                                        f"block of the result; keep the sharded dim outermost where dims merge")
                # where a dim splits (heads out of a sharded width), the shard is a block of its outermost
                # part: the one that keeps the name, else the first (its local size may be 1)
                named = [j for j in outs if dst[j] == src[i]]
                out = named[0] if named else outs[0]
                sharded[out] = axis
                if x.seq == i:
                    seq = out
        return State(tuple(sorted(sharded.items())), x.partial, seq)

    def _window(self, op: Operation, st: list[State]) -> State:
        out = g.tensor_type(op.results[0]).shape
        for i, v in enumerate(op.operands):
            for j, (d, o) in enumerate(zip(g.tensor_type(v).shape, out)):
                if d != o and st[i].axis_at(j):
                    if st[i].seq == j:
                        raise _Need(i, "gather")
                    raise ShardingError(f"{self._where(op)}: a {op.name.removeprefix('graph.')} along a sharded "
                                        f"dim would cut each rank's shard, not the whole tensor")
        if isinstance(op, g.ConcatOp) and any(s.partial != st[0].partial for s in st):
            raise _Need(next(i for i, s in enumerate(st) if s.partial), "reduce")
        return self._broadcast(op, st, [g.tensor_type(v).shape for v in op.operands])

    # --- messages -----------------------------------------------------------------------------
    def _show(self, v: SSAValue) -> str:
        owner = v.owner
        if isinstance(owner, Operation):
            loc = loc_of(owner)
            return f"the {owner.name.removeprefix('graph.')}" + (f" at {loc}" if loc else "")
        names = [a.data for a in self.f.attributes["tessera.arg_names"].data]
        return f"argument {names[v.index]!r}"

    def _where(self, op: Operation | None) -> str:
        if op is None:
            return self.f.sym_name.data
        loc = loc_of(op)
        return f"{self.f.sym_name.data}: {op.name.removeprefix('graph.')}" + (f" at {loc}" if loc else "")


def _drop_last(s: State, rank: int, n: int) -> State:
    """`s` restricted to the first rank - n dims (a matmul's batch dims)."""
    return State(tuple((i, a) for i, a in s.sharded if i < rank - n), s.partial,
                 s.seq if s.seq is not None and s.seq < rank - n else None)


def _reshape_groups(src: list, dst: list) -> list[tuple[list[int], list[int]]] | None:
    """The dims of a reshape in groups of equal element counts (in, out), size-1 dims joining the
    group after them, or None where a size is unknown."""
    if None in src or None in dst:
        return None
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        ins, outs, a, b = [], [], 1, 1
        while True:
            if a <= b and i < len(src):
                a *= src[i]
                ins.append(i)
                i += 1
            elif j < len(dst):
                b *= dst[j]
                outs.append(j)
                j += 1
            else:
                break
            if a == b and ins and outs:   # size-1 dims start the next group
                break
        groups.append((ins, outs))
    return groups


# --- chunks and segments ------------------------------------------------------------------------

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
    if isinstance(op, (g.LayerNormOp, g.RmsNormOp, g.NormStatisticOp)):
        return {shape[0][-1]}
    if isinstance(op, g.ArangeOp):
        return set(g.tensor_type(op.res).shape)
    if isinstance(op, g.DimSizeOp):
        return {op.dim.data}
    if isinstance(op, (g.SliceOp, g.ConcatOp)):
        out = g.tensor_type(op.results[0]).shape
        return {d for s in shape for d, o in zip(s, out) if d != o} | {o for s in shape for d, o in zip(s, out) if d != o}
    if isinstance(op, g.ReshapeOp):
        before, after = set(shape[0]), set(g.tensor_type(op.res).shape)
        return before ^ after
    return set()


@dataclass
class Segment:
    """Ops of the function run as one compiled function between collectives: `inputs` (function
    arguments, values of earlier segments, cuts), `outputs` (values later steps read), `ops` in
    program order, `free` the operand-free ops (aranges, constants, masks made of them) it
    recomputes rather than reads, and whether its rows are sequence-sharded."""

    index: int
    level: int
    ops: list[Operation]
    free: list[Operation]
    inputs: list[Key]
    outputs: list[SSAValue]
    sequence_sharded: bool


def segments(a: Analysis, split_tails: bool = False) -> list[Segment]:
    """The function's ops split at its cuts: an op runs after every collective its operands come
    through (its level: the most cuts on a path from the arguments), each level's ops in program
    order, a new segment where the rows switch between sequence-sharded and whole. With
    `split_tails`, a segment's ops that make partial sums (the row-parallel matmul and the linear
    math after it) become a segment of their own, which an overlapped call runs in chunks without
    chunking the matmuls before it."""
    ops = [op for op in a.f.body.block.ops if not isinstance(op, func.ReturnOp)]
    free = _free_ops(a, ops)
    level: dict[int, int] = {}

    def level_of(k: Key) -> int:
        if isinstance(k, Cut):
            return level_of(k.source) + 1
        owner = k.owner
        return level[id(owner)] if isinstance(owner, Operation) and id(owner) in level else 0
    for op in ops:
        if id(op) not in free:
            level[id(op)] = max([level_of(a.uses[(op, i)]) for i in range(len(op.operands))
                                 if id(op.operands[i].owner) not in free] or [0])
    runs: list[tuple[int, bool | None, list[Operation]]] = []
    for lv in sorted(set(level.values())):
        for op in ops:
            if level.get(id(op)) != lv:
                continue
            mode = _sequence_mode(a, op)
            if runs and runs[-1][0] == lv and (mode is None or runs[-1][1] in (None, mode)):
                runs[-1] = (lv, mode if mode is not None else runs[-1][1], runs[-1][2] + [op])
            else:
                runs.append((lv, mode, [op]))
    if split_tails:
        runs = [part for lv, mode, run in runs for part in _split_tail(a, lv, mode, run)]
    kept = {id(k) for k in a.results} | {id(c.source) for c in a.cuts()}   # read after every segment
    readers: dict[int, set[int]] = {}   # value -> the ops reading it directly
    for (op, _), k in a.uses.items():
        readers.setdefault(id(k), set()).add(id(op))
    out = []
    for index, (lv, mode, run) in enumerate(runs):
        mine = {id(op) for op in run}
        recomputed = _closure(a, run, free)
        inputs: list[Key] = []
        for op in [*recomputed, *run]:
            for i in range(len(op.operands)):
                k = a.uses.get((op, i), op.operands[i])
                owner = k.owner if isinstance(k, SSAValue) else None
                if isinstance(owner, Operation) and (id(owner) in mine or id(owner) in free):
                    continue
                if not any(k is x for x in inputs):
                    inputs.append(k)
        outputs = [r for op in run for r in op.results if id(r) in kept or readers.get(id(r), set()) - mine]
        out.append(Segment(index, lv, run, recomputed, inputs, outputs, bool(mode)))
    return out


def _split_tail(a: Analysis, lv: int, mode, run: list[Operation]) -> list[tuple]:
    """The run, then its ops with partial results (no op before them reads one: a partial sum is
    read only by linear math, or through a cut)."""
    tail = [op for op in run if op.results and a.states[op.results[0]].partial]
    head = [op for op in run if not (op.results and a.states[op.results[0]].partial)]
    return [(lv, mode, part) for part in (head, tail) if part]


def _sequence_mode(a: Analysis, op: Operation) -> bool | None:
    """True where the op's values with the sequence dim are sharded along it, False where they
    are whole, None where it has none."""
    if a.sequence is None:
        return False
    modes = set()
    for i, v in enumerate(op.operands):
        if a.sequence[0] in g.tensor_type(v).shape:
            modes.add(a.states[a.uses[(op, i)]].seq is not None)
    for r in op.results:
        if a.sequence[0] in g.tensor_type(r).shape:
            modes.add(a.states[r].seq is not None)
    if len(modes) > 1:
        raise ShardingError(f"{a.f.sym_name.data}: {op.name.removeprefix('graph.')} at {loc_of(op) or '?'} mixes "
                            f"values sharded along {a.sequence[0]} with whole ones")
    return modes.pop() if modes else None


def _free_ops(a: Analysis, ops: list[Operation]) -> set[int]:
    """Ops computed from no argument (aranges, constants and what is made of them alone), which
    each segment that reads them recomputes: a mask stays in its attention's kernel."""
    free: set[int] = set()
    cut_sources = {id(c.source.owner) for c in a.cuts() if isinstance(c.source, SSAValue)}
    returned = {id(k.owner) for k in a.results if isinstance(k, SSAValue)}
    for op in ops:
        if id(op) in cut_sources or id(op) in returned or not op.results:
            continue
        if all(isinstance(a.uses[(op, i)], SSAValue) and id(v.owner) in free for i, v in enumerate(op.operands)):
            free.add(id(op))
    return free


def _closure(a: Analysis, run: list[Operation], free: set[int]) -> list[Operation]:
    """The free ops the run reads, directly or through each other, in program order."""
    wanted: set[int] = set()
    stack = [v.owner for op in run for v in op.operands if id(v.owner) in free]
    while stack:
        op = stack.pop()
        if id(op) not in wanted:
            wanted.add(id(op))
            stack.extend(v.owner for v in op.operands)
    return [op for op in a.f.body.block.ops if id(op) in wanted]
