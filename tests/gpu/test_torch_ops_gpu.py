"""PyTorch's ops (tests/torch_op_cases.py) on the GPU against NumPy in float64, and fused into a
GEMM epilogue and an attention score modification against torch."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor

from numpy_on_gpu import run_on_gpu
from test_kernels import check, run, torch_dtype
from torch_op_cases import DTYPE_CASES, SHAPES, check as check_case, function, inputs, reference


def _paths(case):
    """Both code paths where the case has a matmul (elsewhere they are the same kernels)."""
    return ["native", "ampere"] if case.name.startswith("einsum") else ["native"]


PARAMS = [(c, dt, p) for c, dt in DTYPE_CASES for p in _paths(c)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.values())))
@pytest.mark.parametrize("case,dt,path", PARAMS, ids=[f"{c.name}-{dt}-{p}" for c, dt, p in PARAMS])
def test_op_on_gpu(torch_cuda, case, dt, path, shape):
    fn = function(case, dt)
    arrays = inputs(case, dt, shape, np.random.default_rng(5))
    (out,) = run_on_gpu(fn, shape, arrays, torch_cuda, path)
    check_case(out, reference(case, arrays))


@tsr.function
def gemm_clamp_masked(a: Tensor["M", "K"], b: Tensor["K", "N"], m: Tensor["M", "N", tsr.bool_]):
    return (a @ b).clamp(-1.0, 1.5).masked_fill(m, -3.0)


@pytest.mark.parametrize("path", ["native", "ampere"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (77, 100, 45), (256, 512, 384)])
def test_clamp_and_masked_fill_in_a_gemm_epilogue(torch_cuda, dtype, m, k, n, path):
    torch = torch_cuda

    def make(spec, gen):
        if spec.dtype == tsr.bool_:
            return torch.rand(spec.shape, generator=gen, device="cuda") < 0.3
        return torch.randn(spec.shape, generator=gen, device="cuda").to(torch_dtype(torch, spec.dtype.name))
    (a, b, mask), (out,) = run(gemm_clamp_masked, dict(M=m, K=k, N=n), dtype, torch, make=make, path=path)
    ref = (a.double() @ b.double()).clamp(-1.0, 1.5).masked_fill(mask, -3.0)
    check(out, ref, dtype, torch)


@tsr.function
def alibi_capped_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                           v: Tensor["B", "H", "S", "D"]):
    i = tsr.arange(q.shape[-2])
    s = q @ k.mT * (1.0 / math.sqrt(q.shape[-1]))
    s = s - tsr.abs(i[:, None] - i[None, :]).to(q.dtype) * 0.25        # ALiBi: an integer abs
    s = s.clamp(-8.0, 8.0).masked_fill(i[:, None] < i[None, :], -math.inf)
    return tsr.softmax(s, -1) @ v


@pytest.mark.parametrize("path", ["native", "ampere"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("s,d", [(1, 64), (17, 64), (1000, 128)])
def test_alibi_clamp_and_masked_fill_in_attention(torch_cuda, dtype, s, d, path):
    torch = torch_cuda
    (q, k, v), (out,) = run(alibi_capped_attention, dict(B=2, H=3, S=s, D=d), dtype, torch, path=path)
    i = torch.arange(s, device="cuda")
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(d)
    scores = scores - (i[:, None] - i[None, :]).abs().double() * 0.25
    scores = scores.clamp(-8.0, 8.0).masked_fill(i[:, None] < i[None, :], -math.inf)
    check(out, torch.softmax(scores, -1) @ v.double(), dtype, torch)
