"""`@tessera.function` reads its annotations however the user's module spells them."""
from __future__ import annotations

import numpy as np
import pytest

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


def test_keyword_arguments_bind_to_parameters_and_others_are_refused():
    """A keyword naming a parameter is that argument (`opt_level=5` was taken as the compile's
    option, silently, and `scale=3.0` failed inside compile_module); one naming neither a
    parameter nor a call option is a TypeError that lists both."""
    @tsr.function
    def f(x: Tensor["N"], scale: float = 1.0, opt_level: int = 1):
        return x * scale * opt_level
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(f(x, opt_level=5), x * 5)
    np.testing.assert_array_equal(f(x, scale=3.0), x * 3)
    np.testing.assert_array_equal(f(x=x, scale=2.0, opt_level=2), x * 4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus': its parameters are x, scale, opt_level"):
        f(x, bogus=1)
    with pytest.raises(TypeError, match="multiple values for argument 'scale'"):
        f(x, 2.0, scale=3.0)
    np.testing.assert_array_equal(f(x, 2.0, space={"block_n": [64]}), x * 2)   # (an option still)
