"""Code generators, one package per target family: `ptx` (Target IR -> PTX, assembled by ptxas)
and `cuda_tile` (Tile IR -> NVIDIA's CUDA Tile IR, assembled by tileiras).

Each kernel of a compile is assigned one of them in the Schedule IR (`schedule.kernel`'s
`backend`, by `tessera.passes.backend_choice`), and `BACKENDS` says what each asks of the stages
before it. Nothing here imports a backend's own modules."""
from __future__ import annotations

from dataclasses import dataclass

from .. import platforms
from ..errors import TesseraError


class UnsupportedByBackend(TesseraError):
    """The kernel uses an op this backend cannot emit yet (the message names the backend)."""


@dataclass(frozen=True)
class Backend:
    """A code generator a kernel can be assigned to, and what it asks of the stages before it."""

    name: str
    stage_operands: bool        # Tile IR stages matmul operands through shared memory itself
                                # (False: the backend's own compiler pipelines plain loads)
    masked: frozenset = frozenset()   # platform features its kernels' schedules must not plan
                                      # for (the backend's own compiler decides whether to use them)
    tile_compiler: bool = False       # its compiler stages and pipelines tiles itself: schedules
                                      # take schedule.SHAPE_DEFAULTS' `tile_compiler` rules
    dynamic_dims: bool = True         # its kernels can take dims at run time (`tessera.dims`)
    vendors: frozenset | None = None  # the GPU vendors it compiles for (None: any the registry has)
    min_version: tuple = ()           # the oldest compute capability it compiles for
    missing_dtypes: frozenset = frozenset()   # element types it cannot compile yet (Tessera names)

    def platform(self, platform: platforms.Platform) -> platforms.Platform:
        """`platform` as this backend's kernels are scheduled for."""
        return platforms.without(platform, self.masked) if self.masked else platform

    def cannot_target(self, platform: platforms.Platform | None, dtypes) -> str | None:
        """Why this backend cannot compile a kernel over element types `dtypes` for `platform`."""
        if platform is None:
            return "the compile names no target"
        if (self.vendors is not None and platform.vendor not in self.vendors) or platform.version < self.min_version:
            return f"it compiles for {'/'.join(sorted(self.vendors or ()))} sm_{''.join(map(str, self.min_version))} " \
                   f"and newer, not {platform.arch}"
        missing = sorted(self.missing_dtypes & set(dtypes))
        return f"it has no {', '.join(missing)} yet" if missing else None


BACKENDS: dict[str, Backend] = {
    "ptx": Backend("ptx", stage_operands=True),
    # tileiras chooses TMA, wgmma and clusters itself: schedules are the ones planned for plain
    # tensor-core tiles (no persistent or warp-specialized GEMMs)
    "cuda-tile": Backend("cuda-tile", stage_operands=False, masked=platforms.BEYOND_AMPERE, tile_compiler=True,
                         dynamic_dims=False, vendors=frozenset({"nvidia"}), min_version=(8, 0),
                         missing_dtypes=frozenset({"fp8_e4m3", "fp8_e5m2"})),
}

#: What a compile's `backend` option takes: one backend for every kernel, or "auto", a backend per
#: kernel by `tessera.passes.backend_choice.RULES` (the default)
BACKEND_OPTIONS = ("auto", *BACKENDS)


def check_backend_option(backend: str) -> None:
    if backend not in BACKEND_OPTIONS:
        raise TesseraError(f"unknown backend {backend!r}; backends are {', '.join(BACKEND_OPTIONS)}")
