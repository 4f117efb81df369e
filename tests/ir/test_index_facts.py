"""What index analysis proves about a kernel's index values, read off the Target IR of real kernels
and off hand-built arithmetic."""
from xdsl.dialects import arith
from xdsl.dialects.builtin import IndexType, IntegerAttr

import tessera as tsr
from tessera import Tensor
from tessera.ir import index_facts
from tessera.ir import target as tgt
from tessera.ir import tile as t


def const(v: int) -> arith.ConstantOp:
    return arith.ConstantOp(IntegerAttr(v, IndexType()))


def test_multiples_through_arithmetic():
    pid = t.ProgramIdOp(0)
    c64, c48, c0 = const(64), const(48), const(0)
    row = arith.MuliOp(pid.result, c64.result)
    shifted = arith.AddiOp(row.result, c48.result)
    assert index_facts.known_multiple(row.result) == 64
    assert index_facts.known_multiple(shifted.result) == 16          # gcd(64, 48)
    assert index_facts.known_multiple(pid.result) == 1
    assert index_facts.known_multiple(c0.result) == 0                 # a multiple of everything
    assert index_facts.known_multiple(arith.AddiOp(c0.result, c48.result).result) == 48
    big = arith.MuliOp(const(3).result, const(357913942).result)      # past 2^30: still exact
    assert index_facts.known_multiple(big.result) == 1073741826


def test_signs_through_arithmetic():
    pid = t.ProgramIdOp(0)
    c3, minus = const(3), const(-1)
    assert index_facts.is_non_negative(arith.RemSIOp(pid.result, c3.result).result)
    assert not index_facts.is_non_negative(arith.AddiOp(pid.result, minus.result).result)
    assert not index_facts.is_non_negative(arith.SubiOp(pid.result, c3.result).result)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def test_gemm_tile_origins_are_multiples_of_the_tile():
    """Each copy's origin along a tile dim is a multiple of the tile's extent there, the loop's
    included (k * block_k); the stage index (k + 2) % stages is never negative."""
    compiled = gemm.compile(gemm.arg_specs_for(dict(M=512, K=256, N=512), "fp16"), arch="sm_90", path="ampere")
    copies = [op for op in compiled.modules["target"].walk() if isinstance(op, tgt.MemcpyOp)]
    assert copies
    for copy in copies:
        _, rows, cols = copy.dst.type.get_shape()
        dims = t.int_values(copy.tile_dims)
        assert index_facts.known_multiple(copy.src_indices[dims[0]]) % rows == 0
        assert index_facts.known_multiple(copy.src_indices[dims[1]]) % cols == 0
        assert all(index_facts.is_non_negative(v) for v in copy.dst_indices)


def test_persistent_gemm_step_counters_are_never_negative():
    """A persistent GEMM carries each tile's first pipeline step (0, + steps per tile) through its
    tile loop; the step, and so the stage and the copy's tile and k, divide unsigned by constants."""
    fn = tsr.function(gemm.fn, space=dict(persistent=[1], programs=[4]))
    compiled = fn.compile(fn.arg_specs_for(dict(M=1024, K=512, N=1024), "fp16"), arch="sm_90a")
    divisions = [op for op in compiled.modules["target"].walk() if isinstance(op, (arith.DivSIOp, arith.RemSIOp))]
    assert divisions
    for op in divisions:
        assert index_facts.is_non_negative(op.lhs) and index_facts.constant_value(op.rhs), op


def _loop_carrying(update):
    """An scf.for carrying one index from 0, each iteration yielding `update(carried)`'s result."""
    from xdsl.dialects import scf
    from xdsl.dialects.builtin import IndexType
    from xdsl.ir import Block, Region

    lb, ub, step, init = const(0), const(8), const(1), const(0)
    body = Block(arg_types=[IndexType(), IndexType()])
    ops = update(body.args[1])
    body.add_ops([*ops, scf.YieldOp(ops[-1].results[0])])
    return scf.ForOp(lb.result, ub.result, step.result, [init.result], Region(body)), body.args[1]


def test_counters_that_add_themselves_are_non_negative_by_induction():
    """carried + carried and carried + 3 never go negative from 0; carried + (-1) may. The
    carried value is assumed while its own update is checked, so the check ends."""
    _, doubling = _loop_carrying(lambda c: [arith.AddiOp(c, c)])
    assert index_facts.is_non_negative(doubling)
    three = const(3)
    _, counting = _loop_carrying(lambda c: [arith.AddiOp(c, three.result)])
    assert index_facts.is_non_negative(counting)
    minus = const(-1)
    _, falling = _loop_carrying(lambda c: [arith.AddiOp(c, minus.result)])
    assert not index_facts.is_non_negative(falling)
