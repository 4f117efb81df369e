"""How a Function hands repeated GPU calls to the launch fast path (runtime/fastcall.py), on the CPU:
its program and the C call are stand-ins, so what is tested is when a record is made, which call
tries which C call, and when a call falls back (tests/gpu/test_fastcall_gpu.py runs the real ones)."""
from __future__ import annotations

import sys

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.frontend import function as function_module
from tessera.frontend.captures import MISSING
from tessera.runtime import fastcall

SCALE = 2.0


class CudaLike:
    """What a Function's call key reads of a CUDA tensor."""

    is_cuda = True

    def __init__(self, rows: int):
        self.shape, self.dtype, self.device = (rows, 8), "f16", "cuda:0"

    def is_contiguous(self):
        return True


class Program:
    """A GPU program: counts its calls and the records asked of it."""

    def __init__(self):
        self.calls = self.records = 0

    def __call__(self, *inputs):
        self.calls += 1
        return ["general"]

    def fast_record(self, inputs, positions, values, out=None):
        self.records += 1
        return fastcall.Record(args=(), inputs=tuple(positions), allocs=(), n_results=1, stream=None, stream_arg=0,
                               context=0, encode=None, launches=())


class FakeCall:
    """The C call of a record: takes a call while its guarded variables hold the same objects (as
    cpp/fastcall.c checks) and its tensors have the record's rows."""

    def __init__(self, record, rows):
        self.record, self.rows = record, rows

    def __call__(self, x):
        globals_now = all(g[1].get(g[2], MISSING) is g[3] for g in self.record.guards if g[0] == "global")
        return "fast" if globals_now and x.shape[0] == self.rows else None


@pytest.fixture
def scaled(monkeypatch):
    """A function with a program for 3, 5, 7, 11 and 13 rows, and fast calls made by `FakeCall`."""
    def scale(x: Tensor["M", "N"]):
        return x * SCALE
    fn = tsr.function(scale)
    monkeypatch.setattr(function_module, "_torch_wanted", lambda grad: False)
    monkeypatch.setattr(fastcall, "_why_not", None)
    made = []

    def make(record):
        call = FakeCall(record, made_rows[-1])
        made.append(call)
        return call
    made_rows = []
    monkeypatch.setattr(fastcall, "make", make)
    fn.made, fn.made_rows = made, made_rows
    for rows in (3, 5, 7, 11, 13):
        fn._programs[fn._call_key((CudaLike(rows),), {})] = function_module._Known(Program(), (0,))
    return fn


def call(fn, rows, **options):
    fn.made_rows.append(rows)
    return fn(CudaLike(rows), **options)


def program(fn, rows, **options):
    return fn._programs[fn._call_key((CudaLike(rows),), options)].program


def test_the_second_call_makes_the_record_and_later_calls_run_in_c(scaled):
    # (the program is known already, as after a first call on the general path)
    assert call(scaled, 3) == "general" and program(scaled, 3).records == 1
    assert call(scaled, 3) == "fast" and program(scaled, 3).calls == 1
    assert program(scaled, 3).records == 1


def test_a_call_with_options_makes_no_record(scaled):
    """A call's options pick its program (tensor_cores=False, path=...); the C calls take calls
    without options only, so a record of a call with options would run for calls without them."""
    scaled._programs[scaled._call_key((CudaLike(3),), {"opt_level": 1})] = function_module._Known(Program(), (0,))
    assert call(scaled, 3, opt_level=1) == "general"
    assert call(scaled, 3, opt_level=1) == "general"
    assert program(scaled, 3, opt_level=1).records == 0 and not scaled._fast


def test_a_rebound_global_declines_and_the_record_is_made_again(scaled, monkeypatch):
    call(scaled, 3)
    first = scaled._fast[0]
    monkeypatch.setattr(sys.modules[__name__], "SCALE", SCALE + 0.0)   # another object, the same key
    assert call(scaled, 3) == "general"          # declined by its guard: the general path, same program
    assert scaled._fast[0] is not first and first not in scaled._fast
    assert call(scaled, 3) == "fast"


def test_the_c_calls_of_the_last_four_shapes_are_tried_most_recent_first(scaled):
    for rows in (3, 5, 7, 11, 13):
        call(scaled, rows)
    assert [c.rows for c in scaled._fast] == [13, 11, 7, 5]
    assert call(scaled, 5) == "fast" and call(scaled, 3) == "general"   # 3's was pushed out ...
    assert [c.rows for c in scaled._fast] == [3, 13, 11, 7]            # ... and comes back first


def test_a_record_past_the_c_modules_limits_is_dropped_for_good(scaled, monkeypatch):
    def refuse(record):
        raise ValueError("fastcall: too many tensor maps")
    monkeypatch.setattr(fastcall, "make", refuse)
    assert call(scaled, 3) == "general" and call(scaled, 3) == "general"
    assert not scaled._fast and program(scaled, 3).records == 1
