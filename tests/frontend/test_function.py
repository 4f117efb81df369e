"""`@tessera.function` reads its annotations however the user's module spells them."""
from __future__ import annotations

import numpy as np

import tessera as tsr
from tessera import Tensor


@tsr.function
def scaled(x: Tensor["M", "N"], y: Tensor["N"]):
    return x * 2.0 + y


def test_string_annotations_are_evaluated():
    """With `from __future__ import annotations` every annotation is a string; shapes still come from them."""
    (x, y) = scaled.arg_specs_for({"M": 3, "N": 5}, "fp32")
    assert (x.shape, y.shape) == ((3, 5), (5,))
    a, b = np.ones((3, 5), np.float32), np.arange(5, dtype=np.float32)
    np.testing.assert_allclose(scaled(a, b), a * 2 + b)


def test_only_hashable_calls_have_a_gpu_call_key():
    """The key of the GPU call memo: per CUDA tensor its shape, dtype and device, per number its
    type and value (1 and 1.0 differ), and the options; a NumPy array or a `space` dict has none."""
    class FakeCuda:
        is_cuda, shape, dtype, device = True, (2, 3), "float16", "cuda:0"

        def is_contiguous(self):
            return True

    key = tsr.Function._gpu_call_key
    assert key((FakeCuda(), 1), {"path": "ampere"}) == ((((2, 3), "float16", "cuda:0", True), (int, 1)),
                                                        (("path", "ampere"),))
    assert key((FakeCuda(), 1), {}) != key((FakeCuda(), 1.0), {})
    assert key((np.zeros(3),), {}) is None
    assert key((FakeCuda(),), {"space": {"block_m": [64]}}) is None
