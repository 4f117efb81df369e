"""The `tessera` command line (also `python -m tessera`).

    tessera compile FILE.py[:FUNC] --shape B=2,S=128 [--dtype fp16] [--arch sm_90a] [--dump-ir=all] [-o DIR]
    tessera run     FILE.py[:FUNC] --shape B=2,S=128 [--dtype fp16] [--seed N] [--device auto] [--profile]
    tessera profile FILE.py[:FUNC] --shape B=2,S=128 ... [--plot roofline.png]: profile regions, then per
                    kernel time, TFLOP/s, GB/s, roofline fraction, occupancy (and ncu's metrics)
    tessera bench   [--filter REGEX] [--compare BASELINE.json] [--report RUN.json ...]: the benchmarks
    tessera opt     FILE.mlir [--passes=fuse,lower-to-tile] [--verify-only]
    tessera package FILE.py[:FUNC]... --arch sm_80,sm_90a --shape B=2,S=128 [--shape ...] -o DIR
    tessera targets [--arch sm_90a]
    tessera demo    flash attention from examples/: compile, run, check, report

A mistake in the user's program, inputs or IR (a TesseraError, an xDSL
VerifyException, an unknown arch, a missing file) prints one `error:` line,
plus `  at file:line` when it points into the user's code, and exits 1;
`--traceback` shows the Python traceback instead.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
import time
import traceback
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Sequence

import numpy as np
from xdsl.utils.exceptions import ParseError, VerifyException

from . import dtypes, platforms
from .backends import BACKEND_OPTIONS
from .passes import backend_choice
from .compiler import DEFAULT_ARCH, DUMP_STAGES, IR_STAGES, STAGES_BY_NAME, Compiled, KernelLaunch, Options
from .dims import DynamicDim
from .dtypes import DType
from .errors import TesseraError, is_internal
from .frontend.function import Function
from .frontend.trace import ArgSpec
from .runtime import interop
from .runtime.profile import profile_report, reset_profile

DEFAULT_DTYPE = "fp16"
DEFAULT_OUT = Path("tessera_out")

#: Pass criterion of `run` and `demo`: ||out - ref|| / ||ref|| (float64, against the exact
#: float64 reference) at most `reference.output_tolerances`' relative bound: a function of the
#: least precise dtype an output is computed from and of its reduction length.

#: The demo runs the checkout's example, so it needs the source tree (an editable install, as the README sets up).
DEMO_FILE = Path(__file__).resolve().parents[1] / "examples" / "flash_attention.py"
DEMO_FUNCTIONS = ("flash_attention", "causal_flash_attention")
DEMO_SHAPE = "B=2,H=4,S=1000,D=64"

#: Errors that are the user's to fix; anything else is a compiler bug and keeps its traceback.
USER_ERRORS = (TesseraError, VerifyException, platforms.UnknownArchError, OSError)


# --- command-line values -----------------------------------------------------------

def parse_shape(text: str) -> dict[str, int]:
    """`B=2,H=4` -> {"B": 2, "H": 4}: the values of a function's symbolic dims."""
    dims = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not (sep and name.isidentifier() and value.isdigit() and int(value) > 0):
            raise TesseraError(f"bad --shape entry {item!r}: expected NAME=SIZE with a positive integer size, "
                               f"as in --shape B=2,S=128")
        dims[name] = int(value)
    return dims


def parse_layouts(items: Sequence[str] | None) -> dict[str, tuple[str, ...]]:
    """`["q=B,S,H,D"]` -> {"q": ("B", "S", "H", "D")}: each argument's dims in the order its memory
    holds them, outermost first (names of its dims, or their indices)."""
    layouts = {}
    for item in items or ():
        name, sep, order = (s.strip() for s in item.partition("="))
        dims = tuple(d.strip() for d in order.split(",") if d.strip())
        if not (sep and name.isidentifier() and dims):
            raise TesseraError(f"bad --layout {item!r}: expected ARG=DIM,DIM,... (the argument's dims in memory "
                               f"order, outermost first), as in --layout q=B,S,H,D")
        if name in layouts:
            raise TesseraError(f"--layout gives {name!r} twice")
        layouts[name] = dims
    return layouts


def with_layouts(specs: Sequence[ArgSpec], layouts: dict[str, tuple[str, ...]]) -> list[ArgSpec]:
    """`specs`, each argument `--layout` names given the strides of its dims stored in that order."""
    by_name = {s.name: s for s in specs}
    unknown = sorted(set(layouts) - set(by_name))
    if unknown:
        raise TesseraError(f"--layout names {', '.join(map(repr, unknown))}, not an argument of the function "
                           f"({', '.join(by_name)})")
    out = []
    for spec in specs:
        order = layouts.get(spec.name)
        if order is not None:
            perm = _memory_order(spec, order)
            strides = [0] * len(perm)
            step = 1
            for d in reversed(perm):
                strides[d] = step
                step *= spec.shape[d]
            spec = dataclasses.replace(spec, strides=interop.canonical_strides(spec.shape, tuple(strides)))
        out.append(spec)
    return out


def _memory_order(spec: ArgSpec, order: tuple[str, ...]) -> list[int]:
    """The dim indices of `spec` in `order` (names of its symbolic dims, or indices), checked to be
    a permutation."""
    names = [d for d in spec.dims if isinstance(d, str)]
    perm = [spec.dims.index(d) if names.count(d) == 1 else int(d) if d.isdigit() else -1 for d in order]
    if sorted(perm) != list(range(len(spec.dims))):
        raise TesseraError(f"--layout {spec.name}={','.join(order)}: name each of its dims once, outermost in memory "
                           f"first, by name ({', '.join(names) or 'none'}) or index (0..{len(spec.dims) - 1})")
    return perm


def parse_dtype(name: str) -> DType:
    """A Tessera dtype by name, the lookup's TypeError turned into a user error."""
    try:
        return dtypes.lookup(name)
    except TypeError as err:
        raise TesseraError(str(err)) from None


def parse_stages(text: str) -> tuple[str, ...]:
    """`--dump-ir` -> stage names in pipeline order; `all` means every stage `dump` writes."""
    requested = {s.strip() for s in text.split(",") if s.strip()}
    unknown = sorted(requested - {"all", *DUMP_STAGES})
    if unknown:
        raise TesseraError(f"unknown IR stage(s) {', '.join(unknown)} for --dump-ir; "
                           f"stages are {', '.join(DUMP_STAGES)}, or all")
    return tuple(s for s in DUMP_STAGES if "all" in requested or s in requested)


def _split_target(target: str) -> tuple[Path, str | None]:
    """`FILE.py:FUNC` -> (FILE.py, FUNC); a suffix that is no identifier belongs to the path."""
    path, sep, name = target.rpartition(":")
    return (Path(path), name) if sep and name.isidentifier() else (Path(target), None)


def import_file(path: Path) -> ModuleType:
    """Imports the user's file under a private module name (a file called json.py must not
    shadow the library), registered in sys.modules as dataclasses and pickle expect."""
    if path.suffix != ".py" or not path.is_file():
        raise TesseraError(f"no Python file {str(path)!r}")
    name = f"_tessera_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def functions_in(module: ModuleType) -> dict[str, Function]:
    """The @tessera.function (and @tessera.kernel) objects a module defines, by attribute name;
    ones it merely imports belong to another file."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, Function) and value.fn.__module__ == module.__name__}


def load_function(target: str) -> Function:
    """The function `FILE.py[:FUNC]` names: FUNC, or the file's only @tessera.function."""
    path, name = _split_target(target)
    found = functions_in(import_file(path))
    if name is None and len(found) == 1:
        return next(iter(found.values()))
    if name in found:
        return found[name]
    candidates = ", ".join(found) or "none"
    if name is not None:
        raise TesseraError(f"{path} has no @tessera.function named {name!r}; candidates: {candidates}")
    if not found:
        raise TesseraError(f"{path} defines no @tessera.function")
    raise TesseraError(f"{path} defines several @tessera.functions ({candidates}); pick one with {path}:NAME")


# --- compiling and checking ----------------------------------------------------------------

def compile_function(fn: Function, args: argparse.Namespace, device: "Device | None" = None
                     ) -> tuple[Compiled, list[ArgSpec]]:
    """Compiles `fn` for `--shape`, `--dtype`, `--arch` and `--path` (a GPU device decides the arch
    itself); an unknown arch fails before tracing."""
    arch = device.arch() if device is not None and device.arch is not None else args.arch
    platforms.get(arch)
    specs = with_layouts(fn.arg_specs_for(parse_shape(args.shape), parse_dtype(args.dtype)),
                         parse_layouts(getattr(args, "layout", None)))
    debugging = {"line_info": getattr(args, "line_info", False), "profile": getattr(args, "profile", False)}
    dynamic = frozenset(d.strip() for d in (getattr(args, "dynamic", "") or "").split(",") if d.strip())
    named = {d for s in specs for d in s.dims if isinstance(d, str)}
    if dynamic - named:
        raise TesseraError(f"--dynamic names {', '.join(sorted(dynamic - named))}, not a dim of {fn.name}'s "
                           f"arguments ({', '.join(sorted(named))})")
    try:
        return fn.compile(specs, dynamic=dynamic, arch=arch, path=args.path, backend=args.backend,
                          **debugging), specs
    except DynamicDim as e:   # `--dynamic` named a dim some step needs the value of
        raise TesseraError(f"{fn.name} cannot take dim {e.dim!r} at run time: {e}") from None


@dataclass(frozen=True)
class Device:
    """Somewhere `run` and `demo` execute a compiled function."""

    name: str
    description: str
    available: Callable[[], bool]
    execute: Callable[[Compiled, Sequence[np.ndarray]], list[np.ndarray]]
    arch: Callable[[], str] | None = None    # the arch to compile for, when the device has one


def _run_on_cpu(compiled: Compiled, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return compiled.run(*inputs)


def _gpu_available() -> bool:
    try:
        import torch
        from .runtime import driver
        return torch.cuda.is_available() and driver.device_count() > 0
    except (ImportError, RuntimeError):
        return False


def _gpu_arch() -> str:
    from .runtime import driver
    return driver.Device(0).platform().arch


#: NumPy has no bf16/fp8; these cross into torch as raw bits of the same width.
_BIT_VIEWS = {dtypes.bf16: (np.int16, "bfloat16", "int16"), dtypes.fp8_e4m3: (np.int8, "float8_e4m3fn", "int8"),
              dtypes.fp8_e5m2: (np.int8, "float8_e5m2", "int8")}


def _to_torch(x: np.ndarray):
    """`x` on device 0, in its own layout (its strides, which the compile specialized on)."""
    import torch
    dt = dtypes.lookup(x.dtype)
    dense = np.ascontiguousarray(x)
    if dt in _BIT_VIEWS:
        bits, name, _ = _BIT_VIEWS[dt]
        t = torch.from_numpy(dense.view(bits)).cuda().view(getattr(torch, name))
    else:
        t = torch.from_numpy(dense).cuda()
    if x.flags.c_contiguous:
        return t
    strided = torch.empty_strided(x.shape, [st // x.itemsize for st in x.strides], dtype=t.dtype, device=t.device)
    return strided.copy_(t)


def _to_numpy(t) -> np.ndarray:
    import torch
    dt = dtypes.lookup(t.dtype)
    if dt in _BIT_VIEWS:
        return t.view(getattr(torch, _BIT_VIEWS[dt][2])).cpu().numpy().view(dt.np)
    return t.cpu().numpy()


def _run_on_gpu(compiled: Compiled, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Through torch tensors on device 0; the time includes the copies in and out."""
    import torch
    outputs = compiled.gpu_program(0)(*[_to_torch(x) for x in inputs])
    torch.cuda.synchronize()
    return [_to_numpy(o) for o in outputs]


#: Execution targets, preferred first: `--device auto` takes the first available one.
DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("gpu", "CUDA device 0 (generated PTX)", _gpu_available, _run_on_gpu, _gpu_arch),
    Device("cpu", "CPU tile interpreter", lambda: True, _run_on_cpu),
)}


def pick_device(name: str) -> Device:
    """The device `--device` names; `auto` is the first available in DEVICES."""
    if name == "auto":
        return next(d for d in DEVICES.values() if d.available())
    if not DEVICES[name].available():
        raise TesseraError(f"device {name!r} is not available on this machine")
    return DEVICES[name]


def random_input(rng: np.random.Generator, spec: ArgSpec) -> np.ndarray:
    """Standard normal values for float arguments, small integers or coin flips otherwise, laid out
    as the spec's strides say."""
    if spec.dtype.is_float:
        x = rng.standard_normal(spec.shape).astype(spec.dtype.np)
    elif spec.dtype == dtypes.bool_:
        x = rng.random(spec.shape) < 0.5
    else:
        x = rng.integers(-8, 8, spec.shape).astype(spec.dtype.np)
    if spec.strides is None:
        return x
    storage = np.empty(1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.strides)), x.dtype)
    view = np.ndarray(spec.shape, x.dtype, buffer=storage, strides=[st * x.itemsize for st in spec.strides])
    view[...] = x
    return view


def tolerances(compiled: Compiled, specs: Sequence[ArgSpec] = ()) -> list[float]:
    """Each output's bound on ||out - ref|| / ||ref||: for the least precise dtype among the values
    it is computed from and its reduction length (`tessera.interpreter.reference.tolerance`; a
    dynamic dim's length the `specs`')."""
    from .interpreter.reference import output_tolerances
    sizes = {d: n for s in specs for d, n in zip(s.dims, s.shape) if isinstance(d, str)}
    try:
        return [t.relative for t in output_tolerances(next(iter(compiled.graph.ops)), sizes)]
    except ValueError as err:   # a dtype no tolerance covers
        raise TesseraError(str(err)) from None


@dataclass(frozen=True)
class OutputError:
    """How far one output is from the reference."""

    name: str
    max_abs: float
    relative: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative <= self.tolerance  # False for NaN: unwritten outputs stay poisoned

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"max abs error {self.max_abs:.2e}, relative error {self.relative:.2e} "
                f"(tolerance {self.tolerance:.1e}): {verdict}")


def compare(name: str, out: np.ndarray, ref: np.ndarray, tol: float) -> OutputError:
    """Max abs and relative (||out-ref|| / ||ref||) error in float64, over the elements the reference
    is not NaN at: where it is (a softmax over no key, a row no sequence holds), the output must be
    NaN too, and an output NaN anywhere else (an unwritten, poisoned element) is an error of NaN."""
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    undefined = np.isnan(ref)
    if (np.isnan(out) != undefined).any():
        return OutputError(name, float("nan"), float("nan"), tol)
    out, ref = np.where(undefined, 0.0, out), np.where(undefined, 0.0, ref)
    diff = out - ref
    ref_norm = np.linalg.norm(ref)
    relative = np.linalg.norm(diff) / ref_norm if ref_norm else (np.inf if diff.any() else 0.0)
    return OutputError(name, float(np.abs(diff).max(initial=0.0)), float(relative), tol)


@dataclass(frozen=True)
class Check:
    """One execution of a compiled function on random inputs, against the NumPy reference."""

    device: Device
    run_seconds: float
    errors: list[OutputError]

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.errors)


def check(compiled: Compiled, specs: Sequence[ArgSpec], device: Device, seed: int) -> Check:
    """Runs `compiled` on `device` with fresh random inputs for `seed` and compares every output."""
    rng = np.random.default_rng(seed)
    inputs = [random_input(rng, s) for s in specs]
    start = time.perf_counter()
    outputs = device.execute(compiled, inputs)
    run_seconds = time.perf_counter() - start
    references = compiled.reference(*inputs)
    errors = [compare(name, out, ref, tol)
              for name, out, ref, tol in zip(compiled.result_names, outputs, references, tolerances(compiled, specs),
                                             strict=True)]
    return Check(device, run_seconds, errors)


# --- reports -------------------------------------------------------------------------

def print_fields(rows: Iterable[tuple[str, object]], indent: str = "  ") -> None:
    """`label  value` lines with the values aligned (a value's further lines too)."""
    rows = list(rows)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{indent}{label:<{width}}  " + str(value).replace("\n", "\n" + " " * (len(indent) + width + 2)))


def _shape_text(args: argparse.Namespace) -> str:
    return " ".join(f"{k}={v}" for k, v in parse_shape(args.shape).items())


def _check_rows(compiled: Compiled, result: Check) -> list[tuple[str, object]]:
    return [("device", f"{result.device.name} ({result.device.description})"),
            ("compile", f"{compiled.compile_seconds:.2f} s"),
            ("run", f"{result.run_seconds:.2f} s"),
            *((e.name, e) for e in result.errors)]


def _show_path(path: Path) -> str:
    """Relative to the working directory when under it: shorter, and what the user typed."""
    return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)


# --- subcommands ---------------------------------------------------------------------

def cmd_compile(args: argparse.Namespace) -> int:
    """Compiles a function and writes the requested stages' IR, and each kernel's PTX and cubin."""
    fn = load_function(args.target)
    stages = parse_stages(args.dump_ir)
    compiled, specs = compile_function(fn, args)
    out = Path(args.output or DEFAULT_OUT / fn.name)
    ir_stages = [s for s in stages if s in IR_STAGES]   # the kernels' code is written in any case, beside cubins
    written = compiled.dump(out, ir_stages) if ir_stages else []
    binaries, reports, notes = write_kernels(compiled, out)
    print(f"compiled {fn.name} for {args.arch} ({args.dtype}, {_shape_text(args)}, {args.path} path, "
          f"backend {args.backend})")
    strided = [f"{a.name} {list(a.strides)}" for a in specs if a.strides and a.name not in compiled.copied_args]
    print_fields([("kernels", ", ".join(compiled.kernel_names)),
                  *([("strided", f"{', '.join(strided)} (read in place)")] if strided else []),
                  *[("copied", f"{name}: {why}") for name, why in compiled.copied_args.items()],
                  *[("layout copy", f"{name}: {what}") for name, what in compiled.layout_copies.items()],
                  ("compile", f"{compiled.compile_seconds:.2f} s"),
                  ("wrote", ", ".join(map(_show_path, written + binaries))
                   or ("nothing" if stages else "nothing (--dump-ir is empty)")),
                  *[("cubins", note) for note in notes]])
    for report in reports:
        print(report)
    rules = backend_choice.rules_named(why for _, why in compiled.kernel_backends.values())
    if rules:
        print_fields([("backend rules", "\n".join(f"{rule.name}: {rule.backend}, {rule.why}" for rule in rules))])
    return 0


def write_kernels(compiled: Compiled, out: Path) -> tuple[list[Path], list[str], list[str]]:
    """Each kernel's code: the PTX backend's `.ptx` (the ptx stage), the CUDA Tile IR backend's
    `.cuda_tile.mlir` and `.tilebc` (the cuda_tile stage); every kernel's `.cubin` where the
    assemblers its kernels need are installed (the cubin stage). Returns the files, a report per
    kernel (its backend, launch, schedule, and what ptxas says of it) and notes of what was
    skipped. A target with no backend, or a kernel its backend cannot emit, is an error."""
    from .backends.cuda_tile import tools
    from .runtime import ptxas

    platform = compiled.options.platform()
    if platform.vendor not in VENDOR_BACKENDS:
        raise TesseraError(f"no backend for {platform.arch} ({platform.vendor}): Tessera emits code for "
                           f"{', '.join(f'{v} GPUs ({b})' for v, b in VENDOR_BACKENDS.items())} only; "
                           f"the IR dumps are in {_show_path(out)}")
    backends = {backend for backend, _ in compiled.kernel_backends.values()}
    written = _write_ptx(compiled, out) if "ptx" in backends else []
    if "cuda-tile" in backends:
        written += compiled.dump(out, ["cuda_tile"])
    missing = [f"{tool} not found ({hint})" for backend, tool, present, hint in [
        ("ptx", "ptxas", ptxas.available, "the CUDA toolkit, or pip install nvidia-cuda-nvcc"),
        ("cuda-tile", "tileiras", tools.available, tools.INSTALL_HINT)] if backend in backends and not present()]
    if missing:
        # (a CUDA Tile IR kernel's launch is read from its cubin: no cubin, no report)
        reports = [] if "cuda-tile" in backends else [kernel_report(compiled, compiled.launches[name], None)
                                                      for name in compiled.kernel_names]
        return written, reports, [f"skipped: {why}" for why in missing]
    cubins = compiled.stage("cubin")
    reports = []
    for name in compiled.kernel_names:
        path = out / f"{name}.cubin"
        path.write_bytes(cubins[name].cubin)
        written.append(path)
        resources = getattr(cubins[name], "resources", {}).get(name)   # (ptxas's report)
        reports.append(kernel_report(compiled, compiled.launches[name], resources))
    return written, reports, []


#: The code generators, by GPU vendor: a target of any other vendor gets IR dumps and an error.
VENDOR_BACKENDS = {"nvidia": "PTX and CUDA Tile IR"}


def _write_ptx(compiled: Compiled, out: Path) -> list[Path]:
    """Each PTX kernel's `.ptx`; a kernel the PTX backend cannot emit is an error that says where
    the IR dumps are."""
    from .backends.ptx import UnsupportedByBackend

    platform = compiled.options.platform()
    try:
        kernels = compiled.stage("ptx")
    except UnsupportedByBackend as e:
        reason = e.message.removeprefix("PTX backend: ")
        raise TesseraError(f"the PTX backend cannot compile {compiled.name} for {platform.arch}: {reason} "
                           f"The IR dumps are in {_show_path(out)}.") from None
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, kernel in kernels.items():
        written.append(out / f"{name}.ptx")
        written[-1].write_text(kernel.ptx)
    return written


def kernel_report(compiled: Compiled, launch: KernelLaunch, resources) -> str:
    """What a kernel engineer asks of a kernel first: its launch, its schedule, and (from ptxas)
    its registers, shared memory, spills and the blocks an SM holds."""
    axes = [str(n) for n in launch.grid]
    for axis, param, dim, block in launch.grid_terms:   # a grid that grows with a dynamic dim
        grows = f"cdiv(param {param} dim {dim}, {block})"
        axes[axis] = grows if axes[axis] == "1" else f"{axes[axis]}*{grows}"
    grid = " x ".join(axes)
    backend, why = compiled.kernel_backends[launch.name]
    rows = [("backend", f"{backend} ({why})" if why else backend),
            ("launch", f"grid {grid}, {launch.threads} threads, {_bytes(launch.dynamic_shared)} dynamic shared memory"),
            ("schedule", _schedule_text(compiled, launch.name))]
    if resources is not None:
        shared = launch.dynamic_shared + resources.shared_bytes
        spills = (f"{resources.spill_store_bytes} bytes spilled" if resources.spill_store_bytes
                  else "no spills")
        rows.append(("ptxas", f"{resources.registers} registers, {_bytes(resources.shared_bytes)} static shared "
                              f"memory, {spills}"))
        platform = compiled.options.platform()
        if platform.vendor == "nvidia":
            blocks, limits = platforms.occupancy(platform, launch.threads, resources.registers, shared)
            rows.append(("per SM", f"{blocks} block{'s' if blocks != 1 else ''} (limited by {' and '.join(limits)})"))
    width = max(len(label) for label, _ in rows)
    return "\n".join([f"  {launch.name}"] + [f"    {label:<{width}}  {value}" for label, value in rows])


def _schedule_text(compiled: Compiled, name: str) -> str:
    """The Schedule IR params a kernel was built from. A split-K GEMM's or split-KV attention's
    schedule.kernel becomes two kernels: `<name>_partials` runs its tiling over the splits,
    `<name>` only combines their results."""
    from .ir import schedule
    from .lowering.schedule_to_tile import SPLIT_PARTIALS

    kernels = {op.sym_name.data: op for op in compiled.modules["schedule"].walk() if isinstance(op, schedule.KernelOp)}
    if name + SPLIT_PARTIALS in compiled.kernel_names:
        if kernels[name].kind.data == "flash_attention":
            return (f"combines the outputs of {name}{SPLIT_PARTIALS}'s key splits by their row log-sum-exp, in "
                    f"split order, then the epilogue")
        return f"sums the fp32 partial products of {name}{SPLIT_PARTIALS} in split order, then the epilogue"
    if name not in kernels and name.endswith(SPLIT_PARTIALS):
        name = name.removesuffix(SPLIT_PARTIALS)
    return " ".join(f"{k}={v}" for k, v in kernels[name].param_values.items()) if name in kernels else "-"


def cmd_package(args: argparse.Namespace) -> int:
    """Compiles each function for every --shape and every --arch, and writes them as an AOT package
    (manifest.json, cubins and PTX) that `tessera.load` runs with no compiler behind it."""
    from .runtime import cpp_package, package, ptxas

    if not ptxas.available():
        raise TesseraError("tessera package assembles cubins, which needs ptxas (the CUDA toolkit, or "
                           "pip install nvidia-cuda-nvcc)")
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    for arch in archs:
        if platforms.get(arch).vendor not in VENDOR_BACKENDS:
            raise TesseraError(f"no backend for {arch}: a package holds PTX and cubins for NVIDIA GPUs only")
    functions = [load_function(target) for target in args.targets]
    shapes = [parse_shape(s) for s in args.shape]
    dynamic = [d.strip() for d in args.dynamic.split(",") if d.strip()]
    artifacts = package.build(functions, shapes, archs, parse_dtype(args.dtype), args.path, dynamic)
    manifest = package.write(args.output, artifacts)
    cpp_package.write(args.output, artifacts, _package_references(functions, shapes, archs[0], args, dynamic),
                      seed=args.seed)
    for a in artifacts:
        shapes_text = ", ".join(f"{x['name']} {x['dtype']}{x['shape']}" for x in a.record["arguments"])
        print(f"  {a.name} for {a.record['arch']}: {shapes_text} ({len(a.record['kernels'])} kernels)")
    print(f"wrote {_show_path(manifest)} ({len(artifacts)} specializations, "
          f"{len(set().union(*(a.files for a in artifacts)))} image files)")
    return 0


def _package_references(functions, shapes, arch: str, args: argparse.Namespace, dynamic=()) -> dict:
    """Per function, per argument signature (`cpp_package.groups`' key, a `dynamic` dim by its
    name): (inputs, outputs, tolerances) of one run on the CPU interpreter on random inputs for
    `--seed`, which the package's C++ example checks the GPU against."""
    out: dict = {}
    for fn in functions:
        for dims in shapes:
            specs = fn.arg_specs_for(dict(dims), parse_dtype(args.dtype))
            compiled = fn.compile(specs, arch=arch, path=args.path)
            inputs = [random_input(np.random.default_rng(args.seed), s) for s in specs]
            key = tuple((tuple(d if d in dynamic else n for d, n in zip(s.dims, s.shape)), s.dtype.name)
                        for s in specs)
            if key not in out.get(compiled.name, {}):   # (a dynamic dim's first --shape is the reference)
                out.setdefault(compiled.name, {})[key] = (inputs, _run_on_cpu(compiled, inputs), tolerances(compiled))
    return out


def cmd_run(args: argparse.Namespace) -> int:
    """Compiles, runs on random inputs and checks against the reference; exit 1 on a mismatch."""
    fn = load_function(args.target)
    device = pick_device(args.device)
    compiled, specs = compile_function(fn, args, device)
    reset_profile()
    result = check(compiled, specs, device, args.seed)
    print(f"{fn.name} for {compiled.arch} on {device.name} ({args.dtype}, {_shape_text(args)}, seed {args.seed})")
    print_fields(_check_rows(compiled, result))
    if args.profile:   # per kernel, the median over blocks of each region's time and share
        print(profile_report())
    return 0 if result.passed else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    """`tessera profile`: tessera/bench/profile_command.py."""
    from .bench.profile_command import cmd_profile
    return cmd_profile(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """The flash attention examples end to end: compile, dump every stage, run, check, report."""
    found = functions_in(import_file(DEMO_FILE))
    device = pick_device(args.device)
    arch = device.arch() if device.arch else args.arch
    print(f"Tessera demo: {_show_path(DEMO_FILE)} for {arch} on {device.description}, {args.dtype}, "
          f"{_shape_text(args)}\n")
    results = []
    for name in DEMO_FUNCTIONS:
        compiled, specs = compile_function(found[name], args, device)
        written = compiled.dump(Path(args.out_dir) / name, IR_STAGES)
        result = check(compiled, specs, device, args.seed)
        results.append(result)
        print(name)
        print_fields([("kernels", ", ".join(compiled.kernel_names)),
                      ("IR dumps", f"{_show_path(written[0].parent)}/{{{','.join(IR_STAGES)}}}.mlir"),
                      *_check_rows(compiled, result)])
        print()
    passed = all(r.passed for r in results)
    print("all outputs match the NumPy reference" if passed else "FAILED: outputs differ from the NumPy reference")
    return 0 if passed else 1


@dataclass(frozen=True)
class Pass:
    """An `opt` pass: the IR level it reads (None: any), and the function from module to module."""

    takes: str | None
    help: str
    run: Callable[[object, argparse.Namespace], object]


def _stage(name: str) -> Callable[[object, argparse.Namespace], object]:
    """The compiler's stage `name` (tessera/compiler.py's STAGES) as an `opt` pass, for --arch."""
    run_stage = STAGES_BY_NAME[name].run
    return lambda module, args: run_stage(module, Options(arch=args.arch))


def _canonicalize(module, args):
    from xdsl.transforms.canonicalize import CanonicalizePass

    from .ir import context
    CanonicalizePass().apply(context(), module)
    return module


def _cse(module, args):
    from xdsl.transforms.common_subexpression_elimination import CommonSubexpressionElimination

    from .ir import context
    CommonSubexpressionElimination().apply(context(), module)
    return module


def _assign_layouts(module, args):
    from .ir import target
    from .lowering.assign_layouts import annotate_layouts
    for kernel in module.walk():
        if isinstance(kernel, target.KernelOp) and kernel.platform.vendor.data == "nvidia":
            annotate_layouts(kernel)
    return module


def _check_async(module, args):
    from .passes.check_async import opt_pass
    return opt_pass(module, args)


PASSES: dict[str, Pass] = {
    "fuse": Pass("graph", "Graph IR -> Schedule IR (fusion groups)", _stage("schedule")),
    "lower-to-tile": Pass("schedule", "Schedule IR -> Tile IR (block programs)", _stage("tile")),
    "lower-to-target": Pass("tile", "Tile IR -> Target IR for --arch", _stage("target")),
    "canonicalize": Pass(None, "xDSL canonicalization (folds, dead code), in place", _canonicalize),
    "cse": Pass(None, "xDSL common subexpression elimination, in place", _cse),
    "assign-layouts": Pass("target", "(re)writes every register tile's layout (part of lower-to-target)",
                           _assign_layouts),
    "check-async": Pass("target", "async-hazard checker: prints each hazard, fails on any", _check_async),
}

#: A module's level is that of the lowest-level dialect it uses (schedule kernels hold graph ops).
LEVEL_DIALECTS = (("target", "tessera_target."), ("tile", "tile."), ("schedule", "schedule."), ("graph", "graph."))


def ir_level(module) -> str | None:
    names = {op.name for op in module.walk()}
    return next((level for level, prefix in LEVEL_DIALECTS if any(n.startswith(prefix) for n in names)), None)


def parse_passes(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PASSES]
    if unknown:
        raise TesseraError(f"unknown pass(es) {', '.join(unknown)}; passes are {', '.join(PASSES)}")
    return names


def parse_file(path: str):
    """The module in an MLIR file (`-`: stdin), a ParseError turned into `file:line:col`."""
    from .ir import parse_ir
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        return parse_ir(text)
    except ParseError as err:
        where = err.span.get_location()
        raise TesseraError(err.msg, f"{path}:{where.line}:{where.col}") from None


def cmd_opt(args: argparse.Namespace) -> int:
    """Parses, verifies, runs passes (verifying after each) and prints the result, like mlir-opt."""
    from .ir import print_ir
    names = parse_passes(args.passes)
    module = parse_file(args.file)
    module.verify()
    for name in names:
        level, wanted = ir_level(module), PASSES[name].takes
        if wanted not in (None, level):
            raise TesseraError(f"pass {name!r} takes {wanted} IR, but its input is {level or 'not Tessera'} IR")
        module = PASSES[name].run(module, args)
        module.verify()
    if not args.verify_only:
        sys.stdout.write(print_ir(module))
    return 0


def _kib(n: int) -> str:
    return f"{n // 1024} KiB"


def _bytes(n: int) -> str:
    """`n` bytes as a reader wants them: 512 bytes, 18 KiB, 81.0 KiB."""
    if n < 1024:
        return f"{n} bytes"
    return f"{n // 1024} KiB" if n % 1024 == 0 else f"{n / 1024:.1f} KiB"


#: `tessera targets` columns: header, and the cell of one platform.
TARGET_COLUMNS: tuple[tuple[str, Callable[[platforms.Platform], str]], ...] = (
    ("arch", lambda p: p.arch),
    ("vendor", lambda p: p.vendor),
    ("version", lambda p: ".".join(map(str, p.version))),
    ("SMs/CUs", lambda p: str(p.sm_count)),
    ("warp", lambda p: "/".join(map(str, p.wave_sizes))),
    ("smem/block", lambda p: _kib(p.max_shared_per_block)),
    ("regs/SM", lambda p: str(p.regs_per_sm)),
    ("matrix instructions", lambda p: ", ".join(sorted(platforms.mma_families(p))) or "-"),
    ("copy", lambda p: platforms.copy_mechanism(p)),
)


def _ptx(p: platforms.Platform) -> str:
    return f"{platforms.ptx_version(p)}, {platforms.ptx_target(p)}" if p.vendor == "nvidia" else "-"


def _mma(i: platforms.MmaInstr) -> str:
    n = f"n{i.n} (steps of {i.n_step})" if i.n_step else f"n{i.n}"
    return f"{i.family} m{i.m} {n} k{i.k}, {i.operand} -> {i.acc}"


#: `tessera targets --arch X` rows: label, and the value for one platform.
TARGET_DETAILS: tuple[tuple[str, Callable[[platforms.Platform], str]], ...] = (
    ("vendor", lambda p: p.vendor),
    ("version", lambda p: ".".join(map(str, p.version))),
    ("SMs / CUs", lambda p: str(p.sm_count)),
    ("wave sizes", lambda p: ", ".join(map(str, p.wave_sizes))),
    ("max threads / block", lambda p: str(p.max_threads_per_block)),
    ("max threads / SM", lambda p: str(p.max_threads_per_sm)),
    ("max blocks / SM", lambda p: str(p.max_blocks_per_sm)),
    ("shared memory / block", lambda p: _kib(p.max_shared_per_block)),
    ("shared memory / SM", lambda p: _kib(p.max_shared_per_sm)),
    ("registers / SM", lambda p: str(p.regs_per_sm)),
    ("max registers / thread", lambda p: str(p.max_regs_per_thread)),
    ("PTX", _ptx),
    ("copy global->shared", lambda p: ", ".join(platforms.copy_mechanisms(p))),
)


def _print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers))]
    for row in (headers, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def cmd_targets(args: argparse.Namespace) -> int:
    """Every registered platform as a table, or one platform in full with `--arch`."""
    if args.arch is None:
        _print_table([h for h, _ in TARGET_COLUMNS],
                     [[cell(p) for _, cell in TARGET_COLUMNS] for p in platforms.all_platforms()])
        return 0
    p = platforms.get(args.arch)
    print(p.arch)
    print_fields([*((label, value(p)) for label, value in TARGET_DETAILS),
                  *(("matrix instruction", _mma(i)) for i in platforms.mma_instructions(p))])
    print("features")
    print_fields([(f, platforms.FEATURES[f]) for f in sorted(p.features)])
    return 0


# --- the parser ------------------------------------------------------------------------

def _function_options(parser: argparse.ArgumentParser, shape: str | None = None) -> None:
    """Options that say what to compile: shapes, dtype, arch."""
    parser.add_argument("--shape", default=shape, required=shape is None, metavar="B=2,S=128,...",
                        help="values of the function's symbolic dims" + (f" (default {shape})" if shape else ""))
    parser.add_argument("--dtype", default=DEFAULT_DTYPE,
                        help=f"dtype of arguments not annotated with one (default {DEFAULT_DTYPE})")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help=f"target architecture (default {DEFAULT_ARCH}; "
                                                             f"a GPU run uses its device's); see `tessera targets`")
    parser.add_argument("--path", choices=["ampere", "native"], default="native",
                        help="code path: native (every feature of --arch a kernel can use, e.g. TMA + wgmma "
                             "GEMMs on sm_90a) or ampere (mma.sync + cp.async, on any sm_80+) (default native)")
    parser.add_argument("--layout", action="append", metavar="ARG=DIM,...",
                        help="an argument's dims in memory order, outermost first (repeatable): --layout q=B,S,H,D "
                             "compiles for q a [B, S, H, D] buffer seen as its annotated [B, H, S, D]")
    parser.add_argument("--backend", choices=list(BACKEND_OPTIONS), default="auto",
                        help="code generator of each kernel: auto (a rule per kernel, which the compile report "
                             "states), ptx (Tessera's PTX, assembled by ptxas) or cuda-tile (NVIDIA's CUDA Tile IR, "
                             "assembled by tileiras: pip install 'tessera[cuda-tile]') (default auto)")


def _run_options(parser: argparse.ArgumentParser) -> None:
    """Options that say how to execute and check."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--device", choices=["auto", *DEVICES], default="auto",
                        help="where to run (default auto: the first available of " + ", ".join(DEVICES) + ")")


def _dynamic_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dynamic", default="", metavar="DIM,...",
                        help="dims the kernels take at run time (shape-generic; --shape gives the hint): the IR "
                             "shows them as ? and the kernels' size params")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="show the Python traceback of an error")
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera: tensor math in Python, "
                                     "compiled through Graph, Schedule, Tile and Target IR to GPU kernels.")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("compile", parents=[common], help="compile a function; write its IR, PTX and cubins")
    p.add_argument("target", metavar="FILE.py[:FUNC]")
    _function_options(p)
    p.add_argument("--dump-ir", default="all", metavar="STAGES",
                   help=f"stages to write, comma-separated from {', '.join(DUMP_STAGES)}, or all (default all)")
    p.add_argument("-o", "--output", metavar="DIR", help=f"where to write the IR, each kernel's .ptx and, with ptxas, its .cubin "
                        f"(default {DEFAULT_OUT}/FUNC)")
    p.add_argument("--line-info", action="store_true",
                   help="PTX with .loc line info of your source lines, assembled with ptxas -lineinfo")
    _dynamic_option(p)
    p.set_defaults(command=cmd_compile)

    p = sub.add_parser("run", parents=[common], help="compile, run on random inputs, check against NumPy")
    p.add_argument("target", metavar="FILE.py[:FUNC]")
    _function_options(p)
    _run_options(p)
    p.add_argument("--profile", action="store_true", help="time the tsr.profile_region()s and report them")
    _dynamic_option(p)
    p.set_defaults(command=cmd_run)

    p = sub.add_parser("profile", parents=[common],
                       help="run with profiling: per profile region, cycles (median over blocks) and share of "
                            "the kernel's time; per kernel, time, TFLOP/s, GB/s, roofline fraction, occupancy")
    p.add_argument("target", metavar="FILE.py[:FUNC]")
    _function_options(p)
    _run_options(p)
    p.add_argument("--plot", metavar="FILE.png", help="draw the kernels on the device's roofline (needs "
                                                       "matplotlib: pip install 'tessera[plot]')")
    p.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute's metrics even where ncu is installed")
    p.set_defaults(command=_cmd_profile, profile=True)

    from .bench.command import add_parser as add_bench_parser
    add_bench_parser(sub, [common])

    p = sub.add_parser("package", parents=[common],
                       help="compile functions for several archs and shapes into a package tessera.load runs")
    p.add_argument("targets", nargs="+", metavar="FILE.py[:FUNC]")
    p.add_argument("--shape", action="append", required=True, metavar="B=2,S=128,...",
                   help="values of the symbolic dims; repeat for more specializations")
    p.add_argument("--arch", default=DEFAULT_ARCH, metavar="ARCH,...",
                   help=f"comma-separated targets, each getting its cubins and PTX (default {DEFAULT_ARCH})")
    p.add_argument("--dtype", default=DEFAULT_DTYPE,
                   help=f"dtype of arguments not annotated with one (default {DEFAULT_DTYPE})")
    p.add_argument("--path", choices=["ampere", "native"], default="native", help="code path (as for compile)")
    p.add_argument("--dynamic", default="", metavar="DIM,...",
                   help="dims the kernels take at run time (shape-generic: one specialization serves every "
                        "value of 2 or more; --shape gives the values the reference run uses)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the package directory")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the reference inputs the C++ example checks against (default 0)")
    p.set_defaults(command=cmd_package)

    p = sub.add_parser("opt", parents=[common], help="parse, verify and transform MLIR of any Tessera level")
    p.add_argument("file", metavar="FILE.mlir", help="`-` reads stdin")
    p.add_argument("--passes", default="", metavar="P1,P2",
                   help="; ".join(f"{name}: {p.help}" for name, p in PASSES.items()))
    p.add_argument("--arch", default=DEFAULT_ARCH,
                   help=f"target of fuse's default tilings and of lower-to-target (default {DEFAULT_ARCH})")
    p.add_argument("--verify-only", action="store_true", help="check only; print nothing")
    p.set_defaults(command=cmd_opt)

    p = sub.add_parser("targets", parents=[common], help="the GPU targets Tessera knows")
    p.add_argument("--arch", help="show one target in full")
    p.set_defaults(command=cmd_targets)

    p = sub.add_parser("demo", parents=[common], help="flash attention end to end, with a report")
    _function_options(p, shape=DEMO_SHAPE)
    _run_options(p)
    p.add_argument("--out-dir", default=str(DEFAULT_OUT), metavar="DIR",
                   help=f"IR dumps go to DIR/FUNC (default {DEFAULT_OUT})")
    p.set_defaults(command=cmd_demo)
    return parser


# --- entry point ---------------------------------------------------------------------

def _stack_files() -> frozenset[str]:
    """Files on the stack when main() starts. An error located in one of them points at whoever
    invoked the CLI (the console script, a test), not at the user's program."""
    return frozenset(os.path.abspath(frame.filename) for frame in traceback.extract_stack())


def describe(err: Exception, callers: frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """(one-line message, user location or None) for a user error."""
    message = err.message if isinstance(err, TesseraError) else str(err)
    location = err.location if isinstance(err, TesseraError) else None
    if location and os.path.abspath(location.split(":")[0]) in callers:
        location = None
    return (message.strip().splitlines() or [type(err).__name__])[0], location


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns the exit status (1 on a user error, printed as one line)."""
    args = build_parser().parse_args(argv)
    callers = _stack_files()
    try:
        return args.command(args)
    except USER_ERRORS as err:
        if args.traceback:
            raise
        message, location = describe(err, callers)
    except Exception as err:   # raised in the user's code (an AttributeError), or a compiler bug
        location = None if args.traceback else user_code_location(err, callers)
        if location is None:
            raise
        message = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}".rstrip(": ")
    print(f"error: {message}", file=sys.stderr)
    if location:
        print(f"  at {location}", file=sys.stderr)
    return 1


def user_code_location(err: Exception, callers: frozenset[str] = frozenset()) -> str | None:
    """`file:line` in the user's code where `err` was raised, when it was raised there (or in a
    library the user's code called); None when it was raised inside Tessera: a compiler bug,
    which keeps its traceback."""
    if isinstance(err, SyntaxError) and err.filename and not is_internal(err.filename):
        return f"{err.filename}:{err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    if not frames or is_internal(frames[-1].filename) and not frames[-1].filename.startswith("<frozen"):
        return None
    library = {sysconfig.get_path(k) for k in ("stdlib", "purelib", "platlib")}
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not is_internal(path) and path not in callers and not any(path.startswith(d + os.sep) for d in library):
            return f"{frame.filename}:{frame.lineno}"
    return None
