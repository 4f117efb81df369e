"""Tile IR -> Target IR: pick the platform's mechanism for every tile op.

This step is where a kernel meets a GPU. It asks the platform registry, never
an arch name: the registry says which matrix instruction a `tile.mma` becomes
(mma.sync, wgmma, tcgen05.mma, an MFMA or a WMMA), how a `tile.copy_async`
moves data (TMA, cp.async or plain loads), and what the limits are.

Each kernel is lowered for its own view of the platform (`kernel_platform`):
the Hopper-native mechanisms (TMA boxes completing on mbarriers, wgmma reading
shared memory through descriptors) are used where every copy and mma of the
kernel has a form they take; a kernel that has one they don't (a copy padded
with -inf, an mma B operand in registers, a tile not a whole 128-byte swizzle
wide) gets the platform with them masked, i.e. the mma.sync + cp.async path.
TMA kernels get their pipelines' protocol as typed ops (`async_pipelines`);
then one small rewrite pattern per tile op does the translation (ops with no
platform choice in them, such as loads, stores, reductions, arith, math and scf,
stay as they are), one pass writes the register layouts (`assign_layouts`) and
one places shared memory (`shared_memory`). `lower_tile_to_target` lists the
steps.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from xdsl.dialects import scf
from xdsl.dialects.builtin import IntegerAttr, MemRefType, ModuleOp, TensorType, UnitAttr
from xdsl.ir import Attribute, Operation
from xdsl.rewriter import InsertPoint, Rewriter
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from tessera import dtypes, platforms
from tessera.ir import provenance, target, tile
from tessera.platforms import Platform
from tessera.runtime import tensor_maps
from tessera.runtime.tensor_maps import NARROW_ROW_BYTES, box_row_bytes, whole_box_rows

from . import TargetLoweringError, debug_to_target

from .assign_layouts import annotate_layouts
from .shared_memory import allocate_shared, shared_layout
from .async_pipelines import RegisterSplit, lower_tma_pipelines
from .byte_fragments import mark_permuted_key_copies


# Register estimate: per-thread registers for indices, addresses and loop
# counters, before any tile data.
_BASE_REGS = 32


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _tensor_bits(t: Attribute) -> int:
    return math.prod(t.get_shape()) * t.get_element_type().bitwidth if isinstance(t, TensorType) else 0


def estimate_regs(kernel: tile.KernelOp, threads: int, platform: Platform, producers: int = 0) -> int:
    """An *estimate* of the registers per thread, for the kernel config and
    occupancy reports; ptxas decides the real number. Counts the loop-carried
    register tiles (accumulators, running max/sum) plus the largest pair of mma
    operand tiles, spread over the threads that compute (a producer warpgroup
    holds none), on top of `_BASE_REGS`; rounded up to ptxas's allocation unit
    of 8 and capped so one block fits on an SM."""
    carried = sum(_tensor_bits(arg.type) for op in kernel.walk() if isinstance(op, scf.ForOp)
                  for arg in op.body.block.args[1:])
    operands = max((_tensor_bits(op.a.type) + _tensor_bits(op.b.type)
                    for op in kernel.walk() if isinstance(op, tile.MmaOp)), default=0)
    computing = threads - producers * platform.warp_size
    regs = _align_up(_BASE_REGS + -(-(carried + operands) // (32 * computing)), 8)
    return min(regs, platform.max_regs_per_thread, platform.regs_per_sm // threads // 8 * 8)


#: A streaming kernel's registers a thread besides its loads' data (indices, addresses, predicates,
#: the math's temporaries), as ptxas allocated them for bias + gelu over [M, 4096] bf16: 40 with
#: its 16 registers of loads in flight (`stream_blocks`).
STREAM_BASE_REGS = 24
#: the tile ops a streaming kernel is made of, besides arith and math ops: loads, stores and
#: elementwise tile ops (a loop, a reduction, an mma, shared memory or a gather make no stream)
_STREAM_OPS = (tile.LoadOp, tile.StoreOp, tile.BroadcastOp, tile.ArangeOp, tile.ProgramIdOp, tile.DimOp,
               tile.CmpiOp, tile.CmpfOp, tile.SelectOp, tile.SIToFPOp, tile.FPToSIOp, tile.ReturnOp, target.ReturnOp)


def stream_blocks(kernel: tile.KernelOp, layouts: dict, threads: int, platform: Platform) -> int | None:
    """The blocks per SM a shape-generic streaming kernel (global loads, elementwise math, stores;
    a grid that grows with a dim taken at run time) asks of ptxas (`tile.OCCUPANCY`,
    `.minnctapersm`) so that a thread holds every load of its tile at once: `STREAM_BASE_REGS`
    plus its loads' registers allow that many; None where the SM's full occupancy allows them
    already, or the kernel is not such a stream.

    Left to itself ptxas aims at full occupancy, and gets there by issuing a tile's later loads only
    after the math on its first ones where it can: the generic kernel's linear grid (`grid_limits`)
    lets it prove the columns in range, freeing the registers. Bias + gelu over [M, 4096] bf16 then
    took 32 registers and read its second row after the first's gelu: 1.05-1.13x the time of the
    kernel compiled for M (40 registers, every load first); asked for 12 blocks (40 registers) it ran
    0.99-1.03x (H200, `bench/dynamic_shapes.py --only bias_gelu`, bench/RESULTS.md session 27). A
    fixed 12 made kernels of four [M, N] inputs spill. Kernels compiled for their dims keep ptxas's
    own choice: it issued their loads first (bias + gelu, bf16 and fp32), and asked, its choices
    are not monotonic (fp32 bias + gelu at 10 blocks: 48 registers and a late load; 9 and 11 fine)."""
    loads = []
    for op in kernel.body.walk():
        if not (isinstance(op, _STREAM_OPS) or op.name.split(".")[0] in ("arith", "math")):
            return None
        if isinstance(op, tile.LoadOp):
            loads.append(op)
    if not loads or any(op.results[0] not in layouts for op in loads):
        return None
    data = sum(-(-len(layouts[op.results[0]].offsets) * op.results[0].type.get_element_type().bitwidth // 32)
               for op in loads)
    blocks = platform.regs_per_sm // (threads * (STREAM_BASE_REGS + data))
    full = min(platform.max_threads_per_sm // threads, platform.max_blocks_per_sm)
    return blocks if 1 <= blocks < full else None


NATIVE = platforms.HOPPER_NATIVE

#: wgmma reads 16-bit operands through descriptors, and 8-bit ones (fp8) stored K-major only.
_WGMMA_ELEMENT_BITS = (16, 8)


def native_blockers(kernel: tile.KernelOp, platform: Platform) -> list[str]:
    """Why `kernel` can't use TMA copies and wgmma on `platform` (empty when it can).

    Copies must be unpadded boxes of a 16-bit or 8-bit tensor whose tile rows run along its
    contiguous dim, a whole number of 128-byte swizzle spans wide, whose outer dims' strides
    a tensor map can hold (`tensor_maps.stride_problem`: 16-byte aligned rows); every mma must read B from shared memory (A from shared
    memory or, like attention's probabilities, from registers), with one 64-row
    wgmma per warpgroup."""
    if not NATIVE <= platform.features:
        return [f"{platform.arch} lacks {', '.join(sorted(NATIVE - platform.features))}"]
    warps = kernel.num_warps.value.data
    reasons = []
    chained = any(isinstance(op, tile.MmaOp) and not isinstance(op.a.owner, tile.LoadSharedOp) for op in kernel.walk())
    for op in kernel.walk():
        if isinstance(op, tile.CopyAsyncOp):
            reasons += _copy_blockers(op)
            if not chained and _narrow_rows(op):
                reasons.append("an 8-bit GEMM tile of 64-byte rows (measured slower on the Hopper path)")
        elif isinstance(op, tile.MmaOp):
            reasons += _mma_blockers(op, warps)
        elif isinstance(op, tile.LoadSharedOp) and op.into_registers:
            # (TMA lays a stage out in 128-byte boxes for wgmma, one copy a box: 512 a row of 32768
            # bf16 elements, where the threads' own 16-byte copies land where they read them)
            reasons.append("a staged tile read into registers (a row walk's rows), which the threads copy")
    return reasons


def _narrow_rows(op: tile.CopyAsyncOp) -> bool:
    """Whether a copy fills 64-byte box rows (`tensor_maps.box_row_bytes`). Only attention takes them
    (fp8 Q and K at D = 64: its mmas feed one another, P @ V's A in registers): an fp8 GEMM whose K is
    one 64-element step gains no pipelining and ran slower on the Hopper path than on mma.sync (H200
    4096x4096x64 36.8 -> 41.8 us, 8192x8192x64 142.4 -> 147.5; bench/RESULTS.md session 42)."""
    cols, element_bytes = op.tile_shape[1], max(1, op.dst.type.get_element_type().bitwidth // 8)
    return box_row_bytes(cols, element_bytes) == NARROW_ROW_BYTES


def _copy_blockers(op: tile.CopyAsyncOp) -> list[str]:
    src: MemRefType = op.src.type
    bits = src.get_element_type().bitwidth
    rows, cols = op.tile_shape
    stride_problem = tensor_maps.stride_problem(tile.stride_factors(src), max(1, bits // 8))
    checks = [
        (op.padding.value.data == 0.0, "a copy padded with a value other than 0"),
        (bits in _WGMMA_ELEMENT_BITS, f"a copy of {bits}-bit elements"),
        (tuple(op.tile_dims.get_values())[1] == src.get_num_dims() - 1,
         "a copy whose tile rows do not run along the tensor's contiguous dim"),
        (stride_problem is None, f"{stride_problem}"),
        (whole_box_rows(cols, max(1, bits // 8)),
         f"a tile {cols} elements wide (not whole 128-byte rows, nor one 64-byte row of 8-bit elements)"),
        (rows <= 256, f"a tile of {rows} rows (a TMA box has at most 256)"),
        (op.rows[0] % 8 == 0, f"a copy into stage row {op.rows[0]} (the 128-byte swizzle repeats every 8 rows)"),
    ]
    return [why for ok, why in checks if not ok]


def _mma_blockers(op: tile.MmaOp, warps: int) -> list[str]:
    m, n, k = op.mnk
    bits = op.a.type.get_element_type().bitwidth
    checks = [
        (isinstance(op.b.owner, tile.LoadSharedOp), "an mma B operand held in registers"),
        (warps % 4 == 0 and m == 16 * warps, f"an mma of {m} rows on {warps} warps (wgmma: 64 rows per warpgroup)"),
        (k % 16 == 0 and n % 8 == 0 and (n <= 256 or n % 256 == 0), f"an mma tile {m}x{n}x{k}"),
        (bits in _WGMMA_ELEMENT_BITS, f"an mma on {bits}-bit operands"),
        (bits != 8 or (op.transpose_a is None and op.transpose_b is not None),
         "an 8-bit mma whose operands are not both K-contiguous (A as [M, K], B as [N, K])"),
    ]
    return [why for ok, why in checks if not ok]


def _fp8_pair(op: tile.MmaOp) -> bool:
    """Whether an mma's operands are the two fp8 formats, which one instruction takes mixed (its
    `precision` names A's; B's element type says its own)."""
    fp8 = {d.mlir for d in dtypes.FP8}
    return {str(op.a.type.get_element_type()), str(op.b.type.get_element_type())} <= fp8


def kernel_platform(kernel: tile.KernelOp, platform: Platform) -> Platform:
    """The platform `kernel` is lowered for: `platform` itself, or without the native
    mechanisms when the kernel has a copy or mma they can't take (`native_blockers`)."""
    if not NATIVE & platform.features or not native_blockers(kernel, platform):
        return platform
    return platforms.without(platform, NATIVE)


def _chosen_platform(kernel: tile.KernelOp, platform: Platform, tensor_cores: bool) -> Platform:
    """`kernel_platform`, or the platform without the native path when mmas stay on CUDA cores; a
    TargetLoweringError for a kernel with an mma tile only wgmma takes (`schedule.WGMMA_BLOCK_N`: the
    other paths' warp tilings halve a tile's sides) that cannot use wgmma."""
    chosen = kernel_platform(kernel, platform) if tensor_cores else platforms.without(platform, NATIVE)
    uneven = sorted({n for op in kernel.walk() if isinstance(op, tile.MmaOp) for n in [op.mnk[1]] if n & (n - 1)})
    if uneven and not NATIVE <= chosen.features:
        why = (native_blockers(kernel, platform) or ["its mmas stay on CUDA cores"])[0] if tensor_cores \
            else "its mmas stay on CUDA cores"
        raise TargetLoweringError(f"kernel @{kernel.sym_name.data}: {uneven[0]}-column tiles need wgmma, which it "
                                  f"cannot use here ({why}); pin a block_n that is a power of two")
    return chosen


def _grids(module: ModuleOp) -> dict[str, tuple]:
    """The grid each kernel is launched with, from the host code's tile.launch ops: its constant
    part, and the terms of the axes that grow with dynamic dims (`tile.LaunchOp.grid_dims`)."""
    grids: dict[str, tuple] = {}
    for launch in module.walk():
        if isinstance(launch, tile.LaunchOp):
            name, grid = launch.kernel.string_value(), (tuple(launch.grid.get_values()), launch.dynamic_grid)
            if grids.setdefault(name, grid) != grid:
                raise TargetLoweringError(f"kernel @{name} is launched with grids {list(grids[name])} and "
                                          f"{list(grid)}; one kernel has one launch configuration")
    return grids


def _dependent_launches(module: ModuleOp) -> set[str]:
    """The kernels whose every launch follows another kernel's launch of the same call in the host
    code (all but the first launched): each may start while the one before it ends. The first is
    launched plainly, after whatever the caller queued before the call."""
    names = [op.kernel.string_value() for op in module.walk() if isinstance(op, tile.LaunchOp)]
    return set(names[1:]) - set(names[:1])


def producer_warps(kernel: tile.KernelOp, platform: Platform) -> int:
    """The warps a warp-specialized kernel adds to issue its copies: its `producer_warps`
    attribute where `platform` copies with TMA (one thread issues a whole tile), else none."""
    attr = kernel.attributes.get(tile.PRODUCER_WARPS)
    return attr.value.data if attr is not None and platforms.copy_mechanism(platform) == "tma" else 0


def _threads(kernel: tile.KernelOp, platform: Platform) -> int:
    """The block's threads: its computing warps plus any producer warps."""
    warps = kernel.num_warps.value.data + producer_warps(kernel, platform)
    threads = warps * platform.warp_size
    if threads > platform.max_threads_per_block:
        raise TargetLoweringError(
            f"kernel @{kernel.sym_name.data}: {warps} warps x {platform.warp_size} threads = {threads} threads, "
            f"but {platform.arch} allows {platform.max_threads_per_block} per block")
    return threads


# ---------------------------------------------------------------------------
# One pattern per tile op
# ---------------------------------------------------------------------------


@dataclass
class LowerKernel(RewritePattern):
    """tile.kernel -> tessera_target.kernel with its config, the platform it was lowered for and
    the registers per thread a warp-specialized kernel is launched with; the body moves over."""

    configs: dict[str, target.KernelConfigAttr]
    platforms: dict[str, Platform]
    splits: dict[str, RegisterSplit | None]
    dependents: set[str]          # `_dependent_launches`

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.KernelOp, rewriter: PatternRewriter) -> None:
        name = op.sym_name.data
        if name not in self.configs:   # another backend's kernel (`tile.BACKEND`)
            return
        producers = producer_warps(op, self.platforms[name]) or None
        split = self.splits.get(name)
        body = op.detach_region(op.body)
        occupancy = op.attributes.get(tile.OCCUPANCY)
        cluster = tile.cluster_size(op)
        kernel = target.KernelOp(
            name, op.function_type.inputs.data, self.configs[name], target.PlatformAttr.of(self.platforms[name]), body,
            producer_warps=producers, maxnreg=split.launch if split else None,
            min_blocks=occupancy.value.data if occupancy is not None and not split else None,
            cluster=cluster if cluster > 1 else None)
        if name in self.dependents and self.platforms[name].has("programmatic_launch"):
            kernel.attributes[target.PROGRAMMATIC_LAUNCH] = UnitAttr()
        for name in (tile.INDEX_BITS, tile.BUFFER_DIMS, tile.BACKEND_WHY):
            if name in op.attributes:
                kernel.attributes[name] = op.attributes[name]
        rewriter.replace(op, kernel)


def _cluster_barriers(block, name: str, platform: Platform) -> None:
    """A clustered kernel's meeting before its first cluster gather: the cluster barrier's arrive
    at the start of its body, its wait before the op holding that gather; and each gather run in
    a loop double-buffered, after a block barrier (its block's threads have read the buffer it
    writes next: `target.ClusterBarrierOp` says why that is enough)."""
    if not platform.has("clusters"):
        raise TargetLoweringError(f"kernel @{name} splits its rows across a thread-block cluster, which "
                                  f"{platform.arch} does not have; pin the row kernel's cluster param to 1")
    first = next((op for op in block.ops if any(isinstance(o, tile.ClusterGatherOp) for o in op.walk())), None)
    if first is None:
        return
    block.insert_op_before(target.ClusterBarrierOp("arrive"), block.first_op)
    block.insert_op_before(target.ClusterBarrierOp("wait"), first)
    for op in block.walk():
        if isinstance(op, tile.ClusterGatherOp) and _in_loop(op):
            op.attributes[target.DOUBLE_BUFFERED] = UnitAttr()
            op.parent_block().insert_op_before(target.BarrierOp(), op)


def _in_loop(op) -> bool:
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, tile.KernelOp):
        if isinstance(parent, scf.ForOp):
            return True
        parent = parent.parent_op()
    return False


class LowerReturn(RewritePattern):
    """tile.return -> tessera_target.return."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.ReturnOp, rewriter: PatternRewriter) -> None:
        rewriter.replace(op, target.ReturnOp())


@dataclass
class LowerMma(RewritePattern):
    """tile.mma -> tessera_target.tensor_core with the registry's best instruction
    for the operand dtype that covers the tile; an asynchronous one (wgmma) reading its
    shared operands through `wgmma_descriptor`s (the `tile.load_shared`s go), between a
    `wgmma_fence` and a `wgmma_commit`, and waited for at once (`wgmma_wait pending = 0`)
    unless a tile.mma_wait follows before anything reads its result.

    A dtype with no matrix instruction at all on the platform (fp32, whose tensor-core
    path would silently be TF32) keeps its `tile.mma`. The CPU interpreter runs it
    exactly; the PTX backend has no CUDA-core matmul yet and raises
    `UnsupportedByBackend` for it."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.MmaOp, rewriter: PatternRewriter) -> None:
        dtype = str(op.a.type.get_element_type())
        if str(op.b.type.get_element_type()) != dtype and not _fp8_pair(op):
            raise TargetLoweringError(f"tile.mma operands differ in element type: a is {op.a.type}, b is {op.b.type}")
        m, n, k = op.mnk
        instr = platforms.mma_instruction(self.platform, dtype, (m, n, k))
        if instr is None and not platforms.mma_instructions(self.platform, dtype):
            return
        if instr is None:
            have = ", ".join(f"{i.family} {list(i.shape)}" for i in platforms.mma_instructions(self.platform, dtype))
            raise TargetLoweringError(
                f"tile.mma {m}x{n}x{k} on {dtype}: {self.platform.arch} has no matrix instruction that covers it"
                f" ({'its ' + dtype + ' instructions: ' + have if have else 'no ' + dtype + ' matrix instructions'})")
        layout = ("t" if op.transpose_a is not None else "n") + ("t" if op.transpose_b is not None else "n")
        if instr.family != "wgmma":
            if layout[0] == "t" and not isinstance(op.a.owner, tile.LoadSharedOp):
                raise TargetLoweringError("tile.mma: a transposed A must be read from shared memory")
            rewriter.replace(op, target.TensorCoreOp(instr.family, op.a, op.b, op.acc, instr.fit((m, n, k)), layout,
                                                     instr.operand))
            return
        loads = [v.owner for v in (op.a, op.b) if isinstance(v.owner, tile.LoadSharedOp)]
        descriptors = {load.result: _wgmma_descriptor(load, is_a=load.result is op.a,
                                                      k_major=layout[0] == "n" if load.result is op.a else layout[1] == "t")
                       for load in loads}
        mma = target.TensorCoreOp(instr.family, descriptors[op.a].result if op.a in descriptors else op.a,
                                  descriptors[op.b].result, op.acc, instr.fit((m, n, k)), layout, instr.operand)
        waits = [] if _waited_for_later(op) else [target.WgmmaWaitOp(0)]
        rewriter.replace(op, [*descriptors.values(), target.WgmmaFenceOp(), mma, target.WgmmaCommitOp(), *waits],
                         [mma.result])
        for load in loads:
            if not load.result.uses:
                rewriter.erase(load)


def _wgmma_descriptor(load: tile.LoadSharedOp, is_a: bool, k_major: bool) -> target.WgmmaDescriptorOp:
    """The descriptor of a TMA-filled stage (`shared_layout`: boxes of 128-byte rows in the 128-byte
    swizzle, or of 64-byte rows in the 64-byte one, `tensor_maps.box_row_bytes`; either repeats every
    8 rows, so 8-row groups are 8 box rows apart: the stride byte offset). An operand stored
    K-major has one box along K per box row of elements, which the wgmma steps through itself
    (leading offset unused: 16); stored M/N-major, its box-wide column blocks are a box apart
    (leading offset: one box's bytes). A's rows are split over the warpgroups, 64 each: 64 rows
    further stored K-major, one box (its columns of M) further stored M-major (the transposed A of
    a weight gradient, X^T @ dY, which TMA cannot transpose on the way in)."""
    major = "k" if k_major else "mn"
    t: MemRefType = load.src.type
    rows, cols = t.get_shape()[1:]
    row_bytes = box_row_bytes(cols, max(1, t.get_element_type().bitwidth // 8))
    box = rows * row_bytes
    leading = 16 if major == "k" else box
    per_warpgroup = (64 * row_bytes if major == "k" else box) if is_a else 0
    return target.WgmmaDescriptorOp(load.src, load.stage, major, leading, 8 * row_bytes, row_bytes, per_warpgroup)


def _waited_for_later(op: tile.MmaOp) -> bool:
    """Whether a tile.mma_wait follows `op` in its block before anything there reads its result."""
    readers = [use.operation for use in op.result.uses if not isinstance(use.operation, scf.YieldOp)]
    nxt = op.next_op
    while nxt is not None:
        if isinstance(nxt, (tile.MmaWaitOp, target.WgmmaWaitOp)):
            return True
        if any(r is nxt or nxt.is_ancestor(r) for r in readers):   # read here, or in a region of it
            return False
        nxt = nxt.next_op
    return False


@dataclass
class LowerAllocShared(RewritePattern):
    """tile.alloc_shared -> tessera_target.allocate pool = "shared" with the alignment and swizzle of
    the platform's copy mechanism (`shared_layout`); `allocate_shared` then places it."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AllocSharedOp, rewriter: PatternRewriter) -> None:
        t: MemRefType = op.result.type
        align, swizzle = shared_layout(platforms.copy_mechanism(self.platform), t)
        rewriter.replace(op, target.AllocateOp(t, "shared", target.memref_bytes(t), align, swizzle))


@dataclass
class LowerCopyAsync(RewritePattern):
    """tile.copy_async -> tessera_target.memcpy global_to_shared, async, copied by the block's
    threads with the registry's mechanism for its padding (cp.async, or plain loads);
    tile_dims, padding and offsets carry over so the emitter can address the tile. TMA
    copies are lowered before, with their mbarriers (`async_pipelines`)."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.CopyAsyncOp, rewriter: PatternRewriter) -> None:
        mechanism = platforms.copy_mechanism(self.platform, op.padding.value.data)
        rewriter.replace(op, target.MemcpyOp(
            op.dst, [op.stage], op.src, op.offsets, "global_to_shared", True, mechanism,
            tuple(op.tile_dims.get_values()), op.padding, op.dst_rows and op.rows, whole=op.whole is not None))


@dataclass
class LowerAsyncCommit(RewritePattern):
    """tile.async_commit -> tessera_target.cp_async_commit; plain loads are done when issued."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AsyncCommitOp, rewriter: PatternRewriter) -> None:
        if platforms.copy_mechanism(self.platform) == "cp.async":
            rewriter.replace(op, target.CpAsyncCommitOp())
        else:
            rewriter.erase(op)


@dataclass
class LowerAsyncWait(RewritePattern):
    """tile.async_wait -> tessera_target.cp_async_wait pending = N; plain loads are done when issued."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AsyncWaitOp, rewriter: PatternRewriter) -> None:
        if platforms.copy_mechanism(self.platform) == "cp.async":
            rewriter.replace(op, target.CpAsyncWaitOp(op.pending.value.data))
        else:
            rewriter.erase(op)


@dataclass
class LowerMmaWait(RewritePattern):
    """tile.mma_wait -> tessera_target.wgmma_wait pending = N where mmas run asynchronously
    (wgmma); elsewhere they are done when issued and the wait goes."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.MmaWaitOp, rewriter: PatternRewriter) -> None:
        if self.platform.has("wgmma"):
            rewriter.replace(op, target.WgmmaWaitOp(op.pending.value.data))
        else:
            rewriter.erase(op)


@dataclass
class FenceSharedStores(RewritePattern):
    """A tile.store_shared is followed by `fence kind = "async_shared"` where mmas read shared
    memory through the async proxy (wgmma's descriptors), which a thread's stores reach only
    through the fence; the barrier after it (the template's) then lets them read."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.StoreSharedOp, rewriter: PatternRewriter) -> None:
        if not self.platform.has("wgmma") or isinstance(op.next_op, target.FenceOp):
            return
        rewriter.insert(target.FenceOp("async_shared"), InsertPoint.after(op))


class DropReleaseStage(RewritePattern):
    """tile.release_stage goes where no cluster fills its pipeline's stages (`lower_tma_pipelines`
    lowers the others): the barrier before it already freed the stage."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.ReleaseStageOp, rewriter: PatternRewriter) -> None:
        rewriter.erase(op)


class DropMmaTurn(RewritePattern):
    """tile.mma_turn goes where `lower_tma_pipelines` did not lower it (no TMA pipelines, so no
    producer warps: the block's barriers keep its warps in step)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.MmaTurnOp, rewriter: PatternRewriter) -> None:
        rewriter.erase(op)


class LowerBarrier(RewritePattern):
    """tile.barrier -> tessera_target.barrier (every thread of the block)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.BarrierOp, rewriter: PatternRewriter) -> None:
        rewriter.replace(op, target.BarrierOp())


@dataclass
class LowerLaunch(RewritePattern):
    """tile.launch -> tessera_target.launch with the kernel's grid, block and shared."""

    configs: dict[str, target.KernelConfigAttr]

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.LaunchOp, rewriter: PatternRewriter) -> None:
        cfg = self.configs.get(op.kernel.string_value())
        if cfg is None:   # another backend's kernel, which keeps its tile.launch
            return
        rewriter.replace(op, target.LaunchOp(
            op.kernel.string_value(), op.args, cfg.grid_dims, cfg.block_dims, cfg.shared.data))


def patterns(platform: Platform, tensor_cores: bool = True) -> Iterable[RewritePattern]:
    """The rewrite patterns for the ops inside a kernel lowered for `platform`; without
    `tensor_cores`, every tile.mma stays on the CUDA cores."""
    return (
        LowerReturn(), *([LowerMma(platform)] if tensor_cores else []),
        LowerAllocShared(platform), LowerCopyAsync(platform),
        LowerAsyncCommit(platform), LowerAsyncWait(platform), LowerMmaWait(platform), LowerBarrier(),
        DropReleaseStage(), DropMmaTurn(),
        FenceSharedStores(platform),
        *debug_to_target.patterns(),
    )


def _barrier_before(op: Operation) -> target.BarrierOp | None:
    """The barrier of all computing threads nearest before `op` in its block with neither a bulk
    reduction nor an op holding regions between them (a wait placed before it is then published
    to every thread by the time they reach `op`), or None."""
    prev = op.prev_op
    while prev is not None:
        if isinstance(prev, target.BarrierOp):
            return prev
        if isinstance(prev, (target.BulkReduceOp, tile.AtomicAddOp)) or prev.regions:
            return None
        prev = prev.prev_op
    return None


def lower_bulk_reductions(kernel, layouts: dict, consumer_threads: int | None = None) -> None:
    """Each tile.atomic_add the allocation pass staged (`shared_memory.bulk_reduction_pitch`) as
    the ops that add it in bulk: once the block's previous bulk reduction has read the buffer
    (`bulk_wait read`, published by a barrier), the threads write the tile into it (`stage_rows`)
    and fence their stores for the async proxy; after a barrier thread 0 adds it with one
    `bulk_reduce`. Where a barrier of the computing warps precedes the add in its block with no
    bulk reduction or nested region between (an across sum's, after its operand's stores), the
    wait goes before that barrier instead of before a barrier of its own: one block-wide meeting
    less per step, and the previous reduction has long read the buffer by then. In a
    warp-specialized kernel (its computing warps' `consumer_threads`) the barriers are theirs
    alone, as the pipelines' (`async_pipelines`), and an add the allocation left to `red`s is
    followed by one: a step's products read its staged operand tile until each warp waits for
    them before its add, and the next step rewrites the tile (without a producer, the barrier
    guarding the next refill orders them). Before the kernel (or the computing warps' region)
    ends it waits for its bulk groups: they read shared memory until they complete. The async
    checker sees each step."""
    adds = [op for op in kernel.walk() if isinstance(op, tile.AtomicAddOp)]
    staged = [op for op in adds if target.STAGING in op.attributes]

    def barrier() -> target.BarrierOp:
        return target.BarrierOp(target.CONSUMER_BARRIER, consumer_threads) if consumer_threads \
            else target.BarrierOp()
    if consumer_threads:   # an add left to `red`s (its staging did not fit) follows the wait for the
        # products reading its operand's staged tile, which the next step rewrites: with no refill
        # barrier (a producer's mbarriers instead), the computing warps meet after it
        for op in adds:
            if target.STAGING not in op.attributes:
                Rewriter.insert_op(barrier(), InsertPoint.after(op))
    for op in staged:
        rank = op.dst.type.get_num_dims()
        tile_dims = list(tile.int_values(op.tile_dims))
        rows_dim = tile_dims.index(rank - 2)
        scratch, staging = op.attributes[target.SCRATCH], op.attributes[target.STAGING]
        published = _barrier_before(op)
        if published is not None:   # the previous reduction's read is waited for before a barrier there
            Rewriter.insert_op(target.BulkWaitOp(0, read=True), InsertPoint.before(published))
        ops = [*([] if published is not None else [target.BulkWaitOp(0, read=True), barrier()]),
               target.StageRowsOp(op.value, rows_dim, scratch, staging), target.FenceOp("async_shared"),
               barrier(),
               target.BulkReduceOp(op.dst, list(op.offsets), sorted(tile_dims), layouts[op.value].shape[rows_dim],
                                   scratch, staging)]
        Rewriter.replace_op(op, ops)
    if staged:   # (a warp-specialized kernel's computing warps wait at the end of their region)
        regions = [op.consumer.block for op in kernel.walk() if isinstance(op, target.WarpSpecializeOp)]
        ends = [InsertPoint.at_end(block) for block in regions] or \
            [InsertPoint.before(op) for op in kernel.walk() if isinstance(op, target.ReturnOp)]
        for end in ends:
            Rewriter.insert_op(target.BulkWaitOp(0), end)


def _rewrite(patterns_: Iterable[RewritePattern], region) -> None:
    """Applies the patterns; the ops replacing an op keep its provenance (source line, regions)."""
    carrying = [provenance.CarryProvenance(p) for p in patterns_]
    PatternRewriteWalker(GreedyRewritePatternApplier(carrying)).rewrite_region(region)


def lower_tile_to_target(module: ModuleOp, platform: Platform | str, *, tensor_cores: bool = True) -> ModuleOp:
    """A Target IR copy of the tile module `module` for `platform` (a Platform or
    an arch name); `module` itself is left unchanged. The PTX backend's kernels (`tile.BACKEND`)
    are lowered; another backend's kernels and their launches stay as they are. Per kernel: its platform
    (`kernel_platform`), the TMA pipelines' protocol (`lower_tma_pipelines`), one pattern
    per remaining tile op, on NVIDIA targets its register layouts (`annotate_layouts`),
    the shared-memory allocation (`allocate_shared`, which needs the layouts to size
    the scratch of reductions and staged stores), its launch configuration (grid =
    its tile.launch's, block = its warps, shared = the allocation's total, regs =
    `estimate_regs`), and whether it is launched as a programmatic dependent of the kernel
    before it (`target.PROGRAMMATIC_LAUNCH`)."""
    p = platform if isinstance(platform, Platform) else platforms.get(platform)
    lowered = module.clone()
    grids = _grids(lowered)
    configs: dict[str, target.KernelConfigAttr] = {}
    chosen: dict[str, Platform] = {}
    splits: dict[str, RegisterSplit | None] = {}
    for kernel in tile.kernels_of(lowered, "ptx"):
        name = kernel.sym_name.data
        if name not in grids:
            raise TargetLoweringError(f"kernel @{name} has no tile.launch in the module, so its grid is unknown")
        kp = chosen[name] = _chosen_platform(kernel, p, tensor_cores)
        producers = producer_warps(kernel, kp)
        threads = _threads(kernel, kp)
        regs = estimate_regs(kernel, threads, kp, producers)
        if platforms.copy_mechanism(kp) == "tma":
            mark_permuted_key_copies(kernel, kp)
            splits[name] = lower_tma_pipelines(kernel, kp, producers)
        _rewrite(patterns(kp, tensor_cores), kernel.body)
        warps = threads // 32 - producers
        layouts = annotate_layouts(kernel, warps) if kp.vendor == "nvidia" else None
        generic = bool(grids[name][1])   # (a grid growing with a run-time dim)
        blocks = stream_blocks(kernel, layouts, threads, kp) \
            if generic and layouts and tile.OCCUPANCY not in kernel.attributes else None
        if blocks is not None:
            kernel.attributes[tile.OCCUPANCY] = IntegerAttr(blocks, 64)
        if tile.cluster_size(kernel) > 1:
            _cluster_barriers(kernel.body.block, name, kp)
        shared = allocate_shared(kernel, kp, layouts, warps)
        if layouts is not None:
            lower_bulk_reductions(kernel, layouts, warps * 32 if producers else None)
        configs[name] = target.KernelConfigAttr.of(grids[name][0], (threads, 1, 1), shared, regs)
    _rewrite([LowerKernel(configs, chosen, splits, _dependent_launches(lowered)), LowerLaunch(configs)], lowered.body)
    for kernel in lowered.ops:
        if isinstance(kernel, target.KernelOp) and grids[kernel.sym_name.data][1]:
            kernel.attributes[target.GRID_DIMS] = tile.grid_dims_attr(grids[kernel.sym_name.data][1])
    return lowered
