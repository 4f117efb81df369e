"""The driver layer's pure-Python parts (no GPU needed): packing tensor-map params and
checking a tensor map before cuTensorMapEncodeTiled would see it."""
import ctypes

import pytest

from tessera.backends.ptx import TensorMapSpec
from tessera.runtime.driver import TENSOR_MAP_BYTES, ArgumentError, PackedArgs, check_tensor_map

PTR = 0x7F0000000000


def packed_bytes(args):
    packed = PackedArgs(args)
    pointers = ctypes.cast(packed.address, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(packed.sizes)]


# --- "tmap" params ----------------------------------------------------------------------------

def test_a_tensor_map_is_packed_as_its_128_bytes():
    tmap = bytes(range(TENSOR_MAP_BYTES))
    packed = PackedArgs([("u64", PTR), ("tmap", tmap)])
    assert packed.sizes == (8, 128)
    assert packed_bytes([("u64", PTR), ("tmap", tmap)])[1] == tmap


@pytest.mark.parametrize("value, message", [
    (bytes(64), r"argument 0 .*a tensor map is 128 bytes, got 64"),
    (bytes(129), r"a tensor map is 128 bytes, got 129"),
    (PTR, r"a tensor map is 128 bytes \(from encode_tensor_map\), got int"),
])
def test_tensor_maps_of_another_size_are_refused(value, message):
    with pytest.raises(ArgumentError, match=message):
        PackedArgs([("tmap", value)])


# --- check_tensor_map -------------------------------------------------------------------------

def spec(**overrides):
    """A 128 x 256 fp16 matrix copied in 64 x 64 boxes: 128-byte rows, the widest 128B swizzle allows."""
    fields = dict(arg=1, dtype="f16", shape=(128, 256), box=(64, 64), swizzle=128)
    return TensorMapSpec(**{**fields, **overrides})


@pytest.mark.parametrize("s", [
    spec(),
    spec(dtype="bf16"),
    spec(dtype="f32", box=(64, 32)),
    spec(dtype="fp8_e4m3", box=(64, 128)),
    spec(shape=(4, 8, 16, 64), box=(1, 1, 16, 64)),
    spec(shape=(2, 4, 100, 64), box=(1, 1, 64, 64), strides=(100 * 4 * 64, 64, 4 * 64, 1)),   # [B, S, H, D] seen as BHSD
    spec(swizzle=0, box=(64, 256)),
    spec(swizzle=64, box=(64, 32)),
])
def test_valid_maps_pass(s):
    check_tensor_map(PTR, s)


def test_a_strided_map_gives_the_driver_its_own_byte_strides():
    """Innermost dim first, as cuTensorMapEncodeTiled takes them; a row-major map's are its shape's."""
    from tessera.runtime.driver import _tensor_map_layout

    strided = spec(shape=(2, 4, 100, 64), box=(1, 1, 64, 64), strides=(25600, 64, 256, 1))
    assert _tensor_map_layout(strided, 2) == ([64, 100, 4, 2], [512, 128, 51200], [64, 64, 1, 1])
    assert _tensor_map_layout(spec(), 2)[1] == [512]


@pytest.mark.parametrize("ptr, s, message", [
    (PTR + 8, spec(), r"the pointer must be 16-byte aligned"),
    (PTR, spec(shape=(128, 100)), r"rows are not 16-byte aligned \(dim 0 steps 200 bytes\)"),
    (PTR, spec(shape=(2, 3, 4), box=(1, 1, 8)), r"rows are not 16-byte aligned \(dim 0 steps 24 bytes\)"),
    (PTR, spec(shape=(2, 64, 64), box=(1, 64, 64), strides=(4100, 64, 1)),
     r"rows are not 16-byte aligned \(dim 0 steps 8200 bytes\)"),
    (PTR, spec(shape=(2, 64, 64), box=(1, 64, 64), strides=(0, 64, 1)), r"broadcast along dim 0 \(stride 0\)"),
    (PTR, spec(shape=(64, 64), strides=(1, 64)), r"innermost dim has stride 64"),
    (PTR, spec(box=(512, 64)), r"every box dim must be 1 to 256"),
    (PTR, spec(box=(0, 64)), r"every box dim must be 1 to 256"),
    (PTR, spec(box=(64, 128)), r"innermost box dim is 256 bytes, wider than the 128-byte swizzle"),
    (PTR, spec(box=(64, 32), swizzle=32), r"innermost box dim is 64 bytes, wider than the 32-byte swizzle"),
    (PTR, spec(box=(64, 4)), r"innermost box dim is 8 bytes, not a multiple of 16"),
    (PTR, spec(swizzle=16), r"swizzle must be one of 0, 32, 64, 128 bytes"),
    (PTR, spec(box=(64,)), r"shape and box must have the same rank, 1 to 5"),
    (PTR, spec(shape=(1,) * 6, box=(1,) * 6), r"same rank, 1 to 5"),
    (PTR, spec(dtype="i32"), r"no tensor map data type for int32"),
    (PTR, spec(dtype="f64"), r"unknown dtype 'f64'"),
])
def test_invalid_maps_are_refused_naming_the_map(ptr, s, message):
    with pytest.raises(ArgumentError, match=message) as e:
        check_tensor_map(ptr, s)
    strides = f", strides {s.strides}" if s.strides else ""
    assert f"tensor map of argument 1 ({s.dtype}, shape {s.shape}{strides}, box {s.box}" in str(e.value)
    assert f"pointer {ptr:#x}" in str(e.value)
