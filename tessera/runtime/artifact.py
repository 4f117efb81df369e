"""A compiled function as data: what a GPU call needs, with no compiler behind it.

One `Artifact` is one specialization of one function (a call signature on one compile arch):

- its arguments (names, symbolic dims, bound shapes, dtypes), its results and its intermediates;
- per kernel its launch (the compile's `KernelLaunch`, field for field: grid, threads, dynamic
  shared memory, pointer params, tensor maps, PTX target) and its images: the PTX, and a cubin
  per arch it was assembled for;
- the call's steps (which kernel runs over which buffers: `launcher.Plan`) and its profiled
  launches.

The description is JSON (`record`); the images are named blobs (`files`), each named by its
sha256, which the record lists beside it. Two containers hold the same record: a single file
(`pack`/`unpack`: the warm-start cache, runtime/warm.py) and a package directory (`manifest.json`
plus one file per blob: runtime/package.py, docs/PACKAGES.md). Reading either verifies every
checksum and the format version before anything reaches the driver.

Loading (`Artifact.program`) imports neither xDSL nor ptxas: it builds the `launcher.Plan` and
`GpuProgram` a compile would have built, from the record.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from .. import dtypes
from ..compiler import KernelLaunch
from ..errors import TesseraError
from . import driver, launcher, profile
from .tensor_maps import TensorMapSpec

#: The version of the record and container layouts; a reader refuses any other. 2: a kernel's launch
#: records `programmatic` (launched as a programmatic dependent of the kernel before it).
FORMAT_VERSION = 2
#: A single-file artifact starts with this, then the sha256 of its header, the header's length
#: (u64, little-endian), the JSON header, and the blobs the header locates.
MAGIC = b"TESSERA-ARTIFACT\n"


class ArtifactError(TesseraError):
    """A serialized function that cannot be used: corrupt, of another format, or for another GPU."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_name(data: bytes, suffix: str) -> str:
    """A blob's file name: its content's sha256 (so equal images are stored once), and its kind."""
    return f"{sha256(data)[:32]}.{suffix}"


# --- arches ------------------------------------------------------------------------------------

def parse_arch(arch: str) -> tuple[int, int, str]:
    """("sm_90a") -> (9, 0, "a"): compute capability and the arch-specific suffix."""
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if m is None:
        raise ArtifactError(f"not an NVIDIA arch: {arch!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def runs_on(image_arch: str, device_arch: str, kind: str) -> bool:
    """Whether an image built for `image_arch` runs on a device of `device_arch`. A cubin runs on its
    own arch, and (without an arch-specific suffix) on later minors of its major; PTX without a
    suffix is JIT-compiled by the driver for any later arch."""
    if image_arch == device_arch:
        return True
    major, minor, suffix = parse_arch(image_arch)
    d_major, d_minor, _ = parse_arch(device_arch)
    if suffix:
        return False
    if kind == "cubin":
        return major == d_major and minor <= d_minor
    return (major, minor) <= (d_major, d_minor)


# --- the record ---------------------------------------------------------------------------------

def _launch_record(launch: KernelLaunch) -> dict:
    return dataclasses.asdict(launch)


def _launch_from_record(r: Mapping) -> KernelLaunch:
    """The `KernelLaunch` `_launch_record` wrote: its fields by name, JSON's lists made tuples again."""
    maps = tuple(TensorMapSpec(**{**m, "shape": tuple(m["shape"]), "box": tuple(m["box"]),
                                  "strides": tuple(m["strides"]) if m.get("strides") else None})
                 for m in r["tensor_maps"])
    return KernelLaunch(**{**r, "grid": tuple(r["grid"]), "tensor_maps": maps,
                            "grid_terms": tuple(tuple(t) for t in r.get("grid_terms", ())),
                            "dims": tuple(tuple(d) for d in r.get("dims", ()))})


def _buffer_record(b: launcher.Buffer, name: str | None = None) -> dict:
    return {**({"name": name} if name is not None else {}), "shape": list(b.shape), "dtype": b.dtype.name,
            **({"strides": list(b.strides)} if b.strides is not None else {}),
            **({"copied": True} if b.copied else {})}


def _buffer_from_record(r: Mapping) -> launcher.Buffer:
    strides = r.get("strides")
    return launcher.Buffer(tuple(r["shape"]), dtypes.lookup(r["dtype"]), tuple(strides) if strides else None,
                           bool(r.get("copied")))


def _toolchain(compiled) -> dict:
    """The assemblers that built the artifact's cubins."""
    backends = {backend for backend, _ in compiled.kernel_backends.values()}
    toolchain = {}
    if "ptx" in backends:
        from . import ptxas
        toolchain["ptxas"] = ptxas.version()
    if "cuda-tile" in backends:
        from ..backends.cuda_tile import tools
        toolchain["tileiras"] = tools.version() if tools.available() else "(cubins from the cache)"
    return toolchain


@dataclass
class Artifact:
    """One specialization of a compiled function: `record` (JSON-able) and the blobs it names."""

    record: dict
    files: dict[str, bytes]

    @classmethod
    def from_compiled(cls, compiled, arguments, *, dims: Mapping[str, int], constants: Mapping | None = None,
                      kind: str = "function", reads_outputs: bool = False,
                      cubin_archs: tuple[str, ...] = ()) -> Artifact:
        """Serializes `compiled` (a `tessera.compiler.Compiled`) called with `arguments` (its
        `ArgSpec`s): its plan, each kernel's `KernelLaunch` and PTX, and cubins for the compile's
        arch and each of `cubin_archs`."""
        if [a.name for a in arguments] != compiled.arg_names:
            raise ArtifactError(f"{compiled.name}: arguments {[a.name for a in arguments]} are not the "
                                f"compile's {compiled.arg_names}")
        call_plan = launcher.plan(compiled)
        ptx = compiled.stage("ptx")   # (a CUDA Tile IR kernel has its cubins only)
        archs = tuple(dict.fromkeys((compiled.arch, *cubin_archs)))
        cubins = {arch: compiled.stage("cubin", arch=arch) for arch in archs}
        files: dict[str, bytes] = {}

        def add(data: bytes, suffix: str) -> dict:
            name = blob_name(data, suffix)
            files[name] = data
            return {"file": name, "sha256": sha256(data), "size": len(data)}

        kernels = {}
        for name, launch in compiled.launches.items():
            images = {"ptx": add(ptx[name].ptx.encode(), "ptx")} if name in ptx else {}
            images.update({arch: add(cubins[arch][name].cubin, f"{arch}.cubin") for arch in archs})
            kernels[name] = {"launch": _launch_record(launch), "images": images}
        record = {
            "function": compiled.name,
            "kind": kind,
            "arch": compiled.arch,
            "toolchain": _toolchain(compiled),
            "arguments": [{**_buffer_record(b, a.name), "dims": list(a.dims)}
                          for a, b in zip(arguments, call_plan.inputs)],
            "dims": dict(dims),
            "constants": dict(constants or {}),
            "results": [_buffer_record(b, n) for b, n in zip(call_plan.outputs, compiled.result_names)],
            "reads_outputs": reads_outputs,
            "intermediates": [_buffer_record(b) for b in call_plan.intermediates],
            "kernels": kernels,
            "steps": [{"kernel": s.launch.name, "buffers": list(s.buffers)} for s in call_plan.steps],
            "index_bits": call_plan.index_bits,
            "dim_multiples": call_plan.dim_multiples,
            "profiled": [dataclasses.asdict(p) for p in profile.profiled_launches(compiled)],
        }
        return cls(record, files)

    # --- reading back -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.record["function"]

    @property
    def arg_names(self) -> list[str]:
        return [a["name"] for a in self.record["arguments"]]

    @property
    def result_names(self) -> list[str]:
        return [r["name"] for r in self.record["results"]]

    @property
    def launches(self) -> dict[str, KernelLaunch]:
        return {name: _launch_from_record(k["launch"]) for name, k in self.record["kernels"].items()}

    def plan(self) -> launcher.Plan:
        """The `launcher.Plan` `launcher.plan` gave the compile this was written from."""
        r = self.record
        launches = self.launches
        return launcher.Plan([_buffer_from_record(a) for a in r["arguments"]],
                             [_buffer_from_record(b) for b in r["results"]],
                             [_buffer_from_record(b) for b in r["intermediates"]],
                             [launcher.Step(launches[s["kernel"]], tuple(s["buffers"])) for s in r["steps"]],
                             r.get("index_bits", 64), r.get("dim_multiples", {}))

    def profiled(self) -> list[profile.ProfiledLaunch]:
        return [profile.ProfiledLaunch(p["kernel"], tuple(p["labels"]), p["intermediate"])
                for p in self.record["profiled"]]

    def image_for(self, kernel: str, device_arch: str) -> tuple[str, str] | None:
        """("cubin" | "ptx", file) of the image of `kernel` that runs on `device_arch`: a cubin
        for it, else the newest compatible cubin, else PTX the driver JIT-compiles; None when none does."""
        images = self.record["kernels"][kernel]["images"]
        cubins = [arch for arch in images if arch != "ptx" and runs_on(arch, device_arch, "cubin")]
        if cubins:
            best = max(cubins, key=lambda a: (a == device_arch, parse_arch(a)[:2]))
            return "cubin", images[best]["file"]
        ptx = images.get("ptx")
        if ptx is not None and runs_on(self.record["arch"], device_arch, "ptx"):
            return "ptx", ptx["file"]
        return None

    def runs_on(self, device_arch: str) -> bool:
        return all(self.image_for(k, device_arch) is not None for k in self.record["kernels"])

    def require_runs_on(self, device_arch: str) -> None:
        """A clear error when some kernel has no image the device can run."""
        if not self.runs_on(device_arch):
            have = sorted({a for k in self.record["kernels"].values() for a in k["images"] if a != "ptx"})
            raise ArtifactError(f"{self.name}: no cubin or PTX for this GPU ({device_arch}); it was built for "
                                f"{', '.join(have) or 'no arch'} (PTX target {self.record['arch']})")

    def load_kernels(self, device: int) -> dict[str, driver.Kernel]:
        """Each kernel loaded on `device` from the image that fits its arch (a cubin through the
        process's function cache, PTX through the driver's JIT)."""
        device_arch = driver.device_platform(device).arch
        self.require_runs_on(device_arch)
        kernels = {}
        for name in self.record["kernels"]:
            kind, file = self.image_for(name, device_arch)
            if kind == "cubin":
                kernels[name] = launcher.functions.kernel(self.files[file], name, device)
            else:
                kernels[name] = driver.Module.from_ptx(self.files[file].decode(), device).function(name)
        return launcher.load_images(kernels, self.launches)

    def program(self, device: int = 0) -> launcher.GpuProgram:
        """This function loaded on `device`, as a compile's `gpu_program` would be."""
        return launcher.GpuProgram.from_parts(self.name, self.plan(), self.load_kernels(device), self.arg_names,
                                              self.profiled(), device)

    def verify(self) -> None:
        """Every blob the record names is present with its size and sha256 (the record's shape too)."""
        try:
            for name, k in self.record["kernels"].items():
                _launch_from_record(k["launch"])
                for ref in k["images"].values():
                    verify_blob(ref["file"], self.files.get(ref["file"]), ref["sha256"], ref["size"])
            _check_plan(self.plan())
            self.profiled()
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"malformed artifact record ({type(e).__name__}: {e})") from None


def _check_plan(plan: launcher.Plan) -> None:
    """What a launch would otherwise take on trust: each step's buffers are the plan's, one per
    pointer param, and each grid, block and shared size are numbers in range (ValueError if not)."""
    buffers = len(plan.inputs) + len(plan.outputs) + len(plan.intermediates)
    for step in plan.steps:
        k = step.launch
        if len(step.buffers) != k.pointers or not all(type(b) is int and 0 <= b < buffers for b in step.buffers):
            raise ValueError(f"a step of kernel {k.name!r} names buffers {list(step.buffers)} of {buffers} "
                             f"for its {k.pointers} pointers")
        if len(k.grid) != 3 or not all(type(n) is int and n >= 1 for n in k.grid) \
                or type(k.threads) is not int or not 1 <= k.threads <= 1024 \
                or type(k.dynamic_shared) is not int or k.dynamic_shared < 0:
            raise ValueError(f"kernel {k.name!r} has grid {k.grid}, {k.threads} threads and "
                             f"{k.dynamic_shared} bytes of shared memory")


def verify_blob(file: str, data: bytes | None, digest: str, size: int) -> None:
    if data is None:
        raise ArtifactError(f"missing file {file}")
    if len(data) != size or sha256(data) != digest:
        raise ArtifactError(f"checksum mismatch in {file}: the file is corrupt")


# --- the single-file container ------------------------------------------------------------------

def pack(header: dict, artifact: Artifact) -> bytes:
    """`header` (versions, key) with `artifact` in one file: magic, sha256 of the JSON header, its
    length, the header, then the blobs at the offsets the header gives."""
    index, offset = {}, 0
    for name, data in artifact.files.items():
        index[name] = {"offset": offset, "size": len(data)}
        offset += len(data)
    body = json.dumps({**header, "format": FORMAT_VERSION, "artifact": artifact.record, "blobs": index},
                      sort_keys=True).encode()
    return b"".join([MAGIC, hashlib.sha256(body).digest(), struct.pack("<Q", len(body)), body,
                     *artifact.files.values()])


def unpack(data: bytes) -> tuple[dict, Artifact]:
    """(header, artifact) of a `pack`ed file, every checksum verified; ArtifactError otherwise."""
    start = len(MAGIC) + 32 + 8
    if len(data) < start or not data.startswith(MAGIC):
        raise ArtifactError("not a Tessera artifact (bad magic or truncated)")
    digest = data[len(MAGIC):len(MAGIC) + 32]
    (length,) = struct.unpack_from("<Q", data, len(MAGIC) + 32)
    body = data[start:start + length]
    if len(body) != length or hashlib.sha256(body).digest() != digest:
        raise ArtifactError("artifact header checksum mismatch: the file is corrupt")
    try:
        header = json.loads(body)
        if header.get("format") != FORMAT_VERSION:
            raise ArtifactError(f"artifact format {header.get('format')!r}, this Tessera reads {FORMAT_VERSION}")
        blobs = data[start + length:]
        files = {name: blobs[at["offset"]:at["offset"] + at["size"]] for name, at in header.pop("blobs").items()}
        artifact = Artifact(header.pop("artifact"), files)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"malformed artifact header ({type(e).__name__}: {e})") from None
    artifact.verify()
    return header, artifact
