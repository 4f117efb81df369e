"""The pipeline, as a list of stages, each naming the stages it reads.

    graph     the traced function (Graph IR)                  tessera.frontend
    schedule  fusion groups with tiling parameters, and the   tessera.passes.fusion,
              backend that compiles each kernel               tessera.passes.backend_choice
    tile      block programs + host launches                  tessera.lowering.schedule_to_tile
  the PTX backend's kernels:
    target    platform instructions (mma.sync, wgmma)         tessera.lowering.tile_to_target
    ptx       each kernel's PTX module                        tessera.backends.ptx
  the CUDA Tile IR backend's kernels (NVIDIA's; docs/CUDA_TILE.md):
    cuda_tile each kernel as a cuda_tile module: text and     tessera.backends.cuda_tile
              the bytecode tileiras takes
  every kernel:
    cubin     each kernel assembled, by ptxas (with its       tessera.runtime.cache (on disk),
              resource report) or by tileiras                 tessera.runtime.ptxas, cuda_tile.tools

The `backend` option says which backends kernels get: "auto" (the default) a backend per kernel by
`backend_choice.RULES`, or "ptx" or "cuda-tile" for every kernel. Each stage is a function from the
results of the stages it reads to its own. `compile_module` runs them through `tile` and returns a
`Compiled`, which runs the later ones on first request and keeps every result: a call on the CPU
tile interpreter never builds target, ptx or cubin. IR stages are verified as they are built.
`Compiled.launches` is the one source of how each kernel is launched (grid, threads, shared memory,
params), for the GPU runtime and the CLI alike. `dump=("all",)` or the TESSERA_DUMP_IR environment
variable writes stages' text (`<stage>.mlir`, each kernel's `<kernel>.ptx` or
`<kernel>.cuda_tile.mlir`) into `dump_dir` or TESSERA_DUMP_DIR.
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
from .backends import check_backend_option
from .dims import MAX_DIM, is_dynamic
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
    backend: str = "auto"              # which backend compiles each kernel (BACKEND_OPTIONS): "auto", a
                                       # rule per kernel; "ptx"; or "cuda-tile", CUDA Tile IR assembled
                                       # by NVIDIA's tileiras

    def platform(self):
        """The target as the PTX backend's kernels see it (a kernel of another backend is scheduled
        for `Backend.platform` of it)."""
        p = platforms.get(self.arch)
        if self.sm_count is not None:
            p = dataclasses.replace(p, sm_count=self.sm_count)
        if self.path == "ampere":
            return platforms.without(p, platforms.BEYOND_AMPERE)
        if self.path != "native":
            raise TesseraError(f"unknown code path {self.path!r}; use 'native' or 'ampere'")
        return p


def _schedule(graph, options: Options):
    from .passes.fusion import fuse
    return fuse(graph, options.space, options.platform(), options.backend, options.profile)


def _tile(schedule, options: Options):
    from .lowering.schedule_to_tile import lower_schedule_to_tile
    return lower_schedule_to_tile(schedule, line_info=options.line_info, profile=options.profile)


def _target(tile, options: Options):
    from .lowering.tile_to_target import lower_tile_to_target
    target = lower_tile_to_target(tile, options.platform(), tensor_cores=options.tensor_cores)
    if os.environ.get("TESSERA_CHECK_ASYNC") == "1":   # the async-hazard checker (tests/conftest.py sets it)
        from .passes.check_async import require_no_hazards
        require_no_hazards(target)
    return target


def _ptx(target, options: Options):
    """Each PTX kernel's module. A kernel the backend cannot emit is an error that also says why the
    kernel is this backend's (its `backend_why`: where tileiras would have compiled it, what kept it)."""
    from .backends.ptx import UnsupportedByBackend, emit_kernel
    from .ir import target as tgt
    from .ir import tile

    kernels = {}
    for op in (op for op in target.ops if isinstance(op, tgt.KernelOp)):
        try:
            kernels[op.sym_name.data] = emit_kernel(op)
        except UnsupportedByBackend as e:
            why = op.attributes.get(tile.BACKEND_WHY)
            if why is None:
                raise
            raise UnsupportedByBackend(f"{e.message}. (The PTX backend has kernel {op.sym_name.data} by "
                                       f"{why.data}.)", e.location) from None
    return kernels


def _cuda_tile(tile, options: Options):
    from .ir import tile as t
    if not t.kernels_of(tile, "cuda-tile"):
        return {}   # (no import of the backend)
    from .backends.cuda_tile import lower_module
    return lower_module(tile, options.arch)


def _cubin(ptx, cuda_tile, options: Options):
    cubins = {}
    if ptx:
        from .runtime.cache import CubinCache
        cache = CubinCache()
        cubins.update({name: cache.assembled(kernel.ptx, options.arch, options.opt_level) for name, kernel in ptx.items()})
    if cuda_tile:
        from .backends.cuda_tile import assemble_kernels
        cubins.update(assemble_kernels(cuda_tile, options.arch, options.opt_level))
    return cubins


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]     # the stages whose results `run` takes, in order (then the Options)
    run: Callable


#: The compiler, in order. The PTX backend's kernels go through target and ptx, the CUDA Tile IR
#: backend's through cuda_tile (each stage holds only its backend's kernels); cubin has them all.
STAGES: tuple[Stage, ...] = (
    Stage("schedule", ("graph",), _schedule),          # Graph IR -> Schedule IR
    Stage("tile", ("schedule",), _tile),               # -> Tile IR
    Stage("target", ("tile",), _target),               # -> Target IR
    Stage("ptx", ("target",), _ptx),                   # -> {kernel: PtxKernel}
    Stage("cuda_tile", ("tile",), _cuda_tile),         # -> {kernel: cuda_tile.CudaTileKernel}
    Stage("cubin", ("ptx", "cuda_tile"), _cubin),      # -> {kernel: ptxas.Assembled or cuda_tile.TileCubin},
                                                       #    via the on-disk cubin cache
)
STAGES_BY_NAME = {stage.name: stage for stage in STAGES}
STAGE_NAMES = ("graph", *STAGES_BY_NAME)
#: The stages whose result is an MLIR module: verified once built, dumped as `<stage>.mlir`.
IR_STAGES = ("graph", "schedule", "tile", "target")
#: What `dump` can write: the IR stages, and as a file per kernel `ptx` (`<kernel>.ptx`) and
#: `cuda_tile` (`<kernel>.cuda_tile.mlir` and its bytecode `<kernel>.tilebc`).
DUMP_STAGES = (*IR_STAGES, "ptx", "cuda_tile")


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
        if stage not in IR_STAGES:
            raise KeyError(stage)
        return self._compiled.stage(stage)

    def __iter__(self):
        return iter(IR_STAGES)

    def __len__(self) -> int:
        return len(IR_STAGES)


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

    def stage(self, name: str, arch: str | None = None):
        """Stage `name`'s result, run (after the stages before it) on first request and kept:
        an IR stage's module, {kernel: PtxKernel} for ptx, {kernel: ptxas.Assembled} for cubin.
        `arch` asks for cubins of another arch than the compile's: a GPU assembles for its own."""
        arch = arch or self.arch
        if name not in STAGE_NAMES:
            raise TesseraError(f"unknown stage {name!r}; stages are {', '.join(STAGE_NAMES)}")
        if arch != self.arch and name != "cubin":
            raise TesseraError(f"only the cubin stage is built for another arch than {self.arch}, not {name}")
        key = (name, arch)
        if key not in self._results:
            self._results[key] = self._run(name, arch)
        return self._results[key]

    def _run(self, name: str, arch: str):
        """Runs stage `name` on the results of the stages it reads, and verifies an IR stage's module."""
        if name == "graph":
            self.graph.verify()
            return self.graph
        stage = STAGES_BY_NAME[name]
        inputs = [self.stage(read) for read in stage.reads]
        start = time.perf_counter()
        result = stage.run(*inputs, dataclasses.replace(self.options, arch=arch))
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
        """Each kernel's launch, in the order the Tile IR module defines them: the PTX backend's
        from target and ptx, the CUDA Tile IR backend's from cuda_tile and their cubins (the
        threads tileiras compiled each for)."""
        from .ir import target

        ptx = self.stage("ptx")
        launches = {op.sym_name.data: _kernel_launch(op, ptx[op.sym_name.data])
                    for op in self.stage("target").ops if isinstance(op, target.KernelOp)}
        if self.stage("cuda_tile"):
            from .backends.cuda_tile import kernel_launches
            launches.update(kernel_launches(self.stage("cuda_tile"), self.stage("cubin")))
        return {name: launches[name] for name in self.kernel_names}

    @property
    def kernel_backends(self) -> dict[str, tuple[str, str]]:
        """Each kernel's backend and the rule or option that chose it (`tile.BACKEND`, `BACKEND_WHY`)."""
        from .ir import tile
        return {op.sym_name.data: (tile.kernel_backend(op), getattr(op.attributes.get(tile.BACKEND_WHY), "data", ""))
                for op in self.stage("tile").ops if isinstance(op, tile.KernelOp)}

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
        """Writes each IR stage of `stages` as `<stage>.mlir` and, for `ptx`, each PTX kernel's
        `<kernel>.ptx` (for `cuda_tile`, each CUDA Tile IR kernel's `<kernel>.cuda_tile.mlir` and
        `<kernel>.tilebc`) into `directory`; returns the files written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for stage in stages:
            if stage == "ptx":
                written += self._dump_ptx(directory)
            elif stage == "cuda_tile":
                written += self._dump_cuda_tile(directory)
            else:
                path = directory / f"{stage}.mlir"
                path.write_text(self.ir(stage))
                written.append(path)
        return written

    def _dump_cuda_tile(self, directory: Path) -> list[Path]:
        """Each CUDA Tile IR kernel's text and bytecode; where the backend cannot lower a kernel, a
        logged warning says why instead (as `_dump_ptx`)."""
        from .backends import UnsupportedByBackend

        try:
            kernels = self.stage("cuda_tile")
        except UnsupportedByBackend as e:
            log.warning("no CUDA Tile IR dumped for %s: %s", self.name, e.message)
            return []
        if not kernels:
            return []
        from .backends.cuda_tile import dump_kernels
        return dump_kernels(kernels, directory)

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
        from .ir import graph, tile

        if self._program is None:
            self._program = TileProgram(self.stage("tile"))
        host = self.host_function()
        n_in = len(self.arg_names)
        if len(inputs) != n_in:
            raise TesseraError(f"{self.name} takes {n_in} tensors, got {len(inputs)}")
        types = host.function_type.inputs.data
        bits = host.attributes.get(tile.INDEX_BITS)
        shapes = dims.bind_shapes(self.name, buffer_shapes(host), [x.shape for x in inputs], self.arg_names,
                                  bits.value.data if bits is not None else 64, graph.dim_multiples(host))
        outputs = [poison(shape, _np_dtype(tt)) for shape, tt in zip(shapes[n_in:], types[n_in:])]
        arrays = [_in_layout(x, tt, name) for x, tt, name in zip(inputs, host.function_type.inputs.data,
                                                               self.arg_names)]
        self._program.run(host.sym_name.data, *arrays, *outputs)
        return outputs

    @property
    def dim_multiples(self) -> dict[str, int]:
        """The dynamic dims whose values the kernels take as multiples (`tessera.dims.whole_blocks`):
        name -> multiple; a call of another value is refused."""
        from .ir import graph
        return graph.dim_multiples(self.host_function())

    @property
    def copied_args(self) -> dict[str, str]:
        """Each argument passed strided that the kernels read from a contiguous copy, and why."""
        from .ir import tile
        attr = self.host_function().attributes.get(tile.COPIED_ARGS)
        return {} if attr is None else {name: why.data for name, why in attr.data.items()}

    @property
    def layout_copies(self) -> dict[str, str]:
        """Each kernel that only copies a value into the layout another kernel's matrix
        instructions need (`passes.byte_operands`), and what it copies."""
        from xdsl.dialects import func

        from .ir import graph as g
        from .ir import schedule as s
        from .passes.byte_operands import is_layout_copy
        out = {}
        for f in (op for op in self.stage("schedule").ops if isinstance(op, func.FuncOp)):
            names = dict(zip(f.body.block.args, (a.data for a in f.attributes["tessera.arg_names"].data)))
            for kernel in (op for op in f.body.block.ops if isinstance(op, s.KernelOp)):
                for copy in (op for op in kernel.body.block.ops if is_layout_copy(op)):
                    source = kernel.inputs[kernel.body.block.args.index(copy.input)] \
                        if copy.input in kernel.body.block.args else None
                    what = names.get(source, "a computed value")
                    dims = ", ".join(str(d) for d in g.tensor_type(copy.res).shape)
                    out[kernel.sym_name.data] = f"{what} transposed to [{dims}], as 8-bit tensor cores read it"
        return out

    def reference(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The Graph IR oracle on the same inputs."""
        from .interpreter.reference import run_graph
        return run_graph(next(iter(self.graph.ops)), inputs)


def buffer_shapes(host) -> list[tuple]:
    """Each host function argument's shape, a dynamic dim as its name (`tile.BUFFER_DIMS`)."""
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
                   backend: str = "auto", dump: Sequence[str] | None = None,
                   dump_dir: str | os.PathLike | None = None) -> Compiled:
    """Compiles a Graph IR module through the tile stage, which every use of the result needs (so a
    program the compiler rejects fails here); target, ptx and cubin run when first asked for.
    TESSERA_LINE_INFO=1 and TESSERA_PROFILE=1 turn `line_info` and `profile` on for every compile."""
    options = Options(arch=arch, space=space, tensor_cores=tensor_cores, opt_level=opt_level, path=path,
                      sm_count=sm_count, line_info=line_info or _env_on("TESSERA_LINE_INFO"),
                      profile=profile or _env_on("TESSERA_PROFILE"), backend=backend)
    check_backend_option(backend)
    stages = _dump_request(dump)
    f = next(iter(graph_module.ops))
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
