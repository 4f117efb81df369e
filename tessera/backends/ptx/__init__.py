"""The PTX backend: Target IR -> PTX text, assembled by ptxas or the driver JIT."""
from .emitter import UnsupportedByBackend, emit_kernel, emit_module

__all__ = ["UnsupportedByBackend", "emit_kernel", "emit_module"]
