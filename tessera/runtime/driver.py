"""A thin, checked layer over the CUDA driver API (NVIDIA's cuda-bindings).

Every driver call goes through `_call`, which turns a failing CUresult into a
`CudaError` naming the API, the error and (for launches) the kernel and its
launch configuration, so a failure is never a bare integer or, worse, ignored.

Kernels run in each device's *primary* context, the one PyTorch and CuPy use,
so device pointers from their tensors are valid here without any copying.

cuda-bindings is imported on first use, not with this module: Tessera stays
importable (and its CPU paths usable) on machines without CUDA.
"""
from __future__ import annotations

import ctypes
import functools
import math
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera import dtypes, platforms

from . import interop, ptxas, tensor_maps


class DriverNotFound(ImportError):
    """cuda-bindings is not installed, or the NVIDIA driver library (libcuda) cannot be loaded."""


class CudaError(RuntimeError):
    """A driver API call returned an error."""

    def __init__(self, api: str, code: int, name: str, description: str, detail: str = ""):
        message = f"{api} failed: {name} ({description})" + (f" {detail}" if detail else "")
        super().__init__(message)
        self.api, self.code, self.name, self.description, self.detail = api, code, name, description, detail


class ArgumentError(TypeError):
    """Kernel arguments that do not fit their PTX types or the kernel's parameters.
    Raised before launching: a mismatch the driver would not notice corrupts silently."""


# ---------------------------------------------------------------------------
# Bindings and error checking
# ---------------------------------------------------------------------------

@functools.cache
def bindings():
    """The driver module: `cuda.bindings.driver` (cuda-bindings >= 12.6), else the
    older cuda-python's `cuda.cuda`; both expose the same function names."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as e:
            raise DriverNotFound("the CUDA runtime needs NVIDIA's cuda-bindings: pip install cuda-bindings") from e
    return driver


def bindings_version() -> str:
    """The installed cuda-bindings (or cuda-python) version, for reports."""
    from importlib import metadata
    for dist in ("cuda-bindings", "cuda-python"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def _error(api: str, code, detail: str = "") -> CudaError:
    driver = bindings()
    name_result, name = driver.cuGetErrorName(code)
    desc_result, desc = driver.cuGetErrorString(code)
    success = driver.CUresult.CUDA_SUCCESS
    name = name.decode() if name_result == success else f"CUresult {int(code)}"
    desc = desc.decode() if desc_result == success else "no description"
    return CudaError(api, int(code), name, desc, detail)


def _check(api: str, result: tuple, detail: str = ""):
    """Unpack a binding's (CUresult, *values) tuple: the value(s) on success, CudaError otherwise."""
    code, *values = result
    if code != bindings().CUresult.CUDA_SUCCESS:
        raise _error(api, code, detail)
    return values[0] if len(values) == 1 else (tuple(values) or None)


def _call(api: str, *args, detail: str = ""):
    """Call driver function `api` and check its result."""
    return _check(api, getattr(bindings(), api)(*args), detail)


_init_lock = threading.Lock()
_initialized = False


def init() -> None:
    """cuInit, once per process."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        try:
            result = bindings().cuInit(0)
        except RuntimeError as e:  # cuda-bindings raises this when libcuda.so cannot be loaded
            raise DriverNotFound(f"the NVIDIA driver library could not be loaded: {e}") from e
        _check("cuInit", result)
        _initialized = True


def device_count() -> int:
    """How many CUDA devices the driver sees; 0 when it sees none."""
    try:
        init()
    except CudaError as e:
        if e.name == "CUDA_ERROR_NO_DEVICE":
            return 0
        raise
    return _call("cuDeviceGetCount")


# ---------------------------------------------------------------------------
# Devices and contexts
# ---------------------------------------------------------------------------

def _device_attribute(suffix: str) -> functools.cached_property:
    """A cached Device property reading CU_DEVICE_ATTRIBUTE_<suffix>."""
    return functools.cached_property(lambda self: self.attribute(suffix))


class Device:
    """One CUDA device; its properties are read from the driver once."""

    def __init__(self, ordinal: int = 0):
        count = device_count()
        if not 0 <= ordinal < count:
            raise ValueError(f"no CUDA device {ordinal}: the driver sees {count}")
        self.ordinal = ordinal
        self.handle = _call("cuDeviceGet", ordinal)

    def attribute(self, suffix: str) -> int:
        """The value of CU_DEVICE_ATTRIBUTE_<suffix> ("MULTIPROCESSOR_COUNT")."""
        attr = getattr(bindings().CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{suffix}")
        return _call("cuDeviceGetAttribute", attr, self.handle)

    sm_count = _device_attribute("MULTIPROCESSOR_COUNT")
    max_shared_per_block_optin = _device_attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
    max_shared_per_sm = _device_attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
    l2_bytes = _device_attribute("L2_CACHE_SIZE")
    regs_per_sm = _device_attribute("MAX_REGISTERS_PER_MULTIPROCESSOR")
    warp_size = _device_attribute("WARP_SIZE")
    max_threads_per_block = _device_attribute("MAX_THREADS_PER_BLOCK")
    max_threads_per_sm = _device_attribute("MAX_THREADS_PER_MULTIPROCESSOR")
    max_blocks_per_sm = _device_attribute("MAX_BLOCKS_PER_MULTIPROCESSOR")

    @functools.cached_property
    def name(self) -> str:
        raw = _call("cuDeviceGetName", 256, self.handle)
        return raw.split(b"\0", 1)[0].decode()

    @functools.cached_property
    def compute_capability(self) -> tuple[int, int]:
        return (self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR"))

    def platform(self) -> platforms.Platform:
        """The registry's Platform for this device, with the driver's counts."""
        major, minor = self.compute_capability
        return platforms.from_device_properties(
            major, minor, self.sm_count, self.max_shared_per_block_optin,
            smem_per_sm=self.max_shared_per_sm, regs_per_sm=self.regs_per_sm,
            max_threads_per_block=self.max_threads_per_block, max_threads_per_sm=self.max_threads_per_sm,
            max_blocks_per_sm=self.max_blocks_per_sm)

    def __repr__(self) -> str:
        return f"Device({self.ordinal}: {self.name}, sm_{''.join(map(str, self.compute_capability))})"


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def device_platform(ordinal: int) -> platforms.Platform:
    """`Device(ordinal).platform()`, queried once per process (a call on CUDA tensors asks every time)."""
    return Device(ordinal).platform()


def _ordinal(device: Device | int) -> int:
    return device.ordinal if isinstance(device, Device) else operator.index(device)


def primary_context(device: Device | int = 0):
    """Make `device`'s primary context current on this thread and return it.

    Retained once per process and never released: PyTorch shares it, and
    releasing it under torch's feet would invalidate torch's allocations.
    Setting it current is per thread, so every entry point here calls this.
    """
    ordinal = _ordinal(device)
    context = _contexts.get(ordinal)
    if context is None:
        with _contexts_lock:
            if ordinal not in _contexts:
                _contexts[ordinal] = _call("cuDevicePrimaryCtxRetain", Device(ordinal).handle)
            context = _contexts[ordinal]
    if int(_call("cuCtxGetCurrent")) != int(context):   # asking is cheaper than setting, every call
        _call("cuCtxSetCurrent", context)
    return context


def _any_context() -> None:
    """Some context current on this thread (device 0's primary one if none is)."""
    if not int(_call("cuCtxGetCurrent")):
        primary_context(0)


def pointer_device(ptr: int) -> int:
    """The ordinal of the device whose memory `ptr` points into (for arrays that
    expose a pointer but not their device, like a bare __cuda_array_interface__).
    Any current context can answer under unified addressing; device 0's is made current when
    none is (never in place of another device's: a launch there would fail with
    CUDA_ERROR_INVALID_HANDLE, as launches on cuda:1 did)."""
    _any_context()
    attr = bindings().CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(_call("cuPointerGetAttribute", attr, bindings().CUdeviceptr(ptr), detail=f"for pointer {ptr:#x}"))


# ---------------------------------------------------------------------------
# Modules and kernels
# ---------------------------------------------------------------------------

_JIT_LOG_BYTES = 1 << 16


@dataclass(frozen=True)
class KernelAttributes:
    """What the driver reports about a loaded kernel."""

    num_regs: int
    static_shared_bytes: int
    local_bytes: int               # per-thread local memory (stack, spills)
    max_threads_per_block: int     # the most this kernel can launch with, given its registers
    max_dynamic_shared_bytes: int  # the current opt-in limit (48 KB until raised)


#: Shared memory (static and dynamic together) a kernel may use without opting in.
DEFAULT_SHARED_LIMIT = 48 * 1024


class Module:
    """A cubin or PTX module loaded into a device's primary context."""

    def __init__(self, handle, device: int, log: str):
        self.handle, self.device, self.log = handle, device, log

    @classmethod
    def from_cubin(cls, cubin: bytes, device: Device | int = 0) -> Module:
        return cls._load(bytes(cubin), _ordinal(device), "cubin")

    @classmethod
    def from_ptx(cls, ptx: str, device: Device | int = 0) -> Module:
        """Load PTX through the driver's JIT (it wants NUL-terminated text); a JIT
        error quotes the PTX lines it names, as `ptxas.assemble` does."""
        return cls._load(ptx.encode() + b"\0", _ordinal(device), "PTX",
                         explain=lambda log: ptxas.explain(ptx, log)[1])

    @classmethod
    def _load(cls, image: bytes, device: int, kind: str, explain: Callable[[str], str] = str.strip) -> Module:
        """cuModuleLoadDataEx with log buffers, so a JIT failure says why."""
        primary_context(device)
        driver = bindings()
        info, errors = bytearray(_JIT_LOG_BYTES), bytearray(_JIT_LOG_BYTES)
        opt = driver.CUjit_option
        options = {opt.CU_JIT_INFO_LOG_BUFFER: info, opt.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: len(info),
                   opt.CU_JIT_ERROR_LOG_BUFFER: errors, opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: len(errors)}
        result = driver.cuModuleLoadDataEx(image, len(options), list(options), list(options.values()))
        error_log = explain(_c_string(errors))
        handle = _check("cuModuleLoadDataEx", result, detail=f"loading {kind} on cuda:{device}" +
                        (f":\n{error_log}" if error_log else ""))
        return cls(handle, device, _c_string(info))

    def function(self, name: str) -> Kernel:
        handle = _call("cuModuleGetFunction", self.handle, name.encode(),
                       detail=f"looking up kernel '{name}'")
        return Kernel(self, name, handle)


def _c_string(buffer: bytearray) -> str:
    return bytes(buffer).split(b"\0", 1)[0].decode(errors="replace").strip()


class Kernel:
    """One `.entry` of a loaded module."""

    def __init__(self, module: Module, name: str, handle):
        self.module, self.name, self.handle = module, name, handle
        self._max_dynamic_shared: int | None = None   # set_max_dynamic_shared's, once called

    @property
    def device(self) -> int:
        return self.module.device

    def _attribute(self, suffix: str) -> int:
        attr = getattr(bindings().CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{suffix}")
        return _call("cuFuncGetAttribute", attr, self.handle, detail=f"for kernel '{self.name}'")

    @functools.cached_property
    def static_shared(self) -> int:
        """Bytes of the kernel's own `.shared` arrays."""
        return self._attribute("SHARED_SIZE_BYTES")

    @property
    def max_dynamic_shared(self) -> int:
        """The dynamic shared memory a launch may ask for: what the kernel opted in to, else the
        driver's default, 48 KB less the kernel's static arrays."""
        if self._max_dynamic_shared is None:
            return DEFAULT_SHARED_LIMIT - self.static_shared
        return self._max_dynamic_shared

    def set_max_dynamic_shared(self, nbytes: int) -> None:
        """Opt in to `nbytes` of dynamic shared memory; launches asking for more than
        `max_dynamic_shared` fail without it."""
        attr = bindings().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _call("cuFuncSetAttribute", self.handle, attr, nbytes,
              detail=f"setting kernel '{self.name}' max dynamic shared memory to {nbytes} bytes")
        self._max_dynamic_shared = nbytes

    def attributes(self) -> KernelAttributes:
        return KernelAttributes(
            num_regs=self._attribute("NUM_REGS"), static_shared_bytes=self._attribute("SHARED_SIZE_BYTES"),
            local_bytes=self._attribute("LOCAL_SIZE_BYTES"),
            max_threads_per_block=self._attribute("MAX_THREADS_PER_BLOCK"),
            max_dynamic_shared_bytes=self._attribute("MAX_DYNAMIC_SHARED_SIZE_BYTES"))

    @functools.cached_property
    def param_sizes(self) -> tuple[int, ...] | None:
        """Each kernel parameter's size in bytes (cuFuncGetParamCount + cuFuncGetParamInfo),
        or None where the driver or bindings cannot say. Only valid indices are queried: probing
        past the end would be a failing API call, which compute-sanitizer reports."""
        driver = bindings()
        if not (hasattr(driver, "cuFuncGetParamCount") and hasattr(driver, "cuFuncGetParamInfo")):
            return None
        try:
            code, count = driver.cuFuncGetParamCount(self.handle)
        except RuntimeError:  # the bindings know it, the installed driver does not (before CUDA 13.1)
            return None
        if code != driver.CUresult.CUDA_SUCCESS:
            return None
        return tuple(int(_call("cuFuncGetParamInfo", self.handle, i, detail=f"for kernel '{self.name}'")[1])
                     for i in range(int(count)))

    def __repr__(self) -> str:
        return f"Kernel({self.name!r} on cuda:{self.device})"


# ---------------------------------------------------------------------------
# Argument packing
# ---------------------------------------------------------------------------

def _integer(bits: int, signed: bool) -> Callable[[Any], int]:
    """A converter that refuses values ctypes would silently wrap (and floats)."""
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)

    def convert(value) -> int:
        v = operator.index(value)
        if not lo <= v <= hi:
            raise OverflowError(f"{v} does not fit in {'s' if signed else 'u'}{bits} ({lo}..{hi})")
        return v
    return convert


def _f32(value) -> float:
    """float -> f32, refusing finite values that would round to infinity."""
    v = float(value)
    if math.isfinite(v) and not math.isfinite(ctypes.c_float(v).value):
        raise OverflowError(f"{v} overflows f32")
    return v


def _f16_bits(value) -> int:
    return struct.unpack("<H", struct.pack("<e", float(value)))[0]


def _bf16_bits(value) -> int:
    return int(np.array(float(value)).astype(dtypes.bf16.np).view(np.uint16))


#: size of a CUtensorMap, which a kernel takes by value as `.param .align 64 .b8 NAME[128]`
TENSOR_MAP_BYTES = 128


_TensorMapStorage = ctypes.c_ubyte * TENSOR_MAP_BYTES


def _TensorMapParam(data: bytes):
    """A tensor map's opaque bytes as one by-value param (one memcpy: this is on the launch path)."""
    return _TensorMapStorage.from_buffer_copy(data)


def _tensor_map_bytes(value) -> bytes:
    """An encoded tensor map, refusing any other length: a short one would be zero-padded
    into a descriptor the TMA unit misreads, not rejected."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"a tensor map is {TENSOR_MAP_BYTES} bytes (from encode_tensor_map), "
                        f"got {type(value).__name__}")
    if len(value) != TENSOR_MAP_BYTES:
        raise ValueError(f"a tensor map is {TENSOR_MAP_BYTES} bytes, got {len(value)}")
    return bytes(value)


# PTX .param type -> (ctypes storage, converter). The driver copies each
# parameter by the size the kernel declares, so the storage size must match it
# exactly: a u64 passed where the kernel has .s32 is silently misread.
PARAM_TYPES: dict[str, tuple[type, Callable[[Any], Any]]] = {
    **{f"{p}{bits}": (getattr(ctypes, f"c_uint{bits}"), _integer(bits, False))
       for p in ("u", "b") for bits in (8, 16, 32, 64)},
    **{f"s{bits}": (getattr(ctypes, f"c_int{bits}"), _integer(bits, True)) for bits in (8, 16, 32, 64)},
    "f32": (ctypes.c_float, _f32),
    "f64": (ctypes.c_double, float),
    "f16": (ctypes.c_uint16, _f16_bits),
    "bf16": (ctypes.c_uint16, _bf16_bits),
    "tmap": (_TensorMapParam, _tensor_map_bytes),
}


class PackedArgs:
    """Kernel arguments as cuLaunchKernel's `void** kernelParams`.

    Owns every ctypes value and the pointer array; keep it referenced until the
    launch call returns (the driver copies the values during the call)."""

    def __init__(self, args: Sequence[tuple[str, Any]]):
        self.values = [_pack_one(i, arg) for i, arg in enumerate(args)]
        self.pointers = (ctypes.c_void_p * max(1, len(self.values)))(
            *(ctypes.addressof(v) for v in self.values))

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(ctypes.sizeof(v) for v in self.values)


def _pack_one(index: int, arg: tuple[str, Any]):
    try:
        ptx_type, value = arg
        if ptx_type == "u64" and type(value) is int and 0 <= value < 1 << 64:   # pointers: the common case
            return ctypes.c_uint64(value)
        ctype, convert = PARAM_TYPES[ptx_type]
        return ctype(convert(value))
    except KeyError:
        raise ArgumentError(f"argument {index}: unknown PTX param type {arg[0]!r}; "
                            f"known: {', '.join(PARAM_TYPES)}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ArgumentError(f"argument {index} {arg!r}: {e}") from None


def _check_param_sizes(kernel: Kernel, packed: PackedArgs) -> None:
    """Refuse arguments whose count or sizes differ from the kernel's parameters."""
    expected = kernel.param_sizes
    if expected is None or expected == packed.sizes:
        return
    if len(expected) != len(packed.sizes):
        raise ArgumentError(f"kernel '{kernel.name}' takes {len(expected)} parameters, "
                            f"got {len(packed.sizes)} arguments")
    index = next(i for i, (e, g) in enumerate(zip(expected, packed.sizes)) if e != g)
    raise ArgumentError(f"kernel '{kernel.name}' parameter {index} is {expected[index]} bytes, "
                        f"but argument {index} packs to {packed.sizes[index]} bytes")


# ---------------------------------------------------------------------------
# TMA tensor maps
# ---------------------------------------------------------------------------

#: tessera dtype -> CU_TENSOR_MAP_DATA_TYPE_<suffix>. TMA only moves bytes, so fp8 travels as u8.
_TENSOR_MAP_DTYPES = {dtypes.fp16: "FLOAT16", dtypes.bf16: "BFLOAT16", dtypes.fp32: "FLOAT32",
                      dtypes.fp8_e4m3: "UINT8", dtypes.fp8_e5m2: "UINT8"}
#: swizzle bytes -> CU_TENSOR_MAP_SWIZZLE_<suffix>
_TENSOR_MAP_SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
_TENSOR_MAP_MAX_RANK = 5
_TENSOR_MAP_MAX_BOX = 256


def _describe_tensor_map(ptr: int, spec) -> str:
    strides = f", strides {tuple(spec.strides)}" if spec.strides else ""
    return (f"tensor map of argument {spec.arg} ({spec.dtype}, shape {tuple(spec.shape)}{strides}, "
            f"box {tuple(spec.box)}, {spec.swizzle}-byte swizzle, pointer {ptr:#x})")


def _tensor_map_layout(spec, itemsize: int) -> tuple[list[int], list[int], list[int]]:
    """cuTensorMapEncodeTiled's view of `spec`, innermost dim first: the dims, the byte strides
    of dims 1.. (dim 0 is contiguous, so it has none: the spec's strides, else row-major's),
    and the box."""
    strides = [st * itemsize for st in reversed(_tensor_map_strides(spec)[:-1])]
    return list(reversed(spec.shape)), strides, list(reversed(spec.box))


def _tensor_map_strides(spec) -> tuple[int, ...]:
    """The element strides of a map's tensor, outermost first: its own, else row-major's."""
    return spec.strides or interop.c_strides(spec.shape)


def _tensor_map_problem(ptr: int, spec) -> str | None:
    """The first reason cuTensorMapEncodeTiled would reject `spec` at `ptr`, or None."""
    try:
        dtype = dtypes.lookup(spec.dtype)
    except TypeError as e:
        return str(e)
    if dtype not in _TENSOR_MAP_DTYPES:
        return f"no tensor map data type for {dtype.name}; supported: {', '.join(d.name for d in _TENSOR_MAP_DTYPES)}"
    if not 1 <= len(spec.shape) <= _TENSOR_MAP_MAX_RANK or len(spec.box) != len(spec.shape):
        return f"shape and box must have the same rank, 1 to {_TENSOR_MAP_MAX_RANK}"
    if spec.swizzle not in _TENSOR_MAP_SWIZZLES:
        return f"swizzle must be one of {', '.join(map(str, _TENSOR_MAP_SWIZZLES))} bytes"
    if ptr % 16:
        return "the pointer must be 16-byte aligned"
    dims, strides, box = _tensor_map_layout(spec, dtype.itemsize)
    if any(d < 1 for d in dims):
        return "every dim must be at least 1"
    problem = tensor_maps.stride_problem(_tensor_map_strides(spec), dtype.itemsize)
    if problem:
        return problem
    if not all(1 <= b <= _TENSOR_MAP_MAX_BOX for b in box):
        return f"every box dim must be 1 to {_TENSOR_MAP_MAX_BOX}"
    inner_bytes = box[0] * dtype.itemsize
    if inner_bytes % 16:
        return f"the innermost box dim is {inner_bytes} bytes, not a multiple of 16"
    if spec.swizzle and inner_bytes > spec.swizzle:
        return f"the innermost box dim is {inner_bytes} bytes, wider than the {spec.swizzle}-byte swizzle"
    return None


def check_tensor_map(ptr: int, spec) -> None:
    """Refuse, naming the map and the reason, what cuTensorMapEncodeTiled would reject with a
    bare CUDA_ERROR_INVALID_VALUE. Pure Python: needs no driver."""
    problem = _tensor_map_problem(ptr, spec)
    if problem:
        raise ArgumentError(f"{_describe_tensor_map(ptr, spec)}: {problem}")


def encode_tensor_map(ptr: int, spec) -> bytes:
    """The CUtensorMap (TMA descriptor) for `spec` (a TensorMapSpec) over the device memory at
    `ptr`, as the bytes of a kernel's by-value "tmap" param. Out-of-bounds elements of a box read
    as zeros, so edge tiles need no masking. Encoding fails with CUDA_ERROR_INVALID_CONTEXT
    unless a context is current (any: the map is plain data), so one is made current if none is."""
    check_tensor_map(ptr, spec)
    _any_context()
    driver = bindings()
    dtype = dtypes.lookup(spec.dtype)
    dims, strides, box = _tensor_map_layout(spec, dtype.itemsize)
    tensor_map = _call(
        "cuTensorMapEncodeTiled",
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_TENSOR_MAP_DTYPES[dtype]}"),
        len(dims), ptr,
        [driver.cuuint64_t(d) for d in dims], [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(b) for b in box], [driver.cuuint32_t(1)] * len(dims),
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{_TENSOR_MAP_SWIZZLES[spec.swizzle]}"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        detail=f"encoding the {_describe_tensor_map(ptr, spec)}")
    return ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)


# ---------------------------------------------------------------------------
# Launching and streams
# ---------------------------------------------------------------------------

def _dim3(dims: int | Sequence[int], what: str) -> tuple[int, int, int]:
    if type(dims) is tuple and len(dims) == 3 and all(type(d) is int and d >= 1 for d in dims):
        return dims   # already a launch's (x, y, z)
    dims = tuple(map(operator.index, dims)) if isinstance(dims, Sequence) else (operator.index(dims),)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive ints, got {dims}")
    return dims + (1,) * (3 - len(dims))


# Attributes holding a raw cudaStream_t: torch.cuda.Stream, cupy.cuda.Stream.
_STREAM_HANDLE_ATTRS = ("cuda_stream", "ptr")


def stream_handle(stream) -> int:
    """The raw CUstream of `stream`: None (the legacy default stream), an int, a
    torch or CuPy stream, or a driver CUstream."""
    if stream is None:
        return 0
    for attr in _STREAM_HANDLE_ATTRS:
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


def launch(kernel: Kernel, grid: int | Sequence[int], block: int | Sequence[int], shared_bytes: int = 0,
           stream=None, args: Sequence[tuple[str, Any]] = ()) -> None:
    """Launch `kernel`; `args` are (PTX param type, value) pairs: ("u64", ptr), ("s32", n), ("f32", x)."""
    grid3, block3 = _dim3(grid, "grid"), _dim3(block, "block")
    packed = PackedArgs(args)
    _check_param_sizes(kernel, packed)
    handle = stream_handle(stream)
    primary_context(kernel.device)
    driver = bindings()
    result = driver.cuLaunchKernel(kernel.handle, *grid3, *block3, shared_bytes, driver.CUstream(handle),
                                   packed.address, 0)
    if result[0] != driver.CUresult.CUDA_SUCCESS:   # the message's details cost driver calls: only on failure
        _check("cuLaunchKernel", result, detail=_launch_detail(kernel, grid3, block3, shared_bytes, handle))


#: a prepared launch's argument slot per param type (`compiler.KernelLaunch.param_types`)
_SLOTS = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "tmap": lambda: _TensorMapStorage()}


class PreparedLaunch:
    """A launch of one kernel with one configuration whose argument buffer is built once: a call
    writes the pointer and tensor-map values into it and calls cuLaunchKernel, skipping the general
    packing, conversion and size checks that `launch` does per call (they are done here, once).
    Not for sharing between threads (each call rewrites the buffer): keep one per thread."""

    def __init__(self, kernel: Kernel, grid, block, shared_bytes: int, param_types: Sequence[str],
                 programmatic: bool = False):
        if any(ty not in _SLOTS for ty in param_types):
            raise ArgumentError(f"a prepared launch takes pointers, tensor maps and u32 sizes, got {list(param_types)}")
        self.kernel, self.shared_bytes = kernel, shared_bytes
        self.grid3, self.block3 = _dim3(grid, "grid"), _dim3(block, "block")
        self.slots = [_SLOTS[ty]() for ty in param_types]
        self._is_map = [ty == "tmap" for ty in param_types]
        self.pointers = (ctypes.c_void_p * max(1, len(self.slots)))(*(ctypes.addressof(v) for v in self.slots))
        _check_param_sizes(kernel, self)
        self._address = ctypes.addressof(self.pointers)
        self._driver = bindings()
        self._success = self._driver.CUresult.CUDA_SUCCESS
        self._programmatic = programmatic
        #: raw stream handle -> what a launch on it passes, built once per stream: the CUstream, or for a
        #: programmatic launch cuLaunchKernelEx's configuration (which holds the stream)
        self._streams: dict[int, Any] = {}

    def _programmatic_config(self, stream):
        """cuLaunchKernelEx's configuration of a launch on `stream` as a programmatic dependent of
        the kernel before it (which the kernel waits for in griddepcontrol.wait), built once per
        stream: building one costs more host time than the launch."""
        d = self._driver
        attribute = d.CUlaunchAttribute()
        attribute.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid3
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block3
        config.sharedMemBytes = self.shared_bytes
        config.attrs, config.numAttrs = [attribute], 1
        config.hStream = stream
        return config

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(ctypes.sizeof(v) for v in self.slots)

    def __call__(self, stream: int, values: Sequence, grid: tuple[int, int, int] | None = None) -> None:
        """Launch on raw stream `stream` with `values`: an int per pointer or size param, 128 bytes
        per map; `grid`: this call's, where it grows with dims taken at run time."""
        if grid is not None and grid != self.grid3:
            self.grid3 = _dim3(grid, "grid")
            if self._programmatic:   # its launch configuration, kept per stream, holds the grid
                self._streams.clear()
        for slot, is_map, value in zip(self.slots, self._is_map, values):
            if is_map:
                ctypes.memmove(slot, value, TENSOR_MAP_BYTES)
            else:
                slot.value = value
        d = self._driver
        target = self._streams.get(stream)
        if target is None:
            if len(self._streams) >= 64:
                self._streams.clear()
            target = d.CUstream(stream)
            if self._programmatic:
                target = self._programmatic_config(target)
            self._streams[stream] = target
        if self._programmatic:
            result = d.cuLaunchKernelEx(target, self.kernel.handle, self._address, 0)
        else:
            result = d.cuLaunchKernel(self.kernel.handle, *self.grid3, *self.block3, self.shared_bytes,
                                      target, self._address, 0)
        if result[0] != self._success:
            _check("cuLaunchKernelEx" if self._programmatic else "cuLaunchKernel", result,
                   detail=_launch_detail(self.kernel, self.grid3, self.block3, self.shared_bytes, stream))


def _launch_detail(kernel: Kernel, grid3, block3, shared_bytes: int, handle: int) -> str:
    detail = (f"launching kernel '{kernel.name}' with grid {grid3}, block {block3}, "
              f"{shared_bytes} bytes dynamic shared memory, on stream {handle:#x}")
    if shared_bytes > kernel.max_dynamic_shared:
        detail += f" (above its {kernel.max_dynamic_shared}-byte limit: call set_max_dynamic_shared first)"
    return detail


def synchronize(stream=None) -> None:
    """Wait for `stream` (any form `stream_handle` takes), or with None for the whole current context."""
    if stream is None:
        _call("cuCtxSynchronize")
    else:
        _call("cuStreamSynchronize", bindings().CUstream(stream_handle(stream)))


def time_calls(run: Callable[[], Any], stream=None, repeats: int = 25) -> list[float]:
    """GPU milliseconds of each of `repeats` calls of `run` (which enqueues work on `stream`),
    from CUDA events around each call. The host enqueues every call before waiting, so the queue
    stays full and an event pair spans its call's GPU work, not the host's launch time (unless
    the GPU work is shorter than the launch)."""
    handle = bindings().CUstream(stream_handle(stream))
    events = [_call("cuEventCreate", 0) for _ in range(2 * repeats)]
    try:
        for i in range(repeats):
            _call("cuEventRecord", events[2 * i], handle)
            run()
            _call("cuEventRecord", events[2 * i + 1], handle)
        _call("cuEventSynchronize", events[-1])
        return [_call("cuEventElapsedTime", events[2 * i], events[2 * i + 1]) for i in range(repeats)]
    finally:
        for event in events:
            _call("cuEventDestroy", event)


def copy_to_host(ptr: int, nbytes: int, stream=None) -> bytes:
    """`nbytes` of device memory at `ptr`, once the work queued on `stream` is done."""
    synchronize(stream)
    host = bytearray(nbytes)
    if nbytes:
        buffer = (ctypes.c_char * nbytes).from_buffer(host)
        _call("cuMemcpyDtoH", ctypes.addressof(buffer), ptr, nbytes)
    return bytes(host)


def current_torch_stream(device: Device | int | None = None) -> int:
    """The raw handle of PyTorch's current stream on `device` (torch's current device when None)."""
    index = None if device is None else _ordinal(device)
    raw = _torch_raw_stream()
    if raw is not None and index is not None:
        return raw(index)
    import torch
    return torch.cuda.current_stream(index).cuda_stream


@functools.lru_cache(maxsize=None)
def _torch_raw_stream():
    """torch's `_cuda_getCurrentRawStream` (what its own launchers call), looked up once, or None."""
    import torch
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


# ---------------------------------------------------------------------------
# Raw device memory (tests only: user tensors come from torch or CuPy)
# ---------------------------------------------------------------------------

def mem_alloc(nbytes: int, device: Device | int = 0) -> int:
    primary_context(device)
    return int(_call("cuMemAlloc", nbytes, detail=f"allocating {nbytes} bytes"))


def mem_free(ptr: int) -> None:
    _call("cuMemFree", bindings().CUdeviceptr(ptr))


def memcpy_htod(dst: int, src: np.ndarray) -> None:
    src = np.ascontiguousarray(src)
    _call("cuMemcpyHtoD", bindings().CUdeviceptr(dst), src.ctypes.data, src.nbytes)


def memcpy_dtoh(dst: np.ndarray, src: int) -> None:
    if not (dst.flags.c_contiguous and dst.flags.writeable):
        raise ValueError("memcpy_dtoh needs a writable C-contiguous destination array")
    _call("cuMemcpyDtoH", dst.ctypes.data, bindings().CUdeviceptr(src), dst.nbytes)
