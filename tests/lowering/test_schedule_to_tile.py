"""What the Schedule -> Tile lowering writes into a flash-attention step: the softmax's per-element
work (one fma and one exp2, the scale folded in) and the key-tail mask only where a tail exists."""
import math

import numpy as np
import pytest
from xdsl.dialects import arith, scf
from xdsl.dialects import math as mathd

import tessera as tsr
from tessera import Tensor
from tessera.ir import tile

from attention_cases import causal_temperature, temperature
from seed_kernels import causal_attention


@tsr.function
def scaled_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])), dim=-1), v)


@tsr.function
def divided_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), dim=-1), v)


@tsr.function
def softcapped(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = 30.0 * tsr.tanh(tsr.matmul(q, k.transpose(-2, -1)) * 0.125 / 30.0)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def recent_keys(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    """Each query sees the keys from 40 before it onwards (a lower bound on the columns only)."""
    s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
    i = tsr.arange(q.shape[-2])
    return tsr.matmul(tsr.softmax(tsr.where(i[None, :] >= i[:, None] - 40, s, -math.inf), dim=-1), v)


def loop_ops(fn, s, path="ampere", **space):
    """The ops of the attention kernel's key-block loop (the mma.sync path's unless `path="native"`),
    with the schedule `space` pins (e.g. qk_ahead=[1]: the next block's scores computed ahead); one
    kernel (two heads of 1024 queries would otherwise split their keys across the GPU's blocks)."""
    compiled = fn.compile(fn.arg_specs_for(dict(B=1, H=2, S=s, D=64), "fp16"), arch="sm_90a", path=path,
                          space={"split_kv": [1], **space})
    (loop,) = [op for op in compiled.modules["tile"].walk() if isinstance(op, scf.ForOp)]
    return [op for op in loop.body.block.ops]


def full_tiles(ops, kind):
    return [op for op in ops if isinstance(op, kind) and len(getattr(op.results[0].type, "shape", ())) == 2]


@pytest.mark.parametrize("fn", [scaled_attention, divided_attention], ids=["times", "divided"])
def test_scale_folds_into_one_fma_and_exp2_per_element(fn):
    ops = loop_ops(fn, 1024)
    assert len(full_tiles(ops, mathd.FmaOp)) == 1 and len(full_tiles(ops, mathd.Exp2Op)) == 1
    assert not full_tiles(ops, mathd.ExpOp)
    # the score tile is not multiplied element by element (only the accumulator's rescale is)
    assert len(full_tiles(ops, arith.MulfOp)) == 1 and not full_tiles(ops, arith.DivfOp)
    assert not [op for op in ops if isinstance(op, tile.CmpiOp)]   # 1024 keys: every block is full


@pytest.mark.parametrize("path", ["ampere", "native"])
def test_a_scale_read_at_run_time_folds_into_the_fma_its_sign_choosing_the_row_max(path):
    """softmax(t * s) with t a tensor: no multiply of the score tile; the loop keeps the max of
    sign(t) * s, a uniform branch on t < 0 between the row min (negated) and the row max."""
    ops = loop_ops(temperature, 1024, path=path)
    assert len(full_tiles(ops, mathd.FmaOp)) == 1 and len(full_tiles(ops, arith.MulfOp)) == 1
    (branch,) = [op for op in ops if isinstance(op, scf.IfOp)
                 and any(isinstance(r, tile.ReduceOp) for r in op.true_region.walk())]
    assert isinstance(branch.cond.owner, tile.CmpfOp) and isinstance(branch.cond.owner.lhs.owner, arith.MulfOp)
    kinds = [[r.kind.data for r in region.walk() if isinstance(r, tile.ReduceOp)]
             for region in (branch.true_region, branch.false_region)]
    assert kinds == [["min"], ["max"]]


@pytest.mark.parametrize("scale", [0.7, -0.7, 0.0, -0.0, 40.0])
@pytest.mark.parametrize("fn,upper", [(temperature, None), (causal_temperature, 0)],
                         ids=["plain", "causal"])
def test_an_attention_scaled_at_run_time_matches_float64_for_either_sign(fn, upper, scale):
    """Either sign of the scale (a negative one flips which score is the max, and a mask's fill
    with it), zero (a uniform softmax over the keys kept) and a large one, with a partial last
    key block, on the interpreter against float64."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 100, 64)).astype(np.float32) for _ in range(3))
    t = np.array([scale], np.float32)
    compiled = fn.compile(fn.arg_specs_for(dict(B=1, H=2, S=100, D=64), "fp32"), arch="sm_90a",
                          space={"split_kv": [1], "block_n": [64]})
    assert "tile.extract" in compiled.ir("tile")
    out = compiled.run(q, k, v, t)[0]
    ref = attention_reference(q, k, v, scale * 0.125, upper=upper)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("fn,upper", [(temperature, None), (causal_temperature, 0)], ids=["plain", "causal"])
def test_a_scale_read_at_run_time_in_the_scores_ahead_loop(fn, upper):
    """The same with block i + 1's scores computed ahead of block i's P @ V (the Hopper D = 128
    loop, warp-specialized): a negative and a positive scale against float64."""
    rng = np.random.default_rng(3)
    f = tsr.function(fn.fn, space={"qk_ahead": [1], "num_stages": [2], "warp_specialize": [1], "block_n": [128],
                                   "block_m": [64], "split_kv": [1]})
    compiled = f.compile(f.arg_specs_for(dict(B=1, H=2, S=300, D=128), "fp32"), arch="sm_90a")
    assert "tile.extract" in compiled.ir("tile") and "qk_ahead = 1" in compiled.ir("schedule")
    for scale in (0.9, -0.9):
        q, k, v = (rng.standard_normal((1, 2, 300, 128)).astype(np.float32) for _ in range(3))
        out = compiled.run(q, k, v, np.array([scale], np.float32))[0]
        ref = attention_reference(q, k, v, scale * 0.125, upper=upper)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("stages", [2, 3])
def test_native_loop_computes_the_next_scores_before_this_blocks_p_at_v(stages):
    """Block i + 1's Q @ K^T is issued first, then block i's P @ V; the wait for one mma group
    retires the scores while P @ V runs through the softmax; P @ V is waited for before the next P
    is written. Keys and values have pipelines of their own: the value tile is read (on TMA, waited
    for) after the scores are issued. Every block the loop reads is a real one: only a partial
    last block is masked."""
    ops = loop_ops(scaled_attention, 1024, path="native", num_stages=[stages], qk_ahead=[1])
    k_read, v_read = [op for op in ops if isinstance(op, tile.LoadSharedOp)]
    assert k_read.src is not v_read.src and k_read.src.type.get_shape()[0] == stages   # a pipeline each

    def step(op):
        if isinstance(op, tile.MmaWaitOp):
            return ("wait", op.pending.value.data)
        if isinstance(op, tile.LoadSharedOp):
            return ("read", "K" if op is k_read else "V")
        return ("mma", "scores" if op.b is k_read.results[0] else "P @ V")
    order = [step(op) for op in ops if isinstance(op, (tile.MmaOp, tile.MmaWaitOp, tile.LoadSharedOp))]
    assert order == [("read", "K"), ("mma", "scores"), ("read", "V"), ("mma", "P @ V"), ("wait", 1), ("wait", 0)]
    assert not [op for op in ops if isinstance(op, scf.IfOp)]
    unmasked, masked = masking_branch(loop_ops(scaled_attention, 1000, path="native", num_stages=[stages],
                                               qk_ahead=[1]))
    assert len(unmasked) == 1 and [op for op in masked if isinstance(op, tile.SelectOp)]


def test_pingpong_warpgroups_take_turns_at_p_at_v_and_the_next_scores():
    """`pingpong`: warpgroup 1 gives warpgroup 0 the first turn and each takes its own before the
    loop; an iteration gives the turn once its scores are issued (before waiting for them) and takes
    it back after the softmax and the accumulator's rescale, right before P @ V; warpgroup 0 gives
    warpgroup 1 its last turn after the loop. Every give meets a take."""
    compiled = scaled_attention.compile(scaled_attention.arg_specs_for(dict(B=1, H=2, S=1024, D=64), "fp16"),
                                        arch="sm_90a", path="native",
                                        space={"split_kv": [1], "warp_specialize": [1], "num_warps": [8],
                                               "pingpong": [1]})
    kernel = next(op for op in compiled.modules["tile"].walk() if isinstance(op, tile.KernelOp))
    (loop,) = [op for op in kernel.walk() if isinstance(op, scf.ForOp)]

    def turn(op):
        return (op.action.data, None if op.warpgroup is None else op.warpgroup.value.data)
    outside = [op for op in kernel.walk() if isinstance(op, tile.MmaTurnOp) and op.parent_op() is not loop]
    before = [turn(op) for op in outside if kernel.body.block.get_operation_index(op)
              < kernel.body.block.get_operation_index(loop)]
    after = [turn(op) for op in outside if turn(op) not in before]
    assert before == [("give", 1), ("take", None)] and after == [("give", 0)]

    def step(op):
        if isinstance(op, tile.MmaTurnOp):
            return turn(op)
        if isinstance(op, tile.MmaWaitOp):
            return ("wait", op.pending.value.data)
        if isinstance(op, arith.MulfOp):
            return ("rescale",)
        return ("mma",)
    order = [step(op) for op in loop.body.block.ops if isinstance(op, (tile.MmaOp, tile.MmaWaitOp, tile.MmaTurnOp))
             or (isinstance(op, arith.MulfOp) and tuple(op.result.type.get_shape()) == (128, 64))]
    assert order == [("mma",), ("give", None), ("wait", 0), ("rescale",), ("take", None), ("mma",)]


def test_without_pingpong_or_two_warpgroups_no_turns_are_taken():
    """No turns without the switch, nor where a 64-row query tile leaves one computing warpgroup."""
    for space in (dict(warp_specialize=[1], num_warps=[8]), dict(warp_specialize=[1], num_warps=[8], pingpong=[1],
                                                                 block_m=[64])):
        ops = loop_ops(scaled_attention, 1024, path="native", **space)
        assert not [op for op in ops if isinstance(op, tile.MmaTurnOp)]


def masking_branch(ops):
    """The scf.if that masks only the key blocks that need it: (then ops, else ops)."""
    (branch,) = [op for op in ops if isinstance(op, scf.IfOp)]
    return list(branch.true_region.block.ops), list(branch.false_region.block.ops)


def test_only_a_partial_last_key_block_is_masked():
    assert not [op for op in loop_ops(scaled_attention, 1024) if isinstance(op, scf.IfOp)]
    unmasked, masked = masking_branch(loop_ops(scaled_attention, 1000))
    assert len(unmasked) == 1 and isinstance(unmasked[0], scf.YieldOp)   # full blocks: the scores as they are
    assert [op for op in masked if isinstance(op, tile.SelectOp)]


def test_causal_masks_only_blocks_that_cross_the_diagonal():
    ops = loop_ops(causal_attention, 1024)
    unmasked, masked = masking_branch(ops)
    assert len(unmasked) == 1 and [op for op in masked if isinstance(op, tile.SelectOp)]
    assert not [op for op in ops if isinstance(op, tile.SelectOp) and len(op.result.type.get_shape()) == 2]


def test_score_mods_other_than_a_positive_scale_stay_as_written():
    ops = loop_ops(softcapped, 1024)
    assert [op for op in ops if isinstance(op, mathd.TanhOp)]
    assert len(full_tiles(ops, mathd.FmaOp)) == 1


@pytest.mark.parametrize("fn", [scaled_attention, divided_attention, softcapped, causal_attention, recent_keys],
                         ids=["scaled", "divided", "softcap", "causal", "recent"])
@pytest.mark.parametrize("s", [64, 100, 300])
def test_folded_softmax_matches_numpy(fn, s):
    rng = np.random.default_rng(s)
    q, k, v = (rng.standard_normal((1, 2, s, 64)).astype(np.float32) for _ in range(3))
    scores = q @ k.transpose(0, 1, 3, 2)
    if fn is softcapped:
        scores = 30.0 * np.tanh(scores * 0.125 / 30.0)
    else:
        scores = scores / 8.0
    i = np.arange(s)
    if fn is causal_attention:
        scores = np.where(i[None, :] <= i[:, None], scores, -np.inf)
    if fn is recent_keys:
        scores = np.where(i[None, :] >= i[:, None] - 40, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(fn(q, k, v), (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-4, atol=1e-5)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@pytest.mark.parametrize("stages,mma_async", [(1, 0), (2, 1), (3, 0), (4, 1)])
@pytest.mark.parametrize("dims", [dict(M=100, K=70, N=90), dict(M=330, K=40, N=97), dict(M=200, K=20, N=64)],
                         ids=["tails", "last-group", "prologue-spans-tiles"])
def test_persistent_gemm_matches_numpy(stages, mma_async, dims):
    """Five blocks walk every tile in grouped order (groups of 4 tile rows; 330 rows leave a last
    group of 3) with one pipeline across tiles, on the tile interpreter, whose copies land late;
    with 2 k steps a tile, 4 stages' prologue already reaches into a block's second tile."""
    fn = tsr.function(gemm.fn, space=dict(persistent=[1], programs=[5], block_m=[32], block_n=[32], block_k=[16],
                                          num_stages=[stages], mma_async=[mma_async], group_m=[4]))
    compiled = fn.compile(fn.arg_specs_for(dims, "fp32"), arch="sm_90a")
    assert "grid = array<i64: 5, 1, 1>" in compiled.ir("tile")
    rng = np.random.default_rng(stages)
    a = rng.standard_normal((dims["M"], dims["K"])).astype(np.float32)
    b = rng.standard_normal((dims["K"], dims["N"])).astype(np.float32)
    np.testing.assert_allclose(compiled.run(a, b)[0], a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("dims,space,dynamic", [
    (dict(M=100, K=72, N=88), dict(persistent=[1], programs=[4]), ()),     # tails; 4 tile rows in pairs
    (dict(M=330, K=40, N=104), dict(persistent=[1], programs=[6]), ()),    # 11 tile rows: the last pair's 2nd past M
    (dict(M=200, K=24, N=64), dict(persistent=[1], programs=[2]), ()),     # 2 k steps: the prologue spans tiles
    (dict(M=128, K=88, N=96), dict(persistent=[0]), ()),                   # a tile a block, clusters along the grid
    (dict(M=330, K=40, N=104), dict(persistent=[1], programs=[6]), ("M",)),  # tile rows counted at run time
], ids=["tails", "odd-tile-rows", "prologue-spans-tiles", "tile-per-block", "dynamic-m"])
def test_cluster_gemm_matches_numpy(stages, dims, space, dynamic):
    """Blocks in clusters of two computing consecutive tile rows of one tile column, whose B tiles
    the cluster copies once (`cluster`): the Tile IR releases each stage (`tile.release_stage`) and
    refills a stage one iteration after its release, on the tile interpreter, whose copies land
    late (a wait counting the groups in flight wrongly reads a stage before its copy lands). Blocks
    walking tiles pair up over any count of tile rows: a last row past M computes padding, stored
    nowhere."""
    fn = tsr.function(gemm.fn, space=dict(cluster=[2], block_m=[32], block_n=[32], block_k=[16],
                                          num_stages=[stages], mma_async=[1], group_m=[4], **space))
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), dynamic=frozenset(dynamic), arch="sm_90a")
    ir = compiled.ir("tile")
    assert "tessera.cluster = 2" in ir and "tile.release_stage" in ir
    rng = np.random.default_rng(stages)
    for m in (dims["M"], 97) if dynamic else (dims["M"],):
        a = rng.standard_normal((m, dims["K"])).astype(np.float16)
        b = rng.standard_normal((dims["K"], dims["N"])).astype(np.float16)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(compiled.run(a, b)[0].astype(np.float64), ref, rtol=2e-2, atol=5e-2)


def test_persistent_gemm_keeps_a_tile_per_block_where_it_gains_nothing():
    """No more tiles than blocks, one k step a tile, or warp specialization: one tile per block."""
    def grid(dims, **space):
        fn = tsr.function(gemm.fn, space={"persistent": [1], "programs": [4], "block_m": [128], "block_n": [256],
                                          **space})
        ir = fn.compile(fn.arg_specs_for(dims, "fp16"), arch="sm_90a").ir("tile")
        return next(line for line in ir.splitlines() if "tile.launch" in line).split("grid = ")[1][:24]
    assert grid(dict(M=1024, K=512, N=1024)).startswith("array<i64: 4,")       # 32 tiles of 128 x 256
    assert grid(dict(M=256, K=512, N=256)).startswith("array<i64: 2,")         # 2 tiles: one each
    assert grid(dict(M=1024, K=64, N=1024)).startswith("array<i64: 32,")       # one k step
    assert grid(dict(M=1024, K=512, N=1024), warp_specialize=[1]).startswith("array<i64: 32,")


def test_persistent_gemm_launches_a_block_per_sm_of_the_device():
    """`programs` follows the SM count of the device compiled for (an H100 PCIe has 114 where the
    registry's sm_90a has 132), so no block waits for a second wave."""
    for sms in (None, 114):
        compiled = gemm.compile(gemm.arg_specs_for(dict(M=4096, K=4096, N=4096), "fp16"), arch="sm_90a",
                                **({"sm_count": sms} if sms else {}))
        assert f"grid = array<i64: {sms or 132}, 1, 1>" in compiled.ir("tile")


@tsr.function
def batched_linear_gelu(a: Tensor["B", "M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@pytest.mark.parametrize("split_k,stages,mma_async", [(2, 1, 0), (3, 2, 1), (4, 3, 0), (64, 2, 0)])
@pytest.mark.parametrize("dims", [dict(B=1, M=1, K=200, N=40), dict(B=2, M=70, K=1000, N=33)],
                         ids=["one-row", "tails"])
def test_split_k_gemm_matches_numpy(split_k, stages, mma_async, dims):
    """K split across blocks into fp32 partial products, summed with the epilogue by a second
    kernel. K = 1000 in steps of 16 makes 63 steps: 3 ways is 21 each, 4 ways leaves the last
    split 15; 64 ways is capped at one step per split (63 splits)."""
    fn = tsr.function(batched_linear_gelu.fn, space=dict(split_k=[split_k], block_m=[32], block_n=[32],
                                                         block_k=[16], num_stages=[stages], mma_async=[mma_async]))
    compiled = fn.compile(fn.arg_specs_for(dims, "fp32"), arch="sm_90a")
    steps = -(-dims["K"] // 16)
    splits = -(-steps // -(-steps // split_k))
    host = compiled.ir("tile").split("func.func")[1]
    assert f"tile.alloc_global : memref<{splits}x{dims['B']}x{dims['M']}x{dims['N']}xf32>" in host
    launches = [line.split("(")[0].split("@")[1] for line in host.splitlines() if "tile.launch" in line]
    assert launches == ["batched_linear_gelu_gemm_0_partials", "batched_linear_gelu_gemm_0"]
    assert f"grid = array<i64: {-(-dims['M'] // 32) * 2}, {dims['B']}, {splits}>" in host
    rng = np.random.default_rng(split_k)
    a = rng.standard_normal((dims["B"], dims["M"], dims["K"])).astype(np.float32)
    b = rng.standard_normal((dims["K"], dims["N"])).astype(np.float32)
    bias = rng.standard_normal(dims["N"]).astype(np.float32)
    np.testing.assert_allclose(compiled.run(a, b, bias)[0], compiled.reference(a, b, bias)[0], rtol=1e-4, atol=1e-4)


def test_a_split_copies_only_its_own_k_steps(monkeypatch):
    """A split's pipeline issues copies past its last step (4 stages run 3 steps ahead); those read
    padding, not the next split's K range, which another block loads: over every block, each of
    the 64 K steps' A and B tiles is copied from memory exactly once."""
    from tessera.interpreter import tile_interp

    k_offsets = []
    original = tile_interp.BUILDERS[tile.CopyAsyncOp]

    def counting(c, op):
        step, offsets = original(c, op), [c.slot(v) for v in op.offsets]
        k_dim = 1 if op.src.type.get_shape()[0] == 32 else 0     # A is 32 x 1024, B is 1024 x 32

        def counted(f):
            k_offsets.append(int(f[offsets[k_dim]]))
            step(f)
        return counted
    monkeypatch.setitem(tile_interp.BUILDERS, tile.CopyAsyncOp, counting)
    fn = tsr.function(gemm.fn, space=dict(split_k=[4], block_m=[32], block_n=[32], block_k=[16], num_stages=[4]))
    compiled = fn.compile(fn.arg_specs_for(dict(M=32, K=1024, N=32), "fp32"), arch="sm_90a", backend="ptx")
    a, b = np.ones((32, 1024), np.float32), np.ones((1024, 32), np.float32)
    np.testing.assert_allclose(compiled.run(a, b)[0], a @ b)
    assert sorted(k for k in k_offsets if k < 1024) == sorted(2 * list(range(0, 1024, 16)))


@pytest.mark.parametrize("pin", [dict(persistent=[1], programs=[8]), dict(warp_specialize=[1])])
def test_a_pinned_switch_the_partial_products_cannot_honour_keeps_one_kernel(pin):
    """The derived split_k yields to a space that pins `persistent` or `warp_specialize` on, which
    only the one-kernel GEMM honours (512 x 4096 x 512 would otherwise split 4 ways on sm_90a)."""
    plain = gemm.compile(gemm.arg_specs_for(dict(M=512, K=4096, N=512), "fp16"), arch="sm_90a")
    assert "_partials" in plain.ir("tile")
    fn = tsr.function(gemm.fn, space=pin)
    compiled = fn.compile(fn.arg_specs_for(dict(M=512, K=4096, N=512), "fp16"), arch="sm_90a")
    assert "_partials" not in compiled.ir("tile")


# --- split-KV attention (flash-decoding) ------------------------------------------------------------

def decode_reference(q, k, v, cap=None):
    """Attention of the last M positions over N keys (bottom-right causal), in float64."""
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / math.sqrt(q.shape[-1])
    if cap:
        s = np.tanh(s / cap) * cap
    m, n = s.shape[-2:]
    s = np.where(np.arange(m)[:, None] + (n - m) >= np.arange(n)[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


@tsr.function
def capped_gqa(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"], v: Tensor["B", "Hk", 1, "N", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    rows, cols = tsr.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2]), tsr.arange(k.shape[-2])
    s = tsr.where(rows[:, None] >= cols[None, :], tsr.tanh(s / 30.0) * 30.0, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@pytest.mark.parametrize("split,stages", [(1, 2), (3, 2), (4, 1), (7, 3), (40, 2), (64, 2)])
@pytest.mark.parametrize("m,n", [(1, 1000), (5, 333), (16, 97)])
def test_split_kv_attention_matches_float64(split, stages, m, n):
    """Key blocks split `split` ways (32-key blocks: 1000 keys make 32 blocks, 97 keys 4, so 64
    ways leaves most splits empty, and a causal query block can see fewer blocks than splits; the
    second kernel combines 16 splits at a time, and at 40 ways the last 8 after its loop):
    a first kernel's per-split outputs and log-sum-exps, combined by a second, equal attention
    in one kernel; GQA through a broadcast head dim (its 6 heads a block's query rows where
    M < 6), soft-capping and the decode offset mask."""
    from decode_attention import decode_attention
    rng = np.random.default_rng(split * 1000 + m)
    space = dict(split_kv=[split], block_n=[32], num_stages=[stages])
    for fn, shape in ((decode_attention, dict(B=2, H=3, M=m, N=n, D=64)),
                      (capped_gqa, dict(B=1, Hk=2, G=6, M=m, N=n, D=64))):   # rows: G for M < 6
        fn = tsr.function(fn.fn, space=space)
        specs = fn.arg_specs_for(shape, "fp32")
        compiled = fn.compile(specs, arch="sm_90a", backend="ptx")
        if split > 1:
            assert compiled.kernel_names[0].endswith("_partials")
        args = [rng.standard_normal(spec.shape).astype(np.float32) for spec in specs]
        out = compiled.run(*args)[0]
        np.testing.assert_allclose(out, decode_reference(*args, cap=30.0 if fn.name == "capped_gqa" else None),
                                   rtol=2e-5, atol=2e-5)


def test_a_split_reads_only_its_own_key_blocks(monkeypatch):
    """A split's pipeline issues copies past its last block (3 stages run 2 blocks ahead); those
    read padding, not the next split's keys, which another block loads: over every block, each of
    the 32 key blocks' K and V tiles is copied from memory exactly once (its query tile apart)."""
    from decode_attention import decode_attention
    from tessera.interpreter import tile_interp

    key_offsets = []
    original = tile_interp.BUILDERS[tile.CopyAsyncOp]

    def counting(c, op):
        step, offsets = original(c, op), [c.slot(v) for v in op.offsets]

        def counted(f):
            if op.src.type.get_shape()[-2] == 1024:   # K or V [B, H, N, D], not Q [B, H, 1, D]
                key_offsets.append(int(f[offsets[2]]))
            step(f)
        return counted
    monkeypatch.setitem(tile_interp.BUILDERS, tile.CopyAsyncOp, counting)
    fn = tsr.function(decode_attention.fn, space=dict(split_kv=[5], block_n=[32], num_stages=[3]))
    specs = fn.arg_specs_for(dict(B=1, H=1, M=1, N=1024, D=64), "fp32")
    compiled = fn.compile(specs, arch="sm_90a", backend="ptx")
    args = [np.ones(spec.shape, np.float32) for spec in specs]
    np.testing.assert_allclose(compiled.run(*args)[0], np.ones((1, 1, 1, 64)), rtol=1e-6)
    assert sorted(k for k in key_offsets if k < 1024) == sorted(2 * list(range(0, 1024, 32)))


@pytest.mark.parametrize("kind", ["causal", "softcap_causal", "plain"])
@pytest.mark.parametrize("s,block_m", [(1, 64), (67, 64), (300, 128), (257, 64)])
def test_heaviest_query_blocks_first_match_float64(kind, s, block_m, random_inputs, assert_matches_reference):
    """`heavy_first`: blocks in launch order take the last query blocks of every batch program first
    (6 programs over 2 batch dims); every output row is still written once, with its own rows' keys.
    (split_kv pinned to 1: on this small grid the derived split would take its own order.)"""
    from attention_cases import FUNCTIONS
    fn = tsr.function(FUNCTIONS[kind].fn, space=dict(heavy_first=[1], block_m=[block_m], block_n=[32], split_kv=[1]))
    dims = dict(B=2, H=3, M=s, N=s, D=64) if kind == "plain" else dict(B=2, H=3, S=s, D=64)
    specs = fn.arg_specs_for(dims, "fp32")
    compiled = fn.compile(specs, arch="sm_90a", backend="ptx")
    assert_matches_reference(compiled, random_inputs(specs, s))


@pytest.mark.parametrize("heavy_first", [0, 1])
def test_heaviest_query_blocks_are_launched_first(heavy_first, monkeypatch):
    """The order itself, as the interpreter launches blocks (axis 0 fastest, as the GPU does): under a
    causal mask `heavy_first` gives the first 6 blocks (one per batch program) the last query block,
    the next 6 the one before, ...; without it each batch program's blocks run first to last."""
    from attention_cases import FUNCTIONS
    from tessera.interpreter import tile_interp

    stores = []
    original = tile_interp.BUILDERS[tile.StoreOp]

    def recording(c, op):
        step, offsets = original(c, op), [c.slot(v) for v in op.offsets]

        def recorded(f):
            if tuple(op.dst.type.get_shape()) == (2, 3, 300, 64):      # the output, not the log-sum-exp
                stores.append(tuple(int(f[o]) for o in offsets[:3]))   # (b, h, first query row)
            step(f)
        return recorded
    monkeypatch.setitem(tile_interp.BUILDERS, tile.StoreOp, recording)
    fn = tsr.function(FUNCTIONS["causal"].fn, space=dict(heavy_first=[heavy_first], block_m=[64], block_n=[32], split_kv=[1]))
    specs = fn.arg_specs_for(dict(B=2, H=3, S=300, D=64), "fp32")
    compiled = fn.compile(specs, arch="sm_90a", backend="ptx")
    compiled.run(*[np.zeros(spec.shape, np.float32) for spec in specs])
    rows = [row for _, _, row in stores]
    if heavy_first:
        assert rows == [64 * (4 - i // 6) for i in range(30)]
        assert [(b, h) for b, h, _ in stores[:6]] == [(b, h) for b in range(2) for h in range(3)]
    else:
        assert rows == [64 * (i % 5) for i in range(30)]


@pytest.mark.parametrize("g,m,rows", [(4, 1, "G"), (8, 1, "G"), (32, 16, "M")])
def test_grouped_query_heads_are_the_query_rows_of_a_decode_block(g, m, rows):
    """With one query, the query heads sharing one KV head are a block's rows: the Q tile is
    copied along G, and K and V are read once per KV head. (A few queries of at most 128 heads x
    queries are merged into one row dim before fusion: tests/passes/test_query_groups.py; 32 x 16
    are more, and keep M as the rows.)"""
    from decode_attention import gqa_decode_attention
    dims = dict(B=2, Hk=3, G=g, M=m, N=512, D=64)
    compiled = gqa_decode_attention.compile(gqa_decode_attention.arg_specs_for(dims, "fp16"), arch="sm_90a",
                                            space=dict(split_kv=[1]))
    (kernel,) = [op for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp)]
    (q_copy,) = [op for op in kernel.walk() if isinstance(op, tile.CopyAsyncOp) and op.src.type.get_shape()[2] == g]
    assert tuple(q_copy.tile_dims.get_values())[0] == (2 if rows == "G" else 3)
    host = compiled.ir("tile").split("func.func")[-1]
    programs = 2 * 3 * (m if rows == "G" else g)
    assert f"grid = array<i64: 1, {programs}, 1>" in host


# --- column reductions (a reduction over a leading axis) -------------------------------------------

@tsr.function
def column_sum(x: Tensor["M", "N"]):
    return tsr.sum(x * 2.0, 0)


@tsr.function
def column_stats(x: Tensor["B", "M", "N"]):
    """Over the middle axis (B is a batch axis of the grid): mean kept as [B, 1, N], max and min."""
    return tsr.mean(x, 1, keepdim=True), tsr.amax(x, 1), tsr.amin(x, 1).to(tsr.fp16)


def column_kernels(compiled) -> list[str]:
    host = compiled.ir("tile").split("func.func")[-1]
    return [line.split("(")[0].split("@")[1] for line in host.splitlines() if "tile.launch" in line]


@pytest.mark.parametrize("split_rows", [1, 3, 64])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 3), (97, 1000), (1000, 33), (4097, 7)])
def test_column_sum_matches_float64(split_rows, m, n):
    """The sum over rows takes the column template (one kernel, or partial results per split and a
    second kernel combining them in order) and matches float64 at awkward shapes."""
    fn = tsr.function(column_sum.fn, space=dict(split_rows=[split_rows], block_m=[16], block_n=[64]))
    compiled = fn.compile(fn.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    kernels = column_kernels(compiled)
    split = split_rows > 1 and m > 64     # under 65 rows: one step of the tile
    assert kernels == ["column_sum_column_reduction_0_partials"] * split + ["column_sum_column_reduction_0"]
    x = np.random.default_rng(m * n).standard_normal((m, n)).astype(np.float32)
    want = (2.0 * x.astype(np.float64)).sum(0)
    np.testing.assert_allclose(compiled.run(x)[0], want, rtol=1e-5, atol=1e-4 * math.sqrt(m))


@pytest.mark.parametrize("split_rows", [1, 4])
def test_column_mean_max_min_over_a_middle_axis(split_rows):
    fn = tsr.function(column_stats.fn, space=dict(split_rows=[split_rows]))
    compiled = fn.compile(fn.arg_specs_for(dict(B=3, M=301, N=130)), arch="sm_90a")
    assert sum("column_reduction" in k and "partials" not in k for k in column_kernels(compiled)) == 3
    x = np.random.default_rng(split_rows).standard_normal((3, 301, 130)).astype(np.float32)
    x[1, 200, 7] = 50.0
    x[2, 0, 129] = -50.0
    mean, hi, lo = compiled.run(x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(hi, x.max(1))
    np.testing.assert_array_equal(lo, x.min(1).astype(np.float16))
    assert lo.dtype == np.float16 and mean.shape == (3, 1, 130)


# --- norm backwards: saved statistics, row statistics broadcast over their rows, column riders ------

def _rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def norm_kernels(fn) -> list[list[str]]:
    """The kernels of each compile of fn's vjp (after a call)."""
    return [c.kernel_names for d in fn._vjp_derivatives.values() for c in d._cache.values()]


def float64_norm_vjp(x, params, dy, layer: bool):
    import torch
    leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, *params)]
    n = x.shape[-1]
    out = (torch.nn.functional.layer_norm(leaves[0], (n,), leaves[1], leaves[2], 1e-5) if layer
           else torch.nn.functional.rms_norm(leaves[0], (n,), leaves[1], 1e-6))
    return [g.numpy() for g in torch.autograd.grad(out, leaves, torch.tensor(dy, dtype=torch.float64))]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_norm_backward_is_one_row_kernel_and_one_combine(dtype):
    """The forward saves rstd (and mean) from the norm's own kernel; the backward's dx kernel takes
    the row statistic's broadcast epilogue and carries the weight's (and bias's) column sums, which
    one kernel combines, each cast to its parameter's dtype there (16-bit parameters: no kernel of
    its own for the [1, N] -> [N] reshape and the cast)."""
    from tessera.autodiff.api import saving
    rms = tsr.function(_rms_norm)
    ln = tsr.function(_layer_norm)
    np_dtype = tsr.dtypes.lookup(dtype).np
    x, w, b = (np.ones(shape, np_dtype) for shape in ((64, 256), 256, 256))
    for fn, params, saved in ((rms, [w], 1), (ln, [w, b], 2)):
        forward = saving(fn).compile(fn.arg_specs_for(dict(M=64, N=256), dtype), arch="sm_90a")
        assert len(forward.kernel_names) == 1 and len(forward.result_names) == 1 + saved
        _, f_vjp = tsr.vjp(fn, x, *params)
        grads = f_vjp(x)
        assert all(g.dtype == x.dtype and g.shape == a.shape for g, a in zip(grads, (x, *params)))
    assert norm_kernels(rms) == [["_rms_norm_vjp_row_reduction_0", "_rms_norm_vjp_row_reduction_0_combine"]]
    # (a layer_norm's two row reductions, mean(dy * w) and mean(dy * w * x_hat), share the kernel)
    assert norm_kernels(ln) == [["_layer_norm_vjp_row_reduction_0", "_layer_norm_vjp_row_reduction_0_combine"]]


@tsr.function
def centered_stats(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    """Three row statistics of two inputs, read broadcast over their rows by one expression."""
    return (x - tsr.mean(x, -1, keepdim=True)) * tsr.amax(y, -1, keepdim=True) + y * tsr.sum(x * y, -1, keepdim=True)


@pytest.mark.parametrize("space", [{}, dict(block_n=[64], block_m=[4]), dict(block_n=[64], block_m=[4], cluster=[4])],
                         ids=["row-in-one-chunk", "chunks", "cluster"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 1000), (300, 33)])
def test_row_statistics_broadcast_over_their_rows_share_one_kernel(space, m, n):
    fn = tsr.function(centered_stats.fn, space=space or None)
    compiled = fn.compile(fn.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    assert compiled.kernel_names == ["centered_stats_row_reduction_0"]
    rng = np.random.default_rng(n)
    x, y = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) * y64.max(-1, keepdims=True) + y64 * (x64 * y64).sum(-1, keepdims=True)
    np.testing.assert_allclose(compiled.run(x, y)[0], want, rtol=1e-5, atol=1e-5 * math.sqrt(n))


@pytest.mark.parametrize("layer", [False, True], ids=["rms_norm", "layer_norm"])
@pytest.mark.parametrize("space", [{}, dict(programs=[1]), dict(programs=[3], block_m=[4]),
                                   dict(programs=[5], block_n=[64]), dict(programs=[3], block_m=[4], num_stages=[2]),
                                   dict(programs=[1], num_stages=[2]), dict(programs=[8], block_n=[64], cluster=[4]),
                                   dict(programs=[6], block_n=[512], block_m=[4], num_stages=[2], cluster=[3]),
                                   dict(programs=[2], block_m=[4], num_stages=[3])],
                         ids=["default", "one-block", "3x4rows", "chunks", "3x4rows-ahead", "one-block-ahead",
                              "clusters-of-4", "clusters-of-2-ahead", "2x4rows-two-ahead"])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 3), (97, 1000), (300, 33)])
def test_norm_backward_matches_float64(layer, space, m, n):
    """Persistent row walks (1, 3, 5 blocks; 4 rows a block leaving a partial last block; rows in
    chunks of 64 columns, so each rider has several accumulators; the next one or two row blocks'
    inputs staged in shared memory while one is computed, `num_stages` 2-3; rows split across clusters of blocks, 2 of
    them walking the rows, each block carrying its share's column sums) against float64."""
    fn = tsr.function(_layer_norm if layer else _rms_norm, space=space or None)
    rng = np.random.default_rng(m * n)
    x, dy = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    params = [(1 + 0.1 * rng.standard_normal(n)).astype(np.float32)]
    if layer:
        params.append(rng.standard_normal(n).astype(np.float32))
    _, f_vjp = tsr.vjp(fn, x, *params)
    wants = float64_norm_vjp(x, params, dy, layer)
    centered = x - x.mean(-1, keepdims=True) if layer else x
    # the terms of dx are of dy * w * rstd, those of dw and db of dy (at n = 1 dx cancels to almost 0
    # and a layer_norm's dw is 0)
    terms = [np.abs(dy * params[0]).max() / max(np.sqrt((centered ** 2).mean(-1) + 1e-5).min(), 1e-30)]
    for got, want, scale in zip(f_vjp(dy), wants, terms + [np.abs(dy).max()] * 2):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(scale, np.abs(want).max()) * math.sqrt(m))


@tsr.function
def norm_and_column_stats(x: Tensor["M", "N"], w: Tensor["N"]):
    """A forward whose column sum and max of its input ride the rms_norm's and softmax's row kernels."""
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6), tsr.sum(x * w, 0), tsr.softmax(x, -1), tsr.amax(x, 0)


@pytest.mark.parametrize("m,n", [(1, 5), (97, 300)])
def test_column_reductions_ride_a_norm_and_a_softmax(m, n):
    compiled = norm_and_column_stats.compile(norm_and_column_stats.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    assert not [k for k in compiled.kernel_names if "column_reduction" in k]
    rng = np.random.default_rng(m)
    x, w = rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for got, want in zip(compiled.run(x, w), compiled.reference(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * math.sqrt(m))


@tsr.function
def softmax_over_columns_and_their_sum(x: Tensor["M", "N"]):
    """A softmax over axis 0 tiles its columns as rows: a column sum cannot ride it."""
    return tsr.softmax(x, 0), tsr.sum(x, 0)


@tsr.function
def statistic_and_column_sum(x: Tensor["M", "N"]):
    from tessera.frontend import ops
    return ops.norm_statistic(x, "rstd", 1e-5, False), tsr.sum(x, 0)


@pytest.mark.parametrize("fn", [softmax_over_columns_and_their_sum, statistic_and_column_sum], ids=lambda f: f.name)
@pytest.mark.parametrize("m,n", [(5, 3), (37, 20)])
def test_row_kernels_a_column_sum_may_or_may_not_ride(fn, m, n):
    compiled = fn.compile(fn.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    x = np.random.default_rng(m).standard_normal((m, n)).astype(np.float32)
    for got, want in zip(compiled.run(x), compiled.reference(x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_norm_over_a_computed_input_writes_its_statistics_from_its_one_kernel():
    """The statistics read their own copy of the norm's prologue (recompute.copy_shared_prologues)
    and still join the norm's kernel."""
    from tessera.autodiff.api import saving

    @tsr.function
    def norm_of_a_sum(x: Tensor["M", "N"], r: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm((x + r).to(tsr.fp32), (x.shape[-1],), w, b, 1e-5)
    forward = saving(norm_of_a_sum).compile(norm_of_a_sum.arg_specs_for(dict(M=9, N=70), "bf16"), arch="sm_90a")
    assert forward.kernel_names == ["norm_of_a_sum_saving_row_reduction_0"]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((9, 70), (9, 70), (70,), (70,))]
    import ml_dtypes
    args = [a.astype(ml_dtypes.bfloat16) for a in args]
    for got, want in zip(forward.run(*args), forward.reference(*args)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_row_walk_stages_its_next_row_blocks_in_shared_memory(stages):
    """num_stages 2-3: the walk copies the next one or two row blocks' x and dy tiles (bf16, as
    stored) into stages of shared memory while it computes one, and carries only the weight
    gradient's accumulator."""
    from xdsl.dialects import scf as scf_d
    from tessera.autodiff.api import Derivative
    from tessera.frontend.trace import ArgSpec
    fn = tsr.function(_rms_norm, space={"num_stages": [stages]})
    specs = [ArgSpec("x", (512, 1024), tsr.bf16, ("M", "N")), ArgSpec("w", (1024,), tsr.bf16, ("N",)),
             ArgSpec("d_out", (512, 1024), tsr.bf16, ("M", "N"))]
    module = Derivative(fn, cotangent_names=["d_out"]).compile(specs, arch="sm_90a").stage("tile")
    kernels = {op.sym_name.data: op for op in module.walk() if isinstance(op, tile.KernelOp)}
    (kernel,) = [op for name, op in kernels.items() if f"{name}_combine" in kernels]   # (the row walk)
    (walk,) = [op for op in kernel.walk() if isinstance(op, scf_d.ForOp) and op.results]
    assert len(walk.results) == 1   # (the accumulator)
    buffers = [op.result.type for op in kernel.walk() if isinstance(op, tile.AllocSharedOp)]
    if stages == 1:
        assert not buffers
        return
    assert [(b.get_shape()[0], b.get_shape()[-1], str(b.get_element_type())) for b in buffers] == [(stages, 1024, "bf16")] * 2
    reads = [op for op in walk.walk() if isinstance(op, tile.LoadSharedOp)]
    assert len(reads) == 2 and all(op.into_registers for op in reads)


@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
@pytest.mark.parametrize("space", [dict(num_stages=[2]), dict(num_stages=[3], programs=[5]),
                                   dict(num_stages=[2], programs=[3], block_m=[4]),
                                   dict(num_stages=[2], programs=[4], cluster=[2])],
                         ids=["ahead", "two-ahead-5-blocks", "4-rows-3-blocks", "clusters-of-2"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 1000), (300, 33), (13, 4097), (5, 9000)])
def test_a_forward_walking_its_rows_matches_float64(op, space, m, n):
    """A row kernel without riders walks its rows where its schedule stages them ahead (num_stages
    2+, a row one chunk; `programs` blocks, or as many as the SMs hold): softmax and both norms,
    a partial last row block, fewer rows than blocks, rows split across a cluster."""
    from tessera.bench import cases
    fn = tsr.function(getattr(cases, op).fn, space={**space, "block_n": [8192]})
    compiled = fn.compile(fn.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    (kernel,) = compiled.kernel_names
    from tessera.ir import schedule as sch
    (params,) = [op.param_values for op in compiled.stage("schedule").walk() if op.name == "schedule.kernel"]
    split = sch.row_split(params, n)
    bm, _, chunks = sch.row_tile(params, m, -(-n // split))
    staged = [op for op in compiled.stage("tile").walk() if isinstance(op, tile.LoadSharedOp)]
    assert bool(staged) == (chunks == 1) and all(op.into_registers for op in staged)
    if chunks == 1:   # (as many blocks as the pin says, or as the rows need)
        assert compiled.launches[kernel].grid[0] == split * min(params.get("programs", 132) // split, -(-m // bm))
    rng = np.random.default_rng(m * n)
    x = rng.standard_normal((m, n)).astype(np.float32)
    w, b = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    args = {"softmax": [x], "layer_norm": [x, w, b], "rms_norm": [x, w]}[op]
    x64 = x.astype(np.float64)
    if op == "softmax":
        e = np.exp(x64 - x64.max(-1, keepdims=True))
        want = e / e.sum(-1, keepdims=True)
    elif op == "layer_norm":
        mean = x64.mean(-1, keepdims=True)
        want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b
    else:
        want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    got = np.full_like(want, np.nan)
    got[...] = compiled.run(*args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@tsr.function
def long_row_statistics(x: Tensor["M", "N"]):
    return tsr.softmax(x, -1), tsr.logsumexp(x, -1), tsr.layer_norm(x, (x.shape[-1],))


@pytest.mark.parametrize("cluster, blocks, block_n", [(4, 4, 64), (8, 8, 64), (3, 3, 64), (2, 2, 64), (4, 4, 256),
                                                      (2, 2, 512)])
def test_rows_split_across_a_cluster_match_float64(cluster, blocks, block_n):
    """A row split across the blocks of a cluster (the `cluster` param; 1000 columns, chunks of 64:
    at most 16 blocks would have a chunk; or shares of one chunk, whose softmax scales the
    exponentials of its statistics' pass): each block reduces its share, the cluster combines the
    shares' statistics (a softmax's max, then its sums each rescaled to that max), rows of -inf,
    of a huge finite fill and a NaN included, and shares all -inf beside finite ones."""
    fn = tsr.function(long_row_statistics.fn, space={"cluster": [cluster], "block_n": [block_n], "block_m": [4]})
    m, n = 6, 1000
    compiled = fn.compile(fn.arg_specs_for(dict(M=m, N=n)), arch="sm_90a")
    kernels = [op for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp)]
    assert [tile.cluster_size(k) for k in kernels] == [blocks] * 3
    x = np.random.default_rng(cluster).standard_normal((m, n)).astype(np.float32)
    x[1] = -np.inf
    x[2, :700] = -np.inf   # (the first blocks' shares all -inf)
    x[3, ::2] = np.finfo(np.float32).min
    x[4, 17] = np.nan
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        mx = x64.max(-1, keepdims=True)
        e = np.exp(x64 - mx)
        softmax, lse = e / e.sum(-1, keepdims=True), (mx + np.log(e.sum(-1, keepdims=True)))[:, 0]
        lse[1] = -np.inf   # (torch's logsumexp of a row of -inf)
        d = x64 - x64.mean(-1, keepdims=True)
        norm = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)
    got = compiled.run(x)
    for g, want in zip(got, (softmax, lse, norm)):
        rows = [i for i in range(m) if i not in (1, 3)] if want is norm else range(m)   # (inf - inf: NaN either way)
        np.testing.assert_allclose(g[list(rows)], want[list(rows)], rtol=2e-5, atol=2e-6, equal_nan=True)


# --- persistent attention: blocks walking query tiles -----------------------------------------------

WALK = dict(split_kv=[1], qk_ahead=[1], warp_specialize=[1], persistent=[1], num_stages=[2])


def attention_reference(q, k, v, scale, bias=None, upper=None):
    """float64 softmax(q k^T * scale + bias) v, keys past row + `upper` masked (causal: 0)."""
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) * scale
    s = s + (0 if bias is None else bias)
    if upper is not None:
        s = np.where(np.arange(s.shape[-1])[None, :] <= np.arange(s.shape[-2])[:, None] + upper, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


def test_a_persistent_attention_walks_query_tiles_on_pipelines_running_across_them():
    """`persistent`: `programs` blocks (the grid), each looping over its query tiles around the
    key loop; Q in two stages (the next tiles' copied ahead), keys and values in the pipelines
    the scores ahead take. A mask bounding the keys below (a window: tiles not starting at key
    block 0) or no more tiles than blocks keeps one tile a block, the switch ignored."""
    def compiled(fn, s, programs, **pins):
        fn = tsr.function(fn.fn, space={**WALK, "programs": [programs], **pins})
        return fn.compile(fn.arg_specs_for(dict(B=1, H=2, S=s, D=64), "fp16"), arch="sm_90a", path="native")
    def kernel_of(c):
        return next(op for op in c.modules["tile"].walk() if isinstance(op, tile.KernelOp))

    def q_stages(kernel):
        (stages,) = {op.dst.type.get_shape()[0] for op in kernel.walk()
                     if isinstance(op, tile.CopyAsyncOp) and op.src is kernel.body.block.args[0]}
        return stages
    walk = compiled(scaled_attention, 1024, 5)   # 16 tiles of 128 queries
    kernel = kernel_of(walk)
    assert "grid = array<i64: 5, 1, 1>" in walk.ir("tile") and q_stages(kernel) == 2
    loops = [op for op in kernel.body.block.ops if isinstance(op, scf.ForOp)]
    assert len(loops) == 1 and [op for op in loops[0].body.walk() if isinstance(op, scf.ForOp)]
    for fn, s, programs in ((window_attention, 1024, 5), (scaled_attention, 1024, 16)):
        one = compiled(fn, s, programs)
        assert f"grid = array<i64: {programs}, 1, 1>" not in one.ir("tile") and q_stages(kernel_of(one)) == 1


@pytest.mark.parametrize("b,h,s,d,programs,stages", [
    (2, 3, 300, 64, 2, 2),     # a partial last key block; 2 blocks walking 3 tiles each
    (1, 2, 1000, 128, 3, 2),   # D = 128: tiles of 16 key blocks
    (3, 1, 256, 64, 4, 2),     # key blocks as many as the stages: the next tile's first ones copied at once
    (1, 5, 129, 64, 7, 2),     # 7 blocks over 10 tiles: some walk one, some two
    (2, 2, 640, 32, 1, 3),     # one block walks every tile; three stages
])
@pytest.mark.parametrize("fn", ["plain", "alibi", "causal", "causal-heads-first"])
@pytest.mark.parametrize("ahead", [1, 0], ids=["scores-ahead", "plain-loop"])
def test_a_persistent_attention_matches_float64(b, h, s, d, programs, stages, fn, ahead):
    """Every tile of every block against float64, on the interpreter (which reads a stage whose copy
    was not waited for as NaN): the walk's copies land in the stage each tile reads, the next tile's
    first key blocks copied by this tile's last iterations, with their own batch indices; with the
    scores ahead (K and V pipelines apart) and without (one pipeline). Causal: each tile its own
    count of key blocks (a first query block's one: copies running ahead into the tile after the
    next), heaviest first (each head's, or with `heavy_first` every head's), the blocks' order
    reversed in odd rounds."""
    from attention_cases import FUNCTIONS
    rng = np.random.default_rng(s + programs)
    heads_first = fn == "causal-heads-first"
    fn = "causal" if heads_first else fn
    f = tsr.function(FUNCTIONS[fn].fn, space={**WALK, "programs": [programs], "num_stages": [stages],
                                              "block_n": [64], "block_m": [64], "num_warps": [4],
                                              "qk_ahead": [ahead], "heavy_first": [int(heads_first)]})
    specs = f.arg_specs_for(dict(B=b, H=h, S=s, M=s, N=s, D=d), "fp32")
    compiled = f.compile(specs, arch="sm_90a", backend="ptx")
    assert f"grid = array<i64: {programs}, 1, 1>" in compiled.ir("tile")
    q, k, v = (rng.standard_normal(spec.shape).astype(np.float32) for spec in specs)
    i = np.arange(s)
    bias = -0.0625 * np.abs(i[:, None] - i[None, :]) if fn == "alibi" else None
    want = attention_reference(q, k, v, 1 / math.sqrt(d), bias, upper=0 if fn == "causal" else None)
    np.testing.assert_allclose(compiled.run(q, k, v)[0], want, rtol=2e-5, atol=2e-5)


@tsr.function
def causal_from_the_end(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
    """Causal with the queries the last M of N positions (a prefill after a cached prefix)."""
    s = tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    i, j = tsr.arange(q.shape[-2]), tsr.arange(k.shape[-2])
    return tsr.matmul(tsr.softmax(tsr.where(i[:, None] + (k.shape[-2] - q.shape[-2]) >= j[None, :], s, -math.inf),
                                  dim=-1), v)


@tsr.function
def window_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    i = tsr.arange(q.shape[-2])
    keep = (i[:, None] >= i[None, :]) & (i[None, :] >= i[:, None] - 200)
    return tsr.matmul(tsr.softmax(tsr.where(keep, s, -math.inf), dim=-1), v)


@pytest.mark.parametrize("m,n,programs,stages,ahead", [
    (200, 333, 3, 2, 1),   # 3 key blocks more than query blocks: the first tile sees 4
    (130, 700, 2, 3, 1),   # three stages, the scores ahead
    (257, 300, 4, 3, 0),   # three stages, one pipeline
])
def test_a_persistent_causal_attention_with_more_keys_than_queries_matches_float64(m, n, programs, stages, ahead):
    """A causal walk whose mask's upper bound is N - M (the queries the last of the keys): every
    tile against float64 on the interpreter, batch 1 and 3."""
    f = tsr.function(causal_from_the_end.fn, space={**WALK, "programs": [programs], "num_stages": [stages],
                                                    "block_n": [64], "block_m": [64], "num_warps": [4],
                                                    "qk_ahead": [ahead]})
    for b in (1, 3):
        rng = np.random.default_rng(m + n + b)
        specs = f.arg_specs_for(dict(B=b, H=2, M=m, N=n, D=64), "fp32")
        compiled = f.compile(specs, arch="sm_90a", backend="ptx")
        assert f"grid = array<i64: {programs}, 1, 1>" in compiled.ir("tile")
        q, k, v = (rng.standard_normal(spec.shape).astype(np.float32) for spec in specs)
        np.testing.assert_allclose(compiled.run(q, k, v)[0], attention_reference(q, k, v, 1 / 8, upper=n - m),
                                   rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", ["plain", "causal"])
def test_a_persistent_attention_saves_each_tiles_logsumexp_for_the_backward(kind):
    """The forward a vjp runs (its output and rows' log-sum-exp, which the backward reads) walking
    its query tiles: the gradients against float64."""
    from attention_cases import FUNCTIONS, reference_grads
    rng = np.random.default_rng(5)
    f = tsr.function(FUNCTIONS[kind].fn, space={**WALK, "programs": [3], "block_n": [64], "block_m": [64],
                                                "num_warps": [4], "backend": "ptx"})
    q, k, v, g = (rng.standard_normal((2, 3, 300, 64)).astype(np.float32) for _ in range(4))
    forward = f.compile(f.arg_specs_for(dict(B=2, H=3, M=300, N=300, S=300, D=64), "fp32"), arch="sm_90a")
    assert "grid = array<i64: 3, 1, 1>" in forward.ir("tile")
    _, f_vjp = tsr.vjp(f, q, k, v)
    for grad, ref in zip(f_vjp(g), reference_grads(kind, q, k, v, g)):
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("arch,path,stages", [("sm_90a", "native", 3), ("sm_80", "ampere", 2)])
def test_a_walk_whose_second_q_stage_does_not_fit_keeps_one_tile_a_block(arch, path, stages):
    """Pinned tiles that fill shared memory without a walk's second Q stage (128 x 128 at D = 128:
    224 KiB in three stages on sm_90a, 160 KiB in two on sm_80) still compile, one tile a block."""
    from attention_cases import FUNCTIONS
    f = tsr.function(FUNCTIONS["plain"].fn, space={**WALK, "num_stages": [stages], "programs": [5], "block_n": [128],
                                                   "block_m": [128], "num_warps": [8], "backend": "ptx"})
    compiled = f.compile(f.arg_specs_for(dict(B=2, H=4, M=1000, N=1000, D=128), "bf16"), arch=arch, path=path)
    assert compiled.modules["target"] and "grid = array<i64: 5, 1, 1>" not in compiled.ir("tile")


@pytest.mark.parametrize("b,h,s,n,d,programs", [(1, 2, 300, 304, 64, 2), (2, 1, 260, 256, 128, 3)])
def test_an_fp8_attention_walking_its_query_tiles_with_turns_matches_float64(b, h, s, n, d, programs):
    """fp8 attention (V passed transposed) with the warpgroups taking turns, walking its query
    tiles (the turns begun and ended in each tile), on the interpreter against float64 of the
    e4m3 values (tests/gpu/test_fp8_attention_gpu.py runs the same on the GPU)."""
    import ml_dtypes
    from fp8_attention import fp8_attention_vt
    rng = np.random.default_rng(s + n)
    f = tsr.function(fp8_attention_vt.fn, space={"pingpong": [1], "warp_specialize": [1], "num_warps": [8],
                                                 "block_m": [128], "block_n": [128], "qk_ahead": [0], "split_kv": [1],
                                                 "persistent": [1], "programs": [programs]})
    compiled = f.compile(f.arg_specs_for(dict(B=b, H=h, S=s, N=n, D=d)), arch="sm_90a")
    assert f"grid = array<i64: {programs}, 1, 1>" in compiled.ir("tile") and "warpgroup_turn" in compiled.ir("target")
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn) for shape in ((b, h, s, d), (b, h, n, d),
                                                                                         (b, h, n, d)))
    scales = [np.array([x], np.float32) for x in (0.5, 1.5, 0.75)]
    out = compiled.run(q, k, np.ascontiguousarray(np.swapaxes(v, -1, -2)), *scales)[0].astype(np.float64)
    qs, ks, vs = (x.astype(np.float64) for x in (q, k, v))
    ref = attention_reference(qs, ks, vs, 0.5 * 1.5 / math.sqrt(d)) * 0.75
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 5e-2
