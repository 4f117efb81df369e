"""`TargetIRCompiler`: the seeds' entry point for compiling a function for one target.

    compiler = TargetIRCompiler(target_platform="cuda", target_architecture="sm_90",
                                optimization_level=3, enable_tensor_cores=True, enable_autotuning=True)
    attention = compiler.compile(flash_attention_impl)
    out = attention(q, k, v)

The returned callable specialises on its arguments' shapes and dtypes at the
first call, like a `@tessera.function` called directly, with the compiler's
options fixed.
"""
from __future__ import annotations

from typing import Callable

from . import platforms
from .errors import TesseraError
from .frontend.function import Function, function

_VENDORS = {"cuda": "nvidia", "nvidia": "nvidia", "hip": "amd", "rocm": "amd", "amd": "amd"}


class TargetIRCompiler:
    """Compiles Tessera functions through the whole pipeline for one platform."""

    def __init__(self, target_platform: str = "cuda", target_architecture: str = "sm_90a",
                 optimization_level: int = 3, enable_tensor_cores: bool = True, enable_autotuning: bool = False):
        vendor = _VENDORS.get(target_platform.lower())
        if vendor is None:
            raise TesseraError(f"unknown target_platform {target_platform!r}; use one of {sorted(_VENDORS)}")
        platform = platforms.get(target_architecture)
        if platform.vendor != vendor:
            raise TesseraError(f"target_architecture {target_architecture} is a {platform.vendor} architecture, "
                               f"not {target_platform}")
        if optimization_level not in (0, 1, 2, 3):
            raise TesseraError(f"optimization_level must be 0, 1, 2 or 3, got {optimization_level!r}")
        self.platform = platform
        self.options = {"arch": platform.arch, "tensor_cores": bool(enable_tensor_cores),
                        "opt_level": optimization_level}
        #: recorded for the autotuner; until it lands, calls use each kernel's default schedule
        self.enable_autotuning = bool(enable_autotuning)

    def compile(self, fn: Callable | Function) -> Callable:
        """A callable running `fn` (a plain function or a @tessera.function) with these options."""
        f = fn if isinstance(fn, Function) else function(fn)
        options = self.options

        def compiled(*args):
            return f(*args, **options)
        compiled.__name__ = f.name
        compiled.__doc__ = f"{f.name} compiled for {self.platform.arch}"
        compiled.function = f
        return compiled
