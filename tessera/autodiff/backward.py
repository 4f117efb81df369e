"""Reverse-mode autodiff as a Graph IR transformation: `backward_graph(forward) -> backward`.

The backward of a traced function `f(x1, ..., xn) -> (y1, ..., ym)` is an ordinary Graph IR
function `f_vjp(x1, ..., xn, dy1, ..., dym) -> (dx1, ..., dxk)`: the forward's inputs, one
cotangent per float output, and one gradient per differentiable (float) input. It is traced
like any function (`frontend.trace.trace`), so it carries `tessera.dims`, argument and result
names and every op's `tessera.loc`, prints with `--dump-ir` and parses back, and compiles
through the same fusion, tiling, targets and CPU interpreter.

How it is built, in one trace:

1. recompute: the forward's ops are cloned into the backward function, reading its arguments
   (the forward's `tessera.loc`s come with them). What the backward reads of the forward is
   recomputed, not saved: the forward stays the function the user wrote (no extra outputs, no
   buffers kept between the calls), and fusion is free to fuse the recomputed forward into the
   backward's kernels (a softmax's probabilities into the matmuls that read them). An
   attention's softmax is recomputed as exp(scores - logsumexp(scores)) (`softmax_from_logsumexp`),
   so that each of its readers fuses into one kernel over score blocks. Issue 14's
   next step is the compiler choosing what a forward saves instead (attention's row log-sum-exp,
   norms' mean and rstd), which turns these clones into extra forward outputs and backward
   inputs;
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

import inspect
from contextlib import contextmanager
from typing import Sequence

from .. import dtypes
from ..errors import TesseraError
from ..frontend import ops, torch_ops
from ..frontend.tensor import Tensor
from ..frontend.trace import ArgSpec, current_trace, trace
from .rules import VJP_RULES, full, rule_key


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
                   name: str | None = None, cotangent_names: Sequence[str] = ()):
    """The backward of the forward module's function, as a Graph IR module (see the module doc).
    `wrt`: the argument positions to differentiate (default: every float argument);
    `cotangent_names`: the cotangent arguments' names (default `d_out<i>`)."""
    from xdsl.dialects.builtin import ArrayAttr, StringAttr

    from ..ir import graph as g

    f = forward_function(forward_module)
    bindings = {k: v.value.data for k, v in f.attributes["tessera.dims"].data.items()}
    arg_names = [a.data for a in f.attributes["tessera.arg_names"].data]
    wrt = differentiable_args(f) if wrt is None else list(wrt)
    for i in wrt:
        if not g.tensor_type(f.body.block.args[i]).dtype.is_float:
            raise TesseraError(f"{f.sym_name.data}: argument {arg_names[i]!r} is "
                               f"{g.tensor_type(f.body.block.args[i]).dtype}; only float inputs have gradients")
    specs = [_spec(n, g.tensor_type(a), bindings) for n, a in zip(arg_names, f.body.block.args)]
    if not seed_ones:
        results = f.body.block.last_op.operands
        taken = set(arg_names)
        names = list(cotangent_names) or [cotangent_name(i, taken) for i in float_results(f)]
        for i, ct_name in zip(float_results(f), names, strict=True):
            specs.append(_spec(ct_name, g.tensor_type(results[i]), bindings, scalar_as_one=True))
    reverse = _Reverse(f, wrt, seed_ones)
    name = name or f"{f.sym_name.data}_{'grad' if seed_ones else 'vjp'}"
    module, _ = trace(_taking(reverse, [s.name for s in specs]), name, specs, bindings, {})
    backward = forward_function(module)
    backward.attributes["tessera.result_names"] = ArrayAttr([StringAttr(f"grad_{arg_names[i]}") for i in wrt])
    return module


def cotangent_name(result: int, taken: set[str]) -> str:
    """`d_out<i>`, made unique among the argument names (which it then joins)."""
    name = f"d_out{result}"
    while name in taken:
        name = "_" + name
    taken.add(name)
    return name


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

    def __init__(self, forward, wrt: list[int], seed_ones: bool):
        self.forward, self.wrt, self.seed_ones = forward, wrt, seed_ones
        self.values: dict = {}   # forward SSA value -> its Tensor in the backward
        self.grads: dict = {}    # forward SSA value -> its cotangent so far
        self.active: set = set()   # forward values that depend on a differentiated input

    def __call__(self, *tensors: Tensor):
        block = self.forward.body.block
        primals, cotangents = tensors[:len(block.args)], tensors[len(block.args):]
        body = list(block.ops)[:-1]
        self._recompute(block.args, primals, body)
        self._find_active(block.args, body)
        self._seed(block.last_op.operands, cotangents)
        for op in reversed(body):
            self._step(op)
        returned: list[Tensor] = []
        return tuple(self._result(block.args[i], returned) for i in self.wrt)

    def _recompute(self, args, primals, body) -> None:
        """The forward's ops cloned into the backward, reading its arguments."""
        from ..ir import graph as g

        t = current_trace()
        mapping = {a: p.value for a, p in zip(args, primals)}
        self.values.update(zip(args, primals))
        for op in body:
            if is_score_softmax(op):
                with _provenance_of(op):
                    probs = softmax_from_logsumexp(self.values[op.input], op.axis.data)
                mapping[op.res] = probs.value
                self.values[op.res] = probs
                continue
            clone = op.clone(value_mapper=mapping)
            t.block.add_op(clone)
            for old, new in zip(op.results, clone.results):
                mapping[old] = new
                self.values[old] = Tensor(t, new, g.tensor_type(new).shape, g.tensor_type(new).dtype)

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
            derived = rule(op, self.grads[y], self.values[y], *(self.values[v] for v in op.operands))
            for v, d in zip(op.operands, derived, strict=True):
                if d is not None and v in self.active:
                    self._accumulate(v, fit(d, self.values[v]))

    def _accumulate(self, v, grad: Tensor) -> None:
        self.grads[v] = grad if v not in self.grads else self.grads[v] + grad

    def _result(self, arg, returned: list[Tensor]) -> Tensor:
        """An argument's gradient as a value of its own (a copy where it is not: module doc)."""
        x = self.values[arg]
        grad = self.grads.get(arg)
        if grad is None:
            grad = fit(full(x.shape, 0.0, x.dtype), x)
        if _views_an_argument(grad) or any(grad.value is r.value for r in returned):
            grad = ops.where(True, grad, grad)
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


def softmax_from_logsumexp(x: Tensor, axis: int) -> Tensor:
    """softmax(x) recomputed as exp(x - logsumexp(x)), in fp32, rounded to x's dtype as the
    forward's softmax is. An attention backward reads the probabilities in three places (dV, and
    dP * P twice); in this form each reader recomputes them from the scores and a row's
    log-sum-exp (one number per row), so fusion makes every reader one kernel looping over key
    blocks (`passes/recompute.py`) and the S x S probabilities never reach memory. (A forward that
    saves the log-sum-exp would pass it in here: issue 14.)"""
    wide = ops.cast(x, dtypes.fp32) if x.dtype.bits < 32 else x
    lse = torch_ops._logsumexp(wide, axis)
    return ops.cast(ops.exp(wide - lse), x.dtype)


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
    and dtype: over the leading dims x lacks and the dims where x has size 1."""
    t = current_trace()
    lead = grad.ndim - x.ndim
    axes = [*range(lead), *(lead + i for i, d in enumerate(x.dims)
                            if t.size(d) == 1 and t.size(grad.dims[lead + i]) != 1)]
    if axes:
        grad = ops.sum(grad, axes, keepdim=True)
    if grad.dims != x.dims:
        grad = ops._reshape_dims(grad, x.dims)
    return ops.cast(grad, x.dtype)


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
