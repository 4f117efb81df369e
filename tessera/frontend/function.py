"""`@tessera.function` and `@tessera.kernel`: the user's entry points.

A `Function` compiles lazily, once per call signature (shapes, dtypes,
constant arguments, target, and the values of the globals and closure
variables it reads: `captures.py`), and keeps the result in an in-memory cache, so
the steady-state call path is a dict lookup plus the launch: no tracing and no
xDSL work. On CUDA tensors a call first looks up the GPU program an earlier
call of the same signature ran (`_gpu_call_key`), skipping the argument
split, the device query and the compile-cache key.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .. import dtypes
from ..errors import ArgumentKindError, DTypeError, ShapeError, TesseraError
from ..runtime import interop
from ..dims import Dynamic, DynamicDim, OffsetWidthError, hint_of, index_bits, multiple_of
from .captures import Captures, exact
from .specialization import CacheInfo, Specialization
from .tensor import TensorSpec
from .trace import ArgSpec, bind_dims, declared_returns, trace
from .zero_size import ZeroSizeCall


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (int, float, bool))


def _kind(x) -> str:
    """What a wrong argument is, for an error message: `a float (1.0)`, `a 0-d ndarray`."""
    if _is_array(x):
        return f"a {len(x.shape)}-d {type(x).__name__}"
    return f"a {type(x).__name__} ({x!r:.40})"


def _zero_size(tensors) -> bool:
    """A call with a zero-size dim: nothing to launch (`ZeroSizeCall`)."""
    return any(0 in tuple(x.shape) for _, x in tensors)


def _on_gpu(x) -> bool:
    """A CUDA tensor (torch, or anything with __cuda_array_interface__ such as CuPy)."""
    return bool(getattr(x, "is_cuda", False)) or hasattr(x, "__cuda_array_interface__")


def _gpu_options(tensors, options: dict) -> tuple[int, dict]:
    """The device of the call, and compile options for it: its arch and SM count, on the native code
    path (TMA + wgmma where the arch has them and the kernel takes them)."""
    from ..runtime import driver, interop

    device = interop.describe(tensors[0][1], f"argument {tensors[0][0]!r}").device
    if device is None:
        raise TesseraError("mixing CPU and CUDA arguments: put every tensor on the same device")
    options = dict(options)
    platform = driver.device_platform(device)
    options.setdefault("arch", platform.arch)
    options.setdefault("sm_count", platform.sm_count)
    return device, options


def _torch_path(args) -> bool:
    """Whether a call takes the torch autograd / torch.compile path (`torch_autograd.wanted`).
    One attribute read per argument; torch is asked only when an argument has `requires_grad`
    (a torch tensor), so calls on other arrays import nothing."""
    grad = None
    for x in args:
        requires = getattr(x, "requires_grad", None)
        if requires is not None:
            grad = grad or requires
    if grad is None:
        return False
    wanted = _torch_wanted or _load_torch_wanted()
    return wanted(grad)


_torch_wanted = None   # torch_autograd.wanted, once a torch tensor was passed


def _torch_compiling() -> bool:
    """Whether torch.compile (Dynamo) is tracing the call, which must reach the torch op (and does
    not trace into C): torch's own check, once a torch tensor was passed."""
    return False


def _load_torch_wanted():
    global _torch_wanted, _torch_compiling
    from .torch_autograd import _is_compiling, wanted
    _torch_wanted, _torch_compiling = wanted, _is_compiling
    return wanted


def _signature(fn: Callable) -> inspect.Signature:
    """`fn`'s signature with string annotations (`from __future__ import annotations`) evaluated
    in its module, so `Tensor["B", "S"]` means the same either way."""
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        return inspect.signature(fn)


#: call keys whose programs a function remembers for its fast path, before it starts over
MAX_REMEMBERED_CALLS = 4096


@functools.lru_cache(maxsize=1)
def _call_options() -> frozenset[str]:
    """The keyword options a call passes to `compiler.compile_module` (`arch=`, `space=`, ...)."""
    from ..compiler import compile_module
    return frozenset(inspect.signature(compile_module).parameters) - {"graph_module"}


class Function:
    """A traced tensor function. Calling it with NumPy arrays runs it on the CPU tile interpreter."""

    #: destination-passing style (outputs are arguments) for @kernel
    writes_outputs = False
    #: whether `trace` takes `dynamic` dims (kernel arguments: `Specialization`)
    takes_dynamic_dims = True

    def __init__(self, fn: Callable, space: dict | None = None, static: Sequence[str] = (),
                 dynamic: Sequence[str] = ()):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = fn.__name__
        self.signature = _signature(fn)
        self.annotations = {n: p.annotation for n, p in self.signature.parameters.items()
                            if isinstance(p.annotation, TensorSpec)}
        self.space = space
        self.tuner = None      # an Autotuner, for @kernel.autotune: GPU calls then use its choice
        self._cache: dict[tuple, Any] = {}
        self._tuned: dict[tuple, dict] = {}   # call signature -> the tuner's schedule
        self._programs: dict[tuple, _Known] = {}   # GPU call key -> its program
        #: the fast path's calls (`fastcall`) of the last few GPU calls, which a call tries first
        self._fast: tuple = ()
        self._warm: dict[tuple, tuple] = {}       # (warm-start key, device) -> what _gpu_program returns
        self.captures = Captures(fn)   # the globals and closure variables it reads: part of every key
        self.specialization = Specialization(self.name, static, dynamic)

    # --- specialisation ------------------------------------------------------------
    def _bind_keywords(self, args: tuple, keywords: dict) -> tuple[tuple, dict]:
        """(the arguments, the compile options) of a call's keywords: one naming a parameter of the
        function is that argument (`f(x, scale=3.0)`; the parameters it skips take their defaults),
        one naming an option of `compile_module` (`arch=`, `space=`) an option; anything else a
        TypeError (an argument the function lacks was taken as an option, silently)."""
        params = self.signature.parameters
        given = {k: v for k, v in keywords.items() if k in params}
        options = {k: v for k, v in keywords.items() if k not in params}
        known = _call_options()
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{self.name}() got an unexpected keyword argument {unknown[0]!r}: its parameters are "
                            f"{', '.join(params)}, and a call's options {', '.join(sorted(known))}")
        if not given:
            return args, options
        try:
            bound = self.signature.bind(*args, **given)
        except TypeError as e:
            raise TypeError(f"{self.name}(): {e}") from None
        bound.apply_defaults()
        if bound.kwargs:   # (a keyword-only or ** parameter: the trace takes arguments by position)
            raise TypeError(f"{self.name}(): parameter {next(iter(bound.kwargs))!r} is keyword-only or **, which "
                            f"a Tessera function does not take yet; make it an ordinary parameter")
        return tuple(bound.args), options

    def _split_args(self, args: Sequence) -> tuple[list, dict[str, Any]]:
        """(tensor arguments, constant arguments) by name; parameters left out take their defaults."""
        params = self.signature.parameters
        names = list(params)
        if len(args) > len(names):
            raise TesseraError(f"{self.name} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}")
        missing = [n for n in names[len(args):] if params[n].default is inspect.Parameter.empty]
        if missing:
            raise TesseraError(f"{self.name} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}: "
                               f"{', '.join(map(repr, missing))} missing")
        values = [*args, *(params[n].default for n in names[len(args):])]
        tensors, constants = [], {}
        for name, x in zip(names, values):
            if _is_array(x) and len(x.shape) > 0:
                tensors.append((name, x))
            else:
                constants[name] = self._constant(name, x)
        if tensors:   # (the one place a call's dim values are noted: `Specialization.observe`)
            self.specialization.observe(self.name, self.dim_annotations, tensors)
        return tensors, constants

    def _constant(self, name: str, x):
        """A non-tensor argument as the Python value the trace sees: numbers, bools, strings and None;
        a NumPy scalar or 0-d host array becomes its number."""
        spec = self.annotations.get(name)
        if spec is not None:
            raise ArgumentKindError(f"{self.name}: argument {name!r} is annotated {spec} but got {_kind(x)}")
        if _is_array(x) and _on_gpu(x):
            raise ArgumentKindError(f"{self.name}: argument {name!r} is a 0-d CUDA tensor; pass a Python number "
                                    f"({name}.item()), which becomes a constant of the kernels")
        if _is_array(x):
            try:
                return np.asarray(x).item()
            except (TypeError, ValueError, RuntimeError) as e:
                raise ArgumentKindError(f"{self.name}: argument {name!r} is a 0-d {type(x).__name__} that is not "
                                        f"a number ({e})") from None
        if x is None or isinstance(x, (int, float, bool, str)):
            return x
        raise ArgumentKindError(f"{self.name}: argument {name!r} must be an array, a number, a string or None, "
                                f"got {_kind(x)}")

    def arg_specs(self, tensors: Sequence[tuple[str, Any]]) -> tuple[dict[str, int], list[ArgSpec]]:
        """The call's dim bindings and argument specs, each with the layout it was passed in."""
        bindings, specs = bind_dims(self.name, [(n, self.annotations.get(n), tuple(int(s) for s in x.shape),
                                                 _arg_dtype(self.name, n, x)) for n, x in tensors])
        return bindings, [dataclasses.replace(spec, strides=interop.layout_of(x))
                          for spec, (_, x) in zip(specs, tensors)]

    def arg_specs_for(self, dims: dict[str, int], dtype=None) -> list[ArgSpec]:
        """Arg specs from symbolic dim values (the CLI's `--shape B=2,S=128`)."""
        default = dtypes.lookup(dtype) if dtype is not None else dtypes.fp32
        specs = []
        for name in self.signature.parameters:
            spec = self.annotations.get(name)
            if spec is None:
                raise TesseraError(f"{self.name}: argument {name!r} has no Tensor[...] annotation, so its shape "
                                   f"cannot be derived from --shape")
            missing = [d for d in spec.dims if isinstance(d, str) and d not in dims]
            if missing:
                raise TesseraError(f"{self.name}: no value for dim(s) {', '.join(missing)} of argument {name!r}; "
                                   f"pass them with --shape {','.join(f'{m}=...' for m in missing)}")
            shape = tuple(dims[d] if isinstance(d, str) else d for d in spec.dims)
            specs.append(ArgSpec(name, shape, spec.dtype or default, spec.dims))
        return specs

    def trace(self, args: Sequence[ArgSpec], constants: dict[str, Any] | None = None,
              dynamic: frozenset[str] = frozenset(), index_bits: int = 64, aligned: frozenset[str] = frozenset()):
        """Graph IR module for these argument specs, its results checked against the return annotation;
        the `dynamic` dims (of 2 or more) are traced as `tessera.dims.Dynamic`s, kernel arguments
        addressed with `index_bits`-bit offsets; those of them `aligned` as multiples of what
        their spec's value is a multiple of (`tessera.dims.multiple_of`: the call's class), the
        others as any value."""
        bindings, checked = bind_dims(self.name, [(a.name, self.annotations.get(a.name), a.shape, a.dtype)
                                                  for a in args])
        bindings = {d: Dynamic(d, hint_of(v), index_bits, multiple_of(v) if d in aligned else 1)
                    if d in dynamic and v >= 2 else v for d, v in bindings.items()}
        outputs = [a.name for a in args] if self.writes_outputs else ()
        returns = None if self.writes_outputs else declared_returns(self.signature.return_annotation)
        checked = [dataclasses.replace(c, strides=a.strides) for c, a in zip(checked, args)]
        module, _ = trace(self.fn, self.name, checked, bindings, constants or {}, outputs, returns)
        return module

    def compile(self, args: Sequence[ArgSpec], constants: dict[str, Any] | None = None,
                dynamic: frozenset[str] = frozenset(), index_bits: int = 64, aligned: frozenset[str] = frozenset(),
                **options):
        """Run the whole pipeline for these specs, with the `dynamic` dims as kernel arguments (of
        `index_bits`-bit offsets: `tessera.dims.index_bits`; `aligned`: `trace`); see
        `tessera.compiler.compile_module`."""
        from ..compiler import compile_module

        if self.space is not None:
            options.setdefault("space", self.space)
        empty = [f"{a.name!r} {list(a.shape)}" for a in args if 0 in a.shape]
        if empty:
            raise ShapeError(f"{self.name}: argument {empty[0]} has a zero-size dim, which leaves no kernel to "
                             f"compile; a call with it returns empty results and launches nothing")
        module = self.trace(args, constants, dynamic, index_bits, aligned) if dynamic else self.trace(args, constants)
        return compile_module(module, **options)

    def torch_op(self, *example_args):
        """This function as a torch custom op: `tsr.torch_op(self, *example_args)`."""
        return torch_op(self, *example_args)

    # --- calling -------------------------------------------------------------------------
    def _cache_key(self, tensors, constants, options: dict) -> tuple:
        """What a compile depends on: shapes (a dynamic dim's `class_of` its value: `Specialization`),
        dtypes, constants, options (a space's lists frozen) and the values of the globals and
        closure variables the function reads."""
        frozen = {name: tuple(sorted((p, tuple(vals)) for p, vals in value.items())) if name == "space" else value
                  for name, value in options.items()}
        shapes, bits = self.key_shapes(tensors)
        return (tuple((shape, str(x.dtype), interop.layout_of(x)) for shape, (_, x) in zip(shapes, tensors)),
                tuple((name, type(v), exact(v)) for name, v in sorted(constants.items(), key=lambda item: item[0])),
                tuple(sorted(frozen.items())), self.captures.key(), bits)

    def key_shapes(self, tensors) -> tuple[list[tuple], int | None]:
        """The tensors' shapes as a compile key (a dynamic dim's value replaced by its class), and
        the offset width of a shape-generic compile (None: no dim is dynamic)."""
        generic = self._generic_dims(tensors)
        bits = 64 if self.specialization.wide else index_bits(x for _, x in tensors)
        return self.specialization.shapes(generic, tensors), bits if generic else None

    @property
    def dim_annotations(self) -> dict:
        """The annotations calls are keyed by, and take dims at run time by (`Specialization`): the
        arguments' own (a derivative adds its saved values' and cotangents')."""
        return self.annotations

    def _generic_dims(self, tensors) -> dict[str, list[tuple[int, int]]]:
        """The dims this call compiles as kernel arguments (`Specialization.dynamic_for`), each with
        its (tensor, axis) positions; none where its trace takes no `dynamic` dims."""
        if not self.takes_dynamic_dims or not tensors or _zero_size(tensors):
            return {}
        return self.specialization.dynamic_for(self.dim_annotations, tensors)

    def _compiled_for(self, tensors, constants, options: dict):
        """The compile for this call, from the cache or made now; a call with a zero-size dim gets a
        `ZeroSizeCall`, which computes its results without kernels."""
        key = self._cache_key(tensors, constants, options)
        compiled = self._cache.get(key)
        if compiled is None:
            _, specs = self.arg_specs(tensors)
            if _zero_size(tensors):
                compiled = ZeroSizeCall(self.trace(specs, constants))
            else:
                compiled = self._compile_generic(specs, constants, tensors, options)
                self.specialization.learn_alignment(self._generic_dims(tensors), compiled.dim_multiples)
                key = self._cache_key(tensors, constants, options)   # without the dims it had to fix (or align)
            self.specialization.compiled(self.dim_annotations, tensors, self._generic_dims(tensors))
            self._cache[key] = compiled
            # A trace may change what it reads (appending to a list it captured): what it left is keyed too.
            self._cache.setdefault(self._cache_key(tensors, constants, options), compiled)
        else:
            self.specialization.hits += 1
        return compiled

    def _compile_generic(self, specs, constants, tensors, options: dict):
        """The compile of a call with its dynamic dims as kernel arguments. A dim some step needs the
        value of (`tessera.dims.DynamicDim`: the user's code reads it, or a kernel's template takes
        it as a constant) is fixed and the function compiled again; it stays fixed for later calls,
        and `cache_info()` says why. On a GPU the kernels' code is generated here, so a code
        generator's refusal falls back as well."""
        while True:
            dynamic = frozenset(self._generic_dims(tensors))
            _, bits = self.key_shapes(tensors)
            try:
                compiled = self.compile(specs, constants, dynamic, bits or 64,
                                        dynamic - self.specialization.unaligned, **options)
                if dynamic and "sm_count" in options:   # a GPU call: generate the code now
                    compiled.stage("ptx")
                return compiled
            except DynamicDim as e:
                if e.dim not in dynamic:
                    raise
                self.specialization.fix(e.dim, f"{e}, needed by {_needed_at(e)}")

    def cache_info(self) -> CacheInfo:
        """Compiles, cache hits and the specialization key of each compile (`Specialization`)."""
        return self.specialization.info()

    def _tuned_options(self, tensors, constants, options: dict, device: int) -> dict:
        """`options` with the autotuner's schedule for this call (measured on its first call)."""
        if self.tuner is None or "space" in options or _zero_size(tensors):
            return options
        call = (tuple((tuple(x.shape), str(x.dtype), interop.layout_of(x)) for _, x in tensors),
                tuple(sorted(constants.items())),
                device, tuple(sorted(options.items())), self.captures.key())
        if call not in self._tuned:   # the steady state skips the key's JSON and the tuner's lookup
            self._tuned[call] = self._tuned_space(tensors, constants, options, device)
        return {**options, "space": self._tuned[call]}

    def _tuned_space(self, tensors, constants, options: dict, device: int) -> dict:
        from ..runtime import driver

        dims, _ = self.arg_specs(tensors)
        target = {"device": driver.Device(device).name, "arch": options["arch"],
                  "path": options.get("path", "native")}
        from ..runtime.autotune import BACKEND
        if BACKEND in self.tuner.space:   # a point on tileiras runs where it is installed (or its cubins are)
            from ..backends.cuda_tile import tools
            target["tileiras"] = tools.version() if tools.available() else None
        layouts = [interop.layout_of(x) for _, x in tensors]
        key = self.tuner.tuning_key(dims, [str(x.dtype) + (f" strides {list(st)}" if st else "")
                                           for (_, x), st in zip(tensors, layouts)], constants, target)
        reference: list = []
        compiled_keys: dict[tuple, tuple] = {}

        def measure(config: dict[str, int]) -> float:
            point = {**options, "space": {k: [v] for k, v in config.items()}}
            compiled_keys[tuple(config.items())] = self._cache_key(tensors, constants, point)
            return self._measure(tensors, constants, point, device, reference)
        chosen = self.tuner.choose(key, measure)
        for config, compiled_key in compiled_keys.items():   # the losers' programs need not stay loaded
            if config != tuple(chosen.items()):
                self._cache.pop(compiled_key, None)
        return {k: [v] for k, v in chosen.items()}

    def _measure(self, tensors, constants, options: dict, device: int, reference: list) -> float:
        """Median GPU ms of one schedule on the call's inputs, into fresh outputs (the caller's are
        not touched), after checking them against the first schedule measured (`reference`)."""
        import statistics

        from ..runtime import autotune, driver, launcher

        program = self._compiled_for(tensors, constants, options).gpu_program(device)
        inputs = [x for _, x in tensors]
        outputs = [autotune.host_copy(o) for o in program(*inputs)]
        if not reference:
            reference.extend(outputs)
        else:
            autotune.check_same(self.name, outputs, reference)
        stream = launcher.current_stream(inputs[0], device)
        return statistics.median(driver.time_calls(lambda: program(*inputs), stream, autotune.REPEATS))

    @staticmethod
    def _gpu_call_key(args, options: dict) -> tuple | None:
        """What decides the program a call on CUDA tensors runs, read cheaply: each CUDA tensor's
        shape, dtype, device and layout (its strides where it is not contiguous), each other argument's type and value, and the options; None when
        one of them cannot be a dict key (a NumPy array, a `space` dict). The program still checks
        every tensor it is given (layout, alignment) before launching."""
        key = (tuple((x.shape, x.dtype, x.device, x.is_contiguous() or x.stride())
                     if getattr(x, "is_cuda", False) else (type(x), exact(x)) for x in args),
               tuple(options.items()))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _remember_program(self, key, program, tensors, out_names=()) -> None:
        """After a GPU call on the slow path: its program, for later calls with the same key."""
        if key is None:
            return
        if len(self._programs) >= MAX_REMEMBERED_CALLS:   # a shape-generic program sees every length
            self._programs.clear()
        names = list(self.signature.parameters)
        tensor_names = [n for n, _ in tensors]
        # each tensor's position among the arguments, and each output's among the tensors
        positions = tuple(names.index(n) for n in tensor_names)
        self._programs[key] = _Known(program, positions, tuple(tensor_names.index(n) for n in out_names))

    def _try_first(self, known: _Known, args: Sequence, key: tuple) -> None:
        """After a call without options of a known program (its second call or later: a first call,
        a warm start's included, spends nothing on this), makes its fast call the first of those a
        call tries. The record is made once, from `args` (which matched the program's `key`) and
        guarding the captured objects `key` was made of; its C call once the module has loaded
        (`fastcall.make` is None until then), and again where a captured variable now holds
        another object of the same key (`SCALE = 2.0` run again), which its guards decline."""
        from ..runtime import fastcall
        if fastcall.unavailable() is not None:   # no C compiler, a failed build, TESSERA_NO_FAST_CALL
            return
        guards = self.captures.identity_guards(key[1])
        if guards is None:   # a captured list or config object; or another thread's key came between
            return
        if not known.recorded:
            known.recorded = True
            known.record = self._fast_record(known, args, guards)
        if known.record is None:
            return
        old = known.call
        if old is None or not _same_objects(guards, known.record.guards):
            known.record = dataclasses.replace(known.record, guards=guards)
            try:
                known.call = fastcall.make(known.record)
            except ValueError:   # past the C module's limits: not tried again
                known.record = known.call = None
        self._fast = fastcall.most_recent_first(self._fast, known.call, stale=old)

    def _fast_record(self, known: _Known, args: Sequence, guards: tuple):
        """The program's `fast_record` of a call with `args`, guarding the captured variables."""
        positions = known.inputs
        if not positions or max(positions) >= len(args):
            return None
        if _torch_wanted is None:   # (a @kernel's first torch call: the fast path's torch.compile check)
            _load_torch_wanted()
        values = {i: a for i, a in enumerate(args) if i not in positions}
        record = getattr(known.program, "fast_record", lambda *a, **k: None)(
            [args[i] for i in positions], positions, values, out=known.outputs if self.writes_outputs else None)
        return dataclasses.replace(record, guards=guards) if record is not None else None

    def _gpu_program(self, tensors, constants, options: dict, device: int) -> tuple:
        """(program, result names, whether it reads an output it writes) for a GPU call: this
        process's compile, else the warm-start cache's artifact (runtime/warm.py: no trace, no
        xDSL, no ptxas), else a compile now, whose artifact the cache keeps for later processes."""
        from ..runtime import warm

        disk_key = None
        if warm.enabled() and not _zero_size(tensors) and \
                self._cache_key(tensors, constants, options) not in self._cache:
            disk_key = warm.function_key(self, tensors, constants, options)
            found = self._warm.get((disk_key, device)) if disk_key else None
            if found is not None:
                return found
            artifact = warm.load(disk_key) if disk_key else None
            if artifact is not None:
                found = self._warm[(disk_key, device)] = (
                    artifact.program(device), artifact.result_names, artifact.record["reads_outputs"])
                return found
        compiled = self._compiled_for(tensors, constants, options)
        program = compiled.gpu_program(device)
        reads_outputs = self.writes_outputs and _reads_an_output(compiled)
        if disk_key is not None:   # keyed again: a dim the compile had to fix is a constant of it
            disk_key = warm.function_key(self, tensors, constants, options)
            warm.store_quietly(disk_key, lambda: self._artifact(compiled, tensors, constants, device, reads_outputs))
        return program, compiled.result_names, reads_outputs

    def _artifact(self, compiled, tensors, constants, device: int, reads_outputs: bool):
        """The serialized form of this call's compile, with cubins for the device's arch."""
        from ..runtime import driver
        from ..runtime.artifact import Artifact

        dims, specs = self.arg_specs(tensors)
        dims = {d: "dynamic" if d in compiled.dynamic_dims else v for d, v in dims.items()}
        return Artifact.from_compiled(compiled, specs, dims=dims, constants=constants,
                                      kind="kernel" if self.writes_outputs else "function",
                                      reads_outputs=reads_outputs,
                                      cubin_archs=(driver.device_platform(device).arch,))

    def _call_key(self, args, options: dict) -> tuple | None:
        """`_gpu_call_key` with the values of the globals and closure variables read."""
        key = self._gpu_call_key(args, options)
        return None if key is None else (key, self.captures.key())

    def __call__(self, *args, **options):
        """Runs on the arguments' device; results come back in the first tensor argument's kind
        (torch in, torch out, on the CPU too; NumPy in, NumPy out; CuPy in, CuPy out). Torch
        tensors that require grad, and torch.compile, go through the function's torch op
        (`torch_autograd`)."""
        if self._fast and not options and not _torch_compiling():
            for fast in self._fast:   # records of recent GPU calls, checked (captures and grad too) and launched in C
                outs = fast(*args)
                if outs is not None:
                    return outs
        if options:
            args, options = self._bind_keywords(args, options)
        if _torch_path(args):
            from . import torch_autograd
            return torch_autograd.call(self, args, options)
        key = self._call_key(args, options)
        known = self._programs.get(key) if key is not None else None
        if known is not None:
            outs = known.program(*[args[i] for i in known.inputs])
            if not options:
                self._try_first(known, args, key)
            return outs[0] if len(outs) == 1 else tuple(outs)
        return self._wide_on_overflow(self._call_slowly, key, args, options)

    def _wide_on_overflow(self, call, key, args, options):
        """`call(key, args, options)`; when a 32-bit-offset generic compile meets a buffer of 2^31
        elements or more (`dims.OffsetWidthError`, which no launch preceded), the function's
        generic compiles take 64-bit offsets from then on, and the call runs again."""
        try:
            return call(key, args, options)
        except OffsetWidthError:
            if self.specialization.wide:
                raise
            self.specialization.wide = True
            return call(key, args, options)

    def _call_slowly(self, key, args, options):
        """A call whose program the fast path does not know: split, compile or find, run, remember."""
        tensors, constants = self._split_args(args)
        if any(_on_gpu(x) for _, x in tensors):
            device, options = _gpu_options(tensors, options)
            options = self._tuned_options(tensors, constants, options, device)
            program, _, _ = self._gpu_program(tensors, constants, options, device)
            outs = program(*[x for _, x in tensors])
            self._remember_program(key, program, tensors)
        else:
            compiled = self._compiled_for(tensors, constants, options)
            outs = compiled.run(*[interop.host_array(x) for _, x in tensors])
            outs = [interop.host_like(tensors[0][1], o) for o in outs] if tensors else outs
        return outs[0] if len(outs) == 1 else tuple(outs)


class Kernel(Function):
    """Destination-passing style: outputs are arguments, written with `C[:] = ...`."""

    writes_outputs = True

    def __call__(self, *args, **options):
        if self._fast and not options and not _torch_compiling():
            for fast in self._fast:   # (checked and launched in C: the record's outputs overlap no other argument)
                if fast(*args) is not None:
                    return None
        if options:
            args, options = self._bind_keywords(args, options)
        key = self._call_key(args, options)
        known = self._programs.get(key) if key is not None else None
        if known is not None:
            ins = [args[i] for i in known.inputs]
            out = [ins[i] for i in known.outputs]
            _through_copies_if_aliased(known.program, ins, known.outputs)(*ins, out=out)
            if not options:
                self._try_first(known, args, key)
            return None
        return self._wide_on_overflow(self._call_slowly, key, args, options)

    def _call_slowly(self, key, args, options):
        tensors, constants = self._split_args(args)
        arrays = {n: x for n, x in tensors}
        if any(_on_gpu(x) for _, x in tensors):
            device, options = _gpu_options(tensors, options)
            options = self._tuned_options(tensors, constants, options, device)
            program, result_names, reads_outputs = self._gpu_program(tensors, constants, options, device)
            for n in result_names:
                if interop.layout_of(arrays[n]) is not None:
                    raise interop.LayoutError(
                        f"{self.name}: output {n!r} has strides {interop.describe(arrays[n]).strides} for shape "
                        f"{tuple(arrays[n].shape)}; kernels store contiguous outputs: store into a contiguous "
                        f"tensor, then copy it into the view")
            if reads_outputs:
                program = _OutputsThroughCopies(program)
            ins, out = [x for _, x in tensors], [arrays[n] for n in result_names]
            names = [n for n, _ in tensors]
            _through_copies_if_aliased(program, ins, [names.index(n) for n in result_names])(*ins, out=out)
            self._remember_program(key, program, tensors, result_names)
            return None
        compiled = self._compiled_for(tensors, constants, options)
        outs = compiled.run(*[interop.host_array(x) for _, x in tensors])
        for name, value in zip(compiled.result_names, outs):
            interop.write_host(arrays[name], value, f"{self.name}: output {name!r}")
        return None


def _arg_dtype(fn_name: str, name: str, x):
    """A tensor argument's dtype as Tessera's, or a DTypeError naming the argument."""
    try:
        return dtypes.lookup(x.dtype)
    except TypeError:
        raise DTypeError(f"{fn_name}: argument {name!r} is {x.dtype}, which Tessera does not compute in "
                         f"(it takes {', '.join(d.name for d in dtypes.ALL)}); cast it first") from None


def _needed_at(e: DynamicDim) -> str:
    """Where a `DynamicDim` came from: the innermost frame of its traceback outside tessera/dims.py
    (the `Dynamic` that refused), as `function in file:line`: the user's line that read the dim, or
    the compiler step that takes it as a constant (files in Tessera named from the package root)."""
    package = Path(__file__).resolve().parents[1]
    where = "?"
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename).resolve()
        if path.name != "dims.py" or path.parent != package:
            inside = package in path.parents
            name = f"tessera/{path.relative_to(package).as_posix()}" if inside else path.name
            where = f"{code.co_name} in {name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _same_objects(a: tuple, b: tuple) -> bool:
    """Whether guard tuples `a` and `b` hold the same objects (module dicts are not compared by value)."""
    return len(a) == len(b) and all(len(x) == len(y) and all(u is v for u, v in zip(x, y)) for x, y in zip(a, b))


@dataclasses.dataclass
class _Known:
    """A GPU call's program, for later calls with the same key: its tensors' positions among the
    arguments, a @kernel's outputs' positions among the tensors, and the record of a call of it
    (`GpuProgram.fast_record`) with the fast path's call of that, once made."""

    program: Any
    inputs: tuple[int, ...]
    outputs: tuple[int, ...] = ()
    record: Any = None
    recorded: bool = False   # whether the record was asked for (it is None where the program has none)
    call: Any = None


def _reads_an_output(compiled) -> bool:
    """Whether a @kernel reads (the old contents of) an argument it also writes: `C[:] = C @ B`."""
    if isinstance(compiled, ZeroSizeCall):
        return False
    args = dict(zip(compiled.arg_names, next(iter(compiled.graph.ops)).body.block.args))
    return any(args[name].uses for name in compiled.result_names)


def _through_copies_if_aliased(program, inputs: Sequence, out_positions: Sequence[int]):
    """`program`, or for a call where an output's memory overlaps another argument's (a view of it,
    `k(C.T, C)`, or one tensor passed as two arguments, `mm(C, B, C)`) the program writing fresh
    arrays that are then copied into the outputs: blocks would otherwise read what other blocks
    already wrote. (An output argument the kernel reads itself: `_reads_an_output`.)
    `out_positions`: each output's position among `inputs`."""
    if isinstance(program, _OutputsThroughCopies):
        return program
    spans = [interop.byte_span(x) for x in inputs]
    for pos in out_positions:
        lo, hi = spans[pos]
        if any(i != pos and a < hi and lo < b for i, (a, b) in enumerate(spans)):
            return _OutputsThroughCopies(program)
    return program


class _OutputsThroughCopies:
    """A @kernel's GPU program writing into fresh arrays that are then copied into its outputs: for
    a kernel that reads an output it writes (`C[:] = C @ B`), whose blocks would otherwise read
    parts of C that other blocks already overwrote."""

    def __init__(self, program):
        self.program = program

    def __call__(self, *inputs, out: Sequence) -> Sequence:
        for target, result in zip(out, self.program(*inputs), strict=True):
            interop.copy_on_device(target, result)
        return out


def torch_op(fn: Function, *example_args):
    """`fn` as a torch custom op, `tessera::<fn's name>`, for the argument kinds of `example_args`
    (tensors, numbers, strings, None: one op per list of kinds), with its fake (shape inference)
    and autograd implementations registered: what torch autograd and `torch.compile` call
    (`torch_autograd`'s module doc). Calls of `fn` with torch tensors that require grad, or
    under torch.compile, register it themselves; this returns it (a `torch.library.CustomOpDef`)
    to call, inspect (`torch.library.opcheck`) or register ahead of a dynamic-shape trace."""
    from .torch_autograd import torch_op as register
    return register(fn, *example_args)


def function(fn: Callable | None = None, **kw):
    """Decorator: `@tessera.function`, or `@tessera.function(static=[...], dynamic=[...])`: dims
    compiled as constants whatever they do, or as kernel arguments from the first call
    (`frontend.specialization`; by default a dim becomes a kernel argument once called with a
    second value)."""
    if fn is None:
        return lambda f: Function(f, **kw)
    return Function(fn, **kw)


class _KernelDecorator:
    """`@tessera.kernel`, and `@tessera.kernel.autotune(space=..., key=..., cache=...)`."""

    def __call__(self, fn: Callable | None = None, **kw):
        """`@tessera.kernel`, or `@tessera.kernel(static=[...], dynamic=[...])`."""
        if fn is None:
            return lambda f: Kernel(f, **kw)
        return Kernel(fn, **kw)

    def autotune(self, space: dict, key: Sequence[str] = (), cache: str | None = None):
        """A kernel whose schedule is tuned on the GPU over `space` (Schedule IR parameter names, in
        either case: `BLOCK_M` or `block_m`), once per value of the `key` dims (all dims when
        empty), with results kept under the `cache` directory (default ~/.cache/tessera/autotune).
        CPU calls, and compiles for a named target, use the space's first values."""
        from ..runtime.autotune import Autotuner, normalize_space, source_hash

        def wrap(fn: Callable) -> Kernel:
            normalized = normalize_space(space, f"@kernel.autotune of {fn.__name__}")
            k = Kernel(fn, space={n: list(v) for n, v in normalized.items()})
            k.autotune_key, k.autotune_cache = tuple(key), cache
            k.tuner = Autotuner(fn.__name__, normalized, tuple(key), cache, source_hash(fn))
            return k
        return wrap


kernel = _KernelDecorator()
