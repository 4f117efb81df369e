"""The TMA protocol in Target IR (lowering/async_pipelines.py): mbarriers, phases, drains and warp roles as ops."""
from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import i32

import tessera as tsr
from tessera import Tensor
from tessera.ir import target as tgt
from tessera.ir import tile
from tessera.lowering.assign_layouts import is_tile
from seed_kernels import causal_attention


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def kernel_of(fn, dims, dtype="fp16", **space):
    if space:
        fn = tsr.function(fn.fn, space={k: [v] for k, v in space.items()})
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch="sm_90a")
    (kernel,) = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)]
    return kernel


def ops(root, kind):
    return [op for op in root.walk() if isinstance(op, kind)]


def test_each_pipeline_gets_mbarriers_a_tensor_map_per_box_and_one_arm_per_group():
    kernel = kernel_of(gemm, dict(M=512, K=1024, N=512), persistent=0, block_m=128, block_n=256)
    (full,) = ops(kernel, tgt.MBarrierAllocOp)
    (init,) = ops(kernel, tgt.MBarrierInitOp)
    assert init.arrivals.value.data == 1 and full.result.type.count.data == 4     # a stage each
    maps = ops(kernel, tgt.TensorMapOp)
    assert [m.result.type.box_dims for m in maps] == [(128, 64), (64, 64)]      # 128-byte-wide boxes
    for arm in ops(kernel, tgt.MBarrierArriveExpectTxOp):
        loads = []
        op = arm.next_op
        while isinstance(op, tgt.TmaLoadOp):
            loads.append(op)
            op = op.next_op
        assert arm.bytes.value.data == sum(load.tensor_map.type.box_bytes for load in loads) == 128 * 64 * 2 + 64 * 256 * 2
        assert {load.stage for load in loads} == {arm.stage}


def test_phases_are_values_carried_through_the_loop():
    """The wait's parity is bit `stage` of a `phase` i32 the loop carries and flips per wait; the
    copies still in flight when the loop ends are waited for after it, one stage at a time."""
    kernel = kernel_of(gemm, dict(M=512, K=1024, N=512), persistent=0)
    loop = next(op for op in kernel.body.block.ops if isinstance(op, scf.ForOp))
    assert [a.type for a in loop.body.block.args[2:]] == [i32, i32]    # armed and phase bits
    (wait,) = [op for op in loop.body.block.ops if isinstance(op, tgt.MBarrierTryWaitOp)]
    parity = wait.parity.owner
    assert isinstance(parity, arith.AndIOp) and isinstance(parity.lhs.owner, arith.ShRUIOp)
    assert parity.lhs.owner.lhs in loop.body.block.args
    top = list(kernel.body.block.ops)
    drains = [i for i, op in enumerate(top) if isinstance(op, scf.IfOp) and ops(op, tgt.MBarrierTryWaitOp)]
    assert len(drains) == 4 and min(drains) > top.index(loop)


def test_a_barrier_that_only_publishes_copies_goes():
    kernel = kernel_of(causal_attention, dict(B=1, H=2, S=512, D=64))
    loop = next(op for op in kernel.walk() if isinstance(op, scf.ForOp) and ops(op, tgt.TmaLoadOp))
    body = [op.name.split(".")[-1] for op in loop.body.block.ops if op.dialect_name() == "tessera_target"]
    assert body.count("barrier") == 1            # the one that frees a stage for its refill
    assert body.index("mbarrier_try_wait") < body.index("tensor_core")


def test_a_cluster_copies_b_once_and_refills_a_stage_its_blocks_released():
    """Blocks in clusters of two sharing B's tiles (`cluster`): each block's B copy is half the
    tile's rows into both blocks (`tma_load multicast = 2`), the arm counts both halves, a stage's
    free mbarrier takes one arrival a block (`mbarrier_arrive per = "cluster"`, from each
    `tile.release_stage`), a copy group first waits for it, and the blocks meet after the init and
    before they exit; the checker finds no hazard."""
    from tessera.passes.check_async import check_async
    fn = tsr.function(gemm.fn, space={"cluster": [2], "programs": [4], "persistent": [1],
                                      "block_m": [128], "block_n": [256]})
    compiled = fn.compile(fn.arg_specs_for(dict(M=1024, K=1024, N=1000), "bf16"), arch="sm_90a")
    (kernel,) = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)]
    assert kernel.cluster.value.data == 2
    full, free = ops(kernel, tgt.MBarrierAllocOp)
    assert [init.arrivals.value.data for init in ops(kernel, tgt.MBarrierInitOp)] == [1, 2]
    loads = ops(kernel, tgt.TmaLoadOp)
    assert {(load.tensor_map.type.box_dims, load.copies) for load in loads} == {((128, 64), 1), ((32, 64), 2)}
    for arm in ops(kernel, tgt.MBarrierArriveExpectTxOp):
        assert arm.bytes.value.data == 128 * 64 * 2 + 64 * 256 * 2         # A, and both halves of B
    arrivals = ops(kernel, tgt.MBarrierArriveOp)
    assert {a.per.data for a in arrivals} == {"cluster"} and {a.barriers for a in arrivals} == {free.result}
    assert len(arrivals) == 4 and not ops(kernel, tile.ReleaseStageOp)  # 3 in the prologue, 1 a step
    claims = [w for w in ops(kernel, tgt.MBarrierTryWaitOp) if w.barriers == free.result]
    assert len(claims) == len(ops(kernel, tgt.MBarrierArriveExpectTxOp))   # a wait before each group
    top = [op for op in kernel.body.block.ops if isinstance(op, tgt.ClusterBarrierOp)]
    assert [b.phase.data for b in top] == ["arrive", "wait", "arrive", "wait"]
    assert check_async(compiled.stage("target")) == []


def test_warp_specialization_is_two_regions_with_the_register_split():
    kernel = kernel_of(gemm, dict(M=512, K=1024, N=512), warp_specialize=1, block_m=128, block_n=256)
    (ws,) = ops(kernel, tgt.WarpSpecializeOp)
    producer, consumer = ws.producer.block, ws.consumer.block
    assert ws.producer_warps.value.data == 4 and kernel.maxnreg.value.data == 168
    assert [(op.action.data, op.regs.value.data) for op in ops(ws, tgt.SetMaxNRegOp)] == [("dec", 40), ("inc", 232)]
    assert isinstance(producer.first_op, tgt.SetMaxNRegOp) and isinstance(consumer.first_op, tgt.SetMaxNRegOp)
    in_producer = {op.name for op in _walk(producer)}
    in_consumer = {op.name for op in _walk(consumer)}
    assert "tessera_target.tma_load" in in_producer and "tessera_target.tma_load" not in in_consumer
    assert "tessera_target.tensor_core" in in_consumer and "tessera_target.tensor_core" not in in_producer
    assert not any(is_tile(v) for op in _walk(producer) for v in (*op.operands, *op.results))   # no tiles
    (full, free) = ops(kernel, tgt.MBarrierAllocOp)
    arrivals = {op.barriers: op.arrivals.value.data for op in ops(kernel, tgt.MBarrierInitOp)}
    assert arrivals == {full.result: 1, free.result: 8}                # one arrive per computing warp
    (arrive,) = [op for op in _walk(consumer) if isinstance(op, tgt.MBarrierArriveOp)]
    assert arrive.barriers is free.result and arrive.per.data == "warp"
    assert any(isinstance(op, tgt.MBarrierTryWaitOp) and op.barriers is free.result for op in _walk(producer))
    assert not any(isinstance(op, tgt.BarrierOp) for op in _walk(consumer) if op.parent_op() is ws)


def _walk(block):
    for op in block.ops:
        yield from op.walk()


def test_shared_memory_is_placed_by_the_allocation_pass():
    """Buffers in order at their alignment, then the mbarriers, then the output's staging buffers;
    the kernel config holds the total."""
    kernel = kernel_of(causal_attention, dict(B=1, H=2, S=512, D=64), block_m=128)   # (two heads derive 64 rows)
    buffers = ops(kernel, tgt.AllocateOp)
    end = 0
    for b in buffers:
        assert b.offset.value.data == -(-end // b.align.value.data) * b.align.value.data
        end = b.offset.value.data + b.size.value.data
    for bars in ops(kernel, tgt.MBarrierAllocOp):
        assert bars.offset.value.data >= end
        end = bars.offset.value.data + 8 * bars.result.type.count.data
    (store,) = [op for op in kernel.walk() if tgt.SCRATCH in op.attributes]
    scratch = store.attributes[tgt.SCRATCH]
    assert isinstance(store, tile.StoreOp) and tgt.STAGING in store.attributes
    assert scratch.offset.data == -(-end // 16) * 16
    assert kernel.config.shared.data == scratch.offset.data + scratch.size.data
    assert {b.swizzle.data for b in buffers} == {"tma_128b"}     # the layout wgmma's descriptors read
    assert not ops(kernel, tile.CopyAsyncOp) and not ops(kernel, tgt.MemcpyOp)
