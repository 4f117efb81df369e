"""Grouped-query attention over merged rows (tessera/passes/query_groups.py): the query heads
sharing a KV head and their few queries become one dim of rows, on the tile interpreter against
the float64 oracle, with the attentions the pass must leave as written."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.ir import tile
from tessera.runtime import ptxas

from decode_attention import gqa_decode_attention


def attention_kernel(compiled):
    f = next(iter(compiled.modules["schedule"].ops))
    (kernel,) = [op for op in f.body.block.ops if op.name == "schedule.kernel" and op.kind.data == "flash_attention"]
    return kernel


def query_rows(compiled) -> int:
    """The query rows of the attention kernel's Q operand (the dim before the head dim)."""
    shape = attention_kernel(compiled).operands[0].type.shape
    bindings = {k: v.value.data for k, v in next(iter(compiled.graph.ops)).attributes["tessera.dims"].data.items()}
    d = shape[-2]
    return bindings[d] if isinstance(d, str) else d


def check(fn, dims, dtype, random_inputs, assert_matches_reference, space=None, seed=0):
    fn = tsr.function(fn.fn, space=space) if space else fn
    specs = fn.arg_specs_for(dims, dtype)
    compiled = fn.compile(specs, arch="sm_90a")
    assert_matches_reference(compiled, random_inputs(specs, seed))
    return compiled


@pytest.mark.parametrize("g,m,n", [(4, 2, 37), (4, 16, 300), (8, 16, 129), (2, 64, 100), (6, 5, 1000), (3, 7, 64)])
def test_query_heads_and_queries_are_one_row_dim(g, m, n, random_inputs, assert_matches_reference):
    """G heads x M queries (at most 128) are the attention kernel's rows, q viewed [B, Hk, G*M, D]
    and the output viewed back; the decode mask's row position is the merged row modulo M."""
    dims = dict(B=2, Hk=3, G=g, M=m, N=n, D=64)
    compiled = check(gqa_decode_attention, dims, "fp32", random_inputs, assert_matches_reference)
    assert query_rows(compiled) == g * m
    assert [op.name for op in next(iter(compiled.modules["schedule"].ops)).body.block.ops].count("graph.reshape") == 2


def test_merged_rows_with_split_keys(random_inputs, assert_matches_reference):
    """Merged rows in a split-KV attention: each split's partial rows, combined by a second kernel."""
    compiled = check(gqa_decode_attention, dict(B=1, Hk=2, G=4, M=3, N=777, D=64), "fp32", random_inputs,
                     assert_matches_reference, space=dict(split_kv=[5], block_n=[32]))
    assert compiled.kernel_names[0].endswith("_partials")
    assert query_rows(compiled) == 12


def test_merged_rows_read_each_kv_head_once():
    """One program per KV head (and batch), where one per query head read each KV head G times."""
    dims = dict(B=2, Hk=3, G=4, M=5, N=512, D=64)
    compiled = gqa_decode_attention.compile(gqa_decode_attention.arg_specs_for(dims, "fp16"), arch="sm_90a",
                                            space=dict(split_kv=[1]))
    (kernel,) = [op for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp)]
    (q_copy,) = [op for op in kernel.walk() if isinstance(op, tile.CopyAsyncOp) and op.src.type.get_shape()[2] == 20]
    assert tuple(q_copy.tile_dims.get_values())[0] == 2
    assert "grid = array<i64: 1, 6, 1>" in compiled.ir("tile").split("func.func")[-1]


@tsr.function
def gqa_slopes(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"], v: Tensor["B", "Hk", 1, "N", "D"]):
    """A per-head linear bias (ALiBi's form, its slope from the head's index within the group) and
    the decode offset mask: one modification varies along G only, one along M."""
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    pos = tsr.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2])
    cols = tsr.arange(k.shape[-2])
    slope = (tsr.arange(q.shape[-3]).to(tsr.fp32) + 1.0) * 0.125
    distance = (pos[:, None] - cols[None, :]).to(tsr.fp32)
    s = tsr.where(pos[:, None] >= cols[None, :], s - slope[:, None, None] * distance, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def test_a_head_dependent_modification_reads_the_merged_row_divided(random_inputs, assert_matches_reference):
    compiled = check(gqa_slopes, dict(B=1, Hk=2, G=4, M=6, N=200, D=64), "fp32", random_inputs,
                     assert_matches_reference)
    assert query_rows(compiled) == 24
    ops = [op.name for op in attention_kernel(compiled).body.block.ops]
    assert "graph.floor_divide" in ops and "graph.remainder" in ops


@tsr.function
def gqa_bias(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"], v: Tensor["B", "Hk", 1, "N", "D"],
             bias: Tensor["M", "N"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + bias
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def gqa_with_logsumexp(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"],
                       v: Tensor["B", "Hk", 1, "N", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v), tsr.logsumexp(s, -1, keepdim=True)


@pytest.mark.parametrize("fn,dims,rows", [
    (gqa_bias, dict(B=1, Hk=2, G=4, M=5, N=90, D=64), 5),                # a bias read from memory varies along M
    (gqa_with_logsumexp, dict(B=1, Hk=2, G=4, M=5, N=90, D=64), 5),      # the scores have another reader
    (gqa_decode_attention, dict(B=1, Hk=2, G=4, M=64, N=90, D=64), 64),  # 256 rows: more than one block
    (gqa_decode_attention, dict(B=1, Hk=2, G=4, M=1, N=90, D=64), 1),    # one query: the heads are the rows already
    (gqa_decode_attention, dict(B=1, Hk=2, G=4, M=8, N=1, D=64), 8),     # one key: its axis would be lost in a view
])
def test_attentions_left_as_written(fn, dims, rows, random_inputs, assert_matches_reference):
    compiled = check(fn, dims, "fp32", random_inputs, assert_matches_reference)
    assert query_rows(compiled) == rows


@pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")
def test_the_merged_kernel_assembles():
    """The merged attention through ptxas on both code paths (fp16, split keys)."""
    dims = dict(B=1, Hk=8, G=4, M=16, N=8192, D=128)
    for arch in ("sm_90a", "sm_80"):
        compiled = gqa_decode_attention.compile(gqa_decode_attention.arg_specs_for(dims, "fp16"), arch=arch)
        assert query_rows(compiled) == 64
        assert set(compiled.stage("cubin")) == set(compiled.kernel_names)


def test_a_strided_q_is_read_in_place_unmerged(random_inputs, assert_matches_reference):
    """q passed as a view whose G and M dims do not collapse (a [B, M, Hk, G, D] buffer): merging
    would copy it before every call, where the unmerged kernel reads it in place."""
    fn = gqa_decode_attention
    q = np.random.default_rng(0).standard_normal((2, 5, 2, 4, 64)).astype(np.float32).transpose(0, 2, 3, 1, 4)
    k, v = random_inputs(fn.arg_specs_for(dict(B=2, Hk=2, G=4, M=5, N=77, D=64), "fp32")[1:], 1)
    tensors, constants = fn._split_args([q, k, v])
    _, specs = fn.arg_specs(tensors)
    compiled = fn.compile(specs, constants, arch="sm_90a")
    assert compiled.copied_args == {} and query_rows(compiled) == 5
    assert_matches_reference(compiled, [q, k, v])


@tsr.function
def gqa_key_bias(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"],
                 v: Tensor["B", "Hk", 1, "N", "D"], kb: Tensor[1, 1, "N"]):
    """A key bias read from memory that varies along neither G nor M (a padding bias)."""
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1])) + kb
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def gqa_scaled_output(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"],
                      v: Tensor["B", "Hk", 1, "N", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v) * 2.0 + 1.0


def test_a_bias_constant_along_heads_and_queries_is_merged(random_inputs, assert_matches_reference):
    compiled = check(gqa_key_bias, dict(B=2, Hk=2, G=4, M=3, N=70, D=32), "fp32", random_inputs,
                     assert_matches_reference)
    assert query_rows(compiled) == 12


def test_an_epilogue_keeps_the_attention_unmerged_and_one_kernel(random_inputs, assert_matches_reference):
    """Merged, the output is a view between kernels and its epilogue a kernel of its own."""
    compiled = check(gqa_scaled_output, dict(B=1, Hk=2, G=4, M=3, N=70, D=32), "fp32", random_inputs,
                     assert_matches_reference, space=dict(split_kv=[1]))
    assert query_rows(compiled) == 3 and len(compiled.kernel_names) == 1
