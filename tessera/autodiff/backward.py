"""Reverse-mode autodiff as a Graph IR transformation: `backward_graph(forward) -> backward`.

The backward of a traced function `f(x1, ..., xn) -> (y1, ..., ym)` is an ordinary Graph IR
function `f_vjp(x1, ..., xn, dy1, ..., dym) -> (dx1, ..., dxk)`: the forward's inputs, one
cotangent per float output, and one gradient per differentiable (float) input. It is traced
like any function (`frontend.trace.trace`), so it carries `tessera.dims`, argument and result
names and every op's `tessera.loc`, prints with `--dump-ir` and parses back, and compiles
through the same fusion, tiling, targets and CPU interpreter.

How it is built, in one trace:

1. recompute: the forward's ops are cloned into the backward, reading its arguments (the
   forward's `tessera.loc`s come with them), except what the forward saved (`saved_values`:
   with `saved`, the backward takes them as arguments after the forward's). What the compiler
   saves is what would cost a pass over the scores to recompute: each attention's row
   log-sum-exp and output O = P @ V (for rowsum(dO * O)); `forward_with_residuals` is the
   forward that also returns them. Everything else is recomputed: fusion fuses the recomputed
   ops into the backward's kernels (a norm's statistics into the row reductions reading them).
   An attention's probabilities are read by the backward as exp(scores - logsumexp(scores))
   (`softmax_from_logsumexp`), so that each of their readers fuses into one kernel over score
   blocks; without saved values, the recomputed forward attention is one flash kernel that
   writes the log-sum-exp beside O;
2. reverse: the ops are visited last to first; each op with a cotangent and an operand that
   depends on a differentiated input applies its rule (`rules.VJP_RULES`, written with the
   frontend's ops) and adds each operand's gradient, summed back to the operand's shape and
   cast to its dtype (`fit`), into that operand's cotangent. The new ops take the forward op's
   `tessera.loc`, so a backward kernel points at the user's line it differentiates;
3. the gradients are returned: zeros for an input no output depends on, and a copy where a
   gradient is an argument (`f(x, y) = x + y` passes dy through) or already returned, since a
   function's results are buffers of their own.

Ops the backward does not read are dropped as dead code by the trace. A rank-0 output's
cotangent is passed as a `[1]` tensor (Tessera's calls take 0-d arrays as constants) and viewed
as rank 0 inside. With `seed_ones`, the cotangents are not arguments but ones: the gradient of
the sum of the outputs, which for `tsr.grad`'s one scalar output is its gradient.

Double backward works: a backward graph is made of ops that all have rules, so
`backward_graph(backward_graph(f))` is the derivative of the derivative (`tsr.vjp` of a
`tsr.grad` gives Hessian-vector products).
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

from .. import dtypes
from ..errors import TesseraError
from ..frontend import ops, torch_ops
from ..frontend.tensor import Tensor
from ..frontend.trace import ArgSpec, current_trace, trace
from .rules import EXTREMES, VJP_RULES, _wide, full, rule_key


def forward_function(module):
    """The one `func.func` of a traced Graph IR module."""
    functions = list(module.ops)
    if len(functions) != 1:
        raise TesseraError(f"autodiff takes a module with one graph function, got {len(functions)} ops")
    return functions[0]


def differentiable_args(f) -> list[int]:
    """The positions of `f`'s float arguments: the ones that get gradients."""
    from ..ir import graph as g

    return [i for i, a in enumerate(f.body.block.args) if g.tensor_type(a).dtype.is_float]


def float_results(f) -> list[int]:
    """The positions of `f`'s float results: the ones that take cotangents."""
    from ..ir import graph as g

    return [i for i, v in enumerate(f.body.block.last_op.operands) if g.tensor_type(v).dtype.is_float]


def backward_graph(forward_module, wrt: Sequence[int] | None = None, seed_ones: bool = False,
                   name: str | None = None, cotangent_names: Sequence[str] = (),
                   saved_names: Sequence[str] | None = None, strides: dict | None = None):
    """The backward of the forward module's function, as a Graph IR module (see the module doc).
    `wrt`: the argument positions to differentiate (default: every float argument);
    `cotangent_names`: the cotangent arguments' names (default `d_out<i>`); `saved_names`: where
    given, the values the forward saved (`saved_values`) are arguments, after the forward's, with
    these names; `strides`: the layouts the call passes cotangents and saved values in, by name
    (the forward's arguments keep theirs)."""
    from xdsl.dialects.builtin import ArrayAttr, StringAttr

    from ..ir import graph as g

    f = forward_function(forward_module)
    bindings = g.bindings_of(f)
    arg_names = [a.data for a in f.attributes["tessera.arg_names"].data]
    wrt = differentiable_args(f) if wrt is None else list(wrt)
    for i in wrt:
        if not g.tensor_type(f.body.block.args[i]).dtype.is_float:
            raise TesseraError(f"{f.sym_name.data}: argument {arg_names[i]!r} is "
                               f"{g.tensor_type(f.body.block.args[i]).dtype}; only float inputs have gradients")
    specs = _argument_specs(f, bindings)
    residuals = saved_values(f) if saved_names is not None else []
    specs += [_spec(n, r.type(f), bindings) for n, r in zip(saved_names or (), residuals, strict=True)]
    if not seed_ones:
        results = f.body.block.last_op.operands
        taken = set(arg_names)
        names = list(cotangent_names) or [cotangent_name(i, taken) for i in float_results(f)]
        for i, ct_name in zip(float_results(f), names, strict=True):
            specs.append(_spec(ct_name, g.tensor_type(results[i]), bindings, scalar_as_one=True))
    specs = [dataclasses.replace(s, strides=(strides or {}).get(s.name, s.strides)) for s in specs]
    reverse = _Reverse(f, wrt, seed_ones, residuals)
    name = name or f"{f.sym_name.data}_{'grad' if seed_ones else 'vjp'}"
    module, _ = trace(_taking(reverse, [s.name for s in specs]), name, specs, bindings, {})
    backward = forward_function(module)
    backward.attributes["tessera.result_names"] = ArrayAttr([StringAttr(f"grad_{arg_names[i]}") for i in wrt])
    return module


@dataclass(frozen=True)
class Saved:
    """A value the forward saves for its backward: the row log-sum-exp of the scores of the
    softmax at `op` (fp32, the reduced axis kept; where they may hold a huge fill, also their row
    max, `rowmax`, and the log-sum-exp of the scores less it, `logsumexp_less_max`:
    `may_hold_huge_fill`), the row `mean` or `rstd` of the norm at `op`
    (fp32, the last dim kept: `graph.norm_statistic`), or the result of the op at `op` (an
    attention's output O). `op` indexes the forward function's body, the same in every trace of it."""

    kind: str   # "logsumexp", "rowmax", "logsumexp_less_max", "mean", "rstd" or "result"
    op: int

    def value(self, f):
        return list(f.body.block.ops)[self.op].results[0]

    def type(self, f):
        from ..ir import graph as g

        t = g.tensor_type(self.value(f))
        if self.kind == "result":
            return t
        return g.TensorType.of((*t.shape[:-1], 1), dtypes.fp32)


#: ops whose vector-Jacobian products do not read their operands' values: a matmul feeding only
#: these need not be saved for the backward
_VALUE_FREE_VJPS = {"graph.add", "graph.sub", "graph.neg", "graph.cast", "graph.reshape", "graph.transpose",
                    "graph.slice", "graph.concat"}


def saved_values(f) -> list[Saved]:
    """What the compiler has the forward `f` save (module doc): per attention (a softmax over scores
    from a matmul), its rows' log-sum-exp, and its output O where the backward reads rowsum(dO * O)
    for rowsum(dP * P) (`_attention_output`); per float norm, its rows' rstd (and a layer_norm's
    mean), which its kernel computes anyway, where the backward re-read x to recompute them; and
    each other matmul's result that a backward rule reads (the input of a gated activation), which
    the backward would otherwise recompute at a GEMM's cost (a SwiGLU MLP's backward recomputed its
    two up-projections: bench/RESULTS.md, session 15)."""
    from ..ir import graph as g

    body = list(f.body.block.ops)[:-1]
    saved = []
    for i, op in enumerate(body):
        if isinstance(op, (g.LayerNormOp, g.RmsNormOp)) and g.tensor_type(op.res).dtype.is_float:
            saved += [Saved(kind, i) for kind in _norm_statistics(op)]
        if is_score_softmax(op):
            saved.append(Saved("logsumexp", i))
            saved += [Saved("rowmax", i), Saved("logsumexp_less_max", i)] if may_hold_huge_fill(op) else []
            pv = _attention_output(op, set(f.body.block.last_op.operands))
            if pv is not None:
                saved.append(Saved("result", body.index(pv)))
    taken = {s.op for s in saved if s.kind == "result"}
    for i, op in enumerate(body):
        if i not in taken and _matmul_read_by_the_backward(op):
            saved.append(Saved("result", i))
    return saved


def _norm_statistics(op) -> tuple[str, ...]:
    """The row statistics a norm's backward reads: a layer_norm's mean and rstd, an rms_norm's rstd."""
    from ..ir import graph as g

    return ("mean", "rstd") if isinstance(op, g.LayerNormOp) else ("rstd",)


def _matmul_read_by_the_backward(op) -> bool:
    """A float matmul none of whose readers is a score softmax's chain (attention recomputes its
    scores per block) and some of whose readers' gradient rules read its value."""
    from ..ir import graph as g

    if not isinstance(op, g.MatmulOp) or not g.tensor_type(op.res).dtype.is_float or _feeds_scores(op.res):
        return False
    return _value_read(op.res)


def _value_read(v, depth: int = 16) -> bool:
    """Whether a gradient rule reads `v`, or a value made from it by ops whose rules read nothing
    (a cast to fp32 before an activation: the backward needs the cast, so the matmul under it)."""
    for u in v.uses:
        r = u.operation
        if r.name == "func.return":
            continue
        if r.name not in _VALUE_FREE_VJPS and rule_key(r) != "graph.reduce.sum" and not _scaled_by_constants(r, v):
            return True
        if depth and _value_read(r.results[0], depth - 1):
            return True
    return False


def _scaled_by_constants(op, v) -> bool:
    """Whether `op` multiplies `v` by constants or divides it by them: its rule reads only the
    constants for v's gradient (and the constants take none), so it does not read `v`."""
    from ..ir import graph as g

    if op.name not in ("graph.mul", "graph.div") or (op.name == "graph.div" and op.operands[0] is not v):
        return False
    return all(isinstance(x.owner, g.ConstantOp) for x in op.operands if x is not v)


def _feeds_scores(v, depth: int = 8) -> bool:
    """Whether `v` reaches a score softmax through elementwise ops (scaling, masks, soft-capping) and
    views, as `is_score_softmax` walks back from it."""
    from ..ir import graph as g

    for u in v.uses:
        op = u.operation
        if is_score_softmax(op):
            return True
        if depth and isinstance(op, (g.ElementwiseOp, g.CastOp, g.TransposeOp, g.ReshapeOp)) \
                and _feeds_scores(op.results[0], depth - 1):
            return True
    return False


def saved_names(count: int, taken) -> list[str]:
    """Names for `count` saved values as arguments or results: `saved<i>`, each made unique among
    `taken` (which they then join)."""
    taken, names = set(taken), []
    for i in range(count):
        name = f"saved{i}"
        while name in taken:
            name = "_" + name
        taken.add(name)
        names.append(name)
    return names


def saved_positions(f) -> list[int]:
    """Where each saved value is among the results of `forward_with_residuals(f)`: a forward
    output's own position (an attention's O returned by the user), else after the outputs."""
    returned = list(f.body.block.last_op.operands)
    positions, extra = [], len(returned)
    for r in saved_values(f):
        v = r.value(f)
        if r.kind == "result" and v in returned:
            positions.append(returned.index(v))
        else:
            positions.append(extra)
            extra += 1
    return positions


def result_dims(f) -> list[tuple]:
    """The dims (names or ints) of each result of `forward_with_residuals(f)`: the forward's
    outputs, then the saved values that are not outputs already. They annotate a derivative's
    saved-value and cotangent arguments, so that a dim taken at run time by the forward is taken
    so by its backward too (`api.Derivative`)."""
    from ..ir import graph as g

    outputs = [g.tensor_type(v).shape for v in f.body.block.last_op.operands]
    extra = [r.type(f).shape for r, at in zip(saved_values(f), saved_positions(f)) if at >= len(outputs)]
    return [tuple(d) for d in (*outputs, *extra)]


def forward_with_residuals(forward_module, name: str | None = None):
    """The forward as a Graph IR module returning its outputs, then the saved values that are not
    outputs already (`saved_positions`), or None when it saves nothing. The log-sum-exps are made
    after every forward op, so each attention's flash kernel writes its own as a second output."""
    from xdsl.dialects.builtin import ArrayAttr, StringAttr

    from ..ir import graph as g

    f = forward_function(forward_module)
    residuals = saved_values(f)
    if not residuals:
        return None
    bindings = g.bindings_of(f)
    specs = _argument_specs(f, bindings)
    positions = saved_positions(f)
    n_out = len(f.body.block.last_op.operands)

    def body(*tensors):
        values = _replay(f, tensors)
        outputs = [values[v] for v in f.body.block.last_op.operands]
        extra, maxima = [], {}
        for r, at in zip(residuals, positions):
            if at < n_out:
                continue
            op = list(f.body.block.ops)[r.op]
            if r.kind == "result":
                extra.append(values[op.results[0]])
            elif r.kind in ("mean", "rstd"):
                with _provenance_of(op):
                    extra.append(ops.norm_statistic(values[op.x], r.kind, op.eps.value.data,
                                                    isinstance(op, g.LayerNormOp)))
            elif r.kind == "rowmax":   # (before the log-sum-exp less it: saved_values)
                with _provenance_of(op):
                    maxima[op] = ops.amax(_wide(values[op.input]), op.axis.data, True)
                extra.append(maxima[op])
            else:
                with _provenance_of(op):
                    extra.append(_row_logsumexp(values[op.input], op.axis.data,
                                                maxima[op] if r.kind == "logsumexp_less_max" else None))
        return (*outputs, *extra)
    module, _ = trace(_taking(body, [s.name for s in specs]), name or f"{f.sym_name.data}_saving", specs,
                      bindings, {})
    result_names = [a.data for a in f.attributes["tessera.result_names"].data]
    extra_names = [n for n, at in zip(saved_names(len(residuals), result_names), positions) if at >= n_out]
    forward_function(module).attributes["tessera.result_names"] = ArrayAttr(
        [StringAttr(n) for n in (*result_names, *extra_names)])
    return module


def _replay(f, tensors: Sequence[Tensor]) -> dict:
    """f's ops cloned into the current trace over `tensors` (its arguments): each value's Tensor."""
    from ..ir import graph as g

    t = current_trace()
    block = f.body.block
    mapping = {a: x.value for a, x in zip(block.args, tensors)}
    values = dict(zip(block.args, tensors))
    for op in list(block.ops)[:-1]:
        clone = op.clone(value_mapper=mapping)
        t.block.add_op(clone)
        for old, new in zip(op.results, clone.results):
            mapping[old] = new
            values[old] = Tensor(t, new, g.tensor_type(new).shape, g.tensor_type(new).dtype)
    return values


def _attention_output(softmax, returned: set):
    """The matmul P @ V reading an attention's probabilities P = softmax(s), when P reaches nothing
    else (through casts, as its left operand), is not returned, and O = P @ V has P's rows: then
    dP = dO @ V^T and rowsum(dP * P) = rowsum(dO * O). None otherwise."""
    from ..ir import graph as g

    chain = _cast_chain(softmax.res)
    p = chain[-1].res if chain else softmax.res
    readers = [u.operation for u in p.uses]
    if len(readers) != 1 or not isinstance(readers[0], g.MatmulOp):
        return None
    (pv,) = readers
    if pv.lhs is not p or pv.rhs is p or any(v in returned for v in (softmax.res, *(c.res for c in chain))):
        return None
    if g.tensor_type(pv.res).shape[:-1] != g.tensor_type(softmax.res).shape[:-1]:
        return None
    return pv


def cotangent_name(result: int, taken: set[str]) -> str:
    """`d_out<i>`, made unique among the argument names (which it then joins)."""
    name = f"d_out{result}"
    while name in taken:
        name = "_" + name
    taken.add(name)
    return name


def _argument_specs(f, bindings: dict[str, int]) -> list[ArgSpec]:
    """The forward function's arguments as specs of a trace over them, each in the layout it was
    passed in (`tessera.arg_strides`), which the new function's compile specializes on too."""
    from ..ir import graph as g

    arg_names = [a.data for a in f.attributes["tessera.arg_names"].data]
    strides = g.arg_strides(f)
    return [dataclasses.replace(_spec(n, g.tensor_type(a), bindings), strides=strides.get(n))
            for n, a in zip(arg_names, f.body.block.args)]


def _spec(name: str, t, bindings: dict[str, int], scalar_as_one: bool = False) -> ArgSpec:
    from ..ir import graph as g

    dims = t.shape if t.shape or not scalar_as_one else (1,)
    return ArgSpec(name, tuple(g.dim_value(d, bindings) for d in dims), t.dtype, tuple(dims))


def _taking(body, names: Sequence[str]):
    """`body` as a function of the named parameters, which is what `trace` calls it with."""
    def traced(*tensors):
        return body(*tensors)
    traced.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    return traced


class _Reverse:
    """The backward's body, run inside its trace: recompute, reverse, return (module doc)."""

    def __init__(self, forward, wrt: list[int], seed_ones: bool, saved: Sequence[Saved] = ()):
        self.forward, self.wrt, self.seed_ones, self.saved = forward, wrt, seed_ones, list(saved)
        self.values: dict = {}   # forward SSA value -> its Tensor in the backward
        self.statistics: dict = {}   # (norm op, "mean" | "rstd") -> the saved row statistic
        #: an attention's probabilities in fp32, before their rounding to the forward's dtype: what
        #: its softmax rule reads (dS = P * (dP - D)), where the rounded P is P @ V's operand only
        self.probabilities: dict = {}
        #: an attention's P @ V -> the row factor c its cotangent dO takes (`_probabilities_from_logsumexp`)
        self.row_scales: dict = {}
        self.scaled_cotangents: dict = {}   # P @ V -> c * dO, made once for its rule and the rowsum
        self.grads: dict = {}    # forward SSA value -> its cotangent so far
        self.active: set = set()   # forward values that depend on a differentiated input

    def __call__(self, *tensors: Tensor):
        block = self.forward.body.block
        n, n_saved = len(block.args), len(self.saved)
        primals, residuals, cotangents = tensors[:n], tensors[n:n + n_saved], tensors[n + n_saved:]
        body = list(block.ops)[:-1]
        self._recompute(block.args, primals, body, residuals)
        self._find_active(block.args, body)
        self._seed(block.last_op.operands, cotangents)
        for op in reversed(body):
            self._step(op)
        returned: list[Tensor] = []
        return tuple(self._result(block.args[i], returned) for i in self.wrt)

    def _recompute(self, args, primals, body, residuals: Sequence[Tensor]) -> None:
        """The forward's ops cloned into the backward, reading its arguments, the saved results
        taken from `residuals` instead (their clones, unread, are dropped); then each attention's
        probabilities as the backward reads them (`_probabilities_from_logsumexp`)."""
        from ..ir import graph as g

        t = current_trace()
        mapping = {a: p.value for a, p in zip(args, primals)}
        self.values.update(zip(args, primals))
        given = {body[r.op].results[0]: x for r, x in zip(self.saved, residuals) if r.kind == "result"}
        lse = {body[r.op]: x for r, x in zip(self.saved, residuals) if r.kind == "logsumexp"}
        maxima = {body[r.op]: x for r, x in zip(self.saved, residuals) if r.kind == "rowmax"}
        less_max = {body[r.op]: x for r, x in zip(self.saved, residuals) if r.kind == "logsumexp_less_max"}
        self.statistics = {(body[r.op], r.kind): x for r, x in zip(self.saved, residuals) if r.kind in ("mean", "rstd")}
        for op in body:
            if op.results and op.results[0] in given:
                mapping[op.results[0]] = given[op.results[0]].value
                self.values[op.results[0]] = given[op.results[0]]
                continue
            clone = op.clone(value_mapper=mapping)
            t.block.add_op(clone)
            for old, new in zip(op.results, clone.results):
                mapping[old] = new
                self.values[old] = Tensor(t, new, g.tensor_type(new).shape, g.tensor_type(new).dtype)
        for op in body:
            if is_score_softmax(op):
                self._probabilities_from_logsumexp(op, lse.get(op), maxima.get(op), less_max.get(op))

    def _probabilities_from_logsumexp(self, softmax, lse: Tensor | None = None, rowmax: Tensor | None = None,
                                      less_max: Tensor | None = None) -> None:
        """What the backward's rules read of an attention's probabilities P = softmax(s) (and of the
        casts of P that its P @ V reads): exp(s - logsumexp(s)), so that each reader fuses into a
        kernel over score blocks (`softmax_from_logsumexp`). The forward's own ops (the clones)
        keep the softmax, so its P @ V stays one flash-attention kernel, which also writes the
        log-sum-exp (made here, after every clone: fusion's order for a kernel's second output), and
        the row max where the scores may hold a huge fill (`may_hold_huge_fill`)."""
        with _provenance_of(softmax):
            scores, axis = self.values[softmax.input], softmax.axis.data
            if lse is None and may_hold_huge_fill(softmax):
                lse = _row_logsumexp(scores, axis, None)
                rowmax = ops.amax(_wide(scores), axis, True)
                less_max = _row_logsumexp(scores, axis, rowmax)
            pv = _attention_output(softmax, set(self.forward.body.block.last_op.operands))
            if rowmax is not None and pv is None:
                wide = softmax_from_logsumexp(scores, axis, less_max, rowmax)
            else:
                wide = softmax_from_logsumexp(scores, axis, lse)
                if rowmax is not None:   # (the factor dO takes: _Reverse._cotangent)
                    self.row_scales[pv] = ops.exp((lse - rowmax) - less_max)
            probs = ops.cast(wide, softmax.res.type.dtype)   # (as the forward's softmax rounds them)
        self.values[softmax.res], self.probabilities[softmax.res] = probs, wide
        for cast in _cast_chain(softmax.res):
            with _provenance_of(cast):
                probs = ops.cast(probs, cast.res.type.dtype, storage=cast.storage is not None)
            self.values[cast.res] = probs

    def _find_active(self, args, body) -> None:
        """The float values that depend on a differentiated input: only they take gradients."""
        from ..ir import graph as g

        self.active.update(args[i] for i in self.wrt)
        for op in body:
            if any(v in self.active for v in op.operands):
                self.active.update(r for r in op.results if g.tensor_type(r).dtype.is_float)

    def _seed(self, results, cotangents: Sequence[Tensor]) -> None:
        """Each float output's cotangent: its argument (a rank-0 output's viewed from [1]), or ones."""
        from ..ir import graph as g

        given = iter(cotangents)
        for v in results:
            if not g.tensor_type(v).dtype.is_float:
                continue
            y = self.values[v]
            if self.seed_ones:
                ct = full(y.shape, 1.0, y.dtype)
            else:
                ct = next(given)
                ct = ops._reshape_dims(ct, ()) if y.ndim == 0 else ct
            if v in self.active:
                self._accumulate(v, ct)

    def _step(self, op) -> None:
        """One forward op's vector-Jacobian product, added into its operands' cotangents."""
        if not op.results or op.results[0] not in self.grads:
            return
        if not any(v in self.active for v in op.operands):
            return
        rule = VJP_RULES.get(rule_key(op))
        if rule is None:
            raise TesseraError(f"no gradient rule for {rule_key(op)} (tessera.autodiff.rules.VJP_RULES)")
        y = op.results[0]
        with _provenance_of(op):
            extra = {}
            if is_score_softmax(op) and (rowsum := self._attention_rowsum(op)) is not None:
                extra["rowsum"] = rowsum
            for kind in ("mean", "rstd"):
                if (op, kind) in self.statistics:
                    extra[kind] = self.statistics[op, kind]
            if rule_key(op) in EXTREMES and ops.ties_of(op) == ops.JOINT:
                extra["counts"] = self._tie_counts(op.operands[0])
            value = self.probabilities.get(y, self.values[y])
            derived = rule(op, self._cotangent(op), value, *(self.values[v] for v in op.operands), **extra)
            for v, d in zip(op.operands, derived, strict=True):
                if d is not None and v in self.active:
                    self._accumulate(v, fit(d, self.values[v]))

    def _tie_counts(self, v) -> Tensor:
        """`v` the extremes one dim's reduction of an amax / amin over several dims took (`ops.JOINT`
        marks the reductions after it): how many elements of the call's input equal each element
        of `v`, so that the next dim's reduction splits its gradient evenly over them all, as
        torch's one reduction does (split one dim at a time, the shares multiplied: amax over
        (0, 1) of [[1, 1], [1, 0]] gave 1/4, 1/4, 1/2)."""
        op = v.owner
        x = op.operands[0]
        hit = ops.equals_extreme(self.values[x], self.values[v])
        joint = ops.ties_of(op) == ops.JOINT
        counts = ops.where(hit, self._tie_counts(x), 0.0) if joint else ops.cast(hit, dtypes.fp32)
        return ops.sum(counts, op.axis.data, keepdim=True)

    def _attention_rowsum(self, softmax) -> Tensor | None:
        """An attention's D = rowsum(dP * P) as rowsum(dO * O) (FlashAttention's preprocessing
        step) where `_attention_output` finds O: sum_j dP_ij P_ij = sum_e dO_ie O_ie, a row
        reduction over the output instead of a pass over the scores recomputing both S and dP.
        None otherwise (the softmax rule then sums dP * P)."""
        pv = _attention_output(softmax, set(self.forward.body.block.last_op.operands))
        if pv is None or pv.res not in self.grads:
            return None
        return ops.sum(_wide(self._cotangent(pv)) * _wide(self.values[pv.res]), -1, keepdim=True)

    def _cotangent(self, op) -> Tensor:
        """The cotangent `op`'s rule takes: its result's; for an attention's P @ V whose scores may
        hold a huge fill (`may_hold_huge_fill`) and whose P only it reads, times its rows' factor
        c = exp((lse - rowmax) - lse_less_max), in dO's dtype. Its probabilities are read as
        P' = exp(s - lse), as without the max apart, and P = c P': c is 1 but for lse's rounding,
        and 1/N on a row all of a huge fill, where lse rounded to the fill and P' is 1. So
        dV = P^T dO = P'^T (c dO), and dS = P (dP - rowsum(dO O)) = P' ((c dO) V^T - rowsum((c dO) O)):
        the kernels over the scores compute what they compute without the max apart, one row value
        an element. H200 bf16 4x16x2048x128, a finfo.min padding fill, the vjp: 1.02 ms with one lse,
        1.047 so, 1.073 with two row values an element (bench/RESULTS.md session 36)."""
        g = self.grads[op.results[0]]
        if op not in self.row_scales:
            return g
        if op not in self.scaled_cotangents:
            self.scaled_cotangents[op] = ops.cast(_wide(g) * self.row_scales[op], g.dtype)
        return self.scaled_cotangents[op]

    def _accumulate(self, v, grad: Tensor) -> None:
        self.grads[v] = grad if v not in self.grads else self.grads[v] + grad

    def _result(self, arg, returned: list[Tensor]) -> Tensor:
        """An argument's gradient as a value of its own (a copy where it is not: module doc)."""
        x = self.values[arg]
        grad = self.grads.get(arg)
        if grad is None:
            grad = fit(full(x.shape, 0.0, x.dtype), x)
        if _views_an_argument(grad) or any(grad.value is r.value for r in returned):
            grad = ops.own_copy(grad)
        returned.append(grad)
        return grad


def is_score_softmax(op) -> bool:
    """An attention's softmax: over the last axis of scores computed (through elementwise ops:
    scaling, masks, soft-capping) from a matmul."""
    from xdsl.ir import Operation

    from ..ir import graph as g

    if not isinstance(op, g.SoftmaxOp) or op.axis.data != g.tensor_type(op.input).rank - 1:
        return False
    work, seen = [op.input], set()
    while work:
        producer = work.pop().owner
        if producer in seen or not isinstance(producer, Operation):
            continue
        seen.add(producer)
        if isinstance(producer, g.MatmulOp):
            return True
        if isinstance(producer, (g.ElementwiseOp, g.CastOp, g.TransposeOp, g.ReshapeOp)):
            work.extend(producer.operands)
    return False


def may_hold_huge_fill(softmax) -> bool:
    """Whether an attention's scores may hold a finite fill so large that their row log-sum-exp,
    the fill plus log N for a row all of it, rounds to the fill in fp32 (P = exp(s - lse) is then 1,
    not 1/N, and the backward's dV, dQ, dK wrong where dO is not 0 on such rows): a float constant
    past HUGE_FILL computes them (torch.finfo(dtype).min, HuggingFace's padding masks; -1e9; the 1e9
    scaling a 0/1 mask, (keep - 1) * 1e9), or
    a float tensor other than the matmuls' operands read along the keys' dim or a query row's (an
    additive mask, `graph.masks_rows_or_keys`: its values are unknown). Such attentions save their
    row max apart (`Saved` "rowmax")."""
    from xdsl.ir import BlockArgument, Operation

    from ..ir import graph as g

    scores = g.tensor_type(softmax.input).shape
    work, seen = [softmax.input], set()
    while work:
        v = work.pop()
        producer = v.owner
        if isinstance(producer, BlockArgument) or not isinstance(producer, Operation):
            t = g.tensor_type(v)
            if t.dtype.is_float and g.masks_rows_or_keys(t.shape, scores):
                return True
            continue
        if producer in seen or isinstance(producer, g.MatmulOp):
            continue
        seen.add(producer)
        if isinstance(producer, g.ConstantOp) and g.tensor_type(v).dtype.is_float \
                and HUGE_FILL < abs(g.float_constant_value(producer)) < math.inf:
            return True
        work.extend(producer.operands)
    return False


#: fills past HUGE_FILL in magnitude (one ulp of it 2^-9: P off by 0.1% at most in a row all of it)
#: have the row max saved apart (`may_hold_huge_fill`); BERT's -10000 does not
HUGE_FILL = 2.0 ** 14


def _row_logsumexp(x: Tensor, axis: int, rowmax: Tensor | None) -> Tensor:
    """The row log-sum-exp of x in fp32, of x less `rowmax` where given."""
    wide = _wide(x)
    return torch_ops._logsumexp(wide if rowmax is None else wide - rowmax, axis)


def softmax_from_logsumexp(x: Tensor, axis: int, lse: Tensor | None = None, rowmax: Tensor | None = None) -> Tensor:
    """softmax(x) recomputed as exp(x - lse), lse = logsumexp(x) (or a saved one), in fp32; with
    the row max apart (`may_hold_huge_fill`), exp((x - rowmax) - lse), lse of x - rowmax. An
    attention backward reads the probabilities in
    several places (dV, and dS = P * (dP - D) for dQ and dK); in this form each reader recomputes
    them from the scores and a row's log-sum-exp (one number per row), so fusion makes every reader
    one kernel looping over key blocks (`passes/recompute.py`) and the S x S probabilities never
    reach memory. The log-sum-exp is one `graph.reduce` of kind logsumexp, which the forward's
    flash-attention kernel writes beside its output."""
    wide = _wide(x)
    lse = torch_ops._logsumexp(wide if rowmax is None else wide - rowmax, axis) if lse is None else lse
    if rowmax is None:
        return ops.exp(wide - lse)
    # (where another op reads P too: else `_Reverse._cotangent` takes the max into dO) in base 2, the
    # log-sum-exp's product a row's: (x - rowmax) * log2(e) - lse * log2(e), a sub and an fma an
    # element as exp(x - lse) took; the second row value costs registers (H200 bf16 4x16x2048x128,
    # a finfo.min padding fill: the vjp 1.016 -> 1.073 ms, bench/RESULTS.md session 36)
    return ops.exp2((wide - rowmax) * LOG2E - lse * LOG2E)


LOG2E = 1.4426950408889634


def _cast_chain(v) -> list:
    """The casts reading `v` one after another, each the only reader of the one before."""
    from ..ir import graph as g

    chain = []
    while len(uses := list(v.uses)) == 1 and isinstance((user := uses[0].operation), g.CastOp):
        chain.append(user)
        v = user.res
    return chain


def _views_an_argument(x: Tensor) -> bool:
    """Whether x is an argument of the function or a view (reshape) of one: no kernel computes it."""
    from xdsl.ir import BlockArgument

    from ..ir import graph as g

    source = x.value
    while isinstance(source.owner, g.ReshapeOp):
        source = source.owner.input
    return isinstance(source, BlockArgument)


def fit(grad: Tensor, x: Tensor) -> Tensor:
    """`grad` (in the broadcast shape of an op's result) summed back to x's shape, with x's dims
    and dtype: over the leading dims x lacks and the dims where x has size 1. The dtype is a storage
    cast (`graph.CastOp.storage`): a kernel computing on the gradient rounds it where it stores
    it (H200 bf16 attention backward, dS rounded once: 8x16x4096x128 7.28 -> 6.77 ms)."""
    t = current_trace()
    lead = grad.ndim - x.ndim
    axes = [*range(lead), *(lead + i for i, d in enumerate(x.dims)
                            if t.size(d) == 1 and t.size(grad.dims[lead + i]) != 1)]
    if axes:
        grad = ops.sum(grad, axes, keepdim=True)
    if grad.dims != x.dims:
        grad = ops._reshape_dims(grad, x.dims)
    return ops.cast(grad, x.dtype, storage=True)


@contextmanager
def _provenance_of(op):
    """The ops made inside take `op`'s provenance (`tessera.loc`, `tessera.regions`)."""
    from ..ir import provenance

    block = current_trace().block
    before = block.last_op
    yield
    carried = {k: v for k, v in op.attributes.items() if k.startswith(provenance.PREFIX)}
    new = before.next_op if before is not None else block.first_op
    while new is not None:
        for key in (provenance.LOC, provenance.REGIONS):
            new.attributes.pop(key, None)
        new.attributes.update(carried)
        new = new.next_op
