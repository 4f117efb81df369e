"""PyTorch's ops (issue 13, item 9) against NumPy in float64 on awkward shapes, how they fuse,
their torch semantics and their errors (their PTX: tests/backends/test_torch_ops_ptx.py)."""
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import emit_module
from tessera.errors import DTypeError, ShapeError

from torch_op_cases import CASES_BY_NAME, DTYPE_CASES, IDS, SHAPES, check, function, inputs, reference

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.values())))
@pytest.mark.parametrize("case,dt", DTYPE_CASES, ids=IDS)
def test_op_matches_numpy(case, dt, shape):
    fn = function(case, dt)
    arrays = inputs(case, dt, shape, np.random.default_rng(11))
    check(fn(*arrays), reference(case, arrays))


# --- torch's semantics -----------------------------------------------------------------------------

def _run(f, *arrays):
    return tsr.function(f)(*arrays)


def test_max_and_min_take_torch_forms():
    """max(x): a tensor; max(x, dim): (values, indices) with the first index of a tie; max(a, b): maximum."""
    x = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 0.5, 7.0]], np.float32)

    def f(x: Tensor["M", "N"]):
        r = tsr.max(x, 1)
        assert isinstance(r, tsr.ValuesIndices) and r.values is r[0]
        return tsr.max(x), r.values, r.indices, x.min(dim=0).indices, tsr.max(x, x[:, :1])
    top, values, indices, low, both = _run(f, x)
    assert float(top) == 7.0 and values.tolist() == [3.0, 7.0] and indices.tolist() == [1, 3]
    assert indices.dtype == np.int32 and low.tolist() == [0, 1, 1, 0]
    np.testing.assert_array_equal(both, np.maximum(x, x[:, :1]))


def test_argmax_of_a_row_with_nan_is_the_first_nan():
    x = np.array([[1.0, np.nan, 5.0, np.nan], [np.inf, 1.0, np.inf, 0.0]], np.float32)

    def f(x: Tensor["M", "N"]):
        return tsr.argmax(x, 1), tsr.argmin(x, 1)
    hi, lo = _run(f, x)
    assert hi.tolist() == [1, 0] and lo.tolist() == [1, 3]


def test_log_softmax_of_a_row_with_inf_is_nan_as_torch():
    x = np.array([[np.inf, 0, 1, 2], [0, 1, 2, 3], [-np.inf, -np.inf, 0, 1]], np.float32)

    def f(x: Tensor["M", "N"]):
        return tsr.log_softmax(x, -1)
    out = _run(f, x)
    assert np.isnan(out[0]).all() and np.isneginf(out[2, :2]).all()
    np.testing.assert_allclose(out[1], x[1] - np.log(np.exp(x[1]).sum()), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16", np.float16])
@pytest.mark.parametrize("n", [300, 20000], ids=["one_chunk", "chunked"])
def test_log_softmax_of_a_row_all_of_a_finite_fill_is_minus_log_n_as_torch(dtype, n):
    """A row all of finfo.min (a padding mask's fill) or -1e30: its logsumexp, the fill plus log N,
    rounds to the fill, and x - it was 0; torch's (x - max) - log(sum) gives -log N
    (`schedule_to_tile._log_softmax_differences`). x - logsumexp(x) written out keeps torch's
    order, and its result there, 0."""
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    rng = np.random.default_rng(36)
    x = (rng.standard_normal((5, n)) * 3).astype(dtype)
    x[1] = np.finfo(np.float32).min if dtype == np.float32 else ml_dtypes.finfo(dtype).min
    x[2, : n // 2] = -1e30 if dtype == np.float32 else ml_dtypes.finfo(dtype).min
    x[3] = -1e30 if dtype == np.float32 else -6e4

    def f(x: Tensor["M", "N"]):
        return tsr.log_softmax(x, -1), x - tsr.logsumexp(x, -1, keepdim=True)
    out, written = _run(f, x)
    x64 = x.astype(np.float64)
    want = (x64 - x64.max(-1, keepdims=True)) - np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1, keepdims=True))
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=tol, atol=tol)
    if dtype == np.float32:
        rounded = x64 - torch_logsumexp_fp32(x)
        np.testing.assert_allclose(written, rounded, rtol=tol, atol=tol)
        assert (written[1] == 0).all()


def torch_logsumexp_fp32(x):
    """torch.logsumexp of fp32 rows as torch computes it: max + log(sum(exp(x - max))), rounded to fp32."""
    x64 = x.astype(np.float64)
    m = x64.max(-1, keepdims=True)
    return (m + np.log(np.exp(x64 - m).sum(-1, keepdims=True))).astype(np.float32).astype(np.float64)


def test_a_difference_from_a_logsumexp_of_another_row_keeps_its_infinities():
    """y - logsumexp(x) where x's row holds +inf is -inf (the logsumexp is +inf), and x - l beside
    exp(l - x) both take the rounded l: only log_softmax's own difference is computed apart."""
    x = np.array([[np.inf, 1, 2, 3], [-3e38, -3e38, -3e38, -3e38]], np.float32)
    y = np.ones((2, 4), np.float32)

    def f(x: Tensor["M", "N"], y: Tensor["M", "N"]):
        lse = tsr.logsumexp(x, -1, keepdim=True)
        return y - lse, (x - lse) * tsr.exp(lse - x)
    shifted, product = _run(f, x, y)
    assert np.isneginf(shifted[0]).all()
    np.testing.assert_array_equal(product[1], np.zeros(4, np.float32))


def test_var_defaults_to_bessels_correction():
    x = np.random.default_rng(0).standard_normal((5, 9)).astype(np.float32)

    def f(x: Tensor["M", "N"]):
        return x.var(1), x.var(1, correction=0), tsr.std(x, 1, correction=1)
    v1, v0, s1 = _run(f, x)
    np.testing.assert_allclose(v1, x.astype(np.float64).var(1, ddof=1), rtol=1e-5)
    np.testing.assert_allclose(v0, x.astype(np.float64).var(1, ddof=0), rtol=1e-5)
    np.testing.assert_allclose(s1, x.astype(np.float64).std(1, ddof=1), rtol=1e-5)


@pytest.mark.parametrize("shape,dim,keepdim", [((7, 1000), -1, False), ((3, 5, 20000), -1, True), ((9, 13), 0, False),
                                               ((2, 3, 4), None, False)])
def test_var_mean_and_std_mean_are_torchs_in_one_row_kernel(shape, dim, keepdim):
    """torch.var_mean / std_mean: (var, mean), Bessel's correction by default; over the last dim one
    kernel, the mean written beside the variance (`fusion.merge_row_chains`)."""
    import torch
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)

    def f(x):
        v, m = tsr.var_mean(x, dim, keepdim=keepdim)
        s, m2 = tsr.std_mean(x, dim, correction=0, keepdim=keepdim)
        return v, m, s, m2
    got = [np.asarray(o, np.float64) for o in _run(f, x)]
    t = torch.tensor(x, dtype=torch.float64)
    kw = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    want = [*torch.var_mean(t, **kw), *torch.std_mean(t, correction=0, **kw)]
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_.reshape(w.shape), w.numpy(), rtol=1e-5, atol=1e-6)
    if dim == -1:
        from tessera.frontend.trace import ArgSpec
        single = tsr.function(lambda x: tsr.var_mean(x, -1, keepdim=keepdim))
        spec = ArgSpec("x", shape, tsr.bf16, tuple(f"d{i}" for i in range(len(shape))))
        names = single.compile([spec], arch="sm_90a", sm_count=132).kernel_names
        assert len(names) == 1, names


def test_var_of_one_element_is_nan_as_in_torch():
    def f(x: Tensor["M", "N"]):
        return x.var(1)
    out = _run(f, np.ones((3, 1), np.float32))
    assert np.isnan(out).all()


def test_logsumexp_of_infinite_rows():
    x = np.array([[-np.inf, -np.inf, -np.inf], [np.inf, 0.0, 1.0], [1000.0, 1000.0, -5.0]], np.float32)

    def f(x: Tensor["M", "N"]):
        return tsr.logsumexp(x, 1)
    out = _run(f, x)
    assert out[0] == -np.inf and out[1] == np.inf
    np.testing.assert_allclose(out[2], 1000.0 + np.log(2.0), rtol=1e-6)


def test_floor_division_and_remainder_round_down_as_python():
    a = np.array([[-7, 7, -7, 7, 0, -1]], np.int32)
    b = np.array([[2, -2, -2, 2, 3, 5]], np.int32)

    def f(a: Tensor["M", "N"], b: Tensor["M", "N"]):
        return a // b, a % b, a.float() // b.float(), a.float() % b.float()
    q, r, qf, rf = _run(f, a, b)
    assert q.tolist() == [[-4, -4, 3, 3, 0, -1]] and r.tolist() == [[1, -1, -1, 1, 0, 4]]
    assert qf.tolist() == q.tolist() and rf.tolist() == r.tolist()


def test_an_empty_dim_tuple_reduces_every_dim_as_torch():
    """dim=() is every dim (torch's), where a rank-1 input failed inside the compiler and a rank-2
    one came back unreduced."""
    def f(v: Tensor["K"], x: Tensor["M", "N"]):
        return tsr.sum(v, ()), tsr.sum(x, (), keepdim=True), tsr.amax(x, []), x.var(())
    v, x = np.arange(4, dtype=np.float32), np.arange(6, dtype=np.float32).reshape(2, 3)
    total, kept, top, var = _run(f, v, x)
    assert float(total) == 6.0 and kept.tolist() == [[15.0]] and float(top) == 5.0
    np.testing.assert_allclose(var, x.var(ddof=1), rtol=1e-6)


def test_integer_pow_is_torchs():
    """int ** int is int32 (it was float32), wrapping as int32 does, torch's values for negative
    exponents; a constant negative exponent of an int is refused, as torch refuses it."""
    x = np.array([2, -3, 5, 1, -1, 0, 46341, 7, -1, 2], np.int32)
    y = np.array([3, 2, 0, -4, -3, 5, 2, 31, -2, 40], np.int32)

    def f(x: Tensor["N"], y: Tensor["N"]):
        return x ** y, x ** 3 + 1, x ** 0.5
    p, cube, root = _run(f, x, y)
    assert p.dtype == np.int32 and cube.dtype == np.int32 and root.dtype == np.float32
    assert p.tolist() == [8, 9, 1, 1, -1, 0, -2147479015, 265001655, 1, 0]   # (torch 2.11's)
    assert cube.tolist() == [9, -26, 126, 2, 0, 1, -1932785794, 344, 0, 9]
    with pytest.raises(DTypeError, match="integers to negative integer powers are not allowed"):
        _run(lambda x: x ** -1, x)


def test_a_query_made_a_row_by_a_view_is_still_one_attention():
    """q[:, :, None, :] @ k^T (a decode step's query given as [B, H, D]): the view's unit dim is
    copied for the kernel's tiles, which read two dims of memory (it failed inside the compiler)."""
    def f(q: Tensor["B", "H", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
        return tsr.softmax(q[:, :, None, :] @ k.transpose(-1, -2) * 0.125, -1) @ v
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 64)).astype(np.float16)
    k, v = (rng.standard_normal((2, 3, 300, 64)).astype(np.float16) for _ in range(2))
    fn = tsr.function(f)
    s = q[:, :, None, :].astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(fn(q, k, v).astype(np.float64), p @ v.astype(np.float64), atol=2e-3)
    names = fn.compile(fn.arg_specs_for(dict(B=2, H=3, N=300, D=64), "fp16"), arch="sm_90a").kernel_names
    assert sum("flash_attention" in n for n in names) == 1, names


def test_float_floor_division_at_its_edges_is_numpys():
    """A remainder rounding to the divisor's magnitude stays (1e-8 // -1.5 was 0, 1e-8 % -1.5 was
    0), infinite dividends give NaN (inf // 1.5, inf % inf were inf), x // 0 is x / 0."""
    x = np.array([1e-8, 1.5, np.inf, np.inf, -np.inf, 1.0, 7, -7, 1.0, 0.0, np.nan, 5.0, 3.0, -1e-8], np.float32)
    y = np.array([-1.5, -3.4e38, 1.5, np.inf, -2.0, 0.1, np.inf, np.inf, 0.0, 0.0, 1.0, np.nan, 1.5, 1.5], np.float32)

    def f(x: Tensor["N"], y: Tensor["N"]):
        return x // y, x % y
    q, r = _run(f, x, y)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(q, np.floor_divide(x, y))
        np.testing.assert_array_equal(r, np.remainder(x, y))


#: dividends and divisors whose quotients pass 2^24 (x - floor(x / y) * y was 7.95 for 1e9 % 3.3, -1
#: for 3e8 % 7), past the float range (3e38 / 1e-38), and subnormal ones
LARGE_QUOTIENTS = (np.array([1e9, 3e8, 123456789.0, -1e9, 7.5e7, 3e38, -3e38, 1e-45, 2.5e-40, 16777217.0, 1e30, 0.75],
                            np.float32),
                   np.array([3.3, 7.0, 0.1, 3.3, -1.7, 1e-38, 7.1e-3, 3e-45, 7e-45, 3.0, -1.1, 1e-44], np.float32))


def test_float_floor_division_past_two_to_the_24_is_exact():
    """Float `%` is C's fmod, exact (`tile.RemFOp`), moved by the divisor where their signs
    differ, and `//` is built on it as torch's: NumPy's results bit for bit, on the CPU."""
    def f(x: Tensor["N"], y: Tensor["N"]):
        return x // y, x % y
    x, y = LARGE_QUOTIENTS
    q, r = _run(f, x, y)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(q, np.floor_divide(x, y))
        np.testing.assert_array_equal(r, np.remainder(x, y))


# --- fusion ----------------------------------------------------------------------------------------

def _kinds(fn, dims, dtype="fp16"):
    compiled = fn.compile(fn.arg_specs_for(dims, dtype))
    schedule = compiled.ir("schedule")
    return [line.split('"')[3] for line in schedule.splitlines() if "schedule.kernel" in line]


def test_clamp_and_masked_fill_fuse_into_a_gemm_epilogue():
    @tsr.function
    def f(a: Tensor["M", "K"], b: Tensor["K", "N"], m: Tensor["M", "N", tsr.bool_]):
        return (a @ b).clamp(-1.0, 1.0).masked_fill(m, 0.0)
    assert _kinds(f, dict(M=77, K=64, N=45)) == ["gemm"]


def test_masked_fill_and_clamp_are_attention_score_modifications():
    @tsr.function
    def f(q: Tensor["B", "S", "D"], k: Tensor["B", "S", "D"], v: Tensor["B", "S", "D"]):
        s = (q @ k.mT).clamp(-30.0, 30.0)
        i = tsr.arange(q.shape[1])
        s = s.masked_fill(i[:, None] < i[None, :], -float("inf"))
        return tsr.softmax(s, -1) @ v
    assert _kinds(f, dict(B=2, S=100, D=64)) == ["flash_attention"]


def test_alibi_with_integer_abs_is_one_attention_kernel():
    @tsr.function
    def f(q: Tensor["B", "S", "D"], k: Tensor["B", "S", "D"], v: Tensor["B", "S", "D"]):
        i = tsr.arange(q.shape[1])
        s = q @ k.mT - tsr.abs(i[:, None] - i[None, :]).to(q.dtype) * 0.5
        return tsr.softmax(s, -1) @ v
    assert _kinds(f, dict(B=2, S=100, D=64)) == ["flash_attention"]
    compiled = f.compile(f.arg_specs_for(dict(B=2, S=100, D=64), "fp16"), arch="sm_80")
    assert all("abs.s32" in k.ptx for k in emit_module(compiled.modules["target"]).values())


def test_log_softmax_is_one_row_reduction():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return tsr.log_softmax(x, -1)
    kinds = _kinds(f, dict(M=7, N=1000))
    assert kinds.count("row_reduction") == 1 and set(kinds) <= {"row_reduction", "elementwise"}


def test_tril_and_expand_read_no_mask_from_memory():
    """The triangle's mask is two aranges and expand a broadcast: one kernel each, inputs only x."""
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x.tril(-1) + 1.0, x[None].expand(4, -1, -1) * 2.0
    assert _kinds(f, dict(M=7, N=13)) == ["elementwise", "elementwise"]


def test_cat_along_a_free_dim_is_one_kernel_writing_both_halves():
    @tsr.function
    def f(x: Tensor["M", "N"], y: Tensor["M", "K"]):
        return tsr.cat([tsr.exp(x), y * 2.0], -1)
    assert _kinds(f, dict(M=7, N=13, K=5)) == ["elementwise"]


def test_slices_fuse_into_a_reduction_prologue_but_never_an_epilogue():
    """A window reads other elements than its own, so it fuses where its operand is loaded (a
    row reduction's prologue reads x shifted) but not into a GEMM's epilogue (registers hold only
    the output tile): there it reads the GEMM's result from memory."""
    @tsr.function
    def prologue(x: Tensor["M", "N"]):
        return tsr.softmax(x[:, 3:] * 2.0, -1)

    @tsr.function
    def epilogue(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return (a @ b)[:, 1:] * 2.0
    assert _kinds(prologue, dict(M=7, N=1000)) == ["row_reduction"]
    assert _kinds(epilogue, dict(M=77, K=64, N=45)) == ["gemm", "elementwise"]
    a, b = (np.random.default_rng(2).standard_normal(s).astype(np.float32) for s in ((77, 64), (64, 45)))
    np.testing.assert_allclose(epilogue(a, b), (a.astype(np.float64) @ b)[:, 1:] * 2.0, rtol=1e-4, atol=1e-4)


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,error,match", [
    (lambda x: x.expand(3, 5), ShapeError, r"dim 0 of x \[M=7, N=13\] has size 7"),
    (lambda x: x.flatten(1, 0), ShapeError, "start_dim 1 comes after end_dim 0"),
    (lambda x: tsr.einsum("ij,jk->ik", x, x[:, :1]), ShapeError, "index 'j'"),
    (lambda x: tsr.einsum("ii->i", x), ShapeError, "diagonals"),
    (lambda x: x.to(tsr.int32).var(), DTypeError, "var of int32"),
    (lambda x: x.masked_fill(x, 0.0), DTypeError, "mask must be a bool"),
    (lambda x: (x > 0) - (x < 0), DTypeError, "sub of bool"),
    (lambda x: -(x > 0), DTypeError, "neg of bool"),
    (lambda x: x.tril().sum(0).tril(), ShapeError, "at least 2 dims"),
    (lambda x: tsr.clamp(x), ValueError, "at least one of min and max"),
    (lambda x: x[:, 20], ShapeError, r"index 20 is out of range for dim 1 of x \[M=7, N=13\]"),
    (lambda x: x[3:3], ShapeError, "selects nothing from dim 0"),
    (lambda x: x[::-1], ShapeError, "steps must be positive"),
    (lambda x: tsr.cat([x, x.T], 1), ShapeError, "tensor 1 .* does not match tensor 0"),
    (lambda x: tsr.stack([x, x[1:]]), ShapeError, "stack: the tensors' shapes differ"),
])
def test_mistakes_are_reported_in_the_users_terms(body, error, match):
    def f(x: Tensor["M", "N"]):
        return body(x)
    fn = tsr.function(f)
    with pytest.raises(error, match=match):
        fn.trace(fn.arg_specs_for(dict(M=7, N=13)))


def test_every_new_op_is_exported():
    for name in ["cat", "stack", "clamp", "clip", "masked_fill", "tril", "triu", "einsum", "var", "std", "var_mean", "std_mean",
                 "log_softmax", "logsumexp", "argmax", "argmin", "flatten", "expand", "floor_divide",
                 "remainder", "max", "min"]:
        assert name in tsr.__all__ and callable(getattr(tsr, name))
