"""Tessera functions in torch autograd and torch.compile on CUDA tensors: the forward and the
backward (the `Derivative` ops of `tessera/frontend/torch_autograd.py`) run as compiled PTX; the
gradients are checked against torch autograd in float64 on the same inputs."""
from __future__ import annotations

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx.types import UnsupportedByBackend
from torch_autograd_cases import (
    CASES, block, float64_twins, gelu_mlp, leaves, rel, rms_norm_matmul, softcapped_causal_attention,
    torch_rms_norm_matmul,
)

GPU_SHAPES = {
    "attention-causal-softcap": [(2, 2, 100, 64)] * 3,
    "rms_norm-matmul": [(37, 64), (64,), (64, 96)],
    "gelu-mlp": [(33, 64), (64, 128), (128,), (128, 64)],
}
TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2, "float32": 1e-4}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name,fn,reference,shapes", CASES, ids=[c[0] for c in CASES])
def test_backward_on_cuda_matches_torch_autograd(torch_cuda, dtype, name, fn, reference, shapes):
    torch = torch_cuda
    args = leaves(torch, GPU_SHAPES[name], getattr(torch, dtype), "cuda", seed=1)
    out = fn(*args)
    assert out.is_cuda and out.dtype == args[0].dtype and "tessera" in type(out.grad_fn).__name__
    cotangent = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    out.backward(cotangent.to(out.dtype))
    exact = float64_twins(args)
    want = reference(torch, *exact)
    want.backward(cotangent.to(out.dtype).double())
    tol = TOLERANCE[dtype]
    assert rel(torch, out.detach(), want.detach()) < tol
    for a, e in zip(args, exact):
        assert a.grad.is_cuda and a.grad.dtype == a.dtype and a.grad.shape == a.shape
        assert rel(torch, a.grad, e.grad) < 2 * tol, f"{name}: gradient of an input of shape {tuple(a.shape)}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chained_functions_and_a_subset_requiring_grad_on_cuda(torch_cuda, dtype):
    """x is data; the parameters of two chained Tessera functions get their gradients from one
    loss.backward()."""
    torch = torch_cuda
    dt = getattr(torch, dtype)
    x = torch.randn(40, 64, device="cuda").to(dt)
    w, a = leaves(torch, [(64,), (64, 64)], dt, "cuda", seed=3, scale=0.5)
    w1, b1, w2 = leaves(torch, [(64, 128), (128,), (128, 64)], dt, "cuda", seed=4, scale=0.2)
    loss = gelu_mlp(torch.tanh(rms_norm_matmul(x, w, a)), w1, b1, w2).float().square().mean()
    loss.backward()
    assert x.grad is None
    exact = float64_twins([w, a, w1, b1, w2])
    we, ae, w1e, b1e, w2e = exact
    h = torch.tanh(torch_rms_norm_matmul(torch, x.double(), we, ae))
    (torch.nn.functional.gelu(h @ w1e + b1e) @ w2e).square().mean().backward()
    for got, e in zip([w, a, w1, b1, w2], exact):
        assert rel(torch, got.grad, e.grad) < 4 * TOLERANCE[dtype]


@tsr.function
def rms_norm_tanh(x: Tensor["N", "C"], w: Tensor["C"]):
    return tsr.tanh(tsr.rms_norm(x, (x.shape[-1],), w, 1e-6))


def test_double_backward_on_cuda(torch_cuda):
    """fp32 on the GPU: a function without a matmul (an fp32 matmul has no GPU path: the next test)."""
    torch = torch_cuda
    x, w = leaves(torch, [(24, 64), (64,)], torch.float32, "cuda", seed=5)
    gx, = torch.autograd.grad((rms_norm_tanh(x, w) ** 2).sum(), x, create_graph=True)
    hw, = torch.autograd.grad((gx * torch.cos(x.detach())).sum(), (w,))
    xe, we = float64_twins([x, w])
    ye = torch.tanh(xe * torch.rsqrt((xe * xe).mean(-1, keepdim=True) + 1e-6) * we)
    gxe, = torch.autograd.grad((ye ** 2).sum(), xe, create_graph=True)
    hwe, = torch.autograd.grad((gxe * torch.cos(xe.detach())).sum(), (we,))
    assert rel(torch, hw, hwe) < 1e-3


def test_an_fp32_matmul_in_a_backward_is_refused_with_the_reason(torch_cuda):
    torch = torch_cuda
    x, w, a = leaves(torch, [(24, 64), (64,), (64, 32)], torch.float32, "cuda", seed=5)
    with pytest.raises(UnsupportedByBackend, match="matmul of fp32 operands"):
        (rms_norm_matmul(x, w, a) ** 2).sum().backward()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])   # an fp32 matmul has no GPU path
def test_torch_compile_inductor_fullgraph_on_cuda(torch_cuda, dtype):
    """Inductor around the Tessera ops (fallback kernels from the fake implementations), forward
    and backward, without graph breaks (fullgraph=True raises on one), against eager."""
    torch = torch_cuda
    model = block(torch, c=64, f=128, device="cuda", dtype=getattr(torch, dtype))
    x = torch.randn(48, 64, device="cuda").to(getattr(torch, dtype))

    def run(m):
        m.zero_grad()
        loss = m(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]
    loss, grads = run(torch.compile(model, fullgraph=True))
    eager_loss, eager_grads = run(model)
    tol = TOLERANCE[dtype] * 4
    assert rel(torch, loss, eager_loss) < tol
    for g, e in zip(grads, eager_grads):
        assert rel(torch, g, e) < tol
    assert torch._dynamo.explain(model)(x).graph_break_count == 0


def test_attention_op_under_torch_compile_on_cuda(torch_cuda):
    torch = torch_cuda
    q, k, v = leaves(torch, [(1, 2, 64, 64)] * 3, torch.float16, "cuda", seed=6)

    def f(q, k, v):
        return softcapped_causal_attention(q * 1.5, k, v).float().sum()
    f(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.compile(f, fullgraph=True)(q, k, v).backward()
    for t, e in zip((q, k, v), eager):
        assert rel(torch, t.grad, e) < 1e-3


def test_no_grad_calls_stay_on_the_fast_path(torch_cuda):
    """Without grad (no input requires it, or torch.no_grad), a CUDA call records nothing and
    registers no op: it is the ordinary call, whose program is remembered for the next one."""
    torch = torch_cuda

    @tsr.function
    def scale(x: Tensor["N", "C"]):
        return tsr.softmax(x, dim=-1) * 2.0

    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    with torch.no_grad():
        y1 = scale(x)
        y2 = scale(x)
    y3 = scale(x.detach())
    assert not any(y.requires_grad for y in (y1, y2, y3))
    assert "_torch_ops" not in vars(scale) and scale._programs
    torch.testing.assert_close(y2, torch.softmax(x.detach(), -1) * 2.0, rtol=1e-5, atol=1e-6)
