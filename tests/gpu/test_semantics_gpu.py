"""Issue 13 on the GPU: zero-size dims launch nothing and come back shaped, stores read in program
order (a kernel reading an output it writes too), captured values re-trace, and results come back
in the inputs' kind (torch CUDA and CPU, CuPy)."""
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.frontend.zero_size import ZeroSizeCall

SCALE = 0.25


@tsr.function
def bias_relu(x: Tensor["S", "D"], b: Tensor["D"]):
    return tsr.relu(x * 2.0 + b)


@tsr.function
def matmul(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return a @ b


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    return tsr.softmax(q @ k.transpose(-2, -1) * 0.125, dim=-1) @ v


@tsr.kernel
def matmul_into(a: Tensor["M", "K"], b: Tensor["K", "N"], c: Tensor["M", "N"]):
    c[:] = a @ b


@tsr.kernel
def accumulate(a: Tensor["M", "M"], c: Tensor["M", "M"]):
    c[:] = c @ a


@tsr.kernel
def store_then_read(a: Tensor["M", "N"], b: Tensor["M", "N"], c: Tensor["M", "N"]):
    b[:] = a * 2.0
    c[:] = a * 2.0
    c[:] = c + b


@tsr.function
def scaled(x: Tensor["S", "D"]):
    return x * SCALE


def cuda(torch, shape, dtype=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype or torch.float16)


def relative_error(out, ref) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / max(ref64.norm(), 1e-30))


# --- zero-size dims ---------------------------------------------------------------------------

def test_zero_size_elementwise(torch_cuda):
    torch = torch_cuda
    x, b = cuda(torch, (0, 64)), cuda(torch, (64,))
    out = bias_relu(x, b)
    assert out.is_cuda and out.shape == (0, 64) and out.dtype == torch.float16
    assert bias_relu(x, b).shape == (0, 64)   # again, through the remembered program


@pytest.mark.parametrize("shape", [(1, 4, 0, 64), (0, 4, 128, 64)])
def test_zero_size_attention(torch_cuda, shape):
    torch = torch_cuda
    q = cuda(torch, shape)
    out = attention(q, q, q)
    assert out.is_cuda and tuple(out.shape) == shape and out.dtype == torch.float16
    assert all(isinstance(c, ZeroSizeCall) for c in attention._cache.values())   # nothing compiled


@pytest.mark.parametrize("m,k,n", [(0, 64, 128), (128, 64, 0), (128, 0, 64)])
def test_zero_size_matmul(torch_cuda, m, k, n):
    torch = torch_cuda
    out = matmul(cuda(torch, (m, k)), cuda(torch, (k, n)))
    assert out.is_cuda and tuple(out.shape) == (m, n) and out.dtype == torch.float16
    assert torch.equal(out, torch.zeros(m, n, device="cuda", dtype=torch.float16))   # K = 0: zeros


def test_zero_size_kernel_writes_zeros_over_an_empty_k(torch_cuda):
    torch = torch_cuda
    c = torch.full((64, 32), float("nan"), device="cuda", dtype=torch.float16)
    matmul_into(cuda(torch, (64, 0)), cuda(torch, (0, 32)), c)
    torch.cuda.synchronize()
    assert torch.equal(c, torch.zeros_like(c))


@tsr.function
def decode_projection(h: Tensor["B", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(h[:, None, :] @ w + b)


@pytest.mark.parametrize("rows", [1, 7, 1000])
@pytest.mark.parametrize("k", [64, 4097])
def test_rows_of_one_element_times_a_matrix(torch_cuda, rows, k):
    """[B, 1, K] @ [K, N] through a view that adds the unit axis: one GEMM over the B rows (then
    the epilogue), checked against float64."""
    torch = torch_cuda
    h, w, b = cuda(torch, (rows, k), seed=1), cuda(torch, (k, 96), seed=2) / k ** 0.5, cuda(torch, (96,), seed=3)
    want = torch.nn.functional.gelu((h.double()[:, None, :] @ w.double()) + b.double())
    out = decode_projection(h, w, b)
    assert out.shape == (rows, 1, 96) and torch.isfinite(out).all() and relative_error(out, want) < 5e-3


# --- stores ------------------------------------------------------------------------------------

def test_a_kernel_reading_the_output_it_writes(torch_cuda):
    """`c[:] = c @ a` reads the old c: blocks must not see tiles others already overwrote."""
    torch = torch_cuda
    a, c = cuda(torch, (256, 256), seed=1), cuda(torch, (256, 256), seed=2)
    expected = c.float() @ a.float()
    accumulate(a, c)
    torch.cuda.synchronize()
    assert relative_error(c, expected) < 1e-2
    c2 = cuda(torch, (256, 256), seed=3)
    expected = c2.float() @ a.float()
    accumulate(a, c2)   # the remembered program, through the same copies
    torch.cuda.synchronize()
    assert relative_error(c2, expected) < 1e-2


def test_reads_after_stores_see_them(torch_cuda):
    torch = torch_cuda
    a = cuda(torch, (100, 70))
    b = torch.full_like(a, float("nan"))
    c = torch.full_like(a, float("nan"))
    store_then_read(a, b, c)
    torch.cuda.synchronize()
    assert relative_error(b, a.float() * 2) < 1e-3
    assert relative_error(c, a.float() * 4) < 1e-3


# --- captured values -------------------------------------------------------------------------

def test_a_changed_global_retraces_on_the_gpu_call_path(torch_cuda):
    global SCALE
    torch = torch_cuda
    x = cuda(torch, (64, 64))
    first = scaled(x)
    SCALE = 0.5
    try:
        second = scaled(x)
    finally:
        SCALE = 0.25
    third = scaled(x)
    torch.cuda.synchronize()
    assert relative_error(first, x.float() * 0.25) < 1e-3
    assert relative_error(second, x.float() * 0.5) < 1e-3
    assert relative_error(third, x.float() * 0.25) < 1e-3


# --- results in kind ---------------------------------------------------------------------------

def test_torch_cuda_in_torch_cuda_out(torch_cuda):
    torch = torch_cuda
    x, b = cuda(torch, (33, 64)), cuda(torch, (64,))
    out = bias_relu(x, b)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    assert relative_error(out, torch.relu(x.float() * 2 + b.float())) < 1e-2


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_cpu_in_torch_cpu_out(dtype):
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    x = torch.randn(9, 16).to(dt)
    b = torch.randn(16).to(dt)
    out = bias_relu(x, b)
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dtype == dt
    assert relative_error(out, torch.relu(x.float() * 2 + b.float())) < 2e-2


def test_a_kernel_writes_torch_cpu_outputs():
    torch = pytest.importorskip("torch")
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    c = torch.full((8, 4), float("nan"))
    matmul_into(a, b, c)
    assert relative_error(c, a @ b) < 1e-5


def test_cupy_in_cupy_out(cuda_device):
    cupy = pytest.importorskip("cupy")
    x = cupy.asarray(np.random.default_rng(0).standard_normal((33, 64)).astype(np.float16))
    b = cupy.asarray(np.random.default_rng(1).standard_normal(64).astype(np.float16))
    out = bias_relu(x, b)
    assert isinstance(out, cupy.ndarray)
    expected = np.maximum(cupy.asnumpy(x).astype(np.float32) * 2 + cupy.asnumpy(b).astype(np.float32), 0)
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float32), expected, rtol=1e-2, atol=1e-2)
    empty = bias_relu(cupy.zeros((0, 64), np.float16), b)
    assert isinstance(empty, cupy.ndarray) and empty.shape == (0, 64)


@tsr.function
def by_mask(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
            mask: Tensor["B", 1, "S", "S"]):
    return tsr.softmax(q @ k.transpose(-2, -1) * 0.125 + mask, dim=-1) @ v


def _padded_queries(torch, s, dt):
    """q, k, v [2, 3, s, 64] and a causal `keep` whose first 9 query rows keep nothing (padding)."""
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(2, 3, s, 64, device="cuda", generator=gen, dtype=dt) for _ in range(3))
    keep = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    keep[:9] = False
    return q, k, v, keep


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("s", [130, 1024])
def test_rows_a_finite_fill_masks_whole_average_v_as_torch(torch_cuda, dtype, additive, s):
    """HuggingFace's masks fill with torch.finfo(dtype).min; a padding query's row, masked whole,
    averages V in torch (each fill minus the max is 0), where Tessera's attention and row softmax
    gave 0 / 0 (`schedule_to_tile._softmax_step`): filled by `where` or added as a mask tensor; at
    1024 keys on 6 heads the attention splits its keys (each split's max and log sum kept apart)."""
    torch = torch_cuda
    dt = getattr(torch, dtype)
    fill = torch.finfo(dt).min

    @tsr.function
    def by_where(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
                 keep: Tensor["S", "S"]):
        s_ = tsr.where(keep, q @ k.transpose(-2, -1) * 0.125, fill)
        return tsr.softmax(s_, dim=-1) @ v, tsr.softmax(tsr.where(keep, q[0, 0] @ k[0, 0].T, fill), -1)

    q, k, v, keep = _padded_queries(torch, s, dt)
    keep[s // 2] = False
    scores = (q.double() @ k.double().transpose(-2, -1)) * 0.125
    if additive:
        mask = torch.zeros(2, 1, s, s, device="cuda", dtype=dt).masked_fill(~keep, fill)
        out = by_mask(q, k, v, mask)
        ref = torch.softmax(scores + mask.double(), -1) @ v.double()
    else:
        out, rows = by_where(q, k, v, keep)
        ref = torch.softmax(scores.masked_fill(~keep, fill), -1) @ v.double()
        rows_ref = torch.softmax((q[0, 0] @ k[0, 0].T).double().masked_fill(~keep, fill), -1)   # (scores in dt)
        assert not torch.isnan(rows).any()
        torch.testing.assert_close(rows.double(), rows_ref, atol=2e-2 if dtype == "bfloat16" else 2e-3, rtol=0)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=4e-2 if dtype == "bfloat16" else 4e-3, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("s", [130, 1024])
def test_gradients_through_rows_a_finite_fill_masks_whole_are_torchs(torch_cuda, dtype, s):
    """The backward of an attention whose padding rows an additive finfo.min mask fills whole, with
    a cotangent on those rows: the forward saves each row's max apart from the log-sum-exp of the
    scores less it (`autodiff.backward.may_hold_huge_fill`), so P there is 1/N as in torch (the
    log-sum-exp alone, the fill plus log N, rounded to the fill and P was 1)."""
    torch = torch_cuda
    dt = getattr(torch, dtype)
    fill = torch.finfo(dt).min

    q, k, v, keep = _padded_queries(torch, s, dt)
    mask = torch.zeros(2, 1, s, s, device="cuda", dtype=dt).masked_fill(~keep, fill)
    d_out = torch.randn(2, 3, s, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1), dtype=dt)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    by_mask(*ours, mask).backward(d_out)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    scores = exact[0] @ exact[1].transpose(-2, -1) * 0.125 + mask.double()
    (torch.softmax(scores, -1) @ exact[2]).backward(d_out.double())
    for mine, want in zip(ours, exact):
        assert not torch.isnan(mine.grad).any()
        scale = want.grad.abs().max().item()
        torch.testing.assert_close(mine.grad.double(), want.grad, atol=(3e-2 if dtype == "bfloat16" else 4e-3) * scale,
                                   rtol=0)



@tsr.function
def floor_division(x: Tensor["N"], y: Tensor["N"]):
    return x // y, x % y


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_float_floor_division_is_torchs_bit_for_bit(torch_cuda, dtype):
    """Float `%` (an exact fmod, each element's long division a loop of its own in PTX) and `//`
    as torch computes them on the GPU: quotients past 2^24 and the float range, subnormals, zeros,
    infinities and random values, in fp32 and (computed in fp32, rounded) bf16 / fp16."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
    from test_torch_ops import LARGE_QUOTIENTS
    torch = torch_cuda
    inf = float("inf")
    edges_x = [1e-8, 1.5, inf, -inf, 1.0, 7.0, -7.0, 0.0, -0.0, 5.0, 3.0, 2.5]
    edges_y = [-1.5, -3.4e38, 1.5, -2.0, 0.1, inf, inf, 3.0, 5.0, 0.0, -1e-45, 2.5]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand_x = (torch.randn(4000, device="cuda", generator=gen) * 10 ** torch.randint(-3, 9, (4000,), device="cuda",
                                                                                     generator=gen)).tolist()
    rand_y = (torch.randn(4000, device="cuda", generator=gen) * 10 ** torch.randint(-3, 3, (4000,), device="cuda",
                                                                                     generator=gen)).tolist()
    x = torch.tensor(LARGE_QUOTIENTS[0].tolist() + edges_x + rand_x, device="cuda").to(getattr(torch, dtype))
    y = torch.tensor(LARGE_QUOTIENTS[1].tolist() + edges_y + rand_y, device="cuda").to(getattr(torch, dtype))
    q, r = floor_division(x, y)
    want_q, want_r = torch.floor_divide(x, y), torch.remainder(x, y)
    for got, want in ((q, want_q), (r, want_r)):
        same = (got == want) | (got.isnan() & want.isnan())
        assert bool(same.all()), [(a, b, g, w) for a, b, g, w in zip(x[~same].tolist(), y[~same].tolist(),
                                                                     got[~same].tolist(), want[~same].tolist())][:8]
