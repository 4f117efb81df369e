"""`tsr.vjp` and `tsr.grad`, in JAX's conventions, over `@tsr.function`s.

    out, f_vjp = tsr.vjp(f, x, w)       # out = f(x, w)
    dx, dw = f_vjp(dout)                # one gradient per argument of f (None for non-floats)
    dloss = tsr.grad(loss, argnums=(0, 1))
    dx, dw = dloss(x, w)                # loss returns one 0-d float tensor

The derivatives are `Derivative`s: `Function`s whose trace is the backward graph of the
forward's trace (`backward.backward_graph`), so they compile once per call signature, are
cached, dump their IR (`TESSERA_DUMP_IR`), and run like any function: on the CPU interpreter
with NumPy arrays, as PTX with CUDA tensors, results in the arguments' kind.

Where Tessera differs from JAX, for want of what Tessera's calls take:
- a 0-d array or a Python number passed to `f` is a constant of its trace, so it has no
  gradient: `f_vjp` gives None for it, and `tsr.grad` refuses it as an `argnums`;
- an int or bool array gets None from `f_vjp` (JAX gives a float0 zero); `tsr.grad` refuses
  one as an `argnums`, as JAX does;
- the cotangent of an int or bool output is ignored (pass None); a float output's cotangent
  must have its shape and dtype, as in JAX.
"""
from __future__ import annotations

import inspect
from typing import Any, NamedTuple, Sequence

from .. import dtypes
from ..errors import ArgumentKindError, DTypeError, ShapeError, TesseraError
from ..frontend.function import Function, Kernel
from ..frontend.tensor import TensorSpec
from ..frontend.trace import ArgSpec


class Derivative(Function):
    """The backward of a `Function` as a `Function` of its own: the forward's parameters, then one
    cotangent per float output (`tsr.vjp`), or no cotangents and the gradient of the one scalar
    output (`tsr.grad`, `argnums`). Its trace is the backward graph of the forward's trace."""

    def __init__(self, forward: Function, argnums: int | Sequence[int] | None = None,
                 cotangent_names: Sequence[str] = (), saved_names: Sequence[str] = (),
                 annotations: dict[str, TensorSpec] | None = None):
        super().__init__(forward.fn, space=forward.space, **_marks(forward))
        self.takes_dynamic_dims = forward.takes_dynamic_dims
        self.forward, self.argnums, self.cotangent_names = forward, argnums, tuple(cotangent_names)
        self.saved_names = tuple(saved_names)
        self.seed_ones = argnums is not None
        self.name = self.__name__ = f"{forward.name}_{'grad' if self.seed_ones else 'vjp'}"
        self.captures = forward.captures
        self.annotations = dict(forward.annotations)
        # and the saved values' and cotangents' dims, as the forward's trace names them (`Layout.annotations`):
        # they key the calls and take dims at run time, where the call's own checks stay the forward's
        self._dim_annotations = {**forward.dim_annotations, **(annotations or {})}
        # keyword-only, so they may follow parameters with defaults; calls still pass them positionally
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in (*self.saved_names,
                                                                              *self.cotangent_names)]
        self.signature = forward.signature.replace(parameters=[*forward.signature.parameters.values(), *extra])

    @property
    def dim_annotations(self) -> dict:
        return self._dim_annotations

    def trace(self, args: Sequence[ArgSpec], constants: dict[str, Any] | None = None,
              dynamic: frozenset[str] = frozenset(), index_bits: int = 64, aligned: frozenset[str] = frozenset()):
        """The backward graph for these argument specs (the forward's, the saved values' where it
        takes them, then the cotangents'), the `dynamic` dims taken at run time as the forward's."""
        from .backward import backward_graph, forward_function

        primal = [a for a in args if a.name not in self.cotangent_names and a.name not in self.saved_names]
        module = _forward_trace(self.forward, primal, constants, dynamic, index_bits, aligned)
        f = forward_function(module)
        if self.seed_ones:
            _check_scalar_output(f, self.forward.name)
        else:
            _check_cotangents(f, [a for a in args if a.name in self.cotangent_names], self.forward.name, primal)
        wrt = self._wrt(f, primal, constants or {})
        return backward_graph(module, wrt, self.seed_ones, self.name, self.cotangent_names,
                              self.saved_names or None,
                              strides={a.name: a.strides for a in args if a.strides is not None})

    def _wrt(self, f, primal: Sequence[ArgSpec], constants: dict) -> list[int]:
        """The graph argument positions to differentiate: `argnums`' (`tsr.grad`), else every float
        argument's."""
        from .backward import differentiable_args

        return self._argnum_positions(f, primal, constants) if self.seed_ones else differentiable_args(f)

    def _argnum_positions(self, f, primal: Sequence[ArgSpec], constants: dict) -> list[int]:
        """The graph argument positions of `argnums`, each a float tensor argument."""
        params = list(self.forward.signature.parameters)
        tensor_names = [a.name for a in primal]
        positions = []
        for n in _as_tuple(self.argnums):
            if not -len(params) <= n < len(params):
                raise TesseraError(f"grad of {self.forward.name}: argnums {n} is out of range for its "
                                   f"{len(params)} parameters")
            name = params[n]
            if name not in tensor_names:
                raise ArgumentKindError(f"grad of {self.forward.name}: argument {name!r} (argnums {n}) is "
                                        f"{constants.get(name)!r}, a constant of the trace, which has no "
                                        f"gradient; pass an array of rank >= 1")
            spec = primal[tensor_names.index(name)]
            if not spec.dtype.is_float:
                raise DTypeError(f"grad of {self.forward.name} requires float inputs; argument {name!r} "
                                 f"(argnums {n}) is {spec.dtype}")
            positions.append(tensor_names.index(name))
        return positions

    def __call__(self, *args, **options):
        grads = super().__call__(*args, **options)
        if isinstance(self.argnums, int) or not self.seed_ones:
            return grads
        return grads if isinstance(grads, tuple) else (grads,)


class Saving(Function):
    """`forward` returning, after its outputs, what its backward reads from it (the values the
    compiler chose to save: `backward.saved_values`) that are not outputs already; `layout` says
    where each saved value is among the results. What `tsr.vjp` and the torch op's forward call."""

    def __init__(self, forward: Function):
        super().__init__(forward.fn, space=forward.space, **_marks(forward))
        self.takes_dynamic_dims = forward.takes_dynamic_dims
        self.forward = forward
        self.name = self.__name__ = f"{forward.name}_saving"
        self.captures = forward.captures
        self.annotations = dict(forward.annotations)
        self.signature = forward.signature.replace(return_annotation=inspect.Signature.empty)
        self._layouts: dict[tuple, Layout] = {}

    def trace(self, args: Sequence[ArgSpec], constants: dict[str, Any] | None = None,
              dynamic: frozenset[str] = frozenset(), index_bits: int = 64, aligned: frozenset[str] = frozenset()):
        from .backward import forward_with_residuals

        module = _forward_trace(self.forward, args, constants, dynamic, index_bits, aligned)
        return forward_with_residuals(module, self.name) or module

    def layout(self, tensors, constants: dict) -> Layout:
        """The results' `Layout` for a call with these (name, array) tensors and constants; traced
        once per call signature."""
        from .backward import forward_function, result_dims, saved_positions

        key = self._cache_key(tensors, constants, {})
        if key not in self._layouts:
            _, specs = self.arg_specs(tensors)
            f = forward_function(self.forward.trace(specs, constants))
            self._layouts[key] = Layout(len(f.body.block.last_op.operands), tuple(saved_positions(f)),
                                        tuple(result_dims(f)))
        return self._layouts[key]


class Layout(NamedTuple):
    """The results of a `Saving` call: the forward's outputs, then the saved values that are not
    outputs already."""

    n_outputs: int
    saved: tuple[int, ...]        # each saved value's position among the results
    dims: tuple[tuple, ...]       # each result's dims (names or ints), as the forward's trace names them

    def annotations(self, forward: Function, saved_names: Sequence[str], cotangent_names: Sequence[str],
                    float_outputs: Sequence[int]) -> dict[str, TensorSpec]:
        """A derivative's saved values and cotangents (one per float output) annotated
        with their results' dims, so that its compiles are keyed, and take dims at run time, as
        the forward's (`Specialization`). A result with a dim the forward's annotations do not
        name (a reshape's product) stays unannotated: its shape keys the compile by value."""
        named = {d for spec in forward.dim_annotations.values() for d in getattr(spec, "dims", ()) if isinstance(d, str)}
        out = {}
        for name, at in (*zip(saved_names, self.saved), *zip(cotangent_names, float_outputs)):
            dims = self.dims[at] or (1,)   # (a 0-d output's cotangent is [1])
            if all(isinstance(d, int) or d in named for d in dims):
                out[name] = TensorSpec(tuple(dims))
        return out


def _forward_trace(forward: Function, args: Sequence[ArgSpec], constants, dynamic: frozenset[str], index_bits: int,
                   aligned: frozenset[str]):
    """The forward's trace, with `dynamic` dims where there are any (a forward that takes none,
    `takes_dynamic_dims` False, is traced as it traces)."""
    return forward.trace(args, constants, dynamic, index_bits, aligned) if dynamic else forward.trace(args, constants)


def _marks(fn: Function) -> dict[str, tuple[str, ...]]:
    """fn's `static=` and `dynamic=` dims, which its derivative and its saving forward take as it does."""
    return {"static": tuple(sorted(fn.specialization.static)), "dynamic": tuple(sorted(fn.specialization.dynamic))}


def saving(fn: Function) -> Saving:
    """fn's `Saving`, kept on fn so that its compiles are reused."""
    known = vars(fn)
    if "_saving" not in known:
        known["_saving"] = Saving(fn)
    return known["_saving"]


def _as_tuple(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _check_scalar_output(f, name: str) -> None:
    from ..ir import graph as g

    types = [g.tensor_type(v) for v in f.body.block.last_op.operands]
    if len(types) != 1 or types[0].rank != 0 or not types[0].dtype.is_float:
        shown = ", ".join(f"{t.dtype}{list(t.shape)}" for t in types)
        raise ShapeError(f"grad of {name}: the function must return one 0-d float tensor (a loss, such as "
                         f"x.mean()), it returns {shown}; use tsr.vjp for other outputs")


def _check_cotangents(f, cotangents: Sequence[ArgSpec], name: str, primal: Sequence[ArgSpec]) -> None:
    """Each float output's cotangent has the output's shape and dtype (a 0-d output's: [1]); a dim
    the trace takes at run time has the value the call's `primal` arguments give it."""
    from ..dims import is_dynamic
    from ..ir import graph as g
    from .backward import float_results

    bindings = g.bindings_of(f)
    called = {d: n for a in primal for d, n in zip(a.dims, a.shape) if isinstance(d, str)}
    results = f.body.block.last_op.operands
    for i, spec in zip(float_results(f), cotangents, strict=True):
        t = g.tensor_type(results[i])
        shape = tuple(called[d] if is_dynamic(g.dim_value(d, bindings)) else g.dim_value(d, bindings)
                      for d in t.shape) or (1,)
        _require_cotangent(name, i, spec.shape, shape, list(shape) if t.shape else [], spec.dtype, t.dtype)


# --- the API --------------------------------------------------------------------------------------

def _require_function(fn, what: str) -> None:
    if isinstance(fn, Kernel):
        raise TesseraError(f"{what} takes a @tsr.function; {fn.name} is a @tsr.kernel, which writes its outputs "
                           f"into its arguments")
    if not isinstance(fn, Function):
        raise TypeError(f"{what} takes a @tsr.function, got {type(fn).__name__}; decorate it with @tsr.function")


def grad(fn: Function, argnums: int | Sequence[int] = 0) -> Derivative:
    """The gradient of `fn`, a function of one 0-d float output, with respect to the arguments
    `argnums` (an int: one gradient; a tuple: a tuple of them), as JAX's `grad`. The result is a
    `Function` (`Derivative`): call it with `fn`'s arguments."""
    _require_function(fn, "grad")
    if not isinstance(argnums, int) and not (isinstance(argnums, (tuple, list)) and argnums
                                             and all(isinstance(n, int) for n in argnums)):
        raise TypeError(f"grad: argnums must be an int or a non-empty tuple of ints, got {argnums!r}")
    return Derivative(fn, argnums=argnums if isinstance(argnums, int) else tuple(argnums))


def _vjp_function(fn: Function, float_outputs: tuple[int, ...], n_saved: int,
                  layout: Layout | None = None) -> Derivative:
    """fn's vjp `Derivative` for outputs whose floats are at `float_outputs`, taking `n_saved`
    saved values (those of the forward's `layout`, which names their dims and the cotangents'),
    kept on fn so that repeated vjps (a training loop) reuse its compiles."""
    from .backward import cotangent_name, saved_names

    known = vars(fn).setdefault("_vjp_derivatives", {})
    key = (float_outputs, n_saved)
    if key not in known:
        saved = saved_names(n_saved, fn.signature.parameters)
        taken = set(fn.signature.parameters) | set(saved)
        cotangents = [cotangent_name(i, taken) for i in float_outputs]
        known[key] = Derivative(fn, cotangent_names=cotangents, saved_names=saved, annotations=layout and
                                layout.annotations(fn, saved, cotangents, float_outputs))
    return known[key]


def _is_float(x) -> bool:
    try:
        return dtypes.lookup(x.dtype).is_float
    except (TypeError, KeyError, AttributeError):
        return False


def vjp(fn: Function, *args):
    """`(fn(*args), vjp_fn)` as JAX's `vjp`: `vjp_fn(cotangents)` (one per output, a tuple when
    `fn` returns a tuple) returns a tuple with one gradient per argument of `fn`: None for
    arguments that have none (ints, bools, numbers and 0-d arrays: module doc)."""
    _require_function(fn, "vjp")
    full = _with_defaults(fn, args)
    tensors, constants = fn._split_args(full)
    forward = saving(fn)
    layout = forward.layout(tensors, constants)
    n_outputs, positions = layout.n_outputs, layout.saved
    results = forward(*args)
    results = results if isinstance(results, tuple) else (results,)
    outs, saved = results[:n_outputs], [results[i] for i in positions]
    outputs = outs if n_outputs > 1 else outs[0]
    floats = tuple(i for i, o in enumerate(outs) if _is_float(o))
    backward = _vjp_function(fn, floats, len(saved), layout)
    differentiable = {name for name, x in tensors if _is_float(x)}

    def vjp_fn(cotangents):
        if isinstance(outputs, tuple) and not isinstance(cotangents, (tuple, list)):
            raise TesseraError(f"vjp of {fn.name}: {fn.name} returns {len(outs)} outputs, so vjp_fn takes a tuple "
                               f"of {len(outs)} cotangents (None for an output that is not a float); got "
                               f"{type(cotangents).__name__}")
        given = cotangents if isinstance(outputs, tuple) else (cotangents,)
        if len(given) != len(outs):
            raise TesseraError(f"vjp of {fn.name}: {len(given)} cotangents for {len(outs)} outputs")
        if not differentiable:   # nothing to differentiate: no backward to compile
            return (None,) * len(full)
        cts = [_as_argument(given[i], i, fn.name) for i in floats]
        for i, ct in zip(floats, cts):   # (before the call's own checks, which name its arguments)
            _check_cotangent(fn.name, i, ct, outs[i])
        grads = backward(*full, *saved, *cts)
        grads = iter(grads if isinstance(grads, tuple) else (grads,))
        return tuple(next(grads) if name in differentiable else None for name in fn.signature.parameters)
    return outputs, vjp_fn


def _with_defaults(fn: Function, args: Sequence) -> list:
    """`args` with the defaults of the parameters left out (cotangents follow all of them); a
    parameter left out that has none is the plain call's error."""
    params = list(fn.signature.parameters.values())
    if any(p.default is inspect.Parameter.empty for p in params[len(args):]):
        fn._split_args(args)   # (raises: "f takes 2 arguments (x, w), got 1: 'w' missing")
    return [*args, *(p.default for p in params[len(args):])]


def _check_cotangent(name: str, i: int, ct, out) -> None:
    """The cotangent array of output `i` (an array) has the output's shape and dtype."""
    _require_cotangent(name, i, tuple(int(n) for n in ct.shape), tuple(int(n) for n in out.shape) or (1,),
                       [int(n) for n in out.shape], _dtype_name(ct), _dtype_name(out))


def _require_cotangent(name: str, i: int, shape: tuple, want: tuple, shown: list, dtype, want_dtype) -> None:
    """A cotangent of output `i` has its shape (`want`: a 0-d output's is [1]; `shown` as the
    output's) and dtype: a call's arrays (`_check_cotangent`) and a compile's specs alike."""
    if tuple(shape) != tuple(want):
        raise ShapeError(f"vjp of {name}: the cotangent of output {i} has shape {list(shape)}, the output {shown}")
    if str(dtype) != str(want_dtype):
        raise DTypeError(f"vjp of {name}: the cotangent of output {i} is {dtype}, the output {want_dtype}; "
                         f"cotangents have their output's dtype")


def _dtype_name(x) -> str:
    """A NumPy or torch array's dtype as Tessera names it (float64, which Tessera has not, as itself)."""
    try:
        return str(dtypes.lookup(x.dtype))
    except (TypeError, KeyError, ValueError):
        return str(x.dtype)


def _as_argument(ct, output: int, name: str):
    """A cotangent as a call argument: arrays as they are, a 0-d one as shape [1] (a 0-d array would
    be a constant of the trace)."""
    if not (hasattr(ct, "shape") and hasattr(ct, "dtype")):
        raise ArgumentKindError(f"vjp of {name}: the cotangent of output {output} must be an array of the "
                                f"output's shape and dtype, got {type(ct).__name__}")
    return ct.reshape(1) if len(ct.shape) == 0 else ct
