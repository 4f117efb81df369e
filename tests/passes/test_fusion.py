"""Fusion decisions (Graph IR -> Schedule IR): which ops share a kernel, and that the result is still right.

Each case checks the `schedule.kernel` ops of the Schedule IR module (kinds, count, what
their regions hold, which values flow between kernels) and runs the compiled program on
the CPU tile interpreter against the Graph IR oracle.
"""
import math

import numpy as np
import pytest
from xdsl.ir import BlockArgument

import tessera as tsr
from tessera import Tensor
from tessera.compiler import compile_module
from tessera.lowering import TargetLoweringError
from tessera.passes.fusion import fuse

import norm_backward_cases
from fp8_attention import causal_fp8_attention, fp8_attention_vt
import row_chain_cases
from seed_kernels import alibi_attention, causal_attention, flash_attention

ATTN_DIMS = {"B": 2, "H": 2, "S": 70, "Sq": 70, "Sk": 70, "D": 64}


def schedule_kernels(c):
    f = next(iter(c.modules["schedule"].ops))
    return [op for op in f.body.block.ops if op.name == "schedule.kernel"]


def region_op_names(kernel) -> list[str]:
    return [op.name for op in kernel.body.block.ops]


def tile_host_ops(c) -> list[str]:
    host = next(op for op in c.modules["tile"].ops if op.name == "func.func")
    return [op.name for op in host.body.block.ops]


def compile_and_check(fn, dims, dtype, random_inputs, assert_matches_reference, seed=0, make=None):
    c = fn.compile(fn.arg_specs_for(dims, dtype))
    arrays = random_inputs(fn.arg_specs_for(dims, dtype), seed)
    if make is not None:
        arrays = make(arrays)
    assert_matches_reference(c, arrays)
    return c


# --- attention ------------------------------------------------------------------------------------------------


@tsr.function
def softcap_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    cap = 30.0
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = cap * tsr.tanh(s / cap)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def mixed_precision_attention(q: Tensor["B", "H", "S", "D", tsr.fp16], k: Tensor["B", "H", "S", "D", tsr.fp16],
                              v: Tensor["B", "H", "S", "D", tsr.fp16]):
    s = tsr.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    p = tsr.softmax(s, dim=-1).to(tsr.fp16)
    return tsr.matmul(p, v)


@tsr.function
def shared_kv_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", 1, "S", "D"], v: Tensor["B", 1, "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


ATTENTION_VARIANTS = [flash_attention, causal_attention, alibi_attention, softcap_attention,
                      mixed_precision_attention, shared_kv_attention]


@pytest.mark.parametrize("fn", ATTENTION_VARIANTS, ids=lambda f: f.name)
def test_attention_is_one_flash_attention_kernel(fn, random_inputs, assert_matches_reference):
    c = compile_and_check(fn, ATTN_DIMS, "fp16", random_inputs, assert_matches_reference)
    (kernel,) = schedule_kernels(c)
    assert kernel.kind.data == "flash_attention"
    names = region_op_names(kernel)
    assert names.count("graph.matmul") == 2 and names.count("graph.softmax") == 1
    assert names[-1] == "schedule.yield"
    assert len(c.kernel_names) == 1
    # No S x S intermediate in memory: the host launches the one kernel and allocates nothing.
    host = tile_host_ops(c)
    assert host.count("tile.launch") == 1
    assert "tile.alloc_global" not in host


def test_score_modifications_live_inside_the_flash_kernel():
    c = causal_attention.compile(causal_attention.arg_specs_for(ATTN_DIMS, "fp16"))
    names = region_op_names(schedule_kernels(c)[0])
    for op in ("graph.arange", "graph.ge", "graph.where", "graph.mul"):
        assert op in names
    c = softcap_attention.compile(softcap_attention.arg_specs_for(ATTN_DIMS, "fp32"))
    assert "graph.tanh" in region_op_names(schedule_kernels(c)[0])
    c = alibi_attention.compile(alibi_attention.arg_specs_for(ATTN_DIMS, "fp32"))
    (kernel,) = schedule_kernels(c)
    assert len(kernel.inputs) == 4  # q, k, v and the slopes
    assert {"graph.sub", "graph.add"} <= set(region_op_names(kernel))


@tsr.function
def attention_returning_probs(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                              v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    p = tsr.softmax(s, dim=-1)
    return tsr.matmul(p, v), p


@tsr.function
def attention_returning_scores(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                               v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v), s


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("fn", [attention_returning_probs, attention_returning_scores], ids=lambda f: f.name)
def test_attention_whose_intermediates_are_returned_is_not_flash(fn, dtype, random_inputs,
                                                                 assert_matches_reference):
    """The probabilities (or scores) must exist in memory, so flash attention does not apply."""
    c = compile_and_check(fn, ATTN_DIMS, dtype, random_inputs, assert_matches_reference)
    kinds = [k.kind.data for k in schedule_kernels(c)]
    assert "flash_attention" not in kinds
    assert kinds.count("gemm") == 2 and kinds.count("row_reduction") == 1


@tsr.function
def attention_probs_used_twice(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                               v: Tensor["B", "H", "S", "D"]):
    p = tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1)
    return tsr.matmul(p, v) + tsr.matmul(p, v * 2.0)


def test_attention_probs_with_two_consumers_is_not_flash(random_inputs, assert_matches_reference):
    c = compile_and_check(attention_probs_used_twice, ATTN_DIMS, "fp32", random_inputs, assert_matches_reference)
    assert "flash_attention" not in [k.kind.data for k in schedule_kernels(c)]


# --- gemm, row reductions, elementwise -----------------------------------------------------------------------

@tsr.function
def linear_gelu(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(tsr.matmul(x, w) + b)


@tsr.function
def linear_gelu_tanh_cast(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(x @ w + b, approximate="tanh").to(tsr.fp16)


@tsr.function
def linear_silu_transposed(x: Tensor["M", "K"], w: Tensor["N", "K"]):
    return tsr.silu(x @ w.T) * 0.5


GEMM_DIMS = {"M": 33, "K": 40, "N": 50}


@pytest.mark.parametrize("fn", [linear_gelu, linear_gelu_tanh_cast, linear_silu_transposed], ids=lambda f: f.name)
def test_matmul_with_epilogue_is_one_gemm_kernel(fn, random_inputs, assert_matches_reference):
    c = compile_and_check(fn, GEMM_DIMS, "fp32", random_inputs, assert_matches_reference)
    (kernel,) = schedule_kernels(c)
    assert kernel.kind.data == "gemm"
    names = region_op_names(kernel)
    assert names.count("graph.matmul") == 1
    assert "tile.alloc_global" not in tile_host_ops(c)


def test_gelu_epilogue_ops_are_in_the_gemm_region():
    c = linear_gelu.compile(linear_gelu.arg_specs_for(GEMM_DIMS, "fp16"))
    names = region_op_names(schedule_kernels(c)[0])
    assert {"graph.matmul", "graph.add", "graph.erf", "graph.mul"} <= set(names)


@tsr.function
def softmax_rows(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def softmax_with_prologue_and_epilogue(x: Tensor["M", "N"], bias: Tensor["N"]):
    return tsr.softmax((x + bias) * 0.5, dim=-1).to(tsr.fp16)


@tsr.function
def layer_norm_affine(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def residual_layer_norm(x: Tensor["M", "N"], r: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.layer_norm(x + r, [x.shape[-1]], w) * 2.0


@tsr.function
def rms_norm_weight(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, [x.shape[-1]], w)


@tsr.function
def row_sum(x: Tensor["M", "N"]):
    return tsr.sum(tsr.exp(x), dim=-1, keepdim=True)


@pytest.mark.parametrize("fn", [softmax_rows, softmax_with_prologue_and_epilogue, layer_norm_affine,
                                residual_layer_norm, rms_norm_weight, row_sum], ids=lambda f: f.name)
def test_row_reduction_is_one_kernel(fn, random_inputs, assert_matches_reference):
    c = compile_and_check(fn, {"M": 9, "N": 300}, "fp32", random_inputs, assert_matches_reference)
    (kernel,) = schedule_kernels(c)
    assert kernel.kind.data == "row_reduction"
    assert "tile.alloc_global" not in tile_host_ops(c)


@pytest.mark.parametrize("fn", list(row_chain_cases.CASES), ids=lambda f: f.name)
@pytest.mark.parametrize("dims", [{"M": 9, "N": 300}, {"M": 3, "N": 1}, {"M": 5, "N": 20000}], ids=["row", "one", "chunks"])
def test_statistics_a_later_row_reduction_reads_share_its_kernel(fn, dims, random_inputs, assert_matches_reference):
    """A statistic only a later reduction over the same rows reads (a variance's mean, the max a
    written-out softmax subtracts; three in a chain for the purity) is computed first in that
    reduction's kernel (`fusion.merge_row_chains`), where it took a kernel of its own and the rows
    were read twice; with a column sum of the same rows riding along (`merge_column_reductions`)."""
    c = compile_and_check(fn, dims, "fp32", random_inputs, assert_matches_reference)
    references, row_kernels = row_chain_cases.CASES[fn]
    assert [k.kind.data for k in schedule_kernels(c)].count("row_reduction") == row_kernels
    (x,) = random_inputs(fn.arg_specs_for(dims, "fp32"), 0)
    for got, want in zip(c.run(x), references(x.astype(np.float64))):
        np.testing.assert_allclose(np.asarray(got, np.float64).reshape(want.shape), want, rtol=2e-5, atol=2e-5)


@tsr.function
def statistic_along_the_columns(x: Tensor["N", "N"]):
    return (x - x.amax(-1, keepdim=True)[:, 0]).sum(-1), tsr.exp(x - x.mean(-1, keepdim=True).reshape(1, x.shape[0])).sum(-1)


def test_a_statistic_viewed_along_the_columns_keeps_its_kernel(random_inputs, assert_matches_reference):
    """A row statistic whose view drops its size-1 dim broadcasts along the columns: the row
    template's statistic is a row's, so it stays a kernel of its own (it was merged, and wrong)."""
    c = compile_and_check(statistic_along_the_columns, {"N": 6}, "fp32", random_inputs, assert_matches_reference)
    (x,) = random_inputs(statistic_along_the_columns.arg_specs_for({"N": 6}, "fp32"), 0)
    x64 = x.astype(np.float64)
    first, second = c.run(x)
    np.testing.assert_allclose(first, (x64 - x64.max(-1)).sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second, np.exp(x64 - x64.mean(-1)[None, :]).sum(-1), rtol=1e-5)


@tsr.function
def elementwise_chain(x: Tensor["B", "M", "N"], y: Tensor["N"], z: Tensor["M", 1]):
    a = tsr.exp(-tsr.abs(x)) * y + z
    b = tsr.where(x > y, a, tsr.minimum(a, 0.5))
    return (tsr.tanh(b) + tsr.sqrt(b * b + 1.0)).to(tsr.fp16)


def test_elementwise_chain_is_one_kernel(random_inputs, assert_matches_reference):
    c = compile_and_check(elementwise_chain, {"B": 2, "M": 5, "N": 33}, "fp32", random_inputs,
                          assert_matches_reference)
    (kernel,) = schedule_kernels(c)
    assert kernel.kind.data == "elementwise"
    assert len(kernel.inputs) == 3
    assert "tile.alloc_global" not in tile_host_ops(c)


# --- materialisation -----------------------------------------------------------------------------------------

@tsr.function
def shared_value_two_reductions(x: Tensor["M", "N"]):
    y = tsr.exp(x) * 2.0
    return tsr.softmax(y, dim=-1), tsr.amax(y, dim=-1, keepdim=True)


@tsr.function
def shared_value_returned_and_reduced(x: Tensor["M", "N"]):
    y = tsr.exp(x) * 2.0
    return y, tsr.sum(y, dim=-1, keepdim=True)


@tsr.function
def shared_gemm_output(x: Tensor["M", "K"], w1: Tensor["K", "N"], w2: Tensor["N", "K"]):
    h = tsr.gelu(x @ w1)
    return tsr.layer_norm(h, h.shape[-1]), h @ w2


def test_an_elementwise_tree_over_inputs_is_copied_into_each_kernel_reading_it(random_inputs,
                                                                              assert_matches_reference):
    """exp(x) * 2 read by a softmax and an amax: each row reduction computes it from x as its
    prologue (passes/recompute.py `copy_shared_prologues`), no kernel writes it to memory; and a
    returned one is written by its own kernel while the reduction still reads x, not it."""
    c = compile_and_check(shared_value_two_reductions, {"M": 9, "N": 33}, "fp32", random_inputs,
                          assert_matches_reference)
    kernels = schedule_kernels(c)
    assert [k.kind.data for k in kernels] == ["row_reduction", "row_reduction"]
    assert all(len(k.inputs) == 1 and isinstance(k.inputs[0], BlockArgument) for k in kernels)
    c = compile_and_check(shared_value_returned_and_reduced, {"M": 9, "N": 33}, "fp32", random_inputs,
                          assert_matches_reference)
    kernels = schedule_kernels(c)
    assert sorted(k.kind.data for k in kernels) == ["elementwise", "row_reduction"]
    assert all(isinstance(v, BlockArgument) for k in kernels for v in k.inputs)


@pytest.mark.parametrize("fn,kinds", [
    (shared_gemm_output, ["gemm", "row_reduction", "gemm"]),
], ids=lambda x: getattr(x, "name", None))
def test_value_with_consumers_in_different_kernels_is_materialized(fn, kinds, random_inputs,
                                                                   assert_matches_reference):
    c = compile_and_check(fn, {"M": 9, "K": 20, "N": 33}, "fp32", random_inputs, assert_matches_reference)
    kernels = schedule_kernels(c)
    assert sorted(k.kind.data for k in kernels) == sorted(kinds)
    producer = kernels[0]
    assert producer.kind.data == kinds[0]
    # The shared value is the producer's single result, read by every other kernel.
    consumers = {use.operation for use in producer.outputs[0].uses}
    assert set(kernels[1:]) <= consumers
    # Each consumer reads it as an input rather than recomputing it.
    for k in kernels[1:]:
        assert producer.outputs[0] in list(k.inputs)


@tsr.function
def bshd_attention(q: Tensor["B", "S", "H", "D"], k: Tensor["B", "S", "H", "D"], v: Tensor["B", "S", "H", "D"]):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def test_transposed_inputs_are_index_maps_not_copies(random_inputs, assert_matches_reference):
    """q, k, v in [B, S, H, D] layout: the transposes become load index maps of the one flash kernel."""
    c = compile_and_check(bshd_attention, ATTN_DIMS, "fp16", random_inputs, assert_matches_reference)
    (kernel,) = schedule_kernels(c)
    assert kernel.kind.data == "flash_attention"
    assert "tile.alloc_global" not in tile_host_ops(c)


@tsr.function
def bshd_attention_bshd_out(q: Tensor["B", "S", "H", "D"], k: Tensor["B", "S", "H", "D"],
                            v: Tensor["B", "S", "H", "D"]):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v).transpose(1, 2)


def test_attention_with_a_transposed_result_is_one_kernel(random_inputs, assert_matches_reference):
    """[B, S, H, D] in and out (the usual layout of a transformer's activations)."""
    c = compile_and_check(bshd_attention_bshd_out, ATTN_DIMS, "fp16", random_inputs, assert_matches_reference)
    assert [k.kind.data for k in schedule_kernels(c)] == ["flash_attention"]   # it stores the transpose itself


@tsr.function
def view_of_argument(x: Tensor["M", "N"]):
    return x.T


@tsr.function
def argument_itself(x: Tensor["M", "N"]):
    return x


@tsr.function
def view_of_gemm(x: Tensor["M", "K"], w: Tensor["K", "N"]):
    return (x @ w).T


@tsr.function
def view_of_softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1).T


@tsr.function
def view_of_elementwise(x: Tensor["M", "N"]):
    return tsr.exp(x).transpose(0, 1)


@tsr.function
def unsqueezed_gemm(x: Tensor["M", "K"], w: Tensor["K", "N"]):
    return (x @ w)[None]


@tsr.function
def two_views_of_a_sum(x: Tensor["M", "N"]):
    """Two returned views of one kernel's output: the kernel writes through one, the other is a copy."""
    s = tsr.sum(x, 0, keepdim=True)
    return s.reshape(x.shape[-1]), s.reshape(1, 1, x.shape[-1])


@tsr.function
def two_flat_views(x: Tensor["M", "N"]):
    s = x * 2.0
    return s.reshape(x.shape[0] * x.shape[1]), s.reshape(1, x.shape[0] * x.shape[1])


@tsr.function
def a_view_and_its_source(x: Tensor["M", "N"]):
    s = tsr.sum(x, 0, keepdim=True)
    return s.reshape(x.shape[-1]), s


@pytest.mark.parametrize("fn", [view_of_argument, argument_itself, view_of_gemm, view_of_softmax,
                                view_of_elementwise, unsqueezed_gemm, two_views_of_a_sum, two_flat_views,
                                a_view_and_its_source], ids=lambda f: f.name)
def test_results_that_are_views_are_written(fn, random_inputs, assert_matches_reference):
    """A returned view (of an argument or of a computed value) still needs a kernel that writes it."""
    compile_and_check(fn, {"M": 9, "K": 20, "N": 33}, "fp32", random_inputs, assert_matches_reference)


def test_fuse_leaves_the_graph_module_unchanged():
    from tessera.ir import print_ir

    module = flash_attention.trace(flash_attention.arg_specs_for(ATTN_DIMS, "fp16"))
    before = print_ir(module)
    scheduled = fuse(module)
    scheduled.verify()
    assert print_ir(module) == before


def test_autotune_space_sets_schedule_params():
    module = linear_gelu.trace(linear_gelu.arg_specs_for(GEMM_DIMS, "fp16"))
    c = compile_module(module, space={"block_m": [64, 128], "block_n": [32, 64], "num_warps": [4]})
    (kernel,) = schedule_kernels(c)
    params = kernel.param_values
    assert params["block_m"] == 64 and params["block_n"] == 32 and params["num_warps"] == 4


def test_native_tiling_only_for_gemms_the_native_path_can_take():
    """On sm_90a a GEMM with 16-byte rows gets the wgmma tiling (128x256, overlapped steps); one
    with 70-element fp16 rows (no TMA box) keeps the measured mma.sync tiling (256x128)."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)

    def params(k):
        module = fuse(mm.trace(mm.arg_specs_for({"M": 4096, "K": k, "N": 4096}, "fp16")),
                      platform=platforms.get("sm_90a"))
        (kernel,) = [op for op in module.walk() if op.name == "schedule.kernel"]
        return kernel.param_values
    native, fallback = params(128), params(70)
    assert (native["block_m"], native["block_n"], native["mma_async"]) == (128, 256, 1)
    assert (fallback["block_m"], fallback["block_n"], fallback["mma_async"]) == (128, 128, 0)


@pytest.mark.parametrize("m, k, n, dtype, arch, cluster", [
    (3000, 4096, 5000, "bf16", "sm_90a", 2),      # B rows of 10000 bytes split lines; 480 tiles for 132 blocks
    (3000, 4096, 5000, "fp16", "sm_90a", 2),
    (3000, 4096, 5120, "bf16", "sm_90a", None),   # whole 128-byte lines
    (850, 8192, 3000, "bf16", "sm_90a", None),    # 84 tiles, 7 rows: one wave, nothing walked, no pairs
    (3000, 4096, 5000, "bf16", "sm_80", None),    # no clusters
    (2900, 4096, 5000, "bf16", "sm_90a", 2),      # 23 tile rows: the last pair's second row past M
    (128, 4096, 40008, "bf16", "sm_90a", None),   # 1 tile row: pairs would compute twice the rows
    (384, 4096, 40008, "bf16", "sm_90a", None),   # 3 tile rows computed as 4
])
def test_gemm_blocks_pair_up_where_b_rows_split_lines(m, k, n, dtype, arch, cluster):
    """A persistent 16-bit GEMM walking more tiles than blocks whose B rows (as stored) start off
    128-byte lines pairs its blocks in clusters sharing B's tiles (`SPLIT_ROWS_GEMM_CLUSTER`)."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)

    module = fuse(mm.trace(mm.arg_specs_for({"M": m, "K": k, "N": n}, dtype)), platform=platforms.get(arch))
    p = next(op for op in module.walk() if op.name == "schedule.kernel").param_values
    assert p.get("cluster") == cluster


@pytest.mark.parametrize("m, cluster", [(384, None), (700, None), (3000, 2)])
def test_a_dynamic_m_pairs_blocks_only_where_its_smallest_rows_would(m, cluster):
    """M taken at run time: the default judges the rows a cluster adds past M at the class's least
    value (257 rows: 3 tile rows as 4, 513: 5 as 6; the class past 1024 from 1025: 9 as 10)."""
    import tessera as tsr

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)

    compiled = mm.compile(mm.arg_specs_for({"M": m, "K": 4096, "N": 5000}, "bf16"), dynamic=frozenset({"M"}),
                          arch="sm_90a")
    p = next(op for op in compiled.modules["schedule"].walk() if op.name == "schedule.kernel").param_values
    assert p.get("cluster") == cluster


def test_gemm_clusters_launch_what_runs_at_once_and_trust_only_stored_rows():
    """A pinned cluster of 4 launches the 30 clusters an H200 runs at once at one block an SM (not
    33: the last 3 would walk after the others); B read through a reshape (a [K, 26, 96] tensor
    viewed as [K, 2496], rows of 4992 bytes: whole lines) is not judged by its source's 192-byte
    steps."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)

    @tsr.function
    def mm_view(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "H", "D"]):
        return tsr.matmul(a, b.reshape(b.shape[0], b.shape[1] * b.shape[2]))

    def params(fn, dims, space=None):
        module = fuse(fn.trace(fn.arg_specs_for(dims, "bf16")), space, platform=platforms.get("sm_90a"))
        return next(op for op in module.walk() if op.name == "schedule.kernel").param_values
    p = params(mm, {"M": 3000, "K": 4096, "N": 5000}, {"cluster": [4]})
    assert (p["cluster"], p["programs"]) == (4, 120)
    assert params(mm, {"M": 3000, "K": 4096, "N": 5000})["programs"] == 132     # pairs: all 66 run at once
    view = params(mm_view, {"M": 3000, "K": 4096, "H": 26, "D": 96})
    assert view["block_n"] == 256 and view.get("cluster") is None


@pytest.mark.parametrize("m, k, n, dtype, space, tile", [
    (512, 512, 512, "bf16", None, (64, 64, 4)),
    (1024, 1024, 1024, "bf16", None, (128, 128, 8)),
    (2048, 2048, 2048, "bf16", None, (128, 256, 8)),          # 128 tiles: the default fills the SMs
    (16, 4096, 4096, "fp16", None, (64, 64, 4)),
    (128, 4096, 4096, "bf16", None, (64, 128, 4)),
    (256, 4096, 4096, "bf16", None, (128, 128, 8)),
    (512, 512, 512, "bf16", {"block_m": [128]}, (128, 256, 8)),   # a space's tile wins
    (70, 64, 70, "fp16", None, (128, 128, 4)),                # 70-element rows: mma.sync's tiling
])
def test_a_small_native_gemm_takes_tiles_for_the_sms(m, k, n, dtype, space, tile):
    """A native GEMM whose 128 x 256 tiles would fill under a quarter of the SMs takes the largest
    of GEMM_TILES that does, else 64 x 64 (H200 sweep in fusion.GEMM_TILES's comment)."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)

    module = fuse(mm.trace(mm.arg_specs_for({"M": m, "K": k, "N": n}, dtype)), space,
                  platform=platforms.get("sm_90a"))
    p = next(op for op in module.walk() if op.name == "schedule.kernel").param_values
    assert (p["block_m"], p["block_n"], p["num_warps"]) == tile


def test_small_gemm_tiles_keep_an_epilogues_narrower_tile():
    """An epilogue that asked for 128 columns (a division) never gets 256 back."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def divided(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b) / 3.0

    module = fuse(divided.trace(divided.arg_specs_for({"M": 2048, "K": 512, "N": 2048}, "bf16")),
                  platform=platforms.get("sm_90a"))
    p = next(op for op in module.walk() if op.name == "schedule.kernel").param_values
    assert p["block_n"] <= 128


def test_native_tiling_for_attention_whatever_the_sequence_length():
    """Attention's probabilities (S = 129 columns) are computed in the kernel, not copied: only Q, K
    and V need 16-byte rows, so S = 129 still gets the native tiling (128 rows on 8 warps)."""
    import math

    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def att(q: tsr.Tensor["B", "S", "D"], k: tsr.Tensor["B", "S", "D"], v: tsr.Tensor["B", "S", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(64), dim=-1), v)

    module = fuse(att.trace(att.arg_specs_for({"B": 2, "S": 129, "D": 64}, "fp16")), platform=platforms.get("sm_90a"))
    (kernel,) = [op for op in module.walk() if op.name == "schedule.kernel"]
    assert (kernel.param_values["block_m"], kernel.param_values["num_warps"]) == (128, 8)


@pytest.mark.parametrize("dims,dtype,ahead", [
    (dict(B=8, H=16, S=4096, D=128), "bf16", True), (dict(B=1, H=16, S=8192, D=128), "fp16", True),
    (dict(B=2, H=4, S=1000, D=128), "fp16", False),   # 64 query blocks: not 4 waves of the SMs
    (dict(B=16, H=16, S=2048, D=64), "bf16", False),   # D = 64: 128 keys, two blocks an SM
    (dict(B=8, H=32, S=1, D=128), "bf16", False),      # a decode step's few query rows (split over the keys)
    (dict(B=8, H=16, S=4096, D=128), "fp32", False)])  # (no wgmma: the mma.sync schedule)
def test_hopper_attention_at_d128_computes_scores_ahead_with_a_producer(dims, dtype, ahead):
    """`schedule.SHAPE_DEFAULTS`: on sm_90a a 16-bit attention at D = 128 whose query blocks make 4+
    waves takes 128 keys a block, a producer warpgroup and the next block's scores ahead (keys and
    values two stages each); other head dims, decode steps, small grids and other paths keep theirs."""
    import math

    @tsr.function
    def att(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(128), dim=-1), v)

    c = att.compile(att.arg_specs_for(dims, dtype), arch="sm_90a")
    p = next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    picked = (p["block_n"], p.get("qk_ahead"), p.get("warp_specialize"), p["num_stages"])
    assert (picked == (128, 1, 1, 2)) == ahead, picked


@pytest.mark.parametrize("dims,causal,walks", [
    (dict(B=8, H=16, S=4096, D=128), False, True), (dict(B=128, H=16, S=1024, D=128), False, True),
    (dict(B=8, H=16, S=4096, D=128), "causal", True),  # each query block's key loop its own length
    (dict(B=8, H=16, S=4096, D=128), "window", False),  # keys bounded below: tiles not from key block 0
    (dict(B=16, H=16, S=2048, D=64), False, False)])  # D = 64: not the scores-ahead schedule
def test_hopper_attention_at_d128_walks_its_query_tiles(dims, causal, walks):
    """`schedule.SHAPE_DEFAULTS`: the scores-ahead schedule, where no mask bounds a query block's
    keys below, is persistent, one block an SM walking the query tiles (`programs`: the SMs)."""
    import math

    @tsr.function
    def att(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if causal:
            i = tsr.arange(q.shape[-2])
            keep = i[:, None] >= i[None, :]
            if causal == "window":
                keep = keep & (i[None, :] >= i[:, None] - 1024)
            s = tsr.where(keep, s, -math.inf)
        return tsr.matmul(tsr.softmax(s, dim=-1), v)

    c = att.compile(att.arg_specs_for(dims, "bf16"), arch="sm_90a", sm_count=132)
    p = next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    assert (p.get("persistent"), p.get("programs")) == ((1, 132) if walks else (0, None))
    assert ("grid = array<i64: 132, 1, 1>" in c.ir("tile")) == walks


@pytest.mark.parametrize("b,h,s,heads_first", [(1, 16, 8192, 1), (2, 8, 8192, 1), (2, 16, 8192, 0), (4, 8, 4096, 0)])
def test_a_causal_walk_takes_every_heads_heaviest_tiles_first_over_few_heads(b, h, s, heads_first):
    """`fusion.HEAVY_FIRST_WALK_BLOCKS_PER_PROGRAM`: a causal attention walking its query tiles
    takes every head's heaviest first (`heavy_first`) where 8 blocks of each head run at once on
    132 SMs (16 heads or fewer), else each head's in turn."""
    from attention_cases import FUNCTIONS
    f = FUNCTIONS["causal"]
    c = f.compile(f.arg_specs_for(dict(B=b, H=h, S=s, D=128), "bf16"), arch="sm_90a", sm_count=132)
    p = next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    assert (p["persistent"], p["heavy_first"]) == (1, heads_first)


@pytest.mark.parametrize("b,h,s,walks", [
    (8, 16, 4096, True), (32, 12, 2048, True), (2, 16, 8192, True),   # measured faster walking (RESULTS 44)
    (3, 16, 4096, False), (2, 12, 4096, False), (1, 24, 8192, False)])   # ... and slower
def test_a_causal_attention_walks_where_the_model_says_it_pays(b, h, s, walks):
    """`fusion._causal_walk_pays`: the causal walk is kept where a model of its static split against
    the hardware's dynamic one of a grid says it pays, at the shapes measured both ways."""
    from attention_cases import FUNCTIONS
    f = FUNCTIONS["causal"]
    c = f.compile(f.arg_specs_for(dict(B=b, H=h, S=s, D=128), "bf16"), arch="sm_90a", sm_count=132)
    p = next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    assert bool(p["persistent"]) == walks and (f"grid = array<i64: 132, 1, 1>" in c.ir("tile")) == walks


def test_the_walk_model_balances_equal_tiles_and_not_a_round_of_one_heavy_tile():
    """`fusion._causal_walk_pays` on made-up tiles: equal ones split evenly, so the walk's smaller
    fixed part pays; 3 heads of 7 causal query blocks over 4 blocks do not: round 1 (reversed)
    ends on the second head's heaviest tile, so block 0 takes a heaviest tile in both rounds (the
    grid's free slots take the tiles as they come)."""
    from tessera.passes.fusion import _causal_walk_pays
    assert _causal_walk_pays([4] * 8, heads=33, programs=132, slots=132, walk_heads_first=False,
                             grid_heads_first=False)
    assert not _causal_walk_pays(list(range(1, 8)), heads=3, programs=4, slots=4, walk_heads_first=False,
                                 grid_heads_first=False)


def test_grouped_query_and_fp8_value_attention_keep_their_d128_schedules():
    """Grouped-query attention (K and V shared by query heads) and an fp8 V are outside the D = 128
    rule (not measured with it): GQA keeps 64 keys and no producer, the fp8 V its own rule's
    producer without the scores ahead (which measured slower for fp8)."""
    from tessera.bench import cases

    def params(fn, dims, dtype):
        c = fn.compile(fn.arg_specs_for(dims, dtype), arch="sm_90a")
        return next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    p = params(cases.gqa_causal_attention, dict(B=8, H=32, Hk=8, S=4096, D=128), "bf16")
    assert (p["block_n"], p.get("qk_ahead"), p.get("warp_specialize")) == (64, 0, 0)

    @tsr.function
    def fp8_values(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                   v: Tensor["B", "H", "S", "D", tsr.fp8_e4m3]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1).to(tsr.fp8_e4m3), v).to(tsr.bf16)
    p = params(fp8_values, dict(B=8, H=16, S=4096, D=128), "bf16")
    assert (p["block_n"], p.get("qk_ahead"), p.get("warp_specialize")) == (128, 0, 1)


@pytest.mark.parametrize("dims,causal,turns,wide", [
    (dict(B=8, H=16, S=4096, D=128), False, True, True), (dict(B=4, H=16, S=8192, D=128), False, True, True),
    (dict(B=8, H=16, S=4096, D=128), True, False, True),    # causal: its shorter loops pay the turns' start
    (dict(B=2, H=4, S=1000, D=128), False, False, False),   # 64 query blocks: not 4 waves of the SMs
    (dict(B=64, H=64, S=64, D=128), False, False, False),   # a 64-row query tile: one computing warpgroup
    (dict(B=16, H=16, S=2048, D=64), False, True, True),    # D = 64: Q and K in TMA's 64-byte swizzle
    (dict(B=16, H=16, S=2048, D=32), False, False, False)])  # D = 32: 32-byte rows, on mma.sync
def test_fp8_attention_warpgroups_take_turns(dims, causal, turns, wide):
    """`schedule.SHAPE_DEFAULTS`: an fp8 attention at D = 64 or 128 over 4+ waves of 128-row query
    blocks takes 256 keys a block and walks the query tiles, one block an SM (`persistent`; under a
    causal mask where the walk pays, as at 8x16x4096); without a causal mask its two computing
    warpgroups take turns at their mmas (`pingpong`)."""
    fn = causal_fp8_attention if causal else fp8_attention_vt
    c = fn.compile(fn.arg_specs_for({**dims, "N": dims["S"]}), arch="sm_90a", sm_count=132)
    p = next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values
    assert bool(p.get("pingpong")) == turns and (not turns or (p["warp_specialize"], p["num_warps"]) == (1, 8))
    assert (p["block_n"] == 256) == wide
    assert (p.get("persistent"), p.get("programs")) == ((1, 132) if wide else (0, None))


def test_fp8_attention_with_rows_narrower_than_a_box_takes_the_mma_sync_schedule():
    """fp8 Q and K at D = 32 are 32-byte rows, which the Hopper path does not copy (whole 128-byte
    swizzled rows, or one 64-byte row of 8-bit elements): the kernel runs on mma.sync, so fusion
    gives it mma.sync's schedule (64 keys on 4 warps), not the wgmma one (which spilled); D = 64
    (TMA's 64-byte swizzle) and D = 128 take wgmma's, two computing warpgroups and a producer over
    256 keys a block."""
    def params(d):
        c = fp8_attention_vt.compile(fp8_attention_vt.arg_specs_for(dict(B=16, H=16, S=2048, N=2048, D=d)),
                                     arch="sm_90a")
        return next(k for k in schedule_kernels(c) if k.kind.data == "flash_attention").param_values, c
    p, c = params(32)
    assert (p["block_n"], p["num_warps"], p.get("warp_specialize")) == (64, 4, 0)
    assert 'tensor_core "wgmma"' not in c.ir("target")
    for d in (64, 128):
        p, c = params(d)
        assert (p["block_n"], p["num_warps"], p.get("warp_specialize")) == (256, 8, 1)
        assert 'tensor_core "wgmma"' in c.ir("target")


# --- split-K ------------------------------------------------------------------------------------------------

@tsr.function
def plain_gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def split_k_of(dims, **options) -> int:
    c = plain_gemm.compile(plain_gemm.arg_specs_for(dims, "fp16"), **options)
    (kernel,) = schedule_kernels(c)
    return kernel.param_values["split_k"]


#: the native GEMM's default tile, pinned where a test is about what follows from it
WIDE = dict(block_m=[128], block_n=[256])


@pytest.mark.parametrize("dims,options,expected", [
    (dict(M=128, K=4096, N=4096), dict(arch="sm_90a"), 4),                  # 64 tiles of 64 x 128; 64 K steps make 4 splits
    (dict(M=512, K=16384, N=512), dict(arch="sm_90a", space=WIDE), 16),     # 8 tiles of 128 x 256, 132 SMs
    (dict(M=512, K=16384, N=512), dict(arch="sm_90a", sm_count=66, space=WIDE), 8),   # half the SMs, half the splits
    (dict(M=512, K=16384, N=512), dict(arch="sm_90a"), 6),                  # 64 tiles of 64 x 64, 3 blocks an SM
    (dict(M=128, K=8192, N=4096), dict(arch="sm_80"), 6),                   # 32 tiles of 128 x 128, 108 SMs x 2
    (dict(M=4096, K=4096, N=4096), dict(arch="sm_90a"), 1),                 # enough tiles
    (dict(M=128, K=1984, N=4096), dict(arch="sm_90a"), 1),                  # 31 K steps: too short to split
    (dict(M=128, K=4096, N=4096), dict(arch="sm_90a", space=dict(split_k=[1])), 1),   # the space pins it
])
def test_split_k_fills_the_gpu_when_output_tiles_cannot(dims, options, expected):
    """The derived `split_k`: output tiles times splits fill the target's block slots (SMs times
    the blocks one holds) when the tiles alone fill less than half, each split keeping 16+ K steps."""
    assert split_k_of(dims, **options) == expected


# --- split-KV (flash-decoding) --------------------------------------------------------------------------------

def split_kv_of(fn, dims, **options) -> int:
    c = fn.compile(fn.arg_specs_for(dims, "fp16"), **options)
    (kernel,) = schedule_kernels(c)
    return kernel.param_values["split_kv"]


@pytest.mark.parametrize("dims,options,expected", [
    # 32 one-query blocks; a 16-row query tile and 64-key blocks of D=128 hold 3 blocks per SM: 396 slots
    (dict(B=1, H=32, M=1, N=131072, D=128), dict(arch="sm_90a"), 12),
    (dict(B=1, H=32, M=1, N=131072, D=128), dict(arch="sm_90a", sm_count=66), 6),   # half the SMs
    (dict(B=1, H=32, M=1, N=1024, D=128), dict(arch="sm_90a"), 8),      # 16 key blocks: two blocks an SM
    (dict(B=1, H=32, M=1, N=192, D=128), dict(arch="sm_90a"), 1),       # 3 key blocks: too few to split
    (dict(B=1, H=8, M=1, N=1024, D=128), dict(arch="sm_90a"), 16),      # 8 blocks: a key block a split
    (dict(B=1, H=8, M=1, N=8192, D=128), dict(arch="sm_90a"), 33),      # 128 key blocks: two blocks an SM
    (dict(B=1, H=8, M=1, N=512, D=128), dict(arch="sm_90a"), 8),        # 8 key blocks: one a split
    (dict(B=1, H=8, M=1, N=448, D=128), dict(arch="sm_90a"), 1),        # 7 key blocks: one run of 4+
    (dict(B=8, H=32, M=1, N=32768, D=128), dict(arch="sm_90a"), 1),     # 256 blocks fill half the slots
    (dict(B=1, H=8, M=4096, N=4096, D=128), dict(arch="sm_90a"), 1),    # prefill: query blocks enough
    (dict(B=1, H=32, M=1, N=131072, D=128), dict(arch="sm_90a", space=dict(split_kv=[1])), 1),   # pinned
])
def test_split_kv_fills_the_gpu_when_query_blocks_cannot(dims, options, expected):
    """The derived `split_kv`: query blocks times splits fill the target's block slots when the
    query blocks alone fill at most half, each split keeping 4+ key blocks, or down to one key
    block where that leaves an SM without two blocks and the cache has 8+ key blocks."""
    from decode_attention import decode_attention
    assert split_kv_of(decode_attention, dims, **options) == expected


def test_split_kv_of_a_dynamic_batch_follows_its_class_bottom():
    """A batch dim taken at run time splits over a long cache as the smallest value of its class
    would (2 for the class 2..16), where it used not to split at all: a decode loop that saw two batch sizes ran
    unsplit, 0.7x cuDNN at B=8 (H100). Its partial outputs are sized by B at run time."""
    from decode_attention import decode_attention
    fn = tsr.function(decode_attention.fn, dynamic=["B"])
    dims = dict(B=8, H=8, M=1, N=32768, D=128)
    c = fn.compile(fn.arg_specs_for(dims, "bf16"), dynamic=frozenset({"B"}), arch="sm_90a")
    split = [k.param_values["split_kv"] for k in schedule_kernels(c)]
    assert split == [split_kv_of(decode_attention, {**dims, "B": 2}, arch="sm_90a")] and split[0] > 1
    short = {**dims, "N": 1024}   # a short cache: split for the class's middle batch (5), not its bottom
    c = fn.compile(fn.arg_specs_for(short, "bf16"), dynamic=frozenset({"B"}), arch="sm_90a")
    assert [k.param_values["split_kv"] for k in schedule_kernels(c)] == \
        [split_kv_of(decode_attention, {**short, "B": 5}, arch="sm_90a")]
    assert "?" in c.ir("tile") and c.stage("cubin")


@pytest.mark.parametrize("kind,dims,arch,expected", [
    ("causal", dict(B=3, H=5, S=1531, D=128), "sm_90a", (64, 1)),       # 180 blocks of 128 rows: 2 waves of 132
    ("softcap_causal", dict(B=1, H=8, S=4096, D=128), "sm_90a", (64, 1)),
    ("causal", dict(B=2, H=8, S=4096, D=128), "sm_90a", (128, 1)),      # 512 blocks: the last first, 128 rows
    ("causal", dict(B=4, H=8, S=2048, D=64), "sm_90a", (128, 1)),       # 32 programs: 4 blocks each on 132 SMs
    ("causal", dict(B=8, H=16, S=4096, D=128), "sm_90a", (128, 0)),     # 128 programs: too many to share in L2
    ("plain", dict(B=1, H=8, M=4096, N=4096, D=128), "sm_90a", (128, 0)),   # no mask: the blocks' work is equal
    ("causal", dict(B=3, H=5, S=1531, D=128), "sm_80", (128, 1)),       # 64 rows only where measured (wgmma)
])
def test_few_heads_start_their_heaviest_query_blocks_first(kind, dims, arch, expected):
    """The derived `heavy_first` (and 64-row query blocks where 128 make at most two waves): a
    causal attention over few enough heads that 4 blocks of each fit the SMs at once."""
    from attention_cases import FUNCTIONS
    fn = FUNCTIONS[kind]
    (kernel,) = schedule_kernels(fn.compile(fn.arg_specs_for(dims, "bf16"), arch=arch))
    assert (kernel.param_values["block_m"], kernel.param_values["heavy_first"]) == expected


def test_a_pinned_schedule_keeps_its_query_order():
    from attention_cases import FUNCTIONS
    fn = tsr.function(FUNCTIONS["causal"].fn, space=dict(heavy_first=[0], block_m=[128]))
    (kernel,) = schedule_kernels(fn.compile(fn.arg_specs_for(dict(B=3, H=5, S=1531, D=128), "bf16"), arch="sm_90a"))
    assert (kernel.param_values["block_m"], kernel.param_values["heavy_first"]) == (128, 0)


def _decode_reference(q, k, v):
    """Causal attention with the diagonal at the bottom right (query i at position N - M + i), in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    m, n = s.shape[-2:]
    s = np.where(np.arange(m)[:, None] + (n - m) >= np.arange(n)[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("gqa", [False, True])
def test_a_causal_decode_step_takes_its_key_count_at_run_time(gqa):
    """A decode step's mask `row + (N - M) >= col` with N taken at run time: N - M is a value the
    kernel reads (`graph.dim_size`, a mask limit per program), so one compile serves every key
    count of N's class (a new cache length per step compiles nothing), split across the grid
    (flash-decoding) as N's class says; checked on the interpreter against float64."""
    from decode_attention import decode_attention, gqa_decode_attention
    fn = tsr.function((gqa_decode_attention if gqa else decode_attention).fn, dynamic=["N"])
    rng = np.random.default_rng(31)
    for m in (1, 3):
        for n in (17, 30, 1031, 1500, 2049):   # (two classes of N: <= 32, unsplit, and past 1024, split)
            shape = (1, 2, 2, m, 16) if gqa else (1, 2, m, 16)
            kv = (1, 2, 1, n, 16) if gqa else (1, 2, n, 16)
            q = rng.standard_normal(shape).astype(np.float16)
            k, v = (rng.standard_normal(kv).astype(np.float16) for _ in range(2))
            np.testing.assert_allclose(fn(q, k, v).astype(np.float64), _decode_reference(q, k, v), atol=2e-3)
    info = fn.cache_info()
    assert info.compiles == 4 and not info.fixed   # one compile per query count and class of N
    dims = dict(B=1, Hk=8, G=4, M=1, N=32768, D=128) if gqa else dict(B=1, H=32, M=1, N=32768, D=128)
    c = fn.compile(fn.arg_specs_for(dims, "bf16"), dynamic=frozenset({"N"}), arch="sm_90a")
    (kernel,) = schedule_kernels(c)
    assert kernel.param_values["split_kv"] > 1 and "graph.dim_size" in c.ir("schedule")
    short = {**dims, "M": 3, "N": 17}   # unsplit: the query block's kept columns bounded by N at run time
    assert fn.compile(fn.arg_specs_for(short, "bf16"), dynamic=frozenset({"N"}), arch="sm_90a").stage("ptx")


def test_a_decode_mask_with_an_offset_is_inside_the_attention_kernel():
    """`rows + (N - M)` (the queries' positions) is read through `rows[:, None]`, a view each kernel
    recomputes: it goes into the attention kernel, not a kernel of its own before it."""
    from decode_attention import decode_attention
    c = decode_attention.compile(decode_attention.arg_specs_for(dict(B=1, H=2, M=3, N=100, D=64), "fp16"))
    assert [k.kind.data for k in schedule_kernels(c)] == ["flash_attention"]


@tsr.function
def transposed_twice_read(x: Tensor["M", "C"], w1: Tensor["C", "F"], w2: Tensor["F", "E"]):
    r = tsr.matmul(tsr.relu(tsr.matmul(x, w1)), w2).transpose(-2, -1)
    return r, r * 2.0


def test_a_transposed_chain_output_read_by_another_kernel_is_copied(random_inputs, assert_matches_reference):
    """The chain kernel stores its output transposed only where the return alone reads the transpose."""
    compile_and_check(transposed_twice_read, dict(M=100, C=32, F=300, E=48), "fp32", random_inputs,
                      assert_matches_reference)


# --- column reductions' epilogues -----------------------------------------------------------------------------


@tsr.function
def column_sum_as_vector(x: Tensor["M", "N"]):
    """[1, N] -> [N] and a cast: the sum's kernel stores it so (`_unit_dims_apart`)."""
    return (tsr.sum(x, 0, keepdim=True).reshape(x.shape[1]) * 0.5).to(tsr.bf16)


@tsr.function
def column_sum_broadcast(x: Tensor["M", "N"], w: Tensor[1, "N"]):
    """[N] + [1, N]: the epilogue broadcasts the sum, which no output map follows: its own kernel."""
    return tsr.sum(x, 0) + w


@tsr.function
def column_sum_of_one_column(x: Tensor["B", "M", "N"]):
    """A kept last dim of 1 dropped by the reshape: the template's columns; its own kernel."""
    return tsr.sum(x, 1).reshape(x.shape[0]) * 2.0


@tsr.function
def rows_and_two_riders(x: Tensor["M", "N"], w: Tensor["N"]):
    """A row kernel carrying two column sums, one with an epilogue reading another value (a weight
    decay's 0.01 w): both ride the row walk."""
    y = x - tsr.mean(x, -1, keepdim=True)
    return y, tsr.sum(x * w, 0) + 0.01 * w, tsr.sum(x, 0)


@pytest.mark.parametrize("fn,dims,kernels", [
    (column_sum_as_vector, dict(M=4097, N=33), ["column_reduction_0_partials", "column_reduction_0"]),
    (column_sum_as_vector, dict(M=1, N=7), ["column_reduction_0"]),
    (column_sum_broadcast, dict(M=300, N=64), ["column_reduction_0", "elementwise_1"]),
    (column_sum_of_one_column, dict(B=3, M=50, N=1), ["column_reduction_0", "elementwise_1"]),
    (rows_and_two_riders, dict(M=1000, N=256), ["row_reduction_0", "row_reduction_0_combine"]),
], ids=["vector", "vector-one-row", "broadcast", "one-column", "two-riders"])
def test_a_column_reduction_takes_an_epilogue_through_size_1_dims(fn, dims, kernels, random_inputs,
                                                                   assert_matches_reference):
    c = compile_and_check(fn, dims, "fp32", random_inputs, assert_matches_reference)
    assert [k.removeprefix(f"{fn.name}_") for k in c.kernel_names] == kernels


# --- a norm backward's row walk ---------------------------------------------------------------------------------


@pytest.mark.skipif(__import__("shutil").which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
@pytest.mark.parametrize("n", [512, 1024, 2048, 4096, 6144, 8192])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_norm_backward_walks_its_rows_with_the_blocks_ptxas_leaves_room_for(norm, n):
    """The dx kernel's programs (`fusion._row_walk_blocks`, a register estimate and its staged rows'
    shared memory) are as many as the SMs hold of it by the registers ptxas gave it and the shared
    memory its launch takes, so no program waits for a second wave (rms_norm at 1024 and 2048
    columns: one block an SM fewer, which measured the same)."""
    from tessera import platforms
    compiled, _ = norm_backward_cases.compile(norm, 16384 * 8192 // n, n)
    (name,) = (k for k in compiled.kernel_names if k.endswith("row_reduction_0"))
    launch = compiled.launches[name]
    registers = compiled.stage("cubin")[name].resources[name].registers
    platform = platforms.get("sm_90a")
    blocks = platforms.occupancy(platform, launch.threads, registers, launch.dynamic_shared)[0]
    fewer = 1 if norm == "rms_norm" and n in (1024, 2048) else 0
    assert launch.grid[0] == platform.sm_count * (blocks - fewer), (registers, launch.threads)


def _fp8_gemm_params(m: int, n: int, k: int, space=None) -> dict:
    from tessera import dtypes, platforms
    from tessera.frontend.trace import ArgSpec

    from fp8_gemm_cases import scaled_mm
    specs = [ArgSpec("a", (m, k), dtypes.fp8_e4m3, ("M", "K")), ArgSpec("b", (n, k), dtypes.fp8_e4m3, ("N", "K")),
             ArgSpec("sa", (1,), dtypes.fp32, (1,)), ArgSpec("sb", (1,), dtypes.fp32, (1,))]
    module = fuse(scaled_mm.trace(specs), space, platform=platforms.get("sm_90a"))
    return next(op for op in module.walk() if op.name == "schedule.kernel").param_values


@pytest.mark.parametrize("m, n, k, tile", [
    (1008, 3008, 8192, (128, 192, 8)),   # 96 tiles of 128 x 256 for 132 SMs; 128 of 128 x 192
    (512, 6000, 8192, (128, 192, 8)),
    (4096, 4096, 4096, (128, 256, 8)),   # many waves: the default
    (2048, 4096, 4096, (128, 256, 8)),   # 128 tiles fill the wave already
    (1008, 8000, 4096, (128, 256, 8)),   # 256 tiles: past one wave either way
    (64, 24000, 4096, (128, 256, 8)),    # 64 rows: under one wgmma per warpgroup of 128 x 192
    (1008, 3008, 64, (128, 256, 8)),     # K steps of 64 bytes: no TMA, so no wgmma, which 192 needs
])
def test_an_fp8_gemm_filling_one_wave_badly_takes_192_columns(m, n, k, tile):
    """fusion.NARROW_TILE: fp8 GEMMs whose default tiles leave a fifth of the SMs idle in their one
    wave take 128 x 192 tiles where those still make one wave (H200 figures in its comment)."""
    p = _fp8_gemm_params(m, n, k)
    assert (p["block_m"], p["block_n"], p["num_warps"]) == tile and p["split_k"] == 1 and p["mma_async"] == 1


@pytest.mark.parametrize("m, k, n, block_n, cluster, split", [
    (1024, 8192, 3072, 192, None, False),   # 96 tiles -> 128: one wave either way, each a quarter narrower
    (2000, 4096, 3000, 192, 2, False),      # 192 -> 256 tiles: two waves either way; B rows split: pairs
    (1000, 8192, 3000, 192, 2, False),      # B rows split, one wave: narrow tiles only in pairs (8 tile rows)
    (850, 8192, 3000, 256, None, False),    # ... 7 tile rows do not pair: unpaired narrow tiles were slower
    (3000, 4096, 5000, 256, 2, False),      # 4 waves -> 5: 960 against 1024 columns, within WAVE_GAIN
    (4096, 4096, 4096, 256, None, False),   # 4 waves -> 6
    (500, 8192, 4096, 256, None, True),     # 64 tiles split K in 2; 192 columns would not split (one kernel)
    (3000, 4096, 384, 256, None, True),     # 48 tiles either way (the narrow ones no more): split K
])
def test_a_16_bit_gemm_takes_narrow_tiles_where_its_waves_shorten(m, k, n, block_n, cluster, split):
    """fusion.NARROW_TILE: a GEMM whose blocks' longest walk (waves of tiles times their width) is
    at least WAVE_GAIN shorter on 128 x 192 tiles takes them (H200 figures in its comment), unless
    its wide tiles split K (192 columns take no split-K) or the narrow tiles are no more."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)
    module = fuse(mm.trace(mm.arg_specs_for(dict(M=m, K=k, N=n), "bf16")), platform=platforms.get("sm_90a"))
    p = next(op for op in module.walk() if op.name == "schedule.kernel").param_values
    assert (p["block_n"], p.get("cluster"), p["split_k"] > 1) == (block_n, cluster, split)


def test_192_columns_are_refused_where_the_kernel_cannot_take_them():
    """192 is not a power of two: only an unsplit wgmma GEMM takes it (mma.sync's warp tiling
    computed wrong products), and a pinned 192 keeps a GEMM in one kernel rather than splitting
    it onto mma.sync."""
    import tessera as tsr
    from tessera import platforms

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)
    sm90 = platforms.get("sm_90a")
    p = next(op for op in fuse(mm.trace(mm.arg_specs_for(dict(M=128, K=8192, N=384), "bf16")),
                               {"block_n": [192]}, platform=sm90).walk() if op.name == "schedule.kernel").param_values
    assert p["block_n"] == 192 and p["split_k"] == 1 and p["mma_async"] == 1   # (2 tiles: it would split)
    unaligned = mm.arg_specs_for(dict(M=2000, K=8192, N=1500), "bf16")   # (3000-byte rows: no TMA, no wgmma)
    with pytest.raises(TargetLoweringError, match="192-column tiles need wgmma, .* not 16-byte aligned"):
        mm.compile(unaligned, arch="sm_90a", space={"block_n": [192]}).stage("target")
    with pytest.raises(Exception, match="192 columns: an unsplit GEMM only"):
        mm.compile(unaligned, arch="sm_90a", space={"block_n": [192], "split_k": [2]})


@pytest.mark.parametrize("m, n, k", [(200, 576, 256), (65, 200, 128), (130, 384, 128)])
def test_a_192_column_fp8_gemm_matches_float64(m, n, k):
    """The 192-column tile's tile program on the CPU interpreter, at sizes no tile divides (pinned:
    their tile counts would not choose it), its wgmma descriptors in Target IR, and its PTX
    assembles (its registers' layouts run on the GPU: tests/gpu/test_fp8_gemm_gpu.py)."""
    import ml_dtypes
    import tessera as tsr
    from tessera import dtypes
    from tessera.frontend.trace import ArgSpec

    from fp8_gemm_cases import scaled_mm
    fn = tsr.function(scaled_mm.fn, space={"block_n": [192]})
    specs = [ArgSpec("a", (m, k), dtypes.fp8_e4m3, ("M", "K")), ArgSpec("b", (n, k), dtypes.fp8_e4m3, ("N", "K")),
             ArgSpec("sa", (1,), dtypes.fp32, (1,)), ArgSpec("sb", (1,), dtypes.fp32, (1,))]
    compiled = fn.compile(specs, arch="sm_90a", sm_count=132)
    assert "[192, 128], major = k" in compiled.ir("target")
    rng = np.random.default_rng(m)
    a, b = (rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn) for shape in ((m, k), (n, k)))
    (out,) = compiled.run(a, b, np.array([0.5], np.float32), np.array([1.25], np.float32))
    ref = a.astype(np.float64) @ b.astype(np.float64).T * 0.625
    assert not np.isnan(out.astype(np.float64)).any()
    assert np.abs(out.astype(np.float64) - ref).max() <= 1e-2 * np.abs(ref).max()
    compiled.stage("cubin")



@pytest.mark.parametrize("n, blocks", [(8193, 2), (20000, 3), (32768, 4), (65536, 8)])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_norm_backward_over_long_rows_splits_them_across_a_cluster(norm, n, blocks, random_inputs,
                                                                       assert_matches_reference):
    """Rows longer than one 8192-element chunk are split across a cluster of blocks
    (`schedule.row_split`), each carrying its share's weight gradients, where the column sums
    were kernels of their own reading x and dy again; on the interpreter, every block of a cluster
    on its own thread, against the float64 reference."""
    from tessera.ir import tile
    compiled, specs = norm_backward_cases.compile(norm, 5, n, dtype=tsr.float32)
    assert [k.rsplit("_vjp_", 1)[1] for k in compiled.kernel_names] == ["row_reduction_0", "row_reduction_0_combine"]
    kernel = next(op for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp))
    assert tile.cluster_size(kernel) == blocks
    assert compiled.launches[compiled.kernel_names[0]].grid[0] == 5 * blocks   # (one cluster a row: 5 rows)
    assert_matches_reference(compiled, random_inputs(specs, 0))



def test_without_clusters_long_rows_keep_their_column_sums_apart():
    """On a platform without clusters (sm_80) a norm backward over rows of 32768 carries no column
    sums: each is a kernel of its own."""
    from tessera.ir import tile
    compiled, _ = norm_backward_cases.compile("layer_norm", 5, 32768, arch="sm_80")
    assert sum("column_reduction" in k for k in compiled.kernel_names) == 2
    assert all(tile.cluster_size(op) == 1 for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp))


@pytest.mark.parametrize("space, column_kernels", [({"cluster": [1]}, 2), ({"cluster": [2]}, 2), ({"cluster": [4]}, 0),
                                                   ({"backend": ["cuda-tile"]}, 2)])
def test_long_rows_carry_their_column_sums_only_where_the_row_kernel_can_split_them(space, column_kernels):
    """A space pinning fewer blocks of a cluster than a row of 32768 needs (shares of 8192), or
    another backend, keeps the column sums apart: merged, their accumulators a row wide spilled."""
    compiled, _ = norm_backward_cases.compile("layer_norm", 5, 32768, dtype=tsr.float32, space=space)
    assert sum("column_reduction" in k for k in compiled.kernel_names) == column_kernels
