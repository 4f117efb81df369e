"""fp8 casts on the GPU (sm_89+): a kernel widens fp8 exactly and narrows to fp8 bit for bit as the
CPU interpreter (ml_dtypes) does, overflow included (NaN for E4M3FN, +-inf for E5M2)."""
import ml_dtypes
import numpy as np
import pytest

from tessera.backends.ptx.types import UnsupportedByBackend
from fp8_cases import narrow, widen

FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
WIDE = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
SHAPES = [(1, 1), (61, 130), (7, 4097), (3, 4), (5, 1000), (9, 1024)]   # (the last three: 4, 8, 16 bytes at a time)


def to_cuda(torch, a: np.ndarray):
    bits = {1: np.uint8, 2: np.int16, 4: np.int32}[a.dtype.itemsize]
    t = torch.from_numpy(np.ascontiguousarray(a).view(bits)).cuda()
    return t.view(getattr(torch, a.dtype.name))   # ml_dtypes and torch name these dtypes alike


def to_host(torch, t, dtype) -> np.ndarray:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(bits).cpu().numpy().view(dtype)


@pytest.fixture
def fp8_device(torch_cuda, cuda_device):
    """torch, on a device with fp8 conversions; on one without (before sm_89) the call must be refused
    with the reason, which is all there is to test there."""
    if not cuda_device.platform().has("fp8"):
        x = to_cuda(torch_cuda, np.ones((2, 2), np.float32).astype(ml_dtypes.float8_e4m3fn))
        with pytest.raises(UnsupportedByBackend, match="fp8 conversions .* need sm_89 or later"):
            widen("fp32")(x)
        return None
    return torch_cuda


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wide", WIDE)
@pytest.mark.parametrize("fp8", FP8)
def test_widening_fp8_is_exact(fp8_device, fp8, wide, shape):
    if fp8_device is None:   # refused, as the fixture checked
        return
    torch, rng = fp8_device, np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 8).astype(np.float32).astype(FP8[fp8])
    got = to_host(torch, widen(wide)(to_cuda(torch, x)), WIDE[wide])
    want = (x.astype(np.float64) * 2.0).astype(WIDE[wide])
    assert np.array_equal(got.astype(np.float64), want.astype(np.float64), equal_nan=True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wide", WIDE)
@pytest.mark.parametrize("fp8", FP8)
def test_narrowing_to_fp8_matches_the_cpu_interpreter_bit_for_bit(fp8_device, fp8, wide, shape):
    if fp8_device is None:   # refused, as the fixture checked
        return
    torch, rng = fp8_device, np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 100).astype(WIDE[wide])
    x.flat[:3] = [300.0, -40000.0, 7e4][: x.size] if x.size >= 3 else x.flat[:3]   # overflows of both types
    got = to_host(torch, narrow(fp8)(to_cuda(torch, x)), FP8[fp8])
    want = narrow(fp8)(x)                      # the CPU interpreter
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
