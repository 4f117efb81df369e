"""Index maps through views that add or remove size-1 dims (`index_maps.unit_reshape_map`)."""
import pytest

from tessera.errors import TesseraError
from tessera.ir.index_maps import unit_reshape_map


@pytest.mark.parametrize("view,m,source,expected", [
    ((2, 5, 1, 8), ("b0", "m", "b1", "d"), (2, 5, 8), ("b0", "m", "d")),       # a dim dropped
    ((4, 1, 1, 16), ("b0", "b1", "n", "d"), (4, 1, 16), ("b0", "n", "d")),     # k[:, None] of one key: the key axis
    ((1, 4, 1, 16), ("m", "b0", "b1", "d"), (1, 4, 16), ("m", "b0", "d")),     # one query, [T, H, D] -> [T, Hk, G, D]
    ((3, 7), ("m", "n"), (3, 1, 7), ("m", None, "n")),                          # a dim added walks no axis
    ((1,), ("m",), (1, 1), (None, "m")),
])
def test_size_one_dims_keep_the_axes_of_the_views_last_size_one_dims(view, m, source, expected):
    assert unit_reshape_map(view, m, source, {}) == expected


def test_other_reshapes_are_refused():
    with pytest.raises(TesseraError, match="only adding or removing size-1 dims"):
        unit_reshape_map((2, 6), ("m", "n"), (12,), {})
