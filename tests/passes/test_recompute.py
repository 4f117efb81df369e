"""The attention backward without an S x S tensor in memory (passes/recompute.py + the flash_chain
template): which kernels the backward becomes, and its gradients on the CPU tile interpreter
against a float64 reference for plain, causal, ALiBi and soft-capped attention, cross attention
and awkward lengths."""
import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor, dtypes
from tessera.autodiff.api import Derivative
from tessera.ir import tile as t
from tessera.passes.recompute import recompute_scores
from tessera.backends.ptx import emit_module
from tessera.runtime.launcher import plan
from tessera.runtime.ptxas import assemble, find_tool

from attention_cases import FUNCTIONS, gqa_causal_attention, gqa_reference_grads, plain, reference_grads


def backward(fn, q_shape, kv_len, dtype=dtypes.fp16, **options):
    b, h, m, d = q_shape
    specs = fn.arg_specs_for({"B": b, "H": h, "M": m, "S": m, "N": kv_len, "D": d}, dtype)
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtype, specs[0].dims)
    return Derivative(fn, cotangent_names=["d_out"]).compile([*specs, d_out], **options)


#: a target of one SM, where a merged dK/dV/dQ kernel's blocks fill two waves at any length
#: (`fusion._Planner._long_enough`)
ONE_SM = {"arch": "sm_90a", "sm_count": 1}


@pytest.fixture
def short_loops(monkeypatch):
    """Merges dQ into the dK/dV kernel over loops of any length, so the interpreter's small shapes
    take the path a GPU's long sequences do (`fusion.ACROSS_LEAST_LOOP`)."""
    from tessera.passes import fusion
    monkeypatch.setattr(fusion, "ACROSS_LEAST_LOOP", 1)


def kernels(compiled):
    f = next(iter(compiled.modules["schedule"].ops))
    return [op for op in f.body.block.ops if op.name == "schedule.kernel"]


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_attention_backward_is_flash_chains_with_no_square_tensor(kind):
    """The recomputed forward is one flash_attention kernel writing the output and the rows'
    log-sum-exp; rowsum(dO * O) one row reduction; the readers of the probabilities two flash_chain
    kernels: dQ, and dK with dV (both loop over query blocks for a block of keys: one kernel, its
    score tiles computed once); no kernel writes, and no buffer holds, a tensor with both the query
    and the key length among its dims."""
    s = 200
    c = backward(FUNCTIONS[kind], (2, 3, s, 64), s)
    ks = kernels(c)
    kinds = [k.kind.data for k in ks]
    # dK = (Q^T dS)^T: the dK/dV kernel stores its [D, S] result transposed itself, with no copy kernel
    assert kinds == ["flash_attention", "row_reduction", "flash_chain", "flash_chain"], kinds
    assert all(str(t) == str(ks[3].outputs[0].type) for t in ks[3].outputs.types)
    assert [(k.kind.data, len(k.outputs)) for k in ks if len(k.outputs) > 1] == [("flash_attention", 2),
                                                                                ("flash_chain", 2)]
    dk_dv = ks[3].body.block
    # S = Q K^T and dP = dO V^T once each, then dV = P^T dO and dK^T = Q^T dS
    assert sum(op.name == "graph.matmul" for op in dk_dv.ops) == 4
    # K and V resident, Q and dO streamed once each (for the scores and for dK and dV alike)
    (tile_dk_dv,) = [k for k in c.modules["tile"].ops if getattr(k, "sym_name", None)
                     and k.sym_name.data == ks[3].sym_name.data]
    assert sum(isinstance(op, t.AllocSharedOp) for op in tile_dk_dv.walk()) == 4
    p = plan(c)
    for buf in (*p.outputs, *p.intermediates):
        assert list(buf.shape).count(s) <= 1, f"an S x S buffer: {buf.shape}"


def test_forward_graphs_are_left_alone():
    """The pass copies nothing where no two sinks share a score tile: a forward attention stays one
    flash_attention kernel, and its module is returned as is."""
    specs = plain.arg_specs_for({"B": 1, "H": 2, "M": 64, "N": 64, "D": 32}, dtypes.fp16)
    module = plain.trace(specs)
    assert recompute_scores(module) is module
    assert [k.kind.data for k in kernels(plain.compile(specs))] == ["flash_attention"]


@pytest.mark.parametrize("kind,q_shape,kv_len", [
    ("plain", (1, 2, 17, 16), 17),
    ("plain", (2, 1, 40, 32), 100),        # cross attention: 40 queries against 100 keys
    ("causal", (1, 2, 97, 64), 97),        # a partial last block in both directions
    ("alibi", (1, 1, 70, 32), 70),
    ("softcap_causal", (2, 1, 65, 16), 65),
])
def test_attention_backward_on_the_interpreter(kind, q_shape, kv_len):
    rng = np.random.default_rng(5)
    b, h, m, d = q_shape
    q = rng.standard_normal(q_shape).astype(np.float16)
    k, v = (rng.standard_normal((b, h, kv_len, d)).astype(np.float16) for _ in range(2))
    out, f_vjp = tsr.vjp(FUNCTIONS[kind], q, k, v)
    d_out = rng.standard_normal(out.shape).astype(np.float16)
    grads = f_vjp(d_out)
    for name, got, want in zip("qkv", grads, reference_grads(kind, q, k, v, d_out)):
        assert got.dtype == np.float16 and got.shape == want.shape and not np.isnan(got).any()
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-2, f"d{name}: {err}"


@pytest.mark.parametrize("heavy_first", [0, 1])
@pytest.mark.parametrize("kind", ["causal", "softcap_causal"])
def test_backward_blocks_in_either_order(kind, heavy_first):
    """The backward's kernels with the blocks that do the most work first (`heavy_first`: dQ's
    last query blocks, dK/dV's first key blocks, over 6 heads) or in grid order: the same
    gradients. Few heads derive heavy first."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 3, 131, 32)).astype(np.float32) for _ in range(3))
    fn = tsr.function(FUNCTIONS[kind].fn, space={"heavy_first": [heavy_first], "block_m": [64], "block_n": [32]})
    out, f_vjp = tsr.vjp(fn, q, k, v)
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    for name, got, want in zip("qkv", f_vjp(d_out), reference_grads(kind, q, k, v, d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"d{name}")
    derived = backward(FUNCTIONS[kind], (2, 3, 256, 64), 256)
    assert {kernel.param_values.get("heavy_first") for kernel in kernels(derived)
            if kernel.kind.data in ("flash_chain", "flash_attention")} == {1}


def test_back_to_back_matmul_is_one_kernel():
    """relu(x @ w1) @ w2 with a short inner dim: the hidden tile is recomputed per block, never stored."""
    @tsr.function
    def mlp(x: Tensor["M", "C"], w1: Tensor["C", "F"], w2: Tensor["F", "E"]):
        return tsr.matmul(tsr.relu(tsr.matmul(x, w1)), w2)

    @tsr.function
    def wide_mlp(x: Tensor["M", "C"], w1: Tensor["C", "F"], w2: Tensor["F", "E"]):
        return tsr.matmul(tsr.relu(tsr.matmul(x, w1)), w2)

    rng = np.random.default_rng(2)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float16) * 0.5 for s in ((100, 32), (32, 300), (300, 48)))
    specs = mlp.arg_specs_for({"M": 100, "C": 32, "F": 300, "E": 48}, dtypes.fp16)
    assert [k.kind.data for k in kernels(mlp.compile(specs))] == ["flash_chain"]
    want = np.maximum(x.astype(np.float64) @ w1, 0) @ w2
    # outputs wider than a head dim would not fit a program's accumulator: two GEMMs as before
    wide = wide_mlp.arg_specs_for({"M": 100, "C": 32, "F": 300, "E": 512}, dtypes.fp16)
    assert [k.kind.data for k in kernels(wide_mlp.compile(wide))] == ["gemm", "gemm"]
    got = mlp(x, w1, w2).astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-2


@pytest.mark.parametrize("kind,skips", [("causal", True), ("softcap_causal", True), ("plain", False),
                                        ("alibi", False)])
def test_causal_backward_kernels_skip_masked_blocks(kind, skips):
    """A causal mask zeroes whole blocks of P and dS: every flash kernel's loop starts or ends
    where the mask does for its block (bounds computed from the program id), not at 0 and N / BN."""
    from xdsl.dialects import arith, scf

    from tessera.ir import tile as t

    c = backward(FUNCTIONS[kind], (1, 2, 256, 64), 256)
    chains = [k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp)
              and any(kind in k.sym_name.data for kind in ("flash_chain", "flash_attention"))]
    assert len(chains) == 3   # the recomputed forward, dQ, dK with dV
    for k in chains:
        (loop,) = [op for op in k.walk() if isinstance(op, scf.ForOp)]
        fixed = isinstance(loop.lb.owner, arith.ConstantOp) and isinstance(loop.ub.owner, arith.ConstantOp)
        assert fixed != skips, k.sym_name.data


@pytest.mark.parametrize("kind", ["causal", "softcap_causal"])
def test_a_chain_computes_its_masks_only_in_the_blocks_they_cut(kind):
    """A block inside the causal mask takes the branch where the mask's wheres are their kept
    operand (no compare, no select: `Emitter.kept_wheres`); only the diagonal's blocks compute
    them. The interpreter runs both branches (test_attention_backward_on_the_interpreter)."""
    from xdsl.dialects import scf

    c = backward(FUNCTIONS[kind], (1, 2, 256, 64), 256)
    chains = [k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp) and "flash_chain" in k.sym_name.data]
    assert len(chains) == 2   # dQ, dK with dV
    for k in chains:
        def selects(region):
            return sum(isinstance(op, t.SelectOp) for op in region.walk())
        branches = [op for op in k.walk() if isinstance(op, scf.IfOp) and selects(op.false_region)]
        assert len(branches) == 1 and selects(branches[0].true_region) == 0, k.sym_name.data


def test_a_score_tile_read_in_two_orientations_is_not_chained():
    """P * P^T needs the score matmul's tile both ways round; one recomputed tile cannot give both,
    so the reduction reads the scores from memory (and the result stays right)."""
    @tsr.function
    def both_ways(x: Tensor["S", "D"], y: Tensor["S", "D"]):
        s = tsr.matmul(x, y.transpose(-2, -1))
        return tsr.sum(s * s.transpose(-2, -1), -1, keepdim=True)

    rng = np.random.default_rng(4)
    x, y = (rng.standard_normal((48, 16)).astype(np.float32) for _ in range(2))
    specs = both_ways.arg_specs_for({"S": 48, "D": 16}, dtypes.fp32)
    assert "flash_chain" not in [k.kind.data for k in kernels(both_ways.compile(specs))]
    s = x.astype(np.float64) @ y.T.astype(np.float64)
    want = (s * s.T).sum(-1, keepdims=True)
    assert np.allclose(both_ways(x, y), want, rtol=1e-3, atol=1e-3)


def test_a_product_with_an_infinite_constant_is_not_taken_as_zero():
    from tessera.ir.masks import _through
    assert _through("mul", [0.0, None]) == 0.0
    assert _through("mul", [0.0, -math.inf]) is None


@tsr.function
def sliding_window(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i, j = tsr.arange(s.shape[-2])[:, None], tsr.arange(s.shape[-1])[None, :]
    return tsr.matmul(tsr.softmax(tsr.where((i >= j) & (j >= i - 24), s, -math.inf), dim=-1), v)


def test_a_sliding_windows_backward_skips_blocks_on_both_sides():
    """A conjunction of bounds (a causal window of 25 keys): every flash kernel's loop, forward and
    backward, starts and ends at the window's blocks; the gradients match float64."""
    from xdsl.dialects import arith, scf

    c = backward(sliding_window, (1, 2, 256, 64), 256)
    for k in (k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp) and "flash" in k.sym_name.data):
        (loop,) = [op for op in k.walk() if isinstance(op, scf.ForOp)]
        assert not isinstance(loop.lb.owner, arith.ConstantOp) and not isinstance(loop.ub.owner, arith.ConstantOp)
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 131, 32)).astype(np.float32) for _ in range(3))
    fn = tsr.function(sliding_window.fn, space={"block_m": [32], "block_n": [16]})
    out, f_vjp = tsr.vjp(fn, q, k, v)
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    scale = 1.0 / math.sqrt(32)
    i, j = np.arange(131)[:, None], np.arange(131)[None, :]
    s = np.where((i >= j) & (j >= i - 24), q64 @ k64.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, p @ v64, rtol=1e-4, atol=1e-5)
    dp = do64 @ v64.swapaxes(-1, -2)
    dx = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    for name, got, want in zip("qkv", f_vjp(d_out), (dx @ k64, dx.swapaxes(-1, -2) @ q64, p.swapaxes(-1, -2) @ do64)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"d{name}")


@pytest.mark.parametrize("h,hk,s", [(4, 2, 37), (6, 1, 97), (4, 4, 64)])
def test_a_grouped_query_backward_computes_dk_and_dv_in_one_kernel(h, hk, s):
    """dV (summed over a KV head's query heads) is read before dK's kernel in the trace; fusion
    moves that sum after it (`_defer_readers`), so dK and dV share one flash_chain kernel (its
    scores computed once) as in an attention without groups, then each is summed over the group.
    Gradients on the interpreter against float64."""
    specs = gqa_causal_attention.arg_specs_for({"B": 2, "H": h, "Hk": hk, "S": s, "D": 16}, dtypes.fp32)
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtypes.fp32, specs[0].dims)
    ks = kernels(Derivative(gqa_causal_attention, cotangent_names=["d_out"]).compile([*specs, d_out]))
    chains = [len(k.outputs) for k in ks if k.kind.data == "flash_chain"]
    assert sorted(chains) == [1, 2], [k.kind.data for k in ks]   # dQ; dK with dV
    rng = np.random.default_rng(h + s)
    q = rng.standard_normal((2, h, s, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, hk, s, 16)).astype(np.float32) for _ in range(2))
    out, f_vjp = tsr.vjp(gqa_causal_attention, q, k, v)
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    for name, got, want in zip("qkv", f_vjp(d_out), gqa_reference_grads(q, k, v, d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"d{name}")


@pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")
def test_the_grouped_query_backward_kernels_assemble_for_hopper():
    specs = gqa_causal_attention.arg_specs_for({"B": 2, "H": 32, "Hk": 8, "S": 1000, "D": 128}, dtypes.bf16)
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtypes.bf16, specs[0].dims)
    c = Derivative(gqa_causal_attention, cotangent_names=["d_out"]).compile([*specs, d_out], arch="sm_90a", sm_count=132)
    for kernel in emit_module(c.modules["target"]).values():
        assemble(kernel.ptx, "sm_90a")


# --- dQ summed in the kernel of dK and dV (`ChainSink.across`) ------------------------------------

def _chain_kernel(c):
    (chain,) = [k for k in kernels(c) if k.kind.data == "flash_chain"]
    return chain


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_dq_is_summed_in_the_kernel_of_dk_and_dv(kind, short_loops):
    """At a head dim of 128 the dQ chain folds into the dK/dV one (keys as rows): S = Q K^T and
    dP = dO V^T computed once, 5 matmuls where two kernels took 7, on 128-key blocks of 8 warps.
    Its Tile IR stores dS^T to shared memory for dQ's product and adds each block to an fp32 sum
    that a kernel before zeroes and one after casts into dQ; on Hopper the sum is a bulk reduction
    from a shared buffer (`shared_memory.bulk_reduction_pitch`), its stores fenced for the async
    proxy."""
    c = backward(FUNCTIONS[kind], (2, 3, 200, 128), 200, dtypes.bf16, **ONE_SM)
    assert [k.kind.data for k in kernels(c)] == ["flash_attention", "row_reduction", "flash_chain"]
    chain = _chain_kernel(c)
    assert len(chain.outputs) == 3
    assert sum(op.name == "graph.matmul" for op in chain.body.block.ops) == 5
    assert (chain.param_values["block_m"], chain.param_values["num_warps"]) == (128, 8)
    name = chain.sym_name.data
    tile_kernels = {k.sym_name.data: k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp)}
    assert [n for n in tile_kernels if n.startswith(name)] == [f"{name}_zero", name, f"{name}_sum"]
    ops = [op.name for op in tile_kernels[name].walk()]
    assert ops.count("tile.store_shared") == 1 and ops.count("tile.atomic_add") == 1
    target = next(k for k in c.modules["target"].walk() if getattr(k, "sym_name", None)
                  and k.sym_name.data == name and k.name == "tessera_target.kernel")
    assert "async_shared" in str(target) and "#tessera_target.staging" in str(target)
    assert all(f"tessera_target.{op}" in str(target) for op in ("bulk_wait", "stage_rows", "bulk_reduce"))
    ptx = c.stage("ptx")[name].ptx
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and "red.global.add" not in ptx


@pytest.mark.parametrize("kv_len,cut", [(200, True), (256, False)])
def test_dst_rows_past_the_keys_end_are_cut_to_zero_before_they_are_stored(kv_len, cut, short_loops):
    """K's zero padding past the keys' end times an infinite or NaN dS^T element (a score
    modification's) would be a NaN in dQ's sum: where the last key block is partial, dS^T is
    selected against the rows' bound before its store to shared memory; where none is, it is not."""
    c = backward(FUNCTIONS["causal"], (2, 3, kv_len, 128), kv_len, dtypes.bf16, **ONE_SM)
    name = _chain_kernel(c).sym_name.data
    kernel = next(k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp) and k.sym_name.data == name)
    (store,) = [op for op in kernel.walk() if isinstance(op, t.StoreSharedOp)]
    stored = store.value.owner.operands[0].owner   # (through the cast to bf16)
    assert (stored.name == "arith.select") is cut


@pytest.mark.parametrize("kind,q_shape,kv_len", [
    ("plain", (1, 2, 131, 128), 131),
    ("plain", (2, 1, 100, 96), 300),        # cross attention; rows of 96 in the block's 128
    ("causal", (1, 2, 200, 128), 200),
    ("softcap_causal", (1, 1, 130, 128), 130),
    ("alibi", (1, 2, 129, 128), 129),
])
def test_dq_summed_across_key_blocks_on_the_interpreter(kind, q_shape, kv_len, short_loops):
    rng = np.random.default_rng(21)
    b, h, m, d = q_shape
    q = rng.standard_normal(q_shape).astype(np.float16)
    k, v = (rng.standard_normal((b, h, kv_len, d)).astype(np.float16) for _ in range(2))
    d_out = rng.standard_normal(q_shape).astype(np.float16)
    c = backward(FUNCTIONS[kind], q_shape, kv_len, **ONE_SM)
    assert len(_chain_kernel(c).outputs) == 3
    for name, got, want in zip("qkv", c.run(q, k, v, d_out), reference_grads(kind, q, k, v, d_out)):
        assert got.dtype == np.float16 and got.shape == want.shape and not np.isnan(got).any()
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-2, f"d{name}: {err}"


@pytest.mark.parametrize("kind", ["causal", "plain"])   # (plain: a staggered loop over a run-time count)
def test_a_generic_backward_sums_dq_over_any_length(kind, short_loops):
    """One compile with S taken at run time: the sum's buffer, its zeroing and its epilogue kernels
    are sized per call; gradients at three lengths against float64."""
    b, h, d = 1, 2, 128
    specs = FUNCTIONS[kind].arg_specs_for({"B": b, "H": h, "S": 256, "M": 256, "N": 256, "D": d}, dtypes.fp16)
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtypes.fp16, specs[0].dims)
    c = Derivative(FUNCTIONS[kind], cotangent_names=["d_out"]).compile(
        [*specs, d_out], dynamic=frozenset({"S"} if kind == "causal" else {"M", "N"}), **ONE_SM)
    assert c.dynamic_dims and len(_chain_kernel(c).outputs) == 3
    rng = np.random.default_rng(22)
    for s in (131, 300, 64):
        q, k, v, g = (rng.standard_normal((b, h, s, d)).astype(np.float16) for _ in range(4))
        for name, got, want in zip("qkv", c.run(q, k, v, g), reference_grads(kind, q, k, v, g)):
            err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
            assert err < 1e-2, f"S={s} d{name}: {err}"


@pytest.mark.parametrize("kind,staggered", [("plain", True), ("alibi", True), ("causal", False)])
def test_key_blocks_start_their_loops_at_their_diagonal(kind, staggered, short_loops):
    """Where each key block's loop covers every query block, it starts at its diagonal and wraps
    around (`schedule_to_tile._staggered`), so that the key blocks of a head do not add to the same
    rows of dQ's sum at once; a causal loop starts there already."""
    c = backward(FUNCTIONS[kind], (2, 3, 300, 128), 300, dtypes.bf16, **ONE_SM)
    name = _chain_kernel(c).sym_name.data
    kernel = next(k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp) and k.sym_name.data == name)
    def same(a, b):   # (one SSA value, or two constants of one value)
        return a is b or all(x.owner.name == "arith.constant" for x in (a, b)) and a.owner.value == b.owner.value

    def wraps(loop):   # (iv + start) mod the loop's end
        return any(u.operation.name == "arith.remsi" and same(u.operation.operands[1], loop.ub)
                   for use in loop.body.block.args[0].uses if use.operation.name == "arith.addi"
                   for u in use.operation.results[0].uses)
    assert any(wraps(op) for op in kernel.walk() if op.name == "scf.for") is staggered


@pytest.mark.parametrize("why,d,s,options", [
    ("a head dim of 64: two kernels measured as fast", 64, 200, ONE_SM),
    ("a head dim not a multiple of 8: K's rows are not whole 16 bytes for TMA", 100, 200, ONE_SM),
    ("under two waves of blocks on 132 SMs", 128, 200, {"arch": "sm_90a"}),
    ("no Hopper path (wgmma, TMA)", 128, 200, {**ONE_SM, "arch": "sm_80"}),
    ("another backend", 128, 200, {**ONE_SM, "backend": "cuda-tile"}),
])
def test_dq_keeps_its_own_kernel_where_summing_it_does_not_pay(why, d, s, options, short_loops):
    c = backward(FUNCTIONS["causal"], (2, 3, s, d), s, dtypes.bf16, **options)
    assert sorted(len(k.outputs) for k in kernels(c) if k.kind.data == "flash_chain") == [1, 2], why


@pytest.mark.parametrize("s,merged", [(1024, False), (2048, True), (4097, True)])
def test_dq_is_summed_across_loops_of_2048_queries_or_more(s, merged):
    """On an H200's 132 SMs: 1024 queries a loop lose to two kernels (grouped-query causal
    8x32/8x1024x128), 2048 and more win."""
    c = backward(FUNCTIONS["causal"], (8, 16, s, 128), s, dtypes.bf16, arch="sm_90a", sm_count=132)
    assert max(len(k.outputs) for k in kernels(c) if k.kind.data == "flash_chain") == (3 if merged else 2)


@pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("d,space", [
    (128, None),
    (96, None),                                        # rows of 96 in the block's 128 (K's padding adds zeros)
    (96, {"block_m": [64], "num_warps": [4]}),         # dS K: the block's rows are queries, on 4 warps
])
def test_across_sums_assemble_for_hopper(d, space, short_loops):
    """Every across sum on Hopper is one bulk reduction of its block: the sum's rows are the
    block's columns and 16 bytes of padding, whatever the head dim."""
    fn = tsr.function(FUNCTIONS["causal"].fn, space=space) if space else FUNCTIONS["causal"]
    c = backward(fn, (2, 3, 200, d), 200, dtypes.bf16, **ONE_SM)
    name = _chain_kernel(c).sym_name.data
    kernels_ptx = emit_module(c.modules["target"])
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in kernels_ptx[name].ptx
    assert "red.global.add" not in kernels_ptx[name].ptx
    for kernel in kernels_ptx.values():
        assemble(kernel.ptx, "sm_90a")


@pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a without Hopper's"])
def test_an_across_sum_lowers_on_the_mma_sync_path(arch, short_loops):
    """The same Tile IR lowered where neither TMA nor wgmma is (fusion merges only on the Hopper
    path, measured there): dS^T stored XOR-swizzled and read with ldmatrix.trans for mma.sync,
    the sums added by `red.global.add.f32`; it assembles."""
    from tessera import platforms
    from tessera.lowering.tile_to_target import lower_tile_to_target

    c = backward(FUNCTIONS["causal"], (2, 3, 200, 96), 200, dtypes.bf16, **ONE_SM)
    platform = "sm_80" if arch == "sm_80" else platforms.without("sm_90a", platforms.BEYOND_AMPERE)
    kernels_ptx = emit_module(lower_tile_to_target(c.modules["tile"].clone(), platform))
    ptx = kernels_ptx[_chain_kernel(c).sym_name.data].ptx
    assert "red.global.add.f32" in ptx and "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx and "cp.reduce" not in ptx
    for kernel in kernels_ptx.values():
        assemble(kernel.ptx, "sm_80" if arch == "sm_80" else "sm_90a")


def test_the_async_checker_sees_dq_read_before_the_stores_of_dst_are_shared(short_loops):
    """The checker models `tile.store_shared` as the threads' writes to a stage: without the
    barrier after dS^T's stores, the wgmma reading it is a hazard (and with it, none)."""
    from tessera.ir import target as tgt
    from tessera.passes.check_async import check_async

    module = backward(FUNCTIONS["causal"], (2, 3, 200, 128), 200, dtypes.bf16, **ONE_SM).modules["target"]
    assert check_async(module) == []
    fence = next(op for op in module.walk() if isinstance(op, tgt.FenceOp) and op.kind.data == "async_shared")
    barrier = fence.next_op   # (after the previous dQ add's read is waited for: `_barrier_before`)
    barrier = barrier.next_op if isinstance(barrier, tgt.BulkWaitOp) else barrier
    assert isinstance(barrier, tgt.BarrierOp)
    barrier.detach()   # (it publishes dS^T and the previous add's read of the staging buffer alike)
    assert {h.kind for h in check_async(module)} == {"read-before-wait", "refill-race"}


def test_the_async_checker_sees_dst_stored_for_wgmma_without_the_proxy_fence(short_loops):
    """dS^T's stores are the generic proxy's and wgmma reads through the async one: with the block
    barrier kept but the fence before it removed, the wgmma's read is a proxy-fence hazard."""
    from tessera.ir import target as tgt
    from tessera.passes.check_async import check_async

    module = backward(FUNCTIONS["causal"], (2, 3, 200, 128), 200, dtypes.bf16, **ONE_SM).modules["target"]
    fence = next(op for op in module.walk() if isinstance(op, tgt.FenceOp) and op.kind.data == "async_shared")
    assert isinstance(fence.next_op.next_op, tgt.BarrierOp)   # (after the previous add's read is waited for)
    fence.detach()
    hazards = check_async(module)
    assert hazards and {h.kind for h in hazards} == {"proxy-fence"}
    assert all(h.op.name == "tessera_target.tensor_core" for h in hazards)


def _without_bulk_wait(module, read: bool):
    from tessera.ir import target as tgt
    next(op for op in module.walk() if isinstance(op, tgt.BulkWaitOp) and (op.read is not None) == read).detach()


def _without_barrier_after_the_read_wait(module):
    from tessera.ir import target as tgt
    wait = next(op for op in module.walk() if isinstance(op, tgt.BulkWaitOp) and op.read is not None)
    wait.next_op.detach()


def _without_before_the_reduce(module, steps_back: int):
    from tessera.ir import target as tgt
    op = next(op for op in module.walk() if isinstance(op, tgt.BulkReduceOp))
    for _ in range(steps_back):
        op = op.prev_op
    op.detach()


@pytest.mark.parametrize("mutate,kinds", [
    (lambda m: _without_bulk_wait(m, read=True), {"refill-race"}),         # the buffer refilled while read
    # thread 0's wait not published (by the barrier that publishes dS^T too: `_barrier_before`)
    (_without_barrier_after_the_read_wait, {"refill-race", "read-before-wait"}),
    (lambda m: _without_before_the_reduce(m, 2), {"proxy-fence"}),         # the stores not fenced
    (lambda m: _without_before_the_reduce(m, 1), {"read-before-wait"}),    # no barrier after the stores
    (lambda m: _without_bulk_wait(m, read=False), {"in-flight-at-exit"}),  # the last reduction's read
])
def test_the_async_checker_follows_the_bulk_reduction_of_dq(mutate, kinds, short_loops):
    """The bulk reduction is Target IR ops (`tile_to_target.lower_bulk_reductions`): the checker
    runs them, and each missing synchronization among them is a hazard of its kind."""
    from tessera.passes.check_async import check_async

    module = backward(FUNCTIONS["causal"], (2, 3, 200, 128), 200, dtypes.bf16, **ONE_SM).modules["target"]
    assert check_async(module) == []
    mutate(module)
    assert {h.kind for h in check_async(module)} == kinds


@pytest.mark.parametrize("why,space", [
    ("a space pinning the cuda-tile backend", {"backend": ["cuda-tile"]}),
    ("blocks of 32 queries: dS^T's shared rows would not fill a 128-byte swizzle row", {"block_n": [32]}),
    ("blocks of 32 keys: 2 warps, which neither 64 queries nor 128 columns of dQ give 16 rows each",
     {"block_m": [32]}),
    ("2 warps", {"num_warps": [2]}),
])
def test_dq_keeps_its_own_kernel_under_a_space_it_cannot_take(why, space, short_loops):
    fn = tsr.function(FUNCTIONS["causal"].fn, space=space)
    c = backward(fn, (2, 3, 200, 128), 200, dtypes.bf16, **ONE_SM)
    assert sorted(len(k.outputs) for k in kernels(c) if k.kind.data == "flash_chain") == [1, 2], why


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_a_mask_filled_with_the_dtypes_least_float_is_no_nan(dtype):
    """HuggingFace's masks fill with torch.finfo(dtype).min, not -inf: a key block all of it made
    -max * log2(e) overflow to +inf in the online softmax, and the row NaN (every row of a
    left-padded batch). Forward and gradients against float64."""
    @tsr.function
    def padded(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
               mask: Tensor["M", "N"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        return tsr.matmul(tsr.softmax(s + mask, dim=-1), v)
    rng = np.random.default_rng(34)
    q, k, v = (rng.standard_normal((1, 1, 130, 32)).astype(dtype) for _ in range(3))
    mask = np.zeros((130, 130), dtype)
    mask[:, :100] = np.finfo(np.float32).min if dtype == np.float32 else ml_dtypes.finfo(dtype).min
    out, f_vjp = tsr.vjp(padded, q, k, v, mask)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = q64 @ k64.transpose(0, 1, 3, 2) / math.sqrt(32) + mask.astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(out.astype(np.float64), p @ v64, atol=tol * 4, rtol=tol)
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = f_vjp(g)
    g64 = g.astype(np.float64)
    dv = p.transpose(0, 1, 3, 2) @ g64
    dp = g64 @ v64.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    for got, want in zip(grads, (ds @ k64 / math.sqrt(32), ds.transpose(0, 1, 3, 2) @ q64 / math.sqrt(32), dv)):
        assert not np.isnan(got.astype(np.float64)).any()
        np.testing.assert_allclose(got.astype(np.float64), want, atol=tol * 4 * np.abs(want).max(), rtol=tol * 4)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("fill", ["finfo", -1e30])
def test_a_row_all_of_a_finite_fill_is_uniform_as_in_torch(dtype, fill):
    """Rows a mask of torch.finfo(dtype).min (or -1e30) fills whole (a left-padded batch's padding
    queries) average V, as torch's softmax makes them (each fill minus the max is 0), where they
    were 0 / 0, NaN (`schedule_to_tile._softmax_step`); a row softmax alike. The gradients agree
    with a cotangent on those rows too: the forward saves each row's max apart from the log-sum-exp
    of the scores less it (`autodiff.backward.may_hold_huge_fill`), where the log-sum-exp alone,
    the fill plus log(N), rounded to the fill and P there was 1, not 1/N (as in FlashAttention)."""
    fill = float(np.finfo(np.float32).min if dtype == np.float32 else ml_dtypes.finfo(dtype).min) \
        if fill == "finfo" else fill

    @tsr.function
    def padded(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
               keep: Tensor["M", "N"]):
        s = tsr.where(keep, tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])), fill)
        return tsr.matmul(tsr.softmax(s, dim=-1), v), tsr.softmax(tsr.where(keep, q[0, 0] @ k[0, 0].T, fill), -1)
    rng = np.random.default_rng(35)
    q, k, v = (rng.standard_normal((1, 2, 130, 32)).astype(dtype) for _ in range(3))
    keep = np.tril(np.ones((130, 130), bool))
    keep[:7] = False
    keep[70] = False
    (out, rows), f_vjp = tsr.vjp(padded, q, k, v, keep)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = np.where(keep, q64 @ k64.transpose(0, 1, 3, 2) / math.sqrt(32), fill)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    s2 = np.where(keep, q64[0, 0] @ k64[0, 0].T, fill)
    p2 = np.exp(s2 - s2.max(-1, keepdims=True))
    p2 /= p2.sum(-1, keepdims=True)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(out.astype(np.float64), p @ v64, atol=tol * 4, rtol=tol)
    np.testing.assert_allclose(rows.astype(np.float64), p2, atol=tol, rtol=tol)
    g = rng.standard_normal(out.shape).astype(dtype)
    grads = f_vjp((g, np.zeros_like(rows)))[:3]
    g64 = g.astype(np.float64)
    dp = g64 @ v64.transpose(0, 1, 3, 2)
    ds = np.where(keep, p * (dp - (dp * p).sum(-1, keepdims=True)), 0)   # (a masked score takes no gradient)
    wants = (ds @ k64 / math.sqrt(32), ds.transpose(0, 1, 3, 2) @ q64 / math.sqrt(32), p.transpose(0, 1, 3, 2) @ g64)
    for got, want in zip(grads, wants):
        assert not np.isnan(got.astype(np.float64)).any()
        np.testing.assert_allclose(got.astype(np.float64), want, atol=tol * 4 * np.abs(want).max(), rtol=tol * 4)


@pytest.mark.parametrize("fill", [-6.9e8, -4.6e8, -3e7])
def test_a_fill_whose_product_rounds_coarsely_keeps_fp16_probabilities_in_range(fill):
    """Fills between 2^24 and 2^30 over the softmax's factor took the fma form: p = 2^(rounding
    error) up to 2^6, which fp16 P @ V operands overflowed (NaN) or lost (0) on a row all of them."""
    @tsr.function
    def padded(q: Tensor["M", "D"], k: Tensor["N", "D"], v: Tensor["N", "D"], keep: Tensor["M", "N"]):
        s = tsr.where(keep, (q @ k.T).to(tsr.fp32), fill)
        return tsr.softmax(s, -1).to(tsr.fp16) @ v
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((130, 32)).astype(np.float16) for _ in range(3))
    keep = np.tril(np.ones((130, 130), bool))
    keep[:2] = False
    out = padded(q, k, v, keep).astype(np.float64)
    s = np.where(keep, (q.astype(np.float64) @ k.astype(np.float64).T).astype(np.float16).astype(np.float64), fill)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(out, p @ v.astype(np.float64), atol=2e-2, rtol=2e-2)


def test_a_key_padding_mask_of_rank_one_is_read_as_a_fill():
    """An additive mask over the keys only ([N]) of finfo(fp32).min, every key masked: uniform,
    as torch (it was missed by the check for mask inputs and came out NaN)."""
    @tsr.function
    def padded(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
               bias: Tensor["N"]):
        return tsr.softmax(q @ k.transpose(-2, -1) * 0.125 + bias, -1) @ v
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 70, 32)).astype(np.float32) for _ in range(3))
    bias = np.full(70, np.finfo(np.float32).min, np.float32)
    out = padded(q, k, v, bias)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(2, keepdims=True), out.shape), atol=1e-5)


@pytest.mark.parametrize("m, n", [(1, 4097), (64, 1000), (3, 777)])
def test_a_split_attention_weighs_a_row_all_of_a_fill_by_its_keys(m, n):
    """Split over its keys (few queries), a row all of finfo(fp32).min averages every key: each
    split's max and log2 sum are kept apart (their sum, the log-sum-exp, rounded to the fill and
    weighed a last, shorter run like the others: 0.043 off at 4097 keys in 65 splits)."""
    fill = float(np.finfo(np.float32).min)

    @tsr.function
    def attn(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
             keep: Tensor["M", "N"]):
        return tsr.softmax(tsr.where(keep, q @ k.transpose(-1, -2), fill), -1) @ v
    rng = np.random.default_rng(n)
    q = rng.standard_normal((1, 1, m, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, n, 64)).astype(np.float32) for _ in range(2))
    keep = rng.random((m, n)) < 0.5
    keep[0] = False
    specs = attn.arg_specs_for(dict(B=1, H=1, M=m, N=n, D=64), "fp32")
    specs[-1] = dataclasses.replace(specs[-1], dtype=dtypes.bool_)
    compiled = attn.compile(specs, arch="sm_90a", sm_count=132)
    assert "split_kv = 1 " not in compiled.ir("schedule") and len(compiled.kernel_names) == 2   # (split)
    (out,) = compiled.run(q, k, v, keep)
    s = np.where(keep, q[0, 0].astype(np.float64) @ k[0, 0].astype(np.float64).T, fill)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0, 0], p @ v[0, 0], atol=1e-5)


def _fill_rows_reference(q, k, v, bias, g):
    """Attention with an additive bias in float64, its output and (dQ, dK, dV) for cotangent g."""
    q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k, v, g))
    s = q64 @ k64.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + bias.astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = g64 @ v64.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(q.shape[-1])
    return p @ v64, (ds @ k64, ds.transpose(0, 1, 3, 2) @ q64, p.transpose(0, 1, 3, 2) @ g64)


@pytest.mark.parametrize("m,n", [(130, 130), (3, 4097)], ids=["rows", "split_kv"])
@pytest.mark.parametrize("mode", ["saved", "recomputed"])
def test_an_additive_mask_of_finite_fill_rows_has_exact_gradients(m, n, mode):
    """An additive float mask (HuggingFace's: 0 or finfo.min) whose rows are all fill: its values
    are unknown to the compiler, so the forward saves each row's max apart from its log-sum-exp
    (`autodiff.backward.may_hold_huge_fill`), in one flash kernel (split over the keys for 3
    queries: its combining kernel writes both) or, in a derivative that recomputes the forward, in
    the recomputed flash kernel; the backward's P there is 1/N, not 1, and the gradients exact."""
    @tsr.function
    def biased(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
               bias: Tensor["M", "N"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + bias,
                                      dim=-1), v)
    rng = np.random.default_rng(36)
    q, k, v = (rng.standard_normal((1, 2, x, 32)).astype(np.float32) for x in (m, n, n))
    bias = np.where(np.tril(np.ones((m, n), bool), n - m), 0.0, np.finfo(np.float32).min).astype(np.float32)
    bias[:2] = np.finfo(np.float32).min
    g = rng.standard_normal((1, 2, m, 32)).astype(np.float32)
    want_out, wants = _fill_rows_reference(q, k, v, bias, g)
    if mode == "saved":
        out, f_vjp = tsr.vjp(biased, q, k, v, bias)
        grads = f_vjp(g)[:3]
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
        saving_kernels = tsr.autodiff.api.saving(biased).compile(
            biased.arg_specs_for(dict(B=1, H=2, M=m, N=n, D=32), "fp32"), arch="sm_90a", sm_count=132).kernel_names
        assert not any("row_reduction" in name or "gemm" in name for name in saving_kernels), saving_kernels
    else:
        specs = biased.arg_specs_for(dict(B=1, H=2, M=m, N=n, D=32), "fp32")
        d_out = dataclasses.replace(specs[0], name="d_out")
        compiled = Derivative(biased, cotangent_names=["d_out"]).compile([*specs, d_out], arch="sm_90a", sm_count=132)
        grads = compiled.run(q, k, v, bias, g)[:3]
    for got, want in zip(grads, wants):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=1e-3)


def test_a_returned_row_max_and_logsumexp_beside_an_attention_keep_torchs_empty_rows():
    """A function returning the scores' amax and logsumexp(s - amax) beside the attention: the flash
    kernel writes them (`fusion._logsumexp_of_scores`), split over the keys or not; a row every
    key of which is masked with -inf gives -inf and NaN there, as torch."""
    @tsr.function
    def f(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
          keep: Tensor["M", "N"]):
        s = tsr.where(keep, tsr.matmul(q, k.transpose(-2, -1)) * 0.125, -math.inf)
        m = s.amax(-1, keepdim=True)
        return tsr.matmul(tsr.softmax(s, dim=-1), v), m, tsr.logsumexp(s - m, -1, keepdim=True)
    rng = np.random.default_rng(5)
    for m_, n in ((130, 130), (2, 4097)):
        q, k, v = (rng.standard_normal((1, 2, x, 32)).astype(np.float32) for x in (m_, n, n))
        keep = np.tril(np.ones((m_, n), bool), n - m_)
        keep[0] = False
        _, rowmax, lse = f(q, k, v, keep)
        s = np.where(keep, q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) * 0.125, -np.inf)
        want = s.max(-1, keepdims=True)
        assert np.isneginf(rowmax[:, :, 0]).all() and np.isnan(lse[:, :, 0]).all()
        np.testing.assert_allclose(rowmax[:, :, 1:], want[:, :, 1:], rtol=1e-5)
        with np.errstate(invalid="ignore"):
            want_lse = np.log(np.exp(s - want).sum(-1, keepdims=True))
        np.testing.assert_allclose(lse[:, :, 1:], want_lse[:, :, 1:], rtol=1e-5, atol=1e-6)


def test_a_zero_one_mask_scaled_past_the_fill_bound_saves_the_row_max():
    """(keep - 1) * 1e9 holds no constant below the bound, but its scale is past it: the forward
    saves the row max apart (`autodiff.backward.may_hold_huge_fill`)."""
    from tessera.autodiff.backward import saved_values, forward_function

    @tsr.function
    def f(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
          keep: Tensor["M", "N"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
        return tsr.matmul(tsr.softmax(s + (keep.to(tsr.fp32) - 1.0) * 1e9, dim=-1), v)
    specs = f.arg_specs_for(dict(B=1, H=2, M=70, N=70, D=32), "fp32")
    specs[-1] = dataclasses.replace(specs[-1], dtype=dtypes.bool_)
    kinds = [s.kind for s in saved_values(forward_function(f.trace(specs)))]
    assert "rowmax" in kinds and "logsumexp_less_max" in kinds


def test_an_additive_query_row_mask_of_a_huge_fill_averages_v_with_exact_gradients():
    """A [B, 1, M, 1] additive mask of finfo.min (query padding rows): the forward's probabilities
    take the exact form (`schedule_to_tile._may_hold_huge_scores`), where they were 0 / 0, and the
    backward saves the row max apart (`graph.masks_rows_or_keys`)."""
    @tsr.function
    def f(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
          rows: Tensor["B", 1, "M", 1]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + rows,
                                      dim=-1), v)
    rng = np.random.default_rng(9)
    q, k, v, g = (rng.standard_normal((1, 2, 130, 32)).astype(np.float32) for _ in range(4))
    rows = np.zeros((1, 1, 130, 1), np.float32)
    rows[..., :5, :] = np.finfo(np.float32).min
    out, f_vjp = tsr.vjp(f, q, k, v, rows)
    want_out, wants = _fill_rows_reference(q, k, v, np.broadcast_to(rows, (1, 1, 130, 130)), g)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
    for got, want in zip(f_vjp(g)[:3], wants):
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=1e-3)


def test_a_query_row_mask_viewed_inside_the_function_averages_v():
    """A [B, M] additive row mask of finfo.min given its size-1 dims inside the function
    (`rows[:, None, :, None]`) is a query-row mask too (`graph.masks_rows_or_keys`): uniform rows
    and finite gradients, split over the keys or not, where they were NaN."""
    @tsr.function
    def f(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
          rows: Tensor["B", "M"]):
        return tsr.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1])) + rows[:, None, :, None], -1) @ v
    rng = np.random.default_rng(10)
    for m_, n in ((70, 90), (3, 4097)):
        q, g = (rng.standard_normal((2, 2, m_, 32)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((2, 2, n, 32)).astype(np.float32) for _ in range(2))
        rows = np.zeros((2, m_), np.float32)
        rows[0, 0] = rows[1, -1] = np.finfo(np.float32).min
        out, f_vjp = tsr.vjp(f, q, k, v, rows)
        want_out, wants = _fill_rows_reference(q, k, v, np.broadcast_to(rows[:, None, :, None], (2, 2, m_, n)), g)
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=1e-4)
        for got, want in zip(f_vjp(g)[:3], wants):
            np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=1e-3)


@pytest.mark.parametrize("kind,d,merged", [("causal", 128, True), ("softcap_causal", 128, True), ("causal", 64, False)])
def test_a_causal_backward_ordering_its_programs_in_groups_matches_float64(kind, d, merged, short_loops, monkeypatch):
    """Row blocks heaviest first a group of programs at a time (`heavy_group`), the last group
    partial (3 programs in groups of 2), in the merged dK/dV/dQ kernel and in the two kernels of
    dK/dV and dQ: every gradient against float64 on the interpreter."""
    from tessera.passes import fusion
    monkeypatch.setattr(fusion, "HEAVY_GROUPS", (2,))
    monkeypatch.setattr(fusion, "HEAVY_GROUP_GAIN", -1.0)   # (one SM: every order takes as long)
    rng = np.random.default_rng(23)
    q_shape = (1, 3, 200, d)
    q, k, v, d_out = (rng.standard_normal(q_shape).astype(np.float16) for _ in range(4))
    c = backward(FUNCTIONS[kind], q_shape, 200, **ONE_SM)
    chains = [k for k in kernels(c) if k.kind.data == "flash_chain"]
    assert (len(chains) == 1) is merged
    assert all(dict(k.param_values).get("heavy_group") == 2 and k.param_values["heavy_first"] for k in chains)
    for name, got, want in zip("qkv", c.run(q, k, v, d_out), reference_grads(kind, q, k, v, d_out)):
        assert not np.isnan(got).any()
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-2, f"d{name}: {err}"


def _reads(value, target) -> bool:
    """Whether `value` is computed from `target` (through ops' operands, in one block)."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        if v is target:
            return True
        if id(v) not in seen and hasattr(v, "op"):
            seen.add(id(v))
            todo.extend(v.op.operands)
    return False


def test_a_backward_step_waits_for_each_mma_only_where_its_result_is_read(short_loops):
    """On asynchronous tensor cores (wgmma) the merged dK/dV/dQ step waits for S^T alone (dP^T's
    mma still runs), issues dV = P^T dO before dP^T is waited for, and waits for dQ's product with
    dK's mma still running through its add: FlashAttention-3's order (`_chain_issue_order`)."""
    c = backward(FUNCTIONS["plain"], (1, 2, 300, 128), 300, dtypes.bf16, **ONE_SM)
    name = _chain_kernel(c).sym_name.data
    kernel = next(k for k in c.modules["tile"].ops if isinstance(k, t.KernelOp) and k.sym_name.data == name)
    loop = next(op for op in kernel.walk() if op.name == "scf.for")
    body = list(loop.body.block.ops)
    steps = [(op.name, op.pending.value.data) if isinstance(op, t.MmaWaitOp) else op.name for op in body
             if isinstance(op, (t.MmaOp, t.MmaWaitOp, t.BarrierOp, t.StoreSharedOp, t.AtomicAddOp))]
    assert steps == ["tile.barrier", "tile.mma", "tile.mma", ("tile.mma_wait", 1), "tile.mma", ("tile.mma_wait", 1),
                     "tile.store_shared", "tile.barrier", "tile.mma", "tile.mma", ("tile.mma_wait", 1),
                     "tile.atomic_add", ("tile.mma_wait", 0)]
    scores_t, dp_t, dv, dq, dk = (op for op in body if isinstance(op, t.MmaOp))
    assert _reads(dv.operands[0], scores_t.results[0]) and not _reads(dv.operands[0], dp_t.results[0])
    assert _reads(dk.operands[0], dp_t.results[0])


@pytest.mark.parametrize("kind,shape,expected", [
    # 128 programs of 32 key blocks each: groups of 4 end the grid on light blocks (384 of 16: 8)
    ("causal", (8, 16, 4096, 128), {"heavy_first": 1, "heavy_group": 4, "warp_specialize": 0}),
    ("causal", (32, 12, 2048, 128), {"heavy_first": 1, "heavy_group": 8, "warp_specialize": 0}),
    ("causal", (2, 16, 8192, 128), {"heavy_first": 1, "warp_specialize": 0}),   # few heads: all at once
    ("plain", (8, 16, 4096, 128), {"heavy_first": 0, "warp_specialize": 1}),    # equal blocks; a producer
    ("alibi", (8, 16, 4096, 128), {"heavy_first": 0, "warp_specialize": 1}),
])
def test_the_merged_backward_orders_its_blocks_and_takes_a_producer_where_measured(kind, shape, expected):
    """On an H200's 132 SMs: a causal backward's key blocks heaviest first a group of heads at a
    time (`fusion._heavy_group`), an unmasked one's copies issued by a producer warpgroup
    (bench/RESULTS.md session 45)."""
    c = backward(FUNCTIONS[kind], shape, shape[2], dtypes.bf16, arch="sm_90a", sm_count=132)
    p = _chain_kernel(c).param_values
    assert {k: p.get(k) for k in expected} == expected and ("heavy_group" in p) == ("heavy_group" in expected)


def test_the_two_causal_chain_kernels_at_a_head_dim_of_64_take_groups_too():
    c = backward(FUNCTIONS["causal"], (16, 16, 2048, 64), 2048, dtypes.bf16, arch="sm_90a", sm_count=132)
    chains = [k.param_values for k in kernels(c) if k.kind.data == "flash_chain"]
    assert len(chains) == 2 and all(p["heavy_first"] and p["heavy_group"] == 16 for p in chains)


@pytest.mark.parametrize("steps,programs,slots,heaviest_last,expected", [
    ([64 - 2 * r for r in range(32)], 128, 132, False, 4),    # causal 8x16x4096: the last program's heavy
    ([2 * r + 2 for r in range(32)], 128, 132, True, 4),      # blocks start last in turn (rows growing too)
    ([64] * 32, 128, 132, False, None),                       # equal blocks: every order ends together
    ([64 - 2 * r for r in range(32)], 4, 132, False, None),   # one wave
])
def test_the_heavy_group_model(steps, programs, slots, heaviest_last, expected):
    from tessera.passes import fusion
    assert fusion._grouped_order_pays(steps, programs, slots, heaviest_last) == expected


@pytest.mark.parametrize("kind", ["plain", "causal"])   # (with and without a producer warpgroup)
def test_a_dq_add_waits_for_the_previous_one_before_the_barrier_publishing_ds(kind, short_loops):
    """A step's bulk reduction of dQ's block reads its staging buffer after the step; the next
    step's writes into it wait for that read (`bulk_wait read`) before the barrier that publishes
    dS^T to every warp (`tile_to_target._barrier_before`), not at a barrier of their own: one
    meeting of the block a step, before the stores and the add."""
    from tessera.ir import target as tgt
    c = backward(FUNCTIONS[kind], (1, 2, 300, 128), 300, dtypes.bf16, **ONE_SM)
    name = _chain_kernel(c).sym_name.data
    kernel = next(k for k in c.modules["target"].ops if isinstance(k, tgt.KernelOp) and k.sym_name.data == name)
    loop = next(op for op in kernel.walk() if op.name == "scf.for" and any(
        isinstance(inner, tgt.BulkReduceOp) for inner in op.body.block.ops))
    steps = [op.name.split(".")[-1] for op in loop.body.block.ops if isinstance(
        op, (tgt.BarrierOp, tgt.BulkWaitOp, tgt.StageRowsOp, tgt.BulkReduceOp, tgt.TensorCoreOp))]
    assert steps[steps.index("bulk_wait"):] == ["bulk_wait", "barrier", "tensor_core", "tensor_core", "stage_rows",
                                                 "barrier", "bulk_reduce"]


@pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")
def test_a_warp_specialized_backward_adds_dq_among_its_computing_warps(short_loops):
    """The unmasked merged kernel takes a producer warpgroup: its computing warps stage dQ's block
    and meet at their own barrier (1, 256 threads), never the block's (whose producer warps have
    exited), and wait for their bulk reductions before their region ends; ptxas assembles it."""
    c = backward(FUNCTIONS["plain"], (1, 2, 300, 128), 300, dtypes.bf16, **ONE_SM)
    chain = _chain_kernel(c)
    assert chain.param_values["warp_specialize"] == 1
    ptx = emit_module(c.modules["target"])[chain.sym_name.data].ptx
    consumers = ptx[ptx.index("setmaxnreg.inc"):]
    assert "bar.sync 1, 256;" in consumers and "bar.sync 0;" not in consumers
    assert consumers.index("cp.async.bulk.wait_group 0;") > consumers.rindex("cp.reduce.async.bulk")
    assemble(ptx, "sm_90a")


def test_the_heavy_group_model_skips_grids_whose_longest_block_is_a_small_share(monkeypatch):
    """Any launch order ends within one block of the work over the slots, so a grid whose longest
    block is under HEAVY_GROUP_GAIN of that keeps the plain order without the model's run (65536
    queries: 512 key blocks of 128 programs)."""
    from tessera.passes import fusion

    def no_simulation(*args):
        raise AssertionError("the model ran")
    monkeypatch.setattr(fusion.heapq, "heapreplace", no_simulation)
    assert fusion._grouped_order_pays([1024 - 2 * r for r in range(512)], 128, 132, False) is None
    with pytest.raises(AssertionError, match="the model ran"):   # (8x16x4096x128's grid: it runs)
        fusion._grouped_order_pays([64 - 2 * r for r in range(32)], 128, 132, False)


def test_a_warp_specialized_backward_whose_dq_adds_stay_reds_meets_after_them(short_loops):
    """128 queries a step at D = 128: dQ's staging does not fit beside the stages, so its adds stay
    `red`s; with a producer warpgroup no refill barrier orders a step's products (reading dS^T's
    staged tile) before the next step's store into it, so the computing warps meet after their
    adds (the async checker, which every compile here runs, flags the store otherwise)."""
    from tessera.ir import target as tgt
    fn = tsr.function(FUNCTIONS["plain"].fn, space={"block_n": [128]})
    c = backward(fn, (1, 2, 300, 128), 300, dtypes.bf16, **ONE_SM)
    chain = _chain_kernel(c)
    assert chain.param_values["warp_specialize"] == 1
    kernel = next(k for k in c.modules["target"].ops if isinstance(k, tgt.KernelOp)
                  and k.sym_name.data == chain.sym_name.data)
    (add,) = [op for op in kernel.walk() if isinstance(op, t.AtomicAddOp)]
    assert isinstance(add.next_op, tgt.BarrierOp) and add.next_op.threads.value.data == 256
    assert "cp.reduce.async.bulk" not in emit_module(c.modules["target"])[chain.sym_name.data].ptx
