"""Tensors from other frameworks, described without copying, and checked before a launch.

A kernel receives bare pointers, so everything the pointer does not say
(device, element type, shape, layout, alignment) is checked here first, with
messages that name the argument and the dim: a wrong stride or a tensor on the
wrong GPU is otherwise a silently wrong result or an illegal address.

`describe` reads, in order: PyTorch tensors (attributes, so torch is never
imported here), `__cuda_array_interface__` (CuPy, Numba), NumPy's
`__array_interface__` (host memory: a clear error for a GPU run), and DLPack.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera import dtypes
from tessera.dtypes import DType
from tessera.errors import DTypeError, ShapeError, TesseraError

ALIGNMENT = 16  # bytes: vectorized (128-bit) loads and TMA need it


class NotATensorError(TesseraError, TypeError):
    """An argument that exposes no array protocol Tessera reads."""


class DeviceError(TesseraError, ValueError):
    """An argument that is not on the CUDA device the others are on."""


class LayoutError(TesseraError, ValueError):
    """An argument whose strides or data pointer the kernels cannot take."""


@dataclass(frozen=True)
class TensorInfo:
    """What a kernel launch needs to know about one array; the array itself is not copied."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: DType | None       # None: an element type Tessera does not support (see type_name)
    type_name: str            # the framework's name for the element type: "float16", "float64"
    device: int | None        # CUDA device ordinal; None when the data is not in CUDA device memory
    place: str                # where the data is, for messages: "cuda:0", "cpu"
    is_contiguous: bool       # C-contiguous
    framework: str            # the top-level module of the array's type: "torch", "cupy", "numpy"


# ---------------------------------------------------------------------------
# Element types
# ---------------------------------------------------------------------------

# Framework dtype names that are not Tessera names (torch.float8_e4m3fn, ...).
_TYPE_ALIASES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}

# DLPack (type code, bits) -> Tessera dtype (dlpack.h's DLDataTypeCode).
_DLPACK_TYPES: dict[tuple[int, int], DType] = {
    (2, 32): dtypes.fp32, (2, 16): dtypes.fp16, (4, 16): dtypes.bf16,
    (10, 8): dtypes.fp8_e4m3, (12, 8): dtypes.fp8_e5m2, (0, 32): dtypes.int32, (6, 8): dtypes.bool_,
}


def _dtype_named(name: str) -> DType | None:
    try:
        return dtypes.lookup(_TYPE_ALIASES.get(name, name))
    except TypeError:
        return None


def _dtype_of_numpy(dt: np.dtype) -> DType | None:
    try:
        return dtypes.lookup(dt)
    except TypeError:
        return None


# ---------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------

def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-contiguous) element strides of `shape` (a size-0 dim counted as 1). The leading
    dim's size is never read: it may be a dynamic dim (`tessera.dims`); a dynamic dim elsewhere has
    no strides before it known here (callers take `tile.stride_factors`, or replace it by 1)."""
    strides, step = [], 1
    for size in reversed(shape[1:]):
        strides.append(step)
        step *= max(size, 1)
    return (step, *reversed(strides)) if shape else ()


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """C-contiguous as PyTorch defines it: dims of size 1 may have any stride, empty arrays always are."""
    if 0 in shape:
        return True
    return all(size == 1 or stride == want for size, stride, want in zip(shape, strides, c_strides(shape)))


def canonical_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """None for a C-contiguous layout; else the element strides with each size-1 dim's (which no
    index moves along) replaced by what a contiguous layout would give it, so that two layouts
    addressing the same elements compare equal: what a compile specializes on."""
    if is_c_contiguous(shape, strides):
        return None
    out = list(strides)
    for d in reversed(range(len(shape))):
        if shape[d] == 1:
            out[d] = out[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    return tuple(out)


#: the protocols `describe` reads a layout through
_LAYOUT_PROTOCOLS = ("__cuda_array_interface__", "__array_interface__", "__dlpack__")


def layout_of(x) -> tuple[int, ...] | None:
    """`canonical_strides` of an array of any framework (None: C-contiguous), read cheaply for
    torch tensors (and objects that answer as they do) and NumPy arrays, which most calls pass.
    What only stands for a shape and dtype (a trace's placeholder) has no layout: None."""
    if hasattr(x, "is_contiguous") and hasattr(x, "stride"):
        return None if x.is_contiguous() else canonical_strides(tuple(x.shape), tuple(x.stride()))
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous or any(st % x.itemsize for st in x.strides):
            return None   # (strides between whole elements, a record's field: the CPU call copies it)
        return canonical_strides(x.shape, _element_strides(x.strides, x.shape, x.itemsize, "array"))
    if not any(hasattr(x, protocol) for protocol in _LAYOUT_PROTOCOLS):
        return None
    info = describe(x)
    return None if info.is_contiguous else canonical_strides(info.shape, info.strides)


def _element_strides(byte_strides, shape, itemsize: int, name: str) -> tuple[int, ...]:
    if byte_strides is None:
        return c_strides(shape)
    if any(s % itemsize for s in byte_strides):
        raise LayoutError(f"{name} has byte strides {tuple(byte_strides)} that are not multiples "
                          f"of its {itemsize}-byte elements")
    return tuple(s // itemsize for s in byte_strides)


def _framework(x) -> str:
    return type(x).__module__.split(".")[0]


# ---------------------------------------------------------------------------
# Readers, one per protocol
# ---------------------------------------------------------------------------

def _is_torch(x) -> bool:
    return _framework(x) == "torch" and hasattr(x, "data_ptr") and hasattr(x, "stride")


@functools.lru_cache(maxsize=None)
def _torch_type(dtype) -> tuple[DType | None, str]:
    """(Tessera dtype, torch's name) of a torch dtype, worked out once per dtype (a call reads several)."""
    type_name = str(dtype).removeprefix("torch.")
    return _dtype_named(type_name), type_name


def _from_torch(x, name: str) -> TensorInfo:
    device = x.device
    dt, type_name = _torch_type(x.dtype)
    return TensorInfo(x.data_ptr(), tuple(x.shape), tuple(x.stride()), dt, type_name,
                      device.index if device.type == "cuda" else None, str(device), x.is_contiguous(), "torch")


def data_pointer(x) -> int:
    """The device address of `x`: torch's directly (on the launch path), any other through `describe`."""
    return x.data_ptr() if _is_torch(x) else describe(x).data_ptr


def _from_interface(x, iface: dict, device: int | None, place: str, name: str) -> TensorInfo:
    """__cuda_array_interface__ and __array_interface__ share one layout (byte strides, typestr)."""
    if iface.get("mask") is not None:
        raise NotATensorError(f"{name} is a masked array; Tessera takes plain arrays")
    # The typestr of ml_dtypes' bfloat16 is an anonymous "<V2"; the array's own dtype says more.
    dt = x.dtype if isinstance(getattr(x, "dtype", None), np.dtype) else np.dtype(iface["typestr"])
    shape = tuple(iface["shape"])
    strides = _element_strides(iface.get("strides"), shape, dt.itemsize, name)
    return TensorInfo(int(iface["data"][0]), shape, strides, _dtype_of_numpy(dt), str(dt), device, place,
                      is_c_contiguous(shape, strides), _framework(x))


def _cuda_array_device(x, ptr: int) -> int:
    """The device of a __cuda_array_interface__ array, which the interface itself does not say."""
    device = getattr(x, "device", None)
    if hasattr(device, "id"):  # CuPy
        return int(device.id)
    if hasattr(x, "__dlpack_device__"):
        return int(x.__dlpack_device__()[1])
    from . import driver
    return driver.pointer_device(ptr)


def _from_cuda_array_interface(x, name: str) -> TensorInfo:
    iface = x.__cuda_array_interface__
    device = _cuda_array_device(x, int(iface["data"][0]))
    return _from_interface(x, iface, device, f"cuda:{device}", name)


def _from_array_interface(x, name: str) -> TensorInfo:
    return _from_interface(x, x.__array_interface__, None, "cpu", name)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    """dlpack.h's DLTensor, the first member of the DLManagedTensor a "dltensor" capsule holds."""

    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# DLPack device types whose memory CUDA kernels can address, and names for the rest.
_DLPACK_CUDA = {2: "cuda", 13: "cuda_managed"}
_DLPACK_HOST = {1: "cpu", 3: "cuda_host"}


def _from_dlpack(x, name: str) -> TensorInfo:
    """Read the DLTensor of an unconsumed capsule. Dropping the capsule afterwards
    runs its deleter, which releases the producer's view, not the data `x` owns."""
    capsule = x.__dlpack__()
    t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] for i in range(t.ndim)) if t.strides else c_strides(shape)
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dt = _DLPACK_TYPES.get((code, bits)) if lanes == 1 else None
    kind, ordinal = t.device.device_type, t.device.device_id
    on_cuda = kind in _DLPACK_CUDA
    place = f"cuda:{ordinal}" if on_cuda else _DLPACK_HOST.get(kind, f"DLPack device type {kind}")
    return TensorInfo((t.data or 0) + t.byte_offset, shape, strides, dt,
                      dt.name if dt else f"DLPack(code={code}, bits={bits}, lanes={lanes})",
                      ordinal if on_cuda else None, place, is_c_contiguous(shape, strides), _framework(x))


# (test, reader), tried in order: torch tensors also expose the later protocols,
# NumPy arrays also DLPack (which cannot export read-only arrays).
_READERS: tuple[tuple[Callable[[Any], bool], Callable[[Any, str], TensorInfo]], ...] = (
    (_is_torch, _from_torch),
    (lambda x: hasattr(x, "__cuda_array_interface__"), _from_cuda_array_interface),
    (lambda x: hasattr(x, "__array_interface__"), _from_array_interface),
    (lambda x: hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"), _from_dlpack),
)


def describe(x, name: str = "argument") -> TensorInfo:
    """Pointer, shape, strides, dtype and device of `x` (a torch tensor, a CuPy
    array, anything with __cuda_array_interface__, __array_interface__ or DLPack)."""
    for accepts, read in _READERS:
        if accepts(x):
            return read(x, name)
    raise NotATensorError(f"{name} is a {type(x).__name__}, not a tensor: pass a torch tensor, a CuPy array, "
                          f"or an object with __cuda_array_interface__ or __dlpack__")


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

def validate(args: Mapping[str, Any], specs: Mapping[str, Any] | None = None,
             contiguous: bool = True) -> dict[str, TensorInfo]:
    """Describe every argument and check it can be passed to a kernel: all on one
    CUDA device, a supported dtype (the spec's, when it names one), the spec's
    shape (symbolic dims equal wherever they repeat), C-contiguous (unless not
    `contiguous`: the caller checks the layout against what it compiled for), and
    the data pointer 16-byte aligned. `specs` maps names to `TensorSpec`s (dims, dtype)."""
    infos = {name: describe(x, f"argument {name!r}") for name, x in args.items()}
    _check_devices(infos)
    bound: dict[str, tuple[int, str, int]] = {}  # dim name -> (size, argument, index)
    for name, info in infos.items():
        spec = (specs or {}).get(name)
        _check_dtype(name, info, getattr(spec, "dtype", None))
        if spec is not None:
            _check_shape(name, info.shape, spec.dims, bound)
        _check_layout(name, info, contiguous)
    return infos


def _check_devices(infos: dict[str, TensorInfo]) -> None:
    first = None
    for name, info in infos.items():
        if info.device is None:
            raise DeviceError(f"argument {name!r} must be on a CUDA device, but is a {info.framework} array "
                              f"in {info.place} memory; move it to the GPU first")
        if first is None:
            first = name
        elif info.device != infos[first].device:
            raise DeviceError(f"argument {name!r} must be on {infos[first].place} like {first!r}, "
                              f"but is on {info.place}")


def _check_dtype(name: str, info: TensorInfo, want: DType | None) -> None:
    if info.dtype is None:
        raise DTypeError(f"argument {name!r} has element type {info.type_name}, which Tessera does not support; "
                         f"supported: {', '.join(d.name for d in dtypes.ALL)}")
    if want is not None and info.dtype != want:
        raise DTypeError(f"argument {name!r} must be {want.name}, but is {info.dtype.name}")


def _check_shape(name: str, shape: tuple[int, ...], dims: tuple, bound: dict) -> None:
    if len(shape) != len(dims):
        raise ShapeError(f"argument {name!r} must have {len(dims)} dims ({', '.join(map(str, dims))}), "
                         f"but has shape {shape}")
    for index, (dim, size) in enumerate(zip(dims, shape)):
        if isinstance(dim, int):
            if size != dim:
                raise ShapeError(f"argument {name!r} dim {index} must be {dim}, but is {size}")
        elif dim not in bound:
            bound[dim] = (size, name, index)
        elif bound[dim][0] != size:
            want, other, other_index = bound[dim]
            raise ShapeError(f"argument {name!r} dim {index} ({dim}) is {size}, but {other!r} dim {other_index} "
                             f"has {dim} = {want}")


def _check_layout(name: str, info: TensorInfo, contiguous: bool = True) -> None:
    if contiguous and not info.is_contiguous:
        raise LayoutError(f"argument {name!r} must be contiguous (strides {info.strides} for shape {info.shape}); "
                          f"call .contiguous() on it first")
    if info.data_ptr % ALIGNMENT:
        raise LayoutError(f"argument {name!r} data pointer is not {ALIGNMENT}-byte aligned ({info.data_ptr:#x}); "
                          f"it is probably a view at an offset: copy it")


def byte_span(x) -> tuple[int, int]:
    """[first, last) bytes an array's elements lie in (its strides' reach); read cheaply for a
    contiguous torch tensor, which most calls pass."""
    if _is_torch(x):
        ptr = x.data_ptr()
        if x.is_contiguous():
            return ptr, ptr + x.nbytes
        shape, strides, itemsize = tuple(x.shape), x.stride(), x.element_size()
    else:
        info = describe(x)
        itemsize = info.dtype.itemsize if info.dtype is not None else np.dtype(x.dtype).itemsize
        ptr, shape, strides = info.data_ptr, info.shape, info.strides
    if 0 in shape:
        return ptr, ptr
    lo = sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = sum((n - 1) * st for n, st in zip(shape, strides) if st > 0)
    return ptr + lo * itemsize, ptr + (hi + 1) * itemsize


def contiguous(x):
    """A C-contiguous copy of a strided array, made by its own framework on its own device and
    stream (torch's `.contiguous()`, CuPy's `ascontiguousarray`)."""
    framework = _framework(x)
    if framework == "torch":
        return x.contiguous()
    if framework == "cupy":
        import cupy
        return cupy.ascontiguousarray(x)
    if framework == "numpy":
        return np.ascontiguousarray(x)
    info = describe(x)
    raise LayoutError(f"a {framework} array with strides {info.strides} for shape {info.shape} must be copied to "
                      f"a contiguous one first, which Tessera does only for torch, CuPy and NumPy arrays")


# ---------------------------------------------------------------------------
# Allocating outputs
# ---------------------------------------------------------------------------

# Tessera dtype -> torch attribute name.
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2", "int32": "int32", "bool": "bool"}


def torch_dtype(dt: DType):
    """The torch dtype of a Tessera dtype."""
    import torch
    return getattr(torch, _TORCH_DTYPES[dt.name])


def _torch_empty(template, shape: tuple[int, ...], dt: DType):
    import torch
    return torch.empty(shape, dtype=torch_dtype(dt), device=template.device)


def _cupy_empty(template, shape: tuple[int, ...], dt: DType):
    import cupy
    with cupy.cuda.Device(template.device.id):
        try:
            return cupy.empty(shape, dtype=dt.np)
        except (TypeError, ValueError) as e:
            raise DTypeError(f"CuPy cannot hold {dt.name} arrays ({e}); pass torch tensors instead") from e


_ALLOCATORS = {"torch": _torch_empty, "cupy": _cupy_empty}


def empty_like_framework(template, shape, dtype) -> Any:
    """An uninitialized array of `shape` and `dtype` from `template`'s framework, on its device."""
    framework = _framework(template)
    allocate = _ALLOCATORS.get(framework)
    if allocate is None:
        raise NotATensorError(f"cannot allocate outputs like a {framework} array: pass torch tensors or CuPy arrays")
    return allocate(template, tuple(int(d) for d in shape), dtypes.lookup(dtype))


# ---------------------------------------------------------------------------
# Results in the caller's kind
# ---------------------------------------------------------------------------

# Tessera dtype -> the integer type of its width: NumPy lacks bf16 and fp8 (ml_dtypes has them), so
# they cross between torch and NumPy as bits.
_TORCH_BITS = {"bf16": "int16", "fp8_e4m3": "int8", "fp8_e5m2": "int8"}


def host_array(x) -> np.ndarray:
    """A host array's data as a NumPy array, without a copy: a torch CPU tensor's (bf16 and fp8
    through their bits), or anything `np.asarray` reads."""
    if not _is_torch(x):
        return np.asarray(x)
    dt, _ = _torch_type(x.dtype)
    t = x.detach()
    if dt is not None and dt.name in _TORCH_BITS:
        import torch
        return t.view(getattr(torch, _TORCH_BITS[dt.name])).numpy().view(dt.np)
    return t.numpy()


def host_like(template, array: np.ndarray):
    """`array` as the kind of host array `template` is: a torch CPU tensor for a torch tensor
    (sharing the memory), else the NumPy array itself."""
    if not _is_torch(template):
        return array
    import torch
    dt = dtypes.lookup(array.dtype)
    if dt.name in _TORCH_BITS:
        bits = torch.from_numpy(np.ascontiguousarray(array).view(np.dtype(_TORCH_BITS[dt.name])))
        return bits.view(torch_dtype(dt))
    return torch.from_numpy(np.ascontiguousarray(array))


def write_host(target, value: np.ndarray, what: str) -> None:
    """Stores `value` into the host array `target` (a NumPy array or a torch CPU tensor), in place."""
    if isinstance(target, np.ndarray) or _is_torch(target):
        view = host_array(target)
        if view.flags.writeable:
            view[...] = value
            return
    raise NotATensorError(f"{what} must be a writable NumPy array or torch tensor on the CPU, "
                          f"got {type(target).__name__}")


def device_to_host(x) -> np.ndarray:
    """A CUDA array's contents as a NumPy array (a copy)."""
    if _is_torch(x):
        return host_array(x.detach().cpu())
    if _framework(x) == "cupy":
        return x.get()
    raise NotATensorError(f"cannot read a {type(x).__name__} back from the GPU: pass torch tensors or CuPy arrays")


def device_like(template, array: np.ndarray):
    """A CUDA array of `template`'s framework, on its device, holding `array`."""
    out = empty_like_framework(template, array.shape, array.dtype)
    copy_to_device(out, array)
    return out


def copy_to_device(target, array: np.ndarray) -> None:
    """Writes `array` into the CUDA array `target` (torch or CuPy), in place."""
    if _is_torch(target):
        target.copy_(host_like(target, array))
    elif _framework(target) == "cupy":
        target.set(np.ascontiguousarray(array))
    else:
        raise NotATensorError(f"cannot write a {type(target).__name__} on the GPU: pass torch tensors or CuPy arrays")


def copy_on_device(target, source) -> None:
    """Copies the CUDA array `source` into `target` (same framework, shape and dtype), on the
    framework's current stream."""
    if _is_torch(target):
        target.copy_(source)
    elif _framework(target) == "cupy":
        target[...] = source
    else:
        raise NotATensorError(f"cannot copy into a {type(target).__name__} on the GPU: pass torch tensors or "
                              f"CuPy arrays")
