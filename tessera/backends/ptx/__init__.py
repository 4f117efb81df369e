"""The PTX backend: Target IR -> PTX text, assembled by ptxas or the driver JIT."""
from . import hopper, tensor_core  # noqa: F401  (register the tensor-core and Hopper op handlers)
from .emitter import PtxKernel, UnsupportedByBackend, emit_kernel, emit_module

__all__ = ["PtxKernel", "UnsupportedByBackend", "emit_kernel", "emit_module"]
