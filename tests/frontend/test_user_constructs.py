"""What a user can write either works or fails with one line naming their argument or dim, at their
line (issue 13, items 3, 4, 6 and 7): return annotations, zero-size dims, NumPy on traced tensors,
scalar and misplaced arguments, results in the inputs' kind."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import ArgumentKindError, DTypeError, ShapeError, TesseraError
from tessera.frontend.zero_size import ZeroSizeCall

THIS_FILE = __file__


def line_of(marker: str) -> int:
    lines = open(THIS_FILE).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def located_at(info, marker: str) -> bool:
    return info.value.location == f"{THIS_FILE}:{line_of(marker)}"


# --- return annotations ---------------------------------------------------------------------

def test_returned_dims_are_checked_against_the_annotation():
    @tsr.function
    def scores(q: Tensor["S", "D"], k: Tensor["S", "D"]) -> Tensor["S", "D"]:  # scores-def
        return q @ k.T

    q = np.ones((8, 4), np.float32)
    with pytest.raises(ShapeError, match=r"annotated Tensor\['S', 'D'\] but is \[S=8, S=8\]: dim 1 is 8 "
                                         r"where the annotation says D=4") as info:
        scores(q, q)
    assert located_at(info, "scores-def")


def test_returned_dtype_is_checked_against_the_annotation():
    @tsr.function
    def f(x: Tensor["S", "D"]) -> Tensor["S", "D", "fp16"]:  # fp16-def
        return x * 2

    with pytest.raises(DTypeError, match="annotated fp16 but is fp32") as info:
        f(np.ones((2, 3), np.float32))
    assert located_at(info, "fp16-def")


def test_annotated_results_count_and_rank():
    @tsr.function
    def pair(x: Tensor["S", "D"]) -> tuple[Tensor["S", "D"], Tensor["S"]]:
        return x * 2, x.sum(-1)

    @tsr.function
    def rank(x: Tensor["S", "D"]) -> Tensor["S"]:
        return x * 2

    @tsr.function
    def count(x: Tensor["S", "D"]) -> tuple[Tensor["S", "D"], Tensor["S"]]:
        return x * 2

    x = np.ones((2, 3), np.float32)
    assert [r.shape for r in pair(x)] == [(2, 3), (2,)]
    with pytest.raises(ShapeError, match=r"annotated Tensor\['S'\] \(rank 1\) but is \[S=2, D=3\] \(rank 2\)"):
        rank(x)
    with pytest.raises(ShapeError, match="annotated to return 2 tensor"):
        count(x)


def test_a_dim_only_the_annotation_names_binds_to_the_result():
    @tsr.function
    def flat(x: Tensor["S", "D"]) -> Tensor["N"]:
        return x.reshape(-1)

    assert flat(np.ones((2, 3), np.float32)).shape == (6,)


# --- zero-size dims ------------------------------------------------------------------------------

def test_zero_size_elementwise_returns_an_empty_result_without_compiling():
    @tsr.function
    def f(x: Tensor["S", "D"], w: Tensor["D"]):
        return x * 2 + w

    out = f(np.zeros((0, 4), np.float16), np.ones(4, np.float16))
    assert out.shape == (0, 4) and out.dtype == np.float16
    assert all(isinstance(c, ZeroSizeCall) for c in f._cache.values())


def test_zero_size_attention_is_empty():
    @tsr.function
    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        return tsr.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v

    for shape in [(1, 2, 0, 64), (0, 2, 16, 64)]:
        q = np.zeros(shape, np.float16)
        out = attention(q, q, q)
        assert out.shape == shape and out.dtype == np.float16


def test_a_matmul_over_an_empty_k_is_zeros():
    @tsr.function
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return a @ b, a.sum(-1)

    out, sums = mm(np.zeros((3, 0), np.float16), np.zeros((0, 5), np.float16))
    np.testing.assert_array_equal(out, np.zeros((3, 5), np.float16))
    np.testing.assert_array_equal(sums, np.zeros(3, np.float16))


def test_a_zero_size_kernel_writes_its_outputs():
    @tsr.kernel
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"], c: Tensor["M", "N"]):
        c[:] = a @ b

    c = np.full((3, 5), 7.0, np.float32)
    mm(np.zeros((3, 0), np.float32), np.zeros((0, 5), np.float32), c)
    np.testing.assert_array_equal(c, np.zeros((3, 5)))
    empty = np.zeros((0, 5), np.float32)
    mm(np.zeros((0, 2), np.float32), np.zeros((2, 5), np.float32), empty)


def test_a_max_over_an_empty_dim_is_an_error_not_a_value():
    @tsr.function
    def f(x: Tensor["S", "D"]):
        return x.max(0)

    with pytest.raises(TesseraError, match="zero-size"):
        f(np.zeros((0, 4), np.float32))


def test_compiling_a_zero_size_dim_says_why_not():
    @tsr.function
    def f(x: Tensor["S", "D"]):
        return x * 2

    with pytest.raises(ShapeError, match=r"argument 'x' \[0, 4\] has a zero-size dim"):
        f.compile(f.arg_specs_for({"S": 0, "D": 4}, "fp32"))


# --- NumPy on traced tensors, and arguments -----------------------------------------------------------

def test_numpy_ufuncs_and_functions_become_tessera_ops():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        y = np.exp(x) + np.maximum(x, 0.0) * np.float32(2) + np.sqrt(np.abs(x)) - np.log(np.abs(x) + 1)
        return np.where(x > 0, y, np.tanh(x)) + np.sum(np.minimum(x, 1.0), axis=-1, keepdims=True)

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    y = np.exp(x) + np.maximum(x, 0) * 2 + np.sqrt(np.abs(x)) - np.log(np.abs(x) + 1)
    np.testing.assert_allclose(f(x), np.where(x > 0, y, np.tanh(x)) + np.minimum(x, 1).sum(-1, keepdims=True),
                               rtol=1e-5)


def test_an_unsupported_numpy_function_is_refused_at_its_line():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return np.cumsum(x)  # np-cumsum

    with pytest.raises(TesseraError, match="np.cumsum on a traced tensor") as info:
        f(np.ones((2, 3), np.float32))
    assert located_at(info, "np-cumsum")


def test_a_numpy_array_in_an_op_is_refused_at_its_line():
    weights = np.ones(3, np.float32)

    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x * weights  # captured-array

    with pytest.raises(ArgumentKindError, match=r"got a ndarray of shape \(3,\)") as info:
        f(np.ones((2, 3), np.float32))
    assert located_at(info, "captured-array")


def test_numpy_scalars_and_0d_arrays_are_constants():
    @tsr.function
    def f(x: Tensor["N"], alpha):
        return x * alpha

    x = np.ones(4, np.float32)
    np.testing.assert_array_equal(f(x, np.float32(3)), x * 3)
    np.testing.assert_array_equal(f(x, np.array(4.0)), x * 4)


def test_a_number_for_a_tensor_argument_names_it():
    @tsr.function
    def fa(q: Tensor["S", "D"], k: Tensor["S", "D"], v: Tensor["S", "D"]):
        return tsr.softmax(q @ k.T, dim=-1) @ v

    k = np.ones((4, 8), np.float16)
    with pytest.raises(ArgumentKindError, match=r"fa: argument 'q' is annotated Tensor\['S', 'D'\] but got a "
                                                r"float \(1.0\)") as info:
        fa(1.0, k, k)  # number-for-q
    assert located_at(info, "number-for-q")
    with pytest.raises(ArgumentKindError, match="argument 'k' is annotated .* but got a 0-d ndarray"):
        fa(k, np.array(2.0, np.float16), k)


def test_an_object_argument_names_it():
    @tsr.function
    def f(x: Tensor["N"], alpha):
        return x * alpha

    with pytest.raises(ArgumentKindError, match="argument 'alpha' must be an array, a number"):
        f(np.ones(4, np.float32), object())


# --- results in the inputs' kind --------------------------------------------------------------------

class FakeTorchDtype:
    """What interop reads of a torch dtype: its module and its name."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class FakeTorchTensor:
    """A torch CPU tensor as far as Tessera looks at one (torch itself is not installed here)."""

    def __init__(self, array):
        self.array = array

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: FakeTorchDtype(str(self.array.dtype)))
    is_cuda = False

    def detach(self):
        return self

    def numpy(self):
        return self.array

    def data_ptr(self):
        return self.array.ctypes.data

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def is_contiguous(self):
        return self.array.flags.c_contiguous


@pytest.fixture
def fake_torch(monkeypatch):
    module = types.ModuleType("torch")
    module.from_numpy = FakeTorchTensor
    for cls in (FakeTorchTensor, FakeTorchDtype):
        monkeypatch.setattr(cls, "__module__", "torch")
    monkeypatch.setitem(sys.modules, "torch", module)
    return module


def test_torch_cpu_tensors_come_back_as_torch_tensors(fake_torch):
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x * 2, x.sum(-1)

    x = FakeTorchTensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    doubled, sums = f(x)
    assert isinstance(doubled, FakeTorchTensor) and isinstance(sums, FakeTorchTensor)
    np.testing.assert_array_equal(doubled.array, x.array * 2)
    np.testing.assert_array_equal(sums.array, x.array.sum(-1))


def test_a_kernel_writes_torch_cpu_outputs_in_place(fake_torch):
    @tsr.kernel
    def k(x: Tensor["M", "N"], out: Tensor["M", "N"]):
        out[:] = x + 1

    x = FakeTorchTensor(np.ones((2, 3), np.float32))
    out = FakeTorchTensor(np.zeros((2, 3), np.float32))
    k(x, out)
    np.testing.assert_array_equal(out.array, 2)


def test_numpy_in_numpy_out():
    @tsr.function
    def f(x: Tensor["N"]):
        return x * 2

    assert type(f(np.ones(3, np.float32))) is np.ndarray


def test_a_kernel_output_must_be_writable():
    @tsr.kernel
    def k(x: Tensor["N"], out: Tensor["N"]):
        out[:] = x

    out = np.zeros(3, np.float32)
    out.flags.writeable = False
    with pytest.raises(TesseraError, match="output 'out' must be a writable"):
        k(np.ones(3, np.float32), out)


# --- the GPU side of zero-size calls, on a stand-in for CuPy -----------------------------------------

class FakeCupyArray:
    """Host memory behind `__cuda_array_interface__`, as far as Tessera's interop reads a CuPy array."""

    device = types.SimpleNamespace(id=0)

    def __init__(self, array):
        self.array = np.ascontiguousarray(array)

    shape = property(lambda self: self.array.shape)
    dtype = property(lambda self: self.array.dtype)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.array.shape, "typestr": self.array.dtype.str, "strides": None, "version": 3,
                "data": (self.array.ctypes.data if self.array.size else 0, False)}

    def get(self):
        return self.array.copy()

    def set(self, array):
        self.array[...] = array

    def __setitem__(self, index, value):
        self.array[index] = value.array


@pytest.fixture
def fake_cupy(monkeypatch):
    module = types.ModuleType("cupy")
    module.empty = lambda shape, dtype: FakeCupyArray(np.empty(shape, dtype))
    module.cuda = types.SimpleNamespace(Device=lambda ordinal: __import__("contextlib").nullcontext())
    monkeypatch.setattr(FakeCupyArray, "__module__", "cupy")
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def zero_size_program(fn, *inputs):
    """`fn`'s ZeroSizeCall for these (host) inputs, loaded as a GPU call would load it."""
    _, specs = fn.arg_specs([(name, x) for name, x in zip(fn.signature.parameters, inputs)])
    return ZeroSizeCall(fn.trace(specs)).gpu_program(0)


def test_a_zero_size_gpu_call_allocates_in_the_inputs_framework(fake_cupy):
    @tsr.function
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return a @ b

    a, b = np.zeros((0, 4), np.float16), np.ones((4, 5), np.float16)
    (out,) = zero_size_program(mm, a, b)(FakeCupyArray(a), FakeCupyArray(b))
    assert isinstance(out, FakeCupyArray) and out.shape == (0, 5) and out.dtype == np.float16


def test_a_zero_size_gpu_call_copies_non_empty_results_to_the_device(fake_cupy):
    @tsr.function
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return a @ b

    a, b = np.zeros((3, 0), np.float16), np.zeros((0, 5), np.float16)
    program = zero_size_program(mm, a, b)
    (out,) = program(FakeCupyArray(a), FakeCupyArray(b))
    np.testing.assert_array_equal(out.array, np.zeros((3, 5)))
    target = FakeCupyArray(np.full((3, 5), np.nan, np.float16))
    program(FakeCupyArray(a), FakeCupyArray(b), out=[target])
    np.testing.assert_array_equal(target.array, np.zeros((3, 5)))


def test_a_kernel_reading_its_output_writes_through_fresh_arrays(fake_cupy):
    """`_OutputsThroughCopies`: the program runs into fresh arrays, copied into `out` afterwards."""
    from tessera.frontend.function import _OutputsThroughCopies

    fresh = FakeCupyArray(np.arange(4, dtype=np.float32))
    calls = []

    def program(*inputs, out=None):
        calls.append(out)
        return [fresh]

    target = FakeCupyArray(np.zeros(4, np.float32))
    assert _OutputsThroughCopies(program)(FakeCupyArray(np.ones(4, np.float32)), out=[target]) == [target]
    assert calls == [None]
    np.testing.assert_array_equal(target.array, fresh.array)


def test_a_float64_argument_is_refused_by_name():
    @tsr.function
    def double(x: Tensor["N"]):
        return x * 2.0
    with pytest.raises(tsr.DTypeError, match="double: argument 'x' is float64, which Tessera does not compute in"):
        double(np.ones(3))


def test_int_inputs_and_scalars_at_the_edges_of_int32():
    """relu of an int stays an int (torch); a norm of ints and an int constant past int32 are
    refused by name, not by the IR verifier; a NumPy integer indexes as an int."""
    ints = np.array([-2, 3], np.int32)
    out = tsr.function(lambda x: tsr.relu(x))(ints)
    assert out.dtype == np.int32 and out.tolist() == [0, 3]
    with pytest.raises(tsr.DTypeError, match="layer_norm of int32"):
        tsr.function(lambda x: tsr.layer_norm(x, (2,)))(ints[None])
    with pytest.raises(tsr.DTypeError, match="the integer 1099511627776 does not fit int32"):
        tsr.function(lambda x: x + 2 ** 40)(ints)
    assert tsr.function(lambda x: x + (2 ** 31 - 4))(ints).tolist() == [2 ** 31 - 6, 2 ** 31 - 1]

    @tsr.function
    def row(x: Tensor["M", "N"]):
        return x[np.int32(1)] * 2.0
    np.testing.assert_allclose(row(np.arange(6, dtype=np.float32).reshape(2, 3)), [6.0, 8.0, 10.0])


def test_the_extreme_of_bools_is_a_bool_and_their_sum_a_count():
    """As torch: amax / amin of bool tensors are bool (any / all); a sum counts (int32 here)."""
    x = np.array([[True, False], [False, False]])
    top, low, count = tsr.function(lambda x: (tsr.amax(x, 1), tsr.amin(x, 1), tsr.sum(x, 1)))(x)
    assert top.dtype == bool and top.tolist() == [True, False] and low.tolist() == [False, False]
    assert count.dtype == np.int32 and count.tolist() == [1, 0]


def test_float_floor_division_and_remainder_are_torchs():
    """1.0 // 0.1 is 9 (1 / 0.1 rounds to 10) and 1.0 % 0.1 is 0.1 - ulp, not a negative
    remainder; by an infinite divisor the remainder is x or the divisor, as torch's."""
    a = np.array([1.0, 3.0, -7.0, 7.0, -1.0, 5.5, -5.5, 0.0, 7.0], np.float32)
    b = np.array([0.1, 0.3, np.inf, np.inf, 0.3, -2.0, 2.0, 3.0, -np.inf], np.float32)
    q, r = tsr.function(lambda a, b: (a // b, a % b))(a, b)
    np.testing.assert_array_equal(q, [9, 9, -1, 0, -4, -3, -3, 0, -1])
    exact = (a.astype(np.float64) - q.astype(np.float64) * b.astype(np.float64)).astype(np.float32)   # (one rounding)
    np.testing.assert_array_equal(r[[0, 1, 4, 5, 6, 7]], exact[[0, 1, 4, 5, 6, 7]])
    np.testing.assert_array_equal(r[[2, 3, 8]], [np.inf, 7.0, -np.inf])
    assert r[0] > 0 and r[1] > 0


def test_a_column_sum_over_a_dim_of_one_feeds_its_epilogue():
    """sum(x, 0, keepdim=True) + x with M = 1: the sum's [1, N] and x's [M, N] are one shape (the
    fuzzer's program; the epilogue's check compared the dims' names)."""
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return tsr.sum(x, dim=0, keepdim=True) + x
    x = np.array([[0.5, -2.0]], np.float16)
    np.testing.assert_array_equal(f(x), [[1.0, -4.0]])
