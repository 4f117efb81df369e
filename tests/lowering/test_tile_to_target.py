"""Tile IR -> Target IR: the registry's choices show up in the lowered GEMM."""
import pytest
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import DenseIntOrFPElementsAttr, IndexType, MemRefType, ModuleOp, TensorType, bf16, f16, f32
from xdsl.ir import Block, Region

import tessera as tsr
from tessera import Tensor, platforms
from tessera.ir import target, tile
from tessera.lowering.tile_to_target import TargetLoweringError, lower_tile_to_target, native_blockers


def index(value: int) -> arith.ConstantOp:
    return arith.ConstantOp.from_int_and_width(value, IndexType())


def tile_gemm(element=f16, m=64, n=64, k=32, stages=2, num_warps=4, size=256, padding=0.0) -> ModuleOp:
    """C[size x size] = A @ B, one (m x n) tile of C per program, K stepped by k
    through `stages`-deep shared buffers, launched from @main."""
    a_t, b_t, c_t = MemRefType(element, [size, size]), MemRefType(element, [size, size]), MemRefType(f32, [size, size])
    kernel = tile.KernelOp.build_kernel("gemm", [a_t, b_t, c_t], num_warps, stages)
    a, b, c = kernel.body.block.args
    pm, pn, c0, cm, cn, ck, csize = (tile.ProgramIdOp(0), tile.ProgramIdOp(1), index(0), index(m), index(n),
                                     index(k), index(size))
    m0, n0 = arith.MuliOp(pm, cm), arith.MuliOp(pn, cn)
    a_s, b_s = tile.AllocSharedOp([stages, m, k], element), tile.AllocSharedOp([stages, k, n], element)
    acc_t = TensorType(f32, [m, n])
    zero = arith.ConstantOp(DenseIntOrFPElementsAttr.from_list(acc_t, [0.0]))

    loop = Block(arg_types=[IndexType(), acc_t])
    kk, acc = loop.args
    x, y = tile.LoadSharedOp(a_s, c0), tile.LoadSharedOp(b_s, c0)
    mma = tile.MmaOp(x, y, acc)
    loop.add_ops([
        tile.CopyAsyncOp(a, a_s, c0, [m0, kk], [0, 1], padding), tile.CopyAsyncOp(b, b_s, c0, [kk, n0], [0, 1]),
        tile.AsyncCommitOp(), tile.AsyncWaitOp(0), tile.BarrierOp(), x, y, mma, scf.YieldOp(mma),
    ])
    for_op = scf.ForOp(c0, csize, ck, [zero], Region(loop))
    kernel.body.block.add_ops([pm, pn, c0, cm, cn, ck, csize, m0, n0, a_s, b_s, zero, for_op,
                               tile.StoreOp(for_op.results[0], c, [m0, n0], [0, 1]), tile.ReturnOp()])

    host = func.FuncOp("main", ([a_t, b_t, c_t], []))
    host.body.block.add_ops([tile.LaunchOp("gemm", [size // m, size // n, 1], host.body.block.args), func.ReturnOp()])
    module = ModuleOp([kernel, host])
    module.verify()
    return module


def ops(module, cls):
    return [op for op in module.walk() if isinstance(op, cls)]


def lowered(arch, **gemm):
    out = lower_tile_to_target(tile_gemm(**gemm), platforms.get(arch))
    out.verify()
    return out


def test_sm80_uses_mma_sync_and_cp_async():
    out = lowered("sm_80")
    (mma,) = ops(out, target.TensorCoreOp)
    assert (mma.family.data, tuple(mma.shape.iter_values()), mma.precision.data) == ("mma.sync", (16, 8, 16), "f16")
    assert {op.mechanism.data for op in ops(out, target.MemcpyOp)} == {"cp.async"}
    assert len(ops(out, target.CpAsyncCommitOp)) == 1 and len(ops(out, target.CpAsyncWaitOp)) == 1
    assert {op.swizzle.data for op in ops(out, target.AllocateOp)} == {"xor_16b"}
    assert not ops(out, target.TmaLoadOp) and not ops(out, target.MBarrierAllocOp)


def test_sm90a_uses_wgmma_and_tma():
    out = lowered("sm_90a", k=64)
    (mma,) = ops(out, target.TensorCoreOp)
    assert (mma.family.data, tuple(mma.shape.iter_values())) == ("wgmma", (64, 64, 16))
    assert not ops(out, target.MemcpyOp)
    assert {op.align.value.data for op in ops(out, target.AllocateOp)} == {1024}
    (barriers,) = ops(out, target.MBarrierAllocOp)
    (init,) = ops(out, target.MBarrierInitOp)
    assert init.barriers is barriers.result and init.arrivals.value.data == 1
    (arm,) = ops(out, target.MBarrierArriveExpectTxOp)
    loads = ops(out, target.TmaLoadOp)
    assert arm.bytes.value.data == sum(load.tensor_map.type.box_bytes for load in loads)
    assert all(load.barriers is barriers.result for load in loads)
    assert len(ops(out, target.MBarrierTryWaitOp)) >= 1
    # the shared-memory allocation pass places the buffers, then the mbarriers after them
    offsets = [op.offset.value.data for op in ops(out, target.AllocateOp)]
    assert offsets[0] == 0 and barriers.offset.value.data >= offsets[-1] + ops(out, target.AllocateOp)[-1].size.value.data
    (kernel,) = ops(out, target.KernelOp)
    assert kernel.config.shared.data == barriers.offset.value.data + 8 * barriers.result.type.count.data
    # the mbarrier wait publishes the copies: the only block barrier is the one after mbarrier_init
    assert len(ops(out, target.BarrierOp)) == 1


@pytest.mark.parametrize("gemm, why", [
    ({"k": 32}, "a tile 32 elements wide (not whole 128-byte rows, nor one 64-byte row of 8-bit elements)"),
    ({"k": 64, "padding": float("-inf")}, "a copy padded with a value other than 0"),
    ({"k": 64, "num_warps": 8}, "an mma of 64 rows on 8 warps (wgmma: 64 rows per warpgroup)"),
    ({"k": 64, "element": f32}, "a copy of 32-bit elements"),
])
def test_sm90a_kernel_the_native_path_cannot_take_falls_back_to_mma_sync(gemm, why):
    module = tile_gemm(**gemm)
    (kernel,) = ops(module, tile.KernelOp)
    assert why in native_blockers(kernel, platforms.get("sm_90a"))
    out = lower_tile_to_target(module, "sm_90a")
    out.verify()
    assert {op.mechanism.data for op in ops(out, target.MemcpyOp)} <= {"cp.async", "ld.global"}
    assert all(op.family.data == "mma.sync" for op in ops(out, target.TensorCoreOp))


def test_gfx90a_uses_mfma_with_wave64():
    out = lowered("gfx90a", element=bf16)
    (mma,) = ops(out, target.TensorCoreOp)
    assert mma.family.data == "v_mfma_f32_32x32x8bf16_1k"
    (kernel,) = ops(out, target.KernelOp)
    assert kernel.config.block_dims == (256, 1, 1)  # 4 wave64 warps
    assert not ops(out, target.CpAsyncCommitOp)  # no cp.async groups to commit


def test_kernel_config_and_launch():
    out = lowered("sm_80", stages=3)
    (kernel,), (launch,) = ops(out, target.KernelOp), ops(out, target.LaunchOp)
    cfg = kernel.config
    assert (cfg.grid_dims, cfg.block_dims, cfg.shared.data) == ((4, 4, 1), (128, 1, 1), 3 * 64 * 32 * 2 * 2)
    assert 32 <= cfg.regs.data <= 255 and cfg.regs.data % 8 == 0
    assert (tuple(launch.grid.iter_values()), launch.shared.value.data) == ((4, 4, 1), cfg.shared.data)
    assert kernel.platform == target.PlatformAttr.of(platforms.get("sm_80"))


def test_copy_keeps_tile_addressing():
    out = lowered("sm_80", padding=float("-inf"))
    copy_a = ops(out, target.MemcpyOp)[0]
    assert (copy_a.kind.data, bool(copy_a.is_async.value.data)) == ("global_to_shared", True)
    assert tuple(copy_a.tile_dims.iter_values()) == (0, 1) and copy_a.padding.value.data == float("-inf")
    assert (len(copy_a.dst_indices), len(copy_a.src_indices)) == (1, 2)
    assert copy_a.mechanism.data == "ld.global"  # cp.async can only zero-fill


def test_tile_ops_without_platform_choices_stay():
    out = lowered("sm_80")
    names = {op.name for op in out.walk()}
    assert {"tile.load_shared", "tile.store", "tile.program_id", "scf.for", "arith.muli"} <= names
    assert not names & {"tile.kernel", "tile.mma", "tile.copy_async", "tile.alloc_shared", "tile.barrier",
                        "tile.async_wait", "tile.async_commit", "tile.launch", "tile.return"}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a", "gfx90a", "gfx1100"])
def test_lowered_module_round_trips(arch):
    text = target.print_module(lowered(arch))
    again = target.parse_target_module(text)
    again.verify()
    assert target.print_module(again) == text


def test_input_module_is_not_mutated():
    module = tile_gemm()
    before = tile.print_module(module)
    lower_tile_to_target(module, "sm_90a")
    assert tile.print_module(module) == before


def test_small_tile_on_sm90a_falls_back_to_mma_sync():
    (mma,) = ops(lowered("sm_90a", m=32), target.TensorCoreOp)
    assert mma.family.data == "mma.sync"


def test_too_much_shared_memory_names_kernel_and_numbers():
    with pytest.raises(TargetLoweringError, match=r"kernel @gemm needs 196608 bytes of shared memory .* "
                                                  r"sm_86 allows 101376 per block"):
        lower_tile_to_target(tile_gemm(m=128, n=256, k=64, stages=4), "sm_86")


def test_too_many_warps_for_wave64():
    with pytest.raises(TargetLoweringError, match=r"kernel @gemm: 32 warps x 64 threads = 2048 threads, but gfx90a "
                                                  r"allows 1024 per block"):
        lower_tile_to_target(tile_gemm(num_warps=32), "gfx90a")


def test_dtype_without_matrix_instructions_keeps_simt_mma():
    """gfx906 has no matrix cores: its mma stays a tile.mma, computed with FMAs by the emitter."""
    lowered = lower_tile_to_target(tile_gemm(), "gfx906")
    assert [op.name for op in lowered.walk() if op.name in ("tile.mma", "tessera_target.tensor_core")] == ["tile.mma"]


def test_tile_no_instruction_covers_is_an_error():
    with pytest.raises(TargetLoweringError, match=r"sm_80 has no matrix instruction that covers it"):
        lower_tile_to_target(tile_gemm(k=8), "sm_80")


def _native_gemm(path: str):
    import tessera as tsr

    @tsr.function
    def mm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        return tsr.matmul(a, b)
    return mm.compile(mm.arg_specs_for(dict(M=512, K=512, N=512), "fp16"), arch="sm_90a", path=path)


def test_native_gemm_overlaps_each_wgmma_with_the_next_copies():
    """mma_async: compute, wait until one mma group runs, barrier, then issue; the accumulator is
    waited for after the loop. The barrier that publishes cp.async copies goes (the mbarrier wait
    does that); the one that frees a stage for the copies after it stays. On the mma.sync path the
    tilings have no mma_async and the loop waits for cp.async groups at one barrier per step."""
    native = _native_gemm("native")
    tile_ops = [op.name for op in native.modules["tile"].walk()]
    assert tile_ops.count("tile.mma_wait") == 2
    loop = next(op for op in native.modules["target"].walk() if isinstance(op, scf.ForOp))
    kinds = [op.name.split(".")[-1] for op in loop.body.block.ops if op.dialect_name() == "tessera_target"]
    assert kinds[:7] == ["mbarrier_try_wait", "wgmma_descriptor", "wgmma_descriptor", "wgmma_fence", "tensor_core",
                         "wgmma_commit", "wgmma_wait"]
    assert kinds[7] == "barrier" and kinds[8] == "mbarrier_arrive_expect_tx" and set(kinds[9:]) == {"tma_load"}
    waits = [op.pending.value.data for op in native.modules["target"].walk() if isinstance(op, target.WgmmaWaitOp)]
    assert waits == [1, 0]
    ampere = _native_gemm("ampere").modules["target"]
    kinds = [op.name.split(".")[-1] for op in ampere.walk()
             if isinstance(op, (target.CpAsyncWaitOp, target.BarrierOp, target.WgmmaWaitOp))]
    assert kinds == ["cp_async_wait", "barrier"]


def _elementwise_kernel(fn, dims: dict, dtype: str, dynamic=()):
    f = tsr.function(fn, dynamic=list(dynamic)) if dynamic else tsr.function(fn, static=list(dims))
    compiled = f.compile(f.arg_specs_for(dims, dtype), dynamic=frozenset(dynamic), arch="sm_90a")
    (kernel,) = [op for op in compiled.stage("target").ops if isinstance(op, target.KernelOp)]
    return kernel, next(iter(compiled.stage("ptx").values())).ptx


def _bias_gelu(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.gelu(x * w + b)


def _gated(a: Tensor["M", "N"], b: Tensor["M", "N"], c: Tensor["M", "N"], d: Tensor["M", "N"]):
    return tsr.silu(a) * b + c * d


@pytest.mark.parametrize("fn, dtype, blocks", [
    (_bias_gelu, "bf16", 12),   # 24 + 8 (two rows of x) + 4 + 4 (w and b) = 40 registers: 12 blocks of 128 threads
    (_bias_gelu, "f32", 10),    # 24 + 16 (four rows of x) + 4 + 4 = 48
    (_gated, "bf16", 9),        # 24 + 4 x 8 = 56
    (_gated, "f32", 5),         # 24 + 4 x 16 = 88
])
def test_a_generic_streaming_kernel_asks_for_registers_to_hold_its_loads(fn, dtype, blocks):
    """A shape-generic elementwise kernel asks ptxas for the blocks per SM at which a thread holds
    every load of its tile (`stream_blocks`), written on the Target IR kernel and in the PTX as
    `.minnctapersm`; the kernel compiled for M leaves the choice to ptxas."""
    kernel, ptx = _elementwise_kernel(fn, {"M": 4096, "N": 4096}, dtype, ("M",))
    assert kernel.min_blocks is not None and kernel.min_blocks.value.data == blocks
    assert f".minnctapersm {blocks}" in ptx
    kernel, ptx = _elementwise_kernel(fn, {"M": 4096, "N": 4096}, dtype)
    assert kernel.min_blocks is None and ".minnctapersm" not in ptx


def test_a_kernel_that_is_no_stream_asks_nothing():
    """A generic row reduction (a loop, a reduction) is no stream: ptxas chooses its registers alone."""
    def norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b)
    kernel, ptx = _elementwise_kernel(norm, {"M": 4096, "N": 4096}, "bf16", ("M",))
    assert kernel.min_blocks is None and ".minnctapersm" not in ptx


@tsr.function
def long_softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, -1)


def test_a_row_split_across_a_cluster_is_refused_where_there_are_none():
    fn = tsr.function(long_softmax.fn, space={"cluster": [4], "block_n": [8192]})
    compiled = fn.compile(fn.arg_specs_for(dict(M=4, N=32768), "bf16"), arch="sm_80")
    with pytest.raises(TargetLoweringError, match="thread-block cluster, which sm_80 does not have; pin the row "
                                                  "kernel's cluster param to 1"):
        compiled.stage("target")


def test_a_cluster_gather_in_a_row_walk_is_double_buffered():
    """The exchange of a walk's every row block takes its two buffers in turn, after a block
    barrier; the meeting before the first exchange is the kernel's arrive at its start and the
    wait before the walk."""
    import norm_backward_cases
    compiled, _ = norm_backward_cases.compile("rms_norm", 300, 20000)
    kernel = next(op for op in compiled.modules["target"].ops if isinstance(op, target.KernelOp))
    ops = list(kernel.body.block.ops)
    assert isinstance(ops[0], target.ClusterBarrierOp) and ops[0].phase.data == "arrive"
    (wait,) = [op for op in ops if isinstance(op, target.ClusterBarrierOp) and op.phase.data == "wait"]
    assert isinstance(wait.next_op, scf.ForOp)
    (exchange,) = [op for op in kernel.walk() if isinstance(op, tile.ClusterGatherOp)]
    assert target.DOUBLE_BUFFERED in exchange.attributes
    assert isinstance(exchange.prev_op, target.BarrierOp)   # (the block has read the buffer it writes next)
    # (two mbarriers and buffers: one row a block, 4 bytes a value from each of the 3 blocks)
    assert exchange.attributes[target.SCRATCH].size.data == 2 * (8 + 4 * 3)
