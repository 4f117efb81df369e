"""The pipeline, as a list of stages: those every backend shares, then the backend's own.

    graph     the traced function (Graph IR)                  tessera.frontend
    schedule  fusion groups with tiling parameters            tessera.passes.fusion
    tile      block programs + host launches                  tessera.lowering.schedule_to_tile
  backend "ptx" (the default):
    target    platform instructions (mma.sync, wgmma)         tessera.lowering.tile_to_target
    ptx       each kernel's PTX module                        tessera.backends.ptx
    cubin     each kernel assembled by ptxas, with its        tessera.runtime.cache (on disk),
              resource report                                 tessera.runtime.ptxas
  backend "cuda-tile" (NVIDIA's CUDA Tile IR; docs/CUDA_TILE.md):
    cuda_tile each kernel as a cuda_tile module: text and     tessera.backends.cuda_tile
              the bytecode tileiras takes
    cubin     each kernel assembled by tileiras               tessera.backends.cuda_tile.tools

Each stage is a function from the previous stage's result to its own.
`compile_module` runs them through `tile` and returns a `Compiled`, which runs
the later ones on first request and keeps every result: a call on the CPU
tile interpreter never builds target, ptx or cubin. IR stages are verified as
they are built. `Compiled.launches` is the one source of how each kernel is
launched (grid, threads, shared memory, params), for the GPU runtime and the
CLI alike. `dump=("all",)` or the TESSERA_DUMP_IR environment variable writes
stages' text (`<stage>.mlir`, and each kernel's `<kernel>.ptx`) into `dump_dir`
or TESSERA_DUMP_DIR.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from . import platforms
from . import dims
from .dims import MAX_DIM, DynamicDim, is_dynamic
from .errors import TesseraError

if TYPE_CHECKING:
    from .backends.ptx import TensorMapSpec

DEFAULT_ARCH = "sm_90a"

log = logging.getLogger("tessera.compiler")


@dataclass
class Options:
    """What a compile may be asked for; every field has the default a plain call gets."""

    arch: str = DEFAULT_ARCH
    space: dict | None = None          # schedule search space (from @kernel.autotune)
    tensor_cores: bool = True          # False keeps every tile.mma as is (CPU interpreter only:
                                       # the PTX backend has no CUDA-core matmul yet)
    opt_level: int = 3                 # ptxas -O level the backend assembles with
    path: str = "native"               # "ampere": mma.sync + cp.async even where the arch has more
    sm_count: int | None = None        # the device's SMs, where they differ from the arch's in the
                                       # registry (an H100 PCIe has 114): persistent kernels use them
    line_info: bool = False            # PTX with .file/.loc line info of the user's source (ptxas -lineinfo)
    profile: bool = False              # kernels stamp their profile regions (tessera.runtime.profile)
    backend: str = "ptx"               # "ptx", or "cuda-tile": CUDA Tile IR assembled by NVIDIA's tileiras

    def platform(self):
        p = platforms.get(self.arch)
        if self.sm_count is not None:
            p = dataclasses.replace(p, sm_count=self.sm_count)
        if BACKENDS[self.backend].masked:
            p = platforms.without(p, BACKENDS[self.backend].masked)
        if self.path == "ampere":
            return platforms.without(p, platforms.BEYOND_AMPERE)
        if self.path != "native":
            raise TesseraError(f"unknown code path {self.path!r}; use 'native' or 'ampere'")
        return p


def _schedule(graph, options: Options):
    from .passes.fusion import fuse
    return fuse(graph, options.space, options.platform(), tile_compiler=not BACKENDS[options.backend].stage_operands)


def _tile(schedule, options: Options):
    from .lowering.schedule_to_tile import lower_schedule_to_tile
    return lower_schedule_to_tile(schedule, line_info=options.line_info, profile=options.profile,
                                  stage_operands=BACKENDS[options.backend].stage_operands)


def _target(tile, options: Options):
    from .lowering.tile_to_target import lower_tile_to_target
    target = lower_tile_to_target(tile, options.platform(), tensor_cores=options.tensor_cores)
    if os.environ.get("TESSERA_CHECK_ASYNC") == "1":   # the async-hazard checker (tests/conftest.py sets it)
        from .passes.check_async import require_no_hazards
        require_no_hazards(target)
    return target


def _ptx(target, options: Options):
    from .backends.ptx import emit_module
    return emit_module(target)


def _cubin(ptx, options: Options):
    from .runtime.cache import CubinCache
    cache = CubinCache()
    return {name: cache.assembled(kernel.ptx, options.arch, options.opt_level) for name, kernel in ptx.items()}


def _cuda_tile(tile, options: Options):
    from .backends.cuda_tile import lower_module
    return lower_module(tile, options.arch)


def _tile_cubin(cuda_tile, options: Options):
    from .backends.cuda_tile import assemble_kernels
    return assemble_kernels(cuda_tile, options.arch, options.opt_level)


#: (name, function from the previous stage's result): the stages every backend shares.
SHARED_STAGES: list[tuple[str, Callable]] = [
    ("schedule", _schedule),   # Graph IR -> Schedule IR
    ("tile", _tile),           # -> Tile IR
]


@dataclass(frozen=True)
class Backend:
    """What a backend adds to the pipeline, and what it asks of the stages before it."""

    stages: tuple[tuple[str, Callable], ...]   # after tile, in order; the last is "cubin"
    stage_operands: bool        # Tile IR stages matmul operands through shared memory itself
                                # (False: the backend's own compiler pipelines plain loads)
    text_stage: str             # the stage `dump` writes a file per kernel of
    masked: frozenset = frozenset()   # platform features the schedule must not plan for (the
                                      # backend's own compiler decides whether to use them)


BACKENDS: dict[str, Backend] = {
    "ptx": Backend((("target", _target),        # -> Target IR
                    ("ptx", _ptx),              # -> {kernel: PtxKernel}
                    ("cubin", _cubin)),         # -> {kernel: ptxas.Assembled}, via the on-disk cubin cache
                   stage_operands=True, text_stage="ptx"),
    "cuda-tile": Backend((("cuda_tile", _cuda_tile),   # -> {kernel: cuda_tile.CudaTileKernel}
                          ("cubin", _tile_cubin)),     # -> {kernel: tileiras's cubin}, via the same cache
                         stage_operands=False, text_stage="cuda_tile",
                         # tileiras chooses TMA, wgmma and clusters itself: schedules are the ones
                         # planned for plain tensor-core tiles (no persistent or warp-specialized GEMMs)
                         masked=platforms.BEYOND_AMPERE),
}

#: The default (PTX) backend's whole compiler, in order.
STAGES: list[tuple[str, Callable]] = [*SHARED_STAGES, *BACKENDS["ptx"].stages]
STAGE_NAMES = ("graph", *(name for name, _ in STAGES))
#: The stages whose result is an MLIR module: verified once built, dumped as `<stage>.mlir`.
IR_STAGES = ("graph", "schedule", "tile", "target")
#: What `dump` can write: the IR stages, and each backend's text stage as a file per kernel
#: (`<kernel>.ptx`; `<kernel>.cuda_tile.mlir` and its bytecode `<kernel>.tilebc`).
DUMP_STAGES = (*IR_STAGES, "ptx", "cuda_tile")


def backend_stages(backend: str) -> list[tuple[str, Callable]]:
    """The whole compiler for `backend`, in order."""
    if backend not in BACKENDS:
        raise TesseraError(f"unknown backend {backend!r}; backends are {', '.join(BACKENDS)}")
    return [*SHARED_STAGES, *BACKENDS[backend].stages]


@dataclass(frozen=True)
class KernelLaunch:
    """How to launch one kernel: the one place the GPU runtime and the CLI read it from.

    The grid is the Target IR kernel config's; threads, dynamic shared memory and tensor maps are
    what the kernel's PTX was written for. The PTX declares its params as `param_types` says:
    a global pointer per kernel argument, then each tensor map by value."""

    name: str
    grid: tuple[int, int, int]
    threads: int
    dynamic_shared: int                        # bytes
    pointers: int                              # kernel arguments (buffers), passed as u64 addresses
    tensor_maps: tuple[TensorMapSpec, ...]     # each over the buffer of pointer param `spec.arg`
    arch: str                                  # the PTX's .target, which the cubin stage assembles for
                                               # unless asked for another arch
    programmatic: bool = False                 # launched as a programmatic dependent of the kernel before
                                               # it (Target IR's `tessera_target.programmatic_launch`)
    #: grid axes that grow with dynamic dims: (axis, pointer param, dim, block), each multiplying
    #: `grid[axis]` by cdiv(that buffer's size along dim, block) (`tile.launch_grid`)
    grid_terms: tuple[tuple[int, int, int, int], ...] = ()
    #: the dynamic dims the kernel takes, (pointer param, dim) each, as u32 params after the maps
    dims: tuple[tuple[int, int], ...] = ()

    @property
    def param_types(self) -> tuple[str, ...]:
        return ("u64",) * self.pointers + ("tmap",) * len(self.tensor_maps) + ("u32",) * len(self.dims)


def _kernel_launch(kernel, ptx) -> KernelLaunch:
    """A Target IR kernel's launch, with what its PtxKernel `ptx` needs."""
    from .ir import target, tile
    return KernelLaunch(kernel.sym_name.data, kernel.config.grid_dims, ptx.threads, ptx.dynamic_shared,
                        len(kernel.function_type.inputs.data), ptx.tensor_maps, kernel.platform.platform.arch,
                        target.PROGRAMMATIC_LAUNCH in kernel.attributes,
                        tile.grid_terms(kernel.attributes.get(target.GRID_DIMS)), ptx.dims)


class _Modules(Mapping):
    """`compiled.modules[stage]`: an IR stage's module, built on first access like `Compiled.stage`."""

    def __init__(self, compiled: Compiled):
        self._compiled = compiled

    def __getitem__(self, stage: str):
        if stage not in self._compiled.ir_stages:
            raise KeyError(stage)
        return self._compiled.stage(stage)

    def __iter__(self):
        return iter(self._compiled.ir_stages)

    def __len__(self) -> int:
        return len(self._compiled.ir_stages)


@dataclass
class Compiled:
    """A compiled function: its stages, each run on first request and kept, and a runner on the
    CPU tile interpreter (which needs only graph, schedule and tile)."""

    name: str
    graph: object                      # the Graph IR module the stages start from
    options: Options = field(default_factory=Options)
    arg_names: list[str] = field(default_factory=list)
    result_names: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0       # spent in the stages run so far
    _results: dict[tuple[str, str], object] = field(default_factory=dict)   # (stage, arch) -> result
    _program: object = None
    _gpu: dict = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return self.options.arch

    @property
    def stage_names(self) -> tuple[str, ...]:
        """This compile's stages (its backend's pipeline), graph first."""
        return ("graph", *(name for name, _ in backend_stages(self.options.backend)))

    @property
    def ir_stages(self) -> tuple[str, ...]:
        """The stages of this compile whose result is an MLIR module."""
        return tuple(s for s in IR_STAGES if s in self.stage_names)

    def stage(self, name: str, arch: str | None = None):
        """Stage `name`'s result, run (after the stages before it) on first request and kept:
        an IR stage's module, {kernel: PtxKernel} for ptx, {kernel: ptxas.Assembled} for cubin.
        `arch` asks for cubins of another arch than the compile's: a GPU assembles for its own."""
        arch = arch or self.arch
        if name not in self.stage_names:
            raise TesseraError(f"unknown stage {name!r} for backend {self.options.backend!r}; "
                               f"stages are {', '.join(self.stage_names)}")
        if arch != self.arch and name != "cubin":
            raise TesseraError(f"only the cubin stage is built for another arch than {self.arch}, not {name}")
        key = (name, arch)
        if key not in self._results:
            self._results[key] = self._run(name, arch)
        return self._results[key]

    def _run(self, name: str, arch: str):
        """Runs stage `name` on the previous stage's result, and verifies an IR stage's module."""
        if name == "graph":
            self.graph.verify()
            return self.graph
        names = self.stage_names
        previous = self.stage(names[names.index(name) - 1])
        start = time.perf_counter()
        result = dict(backend_stages(self.options.backend))[name](previous, dataclasses.replace(self.options, arch=arch))
        if name in IR_STAGES:
            result.verify()
        self.compile_seconds += time.perf_counter() - start
        return result

    @property
    def computed_stages(self) -> tuple[str, ...]:
        """The stages run so far, in the order they ran; the others run when first asked for."""
        return tuple(dict.fromkeys(name for name, _ in self._results))

    @property
    def modules(self) -> Mapping:
        """Each IR stage's module by name, built on first access."""
        return _Modules(self)

    @functools.cached_property
    def launches(self) -> dict[str, KernelLaunch]:
        """Each kernel's launch, in the order the Target IR module defines them (builds target and
        ptx; under the cuda-tile backend, cuda_tile and cubin, in the Tile IR module's order)."""
        from .ir import target

        if self.options.backend == "cuda-tile":
            from .backends.cuda_tile import kernel_launches
            return kernel_launches(self.stage("cuda_tile"), self.stage("cubin"))
        ptx = self.stage("ptx")
        return {op.sym_name.data: _kernel_launch(op, ptx[op.sym_name.data])
                for op in self.stage("target").ops if isinstance(op, target.KernelOp)}

    def gpu_program(self, device: int = 0):
        """This function loaded on a CUDA device (built once per device)."""
        if device not in self._gpu:
            from .runtime.launcher import GpuProgram
            self._gpu[device] = GpuProgram(self, device)
        return self._gpu[device]

    def ir(self, stage: str) -> str:
        from .ir import print_ir
        return print_ir(self.modules[stage])

    @property
    def kernel_names(self) -> list[str]:
        from .ir import tile
        return [op.sym_name.data for op in self.stage("tile").ops if isinstance(op, tile.KernelOp)]

    def dump(self, directory: str | os.PathLike, stages: Sequence[str] = DUMP_STAGES) -> list[Path]:
        """Writes each IR stage of `stages` as `<stage>.mlir` and, for `ptx`, each kernel's
        `<kernel>.ptx` (for `cuda_tile`, `<kernel>.cuda_tile.mlir` and `<kernel>.tilebc`) into
        `directory`; returns the files written. Stages of another backend's pipeline are skipped."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for stage in (s for s in stages if s in self.stage_names):
            if stage == "ptx":
                written += self._dump_ptx(directory)
            elif stage == "cuda_tile":
                from .backends.cuda_tile import dump_kernels
                written += dump_kernels(self.stage("cuda_tile"), directory)
            else:
                path = directory / f"{stage}.mlir"
                path.write_text(self.ir(stage))
                written.append(path)
        return written

    def _dump_ptx(self, directory: Path) -> list[Path]:
        """Each kernel's `<kernel>.ptx`. Where the backend cannot emit a kernel yet, a logged warning
        says why instead: the IR dumps beside it, and a CPU run, still work."""
        from .backends.ptx import UnsupportedByBackend

        try:
            kernels = self.stage("ptx")
        except UnsupportedByBackend as e:
            log.warning("no PTX dumped for %s: %s", self.name, e.message)
            return []
        written = []
        for name, kernel in kernels.items():
            path = directory / f"{name}.ptx"
            path.write_text(kernel.ptx)
            written.append(path)
        return written

    @property
    def dynamic_dims(self) -> tuple[str, ...]:
        """The dims its kernels take at run time (`tessera.dims`)."""
        from .ir import graph
        return graph.dynamic_dims(next(iter(self.graph.ops)))

    def host_function(self):
        """The tile module's host function: the launches and buffers of one call."""
        from xdsl.dialects import func
        return next(op for op in self.stage("tile").ops if isinstance(op, func.FuncOp))

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """Runs on the CPU tile interpreter; outputs start poisoned (NaN) so unwritten elements show."""
        from .interpreter.tile_interp import TileProgram, poison
        from .ir import tile

        if self._program is None:
            self._program = TileProgram(self.stage("tile"))
        host = self.host_function()
        n_in = len(self.arg_names)
        if len(inputs) != n_in:
            raise TesseraError(f"{self.name} takes {n_in} tensors, got {len(inputs)}")
        types = host.function_type.inputs.data
        bits = host.attributes.get(tile.INDEX_BITS)
        shapes = dims.bind_shapes(self.name, buffer_shapes(host), [x.shape for x in inputs], self.arg_names,
                                  bits.value.data if bits is not None else 64)
        outputs = [poison(shape, _np_dtype(tt)) for shape, tt in zip(shapes[n_in:], types[n_in:])]
        arrays = [_in_layout(x, tt, name) for x, tt, name in zip(inputs, host.function_type.inputs.data,
                                                               self.arg_names)]
        self._program.run(host.sym_name.data, *arrays, *outputs)
        return outputs

    @property
    def copied_args(self) -> dict[str, str]:
        """Each argument passed strided that the kernels read from a contiguous copy, and why."""
        from .ir import tile
        attr = self.host_function().attributes.get(tile.COPIED_ARGS)
        return {} if attr is None else {name: why.data for name, why in attr.data.items()}

    def reference(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The Graph IR oracle on the same inputs."""
        from .interpreter.reference import run_graph
        return run_graph(next(iter(self.graph.ops)), inputs)


def buffer_shapes(host) -> list[tuple]:
    """Each host function argument's shape, a dynamic leading dim as its name (`tile.BUFFER_DIMS`)."""
    from .ir import tile
    names = host.attributes.get(tile.BUFFER_DIMS)
    names = [a.data for a in names.data] if names is not None else [""] * len(host.body.block.args)
    return [tile.symbolic_shape(t, name) for t, name in zip(host.function_type.inputs.data, names)]


def _in_layout(x: np.ndarray, memref_type, name: str) -> np.ndarray:
    """`x` as the host function's parameter of `memref_type` takes it: in place where the kernels
    read its strides (which must be the ones compiled for, as on the GPU), else contiguous."""
    from .ir import tile
    from .runtime import interop

    if not tile.is_strided(memref_type):
        return np.ascontiguousarray(x)
    if interop.layout_of(x) != tile.element_strides(memref_type):
        raise interop.LayoutError(f"argument {name!r} has strides {interop.layout_of(x)}, compiled for "
                                  f"{tile.element_strides(memref_type)}")
    return x


def _np_dtype(memref_type) -> np.dtype:
    from .interpreter.tile_interp import np_dtype
    return np_dtype(memref_type)


def _env_on(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def _dump_request(dump) -> tuple[str, ...]:
    env = os.environ.get("TESSERA_DUMP_IR", "")
    requested = tuple(dump or ()) + tuple(x for x in env.split(",") if x)
    if "all" in requested:
        return DUMP_STAGES
    unknown = [s for s in requested if s not in DUMP_STAGES]
    if unknown:
        raise TesseraError(f"unknown IR stage(s) {unknown} to dump; stages are {', '.join(DUMP_STAGES)}, or all")
    return requested




def _check_dims_index_in_32_bits(f) -> None:
    """A clear error for a dim of MAX_DIM or more elements (argument or computed value), which the
    kernels' 32-bit indices would wrap past."""
    from .errors import ShapeError
    from .ir import graph as g

    bindings = g.bindings_of(f)   # (a dynamic dim's value is checked by each call: `launcher.GpuProgram`)
    names = [a.data for a in f.attributes["tessera.arg_names"].data]
    values = [(f"argument {name!r}", a) for name, a in zip(names, f.body.block.args)]
    values += [(f"the result of {op.name} (tessera.loc {op.attributes.get('tessera.loc')})", r)
               for op in f.body.block.ops for r in op.results]
    for what, v in values:
        if not isinstance(v.type, g.TensorType):
            continue
        for axis, d in enumerate(v.type.shape):
            size = g.dim_value(d, bindings)
            if not is_dynamic(size) and size >= MAX_DIM:
                raise ShapeError(f"{f.sym_name.data}: dim {axis} of {what} has {size} elements; kernels index one "
                                 f"dim with 32-bit integers, so a dim must stay under {MAX_DIM}: view it as two "
                                 f"dims (the same memory, e.g. [{size}] as [{size} / 1024, 1024])")


def compile_module(graph_module, *, arch: str = DEFAULT_ARCH, space: dict | None = None,
                   tensor_cores: bool = True, opt_level: int = 3, path: str = "native",
                   sm_count: int | None = None, line_info: bool = False, profile: bool = False,
                   backend: str = "ptx", dump: Sequence[str] | None = None,
                   dump_dir: str | os.PathLike | None = None) -> Compiled:
    """Compiles a Graph IR module through the tile stage, which every use of the result needs (so a
    program the compiler rejects fails here); target, ptx and cubin run when first asked for.
    TESSERA_LINE_INFO=1 and TESSERA_PROFILE=1 turn `line_info` and `profile` on for every compile."""
    options = Options(arch=arch, space=space, tensor_cores=tensor_cores, opt_level=opt_level, path=path,
                      sm_count=sm_count, line_info=line_info or _env_on("TESSERA_LINE_INFO"),
                      profile=profile or _env_on("TESSERA_PROFILE"), backend=backend)
    backend_stages(backend)   # an unknown backend fails here
    stages = _dump_request(dump)
    f = next(iter(graph_module.ops))
    from .ir.graph import dynamic_dims
    dynamic = dynamic_dims(f)
    if dynamic and backend != "ptx":   # (its lowering takes every dim as a constant)
        raise DynamicDim(dynamic[0], f"the {backend} backend takes every dim as a constant")
    _check_dims_index_in_32_bits(f)
    compiled = Compiled(
        name=f.sym_name.data, graph=graph_module, options=options,
        arg_names=[a.data for a in f.attributes["tessera.arg_names"].data],
        result_names=[a.data for a in f.attributes["tessera.result_names"].data])
    compiled.stage("tile")
    for name, why in compiled.copied_args.items():
        log.warning("%s: argument %r is copied to a contiguous buffer before every call: %s",
                    compiled.name, name, why)
    if stages:
        directory = dump_dir or os.environ.get("TESSERA_DUMP_DIR") or Path("tessera_ir") / compiled.name
        compiled.dump(directory, stages)
    return compiled
