"""Tessera's CUDA runtime: PTX -> cubin (ptxas), cubin caches, the driver API, framework tensors.

    from tessera import runtime
    kernel = runtime.kernel_from_ptx(ptx, "my_kernel", arch="sm_90a")
    runtime.launch(kernel, grid=(n_blocks,), block=(128,), shared_bytes=0,
                   stream=runtime.current_torch_stream(), args=[("u64", x.data_ptr()), ("s32", n)])

Importing this package loads neither cuda-bindings nor torch: they are imported
on first use, so machines without CUDA can still import and compile.
"""
from .cache import CubinCache, FunctionCache, cache_key, default_directory, functions, is_complete_elf, kernel_from_ptx
from .driver import (
    PARAM_TYPES, ArgumentError, CudaError, Device, DriverNotFound, Kernel, KernelAttributes, Module, PackedArgs,
    current_torch_stream, device_count, init, launch, primary_context, stream_handle, synchronize,
)
from .interop import (
    DeviceError, LayoutError, NotATensorError, TensorInfo, describe, empty_like_framework, is_c_contiguous, validate,
)
from .ptxas import Assembled, PtxasError, Resources, ToolError, assemble, available, sass

__all__ = [
    "PARAM_TYPES", "ArgumentError", "Assembled", "CubinCache", "CudaError", "Device", "DeviceError",
    "DriverNotFound", "FunctionCache", "Kernel", "KernelAttributes", "LayoutError", "Module", "NotATensorError",
    "PackedArgs", "PtxasError", "Resources", "TensorInfo", "ToolError", "assemble", "available", "cache_key",
    "current_torch_stream", "default_directory", "describe", "device_count", "empty_like_framework", "functions",
    "init", "is_c_contiguous", "is_complete_elf", "kernel_from_ptx", "launch", "primary_context", "sass",
    "stream_handle", "synchronize", "validate",
]
