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
