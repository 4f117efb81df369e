"""Graph IR -> Graph IR, before fusion: a grouped-query attention's few queries and the query
heads that share a key/value head become one dim of rows.

Grouped-query attention written with matmul broadcasting (q [B, Hk, G, M, D] against k and v
[B, Hk, 1, N, D], examples/decode_attention.py) gives the attention kernel M query rows per
block: each of the G query heads of a KV head has blocks of its own, and each reads that KV head
again. With one query (a decode step) the kernel takes the G heads as its rows instead
(`schedule.attention_row_dim`); with a few (speculative decoding verifying several tokens, a short
chunk of a prompt) it cannot, and the KV heads were read G times: 0.59-0.73 of the copy bandwidth
for GQA 32/8 with 16 queries and long caches on an H100, against 0.93-1.02 over merged rows (bench/RESULTS.md, session 19).

So where the G x M rows fit one block (at most MAX_MERGED_ROWS), this pass rewrites the attention
over them: q viewed as [B, Hk, G*M, D] (a host view: only a q that is a contiguous buffer is merged; a
strided or transposed one is read in place, unmerged), K and V without their unit G dim, the score modifications rebuilt over the merged rows, and
the output viewed back as [B, Hk, G, M, E]. A modification that depends on the query position (a
causal mask with its offset) reads `arange(M)`: over the merged rows r that is r % M. One that
depends on the head (a slope from `arange(G)`) reads r // M. A modification read from memory
that varies along G or M (a bias tensor) cannot be re-indexed without a gather: such an
attention stays as written, as does one whose scores or probabilities something else reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from .. import dtypes
from ..dims import is_dynamic
from ..ir import graph as g

#: the most rows merged: the largest query tile of the flash_attention template, so one block
#: holds every query of a KV head (more would split them over blocks that each read the KV head)
MAX_MERGED_ROWS = 128


class _Unmergeable(Exception):
    """The attention reads something that cannot be re-indexed over merged rows."""


def merge_query_groups(module: ModuleOp) -> ModuleOp:
    """`module` with each grouped-query attention of few queries over merged rows (module doc):
    a copy where one is found, else `module` itself (which is never changed)."""
    if not any(_mergeable(f) for f in g.functions(module)):
        return module
    module = module.clone()
    for f in g.functions(module):
        while (found := _mergeable(f)) is not None:
            found.apply()
    return module


def _mergeable(f: func.FuncOp) -> _Merge | None:
    """The first attention of `f` this pass rewrites, planned (nothing built yet), or None."""
    bindings = g.bindings_of(f)
    strided = _strided_args(f)
    for op in f.body.block.ops:
        if isinstance(op, g.MatmulOp):
            merge = _Merge.of(op, bindings)
            if merge is not None and _contiguous(merge.m1.lhs, strided, bindings):
                return merge
    return None


def _strided_args(f: func.FuncOp) -> set[SSAValue]:
    names = [a.data for a in f.attributes["tessera.arg_names"].data]
    strides = g.arg_strides(f)
    return {arg for name, arg in zip(names, f.body.block.args) if name in strides}


def _contiguous(q: SSAValue, strided: set[SSAValue], bindings) -> bool:
    """Whether q is a contiguous buffer (through unit views), which a host view can merge two dims
    of: a q passed strided, or a transpose, would be copied first, where unmerged it is read in place."""
    while isinstance(q.owner, g.ReshapeOp) and g.is_unit_reshape(q.owner, bindings):
        q = q.owner.input
    if isinstance(q.owner, Operation):
        return not isinstance(q.owner, (g.TransposeOp, g.ReshapeOp))
    return q not in strided


@dataclass
class _Merge:
    """One attention softmax(mods(q @ k^T)) @ v whose rows `g_dim` (the G query heads of a KV
    head) and `g_dim + 1` (the M queries) become one dim of G * M rows."""

    m1: g.MatmulOp            # the scores
    softmax: g.SoftmaxOp
    casts: list[g.CastOp]     # between the softmax and m2
    m2: g.MatmulOp            # probabilities @ V
    bindings: dict
    groups: int               # G
    queries: int              # M
    built: dict = field(default_factory=dict)   # (value, its G and M dims) -> its rebuilt value

    @classmethod
    def of(cls, m2: g.MatmulOp, bindings) -> _Merge | None:
        casts, p = [], m2.lhs
        while isinstance(p.owner, g.CastOp):
            casts.append(p.owner)
            p = p.owner.input
        sm = p.owner
        if not isinstance(sm, g.SoftmaxOp) or sm.axis.data != g.tensor_type(sm.input).rank - 1:
            return None
        m1 = _score_matmul(sm.input)
        if m1 is None:
            return None
        out = [g.dim_value(d, bindings) for d in g.tensor_type(m2.res).shape]
        scores = [g.dim_value(d, bindings) for d in g.tensor_type(m1.res).shape]
        rank = len(out)
        if rank < 3 or len(scores) != rank or scores[:-1] != out[:-1]:
            return None
        groups, queries = out[-3], out[-2]
        if is_dynamic(groups) or is_dynamic(queries):   # (the merged rows' count needs them)
            return None
        if not (groups > 1 and queries > 1 and groups * queries <= MAX_MERGED_ROWS):
            return None
        q = [g.dim_value(d, bindings) for d in g.tensor_type(m1.lhs).shape]
        if len(q) != rank or q[-3] != groups:
            return None
        if any(_varies_along_groups(v, bindings) for v in (m1.rhs, m2.rhs)):
            return None
        # K and V lose their G dim through a reshape, whose index maps follow only dims longer
        # than 1: a head dim or key count of 1 would lose its axis
        if any(g.dim_value(d, bindings) == 1 for v in (m1.rhs, m2.rhs) for d in g.tensor_type(v).shape[-2:]):
            return None
        # an epilogue reading the output fuses into the attention kernel unmerged; merged, the output
        # is a host view between kernels and the epilogue a kernel of its own
        if any(isinstance(u.operation, (g.ElementwiseOp, g.CastOp)) for u in m2.res.uses):
            return None
        merge = cls(m1, sm, casts[::-1], m2, bindings, groups, queries)
        try:
            merge.check_readers()
            merge.rebuild(sm.input, rank - 3, rank - 2, dry=True)
        except _Unmergeable:
            return None
        return merge

    # --- planning --------------------------------------------------------------------------
    def check_readers(self) -> None:
        """Only the attention reads its scores, probabilities and everything computed from them
        (a saved log-sum-exp of the scores would need them unmerged)."""
        chain = self._score_chain()
        members = {*chain, self.softmax, *self.casts, self.m2}
        for op in [*chain, self.softmax, *self.casts]:
            if any(use.operation not in members for r in op.results for use in r.uses):
                raise _Unmergeable

    def _score_chain(self) -> set[Operation]:
        """The ops between the score matmul and the softmax that read the scores."""
        chain, work = {self.m1}, [self.softmax.input]
        seen: set = set()
        while work:
            v = work.pop()
            op = v.owner
            if not isinstance(op, Operation) or op in seen:
                continue
            seen.add(op)
            if op is self.m1:
                continue
            if _depends_on(v, self.m1):
                chain.add(op)
                work.extend(op.operands)
        return chain

    # --- rebuilding ------------------------------------------------------------------------
    def rebuild(self, v: SSAValue, g_dim: int | None, m_dim: int | None, dry: bool = False) -> SSAValue | None:
        """`v` over merged rows: its dims `g_dim` and `m_dim` (where it has them: None where its
        rank does not reach them) become one, of G * M where `v` varies along either, else 1.
        With `dry`, only checks that this can be built (raising _Unmergeable)."""
        key = (v, g_dim, m_dim, dry)
        if key not in self.built:
            self.built[key] = self._rebuild(v, g_dim, m_dim, dry)
        return self.built[key]

    def _rebuild(self, v: SSAValue, g_dim: int | None, m_dim: int | None, dry: bool) -> SSAValue | None:
        shape = self._sizes(v)
        varies = any(d is not None and shape[d] != 1 for d in (g_dim, m_dim))
        new_shape = self._merged_shape(g.tensor_type(v).shape, g_dim, m_dim, varies)
        op = v.owner
        if not varies:   # the same along G and M: itself, without the G dim where it has one
            if list(new_shape) == list(g.tensor_type(v).shape) or dry:
                return v
            return self._add(g.ReshapeOp(v, g.TensorType.of(new_shape, g.tensor_type(v).dtype)),
                             op if isinstance(op, Operation) else None)
        if op is self.m1:
            return None if dry else self.scores()
        if isinstance(op, g.ArangeOp):
            return None if dry else self._merged_arange(v, g_dim if g_dim is not None and shape[g_dim] != 1 else None)
        if isinstance(op, (g.ElementwiseOp, g.CastOp)):
            rank = len(shape)
            operands = []
            for x in op.operands:
                lead = rank - g.tensor_type(x).rank
                operands.append(self.rebuild(x, _shifted(g_dim, lead), _shifted(m_dim, lead), dry))
            if dry:
                return None
            result = g.TensorType.of(new_shape, g.tensor_type(v).dtype)
            new = g.CastOp(operands[0], result, op.storage is not None) if isinstance(op, g.CastOp) else \
                g.ELEMENTWISE_OPS[op.kind](operands, result)
            return self._add(new, op)
        if isinstance(op, g.ReshapeOp) and g.is_unit_reshape(op, self.bindings):
            dims = _input_dims(op, self.bindings)
            src_g = dims.get(g_dim) if g_dim is not None and shape[g_dim] != 1 else None
            src_m = dims.get(m_dim) if m_dim is not None and shape[m_dim] != 1 else None
            if src_g is not None and src_m is not None and src_m != src_g + 1:
                raise _Unmergeable
            x = self.rebuild(op.input, src_g, src_m, dry)
            if dry:
                return None
            return self._add(g.ReshapeOp(x, g.TensorType.of(new_shape, g.tensor_type(v).dtype)), op)
        raise _Unmergeable   # read from memory, or computed some other way: needs a gather

    def scores(self) -> SSAValue:
        """q @ k^T over merged rows: q viewed [..., G * M, D], k^T without its unit G dim."""
        key = ("scores",)
        if key not in self.built:
            q = self.m1.lhs
            q_shape = list(g.tensor_type(q).shape)
            merged_q = self._add(g.ReshapeOp(q, g.TensorType.of(
                [*q_shape[:-3], self.groups * self.queries, q_shape[-1]], g.tensor_type(q).dtype)), self.m1)
            self.built[key] = self._matmul(self.m1, merged_q, self._without_groups(self.m1))
        return self.built[key]

    def apply(self) -> None:
        """Builds the merged attention before m2 and gives m2's readers its output viewed back."""
        rank = g.tensor_type(self.m2.res).rank
        scores = self.rebuild(self.softmax.input, rank - 3, rank - 2)
        sm = self.softmax
        probs = self._add(g.SoftmaxOp(scores, rank - 2, g.TensorType.of(
            g.tensor_type(scores).shape, g.tensor_type(sm.res).dtype)), sm)
        for cast in self.casts:
            cast_type = g.TensorType.of(g.tensor_type(probs).shape, g.tensor_type(cast.res).dtype)
            probs = self._add(g.CastOp(probs, cast_type, cast.storage is not None), cast)
        out = self._matmul(self.m2, probs, self._without_groups(self.m2))
        view = self._add(g.ReshapeOp(out, self.m2.res.type), self.m2)
        block = self.m2.parent_block()
        self.m2.res.replace_all_uses_with(view)
        _erase_unread(block)

    # --- helpers ---------------------------------------------------------------------------
    def _sizes(self, v: SSAValue) -> list[int]:
        return [g.dim_value(d, self.bindings) for d in g.tensor_type(v).shape]

    def _merged_shape(self, dims, g_dim: int | None, m_dim: int | None, varies: bool) -> list:
        rows = self.groups * self.queries if varies else 1
        dims = list(dims)
        if m_dim is None and g_dim is None:
            return dims
        if m_dim is None:
            return [*dims[:g_dim], rows, *dims[g_dim + 1:]]
        if g_dim is None:
            return [*dims[:m_dim], rows, *dims[m_dim + 1:]]
        return [*dims[:g_dim], rows, *dims[m_dim + 1:]]

    def _merged_arange(self, v: SSAValue, g_dim: int | None) -> SSAValue:
        """arange(M) over merged rows r: r % M; arange(G): r // M (`g_dim` set)."""
        rows = self.groups * self.queries
        arange = self._add(g.ArangeOp(g.TensorType.of([rows], dtypes.int32)), v.owner)
        m = self._add(g.ConstantOp(float(self.queries), g.TensorType.of((), dtypes.int32)), v.owner)
        kind = "floor_divide" if g_dim is not None else "remainder"
        return self._add(g.ELEMENTWISE_OPS[kind]([arange, m], g.TensorType.of([rows], dtypes.int32)), v.owner)

    def _without_groups(self, mm: g.MatmulOp) -> SSAValue:
        """Matmul `mm`'s K or V operand without its unit G dim (the last batch dim of the result)."""
        t = g.tensor_type(mm.rhs)
        if t.rank < 3:
            return mm.rhs
        shape = list(t.shape)
        del shape[t.rank - 3]
        return self._add(g.ReshapeOp(mm.rhs, g.TensorType.of(shape, t.dtype)), mm)

    def _matmul(self, like: g.MatmulOp, lhs: SSAValue, rhs: SSAValue) -> SSAValue:
        batch = g.broadcast_shapes([g.tensor_type(lhs).shape[:-2], g.tensor_type(rhs).shape[:-2]], self.bindings)
        shape = [*batch, g.tensor_type(lhs).shape[-2], g.tensor_type(rhs).shape[-1]]
        return self._add(g.MatmulOp(lhs, rhs, g.TensorType.of(shape, g.tensor_type(like.res).dtype)), like)

    def _add(self, op: Operation, like: Operation | None) -> SSAValue:
        """Inserts `op` before m2, with the provenance (`tessera.*` attributes) of `like`."""
        if like is not None:
            for name, attr in like.attributes.items():
                if name.startswith("tessera.") and name not in op.attributes:
                    op.attributes[name] = attr
        self.m2.parent_block().insert_op_before(op, self.m2)
        return op.results[0]


def _score_matmul(v: SSAValue) -> g.MatmulOp | None:
    """The one matmul the softmax input is computed from through elementwise ops and unit views."""
    found, work, seen = set(), [v], set()
    while work:
        op = work.pop().owner
        if not isinstance(op, Operation) or op in seen:
            continue
        seen.add(op)
        if isinstance(op, g.MatmulOp):
            found.add(op)
        elif isinstance(op, (g.ElementwiseOp, g.CastOp, g.ReshapeOp)):
            work.extend(op.operands)
    return found.pop() if len(found) == 1 else None


def _depends_on(v: SSAValue, target: Operation) -> bool:
    work, seen = [v], set()
    while work:
        op = work.pop().owner
        if op is target:
            return True
        if not isinstance(op, Operation) or op in seen or isinstance(op, g.MatmulOp):
            continue
        seen.add(op)
        work.extend(op.operands)
    return False


def _varies_along_groups(v: SSAValue, bindings) -> bool:
    """Whether a matmul's K or V operand has a G dim (the last batch dim) longer than 1."""
    t = g.tensor_type(v)
    return t.rank >= 3 and g.dim_value(t.shape[-3], bindings) != 1


def _shifted(dim: int | None, lead: int) -> int | None:
    """An op's result dim as its operand's (broadcast right-aligned `lead` dims fewer), or None."""
    return None if dim is None or dim - lead < 0 else dim - lead


def _input_dims(op: g.ReshapeOp, bindings) -> dict[int, int]:
    """A unit reshape's result dims longer than 1 -> the input dims they are."""
    src = [i for i, d in enumerate(g.tensor_type(op.input).shape) if g.dim_value(d, bindings) != 1]
    dst = [i for i, d in enumerate(g.tensor_type(op.res).shape) if g.dim_value(d, bindings) != 1]
    return dict(zip(dst, src))


def _erase_unread(block) -> None:
    """Erases the ops of `block` whose results nothing reads any more (the unmerged attention and
    the score modifications only it read), readers first."""
    for op in reversed(list(block.ops)):
        if op.results and not any(r.uses for r in op.results):
            op.detach()
            op.erase()
