"""Attention functions with score modifications written as plain math, and their gradients in
float64 (NumPy, derived by hand) and through torch autograd: the cases of the attention backward's
tests on the CPU (tests/passes/test_recompute.py) and the GPU (tests/gpu/test_attention_backward_gpu.py)
and of bench/attention_backward.py; and forward-only ones scaled at run time (`temperature`)."""
import math

import numpy as np

import tessera as tsr
from tessera import Tensor
from tessera.bench.cases import gqa_causal_attention  # noqa: F401  (the grouped-query case: `tessera bench`'s)


def _scores(q, k):
    return tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))


def _ij(s):
    return tsr.arange(s.shape[-2])[:, None], tsr.arange(s.shape[-1])[None, :]


@tsr.function
def plain(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
    return tsr.matmul(tsr.softmax(_scores(q, k), dim=-1), v)


@tsr.function
def causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = _scores(q, k)
    i, j = _ij(s)
    return tsr.matmul(tsr.softmax(tsr.where(i >= j, s, -math.inf), dim=-1), v)


@tsr.function
def alibi(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = _scores(q, k)
    i, j = _ij(s)
    return tsr.matmul(tsr.softmax(s - (0.0625 * tsr.abs(i - j)).to(s.dtype), dim=-1), v)


@tsr.function
def softcap_causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = 20.0 * tsr.tanh(_scores(q, k) * (1.0 / 20.0))
    i, j = _ij(s)
    return tsr.matmul(tsr.softmax(tsr.where(i >= j, s, -math.inf), dim=-1), v)


@tsr.function
def temperature(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
                t: Tensor[1]):
    """The scores scaled by a temperature read at run time (as fp8's dequantizing scales are):
    a scale of either sign, folded into the exponent (`schedule_to_tile._SignedScale`)."""
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * (t * 0.125), dim=-1).to(v.dtype), v)


@tsr.function
def causal_temperature(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
                       t: Tensor[1]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (t * 0.125)
    i, j = _ij(s)
    return tsr.matmul(tsr.softmax(tsr.where(i >= j, s, -math.inf), dim=-1).to(v.dtype), v)


def reference_grads(kind, q, k, v, d_out):
    """float64 dQ, dK, dV of softmax(mod(Q K^T / sqrt(D))) V, derived by hand."""
    q, k, v, d_out = (x.astype(np.float64) for x in (q, k, v, d_out))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.swapaxes(-1, -2) * scale
    i, j = np.arange(s.shape[-2])[:, None], np.arange(s.shape[-1])[None, :]
    ds_dx = np.ones_like(s)
    if kind == "softcap_causal":
        t = np.tanh(s / 20.0)
        s, ds_dx = 20.0 * t, 1.0 - t * t
    if kind == "alibi":
        s = s - 0.0625 * np.abs(i - j)
    if kind in ("causal", "softcap_causal"):
        s = np.where(i >= j, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = d_out @ v.swapaxes(-1, -2)
    dx = p * (dp - (dp * p).sum(-1, keepdims=True)) * ds_dx * scale
    return dx @ k, dx.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ d_out


FUNCTIONS = {"plain": plain, "causal": causal, "alibi": alibi, "softcap_causal": softcap_causal}


def gqa_reference_grads(q, k, v, d_out):
    """float64 dQ, dK, dV: the causal attention's over K and V repeated per query head, dK and dV
    summed over each KV head's query heads."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = reference_grads("causal", q, *(np.repeat(x, group, axis=1) for x in (k, v)), d_out)
    return dq, *(x.reshape(k.shape[0], k.shape[1], group, *x.shape[2:]).sum(2) for x in (dk, dv))


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
