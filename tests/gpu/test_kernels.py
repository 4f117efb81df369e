"""Every generated kernel kind, run on the GPU, against torch on fresh random inputs.

Outputs are poisoned with NaN before each launch, so an element no thread
writes fails the test. Shapes are chosen to hit tails (S = 1, 17, 1000, 4097;
M, N, K not multiples of any tile).
"""
import math
import re

import pytest

import tessera as tsr
from tessera import Tensor

import attention_cases

TOL = {"fp32": 2e-5, "fp16": 1e-2, "bf16": 3e-2}


def torch_dtype(torch, name):
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


#: both code paths: the native one (TMA + wgmma on Hopper, per kernel where it applies) and mma.sync + cp.async
PATHS = ["native", "ampere"]


def run(fn, dims, dtype, torch, *, seed=0, make=None, path="native", expect=None, space=None):
    """Compiles for this GPU on `path`, runs into NaN-poisoned outputs; returns (inputs, outputs).
    `expect`: a tensor-core family the Target IR must use (so a test can't pass on a fallback)."""
    specs = fn.arg_specs_for(dims, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [make(s, gen) if make else
              torch.randn(s.shape, generator=gen, device="cuda", dtype=torch.float32).to(torch_dtype(torch, s.dtype.name))
              for s in specs]
    compiled = fn.compile(specs, arch=_arch(), path=path, **({"space": space} if space else {}))
    if expect:
        assert f'tensor_core "{expect}"' in compiled.ir("target"), f"{fn.name} {dims} does not use {expect}"
    program = compiled.gpu_program(0)
    outs = [torch.full(b.shape, float("nan"), device="cuda", dtype=torch_dtype(torch, b.dtype.name))
            for b in program.outputs]
    program(*inputs, out=outs)
    torch.cuda.synchronize()
    return inputs, outs


def _arch():
    from tessera.runtime import driver
    return driver.Device(0).platform().arch


def check(out, ref, dtype, torch):
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = (out64 - ref64).norm() / max(ref64.norm(), 1e-30)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"


# --- elementwise and row reductions -----------------------------------------------------

@tsr.function
def bias_gelu(x: Tensor["M", "N"], b: Tensor["N"]):
    return tsr.gelu(x * 2.0 + b, approximate="tanh")


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, eps=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n", [(1, 1), (1000, 77), (3, 4097)])
def test_elementwise(torch_cuda, dtype, m, n):
    torch = torch_cuda
    (x, b), (out,) = run(bias_gelu, dict(M=m, N=n), dtype, torch)
    ref = torch.nn.functional.gelu(x.float() * 2 + b.float(), approximate="tanh")
    check(out, ref, dtype, torch)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 1000), (33, 4097), (4, 8192)])
def test_softmax(torch_cuda, dtype, m, n):
    torch = torch_cuda
    (x,), (out,) = run(softmax, dict(M=m, N=n), dtype, torch)
    check(out, torch.softmax(x.float(), dim=-1), dtype, torch)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("m,n", [(1, 7), (64, 1000), (5, 3000)])
def test_layer_norm(torch_cuda, dtype, m, n):
    torch = torch_cuda
    (x, w, b), (out,) = run(layer_norm, dict(M=m, N=n), dtype, torch)
    ref = torch.nn.functional.layer_norm(x.float(), (n,), w.float(), b.float())
    check(out, ref, dtype, torch)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("m,n", [(1, 1), (17, 4097)])
def test_rms_norm(torch_cuda, dtype, m, n):
    torch = torch_cuda
    (x, w), (out,) = run(rms_norm, dict(M=m, N=n), dtype, torch)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    check(out, ref, dtype, torch)


# --- GEMM -----------------------------------------------------------------------------------

@tsr.function
def gemm_bias_gelu(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@tsr.function
def gemm_nt_scaled(a: Tensor["M", "K"], b: Tensor["N", "K"]):
    return (tsr.matmul(a, b.transpose(0, 1)) * 0.5).to(tsr.fp32)


@tsr.function
def batched_gemm(a: Tensor["B", "M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (77, 100, 45), (256, 512, 384), (130, 33, 257), (300, 200, 1000)])
def test_gemm_epilogue(torch_cuda, dtype, m, k, n, path):
    torch = torch_cuda
    (a, b, bias), (out,) = run(gemm_bias_gelu, dict(M=m, K=k, N=n), dtype, torch, path=path)
    ref = torch.nn.functional.gelu(a.float() @ b.float() + bias.float())
    check(out, ref, dtype, torch)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (77, 64, 45), (256, 136, 200)])
def test_gemm_transposed_b(torch_cuda, m, k, n, path):
    torch = torch_cuda
    (a, b), (out,) = run(gemm_nt_scaled, dict(M=m, K=k, N=n), "fp16", torch, path=path)
    check(out, (a.float() @ b.float().T) * 0.5, "fp16", torch)


@tsr.function
def gemm_tn(a: Tensor["K", "M"], b: Tensor["K", "N"]):
    return tsr.matmul(a.transpose(0, 1), b)


@tsr.function
def gemm_tt(a: Tensor["K", "M"], b: Tensor["N", "K"]):
    return tsr.matmul(a.transpose(0, 1), b.transpose(0, 1))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,k,n", [(64, 64, 64), (77, 64, 45), (256, 136, 200), (70, 1000, 136), (1000, 4097, 384)])
def test_gemm_transposed_a(torch_cuda, dtype, m, k, n, path):
    """A stored K x M (a weight gradient's X^T): read transposed from shared memory (ldmatrix.trans
    on mma.sync, an M-major wgmma descriptor on the native path), never by a transposing copy."""
    torch = torch_cuda
    aligned = m % 8 == 0 and n % 8 == 0 and m >= 128   # 16-byte rows, a warpgroup per 64 rows: wgmma
    (a, b), (out,) = run(gemm_tn, dict(M=m, K=k, N=n), dtype, torch, path=path,
                         expect="wgmma" if path == "native" and aligned else None)
    check(out, a.float().T @ b.float(), dtype, torch)
    (a, b), (out,) = run(gemm_tt, dict(M=m, K=k, N=n), dtype, torch, path=path)
    check(out, a.float().T @ b.float().T, dtype, torch)


@pytest.mark.parametrize("path", PATHS)
def test_batched_gemm(torch_cuda, path):
    torch = torch_cuda
    (a, b), (out,) = run(batched_gemm, dict(B=3, M=70, K=48, N=40), "fp16", torch, path=path)
    check(out, a.float() @ b.float(), "fp16", torch)


def gemm_reference(fn, inputs, torch):
    """torch's result for one of the GEMMs above, in fp32."""
    a, b = inputs[0].float(), inputs[1].float()
    if fn is gemm_bias_gelu:
        return torch.nn.functional.gelu(a @ b + inputs[2].float())
    if fn is gemm_nt_scaled:
        return (a @ b.T) * 0.5
    return a @ b


@pytest.mark.parametrize("fn,dims,dtype", [
    (gemm_bias_gelu, dict(M=256, K=512, N=384), "fp16"),
    (gemm_bias_gelu, dict(M=300, K=200, N=1000), "bf16"),       # every dim with a partial tile
    (gemm_bias_gelu, dict(M=129, K=4104, N=264), "fp16"),       # long K, 16-byte (not 128-byte) rows
    (gemm_nt_scaled, dict(M=256, K=136, N=200), "fp16"),        # B stored [N, K]: K-major descriptors
    (batched_gemm, dict(B=3, M=70, K=48, N=40), "fp16"),        # 3-D tensor map for A
    (gemm_bias_gelu, dict(M=256, K=136, N=256), "fp16"),        # block_k 128: the last step's 2nd box is past K
], ids=["aligned", "tails", "long-k", "b-k-major", "batched", "box-past-k"])
def test_native_gemm_uses_wgmma_and_tma(torch_cuda, hopper, fn, dims, dtype):
    torch = torch_cuda
    space = {"block_k": [128], "num_stages": [2]} if dims.get("K") == 136 else None
    inputs, (out,) = run(fn, dims, dtype, torch, path="native", expect="wgmma", space=space)
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)


@pytest.mark.parametrize("fn,dims,dtype,space", [
    (gemm_bias_gelu, dict(M=512, K=1024, N=512), "fp16", dict(programs=[3])),                  # 2-3 tiles each
    (gemm_bias_gelu, dict(M=300, K=200, N=1000), "bf16", dict(programs=[5], num_stages=[4])),  # tails, 4 steps
    (gemm_nt_scaled, dict(M=256, K=1000, N=200), "fp16", dict(programs=[1], num_stages=[2])),  # one block
    (gemm_nt_scaled, dict(M=640, K=128, N=384), "fp16", dict(programs=[4], mma_async=[0])),    # 2 steps, 4 stages
    (batched_gemm, dict(B=3, M=700, K=96, N=640), "fp16", dict(programs=[2])),                # batched
], ids=["aligned", "tails", "one-block", "fewer-steps-than-stages", "batched"])
@pytest.mark.parametrize("path", ["native", "ampere"])
def test_persistent_gemm(torch_cuda, hopper, fn, dims, dtype, space, path):
    """`persistent`: fewer blocks than tiles, each walking tiles with one pipeline across them (a
    tile's last steps issue the next tile's first copies). Steps counted wrongly across tiles show
    as tiles of another tile's data, or, on the native path, as a hang on an mbarrier phase."""
    torch = torch_cuda
    space = {"persistent": [1], **space}
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=_arch(), path=path, space=space)
    assert f"grid = array<i64: {space['programs'][0]}," in compiled.ir("tile")   # blocks walk tiles
    inputs, (out,) = run(fn, dims, dtype, torch, path=path, expect="wgmma" if path == "native" else "mma.sync",
                         space=space)
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)


@pytest.mark.parametrize("fn,dims,dtype,stages", [
    (gemm_bias_gelu, dict(M=512, K=1024, N=512), "fp16", 4),      # more steps than stages: stages reused
    (gemm_bias_gelu, dict(M=300, K=200, N=1000), "bf16", 4),      # partial tiles, fewer steps than stages
    (gemm_nt_scaled, dict(M=256, K=1000, N=200), "fp16", 2),      # two stages, each refilled many times
    (batched_gemm, dict(B=3, M=70, K=48, N=40), "fp16", 3),
], ids=["aligned", "tails", "two-stages", "batched"])
def test_warp_specialized_gemm(torch_cuda, hopper, fn, dims, dtype, stages):
    """A producer warpgroup issues every copy; the computing warps hand each stage back through
    its free mbarrier. Any handshake off by one phase shows as a hang or wrong tiles."""
    torch = torch_cuda
    inputs, (out,) = run(fn, dims, dtype, torch, path="native", expect="wgmma",
                         space={"warp_specialize": [1], "num_stages": [stages]})
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)


@pytest.mark.parametrize("fn,dims,dtype,space", [
    (gemm_bias_gelu, dict(M=2048, K=256, N=5000), "bf16", {}),                                 # the default's pairs
    (gemm_bias_gelu, dict(M=2900, K=256, N=5000), "bf16", {}),                                 # 23 tile rows: one past M
    (gemm_bias_gelu, dict(M=2000, K=256, N=3000), "bf16", {}),                                 # 128 x 192 tiles in pairs
    (gemm_bias_gelu, dict(M=512, K=1024, N=512), "fp16", dict(programs=[4])),                  # whole lines, 4 tiles each
    (gemm_bias_gelu, dict(M=1000, K=200, N=1000), "bf16", dict(programs=[6], num_stages=[3])),  # tails everywhere
    (gemm_nt_scaled, dict(M=256, K=1000, N=200), "fp16", dict(programs=[2])),                  # B stored [N, K]
    (gemm_bias_gelu, dict(M=256, K=64, N=264), "fp16", dict(persistent=[0])),                  # one k step, a tile a block
    (batched_gemm, dict(B=3, M=700, K=96, N=640), "fp16", dict(programs=[2])),                 # batched
], ids=["default", "odd-tile-rows", "narrow", "aligned", "tails", "b-k-major", "one-step", "batched"])
def test_cluster_gemm(torch_cuda, hopper, fn, dims, dtype, space):
    """Blocks in clusters of two computing consecutive tile rows, each copying half of every B tile
    into both (TMA multicast) and refilling a stage one step after both released it. A handshake
    off by one phase shows as a hang or wrong tiles; a block reading its partner's half early, as
    wrong values."""
    torch = torch_cuda
    space = {"cluster": [2], "persistent": [1], **space} if space else None
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=_arch(), **({"space": space} if space else {}))
    assert "tessera.cluster = 2" in compiled.ir("tile")
    inputs, (out,) = run(fn, dims, dtype, torch, path="native", expect="wgmma", space=space)
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)


@pytest.mark.parametrize("fn,dims,dtype", [
    (gemm_nt_scaled, dict(M=1000, K=512, N=3000), "fp16"),     # B stored [N, K]; tails in M and N
    (gemm_bias_gelu, dict(M=1024, K=256, N=3072), "bf16"),     # B [K, N], whole lines; 16 tile columns
], ids=["b-k-major", "epilogue"])
def test_narrow_tile_gemm(torch_cuda, hopper, fn, dims, dtype):
    """A 16-bit GEMM whose blocks' walk 128 x 192 tiles shorten (`fusion.NARROW_TILE`) takes them by
    default: three 64-column boxes a B stage, wgmma n = 192, against torch."""
    torch = torch_cuda
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=_arch())
    assert "block_n = 192 : i64" in compiled.ir("schedule")
    inputs, (out,) = run(fn, dims, dtype, torch, path="native", expect="wgmma")
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)


@pytest.mark.parametrize("fn,dims,dtype,split_k", [
    (gemm_bias_gelu, dict(M=1, K=4096, N=1000), "fp16", None),    # one row: the split the compiler derives
    (gemm_bias_gelu, dict(M=129, K=4104, N=264), "bf16", [8]),     # tails everywhere; the last split is shorter
    (gemm_nt_scaled, dict(M=256, K=3000, N=200), "fp16", [3]),     # B stored [N, K]
    (batched_gemm, dict(B=2, M=70, K=2048, N=40), "fp16", [4]),    # batch: partials [4, 2, 70, 40]
], ids=["one-row", "tails", "b-k-major", "batched"])
@pytest.mark.parametrize("path", PATHS)
def test_split_k_gemm(torch_cuda, fn, dims, dtype, split_k, path):
    """`split_k`: K split across blocks, fp32 partial products, a second kernel adding them in
    order with the epilogue. Two runs agree bit for bit (the order of the sum is fixed)."""
    torch = torch_cuda
    space = {"split_k": split_k} if split_k else None
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=_arch(), path=path, **({"space": space} if space else {}))
    assert "_partials" in compiled.ir("tile")
    inputs, (out,) = run(fn, dims, dtype, torch, path=path, space=space)
    check(out, gemm_reference(fn, inputs, torch), dtype, torch)
    _, (again,) = run(fn, dims, dtype, torch, path=path, space=space)
    assert torch.equal(out, again)


# --- flash attention --------------------------------------------------------------------------

@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = tsr.matmul(q, k.transpose(-2, -1)) * scale
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


@tsr.function
def causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def alibi_softcap(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
                  slopes: Tensor["H", tsr.fp32]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = s + slopes[:, None, None] * (i[None, :] - i[:, None])
    s = 20.0 * tsr.tanh(s / 20.0)
    return tsr.matmul(tsr.softmax(s, dim=-1).to(v.dtype), v)


def sdpa(torch, q, k, v, mask=None, causal_mask=False):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                            is_causal=causal_mask)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("b,h,s,d", [(1, 1, 1, 64), (2, 3, 17, 64), (1, 2, 1000, 64), (1, 1, 4097, 64),
                                     (2, 2, 1000, 128), (1, 1, 17, 128), (2, 2, 512, 128)])
def test_attention(torch_cuda, dtype, b, h, s, d, path):
    torch = torch_cuda
    (q, k, v), (out,) = run(attention, dict(B=b, H=h, S=s, D=d), dtype, torch, path=path)
    check(out, sdpa(torch, q, k, v), dtype, torch)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("b,h,s,d", [(1, 1, 1, 64), (2, 2, 1000, 64), (1, 1, 4097, 128), (1, 2, 512, 64),
                                     (3, 5, 1531, 128)])   # few heads: the last query blocks first
def test_causal_attention(torch_cuda, b, h, s, d, path):
    torch = torch_cuda
    (q, k, v), (out,) = run(causal, dict(B=b, H=h, S=s, D=d), "fp16", torch, path=path)
    check(out, sdpa(torch, q, k, v, causal_mask=True), "fp16", torch)


@pytest.mark.parametrize("fn,s,d,dtype", [(attention, 1000, 64, "bf16"), (attention, 4097, 128, "fp16"),
                                          (causal, 1000, 128, "fp16"), (causal, 129, 64, "bf16"),
                                          (attention, 300, 192, "fp16")])   # D=192: a 256-wide tile
def test_native_attention_uses_wgmma_and_tma(torch_cuda, hopper, fn, s, d, dtype):
    """Q @ K^T from TMA-filled tiles, P @ V with P in registers, against SDPA; causal cases run the
    drain of copies for key blocks past the diagonal (its absence would not show as a wrong result)."""
    torch = torch_cuda
    (q, k, v), (out,) = run(fn, dict(B=2, H=3, S=s, D=d), dtype, torch, path="native", expect="wgmma")
    check(out, sdpa(torch, q, k, v, causal_mask=fn is causal), dtype, torch)


@pytest.mark.parametrize("space", [dict(num_stages=[2]), dict(num_stages=[3]), dict(num_stages=[2], block_n=[64]),
                                   dict(num_stages=[2], warp_specialize=[1], block_n=[128])],
                         ids=["2-stages", "3-stages", "64-keys", "warp-specialized"])
@pytest.mark.parametrize("fn,s,d", [(attention, 1000, 64), (causal, 4097, 128), (causal, 129, 64), (attention, 33, 128),
                                    (attention, 64, 128)])
def test_native_attention_scores_one_block_ahead(torch_cuda, hopper, fn, s, d, space):
    """The schedule that issues block i + 1's Q @ K^T before block i's P @ V (qk_ahead), keys and
    values in pipelines of their own: one key block (the loop never runs), several with a partial
    last one, causal blocks skipped."""
    torch = torch_cuda
    (q, k, v), (out,) = run(fn, dict(B=2, H=3, S=s, D=d), "fp16", torch, path="native", expect="wgmma",
                            space=dict(qk_ahead=[1], **space))
    check(out, sdpa(torch, q, k, v, causal_mask=fn is causal), "fp16", torch)


@pytest.mark.parametrize("fn,s,d", [(attention, 129, 64), (attention, 1000, 64), (causal, 4097, 128),
                                    (causal, 1000, 64), (attention, 2048, 128)])
def test_warp_specialized_attention(torch_cuda, hopper, fn, s, d):
    """Attention with a producer warpgroup issuing Q, K and V: two key blocks, several with a
    partial last one, causal blocks skipped (copies issued for blocks never read are waited for)."""
    torch = torch_cuda
    (q, k, v), (out,) = run(fn, dict(B=2, H=3, S=s, D=d), "fp16", torch, path="native", expect="wgmma",
                            space=dict(warp_specialize=[1]))
    check(out, sdpa(torch, q, k, v, causal_mask=fn is causal), "fp16", torch)


@pytest.mark.parametrize("b,h,s,d,dtype,programs", [
    (8, 16, 1024, 128, "bf16", None),   # the default: 132 programs walking 1024 tiles
    (1, 2, 4097, 128, "fp16", 7),       # a partial last key block, 66 tiles over 7 blocks
    (3, 5, 1531, 128, "bf16", 11),      # a partial last query block in each head
    (1, 1, 1000, 128, "fp16", 3),       # 8 tiles: blocks walking 2 and 3
    (2, 3, 300, 64, "bf16", 2),         # D = 64, three key blocks a tile
    (1, 1, 256, 128, "fp16", 1),        # one block walks both tiles, two key blocks each
])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ahead", [1, 0], ids=["scores-ahead", "plain-loop"])
@pytest.mark.parametrize("fn", [attention, causal], ids=["plain", "causal"])
def test_persistent_attention_walks_query_tiles(torch_cuda, hopper, b, h, s, d, dtype, programs, path, ahead, fn):
    """`persistent` (the Hopper D = 128 default): fewer blocks than query tiles, each walking its
    tiles with the key and value pipelines running across them and two stages of Q; under a causal
    mask each tile with its own count of key blocks (one for a first query block: the copies run
    ahead into the tile after the next), heaviest first. A step counted wrongly across tiles shows
    as another tile's keys, or on TMA as a hang."""
    torch = torch_cuda
    space = {"persistent": [1], "qk_ahead": [ahead], "warp_specialize": [1], "block_n": [128], "num_stages": [2],
             "split_kv": [1], **({"programs": [programs]} if programs else {})}
    if path == "ampere":
        space = {**space, "warp_specialize": [0]}
    dims = dict(B=b, H=h, S=s, D=d)
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=_arch(), path=path, space=space)
    walk = re.search(r"grid = array<i64: (\d+), 1, 1>", compiled.ir("tile"))   # blocks walking tiles
    assert walk and int(walk.group(1)) == (programs or int(walk.group(1))) < b * h * math.ceil(s / 128)
    (q, k, v), (out,) = run(fn, dims, dtype, torch, path=path, space=space,
                            expect="wgmma" if path == "native" else "mma.sync")
    check(out, sdpa(torch, q, k, v, causal_mask=fn is causal), dtype, torch)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ahead", [1, 0], ids=["scores-ahead", "plain-loop"])
@pytest.mark.parametrize("heads_first", [1, 0])
def test_causal_walk_in_three_stages(torch_cuda, hopper, path, ahead, heads_first):
    """A causal walk with three stages of keys and values (pinned; the default has two): copies
    running two steps past a tile's last block, across runs of one-block tiles (64-row query and key
    blocks: each head's first query block sees one; every head's first taken last by 2 blocks walking
    6 heads, so each walks three of them in a row). A step counted wrongly shows as another tile's
    keys, or on TMA as a hang."""
    torch = torch_cuda
    space = {"persistent": [1], "qk_ahead": [ahead], "warp_specialize": [int(path == "native")], "num_stages": [3],
             "block_m": [64], "block_n": [64], "num_warps": [4], "programs": [2], "split_kv": [1],
             "heavy_first": [heads_first]}
    dims = dict(B=2, H=3, S=300, D=64)
    compiled = causal.compile(causal.arg_specs_for(dims, "bf16"), arch=_arch(), path=path, space=space)
    assert "grid = array<i64: 2, 1, 1>" in compiled.ir("tile")
    (q, k, v), (out,) = run(causal, dims, "bf16", torch, path=path, space=space,
                            expect="wgmma" if path == "native" else "mma.sync")
    check(out, sdpa(torch, q, k, v, causal_mask=True), "bf16", torch)


def test_alibi_softcap_attention(torch_cuda):
    torch = torch_cuda
    dims = dict(B=2, H=4, S=333, D=64)
    (q, k, v, slopes), (out,) = run(alibi_softcap, dims, "fp16", torch)
    i = torch.arange(dims["S"], device="cuda", dtype=torch.float32)
    s = (q.float() @ k.float().transpose(-2, -1)) / 8.0 + slopes.float()[:, None, None] * (i[None, :] - i[:, None])
    s = 20.0 * torch.tanh(s / 20.0)
    check(out, torch.softmax(s, dim=-1).half().float() @ v.float(), "fp16", torch)


@pytest.mark.parametrize("temperature", [0.7, -0.7], ids=["positive", "negative"])
@pytest.mark.parametrize("causal_mask", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("b,h,s,d", [(2, 4, 1000, 128), (4, 16, 1031, 64), (4, 16, 1031, 128)])
def test_attention_scaled_by_a_tensor(torch_cuda, b, h, s, d, causal_mask, temperature, path):
    """softmax(t * scores) with t a one-element tensor read at run time, folded into the exponent
    with its sign choosing the row max or min (`schedule_to_tile._SignedScale`), in the loops
    these shapes derive in bf16 (split-KV over the small grid, which keeps the multiply; D = 64,
    two blocks an SM; the scores-ahead walk at D = 128) and on mma.sync, against float64."""
    torch = torch_cuda
    fn = attention_cases.causal_temperature if causal_mask else attention_cases.temperature

    def make(spec, gen):
        if spec.name == "t":
            return torch.tensor([temperature], device="cuda", dtype=torch.bfloat16)
        return torch.randn(spec.shape, generator=gen, device="cuda").to(torch.bfloat16)
    (q, k, v, t), (out,) = run(fn, dict(B=b, H=h, S=s, D=d), "bf16", torch, make=make, path=path)
    scores = q.double() @ k.double().transpose(-2, -1) * (float(t) * 0.125)
    if causal_mask:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    check(out, torch.softmax(scores, dim=-1) @ v.double(), "bf16", torch)


@tsr.function
def recent_keys(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    return tsr.matmul(tsr.softmax(tsr.where(i[None, :] >= i[:, None] - 200, s, -math.inf), dim=-1), v)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("s", [512, 1000])
def test_key_window_attention(torch_cuda, s, path):
    """Key blocks wholly inside the window skip the mask, blocks across its edge apply it."""
    torch = torch_cuda
    (q, k, v), (out,) = run(recent_keys, dict(B=1, H=2, S=s, D=64), "fp16", torch, path=path)
    i = torch.arange(s, device="cuda")
    check(out, sdpa(torch, q, k, v, mask=i[None, :] >= i[:, None] - 200), "fp16", torch)


@tsr.function
def sliding_window(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 300)
    return tsr.matmul(tsr.softmax(tsr.where(keep, s, -math.inf), dim=-1), v)


@pytest.mark.parametrize("space", [{}, {"warp_specialize": [1]}, {"qk_ahead": [1]},
                                   {"qk_ahead": [1], "warp_specialize": [1], "block_n": [128]}],
                         ids=["default", "warp_specialize", "qk_ahead", "qk_ahead-warp_specialize"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("s", [1000, 4097])
def test_sliding_window_attention(torch_cuda, s, path, space):
    """A causal window (a bound on both sides): each query block's key loop starts past the blocks
    the window leaves behind (a first block computed at run time, which a warp-specialized
    producer computes too) and stops at the diagonal."""
    torch = torch_cuda
    (q, k, v), (out,) = run(sliding_window, dict(B=2, H=2, S=s, D=128), "bf16", torch, path=path, space=space)
    i = torch.arange(s, device="cuda")
    check(out, sdpa(torch, q, k, v, mask=(i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 300)), "bf16",
          torch)


def test_torch_tensors_in_and_out(torch_cuda):
    """The plain call path: CUDA tensors in, CUDA tensors of the right dtype out, on torch's stream."""
    torch = torch_cuda
    q, k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = attention(q, k, v)
    assert out.is_cuda and out.dtype == torch.float16 and out.shape == q.shape
    check(out, sdpa(torch, q, k, v), "fp16", torch)


def test_bad_inputs_fail_before_launch(torch_cuda):
    torch = torch_cuda
    q = torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 2, 100, 32, device="cuda", dtype=torch.float16)
    with pytest.raises(tsr.ShapeError, match="D"):
        attention(q, k, k)
    with pytest.raises(tsr.TesseraError, match="not 16-byte aligned"):
        attention(torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape), q, q)
    # an innermost dim that is not contiguous is copied first (the compile says why), not refused
    strided = q.transpose(-2, -1).contiguous().transpose(-2, -1)
    torch.testing.assert_close(attention(strided, q, q), attention(q, q, q))


@tsr.function
def cross_attention(q: Tensor["B", "H", "Sq", "D"], k: Tensor["B", "H", "Sk", "D"], v: Tensor["B", "H", "Sk", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@pytest.mark.parametrize("sq,sk,d,dtype", [(1, 4097, 64, "fp16"), (1000, 17, 128, "bf16"), (333, 1000, 64, "bf16")])
def test_cross_attention(torch_cuda, sq, sk, d, dtype):
    torch = torch_cuda
    (q, k, v), (out,) = run(cross_attention, dict(B=2, H=3, Sq=sq, Sk=sk, D=d), dtype, torch)
    check(out, sdpa(torch, q, k, v), dtype, torch)


def test_cupy_arrays_in_and_out(cuda_device):
    """Any __cuda_array_interface__ producer works; outputs come back in the caller's framework."""
    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((37, 1000), dtype=cupy.float32)
    out = softmax(x)
    assert isinstance(out, cupy.ndarray) and out.shape == x.shape
    ref = cupy.exp(x - x.max(axis=-1, keepdims=True))
    ref /= ref.sum(axis=-1, keepdims=True)
    assert float(cupy.abs(out - ref).max()) < 1e-5
