"""The attention backward on CUDA tensors (issue 14, item 4): `flash_chain` kernels that recompute
the scores per block (no S x S tensor in memory), for score modifications written as plain math,
against torch autograd in float64 on the same inputs."""
import math

import pytest

import tessera as tsr
from tessera import Tensor


def _scores(q, k):
    return tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))


@tsr.function
def plain(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
    return tsr.matmul(tsr.softmax(_scores(q, k), dim=-1), v)


@tsr.function
def causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = _scores(q, k)
    i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= j[None, :], s, -math.inf), dim=-1), v)


@tsr.function
def alibi(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = _scores(q, k)
    i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
    return tsr.matmul(tsr.softmax(s - (0.0625 * tsr.abs(i[:, None] - j[None, :])).to(s.dtype), dim=-1), v)


@tsr.function
def softcap_causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = 20.0 * tsr.tanh(_scores(q, k) * (1.0 / 20.0))
    i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= j[None, :], s, -math.inf), dim=-1), v)


def torch_reference(torch, kind, q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i = torch.arange(s.shape[-2], device=s.device)[:, None]
    j = torch.arange(s.shape[-1], device=s.device)[None, :]
    if kind == "softcap_causal":
        s = 20.0 * torch.tanh(s / 20.0)
    if kind == "alibi":
        s = s - 0.0625 * (i - j).abs()
    if kind in ("causal", "softcap_causal"):
        s = s.masked_fill(i < j, -math.inf)
    return torch.softmax(s, dim=-1) @ v


FUNCTIONS = {"plain": plain, "causal": causal, "alibi": alibi, "softcap_causal": softcap_causal}


def rel(torch, got, want) -> float:
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), "NaN in a gradient"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind,q_shape,kv_len", [
    ("plain", (1, 2, 17, 64), 17),
    ("plain", (2, 2, 100, 64), 1000),      # cross attention: 100 queries, 1000 keys
    ("causal", (2, 3, 1000, 128), 1000),
    ("causal", (1, 1, 4097, 64), 4097),
    ("alibi", (1, 2, 257, 128), 257),
    ("softcap_causal", (1, 2, 1000, 64), 1000),
])
def test_attention_backward_matches_torch_autograd(torch_cuda, dtype, kind, q_shape, kv_len):
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, h, m, d = q_shape
    shapes = [q_shape, (b, h, kv_len, d), (b, h, kv_len, d)]
    q, k, v = (torch.randn(s, device="cuda", generator=gen).to(getattr(torch, dtype)) for s in shapes)
    out, f_vjp = tsr.vjp(FUNCTIONS[kind], q, k, v)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    grads = f_vjp(d_out)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(torch_reference(torch, kind, *exact), exact, d_out.double())
    tol = 4e-2 if dtype == "bfloat16" else 1e-2
    for name, got, w in zip("qkv", grads, want):
        assert got.is_cuda and got.dtype == q.dtype and got.shape == w.shape
        assert rel(torch, got, w) < tol, f"d{name}"


def test_attention_backward_through_torch_autograd(torch_cuda):
    """loss.backward() through a Tessera attention runs the same kernels (torch_autograd's op)."""
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 513, 64, device="cuda", generator=gen, dtype=torch.float16).requires_grad_()
               for _ in range(3))
    causal(q, k, v).float().square().sum().backward()
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    torch_reference(torch, "causal", *exact).float().square().sum().backward()
    for x, e in zip((q, k, v), exact):
        assert rel(torch, x.grad, e.grad) < 1e-2
