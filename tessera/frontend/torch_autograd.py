"""PyTorch integration: `@tsr.function`s in torch autograd and `torch.compile` (issue 14, item 3).

    y = attention(q, k, v)          # q requires grad: y has a grad_fn
    y.sum().backward()              # runs Tessera's backward (PTX on CUDA, the interpreter on CPU)
    op = tsr.torch_op(attention, q, k, v)   # torch.ops.tessera.attention

One mechanism serves both: each `Function`, for one list of argument kinds (a tensor, a float, an
int, ... per parameter), is a torch custom op (`torch.library.custom_op`, named
`tessera::<function name>`, with `_<n>` appended where that name is taken) with
- an implementation per device: the ordinary Tessera call (compiled PTX kernels on CUDA tensors,
  the CPU interpreter on CPU tensors);
- a fake implementation (`register_fake`): the output shapes and dtypes from the trace, Tessera's
  shape inference, which compiles no kernel; so `torch.compile` traces through the op;
- autograd (`register_autograd`): the op's forward is fn `Saving` what the compiler chose for its
  backward to read rather than recompute (an attention's row log-sum-exp and output: its
  results are fn's outputs, then those; calls see fn's outputs only), and it saves its tensor
  inputs and those values (`ctx.save_for_backward`); the backward calls the op of a `Derivative`
  for just the inputs that `ctx.needs_input_grad` asks for. That derivative is itself such an
  op, with autograd, so double backward (`create_graph=True`, Hessian-vector products) works:
  Graph IR autodiff of the backward graph, for which the first backward recomputes what was
  saved (a saved value is a constant to the graph that reads it).

Why a custom op rather than a bare `torch.autograd.Function`: the same object is what
`torch.compile(fullgraph=True)` needs (a bare autograd.Function calling Tessera's Python call path
would break the graph), and custom ops' autograd is an autograd.Function underneath.

When the torch path is taken (`Function.__call__` asks `wanted`): a torch tensor argument that
requires grad under grad mode, or torch.compile (Dynamo) tracing the call. Every other call takes
Tessera's ordinary path: no custom-op dispatch, no autograd node; what it costs is one
`requires_grad` read per argument (`function._torch_path`) and, when one is a torch tensor, two
flags asked of torch (grad mode, Dynamo): about 0.1 us per tensor argument on the CPU where this
was measured. Calls on NumPy or CuPy arrays never import torch.

Registration is automatic, on the first call that takes the torch path with those argument kinds
(registration traces the function once, for its number of outputs), eagerly or while Dynamo
traces the call (`_register_while_tracing`), so nothing has to be registered before
`torch.compile`. Automatic, because a user of a model should not have to list the Tessera
functions it calls; explicit `tsr.torch_op(fn, *example_args)` returns the op without calling it
(to call or inspect it directly, or to register ahead of a trace with dynamic shapes).

Argument kinds: a tensor of rank >= 1 is `Tensor`; Python numbers, bools and strings are
`float`/`int`/`bool`/`str` (constants of the trace, as always: no gradient); a 0-d tensor is
passed as its number (`.item()`, what Tessera's trace makes of it anyway); None is `Tensor?`.
Only positional arguments: keyword arguments of a Tessera call are compile options, which the
torch path does not take.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
from typing import Any, Sequence

import torch

from ..autodiff.api import Derivative, saving
from ..errors import ArgumentKindError, TesseraError
from ..runtime import interop

_is_compiling = torch.compiler.is_dynamo_compiling
_grad_enabled = torch.is_grad_enabled
_names = itertools.count()
_taken: set[str] = set()   # op names this process registered in the `tessera` namespace


def wanted(requires_grad: bool) -> bool:
    """Whether a call with torch tensor arguments goes through the torch op: Dynamo tracing it, or
    a tensor that requires grad (`requires_grad`: any does) under grad mode."""
    return _is_compiling() or (requires_grad and _grad_enabled())


def call(fn, args: Sequence, options: dict):
    """`fn(*args)` through its torch op (autograd recorded, or traced by torch.compile)."""
    if options:
        raise TesseraError(f"{fn.name}: compile options ({', '.join(options)}) are not taken on the torch "
                           f"autograd / torch.compile path; call it without them")
    full = _arguments(fn, args)
    kinds = _kinds(fn, full)
    ops = getattr(fn, "_torch_ops", None)
    op = ops.get(kinds) if ops is not None else None
    if op is not None:
        return _outputs(op.overload(*full), op.n_outputs)
    if _is_compiling():   # Dynamo cannot trace a registration: it runs it (`_register_while_tracing`)
        layout = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in full)
        name, n_outputs = _register_while_tracing(id(fn), kinds, layout)
        return _outputs(getattr(torch.ops.tessera, name)(*full), n_outputs)
    op = _register(fn, kinds, full)
    return _outputs(op.overload(*full), op.n_outputs)


def _outputs(results, n_outputs: int):
    """The function's outputs among the op's results (the values its forward saves follow them)."""
    if not isinstance(results, tuple):
        return results
    return results[0] if n_outputs == 1 else results[:n_outputs]


def torch_op(fn, *example_args):
    """`fn` as a torch custom op (`torch.ops.tessera.<name>`, see the module doc) for the argument
    kinds of `example_args` (all of `fn`'s parameters without defaults), registered now if it is
    not yet. Call it with `fn`'s positional arguments; it returns fn's outputs, then the values
    fn's forward saves for its backward (none for most functions; an attention's row
    log-sum-exp, fp32 with the key dim kept as 1)."""
    from .function import Function, Kernel

    if isinstance(fn, Kernel) or not isinstance(fn, Function):
        raise TesseraError(f"torch_op takes a @tsr.function, got {type(fn).__name__}")
    full = _arguments(fn, example_args)
    kinds = _kinds(fn, full)
    op = getattr(fn, "_torch_ops", {}).get(kinds) or _register(fn, kinds, full)
    return op.op


# --- arguments ------------------------------------------------------------------------------------

def _arguments(fn, args: Sequence) -> list:
    """`args` with the defaults of the parameters left out, and 0-d tensors as their numbers."""
    params = list(fn.signature.parameters.values())
    if len(args) > len(params):
        raise TesseraError(f"{fn.name} takes {len(params)} arguments, got {len(args)}")
    missing = [p.name for p in params[len(args):] if p.default is p.empty]
    if missing:
        raise TesseraError(f"{fn.name}: {', '.join(map(repr, missing))} missing")
    full = [*args, *(p.default for p in params[len(args):])]
    return [x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x for x in full]


def _kinds(fn, full: Sequence) -> tuple[str, ...]:
    """The schema type of each argument (module doc)."""
    return tuple(_kind(fn, name, x) for name, x in zip(fn.signature.parameters, full))


def _kind(fn, name: str, x) -> str:
    if isinstance(x, torch.Tensor):
        return "Tensor"
    if x is None:
        return "Tensor?"
    for t, kind in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if isinstance(x, t):
            return kind
    raise ArgumentKindError(f"{fn.name}: argument {name!r} is a {type(x).__name__}; with torch tensors that "
                            f"require grad (or under torch.compile) pass torch tensors, numbers, strings or None")


# --- the op ---------------------------------------------------------------------------------------

class _TorchOp:
    """`fn` for one list of argument kinds as a torch custom op, with its fake implementation and
    its autograd (module doc)."""

    def __init__(self, fn, kinds: tuple[str, ...], full: Sequence):
        self.fn, self.kinds = fn, kinds
        self.params = list(fn.signature.parameters)
        results = _output_specs(fn, full)
        self.float_outputs = tuple(i for i, (_, dt) in enumerate(results) if dt.is_float)
        self.n_outputs = len(results)
        # the op's results: fn's outputs, then what its forward saves for the backward (`Saving`).
        # A derivative's op saves nothing: a second backward (create_graph=True) that reads its
        # results recomputes what it needs (`_backward`), where saving would make every first
        # backward pay for it (an attention's derivative would save its two S x S score products:
        # two GEMMs and 2 x B x H x S x S elements written each step).
        saves = not isinstance(fn, Derivative)
        tensors, constants = fn._split_args(list(full))
        layout = saving(fn).layout(tensors, constants)
        self.layout = layout if saves else layout._replace(saved=(), dims=layout.dims[:layout.n_outputs])
        self.forward = saving(fn) if saves else fn
        self.saved_positions = self.layout.saved
        self.n_results = len(_output_specs(self.forward, full))
        self.name = _op_name(fn.name)
        self.op = torch.library.custom_op(f"tessera::{self.name}", self._impl, mutates_args=(),
                                          schema=self._schema())
        self.op.register_fake(self._fake)
        self.op.register_autograd(self._backward, setup_context=self._setup_context)
        self.overload = getattr(torch.ops.tessera, self.name).default   # what calls go through

    def _schema(self) -> str:
        params = ", ".join(f"{kind} {name}" for kind, name in zip(self.kinds, self.params))
        returns = "Tensor" if self.n_results == 1 else f"({', '.join(['Tensor'] * self.n_results)})"
        return f"({params}) -> {returns}"

    def _impl(self, *args):
        """The Tessera call (of fn saving what its backward reads) on the op's tensors, detached
        (below autograd: the op's autograd records the call) and copied where their address is
        not aligned (`_kernel_ready`)."""
        ready = [_kernel_ready(x) if isinstance(x, torch.Tensor) else x for x in args]
        outs = self.forward(*ready)
        outs = outs if isinstance(outs, tuple) else (outs,)
        # what is saved follows from the function's structure, which a function branching on its
        # shapes could change between calls of one op: an error, never a wrong value saved
        saved = saving(self.fn).layout(*self.fn._split_args(ready)).saved if self.saved_positions else ()
        if len(outs) != self.n_results or saved != self.saved_positions:
            raise TesseraError(f"{self.fn.name} returned {len(outs)} results (saved values at "
                               f"{saved}) where its torch op "
                               f"tessera::{self.name} declares {self.n_results} (at {self.saved_positions}); "
                               f"a function whose outputs change with its shapes needs one op per structure")
        if not outs[0].is_cuda:   # CPU results of rank 0 come back as [1] (interop.host_like); the fake says ()
            outs = tuple(o.reshape(shape) for o, (shape, _) in zip(outs, _output_specs(self.forward, args)))
        return outs if self.n_results > 1 else outs[0]

    def _fake(self, *args):
        """Empty tensors of the results' shapes and dtypes, from the trace (no kernels compiled)."""
        first = next(x for x in args if isinstance(x, torch.Tensor))
        outs = [first.new_empty(shape, dtype=interop.torch_dtype(dt)) for shape, dt in _output_specs(self.forward, args)]
        return tuple(outs) if self.n_results > 1 else outs[0]

    def _setup_context(self, ctx, inputs, output) -> None:
        """Saves the tensor inputs, the values the forward saved for the backward, and the other
        arguments (the backward recomputes the rest)."""
        ctx.tensor_positions = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.constants = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        outs = output if isinstance(output, tuple) else (output,)
        ctx.save_for_backward(*[inputs[i] for i in ctx.tensor_positions], *[outs[i] for i in self.saved_positions])
        ctx.output_types = [(tuple(o.shape), o.dtype) for o in outs]

    def _backward(self, ctx, *grads):
        return _backward(self, ctx, grads)


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """`x` detached, and copied where Tessera's kernels could not read it as it is (at an address
    not 16-byte aligned): torch.compile and autograd hand the op tensors that eager code would
    not have made (views into larger buffers). A strided tensor stays as it is: the call compiles
    for its strides, or copies it and says why (`Compiled.copied_args`)."""
    x = x.detach()
    if x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _register(fn, kinds: tuple[str, ...], full: Sequence) -> _TorchOp:
    op = _TorchOp(fn, kinds, full)
    fn.__dict__.setdefault("_torch_ops", {})[kinds] = op
    return op


class _Layout:
    """A tensor argument as the trace reads it, shape and dtype, for a registration under Dynamo."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.shape, self.dtype = shape, dtype


#: the attribute `torch._dynamo.assume_constant_result` sets on a function, all it does (torch
#: 2.11-2.13, torch/_dynamo/decorators.py; tests/frontend/test_torch_autograd.py checks it)
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"


def _assume_constant_result(fn):
    """`torch._dynamo.assume_constant_result(fn)` without importing Dynamo where it is not imported
    yet: the import costs 1-5 s, which every process passing a torch tensor to a Tessera function
    would pay for a marker only torch.compile reads (by then Dynamo is imported)."""
    if "torch._dynamo" in sys.modules:
        return torch._dynamo.assume_constant_result(fn)
    setattr(fn, DYNAMO_CONSTANT_MARK, True)
    return fn


@_assume_constant_result
def _register_while_tracing(fn_id: int, kinds: tuple[str, ...], layout: tuple) -> tuple[str, int]:
    """The op's name and fn's number of outputs, registering the op first: what Dynamo does with a
    call whose op is not yet registered. Marked as a constant result, so Dynamo runs it at trace
    time rather than tracing it (it could not: registration is not tensor code), with constant
    arguments only: the
    tensors' shapes and dtypes (static shapes; a dynamic one breaks the graph here:
    `tsr.torch_op` beforehand avoids that), and the Function by its `id` (torch 2.11's Dynamo
    passes no other object to such a function; `id` it takes, guarding on the object). The
    Function is alive meanwhile: the frame being traced holds it."""
    fn = ctypes.cast(fn_id, ctypes.py_object).value
    full = [_Layout(*x) if isinstance(x, tuple) else x for x in layout]
    op = fn.__dict__.get("_torch_ops", {}).get(kinds) or _register(fn, kinds, full)
    return op.name, op.n_outputs


def _op_name(name: str) -> str:
    """`name`, or `name_<n>` where this process (or another library) took it in `tessera`."""
    candidate = name
    while candidate in _taken or _defined(candidate):
        candidate = f"{name}_{next(_names)}"
    _taken.add(candidate)
    return candidate


def _defined(name: str) -> bool:
    try:
        return hasattr(torch.ops.tessera, name)
    except (AttributeError, RuntimeError):
        return False


def _output_specs(fn, args: Sequence) -> list[tuple[tuple[int, ...], Any]]:
    """(shape, Tessera dtype) of each output of `fn(*args)`, from its trace: Tessera's shape
    inference (real or fake tensors alike; only shapes and dtypes are read). Cached per call
    signature on `fn`, as its compiles are."""
    from .zero_size import ZeroSizeCall

    tensors, constants = fn._split_args(list(args))
    key = (tuple((tuple(int(s) for s in x.shape), str(x.dtype)) for _, x in tensors),
           tuple(sorted(constants.items())), fn.captures.key())
    known = fn.__dict__.setdefault("_torch_output_specs", {})
    if key not in known:
        _, specs = fn.arg_specs(tensors)
        known[key] = ZeroSizeCall(fn.trace(specs, constants)).results
    return known[key]


# --- autograd -------------------------------------------------------------------------------------

def _backward(op: _TorchOp, ctx, grads) -> tuple:
    """The gradients of the inputs that need them, from the op of fn's derivative for just those
    inputs; None for the rest (non-float and constant arguments, inputs not requiring grad). The
    derivative reads what the forward saved, except under `create_graph=True` (grad mode on in the
    backward): a derivative of a derivative must see how the saved values depend on the inputs, so
    that one recomputes them."""
    inputs = list(ctx.constants)
    tensors = ctx.saved_tensors
    for i, x in zip(ctx.tensor_positions, tensors):
        inputs[i] = x
    wrt = [i for i in ctx.tensor_positions if ctx.needs_input_grad[i] and inputs[i].dtype.is_floating_point]
    if not wrt:
        return (None,) * len(inputs)
    cotangents = [_cotangent(grads[i], *ctx.output_types[i]) for i in op.float_outputs]
    saved = list(tensors[len(ctx.tensor_positions):]) if not torch.is_grad_enabled() else []
    derivative = _derivative(op, tuple(op.params[i] for i in wrt), len(saved))
    full = [*inputs, *saved, *cotangents]
    kinds = (*op.kinds, *("Tensor",) * (len(saved) + len(cotangents)))
    dop = derivative.__dict__.get("_torch_ops", {}).get(kinds) or _register(derivative, kinds, full)
    results = _outputs(dop.overload(*full), dop.n_outputs)
    results = iter(results if isinstance(results, tuple) else (results,))
    return tuple(next(results) if i in wrt else None for i in range(len(inputs)))


def _cotangent(grad, shape: tuple[int, ...], dtype) -> torch.Tensor:
    """An output's gradient as a backward argument: its dtype, contiguous (torch's may be expanded
    views), a 0-d one as shape [1] (a 0-d tensor would be a constant of the trace)."""
    grad = grad.to(dtype).contiguous()
    return grad.reshape(1) if len(shape) == 0 else grad


def _derivative(op: _TorchOp, wrt_names: tuple[str, ...], n_saved: int):
    """fn's vjp for the inputs `wrt_names`, reading `n_saved` saved values, kept on fn so repeated
    backwards reuse its compiles."""
    from ..autodiff.backward import cotangent_name, saved_names

    fn = op.fn
    known = fn.__dict__.setdefault("_torch_derivatives", {})
    key = (op.float_outputs, wrt_names, n_saved)
    if key not in known:
        saved = saved_names(n_saved, fn.signature.parameters)
        taken = set(fn.signature.parameters) | set(saved)
        cotangents = [cotangent_name(i, taken) for i in op.float_outputs]
        known[key] = _PartialVJP(fn, wrt_names, cotangents, saved,
                                 op.layout.annotations(fn, saved, cotangents, op.float_outputs))
    return known[key]


class _PartialVJP(Derivative):
    """A `Derivative` in `tsr.vjp`'s form (the forward's parameters, the values it saved where
    given, then one cotangent per float output) whose gradients are those of the inputs
    `wrt_names` only: the backward graph differentiates nothing torch does not ask for."""

    def __init__(self, forward, wrt_names: Sequence[str], cotangent_names: Sequence[str],
                 saved_names: Sequence[str] = (), annotations: dict | None = None):
        super().__init__(forward, cotangent_names=cotangent_names, saved_names=saved_names, annotations=annotations)
        self.wrt_names = tuple(wrt_names)
        self.name = self.__name__ = f"{forward.name}_vjp_{'_'.join(self.wrt_names)}"
        self.captures = _TaggedCaptures(forward.captures, ("vjp", self.wrt_names, len(self.saved_names)))

    def _wrt(self, f, primal, constants: dict) -> list[int]:
        names = [a.name for a in primal]
        return [names.index(n) for n in self.wrt_names]


class _TaggedCaptures:
    """The forward's captures, with a tag in their key saying which derivative this is. Compile
    keys, in process and on disk (the warm-start cache: `runtime/warm.function_key`), hold the
    function's code, signature and `captures.key()`; derivatives of one forward for different
    inputs share the code and the signature, so the tag is what tells their compiles apart."""

    def __init__(self, captures, tag: tuple):
        self.captures, self.tag = captures, tag

    def key(self) -> tuple:
        return (self.captures.key(), self.tag)

    def identity_guards(self, key: tuple) -> tuple | None:
        return self.captures.identity_guards(key[0])
