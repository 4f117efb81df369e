"""Tessera functions and the same math in torch, shared by the torch autograd tests on the CPU
(tests/frontend/test_torch_autograd.py) and on CUDA (tests/gpu/test_torch_autograd_gpu.py).

Each case: (id, Tessera function, torch reference taking (torch, *args), argument shapes, constants
passed after the tensors). The references are written independently of Tessera, in plain torch,
so torch autograd in float64 on them is the gradients' oracle.
"""
from __future__ import annotations

import math

import tessera as tsr
from tessera import Tensor

SOFT_CAP = 20.0


@tsr.function
def softcapped_causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                                v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = SOFT_CAP * tsr.tanh(s * (1.0 / SOFT_CAP))
    i = tsr.arange(s.shape[-2])
    j = tsr.arange(s.shape[-1])
    s = tsr.where(i[:, None] >= j[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def torch_softcapped_causal_attention(torch, q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = SOFT_CAP * torch.tanh(s / SOFT_CAP)
    causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    return torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1) @ v


@tsr.function
def rms_norm_matmul(x: Tensor["N", "C"], w: Tensor["C"], a: Tensor["C", "F"], eps: float = 1e-6):
    return tsr.matmul(tsr.rms_norm(x, (x.shape[-1],), w, eps), a)


def torch_rms_norm_matmul(torch, x, w, a, eps: float = 1e-6):
    return (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w) @ a


@tsr.function
def gelu_mlp(x: Tensor["N", "C"], w1: Tensor["C", "F"], b1: Tensor["F"], w2: Tensor["F", "C"]):
    return tsr.matmul(tsr.gelu(tsr.matmul(x, w1) + b1), w2)


def torch_gelu_mlp(torch, x, w1, b1, w2):
    return torch.nn.functional.gelu(x @ w1 + b1) @ w2


CASES = [
    ("attention-causal-softcap", softcapped_causal_attention, torch_softcapped_causal_attention,
     [(1, 2, 9, 16)] * 3),
    ("rms_norm-matmul", rms_norm_matmul, torch_rms_norm_matmul, [(6, 24), (24,), (24, 12)]),
    ("gelu-mlp", gelu_mlp, torch_gelu_mlp, [(5, 16), (16, 32), (32,), (32, 16)]),
]


def rel(torch, got, want) -> float:
    """||got - want|| / ||want|| in float64 (NaNs fail)."""
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), "NaN in a result"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def leaves(torch, shapes, dtype, device, seed: int = 0, scale: float = 1.0):
    """Fresh standard-normal leaf tensors that require grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [(scale * torch.randn(s, generator=gen, device=device)).to(dtype).requires_grad_() for s in shapes]


def float64_twins(args):
    """The same values as float64 leaves that require grad: the reference's inputs."""
    return [a.detach().double().requires_grad_() for a in args]


def block(torch, c: int = 16, f: int = 32, device: str = "cpu", dtype=None):
    """A small torch.nn.Module calling both Tessera functions between torch ops (a residual
    rms_norm-matmul, then a residual GELU MLP), returning a scalar loss."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(9)
            self.norm = torch.nn.Parameter(torch.ones(c))
            self.a = torch.nn.Parameter(torch.randn(c, c, generator=gen) / c ** 0.5)
            self.w1 = torch.nn.Parameter(torch.randn(c, f, generator=gen) / c ** 0.5)
            self.b1 = torch.nn.Parameter(torch.zeros(f))
            self.w2 = torch.nn.Parameter(torch.randn(f, c, generator=gen) / f ** 0.5)

        def forward(self, x):
            h = x + rms_norm_matmul(x, self.norm, self.a)
            return (h + gelu_mlp(torch.relu(h), self.w1, self.b1, self.w2)).float().square().mean()
    return Block().to(device=device, dtype=dtype)
