"""FP8 GEMMs (issue 16 item 3) on the CPU: the product of fp8 operands is fp32, so per-tensor and
per-row/column scales are ordinary tensor math; the tile interpreter matches float64 on the fp8
values; the PTX assembles, and its SASS runs on the FP8 tensor cores (QGMMA through wgmma m64nNk32
on sm_90a, QMMA m16n8k32 on sm_89); an operand not stored K-contiguous gets a clear error."""
import re

import ml_dtypes
import numpy as np
import pytest

import tessera as tsr
from tessera.frontend.trace import ArgSpec
from tessera.runtime import ptxas
from tessera.runtime.ptxas import find_tool

from fp8_gemm_cases import rowwise_bias_gelu, scaled_mm

needs_cuobjdump = pytest.mark.skipif(find_tool("cuobjdump") is None, reason="cuobjdump not installed")
NP = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def fp8(rng, shape, dtype):
    return rng.standard_normal(shape).astype(NP[dtype])


def test_an_fp8_product_is_fp32():
    specs = [ArgSpec("a", (64, 32), tsr.fp8_e4m3, ("M", "K")), ArgSpec("b", (48, 32), tsr.fp8_e4m3, ("N", "K")),
             ArgSpec("sa", (1,), tsr.fp32, (1,)), ArgSpec("sb", (1,), tsr.fp32, (1,))]
    graph = scaled_mm.compile(specs).ir("graph")
    (matmul,) = [line for line in graph.splitlines() if "graph.matmul" in line]
    assert matmul.endswith("f8E4M3FN> -> !graph.tensor<[a_0, b_0], f32>")


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("m,n,k", [(37, 40, 96), (1, 17, 64), (64, 64, 100)])
def test_scaled_mm_matches_float64(m, n, k, dtype):
    rng = np.random.default_rng(m + n + k)
    a, b = fp8(rng, (m, k), dtype), fp8(rng, (n, k), dtype)
    sa, sb = np.array([0.5], np.float32), np.array([1.25], np.float32)
    out = scaled_mm(a, b, sa, sb)
    assert out.dtype == ml_dtypes.bfloat16
    ref = a.astype(np.float64) @ b.astype(np.float64).T * 0.625
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 1e-2


def test_rowwise_scales_bias_and_gelu_match_float64():
    rng = np.random.default_rng(3)
    m, n, k = 33, 48, 64
    a, b = fp8(rng, (m, k), "fp8_e4m3"), fp8(rng, (n, k), "fp8_e4m3")
    sa, sb = rng.random((m, 1)).astype(np.float32) + 0.5, rng.random((1, n)).astype(np.float32) + 0.5
    bias = rng.standard_normal(n).astype(np.float16)
    out = rowwise_bias_gelu(a, b, sa, sb, bias)
    x = (a.astype(np.float64) @ b.astype(np.float64).T) * sa * sb + bias
    ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    assert out.dtype == np.float16
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 2e-3


def _specs(dtype, m=256, n=512, k=512):
    dt = getattr(tsr, dtype)
    return [ArgSpec("a", (m, k), dt, ("M", "K")), ArgSpec("b", (n, k), dt, ("N", "K")),
            ArgSpec("sa", (1,), tsr.fp32, (1,)), ArgSpec("sb", (1,), tsr.fp32, (1,))]


@needs_cuobjdump
@pytest.mark.parametrize("arch,path,instruction", [
    ("sm_90a", "native", r"QGMMA\.64x\d+x32\.F32\.{0}\.{0}"),
    ("sm_89", "native", r"QMMA\.16832\.F32\.{0}\.{0}"),
])
@pytest.mark.parametrize("dtype", list(NP))
def test_the_sass_runs_on_fp8_tensor_cores(arch, path, instruction, dtype):
    compiled = scaled_mm.compile(_specs(dtype), arch=arch, path=path)
    ptx = "\n".join(k.ptx for k in compiled.stage("ptx").values())
    kind = dtype.split("_")[1]
    assert f".f32.{kind}.{kind}" in ptx
    sass = "\n".join(ptxas.sass(c.cubin) for c in compiled.stage("cubin").values())
    assert re.search(instruction.format(kind.upper()), sass), sorted(set(re.findall(r"\b\w*MMA[\w.]*", sass)))


def test_the_native_schedule_steps_128_elements_of_k():
    """128-element K steps fill the 128-byte swizzled rows TMA writes."""
    compiled = scaled_mm.compile(_specs("fp8_e4m3", 4096, 4096, 4096), arch="sm_90a")
    schedule = compiled.ir("schedule")
    assert "block_k = 128" in schedule and 'tensor_core "wgmma"' in compiled.ir("target")


def test_an_operand_stored_n_contiguous_is_refused_clearly():
    """fp8 tensor cores read both operands K-contiguous: B as [K, N] has no path, and says so."""
    @tsr.function
    def nn(a, b):
        return tsr.matmul(a, b).to(tsr.bf16)

    from tessera.ir import tile
    from tessera.lowering.tile_to_target import native_blockers

    specs = [ArgSpec("a", (256, 512), tsr.fp8_e4m3, ("M", "K")), ArgSpec("b", (512, 256), tsr.fp8_e4m3, ("K", "N"))]
    compiled = nn.compile(specs, arch="sm_90a")
    kernel = next(op for op in compiled.stage("tile").ops if isinstance(op, tile.KernelOp))
    assert any("not both K-contiguous" in why for why in native_blockers(kernel, tsr.platforms.get("sm_90a")))
    with pytest.raises(tsr.TesseraError, match=r"8-bit matmul .* K-contiguous .* a @ b.T"):
        compiled.stage("ptx")


@pytest.mark.parametrize("k", [8, 16])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_89"])
def test_a_short_k_takes_one_32_element_step(arch, k):
    """An fp8 instruction's K is 32 elements: a K of 8 or 16 is one step, padded (it failed to lower)."""
    compiled = scaled_mm.compile(_specs("fp8_e4m3", 64, 48, k), arch=arch)
    compiled.stage("cubin")
    rng = np.random.default_rng(k)
    a, b = fp8(rng, (64, k), "fp8_e4m3"), fp8(rng, (48, k), "fp8_e4m3")
    (out,) = compiled.run(a, b, np.array([1.0], np.float32), np.array([1.0], np.float32))
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 1e-2


def test_no_gradient_through_an_fp8_matmul():
    rng = np.random.default_rng(0)
    a, b = fp8(rng, (16, 32), "fp8_e4m3"), fp8(rng, (8, 32), "fp8_e4m3")
    one = np.array([1.0], np.float32)
    _, vjp_fn = tsr.vjp(scaled_mm, a, b, one, one)
    with pytest.raises(tsr.DTypeError, match="no gradient through a matmul of fp8_e4m3 operands"):
        vjp_fn(np.ones((16, 8), ml_dtypes.bfloat16))


@needs_cuobjdump
@pytest.mark.parametrize("arch,path,instruction", [
    ("sm_90a", "native", r"QGMMA\.64x\d+x32\.F32\.E4M3\.E5M2"),
    ("sm_89", "native", r"QMMA\.16832\.F32\.E4M3\.E5M2"),
])
def test_e4m3_times_e5m2_mixes_on_the_tensor_cores(arch, path, instruction):
    """The two fp8 formats mix (as an fp8 training step's gradient GEMMs do): one instruction."""
    specs = _specs("fp8_e4m3")
    specs[1] = ArgSpec("b", specs[1].shape, tsr.fp8_e5m2, specs[1].dims)
    compiled = scaled_mm.compile(specs, arch=arch, path=path)
    sass = "\n".join(ptxas.sass(c.cubin) for c in compiled.stage("cubin").values())
    assert re.search(instruction, sass), sorted(set(re.findall(r"\b\w*MMA[\w.]*", sass)))
    rng = np.random.default_rng(5)
    a, b = fp8(rng, (37, 96), "fp8_e4m3"), fp8(rng, (45, 96), "fp8_e5m2")
    one = np.array([1.0], np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    out = scaled_mm(a, b, one, one)
    assert np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref) < 1e-2


def test_other_dtypes_do_not_mix():
    rng = np.random.default_rng(0)
    with pytest.raises(tsr.DTypeError, match="only the two fp8 formats mix"):
        scaled_mm(fp8(rng, (4, 32), "fp8_e4m3"), rng.standard_normal((4, 32)).astype(np.float16),
                  np.ones(1, np.float32), np.ones(1, np.float32))
