"""Graph IR -> Graph IR, before fusion: score tiles recomputed by each kernel that reduces them.

An attention backward reads the scores S = Q @ K^T (and dP = dO @ V^T) through elementwise ops
in several places: the row max and row sum of the log-sum-exp, rowsum(dP * P), dV = P^T @ dO,
dQ = dS @ K and dK = dS^T @ Q. Each of them reduces an S x S tile away, over the keys or over the
queries, while the matmuls producing the tile have a short inner dim (the head dim). Writing the
S x S values to memory once and reading them five times costs far more than recomputing them
from Q, K, V and dO, which are S x D, in each reader; and fusion can only make one reader the
home of an op. So every such reader (a "sink": a row or column reduction, or a matmul taking the
tile as an operand) gets a copy of its own of the producer tree it reads: the score matmuls and
every elementwise op between them and the sink, with the elementwise ops they read. Fusion then
makes each sink one `flash_chain` kernel looping over key (or query) blocks.

What is copied is only what the copy can recompute: elementwise ops and matmuls over at most
`MAX_SCORE_INNER` elements; windows (slices, concatenations), other reductions and longer matmuls
are read from memory as before. A tree copied for a sink that cannot be fused would only add work,
so only sinks `chain_sink` accepts get copies, and only where another op reads the tree too (the
last reader keeps the original).

`copy_shared_prologues`, the second pass here, does the same for cheaper trees: elementwise ops
over arguments and row statistics that several kernels read (a norm backward's casts of x and
dy) are copied into each reader rather than written to memory once for all of them.
"""
from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from ..dims import is_dynamic
from ..ir import graph as g

#: the longest inner dim of a matmul whose result is recomputed rather than stored: a head dim
#: (a flash_chain kernel keeps a whole row of each operand tile in shared memory)
MAX_SCORE_INNER = 256

RECOMPUTABLE = (g.ElementwiseOp, g.CastOp, g.TransposeOp, g.ReshapeOp, *g.SOURCE_OPS)


def is_score_matmul(op, bindings: dict[str, int]) -> bool:
    """A matmul cheap enough to recompute: its inner dim is at most MAX_SCORE_INNER, shorter than
    both dims of its result (so the result is the larger tensor). A result dim taken at run time
    counts as longer whatever its class: the kernels that recompute such scores take it at run
    time, where materializing them would need a GEMM over it as its K (which takes K as a
    constant), so a small class would fix the dim for every later call."""
    if not isinstance(op, g.MatmulOp):
        return False
    inner = g.dim_value(g.tensor_type(op.lhs).shape[-1], bindings)
    if is_dynamic(inner) or inner > MAX_SCORE_INNER:
        return False
    return all(is_dynamic(n) or inner < n for n in (g.dim_value(d, bindings) for d in g.tensor_type(op.res).shape[-2:]))


def _recomputable(op, bindings) -> bool:
    return isinstance(op, Operation) and (is_score_matmul(op, bindings) or (
        isinstance(op, RECOMPUTABLE) and not (isinstance(op, g.ReshapeOp) and not g.is_unit_reshape(op, bindings))))


def producer_tree(v: SSAValue, bindings) -> list[Operation]:
    """The recomputable ops `v` is computed by (a sink's operand), producers first: up to the score
    matmuls, whose operands a flash_chain kernel reads from memory (a cast of Q feeding Q @ K^T is
    a kernel of its own, read by every sink, not recomputed inside one)."""
    order: list[Operation] = []
    seen: set[Operation] = set()

    def visit(x: SSAValue) -> None:
        op = x.owner
        if op in seen or not _recomputable(op, bindings):
            return
        seen.add(op)
        if not is_score_matmul(op, bindings):
            for operand in op.operands:
                visit(operand)
        order.append(op)
    visit(v)
    return order


def reduces_scores(tree: list[Operation], bindings) -> bool:
    """Whether a sink's operand tree recomputes a score matmul (else copying it gains nothing)."""
    return any(is_score_matmul(op, bindings) for op in tree)


def chain_sink(op, operand: SSAValue, bindings: dict[str, int]) -> bool:
    """Whether `op` reduces `operand`'s last two dims' tile in a loop a flash_chain kernel runs: a
    sum/max/min over one of them, or a matmul taking it as one (and only one) operand whose other
    operand's kept dim is at most MAX_SCORE_INNER (a program accumulates whole output rows)."""
    if isinstance(op, g.ReduceOp):
        rank = g.tensor_type(op.input).rank
        return op.kind.data in ("sum", "max", "min") and rank >= 2 and op.axis.data >= rank - 2 \
            and not is_row_max_apart(op)
    if isinstance(op, g.MatmulOp) and (op.lhs is operand) != (op.rhs is operand):
        kept = g.dim_value(g.tensor_type(op.res).shape[-1 if op.lhs is operand else -2], bindings)
        return not is_dynamic(kept) and kept <= MAX_SCORE_INNER   # (a dynamic dim has no bound)
    return False


def is_row_max_apart(op: g.ReduceOp) -> bool:
    """A max over the last axis that a logsumexp of the same rows less it reads (through a sub):
    an attention's row max, saved apart from its log-sum-exp (`autodiff.backward.may_hold_huge_fill`),
    which the flash kernel computes anyway (`fusion._logsumexp_of_scores`): not a sink of its own."""
    if op.kind.data != "max" or op.axis.data != g.tensor_type(op.input).rank - 1:
        return False
    return any(isinstance(sub := use.operation, g.ElementwiseOp) and sub.kind == "sub" and use.index == 1
               and any(isinstance(r.operation, g.ReduceOp) and r.operation.kind.data == "logsumexp"
                       for r in sub.results[0].uses)
               for use in op.res.uses)


def recompute_scores(module: ModuleOp) -> ModuleOp:
    """`module` with each flash_chain sink reading a producer tree of its own (module doc): a copy
    where some sink needs one, else `module` itself (which is never changed)."""
    if not any(_sinks_sharing(f, apply=False) for f in module.ops if isinstance(f, func.FuncOp)):
        return module
    module = module.clone()
    for f in module.ops:
        if isinstance(f, func.FuncOp):
            _erase_unread(_sinks_sharing(f, apply=True))
    return module


def _erase_unread(ops: list[Operation]) -> None:
    """Erases the ops of `ops` (producers first) that no op reads any more: originals every sink
    now reads a copy of, which would otherwise keep their operands read outside one sink's tree."""
    erased = True
    while erased:
        erased = False
        for op in reversed(ops):
            if op.parent is not None and op.results and not any(r.uses for r in op.results):
                op.detach()
                op.erase()
                erased = True


def _sinks_sharing(f: func.FuncOp, apply: bool) -> list[Operation]:
    """The ops of the producer trees that sinks share with other readers (other sinks, an attention
    forward's softmax, its saved log-sum-exp), in program order; with `apply`, each such sink gets a
    copy of its tree (the last reader keeps the original)."""
    bindings = g.bindings_of(f)
    shared: list[Operation] = []
    for sink in list(f.body.block.ops):
        for index, v in enumerate(sink.operands):
            if not chain_sink(sink, v, bindings):
                continue
            tree = producer_tree(v, bindings)
            if not reduces_scores(tree, bindings) or not _read_elsewhere(tree, sink):
                continue
            shared += tree
            if not apply:
                return shared
            sink.operands[index] = _copy_tree(v, tree, sink)
    return shared


def _read_elsewhere(tree: list[Operation], sink: Operation) -> bool:
    """Whether an op of `tree` (constants and aranges aside: every kernel makes its own) has a
    reader outside the tree and the sink."""
    members = set(tree) | {sink}
    return any(use.operation not in members for op in tree if not isinstance(op, g.SOURCE_OPS)
               for r in op.results for use in r.uses)


def _copy_tree(v: SSAValue, tree: list[Operation], before: Operation) -> SSAValue:
    """Clones of `tree`'s ops (producers first) inserted before `before`; `v`'s clone."""
    mapping: dict[SSAValue, SSAValue] = {}
    block = before.parent_block()
    for op in tree:
        clone = op.clone(value_mapper=mapping)
        block.insert_op_before(clone, before)
        mapping.update(zip(op.results, clone.results))
    return mapping[v]


# --- shared prologues ---------------------------------------------------------------------------

def copy_shared_prologues(module: ModuleOp) -> ModuleOp:
    """`module` with each elementwise op over inputs and row statistics that several ops read
    copied once per reader, else `module` itself (never changed).

    Why: fusion makes an op read by two kernels a kernel of its own, which writes its result to
    memory for both to read. For a cast of an input, or the input times a row statistic (a norm
    backward's x * rstd), that costs a write and two reads of an fp32 tensor where each reader
    could read the input itself: a RMSNorm backward was nine kernels, five of them writing [M, N]
    fp32 intermediates. Copied, each reader fuses its copy as a prologue. Only trees whose leaves
    are arguments, constants, aranges and reductions' results (small, and in memory anyway) are
    copied: a tree over a matmul's result stays one, since copying it would take the GEMM's
    epilogue away."""
    if not any(_shared_prologues(f, apply=False) for f in module.ops if isinstance(f, func.FuncOp)):
        return module
    module = module.clone()
    for f in module.ops:
        if isinstance(f, func.FuncOp):
            _shared_prologues(f, apply=True)
    return module


_PROLOGUE_OPS = (g.ElementwiseOp, g.CastOp)


def _shared_prologues(f: func.FuncOp, apply: bool) -> bool:
    """Whether some prologue op has several readers; with `apply`, gives each reader a copy
    (readers last to first, so the copies' own producers are copied in turn)."""
    copyable: dict[Operation, bool] = {}

    def is_copyable(op) -> bool:
        if op not in copyable:
            copyable[op] = isinstance(op, _PROLOGUE_OPS) and all(_leaf_or(x, is_copyable) for x in op.operands)
        return copyable[op]

    found = False
    for op in reversed(list(f.body.block.ops)):
        if not isinstance(op, _PROLOGUE_OPS) or not is_copyable(op):
            continue
        # device asserts join whichever kernel computes what they read: they do not count
        readers = [r for r in dict.fromkeys(u.operation for u in op.results[0].uses)
                   if not isinstance(r, g.AssertOp) and not _only_asserts(r)]
        # a matmul reads its operands from memory (so does a view, which may feed one): those
        # readers share the original, every other reader gets a copy
        copied = [r for r in readers if isinstance(r, _PROLOGUE_OPS + (g.ReduceOp, g.SoftmaxOp, g.LayerNormOp,
                                                                          g.RmsNormOp, g.NormStatisticOp))]
        if len(readers) < 2 or not copied:
            continue
        if not apply:
            return True
        found = True
        for reader in copied[1:] if len(copied) == len(readers) else copied:
            clone = op.clone()
            op.parent_block().insert_op_before(clone, op)
            for i, x in enumerate(reader.operands):
                if x is op.results[0]:
                    reader.operands[i] = clone.results[0]
    return found


def _only_asserts(op: Operation) -> bool:
    """Whether every reader of `op`'s results is a device assert, directly or through such ops."""
    readers = [u.operation for r in op.results for u in r.uses]
    return bool(readers) and all(isinstance(r, g.AssertOp) or _only_asserts(r) for r in readers)


def _leaf_or(v: SSAValue, is_copyable) -> bool:
    """An argument, a constant or arange, a reduction's result, or a view of one; else whether
    its producer is a copyable prologue op."""
    op = v.owner
    while isinstance(op, (g.TransposeOp, g.ReshapeOp)):
        v = op.input
        op = v.owner
    if not isinstance(op, Operation) or isinstance(op, (*g.SOURCE_OPS, g.ReduceOp)):
        return True
    return is_copyable(op)
