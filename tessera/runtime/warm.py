"""Warm start: whole compiled functions cached on disk, content-addressed.

A GPU call that compiles writes its `Artifact` (runtime/artifact.py) here; the same call in a
later process finds it under the same key and launches it without tracing, without xDSL and
without ptxas. The key (`function_key`) is a sha256 over everything the compile depends on:

- the function's code (its code object, nested code included: bytecode, constants, names,
  lines), its signature's annotations, and whether it is a @function or a @kernel;
- the values of the globals and closure variables it reads (`Captures.key()`), made stable across
  processes (`stable`): a helper function by its code, a module or class by its name, each with
  its source file's size and mtime; a value that has no stable form (an arbitrary object by
  identity), or a subclass of Function (a `Derivative`), keeps the function off the disk cache;
- the call signature: shapes (a shape-generic compile's dynamic dims by their class, with its
  offset width: `Function.key_shapes`), dtypes, constant arguments, compile options and the environment
  switches that change a compile (TESSERA_LINE_INFO, TESSERA_PROFILE);
- Tessera itself (its version and the size and mtime of each of its source files) and the
  toolchain (the path, size and mtime of ptxas: a stat, not a run).

Entries live in $TESSERA_FUNCTION_CACHE_DIR, default `functions/` under the cubin cache
(`cache.default_directory()`), one file per key, written to a temp file and renamed, so
concurrent processes writing one key both succeed and readers see a whole entry or none. An entry
that fails its checks (checksums, format, versions) is removed and rebuilt. TESSERA_WARM_CACHE=0
turns the cache off.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

from ..dtypes import DType
from ..errors import TesseraError
from . import cache, interop, ptxas
from .artifact import FORMAT_VERSION, Artifact, ArtifactError, pack, unpack

log = logging.getLogger("tessera.warm")

#: Environment switches that change what a compile produces (compiler.compile_module reads them).
COMPILE_ENVIRONMENT = ("TESSERA_LINE_INFO", "TESSERA_PROFILE")


def enabled() -> bool:
    return os.environ.get("TESSERA_WARM_CACHE", "1") != "0"


def directory() -> Path:
    """$TESSERA_FUNCTION_CACHE_DIR, else `functions/` in the cubin cache's directory."""
    env = os.environ.get("TESSERA_FUNCTION_CACHE_DIR")
    return Path(env) if env else cache.default_directory() / "functions"


# --- the key ------------------------------------------------------------------------------------

@functools.cache
def compiler_fingerprint() -> str:
    """Tessera's version and each of its source files' path, size and mtime: an edited compiler
    misses every entry an older one wrote (a stat per file, no reading)."""
    import tessera

    root = os.path.dirname(tessera.__file__)
    files = []   # (relative path, full path): os.walk and strings take 1.5 ms, pathlib took 4.4-5.8 (CPU machine)
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]
        files += [(os.path.join(folder, n)[len(root) + 1:], os.path.join(folder, n)) for n in names if n.endswith(".py")]
    h = hashlib.sha256(str(getattr(tessera, "__version__", "?")).encode())
    for relative, path in sorted(files):
        st = os.stat(path)
        h.update(f"{relative}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


@functools.cache
def toolchain_fingerprint() -> str:
    """The ptxas that would assemble: its path, size and mtime (a stat: the warm path runs no tool)."""
    path = ptxas.find_tool("ptxas")
    if path is None:
        return "no ptxas"
    st = os.stat(path)
    return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"


def code_digest(code: types.CodeType) -> str:
    """sha256 of what a code object runs and where its lines are (asserts and line info carry them),
    nested code objects included."""
    h = hashlib.sha256()
    for part in (code.co_qualname, code.co_filename, code.co_firstlineno, code.co_code, code.co_linetable,
                 code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
        h.update(repr(part).encode())
    for const in code.co_consts:
        h.update((code_digest(const) if isinstance(const, types.CodeType) else repr((type(const), const))).encode())
    return h.hexdigest()


def module_stamp(name: str | None) -> str:
    """The size and mtime of module `name`'s source file ("" when it has none): a captured module,
    class or function is keyed by name, and what it reads in its own module (a constant in a config
    file) is not keyed by value, so an edit of that file must miss."""
    path = getattr(sys.modules.get(name or ""), "__file__", None)
    try:
        st = os.stat(path) if path else None
    except OSError:
        return ""
    return f"{st.st_size}:{st.st_mtime_ns}" if st else ""


class NotStable(Exception):
    """A captured value with no form that means the same in another process."""


def stable(x):
    """A JSON-able form of a frozen capture key (`captures.freeze`) that is equal across processes
    exactly when the values are: identities become names (functions also their code; modules,
    classes and functions also their source file's stamp), the in-process identity of a config
    object is left out (its attribute values stay)."""
    from ..frontend import captures

    if isinstance(x, captures.ObjectIdentity):
        return "<object>"
    if x is captures._MISSING:
        return "<missing>"
    if x is None or isinstance(x, (bool, int, float, complex, str)):
        return [type(x).__name__, repr(x)]
    if isinstance(x, bytes):
        return ["bytes", x.hex()]
    if isinstance(x, (tuple, list)):
        return [stable(v) for v in x]
    if isinstance(x, type):
        return ["type", x.__module__, x.__qualname__, module_stamp(x.__module__)]
    if isinstance(x, types.ModuleType):
        return ["module", x.__name__, module_stamp(x.__name__)]
    if isinstance(x, types.FunctionType):
        return ["function", x.__module__, x.__qualname__, code_digest(x.__code__), module_stamp(x.__module__)]
    if isinstance(x, types.MethodType):
        return ["method", stable(x.__func__), stable(type(x.__self__))]
    if isinstance(x, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType,
                      types.WrapperDescriptorType)):
        return ["builtin", getattr(x, "__module__", None), x.__qualname__]
    if isinstance(x, (DType, np.dtype, np.generic, enum.Enum, range)) or dataclasses.is_dataclass(x):
        return ["value", stable(type(x)), repr(x)]
    if type(x).__module__ == "torch" and type(x).__name__ == "dtype":
        return ["torch", str(x)]
    fn = getattr(x, "fn", None)
    if type(x).__module__.startswith("tessera.") and isinstance(fn, types.FunctionType):
        return ["tessera", type(x).__name__, stable(fn)]   # a captured @tsr.function
    raise NotStable(f"{type(x).__qualname__} has no stable form")


def function_key(function, tensors, constants: dict, options: dict) -> str | None:
    """The disk key of a call of `function` (a tessera Function) with `tensors` ((name, array)
    pairs), `constants` and compile `options`; None when a captured value has no stable form, or
    for a subclass of Function or Kernel (a `Derivative` traces its backward, by state of its own
    such as `argnums` that this key does not cover)."""
    from ..frontend.function import Function, Kernel

    if type(function) not in (Function, Kernel):
        return None
    shapes, bits = function.key_shapes(tensors)   # a shape-generic compile: each dynamic dim's class
    try:
        captured = stable(function.captures.key())
    except NotStable as e:
        log.debug("%s stays off the warm cache: %s", function.name, e)
        return None
    payload = {
        "format": FORMAT_VERSION,
        "tessera": compiler_fingerprint(),
        "toolchain": toolchain_fingerprint(),
        "kind": type(function).__name__,
        "code": code_digest(function.fn.__code__),
        "signature": str(function.signature),
        "space": function.space,
        "captures": captured,
        "tensors": [[name, list(shape), str(x.dtype), interop.layout_of(x)] for (name, x), shape in zip(tensors, shapes)],
        "index_bits": bits,
        "constants": sorted([k, repr(v)] for k, v in constants.items()),
        "options": sorted([k, repr(v)] for k, v in options.items()),
        "environment": [os.environ.get(name, "") for name in COMPILE_ENVIRONMENT],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


# --- the store ----------------------------------------------------------------------------------

def path(key: str) -> Path:
    return directory() / f"{key}.tsra"


def header(key: str) -> dict:
    """What an entry must say of itself besides its artifact: its key and the compiler and
    toolchain that wrote it (checked again on load, beside the key that already covers them)."""
    return {"key": key, "tessera": compiler_fingerprint(), "toolchain": toolchain_fingerprint()}


def load(key: str) -> Artifact | None:
    """The entry under `key`, verified; None when absent. A corrupt or mismatched entry is
    removed (and logged), so the caller rebuilds it."""
    entry = path(key)
    try:
        data = entry.read_bytes()
    except FileNotFoundError:
        return None
    try:
        found, artifact = unpack(data)
        expected = header(key)
        if any(found.get(k) != v for k, v in expected.items()):
            raise ArtifactError("entry written for another key, compiler or toolchain")
    except (ArtifactError, ValueError) as e:
        log.warning("discarding warm-start entry %s: %s", entry, e)
        entry.unlink(missing_ok=True)
        return None
    return artifact


def store(key: str, artifact: Artifact) -> Path:
    """Writes the entry for `key` atomically: a temp file in the same directory, renamed over it."""
    data = pack(header(key), artifact)
    folder = directory()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:16]}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path(key))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path(key)


def store_quietly(key: str, artifact_of) -> None:
    """`store(key, artifact_of())`, where failing to write (a read-only or full disk, a kernel the
    serializer cannot take) only costs the next process a compile: logged, never raised, so the
    call whose compile it serializes still returns its result. An unexpected error is logged
    with its traceback (a bug to report), expected ones in one line."""
    try:
        store(key, artifact_of())
    except (OSError, TesseraError, ptxas.ToolError) as e:
        log.warning("could not write the warm-start entry %s: %s", key, e)
    except Exception:
        log.exception("could not write the warm-start entry %s", key)
