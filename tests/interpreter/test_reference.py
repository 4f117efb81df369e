"""The Graph IR oracle: exact float64 evaluation from the dtype-rounded inputs (casts still round)."""
import ml_dtypes
import numpy as np

import tessera as tsr
from tessera import Tensor
from tessera.interpreter.reference import output_tolerances, run_graph, tolerance


@tsr.function
def cancel(x: Tensor["N"]):
    return (x * 256.0 + 1.0) - x * 256.0


@tsr.function
def cast_rounds(x: Tensor["N"]):
    return (x * 3.0).to(tsr.bf16).to(tsr.fp32) - x * 3.0


@tsr.function
def attention(q: Tensor["S", "D"], k: Tensor["S", "D"], v: Tensor["S", "D"]):
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(0, 1)), dim=-1), v).to(tsr.fp32)


def graph(fn, dims, dtype):
    return next(iter(fn.compile(fn.arg_specs_for(dims, dtype)).graph.ops))


def test_float_intermediates_stay_float64():
    x = np.full(4, 3.0, ml_dtypes.bfloat16)
    f = graph(cancel, {"N": 4}, "bf16")
    exact, = run_graph(f, [x])
    rounded, = run_graph(f, [x], exact=False)
    assert exact.dtype == ml_dtypes.bfloat16          # each result still has its dtype
    np.testing.assert_array_equal(exact.astype(np.float64), 1.0)      # 769 - 768
    np.testing.assert_array_equal(rounded.astype(np.float64), 0.0)    # 769 rounds to 768 in bf16


def test_casts_round():
    x = np.array([1.0 / 3.0, 0.1], np.float32)
    out, = run_graph(graph(cast_rounds, {"N": 2}, "fp32"), [x])
    want = (x * 3.0).astype(ml_dtypes.bfloat16).astype(np.float64) - x.astype(np.float64) * 3.0
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=1e-6)
    assert np.abs(out).max() > 1e-4   # the bf16 rounding is there


def test_output_tolerance_is_the_least_precise_dtype_and_the_reduction_length():
    tol, = output_tolerances(graph(attention, {"S": 100, "D": 16}, "fp16"))
    assert tol == tolerance("fp16", 16 + 100 + 100)   # Q @ K^T over D, softmax and P @ V over S
    tol, = output_tolerances(graph(cancel, {"N": 8}, "fp32"))
    assert tol == tolerance("fp32", 1)
