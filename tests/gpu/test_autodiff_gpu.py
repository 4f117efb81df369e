"""`tsr.vjp` and `tsr.grad` on CUDA tensors: the backward graph compiled to PTX, against torch autograd
in float64 on the same inputs (the fused attention backward's own cases: test_attention_backward_gpu.py)."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor


@tsr.function
def softcapped_causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                                v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = 20.0 * tsr.tanh(s * (1.0 / 20.0))
    i = tsr.arange(s.shape[-2])
    j = tsr.arange(s.shape[-1])
    s = tsr.where(i[:, None] >= j[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def norm_mlp(x: Tensor["N", "C"], w: Tensor["C"], a: Tensor["C", "F"]):
    return tsr.matmul(tsr.silu(tsr.rms_norm(x, (x.shape[-1],), w)), a)


def torch_softcapped_causal_attention(torch, q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = 20.0 * torch.tanh(s / 20.0)
    causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1) @ v


def torch_norm_mlp(torch, x, w, a):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    return torch.nn.functional.silu(y) @ a


def rel(torch, got, want) -> float:
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), "NaN in a gradient"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fn,reference,shapes", [
    (softcapped_causal_attention, torch_softcapped_causal_attention, [(1, 2, 17, 64)] * 3),
    (softcapped_causal_attention, torch_softcapped_causal_attention, [(2, 1, 100, 128)] * 3),
    (norm_mlp, torch_norm_mlp, [(37, 64), (64,), (64, 96)]),
], ids=["attention-S17-D64", "attention-S100-D128", "rms_norm-silu-matmul"])
def test_vjp_on_cuda_tensors_matches_torch_autograd(torch_cuda, dtype, fn, reference, shapes):
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(7)
    args = [torch.randn(s, device="cuda", generator=gen).to(getattr(torch, dtype)) for s in shapes]
    out, f_vjp = tsr.vjp(fn, *args)
    cotangent = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    grads = f_vjp(cotangent)
    exact = [a.double().requires_grad_() for a in args]
    want_out = reference(torch, *exact)
    want = torch.autograd.grad(want_out, exact, cotangent.double())
    tol = 2e-2 if dtype == "bfloat16" else 5e-3
    assert out.is_cuda and rel(torch, out, want_out.detach()) < tol
    for g, w in zip(grads, want):
        assert g.is_cuda and g.dtype == out.dtype and g.shape == w.shape
        assert rel(torch, g, w) < 2 * tol


def test_grad_of_a_scalar_loss_on_cuda(torch_cuda):
    torch = torch_cuda

    @tsr.function
    def loss(x: Tensor["N", "C"], w: Tensor["C"]):
        return tsr.mean(tsr.tanh(tsr.layer_norm(x, (x.shape[-1],)) * w))

    x = torch.randn(64, 200, device="cuda", dtype=torch.float32)
    w = torch.randn(200, device="cuda", dtype=torch.float32)
    dx, dw = tsr.grad(loss, argnums=(0, 1))(x, w)
    xe, we = x.double().requires_grad_(), w.double().requires_grad_()
    torch.tanh(torch.nn.functional.layer_norm(xe, (200,)) * we).mean().backward()
    assert rel(torch, dx, xe.grad) < 1e-4 and rel(torch, dw, we.grad) < 1e-4
    assert np.isfinite(dx.cpu().numpy()).all()
