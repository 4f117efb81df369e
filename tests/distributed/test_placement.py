"""Where sharded math needs communication (tessera/distributed/placement.py), decided on the CPU
from Graph IR alone: the results and gradients that are partial sums over mesh axes, and the
math that cannot run on shards, refused with the op, its line and the way out."""
import pytest

import tessera as tsr
from tessera import Tensor, dtypes
from tessera.distributed import placement
from tessera.distributed.placement import ShardingError
from tessera.distributed.sharded import gradient_placements

from sharded_cases import attention, mlp


@tsr.function
def mlp_then_gelu(x: Tensor["N", "C"], w1: Tensor["C", "F"], b1: Tensor["F"], w2: Tensor["F", "C"]):
    return tsr.gelu(mlp.fn(x, w1, b1, w2))


@tsr.function
def row_parallel_with_bias(h: Tensor["N", "F"], w2: Tensor["F", "C"], b2: Tensor["C"]):
    return tsr.matmul(h, w2) + b2


@tsr.function
def norm(x: Tensor["N", "C"], w: Tensor["C"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)


@tsr.function
def causal_rows(x: Tensor["S", "D"]):
    return tsr.where(tsr.arange(x.shape[0])[:, None] > 2, x, 0.0)


MLP = {"N": 12, "C": 16, "F": 32}
ATTENTION = {"B": 2, "H": 4, "S": 24, "D": 16}


def specs(fn, dims):
    return fn.arg_specs_for(dims, dtypes.fp16)


def results(fn, dims, shard):
    return placement.propagate(fn.trace(specs(fn, dims)), shard)


def grads(fn, dims, shard):
    return {n: set(p.partial) for n, p in gradient_placements(fn, specs(fn, dims), {}, shard).items()}


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
    (mlp_then_gelu, MLP, {"F": "tp"}, r"erf at .*test_placement.py:\d+: erf reads a partial sum over mesh axis tp "
                                      r"\(made by the matmul contracting the sharded dim F at .*sharded_cases.py:\d+\)"
                                      r": only linear math may follow one; end the function before this op"),
    (row_parallel_with_bias, MLP, {"F": "tp"}, r"add at .*: add reads a partial sum over mesh axis tp"),
    (norm, MLP, {"C": "tp"}, r"rms_norm normalizes over the sharded dim C"),
    (attention, ATTENTION, {"S": "sp"}, r"sharded dim S twice \(\['B', 'H', 'S', 'S'\]\)"),
    (causal_rows, {"S": 8, "D": 4}, {"S": "sp"}, r"arange over the sharded dim S would count from 0 on every rank"),
])
def test_math_that_cannot_run_on_shards_is_refused_with_the_op_and_the_way_out(fn, dims, shard, message):
    with pytest.raises(ShardingError, match=message):
        results(fn, dims, shard)


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
