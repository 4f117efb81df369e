"""FP8 GEMMs on the GPU (issue 16 item 3): e4m3 and e5m2 operands, per-tensor and per-row/column
scales written as tensor math, fused epilogues, bf16/fp16 results; on the native path (wgmma
m64nNk32 through TMA on sm_90a) and the mma.sync path (m16n8k32), at awkward shapes, into
NaN-poisoned outputs, against float64 and against torch._scaled_mm on the same inputs."""
import pytest

from fp8_gemm_cases import reference, rowwise_bias_gelu, scaled_mm
from test_kernels import PATHS, _arch

#: (1000, 768, 512), (256, 4096, 4096) and (1008, 3008, 512) take 128 x 192 tiles on sm_90a (fusion.NARROW_TILE)
SHAPES = [(1000, 768, 512), (37, 130, 96), (1, 17, 64), (4097, 256, 128), (64, 64, 100), (256, 4096, 4096),
          (64, 48, 16), (33, 40, 8), (1008, 3008, 512),
          (256, 384, 64), (1000, 512, 64)]   # (K = 64: 64-byte rows, on mma.sync)
FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: relative error (of the norm) against float64 on the fp8 values: the result's rounding
TOL = {"bf16": 1e-2, "fp16": 2e-3}


def inputs(torch, m, n, k, dtype, rowwise):
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    fp8 = getattr(torch, FP8[dtype])
    a = torch.randn(m, k, device="cuda", generator=gen).to(fp8)
    b = torch.randn(n, k, device="cuda", generator=gen).to(fp8)
    if rowwise:
        sa = torch.rand(m, 1, device="cuda", generator=gen) + 0.5
        sb = torch.rand(1, n, device="cuda", generator=gen) + 0.5
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.float16)
        return [a, b, sa, sb, bias]
    return [a, b, torch.tensor([0.5], device="cuda"), torch.tensor([1.25], device="cuda")]


def run(torch, fn, args, path):
    names = list(fn.signature.parameters)
    _, specs = fn.arg_specs(list(zip(names, args)))
    compiled = fn.compile(specs, arch=_arch(), path=path)
    program = compiled.gpu_program(0)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    outs = [torch.full(o.shape, float("nan"), device="cuda", dtype=dt[o.dtype.name]) for o in program.outputs]
    program(*args, out=outs)
    torch.cuda.synchronize()
    return compiled, outs[0]


def check(torch, out, ref, tol):
    out64 = out.double()
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = float((out64 - ref).norm() / max(float(ref.norm()), 1e-30))
    assert err < tol, f"relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(FP8))
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_scaled_mm_matches_float64_and_torch(torch_cuda, m, n, k, dtype, path):
    torch = torch_cuda
    args = inputs(torch, m, n, k, dtype, rowwise=False)
    compiled, out = run(torch, scaled_mm, args, path)
    check(torch, out, reference(torch, scaled_mm, *args), TOL["bf16"])
    if path == "native" and _arch() == "sm_90a" and k % 128 == 0 and m >= 64:   # (whole 128-byte TMA rows)
        assert 'tensor_core "wgmma"' in compiled.ir("target")
        if (m, n) in ((1000, 768), (256, 4096), (1008, 3008)):
            assert "[192, 128], major = k" in compiled.ir("target")
    a, b, sa, sb = args
    if dtype == "fp8_e4m3" and k % 16 == 0 and n % 16 == 0:   # (torch has no e5m2 x e5m2; cuBLASLt's alignment)
        peer = torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        assert float((out.double() - peer.double()).norm() / peer.double().norm()) < 1e-2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k", [(1000, 768, 512), (37, 130, 96), (4097, 256, 128)])
def test_rowwise_scales_bias_gelu(torch_cuda, m, n, k, path):
    torch = torch_cuda
    args = inputs(torch, m, n, k, "fp8_e4m3", rowwise=True)
    _, out = run(torch, rowwise_bias_gelu, args, path)
    check(torch, out, reference(torch, rowwise_bias_gelu, *args), TOL["fp16"])


def test_plain_call_with_torch_tensors(torch_cuda):
    """`scaled_mm(a, b, sa, sb)` on CUDA tensors, as a user writes it."""
    torch = torch_cuda
    a, b, sa, sb = inputs(torch, 512, 384, 256, "fp8_e4m3", rowwise=False)
    out = scaled_mm(a, b, sa, sb)
    assert out.dtype == torch.bfloat16
    check(torch, out, reference(torch, scaled_mm, a, b, sa, sb), TOL["bf16"])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k", [(1000, 768, 512), (37, 130, 96)])
def test_e4m3_times_e5m2(torch_cuda, m, n, k, path):
    """The two fp8 formats mixed (an fp8 training step's e5m2 gradients times e4m3 weights)."""
    torch = torch_cuda
    a, _, sa, sb = inputs(torch, m, n, k, "fp8_e4m3", rowwise=False)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e5m2)
    _, out = run(torch, scaled_mm, [a, b, sa, sb], path)
    check(torch, out, reference(torch, scaled_mm, a, b, sa, sb), TOL["bf16"])
    if k % 16 == 0 and n % 16 == 0:
        peer = torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        assert float((out.double() - peer.double()).norm() / peer.double().norm()) < 1e-2
