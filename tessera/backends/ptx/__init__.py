"""The PTX backend: Target IR -> PTX text, assembled by ptxas or the driver JIT."""
from .emitter import PtxKernel, UnsupportedByBackend
from .paths import emit_kernel, emit_module

__all__ = ["PtxKernel", "UnsupportedByBackend", "emit_kernel", "emit_module"]
