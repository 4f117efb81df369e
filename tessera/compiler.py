"""The pipeline, as a list of stages.

    graph     the traced function (Graph IR)            tessera.frontend
    schedule  fusion groups with tiling parameters      tessera.passes.fusion
    tile      block programs + host launches            tessera.lowering.schedule_to_tile
    target    platform instructions (mma.sync, wgmma)   tessera.lowering.tile_to_target

Each stage is a function from one module to the next. `compile_module` runs
them, verifies after each, and dumps any stage's text on request
(`dump=("all",)` or the TESSERA_DUMP_IR environment variable, into
`dump_dir` or TESSERA_DUMP_DIR).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import TesseraError

DEFAULT_ARCH = "sm_90a"


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

    def platform(self):
        import dataclasses

        from . import platforms

        p = platforms.get(self.arch)
        if self.sm_count is not None:
            p = dataclasses.replace(p, sm_count=self.sm_count)
        if self.path == "ampere":
            return platforms.without(p, platforms.BEYOND_AMPERE)
        if self.path != "native":
            raise TesseraError(f"unknown code path {self.path!r}; use 'native' or 'ampere'")
        return p


def _schedule(module, options: Options):
    from .passes.fusion import fuse
    return fuse(module, options.space, options.platform())


def _tile(module, options: Options):
    from .lowering.schedule_to_tile import lower_schedule_to_tile
    return lower_schedule_to_tile(module)


def _target(module, options: Options):
    from .lowering.tile_to_target import lower_tile_to_target
    return lower_tile_to_target(module, options.platform(), tensor_cores=options.tensor_cores)


#: (name, function from the previous stage's module) — the whole compiler, in order.
STAGES: list[tuple[str, Callable]] = [
    ("schedule", _schedule),
    ("tile", _tile),
    ("target", _target),
]
STAGE_NAMES = ("graph", *(name for name, _ in STAGES))


@dataclass
class Compiled:
    """A compiled function: every stage's module, and a runner on the CPU tile interpreter."""

    name: str
    modules: dict[str, object]
    arch: str
    compile_seconds: float
    options: Options = field(default_factory=Options)
    arg_names: list[str] = field(default_factory=list)
    result_names: list[str] = field(default_factory=list)
    _program: object = None
    _gpu: dict = field(default_factory=dict)

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
        return [op.sym_name.data for op in self.modules["tile"].ops if isinstance(op, tile.KernelOp)]

    def dump(self, directory: str | os.PathLike, stages: Sequence[str] = STAGE_NAMES) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for stage in stages:
            path = directory / f"{stage}.mlir"
            path.write_text(self.ir(stage))
            written.append(path)
        return written

    def host_function(self):
        """The tile module's host function: the launches and buffers of one call."""
        from xdsl.dialects import func
        return next(op for op in self.modules["tile"].ops if isinstance(op, func.FuncOp))

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """Runs on the CPU tile interpreter; outputs start poisoned (NaN) so unwritten elements show."""
        from .interpreter.tile_interp import TileProgram, poison

        if self._program is None:
            self._program = TileProgram(self.modules["tile"])
        host = self.host_function()
        n_in = len(self.arg_names)
        if len(inputs) != n_in:
            raise TesseraError(f"{self.name} takes {n_in} tensors, got {len(inputs)}")
        out_types = host.function_type.inputs.data[n_in:]
        outputs = [poison(tt.get_shape(), _np_dtype(tt)) for tt in out_types]
        arrays = [np.ascontiguousarray(x) for x in inputs]
        self._program.run(host.sym_name.data, *arrays, *outputs)
        return outputs

    def reference(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The Graph IR oracle on the same inputs."""
        from .interpreter.reference import run_graph
        return run_graph(next(iter(self.modules["graph"].ops)), inputs)


def _np_dtype(memref_type) -> np.dtype:
    from .interpreter.tile_interp import np_dtype
    return np_dtype(memref_type)


def _dump_request(dump) -> tuple[str, ...]:
    env = os.environ.get("TESSERA_DUMP_IR", "")
    requested = tuple(dump or ()) + tuple(x for x in env.split(",") if x)
    if "all" in requested:
        return STAGE_NAMES
    unknown = [s for s in requested if s not in STAGE_NAMES]
    if unknown:
        raise TesseraError(f"unknown IR stage(s) {unknown} to dump; stages are {', '.join(STAGE_NAMES)}, or all")
    return requested


def compile_module(graph_module, *, arch: str = DEFAULT_ARCH, space: dict | None = None,
                   tensor_cores: bool = True, opt_level: int = 3, path: str = "native",
                   sm_count: int | None = None,
                   dump: Sequence[str] | None = None, dump_dir: str | os.PathLike | None = None) -> Compiled:
    """Runs every stage on a Graph IR module, verifying each result."""
    start = time.perf_counter()
    options = Options(arch=arch, space=space, tensor_cores=tensor_cores, opt_level=opt_level, path=path,
                      sm_count=sm_count)
    graph_module.verify()
    modules = {"graph": graph_module}
    current = graph_module
    for name, stage in STAGES:
        current = stage(current, options)
        current.verify()
        modules[name] = current
    f = next(iter(graph_module.ops))
    compiled = Compiled(
        name=f.sym_name.data, modules=modules, arch=arch, compile_seconds=time.perf_counter() - start,
        options=options,
        arg_names=[a.data for a in f.attributes["tessera.arg_names"].data],
        result_names=[a.data for a in f.attributes["tessera.result_names"].data])
    stages = _dump_request(dump)
    if stages:
        directory = dump_dir or os.environ.get("TESSERA_DUMP_DIR") or Path("tessera_ir") / compiled.name
        compiled.dump(directory, stages)
    return compiled
