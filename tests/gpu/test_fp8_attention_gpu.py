"""FP8 attention on the GPU (issue 16 item 3): examples/fp8_attention.py as written, Q, K and V in
e4m3 with per-tensor scales, against float64 attention on the same fp8 values; plain, causal (queries
fewer than keys too) and V passed transposed; head dims 64 and 128; awkward lengths (1, 17, primes,
1000, 4097); both code paths (wgmma m64nNk32 with the probabilities as a register operand on
sm_90a, mma.sync m16n8k32 otherwise); NaN-poisoned outputs."""
import math

import pytest

from fp8_attention import causal_fp8_attention, fp8_attention, fp8_attention_vt
from test_kernels import PATHS, _arch

#: relative error (of the norm) against float64 on the fp8 inputs: e4m3 probabilities (3 mantissa
#: bits, about 2-2.5% measured on the CPU interpreter) and the bf16 output
TOL = 4e-2

CASES = [  # B, H, S, N, D
    (1, 1, 1, 1, 128),
    (2, 3, 17, 17, 128),
    (1, 2, 1000, 1000, 128),
    (2, 1, 127, 4097, 128),
    (1, 2, 4097, 131, 128),
    (2, 2, 257, 1000, 64),
    (1, 2, 300, 2048, 128),
    (2, 3, 1, 4096, 128),
    (2, 2, 1024, 1024, 64),   # D = 64: Q and K in TMA's 64-byte swizzle
    (1, 3, 300, 2048, 64),
    (2, 2, 1024, 1024, 48),   # (a 64-wide tile over 48 columns: TMA fills the rest with zeros)
    (2, 2, 64, 64, 64),       # (V^T's 64 keys a row in the 64-byte swizzle too)
]


def inputs(torch, b, h, s, n, d):
    gen = torch.Generator(device="cuda").manual_seed(b * 1000 + s + n + d)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(torch.float8_e4m3fn)
               for shape in ((b, h, s, d), (b, h, n, d), (b, h, n, d)))
    scales = [torch.tensor([x], device="cuda") for x in (0.5, 1.5, 0.75)]
    return q, k, v, scales


def reference(torch, q, k, v, scales, causal):
    q, k, v = (x.double() for x in (q, k, v))
    sq, sk, sv = (float(x) for x in scales)
    s = q @ k.transpose(-1, -2) * (sq * sk / math.sqrt(q.shape[-1]))
    if causal:
        rows = torch.arange(q.shape[-2], device="cuda")[:, None] + k.shape[-2] - q.shape[-2]
        s = s.masked_fill(torch.arange(k.shape[-2], device="cuda")[None, :] > rows, -math.inf)
    return torch.softmax(s, -1) @ v * sv


def run(torch, fn, args, path, space=None):
    names = list(fn.signature.parameters)
    _, specs = fn.arg_specs(list(zip(names, args)))
    compiled = fn.compile(specs, arch=_arch(), path=path, **({"space": space} if space else {}))
    program = compiled.gpu_program(0)
    outs = [torch.full(o.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for o in program.outputs]
    program(*args, out=outs)
    torch.cuda.synchronize()
    return compiled, outs[0]


def check(torch, out, ref, causal):
    out64 = out.double()
    if causal and out.shape[-2] > 0:   # (rows before the first key see none: NaN in both)
        keep = ~torch.isnan(ref[..., 0])
        out64, ref = out64[keep], ref[keep]
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = float((out64 - ref).norm() / max(float(ref.norm()), 1e-30))
    assert err < TOL, f"relative error {err:.2e} >= {TOL}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fn", [fp8_attention, causal_fp8_attention, fp8_attention_vt], ids=lambda f: f.name)
@pytest.mark.parametrize("b,h,s,n,d", CASES)
def test_fp8_attention_matches_float64(torch_cuda, fn, b, h, s, n, d, path):
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    value = v.transpose(-1, -2).contiguous() if fn is fp8_attention_vt else v
    compiled, out = run(torch, fn, [q, k, value, *scales], path)
    causal = fn is causal_fp8_attention
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)
    kernels = compiled.ir("schedule").count("schedule.kernel")
    assert kernels == (1 if fn is fp8_attention_vt else 2)   # (V's transposed copy)
    if path == "native" and _arch() == "sm_90a" and d in (64, 128) and n % 16 == 0 and s >= 128:
        # (TMA takes 16-byte rows of V^T; a few queries split the keys, on mma.sync)
        assert 'tensor_core "wgmma"' in compiled.ir("target")
        assert ('swizzle = "tma_64b"' in compiled.ir("target")) == (d == 64)


#: the warp-specialized schedule with the computing warpgroups taking turns at their mmas (the
#: default only over 4+ waves of query blocks): one key block, a partial last one, causal blocks
#: skipped and masked, queries fewer and more than keys
PINGPONG = {"pingpong": [1], "warp_specialize": [1], "num_warps": [8], "block_m": [128], "block_n": [128],
            "qk_ahead": [0], "split_kv": [1]}


@pytest.mark.parametrize("fn", [causal_fp8_attention, fp8_attention_vt], ids=lambda f: f.name)
@pytest.mark.parametrize("b,h,s,n,d", [(1, 1, 1, 1, 128), (2, 3, 33, 33, 128), (1, 2, 128, 128, 128),
                                       (2, 2, 129, 256, 128), (1, 2, 1000, 1024, 128), (1, 2, 2048, 2048, 128),
                                       (1, 2, 4097, 4097, 128), (1, 2, 1000, 1000, 64), (2, 2, 64, 4096, 128),
                                       (1, 2, 256, 128, 128), (1, 2, 1024, 1024, 64)])
def test_fp8_attention_warpgroups_taking_turns(torch_cuda, hopper, fn, b, h, s, n, d):
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    value = v.transpose(-1, -2).contiguous() if fn is fp8_attention_vt else v
    compiled, out = run(torch, fn, [q, k, value, *scales], "native", space=PINGPONG)
    causal = fn is causal_fp8_attention
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)
    # (turns on the native path, where TMA takes V^T's rows 16-byte aligned, and a 128-row query tile
    # leaves two computing warpgroups; causal queries past the keys run an empty loop)
    assert ("warpgroup_turn" in compiled.ir("target")) == (n % 16 == 0 and s > 64)


@pytest.mark.parametrize("b,h,s,n,d,programs", [(1, 2, 1000, 1024, 64, 3), (2, 3, 300, 304, 64, 2),
                                                (1, 2, 4097, 4096, 128, 7), (2, 2, 256, 256, 64, 1)])
def test_fp8_attention_walking_query_tiles_with_turns(torch_cuda, hopper, b, h, s, n, d, programs):
    """`persistent` with the warpgroups taking turns: fewer blocks than query tiles, each walking its
    tiles (the turns begun and ended in each), every tile against float64."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    space = {**PINGPONG, "persistent": [1], "programs": [programs]}
    compiled, out = run(torch, fp8_attention_vt, [q, k, v.transpose(-1, -2).contiguous(), *scales], "native",
                        space=space)
    assert f"grid = array<i64: {programs}, 1, 1>" in compiled.ir("tile") and "warpgroup_turn" in compiled.ir("target")
    check(torch, out, reference(torch, q, k, v, scales, False), False)


#: fp8's default over 4+ waves of query blocks (`schedule._fp8_wide`): 256 keys a block, walking
#: the query tiles, the computing warpgroups taking turns without a causal mask
WIDE = {"warp_specialize": [1], "num_warps": [8], "block_m": [128], "block_n": [256], "qk_ahead": [0],
        "split_kv": [1], "persistent": [1]}


@pytest.mark.parametrize("fn", [causal_fp8_attention, fp8_attention_vt], ids=lambda f: f.name)
@pytest.mark.parametrize("b,h,s,n,d,programs", [(1, 1, 1, 16, 128, 1), (1, 1, 300, 272, 128, 2),
                                                (1, 2, 1000, 1024, 128, 3), (2, 2, 513, 4096, 64, 5),
                                                (1, 2, 4097, 4096, 128, 7), (2, 2, 256, 256, 128, 1),
                                                (1, 2, 1031, 1040, 64, 4)])
def test_fp8_attention_on_256_key_blocks_walking(torch_cuda, hopper, fn, b, h, s, n, d, programs):
    """256 keys a block, fewer blocks than query tiles walking them: a partial last key block (16 of
    256 keys), causal blocks skipped and masked, queries fewer and more than keys, every tile against
    float64. Two cases keep the grid (`schedule_to_tile._walks_attention_tiles`): one query tile
    (1 x 1 x 1), and one key block without a mask (fewer than the two stages the walk runs ahead)."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    causal = fn is causal_fp8_attention
    value = v if causal else v.transpose(-1, -2).contiguous()
    space = {**WIDE, "pingpong": [int(not causal)], "programs": [programs]}
    compiled, out = run(torch, fn, [q, k, value, *scales], "native", space=space)
    assert "block_n = 256" in compiled.ir("schedule")
    walks = b * h * -(-s // 128) > programs and (causal or -(-n // 256) >= 2)
    grid = f"{programs}, 1, 1" if walks else f"{-(-s // 128)}, {b * h}, 1"
    assert f"grid = array<i64: {grid}>" in compiled.ir("tile")
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)


@pytest.mark.parametrize("fn,b,h,s,n,d", [(fp8_attention_vt, 4, 16, 1031, 1040, 128),
                                          (causal_fp8_attention, 4, 16, 1031, 1031, 64)],
                         ids=["vt", "causal"])
def test_fp8_attention_default_over_four_waves(torch_cuda, hopper, fn, b, h, s, n, d):
    """The derived schedule where 128-row query blocks fill 4+ waves: 256-key blocks, walking."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    causal = fn is causal_fp8_attention
    value = v if causal else v.transpose(-1, -2).contiguous()
    compiled, out = run(torch, fn, [q, k, value, *scales], "native")
    assert "block_n = 256" in compiled.ir("schedule") and "persistent = 1" in compiled.ir("schedule")
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)


@pytest.mark.parametrize("q_scale", [-0.5, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("fn", [causal_fp8_attention, fp8_attention_vt], ids=lambda f: f.name)
@pytest.mark.parametrize("b,h,s,n,d,split", [(1, 2, 1000, 1024, 128, 1), (2, 2, 257, 1000, 64, 1),
                                             (2, 2, 257, 1000, 64, None), (4, 16, 1031, 1040, 128, None)])
def test_fp8_attention_with_a_negative_or_zero_scale(torch_cuda, hopper, fn, b, h, s, n, d, split, q_scale):
    """The scales, read at run time, fold into the exponent's fma with their product's sign
    choosing the row max (the min where negative) and a mask's fill (`_SignedScale`): a negative
    scale, and zero (a uniform softmax over the keys kept), against float64. Split-KV's runs (the
    derived schedule of the small grid) keep the multiply; the last shape takes fp8's derived
    schedule (256-key blocks, walking)."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    scales[0] = torch.tensor([q_scale], device="cuda")
    causal = fn is causal_fp8_attention
    value = v if causal else v.transpose(-1, -2).contiguous()
    compiled, out = run(torch, fn, [q, k, value, *scales], "native", space={"split_kv": [split]} if split else None)
    tile_ir = compiled.ir("tile")
    assert ("tile.extract" in tile_ir) == ("_partials" not in tile_ir) and ("_partials" in tile_ir) == (split is None
                                                                                                       and s < 1000)
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)


def test_plain_call_with_torch_tensors(torch_cuda):
    """`fp8_attention(q, k, v, sq, sk, sv)` on CUDA tensors, as a user writes it: bf16 out."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, 2, 4, 300, 300, 128)
    out = fp8_attention(q, k, v, *scales)
    assert out.dtype == torch.bfloat16
    check(torch, out, reference(torch, q, k, v, scales, False), False)


#: a 64-row query tile: one computing warpgroup, which takes no turns
ONE_WARPGROUP = {"warp_specialize": [1], "num_warps": [8], "block_m": [64], "block_n": [128], "split_kv": [1]}


@pytest.mark.parametrize("fn,b,h,s,n,d,space", [
    (causal_fp8_attention, 2, 3, 300, 272, 64, None),          # a 16-key tail, past it the next head's keys
    (causal_fp8_attention, 1, 1, 200, 80, 64, ONE_WARPGROUP),   # 80 keys of a 128-key block, nothing past them
    (causal_fp8_attention, 2, 2, 1031, 1040, 64, {"split_kv": [1]}),
    (causal_fp8_attention, 4, 16, 1031, 1040, 128, None),      # 256-key blocks, walking (fp8's derived schedule)
    (causal_fp8_attention, 1, 2, 4097, 4112, 128, WIDE),
    (fp8_attention_vt, 2, 2, 513, 4112, 128, {**WIDE, "pingpong": [0]}),
    (fp8_attention, 3, 5, 257, 1024, 64, {"pingpong": [0], "split_kv": [1]}),
])
def test_fp8_attention_over_permuted_keys(torch_cuda, hopper, fn, b, h, s, n, d, space):
    """Keys loaded permuted in each 16 (`lowering.byte_fragments`, without warpgroup turns): the
    scores' columns in 8-bit A order, the causal mask and the key tail computed from them, against
    float64 (key tails inside a head, whose box reads on into the next head's keys, and at the end)."""
    torch = torch_cuda
    q, k, v, scales = inputs(torch, b, h, s, n, d)
    value = v.transpose(-1, -2).contiguous() if fn is fp8_attention_vt else v
    compiled, out = run(torch, fn, [q, k, value, *scales], "native", space=space)
    assert "{byte_a_rows}" in compiled.ir("target") and "warpgroup_turn" not in compiled.ir("target")
    causal = fn is causal_fp8_attention
    check(torch, out, reference(torch, q, k, v, scales, causal), causal)
