"""describe() and validate() on arrays from other frameworks (no GPU needed: CUDA arrays are faked)."""
import re
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from tessera import Tensor, dtypes
from tessera.errors import DTypeError, ShapeError, TesseraError
from tessera.runtime import interop
from tessera.runtime.interop import DeviceError, LayoutError, NotATensorError, describe, validate


class FakeCudaArray:
    """What CuPy exposes: __cuda_array_interface__ (byte strides) and .device.id. Nothing is allocated."""

    def __init__(self, shape, typestr="<f2", ptr=0x7F0000000000, device=0, strides=None, mask=None):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": strides, "version": 3, "mask": mask}
        self.device = SimpleNamespace(id=device)


class DLPackOnly:
    """Exposes a NumPy array through DLPack alone."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def qkv(**overrides):
    args = {name: FakeCudaArray((2, 4, 8, 16)) for name in "qkv"}
    return {**args, **overrides}


SPECS = {name: Tensor["B", "S", "H", 16, dtypes.fp16] for name in "qkv"}


# --- describe ---------------------------------------------------------------------------------

def test_cuda_array_interface_is_read_without_copying():
    info = describe(FakeCudaArray((3, 5), strides=(10, 2), ptr=0x1000, device=1))
    assert (info.data_ptr, info.shape, info.strides) == (0x1000, (3, 5), (5, 1))
    assert (info.dtype, info.device, info.place, info.is_contiguous) == (dtypes.fp16, 1, "cuda:1", True)


def test_missing_strides_mean_c_order():
    assert describe(FakeCudaArray((2, 3, 4))).strides == (12, 4, 1)


def test_numpy_arrays_are_host_memory():
    a = np.zeros((4, 8), dtype=np.float32)
    info = describe(a)
    assert (info.device, info.place, info.framework) == (None, "cpu", "numpy")
    assert (info.data_ptr, info.shape, info.strides, info.dtype) == (a.ctypes.data, (4, 8), (8, 1), dtypes.fp32)
    assert describe(a.T).strides == (1, 8) and not describe(a.T).is_contiguous


def test_numpy_bfloat16_keeps_its_dtype():
    assert describe(np.zeros(4, dtype=ml_dtypes.bfloat16)).dtype == dtypes.bf16


def test_unsupported_dtypes_are_described_not_refused():
    info = describe(np.zeros(3))
    assert info.dtype is None and info.type_name == "float64"


def test_dlpack_capsules_are_read_in_place():
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    view = a.transpose(0, 2, 1)
    info = describe(DLPackOnly(view))
    assert (info.data_ptr, info.shape, info.strides) == (view.ctypes.data, (2, 4, 3), (12, 1, 4))
    assert (info.dtype, info.device, info.place, info.is_contiguous) == (dtypes.int32, None, "cpu", False)
    assert describe(DLPackOnly(a[1])).data_ptr == a.ctypes.data + 12 * 4


def test_not_a_tensor():
    with pytest.raises(NotATensorError, match="argument 'q' is a list, not a tensor"):
        validate({"q": [1.0, 2.0]})


def test_cuda_array_byte_strides_must_be_whole_elements():
    with pytest.raises(LayoutError, match=r"has byte strides \(6, 3\) that are not multiples of its 2-byte elements"):
        describe(FakeCudaArray((2, 2), strides=(6, 3)))


def test_masked_arrays_are_refused():
    with pytest.raises(NotATensorError, match="masked"):
        describe(FakeCudaArray((2,), mask=object()))


@pytest.mark.parametrize("shape, strides, contiguous", [
    ((4, 4), (4, 1), True), ((4, 4), (1, 4), False), ((4, 1), (1, 99), True), ((1, 4), (7, 1), True),
    ((0, 4), (1, 1), True), ((), (), True), ((2, 3), (6, 1), False),
])
def test_c_contiguity(shape, strides, contiguous):
    assert interop.is_c_contiguous(shape, strides) == contiguous


# --- validate ---------------------------------------------------------------------------------

def test_valid_arguments_are_described():
    infos = validate(qkv(), SPECS)
    assert list(infos) == ["q", "k", "v"] and all(i.device == 0 for i in infos.values())


def test_numpy_is_the_cpu():
    with pytest.raises(DeviceError, match="argument 'k' must be on a CUDA device, but is a numpy array in cpu memory"):
        validate(qkv(k=np.zeros((2, 4, 8, 16), dtype=np.float16)), SPECS)


def test_numpy_is_the_cpu_even_with_a_dtype_tessera_lacks():
    with pytest.raises(DeviceError, match="must be on a CUDA device"):
        validate({"x": np.zeros(3)})


def test_all_arguments_on_one_device():
    with pytest.raises(DeviceError, match="argument 'k' must be on cuda:0 like 'q', but is on cuda:1"):
        validate(qkv(k=FakeCudaArray((2, 4, 8, 16), device=1)), SPECS)


def test_contiguity_is_required():
    transposed = FakeCudaArray((2, 4, 8, 16), strides=(1024, 256, 2, 16))
    with pytest.raises(LayoutError, match=re.escape(
            "argument 'q' must be contiguous (strides (512, 128, 1, 8) for shape (2, 4, 8, 16))")):
        validate(qkv(q=transposed), SPECS)


def test_data_pointers_are_16_byte_aligned():
    with pytest.raises(LayoutError, match="argument 'v' data pointer is not 16-byte aligned"):
        validate(qkv(v=FakeCudaArray((2, 4, 8, 16), ptr=0x7F0000000008)), SPECS)


def test_dtype_must_match_the_spec():
    with pytest.raises(DTypeError, match="argument 'k' must be fp16, but is fp32"):
        validate(qkv(k=FakeCudaArray((2, 4, 8, 16), typestr="<f4")), SPECS)


def test_unsupported_dtype_is_named():
    with pytest.raises(DTypeError, match="argument 'x' has element type float64, which Tessera does not support"):
        validate({"x": FakeCudaArray((3,), typestr="<f8")})


def test_rank_must_match():
    with pytest.raises(ShapeError, match=r"argument 'q' must have 4 dims \(B, S, H, 16\), but has shape \(2, 4\)"):
        validate(qkv(q=FakeCudaArray((2, 4))), SPECS)


def test_fixed_dims_must_match():
    with pytest.raises(ShapeError, match="argument 'v' dim 3 must be 16, but is 32"):
        validate(qkv(v=FakeCudaArray((2, 4, 8, 32))), SPECS)


def test_symbolic_dims_must_agree_across_arguments():
    with pytest.raises(ShapeError, match=r"argument 'k' dim 2 \(H\) is 4, but 'q' dim 2 has H = 8"):
        validate(qkv(k=FakeCudaArray((2, 4, 4, 16))), SPECS)


def test_errors_are_tessera_errors():
    with pytest.raises(TesseraError):
        validate({"x": np.zeros(3, dtype=np.float32)})


def test_outputs_cannot_be_allocated_like_numpy():
    with pytest.raises(NotATensorError, match="cannot allocate outputs like a numpy array"):
        interop.empty_like_framework(np.zeros(3), (3,), "fp32")
