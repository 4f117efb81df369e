"""The CPU tile interpreter honours device_asserts (message, source line, block, element) and
records profile regions (host nanoseconds, reported like a GPU's cycles)."""
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import DeviceAssertError
from tessera.interpreter.reference import run_graph


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


@tsr.function
def positive(x: Tensor["M", "N"]):
    y = x * 2.0
    tsr.device_assert(y > 0, "x must be positive")  # elementwise assert
    return y + 1.0


def test_a_failing_assert_names_message_line_block_and_element():
    x = np.ones((40, 300), np.float32)
    x[20, 200] = -1.0      # default 16 x 128 tiles: program (1, 1, 0), element (4, 72) of its tile
    with pytest.raises(DeviceAssertError) as failure:
        positive(x)
    err = failure.value
    assert err.user_message == "x must be positive"
    assert err.location == f"{__file__}:{line_of('elementwise assert')}"
    assert (err.block, err.element) == ((1, 1, 0), (4, 72))
    for part in ("x must be positive", f"{__file__}:{line_of('elementwise assert')}", "(1, 1, 0)", "(4, 72)"):
        assert part in str(err)


def test_a_holding_assert_is_silent_even_on_the_padding_of_tail_tiles():
    x = np.random.default_rng(0).random((37, 301)).astype(np.float32) + 0.5   # tiles reach past both dims
    np.testing.assert_allclose(positive(x), 2 * x + 1, rtol=1e-6)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    c = tsr.matmul(a, b)
    tsr.device_assert(c < 100.0, "product too large")
    return tsr.relu(c)


@tsr.function
def norm(x: Tensor["M", "N"], w: Tensor["N"]):
    y = tsr.rms_norm(x, (x.shape[-1],), w)
    tsr.device_assert(y < 10.0, "normalized")
    return y


@tsr.function
def ordered(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    tsr.device_assert(x <= y, "ordered")
    return x + y


@tsr.kernel
def scale(x: Tensor["M", "N"], out: Tensor["M", "N"]):
    tsr.device_assert(x == x, "no NaN")
    out[:] = x * 3.0


@pytest.mark.parametrize("call, bad", [
    (lambda x, bad: gemm(x, np.eye(70, 20, dtype=np.float32) * (1e3 if bad else 1.0)), True),
    (lambda x, bad: norm(x, np.full(70, 1e3 if bad else 1.0, np.float32)), True),
    (lambda x, bad: ordered(x, x - 1.0 if bad else x + 1.0), True),
    (lambda x, bad: scale(np.where(bad, np.nan, x).astype(np.float32), np.empty_like(x)), True),
])
def test_asserts_fire_in_every_kind_of_kernel(call, bad):
    x = np.abs(np.random.default_rng(1).standard_normal((33, 70))).astype(np.float32) + 0.1
    call(x, False)
    with pytest.raises(DeviceAssertError):
        call(x, True)


def test_the_graph_oracle_checks_asserts_too():
    x = -np.ones((4, 5), np.float32)
    compiled = positive.compile(positive.arg_specs_for({"M": 4, "N": 5}, "fp32"))
    with pytest.raises(DeviceAssertError, match="x must be positive"):
        run_graph(next(iter(compiled.graph.ops)), [x])


@tsr.function
def profiled(a: Tensor["M", "K"], b: Tensor["K", "N"], x: Tensor["M", "N"]):
    with tsr.profile_region("matmul"):
        c = tsr.matmul(a, b)
    with tsr.profile_region("activation"):
        y = tsr.gelu(c)
    with tsr.profile_region("softmax"):
        return tsr.softmax(y * x, dim=-1)


def test_profile_regions_are_reported_per_kernel_on_the_cpu():
    rng = np.random.default_rng(0)
    a, b, x = (rng.standard_normal(s).astype(np.float32) for s in ((100, 64), (64, 70), (100, 70)))
    tsr.reset_profile()
    out = profiled(a, b, x, profile=True)
    np.testing.assert_allclose(out, profiled(a, b, x), rtol=1e-5)
    report = tsr.profile_report()
    # the activation is fused into the softmax's kernel (as its prologue): its region goes with it
    assert {k: [r.label for r in p.regions] for k, p in report.items()} == {
        "profiled_gemm_0": ["matmul"], "profiled_row_reduction_1": ["softmax", "activation"]}
    for kernel in report.values():
        assert kernel.unit == "ns" and kernel.median > 0
        assert kernel.blocks == {"profiled_gemm_0": 1, "profiled_row_reduction_1": 4}[kernel.kernel]
        for region in kernel.regions:
            assert 0 < region.share <= 1 and 0 <= region.begin < region.end
    assert "matmul" in str(report) and "%" in str(report)


def test_without_profiling_kernels_have_no_stamps():
    compiled = profiled.compile(profiled.arg_specs_for({"M": 8, "K": 16, "N": 8}, "fp32"))
    assert not any("profile" in op.name for op in compiled.modules["tile"].walk())
