"""Stores mean what they mean in NumPy: later reads, and views taken before, see them (issue 13, item 1)."""
from __future__ import annotations

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import ShapeError, TesseraError
from tessera.frontend.function import _reads_an_output

A = np.arange(12, dtype=np.float32).reshape(3, 4)


def run_kernel(kernel, *inputs, outputs=1):
    """Calls a @kernel on `inputs` plus `outputs` zeroed arrays; returns the outputs."""
    outs = [np.zeros_like(inputs[0]) for _ in range(outputs)]
    kernel(*inputs, *outs)
    return outs[0] if outputs == 1 else outs


def test_a_read_after_a_whole_store_sees_it():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = A * 2
        C[:] = C + 1

    np.testing.assert_array_equal(run_kernel(k, A), A * 2 + 1)


def test_a_read_of_another_stored_output_sees_the_new_value():
    @tsr.kernel
    def k(A: Tensor["M", "N"], B: Tensor["M", "N"], C: Tensor["M", "N"]):
        B[:] = A * 2
        C[:] = B + 1

    B = np.full_like(A, 100.0)
    C = np.zeros_like(A)
    k(A, B, C)
    np.testing.assert_array_equal(B, A * 2)
    np.testing.assert_array_equal(C, A * 2 + 1)


def test_a_read_before_a_store_sees_the_old_contents():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = C * 10 + A

    C = np.ones_like(A)
    k(A, C)
    np.testing.assert_array_equal(C, 10 + A)


def test_partial_stores_in_program_order():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = A
        C[1] = 5.0
        C[:, 2:4] = A.sum(1, keepdim=True)
        C[..., -1] = 0
        C[-1, 0] = -3.0
        C[:] = C + 1

    expected = A.copy()
    expected[1] = 5.0
    expected[:, 2:4] = A.sum(1, keepdims=True)
    expected[..., -1] = 0
    expected[-1, 0] = -3.0
    np.testing.assert_array_equal(run_kernel(k, A), expected + 1)


def test_a_view_taken_before_a_store_sees_it():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        old_t = C.T
        rows = C[:, None, :]
        C[:] = A * 3
        C[:] = old_t.T + rows.reshape(C.shape[0], C.shape[1])

    np.testing.assert_array_equal(run_kernel(k, A), A * 6)


def test_a_window_taken_before_a_store_sees_it():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        first_row = C[0]
        C[:] = A
        C[:] = C + first_row

    np.testing.assert_array_equal(run_kernel(k, A), A + A[0])


def test_a_store_into_a_window_is_refused():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = A
        C[0][:] = 5.0  # store-into-window

    with pytest.raises(TesseraError, match="store into a view of C") as info:
        run_kernel(k, A)
    assert info.value.location.endswith(f":{_line_of('store-into-window')}")


def test_in_place_operators_store():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = A
        C += A
        C *= 2.0

    np.testing.assert_array_equal(run_kernel(k, A), A * 4)


def test_a_scalar_store_broadcasts():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[:] = 0.5
        C[:] = C + A.sum(0)

    np.testing.assert_array_equal(run_kernel(k, A), 0.5 + np.broadcast_to(A.sum(0), A.shape))


def test_function_stores_are_functional():
    """`x[:] = x * 2; return x` returns the doubled x; the caller's array is left alone."""
    @tsr.function
    def f(x: Tensor["M", "N"]):
        x[:] = x * 2
        return x

    x = A.copy()
    np.testing.assert_array_equal(f(x), A * 2)
    np.testing.assert_array_equal(x, A)


def test_function_store_reaches_views():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        t = x.T
        x[0] = 1.0
        return t

    expected = A.copy()
    expected[0] = 1.0
    np.testing.assert_array_equal(f(A), expected.T)


def test_a_store_into_a_view_is_refused_at_its_line():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C.T[:] = A.T  # store-into-view

    with pytest.raises(TesseraError, match="store into a view of C") as info:
        run_kernel(k, A)
    assert info.value.location.endswith(f":{_line_of('store-into-view')}")


def test_a_varying_value_into_part_of_a_dim_is_refused():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[0:2, :] = A[:, :] * 1.0  # partial-varying

    with pytest.raises(ShapeError, match="dim 0 .M=3.") as info:
        run_kernel(k, A)
    assert info.value.location.endswith(f":{_line_of('partial-varying')}")


def test_a_value_varying_along_part_of_a_dim_is_refused():
    """Placing a varying value at an offset needs a shift no op expresses: refused, not misplaced."""
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[1:3, :] = tsr.arange(2)[:, None] * 1.0  # partial-shift

    with pytest.raises(TesseraError, match="varies along dim 0 .M=3. but fills only part of it") as info:
        run_kernel(k, A)
    assert info.value.location.endswith(f":{_line_of('partial-shift')}")


def test_a_stepped_slice_store_is_refused():
    @tsr.kernel
    def k(A: Tensor["M", "N"], C: Tensor["M", "N"]):
        C[::2] = 1.0

    with pytest.raises(TesseraError, match="step"):
        run_kernel(k, A)


def test_an_unread_value_compiles_to_no_kernel():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        tsr.exp(x)
        return x * 2

    compiled = f.compile(f.arg_specs_for({"M": 4, "N": 8}, "fp32"))
    assert len(compiled.kernel_names) == 1


def test_kernels_that_read_an_output_they_write_are_known():
    """On a GPU such a kernel writes to fresh arrays copied into its outputs after (blocks of a
    GEMM would otherwise read C tiles that others already overwrote)."""
    @tsr.kernel
    def accumulate(A: Tensor["M", "M"], C: Tensor["M", "M"]):
        C[:] = C @ A

    @tsr.kernel
    def plain(A: Tensor["M", "M"], C: Tensor["M", "M"]):
        C[:] = A @ A

    specs = accumulate.arg_specs_for({"M": 64}, "fp16")
    assert _reads_an_output(accumulate.compile(specs))
    assert not _reads_an_output(plain.compile(specs))


def _line_of(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def test_a_kernel_may_store_one_value_into_two_outputs():
    """B[:] = A * 2; C[:] = B: each output gets the value (a copy), where the host function
    refused to return one value twice."""
    @tsr.kernel
    def twice(A: Tensor["M", "N"], B: Tensor["M", "N"], C: Tensor["M", "N"]):
        B[:] = A * 2
        C[:] = B
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b, c = np.zeros_like(a), np.zeros_like(a)
    twice(a, b, c)
    np.testing.assert_array_equal(b, a * 2)
    np.testing.assert_array_equal(c, a * 2)
