"""FP8 attention on the CPU (issue 16 item 3): examples/fp8_attention.py traces into one flash
kernel plus V's transposed copy (`passes.byte_operands`), matches float64 on the interpreter at
awkward shapes, and its PTX runs P @ V on fp8 tensor cores with the probabilities as a register
operand (wgmma m64nNk32 on sm_90a, mma.sync m16n8k32 on sm_89)."""
import math
import re

import ml_dtypes
import numpy as np
import pytest

import tessera as tsr
from tessera.frontend.trace import ArgSpec
from tessera.runtime import ptxas
from tessera.runtime.ptxas import find_tool

from fp8_attention import causal_fp8_attention, fp8_attention, fp8_attention_vt

needs_cuobjdump = pytest.mark.skipif(find_tool("cuobjdump") is None, reason="cuobjdump not installed")
E4M3 = ml_dtypes.float8_e4m3fn
SCALES = [np.array([x], np.float32) for x in (0.5, 1.5, 0.75)]


def specs(b, h, s, n, d, transposed_v=False):
    v = ArgSpec("vt", (b, h, d, n), tsr.fp8_e4m3, ("B", "H", "D", "N")) if transposed_v else \
        ArgSpec("v", (b, h, n, d), tsr.fp8_e4m3, ("B", "H", "N", "D"))
    return [ArgSpec("q", (b, h, s, d), tsr.fp8_e4m3, ("B", "H", "S", "D")),
            ArgSpec("k", (b, h, n, d), tsr.fp8_e4m3, ("B", "H", "N", "D")), v,
            *(ArgSpec(name, (1,), tsr.fp32, ("one",)) for name in ("q_scale", "k_scale", "v_scale"))]


def reference(q, k, v, causal):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    sq, sk, sv = (float(x[0]) for x in SCALES)
    s = q @ np.swapaxes(k, -1, -2) * (sq * sk / math.sqrt(q.shape[-1]))
    if causal:
        rows = np.arange(s.shape[-2])[:, None] + s.shape[-1] - s.shape[-2]
        s = np.where(np.arange(s.shape[-1])[None, :] <= rows, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True) @ v * sv


@pytest.mark.parametrize("fn", [fp8_attention, causal_fp8_attention, fp8_attention_vt], ids=lambda f: f.name)
@pytest.mark.parametrize("b,h,s,n,d", [(1, 1, 1, 1, 64), (2, 1, 17, 53, 128), (1, 2, 37, 17, 64), (1, 1, 130, 131, 32)])
def test_matches_float64_on_the_interpreter(fn, b, h, s, n, d):
    rng = np.random.default_rng(s * n + d)
    q, k, v = (rng.standard_normal(shape).astype(E4M3) for shape in ((b, h, s, d), (b, h, n, d), (b, h, n, d)))
    value = np.ascontiguousarray(np.swapaxes(v, -1, -2)) if fn is fp8_attention_vt else v
    out = fn(q, k, value, *SCALES)
    assert out.dtype == ml_dtypes.bfloat16
    ref = reference(q, k, v, fn is causal_fp8_attention)
    seen = ~np.isnan(ref)          # (causal rows before the first key see none: NaN in both)
    assert np.array_equal(np.isnan(out.astype(np.float64)), ~seen)
    err = np.linalg.norm(out.astype(np.float64)[seen] - ref[seen]) / np.linalg.norm(ref[seen])
    assert err < 4e-2     # (e4m3 probabilities: 3 mantissa bits)


def test_v_is_read_through_a_transposed_copy():
    """V as stored ([..., N, D]) gets a layout copy: a transpose tagged in the Graph IR the fusion
    pass plans over, a kernel of its own in the schedule; V passed transposed needs none."""
    compiled = fp8_attention.compile(specs(2, 4, 256, 256, 128), arch="sm_90a")
    kernels = re.findall(r'schedule.kernel "\w+" "(\w+)"', compiled.ir("schedule"))
    assert kernels == ["elementwise", "flash_attention"]
    assert "tessera.layout_copy" in compiled.ir("schedule")
    passed = fp8_attention_vt.compile(specs(2, 4, 256, 256, 128, transposed_v=True), arch="sm_90a")
    assert re.findall(r'schedule.kernel "\w+" "(\w+)"', passed.ir("schedule")) == ["flash_attention"]


def test_a_16_bit_attention_gets_no_copy():
    import flash_attention as examples
    fn = examples.flash_attention
    compiled = fn.compile(fn.arg_specs_for(dict(B=1, H=2, S=256, D=128), tsr.bf16), arch="sm_90a")
    assert "layout_copy" not in compiled.ir("schedule")


def test_an_fp8_gemm_of_an_n_contiguous_operand_is_not_copied():
    """Only attention's P @ V (A computed in the kernel) is rewritten; a GEMM keeps its clear error."""
    @tsr.function
    def nn(a, b):
        return tsr.matmul(a, b).to(tsr.bf16)

    compiled = nn.compile([ArgSpec("a", (256, 512), tsr.fp8_e4m3, ("M", "K")),
                           ArgSpec("b", (512, 256), tsr.fp8_e4m3, ("K", "N"))], arch="sm_90a")
    assert "layout_copy" not in compiled.ir("schedule")


def test_the_probabilities_are_narrowed_in_range():
    """The template marks P's cast in range (at most 1), so the PTX converts it two values to a
    `cvt.rn.satfinite` without the overflow check a cast needs elsewhere."""
    compiled = fp8_attention.compile(specs(4, 16, 1024, 1024, 128), arch="sm_90a")
    narrowings = [line for line in compiled.ir("tile").splitlines() if "arith.truncf" in line]
    assert len(narrowings) == 2 and "tessera.in_range" in narrowings[0]   # (P; the output to bf16)
    ptx = compiled.stage("ptx")["fp8_attention_flash_attention_1"].ptx
    pairs = re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32 %\w+, (%\w+), (%\w+);", ptx)
    assert any(hi != lo for hi, lo in pairs)


@pytest.mark.parametrize("arch,instruction,register_a", [
    ("sm_90a", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3 \{[^}]+\}, \{", True),
    ("sm_89", r"mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3", False),
])
def test_p_at_v_runs_on_fp8_tensor_cores_from_registers(arch, instruction, register_a):
    compiled = fp8_attention.compile(specs(4, 16, 1024, 1024, 128), arch=arch)
    ptx = compiled.stage("ptx")["fp8_attention_flash_attention_1"].ptx
    assert re.search(instruction, ptx)
    assert "shfl.sync.idx.b32" in ptx          # (the accumulator's bytes moved into A fragments)
    compiled.stage("cubin")


@needs_cuobjdump
def test_the_sass_has_fp8_wgmma_with_a_register_operand():
    compiled = fp8_attention.compile(specs(4, 16, 1024, 1024, 128), arch="sm_90a")
    sass = ptxas.sass(compiled.stage("cubin")["fp8_attention_flash_attention_1"].cubin)
    mmas = re.findall(r"QGMMA\.64x\d+x32\.F32\.E4M3\.E4M3 [^;]*", sass)
    assert mmas, sorted(set(re.findall(r"\b\w*MMA[\w.]*", sass)))
    assert any(re.search(r", R\d+, gdesc", m) for m in mmas), mmas[:2]   # P @ V: A from registers


def test_one_key_takes_a_32_byte_step():
    """An 8-bit instruction's K is 32 elements: one key (or a head dim of 16) is one padded step."""
    for s, n, d in ((1, 1, 128), (5, 3, 16)):
        fp8_attention.compile(specs(1, 1, s, n, d), arch="sm_90a").stage("cubin")


@tsr.function
def e5m2_probabilities(q, k, v):
    """The probabilities cast to e5m2 against e4m3 values: the formats mix on the tensor cores."""
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1).to(tsr.fp8_e5m2), v).to(tsr.bf16)


def test_the_probabilities_take_the_dtype_they_are_cast_to():
    """(They were cast to V's dtype, e4m3, whatever the function said.)"""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape).astype(E4M3) for shape in ((1, 2, 64, 64), (1, 2, 80, 64), (1, 2, 80, 64)))
    _, arg_specs = e5m2_probabilities.arg_specs(list(zip("qkv", (q, k, v))))
    compiled = e5m2_probabilities.compile(arg_specs, arch="sm_90a")
    assert re.search(r"tessera\.in_range} : tensor<64x(\d+)xf32> to tensor<64x\1xf8E5M2>", compiled.ir("tile"))
    out = compiled.run(q, k, v)[0].astype(np.float64)
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / 8
    p = np.exp(s - s.max(-1, keepdims=True))
    exact = p / p.sum(-1, keepdims=True) @ v.astype(np.float64)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < 6e-2   # (e5m2: 2 mantissa bits)
    ptx = "".join(kernel.ptx for kernel in compiled.stage("ptx").values())
    assert re.search(r"\.f32\.e5m2\.e4m3\b", ptx)


def _attention(q, k, v):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1).to(tsr.fp8_e4m3), v).to(tsr.bf16)


def test_one_copy_for_a_v_two_attentions_read():
    @tsr.function
    def two(q, q2, k, v):
        return _attention(q, k, v) + _attention(q2, k, v)

    arg_specs = [ArgSpec(name, (2, 4, 256, 128), tsr.fp8_e4m3, ("B", "H", "S", "D")) for name in ("q", "q2", "k", "v")]
    compiled = two.compile(arg_specs, arch="sm_90a")
    assert compiled.ir("schedule").count("tessera.layout_copy") == 1
    assert re.findall(r'schedule.kernel "\w+" "(\w+)"', compiled.ir("schedule")).count("flash_attention") == 2


def test_no_copy_where_tileiras_compiles_the_kernels():
    compiled = fp8_attention.compile(specs(2, 4, 256, 256, 128), arch="sm_90a", backend="cuda-tile")
    assert "layout_copy" not in compiled.ir("schedule")
