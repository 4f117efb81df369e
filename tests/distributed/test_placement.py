"""Where sharded math needs communication (tessera/distributed/placement.py), decided on the CPU
from Graph IR alone: the results that are partial sums over mesh axes, the collectives placed
inside a function where its math reads one (all-reduces, or reduce-scatters and all-gathers with
sequence parallelism), the values whose gradients are all-reduced, the segments the function is
split into, and the math that cannot run on shards, refused with the op, its line and the way out."""

import pytest

import tessera as tsr
from tessera import Tensor, dtypes
from tessera.distributed import placement
from tessera.distributed.placement import ShardingError
from tessera.frontend.trace import ArgSpec

from llama_block import llama_block
from sharded_cases import BLOCK, attention, mlp, mlp_then_gelu


@tsr.function
def row_parallel_with_bias(h: Tensor["N", "F"], w2: Tensor["F", "C"], b2: Tensor["C"]):
    return tsr.matmul(h, w2) + b2


@tsr.function
def norm(x: Tensor["N", "C"], w: Tensor["C"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)


@tsr.function
def causal_rows(x: Tensor["S", "D"]):
    return tsr.where(tsr.arange(x.shape[0])[:, None] > 2, x, 0.0)


@tsr.function
def heads_last(x: Tensor["N", "Q"]):
    """Q split into (head_dim, heads): a rank's heads are not a block of the merged dim."""
    return x.reshape(x.shape[0], 4, x.shape[1] // 4).transpose(1, 2).reshape(x.shape[0], x.shape[1])


MLP = {"N": 12, "C": 16, "F": 32}
ATTENTION = {"B": 2, "H": 4, "S": 24, "D": 16}


def specs(fn, dims, dtype=dtypes.fp16):
    return [ArgSpec(n, tuple(dims[d] for d in spec.dims), dtype, spec.dims) for n, spec in fn.annotations.items()]


def trace(fn, dims, constants=None):
    return fn.trace(specs(fn, dims), constants or {})


def results(fn, dims, shard):
    return placement.propagate(trace(fn, dims), shard)


def analysis(fn, dims, shard, sequence=None, gradients=False, constants=None):
    return placement.analyze(trace(fn, dims, constants), shard, sequence, gradients)


def grads(fn, dims, shard):
    """Per float argument, the mesh axes its gradient is all-reduced over."""
    a = analysis(fn, dims, shard, gradients=True)
    names = [n.data for n in a.f.attributes["tessera.arg_names"].data]
    out = {n: set() for n in names}
    for c in a.cuts():
        if c.collective.kind == "enter" and c.source in a.f.body.block.args:
            out[names[c.source.index]] |= set(c.collective.axes)
    return out


def kinds(a):
    return [c.collective.kind for c in a.cuts()]


def test_column_then_row_parallel_mlp_all_reduces_its_output_and_its_inputs_gradient():
    (y,) = results(mlp, MLP, {"F": "tp"})
    assert y.partial == {"tp"} and y.sharded == ()
    assert grads(mlp, MLP, {"F": "tp"}) == {"x": {"tp"}, "w1": set(), "b1": set(), "w2": set()}


def test_attention_with_heads_sharded_needs_no_communication():
    (o,) = results(attention, ATTENTION, {"H": "tp"})
    assert o.partial == frozenset() and o.sharded == ((1, "tp"),)
    assert grads(attention, ATTENTION, {"H": "tp"}) == {"q": set(), "k": set(), "v": set()}


def test_data_parallel_gradients_of_replicated_weights_are_all_reduced():
    (y,) = results(mlp, MLP, {"N": "dp"})
    assert y.partial == frozenset() and y.sharded == ((0, "dp"),)
    assert grads(mlp, MLP, {"N": "dp"}) == {"x": set(), "w1": {"dp"}, "b1": {"dp"}, "w2": {"dp"}}


def test_a_2d_mesh_combines_data_and_tensor_parallelism():
    shard = {"N": "dp", "F": "tp"}
    (y,) = results(mlp, MLP, shard)
    assert y.partial == {"tp"} and y.sharded == ((0, "dp"),)
    assert grads(mlp, MLP, shard) == {"x": {"tp"}, "w1": {"dp"}, "b1": {"dp"}, "w2": {"dp"}}


@pytest.mark.parametrize("fn,dims,shard,message", [
    (norm, MLP, {"C": "tp"}, r"rms_norm normalizes over the sharded dim C"),
    (attention, ATTENTION, {"S": "sp"}, r"sharded dim S twice \(\['B', 'H', 'S', 'S'\]\)"),
    (causal_rows, {"S": 8, "D": 4}, {"S": "sp"}, r"arange over the sharded dim S would count from 0 on every rank"),
    (heads_last, {"N": 3, "Q": 16}, {"Q": "tp"}, r"reshape at .*test_placement.py:\d+: a reshape of \[.*\] merges the "
                                                 r"sharded dim"),
])
def test_math_that_cannot_run_on_shards_is_refused_with_the_op_and_the_way_out(fn, dims, shard, message):
    with pytest.raises(ShardingError, match=message):
        results(fn, dims, shard)


@pytest.mark.parametrize("fn", [mlp_then_gelu, row_parallel_with_bias])
def test_a_partial_sum_read_by_nonlinear_math_is_all_reduced_where_it_is_read(fn):
    """gelu of a row-parallel output, a replicated bias added to one: one all-reduce before the
    op, the function split there, and its result whole."""
    a = analysis(fn, MLP, {"F": "tp"})
    (cut,) = a.cuts()
    assert cut.collective == placement.Collective("all_reduce", ("tp",))
    readers = {op.name for (op, _), k in a.uses.items() if k is cut}   # gelu reads it twice: one all-reduce
    assert readers == ({"graph.mul"} if fn is mlp_then_gelu else {"graph.add"})
    assert len(placement.segments(a)) == 2
    assert a.states[a.results[0]].placement() == placement.Placement((), frozenset())


def test_sums_and_scalings_of_partial_sums_stay_partial():
    @tsr.function
    def two_row_parallel(h: Tensor["N", "F"], w: Tensor["F", "C"], u: Tensor["F", "C"], s: Tensor["C"]):
        return (-(tsr.matmul(h, w) - tsr.matmul(h, u)) * s / 3.0).to(tsr.fp32).sum(0)
    (y,) = results(two_row_parallel, MLP, {"F": "tp"})
    assert y.partial == {"tp"}


def test_the_dims_a_function_is_independent_along_are_the_ones_no_op_reads_across():
    """What an overlapped sharded call may split into chunks: the MLP's tokens, attention's batch
    and heads (not its sequence: the keys are contracted, the mask indexes it)."""
    assert placement.independent_dims(mlp.trace(specs(mlp, MLP))) == {"N"}
    assert placement.independent_dims(attention.trace(specs(attention, ATTENTION))) == {"B", "H"}


BLOCK_CONSTANTS = {"head_dim": 8, "eps": 1e-5}


def block(sequence=None, gradients=False):
    return analysis(llama_block, BLOCK, {"Q": "tp", "F": "tp"}, sequence, gradients, BLOCK_CONSTANTS)


def test_a_tensor_parallel_block_all_reduces_its_two_output_projections():
    """Megatron-LM's layout, derived: attention (heads split) and the MLP (hidden dim split) each
    end in an all-reduce; in training the normed values entering the column-parallel matmuls
    get their gradients all-reduced (Megatron's f), the arguments none."""
    a = block()
    assert kinds(a) == ["all_reduce", "all_reduce"]
    assert [len(s.ops) for s in placement.segments(a)][-1] == 1   # the last residual add
    t = block(gradients=True)
    assert kinds(t) == ["enter", "all_reduce", "enter", "all_reduce"]
    entering = [c.source.owner.name for c in t.cuts() if c.collective.kind == "enter"]
    assert entering == ["graph.rms_norm", "graph.rms_norm"]
    assert not any(c.source in t.f.body.block.args for c in t.cuts())


def test_sequence_parallelism_reduce_scatters_and_all_gathers_along_the_sequence():
    """With sequence="S": the norms and residual adds on 1/tp of the rows, an all-gather before
    each tensor-parallel region (its gradient a reduce-scatter: every use of the gathered value
    enters sharded math), a reduce-scatter after; the norms' weights' gradients all-reduced."""
    a = block(("S", "tp"))
    assert [(c.collective.kind, c.collective.dim) for c in a.cuts()] == [
        ("all_gather", 1), ("reduce_scatter", 1), ("all_gather", 1), ("reduce_scatter", 1)]
    assert [s.sequence_sharded for s in placement.segments(a)] == [True, False, True, False, True]
    assert a.states[a.results[0]].placement() == placement.Placement(((1, "tp"),), frozenset())
    t = block(("S", "tp"), gradients=True)
    assert [c.grad for c in t.cuts() if c.collective.kind == "all_gather"] == ["reduce_scatter"] * 2
    names = [n.data for n in t.f.attributes["tessera.arg_names"].data]
    assert sorted(names[c.source.index] for c in t.cuts() if c.collective.kind == "enter") == \
        ["attn_norm", "mlp_norm"]


def test_a_sequence_parallel_value_meeting_a_replicated_one_takes_its_own_rows():
    @tsr.function
    def add_table(x: Tensor["S", "C"], table: Tensor["S", "C"]):
        return x + table
    a = analysis(add_table, {"S": 8, "C": 4}, {}, ("S", "tp"))
    assert kinds(a) == []   # both arguments come sequence-sharded
    @tsr.function
    def add_positions(x: Tensor["S", "C"]):
        return x + tsr.arange(x.shape[0])[:, None]
    a = analysis(add_positions, {"S": 8, "C": 4}, {}, ("S", "tp"))
    assert [(c.collective.kind, c.collective.dim) for c in a.cuts()] == [("split", 0)]


def test_heads_split_out_of_a_sharded_width_stay_sharded_with_one_head_per_rank():
    """[N, Q] -> [N, heads, head_dim] with one local head: the heads dim (local size 1) carries the
    shard, so a sum over heads is a partial sum and a matmul over head_dim is not."""
    @tsr.function
    def per_head(x: Tensor["N", "Q"]):
        h = x.reshape(x.shape[0], x.shape[1] // 8, 8).transpose(0, 1)   # [heads, N, head_dim]
        return h.sum(0), tsr.matmul(h, h.transpose(-2, -1))
    summed, gram = results(per_head, {"N": 3, "Q": 8}, {"Q": "tp"})
    assert summed.partial == {"tp"} and gram.partial == frozenset() and gram.sharded == ((0, "tp"),)


class _PlanningMesh:
    """What `shard` reads of a mesh to plan a call (no process group: nothing is run)."""

    names = ("tp",)

    def size(self, axis):
        return 2

    def rank(self, axis):
        return 0


def test_an_overlapped_block_runs_only_its_row_parallel_matmuls_in_chunks_along_the_batch(monkeypatch):
    """chunks=2: each output projection becomes a segment of its own, run in 2 chunks of the
    outermost independent dim (the batch: contiguous blocks), not of C (the widest, but a chunk of
    columns would copy every operand)."""
    torch = pytest.importorskip("torch")
    from tessera.distributed import sharded as sharded_module
    from tessera.distributed import shard

    monkeypatch.setattr(sharded_module, "MIN_CHUNK_ROWS", 4)
    f = shard(llama_block, _PlanningMesh(), {"Q": "tp", "F": "tp"}, chunks=2)
    args = f.local(*[torch.randn(tuple(BLOCK[d] for d in spec.dims)) for spec in llama_block.annotations.values()])
    report = f.report(*args, 8, 1e-5)
    chunked = [line for line in report.splitlines() if "chunks" in line]
    assert len(chunked) == 2 and all(": matmul (from" in line and "in 2 chunks along B" in line for line in chunked), \
        report


@pytest.mark.parametrize("dims,sequence,message", [
    ({"Q": "tp", "F": "tp"}, "T", r"the sequence dim 'T' must be a dim of its arguments"),
    ({"Q": "tp", "S": "tp"}, "S", r"that `dims` does not shard already"),
    ({"Q": "tp", "B": "dp"}, "S", r"sequence='S' needs its mesh axis when the sharded dims use 2 axes"),
])
def test_shard_refuses_a_sequence_dim_it_cannot_use(dims, sequence, message):
    from tessera.errors import TesseraError
    from tessera.distributed import shard

    class Mesh2D(_PlanningMesh):
        names = ("dp", "tp")
    with pytest.raises(TesseraError, match=message):
        shard(llama_block, Mesh2D(), dims, sequence=sequence)


def test_local_names_the_sequence_dim_that_does_not_divide():
    torch = pytest.importorskip("torch")
    from tessera.errors import ShapeError
    from tessera.distributed import shard

    f = shard(llama_block, _PlanningMesh(), {"Q": "tp", "F": "tp"}, sequence="S")
    whole = [torch.randn(tuple({**BLOCK, "S": 13}[d] for d in spec.dims)) for spec in llama_block.annotations.values()]
    with pytest.raises(ShapeError, match=r"dim S=13 of argument 'x' does not divide over mesh axis 'tp' of 2 ranks"):
        f.local(*whole)


@tsr.function
def norm_statistics(x: Tensor["N", "C"]):
    """What a norm's forward saves (its backward reads them): rows, with the normalized dim kept as 1."""
    from tessera.frontend import ops
    return ops.norm_statistic(x, "mean", 1e-5, True), ops.norm_statistic(x, "rstd", 1e-5, True)


def test_norm_statistics_keep_their_rows_sharding_and_refuse_a_sharded_normalized_dim():
    mean, rstd = results(norm_statistics, {"N": 8, "C": 16}, {"N": "dp"})
    assert mean.sharded == rstd.sharded == ((0, "dp"),) and not mean.partial
    with pytest.raises(ShardingError, match=r"norm_statistic normalizes over the sharded dim C"):
        results(norm_statistics, {"N": 8, "C": 16}, {"C": "tp"})
    assert placement.independent_dims(trace(norm_statistics, {"N": 8, "C": 16})) == {"N"}


@tsr.function
def truncated_partial_sum(h: Tensor["N", "F"], w: Tensor["F", "C"]):
    return tsr.matmul(h, w).to(tsr.int32)


def test_a_partial_sum_is_all_reduced_before_a_cast_to_an_integer():
    """Truncating each rank's share is not truncating the sum: the all-reduce comes first."""
    a = analysis(truncated_partial_sum, {"N": 8, "F": 16, "C": 4}, {"F": "tp"})
    (cut,) = a.cuts()
    assert cut.collective.kind == "all_reduce"
    assert [use[0].name for use, k in a.uses.items() if k is cut] == ["graph.cast"]   # (op, operand) read after it
