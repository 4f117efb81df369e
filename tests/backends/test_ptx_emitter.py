"""The PTX emitter's output assembles with ptxas for every CUDA target, and the SASS has what we meant."""
import collections
import re
import shutil
import subprocess

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import UnsupportedByBackend, emit_module
from tessera.backends.ptx.arithmetic import unsigned_magic
from tessera.ir import target as tgt
from tessera.lowering.shared_memory import Staging

from tessera.runtime.ptxas import find_tool, sass

from seed_kernels import causal_attention

needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
needs_cuobjdump = pytest.mark.skipif(find_tool("cuobjdump") is None, reason="cuobjdump not installed")


@tsr.function
def gelu_bias(x: Tensor["M", "N"], y: Tensor["N"]):
    return tsr.gelu(x * 2.0 + y).to(tsr.fp16)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w)


@tsr.function
def row_sum(x: Tensor["B", "M", "N"]):
    return x.sum(dim=-1, keepdim=True)


@tsr.function
def masked(x: Tensor["S", "T"]):
    i = tsr.arange(x.shape[0])
    j = tsr.arange(x.shape[1])
    return tsr.where(i[:, None] >= j[None, :], tsr.exp(x), 0.0)


@tsr.function
def gemm_epilogue(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@tsr.function
def gemm_nt(a: Tensor["M", "K"], b: Tensor["N", "K"]):
    return tsr.matmul(a, b.transpose(0, 1))


MMA_CASES = [
    (gemm_epilogue, dict(M=256, K=512, N=384)),
    (gemm_nt, dict(M=77, K=64, N=45)),
    (causal_attention, dict(B=2, H=2, S=1000, D=64)),
    (causal_attention, dict(B=1, H=1, S=17, D=128)),
]
MMA_ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]

CASES = [
    (gelu_bias, dict(M=100, N=1000)),
    (softmax, dict(M=1000, N=4097)),
    (layer_norm, dict(M=64, N=8192)),
    (rms_norm, dict(M=7, N=300)),
    (row_sum, dict(B=3, M=5, N=77)),
    (masked, dict(S=33, T=65)),
]
ARCHS = ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a"]


def assemble(ptx: str, arch: str, tmp_path) -> tuple[str, bytes]:
    src, cubin = tmp_path / "k.ptx", tmp_path / "k.cubin"
    src.write_text(ptx)
    result = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stderr, cubin.read_bytes()


@needs_ptxas
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fn,dims", CASES, ids=[f.name for f, _ in CASES])
def test_generated_ptx_assembles(fn, dims, arch, tmp_path):
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch=arch)
    modules = emit_module(compiled.modules["target"])
    assert set(modules) == set(compiled.kernel_names)
    for kernel in modules.values():
        report, _ = assemble(kernel.ptx, arch, tmp_path)
        assert "spill" not in report or "0 bytes spill stores" in report


@needs_ptxas
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_dtypes_assemble(dtype, tmp_path):
    compiled = layer_norm.compile(layer_norm.arg_specs_for(dict(M=4, N=100), dtype), arch="sm_90a")
    for kernel in emit_module(compiled.modules["target"]).values():
        assemble(kernel.ptx, "sm_90a", tmp_path)


@needs_ptxas
@needs_cuobjdump
def test_row_reduction_uses_warp_shuffles_and_wide_loads(tmp_path):
    compiled = softmax.compile(softmax.arg_specs_for(dict(M=64, N=1024), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    _, cubin = assemble(kernel.ptx, "sm_90a", tmp_path)
    text = sass(cubin)
    assert "SHFL.BFLY" in text and "MUFU.EX2" in text and "LDG.E.128" in text


def test_kernels_beyond_this_backend_say_so():
    """sm_100a's tcgen05 path is not emitted yet; it says so instead of writing wrong PTX."""
    compiled = gemm_epilogue.compile(gemm_epilogue.arg_specs_for(dict(M=256, K=512, N=384), "fp16"), arch="sm_100a")
    with pytest.raises(UnsupportedByBackend, match=r"tcgen05.mma m128n128k16\) is not emitted yet.*sm_90a"):
        emit_module(compiled.modules["target"])


@pytest.mark.parametrize("dtype,tensor_cores,arch,says", [
    ("fp32", True, "sm_80", r"fp32 operands; this backend's tensor-core matmuls on sm_80 take bf16, fp16.*"
                            r"give the matmul bf16 or fp16 operands \(x.to\(tsr.bf16\)\)"),
    ("fp16", False, "sm_80", r"fp16 operands kept off the tensor cores \(tensor_cores=False.*compile it with tensor"),
    ("bf16", True, "sm_75", r"bf16 operands; this backend emits no tensor-core matmul for sm_75 yet.*"
                            r"sm_80 to sm_89 or sm_90a"),
    ("fp16", True, "sm_70", r"sm_70's matrix instruction for this matmul \(wmma m16n16k16\) is not emitted yet.*"
                            r"compile for one of those"),
], ids=["fp32", "tensor-cores-off", "bf16-sm_75", "fp16-sm_70"])
def test_a_matmul_without_tensor_cores_says_what_to_do(dtype, tensor_cores, arch, says):
    """No CUDA-core matmul in the PTX backend yet, nor sm_75's and sm_70's tensor-core forms: the
    error names the dtype and the ways out (a dtype the arch's matmuls take, the arch to compile
    for), never one that fails again."""
    compiled = gemm_nt.compile(gemm_nt.arg_specs_for(dict(M=64, K=64, N=64), dtype), arch=arch,
                               tensor_cores=tensor_cores, backend="ptx")
    with pytest.raises(UnsupportedByBackend, match=says + ".*CPU interpreter"):
        emit_module(compiled.modules["target"])


@tsr.function
def batched(a: Tensor["B", "M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


NATIVE_GEMMS = [
    (gemm_epilogue, dict(M=256, K=512, N=384)),
    (gemm_epilogue, dict(M=300, K=200, N=1000)),
    (gemm_nt, dict(M=256, K=136, N=200)),
    (batched, dict(B=3, M=70, K=48, N=40)),
    (batched, dict(B=1, M=4096, K=512, N=2048)),           # more tiles than SMs: persistent
    (gemm_epilogue, dict(M=4096, K=512, N=2000)),          # persistent, with an epilogue and tails
]


@needs_ptxas
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("fn,dims", NATIVE_GEMMS,
                         ids=["aligned", "tails", "b-k-major", "batched", "persistent", "persistent-epilogue"])
def test_native_gemm_assembles_for_sm90a(fn, dims, dtype, tmp_path):
    """The Hopper path: wgmma from TMA-filled, 128-byte-swizzled tiles; no spills."""
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch="sm_90a")
    walks_tiles = "grid = array<i64: 132, 1, 1>" in compiled.ir("tile")   # a block per SM of sm_90a
    assert walks_tiles == (dims["M"] >= 2048)
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert "wgmma.mma_async" in kernel.ptx and "cp.async.bulk.tensor" in kernel.ptx
    report, _ = assemble(kernel.ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report
    assert "serialized" not in report     # ptxas warns when it must serialize wgmma
    assert kernel.dynamic_shared > 48 * 1024


def test_native_gemm_tensor_maps():
    """One tensor map per operand, described as the runtime must encode it: boxes one 128-byte row wide."""
    compiled = batched.compile(batched.arg_specs_for(dict(B=3, M=70, K=48, N=40), "bf16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    a, b = kernel.tensor_maps
    assert (a.arg, a.dtype, a.shape, a.box) == (0, "bf16", (3, 70, 48), (1, 64, 64))   # (a small GEMM's 64-row tiles)
    assert (b.arg, b.dtype, b.shape, b.box) == (1, "bf16", (48, 40), (64, 64))
    assert kernel.ptx.count(".param .align 64 .b8") == 2


@needs_ptxas
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rows", [64, 128])
def test_native_attention_assembles_for_sm90a(d, rows, tmp_path):
    """Attention on sm_90a: Q @ K^T with both operands behind descriptors, P @ V with P in registers
    (wgmma's register-A form), Q, K, V as 4-D TMA boxes; no spills, no serialized wgmma. 128 query
    rows on two warpgroups, or 64 on one (what two heads of 1000 queries derive: few heads)."""
    compiled = causal_attention.compile(causal_attention.arg_specs_for(dict(B=1, H=2, S=1000, D=d), "fp16"),
                                        arch="sm_90a", space={"split_kv": [1], "block_m": [rows]})
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert re.search(r"wgmma\.mma_async\S+ \{[^}]+\}, %rd\d+, %rd\d+", kernel.ptx)     # A and B descriptors
    assert re.search(r"wgmma\.mma_async\S+ \{[^}]+\}, \{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd", kernel.ptx)  # A regs
    assert "mma.sync" not in kernel.ptx and "cp.async.bulk.tensor.4d" in kernel.ptx
    keys = 128 if d == 64 else 64   # the key block: fewer keys where each carries more of the head dim
    assert [spec.box for spec in kernel.tensor_maps] == [(1, 1, rows, 64)] + [(1, 1, keys, 64)] * 2
    report, _ = assemble(kernel.ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report and "serialized" not in report


def test_ampere_path_keeps_attention_on_mma_sync():
    compiled = causal_attention.compile(causal_attention.arg_specs_for(dict(B=1, H=2, S=256, D=64), "fp16"),
                                        arch="sm_90a", path="ampere")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert "mma.sync.aligned" in kernel.ptx and "wgmma" not in kernel.ptx and not kernel.tensor_maps


@needs_ptxas
@needs_cuobjdump
def test_native_gemm_sass(tmp_path):
    """HGMMA from wgmma, UTMALDG from the TMA copies, SYNCS from the mbarriers: the Hopper path, really there."""
    compiled = gemm_epilogue.compile(gemm_epilogue.arg_specs_for(dict(M=256, K=512, N=384), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    _, cubin = assemble(kernel.ptx, "sm_90a", tmp_path)
    counts = collections.Counter(re.findall(r"\b(HGMMA\.64x\d+x16\.F32|UTMALDG\.2D|SYNCS\.[A-Z.0-9]+|HMMA)",
                                            sass(cubin)))
    assert any(k.startswith("HGMMA.64x") for k in counts) and counts["UTMALDG.2D"] > 0 and counts["HMMA"] == 0
    assert any(k.startswith("SYNCS.PHASECHK") for k in counts)


@needs_ptxas
@needs_cuobjdump
def test_cluster_gemm_multicasts_b_and_arrives_across_the_cluster_without_gpu_fences(tmp_path):
    """A GEMM in clusters of two sharing B (`cluster`): `.reqnctapercluster 2`, B's boxes copied with
    `.multicast::cluster` (UTMALDG.2D.MULTICAST), the other block told of a free stage with a plain
    `mbarrier.arrive.shared::cluster` (a `.release.cluster` one put a GPU-wide MEMBAR before each:
    3000x4096x5000 bf16 on an H200 289 us against 194.7), and wgmma descriptors built from the
    shared address's low 18 bits (a cluster block's addresses carry its rank from bit 24, which
    unmasked read rank 1's B boxes 256 bytes off, session 39)."""
    fn = tsr.function(gemm_epilogue.fn, space={"cluster": [2], "programs": [4], "persistent": [1]})
    compiled = fn.compile(fn.arg_specs_for(dict(M=1024, K=1024, N=1000), "bf16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    ptx = kernel.ptx
    assert ".reqnctapercluster 2, 1, 1" in ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::complete_tx::bytes"
                     r"\.multicast::cluster \[", ptx)
    assert "mbarrier.arrive.shared::cluster.b64" in ptx and "mbarrier.arrive.release" not in ptx
    assert ptx.count("262143;") >= 2   # (the A and B descriptors' address masks)
    report, cubin = assemble(ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report
    listing = sass(cubin)
    assert "UTMALDG.2D.MULTICAST" in listing and "HGMMA.64x" in listing
    assert listing.count("MEMBAR.ALL.GPU") <= 2   # (the cluster's two meetings: after init, before exit)


@tsr.function
def gemm_to_fp32(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b).to(tsr.fp32)


NARROW_STORE = re.compile(r"st\.global\.(?!v4\.b32)")


@needs_ptxas
@pytest.mark.parametrize("fn,dims", [(gemm_epilogue, dict(M=256, K=512, N=384)),
                                     (gemm_to_fp32, dict(M=300, K=200, N=1000)),
                                     (batched, dict(B=1, M=4096, K=512, N=2048))],
                         ids=["fp16", "fp32-tails", "persistent"])
def test_native_gemm_stores_whole_lines_through_each_warps_shared_buffer(fn, dims, tmp_path):
    """The native GEMM's tile leaves through a shared buffer per warp (16 rows, each padded by 16
    bytes), in 16-byte global stores only, ordered by warp barriers, not block barriers."""
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_90a")
    (store,) = [op for op in compiled.modules["target"].walk() if tgt.STAGING in op.attributes]
    scratch = store.attributes[tgt.SCRATCH]
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert scratch.size.data == kernel.threads // 32 * 16 * (128 + 16)
    assert scratch.offset.data + scratch.size.data == kernel.dynamic_shared   # the last claim on shared memory
    assert "staged store" in kernel.ptx and not re.search(r"^\s+\.shared", kernel.ptx, re.M)   # none the IR lacks
    assert "st.global.v4.b32" in kernel.ptx and not NARROW_STORE.search(kernel.ptx)
    assert kernel.ptx.count("bar.warp.sync") % 2 == 0 and "bar.warp.sync" in kernel.ptx
    report, _ = assemble(kernel.ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report and "serialized" not in report


@pytest.mark.parametrize("fn,dims,path", [(gemm_nt, dict(M=77, K=64, N=45), "native"),   # rows of 90 bytes
                                          (gemm_epilogue, dict(M=256, K=512, N=384), "ampere")])
def test_stores_stay_direct_where_staging_does_not_apply(fn, dims, path):
    """No staging where a row is not whole 16-byte vectors, nor on the mma.sync path (its several
    blocks per SM hide one another's stores)."""
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_90a", path=path)
    assert not any(tgt.STAGING in op.attributes for op in compiled.modules["target"].walk())
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert "staged store" not in kernel.ptx and NARROW_STORE.search(kernel.ptx)


@pytest.mark.parametrize("elem,warp_cols", [(2, 256), (2, 64), (2, 32), (2, 16), (4, 128), (4, 16)])
def test_a_staged_fragment_store_touches_every_bank_equally(elem, warp_cols):
    """One fragment store of a warp: lane l writes row l / 4, bytes 2 elem (l % 4) on; with the
    16-byte pad each bank gets the same number of words (once for fp16: no conflict)."""
    staging = Staging.of(elem, warp_cols)
    words = [(lane // 4 * staging.pitch + lane % 4 * 2 * elem) // 4 + w
             for lane in range(32) for w in range(2 * elem // 4)]
    assert sorted(collections.Counter(word % 32 for word in words).values()) == [2 * elem // 4] * 32
    assert staging.lanes_per_row * staging.vec == staging.cols and 32 % staging.lanes_per_row == 0


def test_no_staging_for_rows_narrower_than_two_vectors():
    assert Staging.of(2, 8) is None and Staging.of(4, 4) is None


@needs_ptxas
@pytest.mark.parametrize("arch", MMA_ARCHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("fn,dims", MMA_CASES, ids=[f"{f.name}-{d}" for f, d in MMA_CASES])
def test_tensor_core_kernels_assemble_without_spills(fn, dims, dtype, arch, tmp_path):
    """The Ampere-class path, also as the fallback on Hopper (path="ampere")."""
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=arch, path="ampere")
    for kernel in emit_module(compiled.modules["target"]).values():
        report, _ = assemble(kernel.ptx, arch, tmp_path)
        assert "0 bytes spill stores" in report


@needs_ptxas
@needs_cuobjdump
@pytest.mark.parametrize("fn,dims", MMA_CASES[::2], ids=["gemm", "attention"])
def test_tensor_core_sass(fn, dims, tmp_path):
    """HMMA from mma.sync, LDSM from ldmatrix, LDGSTS from cp.async: the Ampere path, really there."""
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_80", space={"split_kv": [1]})
    (kernel,) = emit_module(compiled.modules["target"]).values()
    _, cubin = assemble(kernel.ptx, "sm_90", tmp_path)
    counts = collections.Counter(re.findall(r"\b(HMMA\.16816\.F32|LDSM\.16\.M88|LDGSTS\.E\.BYPASS\.128)",
                                            sass(cubin)))
    assert counts["HMMA.16816.F32"] > 0 and counts["LDSM.16.M88"] > 0 and counts["LDGSTS.E.BYPASS.128"] > 0


def test_ptx_text_is_the_same_in_every_process():
    """The cubin cache is keyed by the PTX text, so the text must not depend on Python's per-process
    hash seed (set iteration order): two processes with different seeds emit identical PTX."""
    import os
    import sys
    program = (
        "import hashlib, tessera as tsr\n"
        "from tessera import Tensor\n"
        "from tessera.backends.ptx import emit_module\n"
        "@tsr.function\n"
        "def g(a: Tensor['M', 'K'], b: Tensor['K', 'N']):\n"
        "    return tsr.matmul(a, b)\n"
        "for path in ('native', 'ampere'):\n"
        "    c = g.compile(g.arg_specs_for(dict(M=300, K=200, N=1000), 'fp16'), arch='sm_90a', path=path)\n"
        "    for k in emit_module(c.modules['target']).values():\n"
        "        print(hashlib.sha1(k.ptx.encode()).hexdigest())\n")
    outputs = [subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONHASHSEED=seed)).stdout for seed in ("1", "2", "3")]
    assert outputs[0] and outputs[0] == outputs[1] == outputs[2]


def _cp_async_lines(fn, dims):
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_90", path="ampere")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    return kernel.ptx, [line.strip() for line in kernel.ptx.splitlines() if "cp.async.cg" in line]


def test_whole_tiles_share_one_predicate_per_copy():
    """Tiles that divide the GEMM: every chunk of a copy takes the copy's one byte count (0 past K)
    and an immediate offset from the thread's first chunk, in global and shared memory alike."""
    ptx, lines = _cp_async_lines(batched, dict(B=2, M=256, K=512, N=256))
    sizes = {line.rsplit(",", 1)[1] for line in lines}
    copies = ptx.count("cp.async.commit_group")
    assert len(sizes) == 2 * copies   # one size register per copy of A or of B, not one per chunk
    assert all(re.search(r"\[%r\d+(\+\d+)?\], \[%rd\d+\+\d+\]", line) for line in lines)
    assert not any(line.startswith("@") for line in lines)   # every thread's rows lie in the tile


def test_tails_keep_a_predicate_per_chunk():
    _, lines = _cp_async_lines(batched, dict(B=2, M=300, K=200, N=1000))
    assert len({line.rsplit(",", 1)[1] for line in lines}) == len(lines)


def test_index_division_by_a_constant_uses_no_divide():
    """(k + 2) % stages, tile rows and columns from the program id: k and the ids count up from 0,
    so each division by a constant is a mask, shift or multiply-high, never div/rem (which ptxas
    builds from a float reciprocal, MUFU.RCP, every time it runs, in the GEMM's loop too). The
    grouped tile order still divides by its last group's height, once, before the loop."""
    for stages in (2, 3):
        fn = tsr.function(batched.fn, space=dict(num_stages=[stages]))
        compiled = fn.compile(fn.arg_specs_for(dict(B=1, M=256, K=512, N=256), "fp16"), arch="sm_90", path="ampere")
        (kernel,) = emit_module(compiled.modules["target"]).values()
        assert not re.search(r"\b(div|rem)\.\w+ %r\d+, %r\d+, \d+;", kernel.ptx)
        loop = kernel.ptx[kernel.ptx.index("$L_loop"):kernel.ptx.index("$L_done")]
        assert not re.search(r"\b(div|rem)\.", loop)
        assert ("and.b32" if stages == 2 else "mul.hi.u32") in kernel.ptx


@given(st.integers(0, 2**31 - 1), st.integers(2, 2**31 - 1))
def test_magic_numbers_divide_every_non_negative_s32(x, divisor):
    assume(divisor & (divisor - 1))       # powers of two are a shift or a mask
    m, shift = unsigned_magic(divisor)
    assert m < 2**32
    assert (x * m >> 32) >> shift == x // divisor
    top = 2**31 - 1                       # the largest dividend, where an inexact m fails first
    assert (top * m >> 32) >> shift == top // divisor


@needs_ptxas
@pytest.mark.parametrize("arch,path", [*((a, "ampere") for a in MMA_ARCHS), ("sm_90a", "native")])
@pytest.mark.parametrize("dims", [dict(M=128, K=4096, N=1024), dict(M=33, K=3000, N=200)], ids=["aligned", "tails"])
def test_split_k_gemm_kernels_assemble(arch, path, dims, tmp_path):
    """A split-K GEMM's two kernels: the partial products on tensor cores (wgmma on the native
    path for whole tiles), and the elementwise sum with the epilogue; no spills."""
    compiled = gemm_epilogue.compile(gemm_epilogue.arg_specs_for(dims, "fp16"), arch=arch, path=path)
    kernels = emit_module(compiled.modules["target"])
    assert list(kernels) == ["gemm_epilogue_gemm_0_partials", "gemm_epilogue_gemm_0"]
    partials, total = kernels.values()
    mma = ("wgmma.mma_async" if path == "native" else "mma.sync") if dims["M"] == 128 else "mma"
    assert mma in partials.ptx and "mma" not in total.ptx
    for kernel in kernels.values():
        report, _ = assemble(kernel.ptx, arch, tmp_path)
        assert "0 bytes spill stores" in report


@tsr.function
def doubled(x: Tensor["M", "N"]):
    return x * 2.0


@needs_ptxas
@pytest.mark.parametrize("fn,dims,path", [
    (doubled, dict(M=2 ** 15 + 1, N=2 ** 16 - 1), "native"),                   # loads and stores
    (causal_attention, dict(B=1, H=1, S=2 ** 24 + 3, D=128), "ampere"),         # cp.async copies of K, V
], ids=["elementwise", "attention-copies"])
def test_tensors_of_2_31_elements_or_more_address_in_64_bits(fn, dims, path, tmp_path, monkeypatch):
    """An element index past 2^31 - 1 wraps in 32-bit arithmetic to an address outside the
    tensor (an illegal access on the GPU, or a wrong element): such tensors sum 64-bit products
    (mad.wide), and smaller ones keep the 32-bit sum (the elementwise kernel at 10 x 1000). One
    dim of 2^31 elements is refused before anything compiles."""
    # (not the async checker: it would step through the 2^24-key loop in Python, 100-220 s; its
    # hazards are those of the small attention kernels tests/passes/test_check_async.py checks)
    monkeypatch.setenv("TESSERA_CHECK_ASYNC", "0")
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_90a", path=path, space={"split_kv": [1]})
    for kernel in emit_module(compiled.modules["target"]).values():
        assert "mad.wide.s32" in kernel.ptx
        report, _ = assemble(kernel.ptx, "sm_90a", tmp_path)
        assert "0 bytes spill stores" in report
    small = doubled.compile(doubled.arg_specs_for(dict(M=10, N=1000), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(small.modules["target"]).values()
    assert "mad.wide.s32" not in kernel.ptx and "mul.wide.s32" in kernel.ptx
    with pytest.raises(tsr.ShapeError, match=r"dim 1 of argument 'x' has 2147483648 elements"):
        doubled.compile(doubled.arg_specs_for(dict(M=1, N=2 ** 31), "fp16"), arch="sm_90a")


def test_a_statistic_kept_as_a_column_is_read_in_pairs_only_where_aligned():
    """An attention backward's log-sum-exp [B, H, S, 1], read along S by the dK/dV kernel: a lane's
    two consecutive columns in one 8-byte load (the trailing size-1 dim counts as absent); read
    through a slice starting one element in, the pairs would straddle 4-byte boundaries (and the
    tensor's end), so each element is loaded alone."""
    def scores_grad(lse_rows):
        @tsr.function
        def dv(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], do: Tensor["B", "H", "S", "D"],
               lse: Tensor["B", "H", "T", 1]):
            p = tsr.exp(tsr.matmul(q, k.transpose(-2, -1)) * 0.125 - lse_rows(lse))
            return tsr.matmul(p.transpose(-2, -1), do)
        specs = dv.arg_specs_for({"B": 1, "H": 2, "S": 256, "D": 64, "T": 264}, "bf16")
        ptx = "\n".join(k.ptx for k in dv.compile(specs, arch="sm_80").stage("ptx").values())
        return collections.Counter(re.findall(r"ld\.global\.[\w.]+", ptx))
    whole = scores_grad(lambda lse: lse[:, :, :256, :])
    shifted = scores_grad(lambda lse: lse[:, :, 1:257, :])
    assert whole["ld.global.b32"] == 8 and whole["ld.global.b16"] == 0, whole   # bf16 pairs
    assert shifted["ld.global.b16"] == 16 and shifted["ld.global.b32"] == 0, shifted


@needs_ptxas
@needs_cuobjdump
def test_rows_split_across_a_cluster_exchange_their_statistics_through_its_shared_memory(tmp_path):
    """A norm backward over rows of 32768 splits them across clusters of 4 blocks: the kernel
    declares its cluster, meets once before its walk (`barrier.cluster`), then writes each row
    block's statistics into every block's shared memory (`mapa`, `st.async`), each completing
    that block's mbarrier, without spilling."""
    import norm_backward_cases
    compiled, _ = norm_backward_cases.compile("layer_norm", 4096, 32768)
    kernel = emit_module(compiled.modules["target"])[compiled.kernel_names[0]]
    assert ".reqnctapercluster 4, 1, 1" in kernel.ptx
    assert kernel.ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32") == 2 * 4   # (2 values, 4 blocks)
    assert kernel.ptx.count("barrier.cluster.wait.aligned;") == 1
    report, cubin = assemble(kernel.ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report
    listing = sass(cubin)
    assert "UCGABAR_ARV" in listing and "UCGABAR_WAIT" in listing


@needs_ptxas
@needs_cuobjdump
def test_a_row_walk_stages_its_rows_with_the_threads_own_copies(tmp_path):
    """A layer_norm over rows of 32768 walks its rows, the next row staged in shared memory: on
    sm_90a too its threads copy their 16-byte chunks (cp.async; TMA's 128-byte boxes would take 512
    copies a row, `native_blockers`) and read them back in 16-byte vectors (LDGSTS and LDS.128 in
    SASS), 2 stages of 64 KB, one block an SM walking, without spilling."""
    from tessera.bench import cases
    from tessera.lowering.tile_to_target import native_blockers
    fn = cases.layer_norm
    compiled = fn.compile(fn.arg_specs_for(dict(M=4096, N=32768), "bf16"), arch="sm_90a")
    (name,) = compiled.kernel_names
    (kernel,) = [op for op in compiled.stage("tile").walk() if getattr(op, "sym_name", None) and op.sym_name.data == name]
    from tessera import platforms
    assert any("read into registers" in why for why in native_blockers(kernel, platforms.get("sm_90a")))
    launch = compiled.launches[name]
    assert launch.grid == (132, 1, 1) and launch.dynamic_shared >= 2 * 32768 * 2
    ptx = compiled.stage("ptx")[name].ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.bulk.tensor" not in ptx
    assert ptx.count("ld.shared.v4.b32") == 32768 * 2 // 16 // 512   # (each thread's 16-byte chunks of a row)
    report, cubin = assemble(ptx, "sm_90a", tmp_path)
    assert "0 bytes spill stores" in report
    listing = sass(cubin)
    assert "LDGSTS" in listing and "LDS.128" in listing
