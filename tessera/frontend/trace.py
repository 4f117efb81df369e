"""Tracing a Python function into Graph IR.

`bind_dims` binds every symbolic dim of the annotations to the concrete size
it has in the call (reporting disagreements with the user's names); `trace`
then runs `fn` once on `Tensor` values and returns a `builtin.module` holding
one `func.func` in the graph dialect, with the output arguments it stored to.
"""
from __future__ import annotations

import contextvars
import inspect
import linecache
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..dims import is_dynamic
from ..dtypes import DType
from ..errors import DTypeError, ShapeError, TesseraError, user_frame
from ..runtime.interop import canonical_strides
from .tensor import Tensor, TensorSpec, check_dtype

_CURRENT: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar("tessera_trace", default=None)


@dataclass(frozen=True)
class ArgSpec:
    """One tensor argument of a call: its name, concrete shape, dtype and symbolic dims."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    dims: tuple[str | int, ...]
    #: element strides of an argument passed in another layout than C-contiguous
    #: (`interop.canonical_strides`); None: contiguous
    strides: tuple[int, ...] | None = None

    def __post_init__(self):   # one layout, one spelling: what the runtime compares calls against
        if self.strides is not None:
            object.__setattr__(self, "strides", canonical_strides(self.shape, tuple(self.strides)))


def current_trace() -> "Trace":
    trace = _CURRENT.get()
    if trace is None:
        raise TesseraError("tessera ops can only be used inside a @tessera.function or @tessera.kernel")
    return trace


class Trace:
    """The function being built: its block, its dim bindings, its outputs, and the profile
    regions open now (outermost first)."""

    def __init__(self, bindings: dict[str, int]):
        from xdsl.ir import Block

        self.bindings = dict(bindings)
        self.block = Block()
        self.stored: dict[str, Tensor] = {}
        self.regions: list[str] = []
        # id(tensor) -> [(view, remake)]: the views taken of it, re-made from it after a store
        self.views: dict[int, list[tuple[Tensor, Callable[[Tensor], Tensor]]]] = {}
        self.view_parent: dict[int, Tensor] = {}   # id(view) -> the tensor it views
        self._remaking = False

    def size(self, d: str | int) -> int:
        return d if isinstance(d, int) else self.bindings[d]

    def add(self, op):
        """Appends `op`, stamped with the user's line that made it and the regions open around it
        (`tessera.ir.provenance`)."""
        from ..ir import provenance

        op.attributes |= provenance.loc_attributes(source_loc(), self.regions)
        self.block.add_op(op)
        return op

    def note_view(self, parent: Tensor, view: Tensor, remake: Callable[[Tensor], Tensor]) -> None:
        """Records that `view` is `remake(parent)` without a copy (a transpose, a reshape), so a
        store into `parent` reaches it as a store reaches a NumPy view."""
        if self._remaking:   # a view re-made after a store stays registered under its first making
            return
        self.views.setdefault(id(parent), []).append((view, remake))
        self.view_parent[id(view)] = parent

    def rebind(self, x: Tensor, new: Tensor) -> None:
        """A store: `x` (the Python object every name of it holds) now has `new`'s value, and each
        view taken of it is re-made from that value, so every later read sees the store."""
        x.value, x.dims, x.dtype = new.value, new.dims, new.dtype
        for view, remake in self.views.get(id(x), ()):
            outer, self._remaking = self._remaking, True
            try:
                remade = remake(x)
            finally:
                self._remaking = outer
            self.rebind(view, remade)


def source_loc():
    """The user's line being traced now, with an absolute path (what debuggers and ptxas's line
    table want), or None when no frame is the user's."""
    from ..ir.provenance import Loc

    frame = user_frame()
    if frame is None:
        return None
    file, line = frame
    return Loc(file if file.startswith("<") else os.path.abspath(file), line)


def bind_dims(fn_name: str, specs: Sequence[tuple[str, TensorSpec | None, tuple[int, ...], DType]]
              ) -> tuple[dict[str, int], list[ArgSpec]]:
    """Unify annotated dim names with the call's shapes; name the dims of unannotated args."""
    bindings: dict[str, int] = {}
    first_seen: dict[str, str] = {}
    args = []
    for arg, spec, shape, dt in specs:
        if spec is None:
            dims = tuple(f"{arg}_{i}" for i in range(len(shape)))
        else:
            check_dtype(arg, spec.dtype, dt)
            if len(spec.dims) != len(shape):
                raise ShapeError(f"{fn_name}: argument {arg!r} is annotated {spec} (rank {len(spec.dims)}) "
                                 f"but has shape {list(shape)} (rank {len(shape)})")
            dims = spec.dims
        for d, size in zip(dims, shape):
            if isinstance(d, int):
                if d != size:
                    raise ShapeError(f"{fn_name}: argument {arg!r} must have size {d} where it has {size} "
                                     f"(annotation {spec})")
                continue
            if d in bindings and bindings[d] != size:
                raise ShapeError(f"{fn_name}: argument {arg!r} has {d}={size} but argument "
                                 f"{first_seen[d]!r} has {d}={bindings[d]}")
            bindings.setdefault(d, size)
            first_seen.setdefault(d, arg)
        args.append(ArgSpec(arg, tuple(shape), dt, tuple(dims)))
    return bindings, args


def trace(fn: Callable, fn_name: str, args: Sequence[ArgSpec], bindings: dict[str, int],
          constants: dict[str, Any], outputs: Sequence[str] = (), returns: Sequence[TensorSpec] | None = None):
    """Run `fn` on traced tensors; return the graph module and the output arg names it stored to.
    `returns`: what the return annotation declares, checked against the results."""
    from xdsl.dialects import func
    from xdsl.dialects.builtin import ModuleOp
    from xdsl.ir import Region

    from xdsl.dialects.builtin import IntegerAttr

    from ..ir import graph

    t = Trace(bindings)
    params: dict[str, Any] = dict(constants)
    for a in args:
        value = t.block.insert_arg(graph.TensorType.of(a.dims, a.dtype), len(t.block.args))
        params[a.name] = Tensor(t, value, a.dims, a.dtype)
        params[a.name].label = params[a.name].argument = a.name
    token = _CURRENT.set(t)
    try:
        ordered = [params[name] for name in inspect.signature(fn).parameters]
        result = fn(*ordered)
    finally:
        _CURRENT.reset(token)
    if t.regions:
        raise TesseraError(f"{fn_name}: profile region {t.regions[-1]!r} is begun but never ended "
                           f"(tsr.profile_end({t.regions[-1]!r}))")
    token = _CURRENT.set(t)
    try:
        results = _collect_results(fn_name, result, t, outputs)
    finally:
        _CURRENT.reset(token)
    for r in results:
        if not isinstance(r, Tensor):
            raise TesseraError(f"{fn_name} must return tensors computed from its arguments, got {type(r).__name__}")
    if returns is not None:
        check_returns(fn, fn_name, results, returns, t)
    t.block.add_op(func.ReturnOp(*[r.value for r in results]))
    _drop_dead_ops(t.block)
    ftype = ([a.type for a in t.block.args], [r.value.type for r in results])
    f = func.FuncOp(fn_name, ftype, Region(t.block))
    f.attributes["tessera.dims"] = graph.dims_attr(t.bindings)
    dynamic = [v for v in t.bindings.values() if is_dynamic(v)]
    if dynamic:
        f.attributes[graph.DYNAMIC_DIMS] = graph.dynamic_dims_attr(t.bindings)
        f.attributes[graph.INDEX_BITS] = IntegerAttr(dynamic[0].index_bits, 64)
        multiples = graph.dim_multiples_attr(t.bindings)
        if multiples is not None:
            f.attributes[graph.DIM_MULTIPLES] = multiples
    f.attributes["tessera.arg_names"] = _str_array([a.name for a in args])
    strided = {a.name: a.strides for a in args if a.strides is not None}
    if strided:
        f.attributes["tessera.arg_strides"] = graph.strides_attr(strided)
    f.attributes["tessera.result_names"] = _str_array(
        list(t.stored) if outputs else [f"out{i}" for i in range(len(results))])
    return ModuleOp([f]), list(t.stored)


def _collect_results(fn_name, result, t: Trace, outputs) -> list:
    if outputs:
        if result is not None:
            raise TesseraError(f"@kernel {fn_name} writes its outputs (e.g. C[:] = ...); it must not return a value")
        if not t.stored:
            raise TesseraError(f"@kernel {fn_name} stores to none of its arguments; write outputs with C[:] = ...")
        return _distinct(list(t.stored.values()))
    if result is None:
        raise TesseraError(f"{fn_name} returned None; a @tessera.function returns its result tensors")
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _distinct(values: list) -> list:
    """A kernel's stored values, each its own: an output that holds the value another output
    holds (`B[:] = A * 2; C[:] = B`) gets a copy of it (`ops.own_copy`), as a function cannot
    return one value twice (each result is a buffer of its own)."""
    from . import ops

    seen, out = set(), []
    for v in values:
        if v.value in seen:
            v = ops.own_copy(v)
        seen.add(v.value)
        out.append(v)
    return out


def declared_returns(annotation) -> list[TensorSpec] | None:
    """The `Tensor[...]`s a return annotation declares (`-> Tensor[...]`, `-> tuple[Tensor[...], ...]`),
    or None when it declares none to check (no annotation, a bare `Tensor`, a tuple of any length)."""
    if isinstance(annotation, TensorSpec):
        return [annotation]
    items = typing.get_args(annotation) if typing.get_origin(annotation) is tuple else annotation
    if isinstance(items, tuple) and items and all(isinstance(i, TensorSpec) for i in items):
        return list(items)
    return None


def check_returns(fn: Callable, fn_name: str, results: Sequence[Tensor], declared: Sequence[TensorSpec],
                  t: Trace) -> None:
    """The results against the return annotation: their count, each one's rank, dims (a declared
    name must have the size it is bound to; one bound nowhere else binds here) and dtype. Errors
    point at the annotation's `def` line and name the dims as the user wrote them."""
    where = _def_location(fn)
    if len(results) != len(declared):
        raise ShapeError(f"{fn_name} is annotated to return {len(declared)} tensor(s) but returns {len(results)}",
                         where)
    bound = dict(t.bindings)   # plus dims only the annotation names, bound by the first result using them
    for i, (r, spec) in enumerate(zip(results, declared)):
        what = f"{fn_name}: result {i}" if len(results) > 1 else f"{fn_name}: the result"
        got = "[" + ", ".join(f"{d}={t.size(d)}" if isinstance(d, str) else str(d) for d in r.dims) + "]"
        if len(spec.dims) != len(r.dims):
            raise ShapeError(f"{what} is annotated {spec} (rank {len(spec.dims)}) but is {got} (rank {len(r.dims)})",
                             where)
        for axis, (want, have) in enumerate(zip(spec.dims, r.dims)):
            size = t.size(have)
            expected = want if isinstance(want, int) else bound.setdefault(want, size)
            if size != expected:
                named = want if isinstance(want, int) else f"{want}={expected}"
                raise ShapeError(f"{what} is annotated {spec} but is {got}: dim {axis} is {size} where the "
                                 f"annotation says {named}", where)
        if spec.dtype is not None and spec.dtype != r.dtype:
            raise DTypeError(f"{what} is annotated {spec.dtype.name} but is {r.dtype.name} ({spec}); "
                             f"cast it with .to(tsr.{spec.dtype.name})", where)


def _def_location(fn: Callable) -> str | None:
    """`file:line` of `fn`'s `def` line, where its annotations are (its code starts at the first
    decorator)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    for line in range(code.co_firstlineno, code.co_firstlineno + 32):
        if linecache.getline(code.co_filename, line).lstrip().startswith(("def ", "async def ")):
            return f"{code.co_filename}:{line}"
    return f"{code.co_filename}:{code.co_firstlineno}"


def _drop_dead_ops(block) -> None:
    """Erases ops whose results nothing reads (a value computed and never used, a view re-made
    after a store that nobody reads again), so no kernel computes them. Ops without results
    (asserts) stay."""
    for op in reversed(list(block.ops)):
        if op.results and all(not r.uses for r in op.results):
            block.erase_op(op)


def _str_array(names: Sequence[str]):
    from xdsl.dialects.builtin import ArrayAttr, StringAttr

    return ArrayAttr([StringAttr(n) for n in names])

