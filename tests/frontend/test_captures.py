"""Captured Python values are part of the compile key, or refused by name (issue 13, item 2)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import ArgumentKindError
from tessera.frontend.captures import Captures, freeze

X = np.ones(4, np.float32)
scale = 0.1
OFFSET = 1.0
TABLE = np.arange(4, dtype=np.float32)
BIG = np.zeros(10_000, np.float32)


def test_a_changed_global_retraces():
    global scale

    @tsr.function
    def f(x: Tensor["N"]):
        return x * scale

    np.testing.assert_allclose(f(X), X * 0.1)
    scale = 0.2
    try:
        np.testing.assert_allclose(f(X), X * 0.2)
    finally:
        scale = 0.1
    np.testing.assert_allclose(f(X), X * 0.1)
    assert len({id(c) for c in f._cache.values()}) == 2   # back to 0.1: the first compile again


def test_a_changed_closure_variable_retraces():
    factor = 2.0

    @tsr.function
    def f(x: Tensor["N"]):
        return x * factor

    np.testing.assert_allclose(f(X), X * 2)
    factor = 3.0
    np.testing.assert_allclose(f(X), X * 3)


def _add_offset(x):
    return x + OFFSET


def test_a_global_read_by_a_helper_function_retraces():
    global OFFSET

    @tsr.function
    def f(x: Tensor["N"]):
        return _add_offset(x)

    np.testing.assert_allclose(f(X), X + 1)
    OFFSET = 5.0
    try:
        np.testing.assert_allclose(f(X), X + 5)
    finally:
        OFFSET = 1.0


def test_a_config_objects_attribute_retraces():
    @dataclasses.dataclass
    class Config:
        scale: float

    cfg = Config(2.0)

    @tsr.function
    def f(x: Tensor["N"]):
        return x * cfg.scale

    np.testing.assert_allclose(f(X), X * 2)
    cfg.scale = 4.0
    np.testing.assert_allclose(f(X), X * 4)


def test_a_small_captured_array_is_keyed_by_its_contents():
    @tsr.function
    def f(x: Tensor["N"]):
        return x * float(TABLE[1])

    np.testing.assert_allclose(f(X), X * 1)
    TABLE[1] = 7.0
    try:
        np.testing.assert_allclose(f(X), X * 7)
    finally:
        TABLE[1] = 1.0


def test_a_large_captured_array_is_refused_by_name():
    @tsr.function
    def f(x: Tensor["N"]):
        return x * float(BIG[0])

    with pytest.raises(ArgumentKindError, match="f reads global 'BIG', which is an array of 40000 bytes"):
        f(X)


def test_default_arguments_are_constants_of_the_key():
    @tsr.function
    def f(x: Tensor["N"], alpha=2.0, mode="scale"):
        return x * alpha if mode == "scale" else x + alpha

    np.testing.assert_allclose(f(X), X * 2)
    np.testing.assert_allclose(f(X, 3.0), X * 3)
    np.testing.assert_allclose(f(X, 3.0, "shift"), X + 3)


def test_constants_are_keyed_by_type_and_bits():
    """2 and 2.0 trace differently (an int tensor times a float is float), and so do 0.0 and -0.0
    (1 / -0.0 is -inf); a NaN constant is found again rather than compiled on every call."""
    @tsr.function
    def scale(x: Tensor["N"], s):
        return x * s

    ints = np.arange(4, dtype=np.int32)
    assert scale(ints, 2).dtype == np.int32 and scale(ints, 2.0).dtype == np.float32

    @tsr.function
    def reciprocal(x: Tensor["N"], s):
        return 1.0 / (x * s)

    assert (reciprocal(X, 0.0) == np.inf).all() and (reciprocal(X, -0.0) == -np.inf).all()
    for _ in range(3):
        assert np.isnan(reciprocal(X, float("nan"))).all()
    assert reciprocal.cache_info().compiles == 3


SIGN = 0.0


def test_a_captured_zero_that_changes_sign_retraces():
    global SIGN

    @tsr.function
    def f(x: Tensor["N"]):
        return 1.0 / (x * SIGN)

    assert (f(X) == np.inf).all()
    SIGN = -0.0
    try:
        assert (f(X) == -np.inf).all()
    finally:
        SIGN = 0.0


def test_what_the_key_holds():
    """Numbers by type and value, modules and functions by identity, containers item by item."""
    assert freeze(1, "v") != freeze(1.0, "v") != freeze(True, "v")
    assert freeze(np, "v") is np
    assert freeze([1, (2.0, "a")], "v") == freeze([1, (2.0, "a")], "v")
    assert freeze({"s": 0.1}, "v") != freeze({"s": 0.2}, "v")
    assert freeze(slice(1, 3), "v") == freeze(slice(1, 3), "v")
    hash(freeze(slice(1, 3), "v"))


def test_the_key_reads_only_the_globals_the_code_names():
    def f(x):
        return tsr.exp(x) * scale

    assert Captures(f).key() == (tsr, (float, (0.1).hex()))   # `exp` is an attribute; `x` a local


class Knobs:
    GAIN = 2.0


def test_an_attribute_of_a_module_or_class_the_code_reads_is_keyed(tmp_path, monkeypatch):
    """`cfg.FACTOR` and `Knobs.GAIN`: a changed value re-traces (the module and class themselves
    are keyed by identity, their attributes by value)."""
    (tmp_path / "capture_cfg.py").write_text("FACTOR = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import capture_cfg

    @tsr.function
    def f(x: Tensor["N"]):
        return x * capture_cfg.FACTOR + x * Knobs.GAIN + tsr.exp(x) * 0.0

    np.testing.assert_allclose(f(X), X * 4)
    try:
        capture_cfg.FACTOR, Knobs.GAIN = 3.0, 5.0
        np.testing.assert_allclose(f(X), X * 8)
        np.testing.assert_allclose(f(X), X * 8)
        assert f.cache_info().compiles == 2 and f.cache_info().hits == 1
    finally:
        Knobs.GAIN = 2.0
    labels = [v.label for v in f.captures._plan]
    assert "f reads capture_cfg.FACTOR" in labels and "f reads Knobs.GAIN" in labels
    assert not any("tsr.exp" in label for label in labels)   # (Tessera's own attributes: constants)


class _Inner:
    def __init__(self, scale):
        self.scale, self.sizes = scale, [1, 2]


class _Config:
    def __init__(self):
        self.inner = _Inner(2.0)


CONFIG = _Config()
LOOKUP = {"m": _Inner(3.0)}


def test_an_object_inside_a_config_object_or_a_dict_is_keyed_by_its_attributes():
    """cfg.inner.scale and D["m"].scale: changing them re-traces (they were keyed by identity)."""
    @tsr.function
    def f(x: Tensor["N"]):
        return x * CONFIG.inner.scale + x * LOOKUP["m"].scale
    np.testing.assert_allclose(f(X), X * 5)
    CONFIG.inner.scale, LOOKUP["m"].scale = 4.0, 6.0
    try:
        np.testing.assert_allclose(f(X), X * 10)
    finally:
        CONFIG.inner.scale, LOOKUP["m"].scale = 2.0, 3.0


class _Outer:
    class Sub:
        G = 2.0


GAIN = 3.0
ACTIVATIONS = {"scaled": lambda x: x * GAIN}


def test_an_attribute_of_a_class_inside_a_class_is_keyed():
    """Knobs.Sub.G: a changed value re-traces, and so does a nested class rebound."""
    @tsr.function
    def f(x: Tensor["N"]):
        return x * _Outer.Sub.G
    np.testing.assert_allclose(f(X), X * 2)
    original = _Outer.Sub
    try:
        _Outer.Sub.G = 5.0
        np.testing.assert_allclose(f(X), X * 5)

        class Other:
            G = 7.0
        _Outer.Sub = Other
        np.testing.assert_allclose(f(X), X * 7)
    finally:
        _Outer.Sub = original
        original.G = 2.0
    assert "f reads _Outer.Sub.G" in [v.label for v in f.captures._plan]


def test_a_global_a_lambda_in_a_table_reads_retraces():
    """A lambda held in a dict the function reads: its own globals are part of the key, and a
    lambda put in the table's place is looked into again."""
    global GAIN

    @tsr.function
    def f(x: Tensor["N"]):
        return ACTIVATIONS["scaled"](x)
    np.testing.assert_allclose(f(X), X * 3)
    try:
        GAIN = 4.0
        np.testing.assert_allclose(f(X), X * 4)
        ACTIVATIONS["scaled"] = lambda x: x * OFFSET * GAIN
        np.testing.assert_allclose(f(X), X * 4)   # (OFFSET is 1.0)
        GAIN = 6.0
        np.testing.assert_allclose(f(X), X * 6)
    finally:
        GAIN = 3.0
        ACTIVATIONS["scaled"] = lambda x: x * GAIN


FUNCTIONS: list = []
G = 2.0


def test_a_table_empty_when_first_read_is_looked_into_once_it_holds_a_function():
    """A list that held no function when the plan was made, then one reading a global: a changed
    global re-traces (the plan is made again when the table's functions change)."""
    global G

    @tsr.function
    def f(x: Tensor["N"]):
        return FUNCTIONS[0](x) if FUNCTIONS else x
    np.testing.assert_allclose(f(X), X)
    try:
        FUNCTIONS[:] = [lambda x: x * G]
        np.testing.assert_allclose(f(X), X * 2)
        G = 7.0
        np.testing.assert_allclose(f(X), X * 7)
    finally:
        FUNCTIONS.clear()
        G = 2.0
