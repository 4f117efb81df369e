"""Ahead-of-time packages: compiled functions as a directory a deployment loads without the compiler.

    tessera package model.py:attention --arch sm_80,sm_90a --shape B=2,H=8,S=1024,D=64 -o pkg/
    attention = tessera.load("pkg/").attention      # NumPy + cuda-bindings: no xDSL, no ptxas
    out = attention(q, k, v)                         # torch / CuPy CUDA tensors

A package is `manifest.json` plus one file per image (cubins, PTX), each named by its sha256.
The manifest (docs/PACKAGES.md) lists each function's arguments and its specializations, one per
(shapes, arch), each the `Artifact` record (runtime/artifact.py) a warm-start entry holds too,
and every file's size and sha256. `load` verifies the manifest's format and every checksum
without touching the GPU; a function checks the device's arch on its first call.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from .. import dtypes
from ..dims import bind_shapes
from ..errors import DTypeError, ShapeError, TesseraError
from . import driver, fastcall, interop
from .artifact import FORMAT_VERSION, Artifact, ArtifactError, parse_arch, sha256, verify_blob

MANIFEST = "manifest.json"


# --- writing ------------------------------------------------------------------------------------

def manifest(artifacts: Sequence[Artifact]) -> dict:
    """The manifest of a package holding `artifacts` (several specializations of a function are
    grouped under its name; its arguments' names and symbolic dims come from its first)."""
    import tessera

    functions: dict[str, dict] = {}
    for a in artifacts:
        entry = functions.setdefault(a.name, {
            "kind": a.record["kind"],
            "arguments": [{"name": x["name"], "dims": x["dims"]} for x in a.record["arguments"]],
            "results": a.result_names,
            "specializations": []})
        entry["specializations"].append(a.record)
    files = {name: {"sha256": sha256(data), "size": len(data)} for a in artifacts for name, data in a.files.items()}
    return {"format": FORMAT_VERSION, "tessera": tessera.__version__, "functions": functions,
            "files": dict(sorted(files.items()))}


def write(directory: str | os.PathLike, artifacts: Sequence[Artifact]) -> Path:
    """Writes the package: every image file, then `manifest.json` last (each through a temp file
    and a rename), so a reader never sees a manifest naming a file not yet written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for a in artifacts:
        for name, data in a.files.items():
            _write_atomically(directory / name, data)
    path = directory / MANIFEST
    _write_atomically(path, json.dumps(manifest(artifacts), indent=1, sort_keys=True).encode())
    return path


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:16]}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- loading ------------------------------------------------------------------------------------

def read_manifest(directory: Path) -> dict:
    try:
        found = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{directory} is not a Tessera package: no {MANIFEST}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{directory / MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(found, dict) or found.get("format") != FORMAT_VERSION:
        raise ArtifactError(f"{directory / MANIFEST}: package format "
                            f"{found.get('format') if isinstance(found, dict) else None!r}, "
                            f"this Tessera reads {FORMAT_VERSION}")
    return found


def read_files(directory: Path, listed: Mapping[str, Mapping]) -> dict[str, bytes]:
    """Every file the manifest lists, each checked against its size and sha256."""
    files = {}
    for name, ref in listed.items():
        if not isinstance(name, str) or name in ("", ".", "..") or "\x00" in name or Path(name).name != name:
            raise ArtifactError(f"{directory / MANIFEST} names a file that is not a plain file of the package: "
                                f"{name!r}")
        path = directory / name
        if path.is_dir():
            raise ArtifactError(f"package {directory}: {name!r} is a directory, not the file the manifest lists")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = None
        except OSError as e:
            raise ArtifactError(f"package {directory}: {name!r} cannot be read ({e.strerror})") from None
        try:
            verify_blob(name, data, ref["sha256"], ref["size"])
        except ArtifactError as e:
            raise ArtifactError(f"package {directory}: {e.message}") from None
        files[name] = data
    return files


def load(directory: str | os.PathLike) -> Package:
    """The package in `directory`, verified (format, every file's checksum, every record), with
    one callable per function. Touches no GPU: the arch is checked on a function's first call."""
    directory = Path(directory)
    found = read_manifest(directory)
    try:
        files = read_files(directory, found["files"])
        functions = {}
        for name, entry in found["functions"].items():
            artifacts = [Artifact(record, files) for record in entry["specializations"]]
            for a in artifacts:
                a.verify()
            functions[name] = PackagedFunction(name, entry["kind"], [a["name"] for a in entry["arguments"]],
                                               artifacts)
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{directory / MANIFEST} is malformed ({type(e).__name__}: {e})") from None
    return Package(directory, functions)


class Package(Mapping):
    """A loaded package: its functions by name (`pkg["f"]` or `pkg.f`)."""

    def __init__(self, directory: Path, functions: dict[str, PackagedFunction]):
        self.directory = directory
        self.functions = functions

    def __getitem__(self, name: str) -> PackagedFunction:
        return self.functions[name]

    def __getattr__(self, name: str) -> PackagedFunction:
        try:
            return self.__dict__["functions"][name]
        except KeyError:
            raise AttributeError(f"package {self.__dict__.get('directory')} has no function {name!r}") from None

    def __iter__(self):
        return iter(self.functions)

    def __len__(self) -> int:
        return len(self.functions)


def _describe(x, name: str):
    """(shape, tessera dtype (or the framework's name of a dtype Tessera lacks), device) of a CUDA
    tensor argument (torch, CuPy, DLPack)."""
    info = interop.describe(x, f"argument {name!r}")
    if info.device is None:
        raise interop.DeviceError(f"argument {name!r} must be a CUDA tensor, but is on {info.place}: "
                                  f"a package runs on the GPU only")
    return info.shape, info.dtype or info.type_name, info.device


def _signature_text(names: Iterable[str], specs: Iterable) -> str:
    return ", ".join(f"{n}: {getattr(d, 'name', d)}{list(s)}" for n, (s, d) in zip(names, specs))


_UNASKED = object()   # a signature whose record was not asked for yet


class PackagedFunction:
    """One function of a package: called with CUDA tensors, it runs the specialization compiled for
    their shapes and dtypes whose images fit the device (a cubin for its arch, a compatible cubin,
    else PTX the driver compiles), loaded on first use."""

    def __init__(self, name: str, kind: str, arg_names: list[str], artifacts: list[Artifact]):
        self.name, self.kind, self.arg_names, self.artifacts = name, kind, arg_names, artifacts
        self._programs: dict[tuple, tuple] = {}   # (signature, device) -> (program, result positions)
        self._loaded: dict[tuple, object] = {}     # (id(artifact), device) -> its program
        #: (signature, device) -> the fast path's call of it (`fastcall`; `_try_first` says what else)
        self._records: dict[tuple, object] = {}
        self._fast: tuple = ()   # the C calls of the last few signatures, which a call tries first

    @property
    def specializations(self) -> list[tuple[str, tuple]]:
        """(arch, ((shape, dtype name) per argument)) per specialization."""
        return [(a.record["arch"], tuple((tuple(x["shape"]), x["dtype"]) for x in a.record["arguments"]))
                for a in self.artifacts]

    def __call__(self, *args):
        """Results of a function (one array, or a tuple); None for a kernel, which writes its outputs."""
        for fast in self._fast:   # a signature called before, checked and launched in C
            outs = fast(*args)
            if outs is not None:
                return None if self.kind == "kernel" else outs
        if len(args) != len(self.arg_names):
            raise TesseraError(f"{self.name} takes {len(self.arg_names)} tensors ({', '.join(self.arg_names)}), "
                               f"got {len(args)}")
        described = [_describe(x, n) for x, n in zip(args, self.arg_names)]
        signature = tuple((s, d) for s, d, _ in described)
        device = described[0][2]
        known = self._programs.get((signature, device))
        again = known is not None
        if known is None:
            if len(self._programs) >= 4096:   # a shape-generic specialization sees every length
                self._programs.clear()
                self._records.clear()
            known = self._programs[(signature, device)] = self._load(signature, device)
        program, result_positions = known
        if self.kind == "kernel":
            program(*args, out=[args[i] for i in result_positions])
            outs = None
        else:
            outs = program(*args)
            outs = outs[0] if len(outs) == 1 else tuple(outs)
        if again:   # its second call or later: the fast path's record of it
            self._try_first((signature, device), program, result_positions, args)
        return outs

    def _try_first(self, key: tuple, program, result_positions: tuple, args: Sequence) -> None:
        """Makes the C call of `key`'s program, recorded once from `args`, the first a call tries.
        `_records[key]` holds that call; its record while the C module is still loading (made into
        a call on a later call); None where there is none (no record, past the module's limits, no
        module)."""
        entry = self._records.get(key, _UNASKED)
        if entry is _UNASKED:
            entry = getattr(program, "fast_record", lambda *a, **k: None)(
                args, tuple(range(len(args))), {}, out=result_positions if self.kind == "kernel" else None)
        if isinstance(entry, fastcall.Record):
            try:
                call = fastcall.make(entry)
            except ValueError:   # past the C module's limits
                call = None
                entry = None
            if call is not None:
                entry = call
            elif fastcall.unavailable() is not None:
                entry = None
        self._records[key] = entry
        if entry is not None and not isinstance(entry, fastcall.Record):
            self._fast = fastcall.most_recent_first(self._fast, entry)

    def _load(self, signature: tuple, device: int) -> tuple:
        """The program of the specialization for `signature` that runs on `device`'s arch (one
        compiled for its exact shapes before a shape-generic one); a shape-generic program is
        loaded once for all the shapes it serves."""
        from ..frontend.function import _OutputsThroughCopies

        matching = sorted((a for a in self.artifacts if self._matches(a, signature)), key=is_generic)
        if not matching:
            raise self._no_specialization(signature)
        arch = driver.device_platform(device).arch
        runnable = [a for a in matching if a.runs_on(arch)]
        if not runnable:
            matching[0].require_runs_on(arch)
        best = max(runnable, key=lambda a: (not is_generic(a), a.record["arch"] == arch,
                                            parse_arch(a.record["arch"])[:2]))
        loaded = self._loaded.get((id(best), device))
        program = loaded if loaded is not None else self._loaded.setdefault((id(best), device), best.program(device))
        if best.record["reads_outputs"]:
            program = _OutputsThroughCopies(program)
        return program, tuple(self.arg_names.index(n) for n in best.result_names) if self.kind == "kernel" else ()

    @staticmethod
    def _matches(a: Artifact, signature: tuple) -> bool:
        """Whether `a` runs arguments of these (shape, dtype)s: its dtypes, and its shapes (a dynamic
        dim, named in the record, any value of 2 or more the arguments agree on)."""
        args = a.record["arguments"]
        return [dtypes.lookup(x["dtype"]) for x in args] == [d for _, d in signature] \
            and PackagedFunction._shapes_fit(a, signature)

    @staticmethod
    def _shapes_fit(a: Artifact, signature: tuple) -> bool:
        """Whether `a`'s shapes take the arguments' (a dynamic dim any value it allows)."""
        args = a.record["arguments"]
        if len(args) != len(signature):
            return False
        try:
            bind_shapes(a.name, [tuple(x["shape"]) for x in args], [s for s, _ in signature],
                        [x["name"] for x in args], a.record.get("index_bits", 64), a.record.get("dim_multiples"))
        except ShapeError:
            return False
        return True

    def _no_specialization(self, signature: tuple) -> TesseraError:
        """A DTypeError when some specialization has the shapes (the dtypes are wrong), else a
        ShapeError; either names what was given and what the package holds."""
        given = _signature_text(self.arg_names, signature)
        packaged = "; ".join(f"({_signature_text(self.arg_names, [(s, dtypes.lookup(d)) for s, d in args])}) "
                             f"for {arch}" for arch, args in self.specializations)
        shapes_fit = any(self._shapes_fit(a, signature) for a in self.artifacts)
        kind = DTypeError if shapes_fit else ShapeError
        return kind(f"{self.name}: no packaged specialization for ({given}); the package holds {packaged}")

    def __repr__(self) -> str:
        return f"<packaged {self.kind} {self.name}: {len(self.artifacts)} specialization(s)>"


def is_generic(a: Artifact) -> bool:
    """Whether an artifact's kernels take some dim at run time (its record names it in a shape)."""
    return any(isinstance(n, str) for x in a.record["arguments"] for n in x["shape"])


# --- building (the compiler's side: `tessera package`) ------------------------------------------

def _largest_dynamic(shapes: Sequence[Mapping[str, int]], dynamic: Sequence[str]) -> list[dict[str, int]]:
    """`shapes`, each dynamic dim taking the largest value any shape of the same static dims gives
    it (its class picks the schedule the package serves every value with)."""
    largest: dict[tuple, dict[str, int]] = {}
    for dims in shapes:
        key = tuple(sorted((d, v) for d, v in dims.items() if d not in dynamic))
        top = largest.setdefault(key, {})
        for d in dynamic:
            if d in dims:
                top[d] = max(top.get(d, 0), dims[d])
    return [{**dims, **largest[tuple(sorted((d, v) for d, v in dims.items() if d not in dynamic))]}
            for dims in shapes]


def build(functions: Sequence, shapes: Sequence[Mapping[str, int]], archs: Sequence[str], dtype,
          path: str = "native", dynamic: Sequence[str] = ()) -> list[Artifact]:
    """An artifact per function, shape and arch: each compiled for the arch (on code path `path`,
    arguments not annotated with a dtype taking `dtype`) with its PTX and the arch's cubins; the
    `dynamic` dims as kernel arguments (64-bit offsets: a package serves any size), so one
    artifact serves every value of them (a function that cannot take one is an error saying why).
    Its schedule is the one the classes of the largest values the shapes give the dynamic dims pick
    (`tessera.dims.CLASSES`, `_largest_dynamic`)."""
    from ..dims import DynamicDim
    from ..frontend.function import _reads_an_output

    artifacts = []
    for fn in functions:
        built = set()
        for dims in _largest_dynamic(shapes, dynamic):
            specs = fn.arg_specs_for(dict(dims), dtype)
            bound = {d: "dynamic" if d in dynamic else dims[d] for s in specs for d in s.dims if isinstance(d, str)}
            if tuple(sorted(bound.items())) in built:   # another value of a dynamic dim: the same specialization
                continue
            built.add(tuple(sorted(bound.items())))
            unknown = sorted(set(dynamic) - set(bound))
            if unknown:
                raise TesseraError(f"{fn.name}: --dynamic names {', '.join(unknown)}, which are not its dims "
                                   f"({', '.join(bound)})")
            for arch in archs:
                try:
                    compiled = fn.compile(specs, dynamic=frozenset(dynamic), arch=arch, path=path)
                    compiled.stage("ptx")
                except DynamicDim as e:
                    raise TesseraError(f"{fn.name} cannot take dim {e.dim!r} at run time: {e}; package it "
                                       f"with a --shape per value instead") from None
                artifacts.append(Artifact.from_compiled(
                    compiled, specs, dims=bound, kind="kernel" if fn.writes_outputs else "function",
                    reads_outputs=fn.writes_outputs and _reads_an_output(compiled)))
    return artifacts
