"""The PTX backend: Target IR -> PTX text, assembled by ptxas or the driver JIT."""
from .core import PtxKernel, TensorMapSpec
from .paths import emit_kernel, emit_module
from .types import UnsupportedByBackend

__all__ = ["PtxKernel", "TensorMapSpec", "UnsupportedByBackend", "emit_kernel", "emit_module"]
