"""The attention backward on CUDA tensors (issue 14, item 4): `flash_chain` kernels that recompute
the scores per block (no S x S tensor in memory), for score modifications written as plain math,
against torch autograd in float64 on the same inputs."""
import pytest

import tessera as tsr

from attention_cases import FUNCTIONS, causal, torch_reference


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
    ("causal", (1, 1, 1, 64), 1),           # one query, one key
    ("plain", (1, 3, 1, 128), 131),        # one query (a decode step) against a prime key count
    ("plain", (2, 1, 5, 128), 1),          # one key: every probability is 1
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
        if not w.any():   # one key: dQ and dK are exactly 0, and D = rowsum(dO * O) from the rounded O
            assert not torch.isnan(got).any() and got.double().norm() / d_out.double().norm() < tol / 10, \
                f"d{name}: {got.abs().max()} where it is 0"
            continue
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
