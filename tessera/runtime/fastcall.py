"""The launch fast path: a repeated call of a compiled function, checked and launched in C.

A steady call of a cached kernel through the general path (`GpuProgram.__call__`) costs 15-18 us
of host time on an H200 with torch tensors, where torch's own `add` costs 6 (bench/
launch_overhead.py). Measured there, per piece: cuda-bindings' cuLaunchKernel 3.8 us (ctypes'
5.1), the checks of two tensors in Python 3-5 us, an output's allocation 1.5-3 us. So, as Triton
does, the fast path is a small C extension (cpp/fastcall.c), compiled on first use with the
machine's C compiler into Tessera's cache and loaded from there afterwards: a `Record` of one
validated call (its tensors' types, dtypes, shapes, devices and layouts, its other arguments'
values, its allocations and each launch's parameters) becomes a `Call` that checks new arguments
against it and launches without returning to Python, or returns None when any differ (the caller
then takes the general path, which names what is wrong).

The module is built in a background thread the first time a record is made, so no call waits for
the compiler; calls use the general path until it is loaded. Without a C compiler, Python headers
or dlopen (or with TESSERA_NO_FAST_CALL=1) the general path serves every call, and `unavailable()`
says why.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

SOURCE = Path(__file__).with_name("cpp") / "fastcall.c"
MODULE_NAME = "tessera_fastcall"
#: the kinds of `Record` entries, as cpp/fastcall.c numbers them
ARG_TENSOR, ARG_VALUE = 0, 1
POINTER, U32, TENSOR_MAP = 0, 1, 2
GUARD_GLOBAL, GUARD_CELL = 0, 1
#: non-tensor arguments a record compares by value (anything else: the general path's key)
VALUE_TYPES = (int, float, bool, str, type(None))

_lock = threading.Lock()
_module: Any = None
_why_not: str | None = None      # why the module is unavailable, once known
_building = False
_thread: threading.Thread | None = None


@dataclass(frozen=True)
class Alloc:
    """One buffer a call allocates: `callable(*args, **kw)`, given the call's argument `template`
    first where it is not None (torch.empty_like(x))."""

    callable: Callable
    args: tuple = ()
    kw: tuple[tuple[str, Any], ...] = ()
    template: int | None = None


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its CUfunction handle, grid, block, dynamic shared memory, whether it is
    a programmatic dependent launch, and its parameters in PTX order: (POINTER, buffer),
    (U32, value) or (TENSOR_MAP, buffer, spec), buffers indexing inputs + allocations."""

    handle: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    programmatic: bool
    params: tuple[tuple, ...]


@dataclass(frozen=True)
class Record:
    """A call as the fast path replays it. `args`: per positional argument, (ARG_TENSOR, type,
    dtype, shape, device, strides or None for contiguous, bytes spanned) or (ARG_VALUE, value); `inputs`: the
    program's inputs' argument positions; `allocs`: outputs first, then intermediates; the first
    `n_results` are returned (one alone, several as a tuple); `stream(stream_arg)` is the raw
    stream to launch on; `context` the CUcontext to make current; `encode(pointer, spec)` a tensor
    map's 128 bytes."""

    args: tuple
    inputs: tuple[int, ...]
    allocs: tuple[Alloc, ...]
    n_results: int
    stream: Callable[[Any], int]
    stream_arg: Any
    context: int
    encode: Callable[[int, Any], bytes]
    launches: tuple[Launch, ...]
    #: the globals and closure variables the trace read (`Captures.identity_guards`), each of
    #: which must hold the same object again
    guards: tuple = ()
    #: a @kernel's output arguments (positions), whose bytes may overlap no other tensor argument's
    #: (a tensor's spec ends with the bytes it spans)
    disjoint: tuple[int, ...] = ()
    #: what must outlive the record: the program whose loaded kernels its launches name by handle
    owner: Any = None

    def as_tuple(self) -> tuple:
        """The layout cpp/fastcall.c's Call takes."""
        from ..frontend.captures import MISSING
        guards = tuple((GUARD_GLOBAL, g[1], g[2], g[3], g[3] is not MISSING) if g[0] == "global"
                       else (GUARD_CELL, g[1], None, g[2], g[2] is not MISSING) for g in self.guards)
        allocs = tuple((a.callable, -1 if a.template is None else a.template, a.args,
                        tuple(k for k, _ in a.kw), tuple(v for _, v in a.kw)) for a in self.allocs)
        launches = tuple((s.handle, s.grid, s.block, s.shared, s.programmatic, s.params) for s in self.launches)
        return (self.args, self.inputs, allocs, self.n_results, (self.stream, self.stream_arg), self.context,
                self.encode, launches, guards, self.disjoint, self.owner)


def make(record: Record):
    """The C `Call` of `record`, or None while the module is not loaded (the first request starts
    its build in the background); ValueError for a record past the module's limits (arguments,
    buffers, tensor maps), which stays on the general path."""
    module = _module or _start_loading()
    return module.Call(record.as_tuple()) if module is not None else None


def most_recent_first(calls: tuple, call, stale=None, keep: int = 4) -> tuple:
    """The C calls a callable tries, most recent first: `calls` with `call` (None: none) in front and
    `stale` (a call `call` replaces) dropped, at most `keep` of them. A callable called at a few
    shapes in turn (one projection for Q and another for the output) finds each; a declining call
    costs its first differing check (a shape: about 0.2 us)."""
    others = tuple(c for c in calls if c is not stale and c is not call)
    return (call, *others)[:keep] if call is not None else others


def unavailable() -> str | None:
    """Why calls take the general path (no compiler, a failed build), or None."""
    return _why_not


def wait(timeout: float | None = None) -> Any:
    """The module, after waiting for a build in progress (tests, benchmarks)."""
    _start_loading()
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    return _module


def _start_loading():
    global _building, _thread
    with _lock:
        if _module is not None or _why_not is not None or _building:
            return _module
        if os.environ.get("TESSERA_NO_FAST_CALL"):
            _give_up("TESSERA_NO_FAST_CALL is set")
            return None
        _building = True
        _thread = threading.Thread(target=_load_in_background, name="tessera-fastcall-build", daemon=True)
        _thread.start()
    return None


def _give_up(why: str, warn: bool = False) -> None:
    global _why_not
    _why_not = why
    if warn:   # (once: calls keep working, on the general path, at its host cost)
        warnings.warn(f"Tessera's launch fast path is off, every GPU call takes the general path: {why}",
                      RuntimeWarning, stacklevel=2)


def _load_in_background() -> None:
    global _module, _building
    try:
        module = load(build(default_directory()))
        configure(module)
        _module = module
    except Exception as e:   # noqa: BLE001 - any failure leaves the general path, and says why
        _give_up(f"the fast launch module did not build or load: {e}", warn=True)
    finally:
        _building = False


def _after_fork_in_child() -> None:
    """A child forked during a build has no builder thread: it starts its own when asked."""
    global _building, _thread
    if _building:
        _building, _thread = False, None


os.register_at_fork(after_in_child=_after_fork_in_child)


def default_directory() -> Path:
    from .cache import default_directory as cubin_directory
    return cubin_directory() / "fastcall"


def compiler() -> str | None:
    """The C compiler: $CC, else Python's, else cc or gcc on PATH."""
    for candidate in (os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0], "cc", "gcc"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build(directory: Path) -> Path:
    """The module compiled into `directory` (once per source, Python version and platform; written
    atomically, so concurrent processes each see a whole file); its path."""
    source = SOURCE.read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    tag = hashlib.sha256(source + sys.version.encode() + suffix.encode()).hexdigest()[:16]
    path = directory / f"{MODULE_NAME}-{tag}{suffix}"
    if path.exists():
        return path
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found (set $CC)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include} (install Python's development headers)")
    directory.mkdir(parents=True, exist_ok=True)
    out = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(out), "-ldl"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, path)
    finally:
        out.unlink(missing_ok=True)
    return path


def load(path: Path):
    """The extension module at `path`."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def configure(module, library: str = "libcuda.so.1") -> None:
    """Points `module` at the driver library's entry points; a failed launch raises the driver's
    error, as the general path's would."""
    module.configure(library, _raise_launch_error)


def _raise_launch_error(api: str, code: int, step: int) -> None:
    from . import driver
    raise driver._error(api, driver.bindings().CUresult(code), f"in step {step} of a call on the fast path")
