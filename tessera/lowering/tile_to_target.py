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
The launch configuration of each kernel is computed once, up front
(`kernel_configs`), because both the kernel and its host-side launch carry it;
then one small rewrite pattern per tile op does the translation. Ops with no
platform choice in them (loads, stores, reductions, arith, math, scf) stay as
they are.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from xdsl.dialects import scf
from xdsl.dialects.builtin import MemRefType, ModuleOp, TensorType
from xdsl.ir import Attribute
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from tessera import platforms
from tessera.ir import target, tile
from tessera.platforms import Platform


class TargetLoweringError(ValueError):
    """A tile module that the chosen platform cannot run as written."""


# Alignment of shared buffers per copy mechanism: TMA's 128-byte swizzle repeats
# every 1024 bytes, cp.async moves 16-byte chunks.
_SHARED_ALIGN = {"tma": 1024, "cp.async": 128, "ld.global": 16}

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


NATIVE = platforms.HOPPER_NATIVE

#: A TMA box row is one 128-byte swizzle span; wgmma reads 16-bit operands through descriptors.
_TMA_ROW_BYTES = 128
_WGMMA_ELEMENT_BITS = 16


def native_blockers(kernel: tile.KernelOp, platform: Platform) -> list[str]:
    """Why `kernel` can't use TMA copies and wgmma on `platform` (empty when it can).

    Copies must be unpadded boxes of a 16-bit tensor whose tile rows run along its
    contiguous dim, a whole number of 128-byte swizzle spans wide, over rows that
    are 16-byte aligned; every mma must read B from shared memory (A from shared
    memory or, like attention's probabilities, from registers), with one 64-row
    wgmma per warpgroup."""
    if not NATIVE <= platform.features:
        return [f"{platform.arch} lacks {', '.join(sorted(NATIVE - platform.features))}"]
    warps = kernel.num_warps.value.data
    reasons = []
    for op in kernel.walk():
        if isinstance(op, tile.CopyAsyncOp):
            reasons += _copy_blockers(op)
        elif isinstance(op, tile.MmaOp):
            reasons += _mma_blockers(op, warps)
    return reasons


def _copy_blockers(op: tile.CopyAsyncOp) -> list[str]:
    src: MemRefType = op.src.type
    dst: MemRefType = op.dst.type
    bits = src.get_element_type().bitwidth
    rows, cols = dst.get_shape()[1:]
    checks = [
        (op.padding.value.data == 0.0, "a copy padded with a value other than 0"),
        (bits == _WGMMA_ELEMENT_BITS, f"a copy of {bits}-bit elements"),
        (tuple(op.tile_dims.get_values())[1] == src.get_num_dims() - 1,
         "a copy whose tile rows do not run along the tensor's contiguous dim"),
        (src.get_shape()[-1] * bits // 8 % 16 == 0, "a tensor whose rows are not 16-byte aligned"),
        (cols * bits // 8 % _TMA_ROW_BYTES == 0, f"a tile {cols} elements wide (not whole 128-byte rows)"),
        (rows <= 256, f"a tile of {rows} rows (a TMA box has at most 256)"),
    ]
    return [why for ok, why in checks if not ok]


def _mma_blockers(op: tile.MmaOp, warps: int) -> list[str]:
    (m, k), (_, n) = op.a.type.get_shape(), op.acc.type.get_shape()
    checks = [
        (isinstance(op.b.owner, tile.LoadSharedOp), "an mma B operand held in registers"),
        (warps % 4 == 0 and m == 16 * warps, f"an mma of {m} rows on {warps} warps (wgmma: 64 rows per warpgroup)"),
        (k % 16 == 0 and n % 8 == 0 and (n <= 256 or n % 256 == 0), f"an mma tile {m}x{n}x{k}"),
        (op.a.type.get_element_type().bitwidth == _WGMMA_ELEMENT_BITS, "an mma on non-16-bit operands"),
    ]
    return [why for ok, why in checks if not ok]


def kernel_platform(kernel: tile.KernelOp, platform: Platform) -> Platform:
    """The platform `kernel` is lowered for: `platform` itself, or without the native
    mechanisms when the kernel has a copy or mma they can't take (`native_blockers`)."""
    if not NATIVE & platform.features or not native_blockers(kernel, platform):
        return platform
    return platforms.without(platform, NATIVE)


def _chosen_platform(kernel: tile.KernelOp, platform: Platform, tensor_cores: bool) -> Platform:
    """`kernel_platform`, or the platform without the native path when mmas stay on CUDA cores."""
    return kernel_platform(kernel, platform) if tensor_cores else platforms.without(platform, NATIVE)


def _grids(module: ModuleOp) -> dict[str, tuple[int, ...]]:
    """The grid each kernel is launched with, from the host code's tile.launch ops."""
    grids: dict[str, tuple[int, ...]] = {}
    for launch in module.walk():
        if isinstance(launch, tile.LaunchOp):
            name, grid = launch.kernel.string_value(), tuple(launch.grid.get_values())
            if grids.setdefault(name, grid) != grid:
                raise TargetLoweringError(f"kernel @{name} is launched with grids {list(grids[name])} and "
                                          f"{list(grid)}; one kernel has one launch configuration")
    return grids


def _shared_bytes(kernel: tile.KernelOp, align: int) -> list[tuple[Attribute, int]]:
    return [(op.result.type, _align_up(target.memref_bytes(op.result.type), align))
            for op in kernel.walk() if isinstance(op, tile.AllocSharedOp)]


def producer_warps(kernel: tile.KernelOp, platform: Platform) -> int:
    """The warps a warp-specialized kernel adds to issue its copies: its `producer_warps`
    attribute where `platform` copies with TMA (one thread issues a whole tile), else none."""
    attr = kernel.attributes.get(tile.PRODUCER_WARPS)
    return attr.value.data if attr is not None and platforms.copy_mechanism(platform) == "tma" else 0


def kernel_configs(module: ModuleOp, platform: Platform, tensor_cores: bool = True) -> dict[str, target.KernelConfigAttr]:
    """The launch configuration of every tile.kernel of `module` on its `kernel_platform`:
    block = num_warps warps, shared = its tile.alloc_shared buffers (aligned),
    grid = its tile.launch's, regs = `estimate_regs`."""
    grids = _grids(module)
    configs = {}
    for kernel in (op for op in module.walk() if isinstance(op, tile.KernelOp)):
        name = kernel.sym_name.data
        if name not in grids:
            raise TargetLoweringError(f"kernel @{name} has no tile.launch in the module, so its grid is unknown")
        kp = _chosen_platform(kernel, platform, tensor_cores)
        align = _SHARED_ALIGN[platforms.copy_mechanism(kp)]
        warps = kernel.num_warps.value.data + producer_warps(kernel, kp)
        threads = warps * kp.warp_size
        if threads > kp.max_threads_per_block:
            raise TargetLoweringError(
                f"kernel @{name}: {warps} warps x {kp.warp_size} threads = {threads} threads, but "
                f"{kp.arch} allows {kp.max_threads_per_block} per block")
        buffers = _shared_bytes(kernel, align)
        shared = sum(size for _, size in buffers)
        if platforms.copy_mechanism(kp) == "tma":   # an 8-byte mbarrier per stage of each buffer (two when
            barriers = 2 if producer_warps(kernel, kp) else 1   # warp-specialized: data landed, stage free)
            shared += 8 * barriers * sum(t.get_shape()[0] for t, _ in buffers)
        if shared > kp.max_shared_per_block:
            shown = ", ".join(f"{t} = {size}" for t, size in buffers)
            raise TargetLoweringError(
                f"kernel @{name} needs {shared} bytes of shared memory ({shown}) but {kp.arch} allows "
                f"{kp.max_shared_per_block} per block; use fewer stages or smaller tiles")
        configs[name] = target.KernelConfigAttr.of(
            grids[name], (threads, 1, 1), shared, estimate_regs(kernel, threads, kp, producer_warps(kernel, kp)))
    return configs


# ---------------------------------------------------------------------------
# One pattern per tile op
# ---------------------------------------------------------------------------


@dataclass
class LowerKernel(RewritePattern):
    """tile.kernel -> tessera_target.kernel with its config and the platform it was lowered for; the body moves over."""

    configs: dict[str, target.KernelConfigAttr]
    platforms: dict[str, Platform]

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.KernelOp, rewriter: PatternRewriter) -> None:
        name = op.sym_name.data
        producers = producer_warps(op, self.platforms[name]) or None
        body = op.detach_region(op.body)
        rewriter.replace(op, target.KernelOp(
            name, op.function_type.inputs.data, self.configs[name], target.PlatformAttr.of(self.platforms[name]), body,
            producer_warps=producers))


class LowerReturn(RewritePattern):
    """tile.return -> tessera_target.return."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.ReturnOp, rewriter: PatternRewriter) -> None:
        rewriter.replace(op, target.ReturnOp())


@dataclass
class LowerMma(RewritePattern):
    """tile.mma -> tessera_target.tensor_core with the registry's best instruction
    for the operand dtype that covers the tile.

    A dtype with no matrix instruction at all on the platform (fp32, whose tensor-core
    path would silently be TF32) keeps its `tile.mma`. The CPU interpreter runs it
    exactly; the PTX backend has no CUDA-core matmul yet and raises
    `UnsupportedByBackend` for it."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.MmaOp, rewriter: PatternRewriter) -> None:
        dtype = str(op.a.type.get_element_type())
        if str(op.b.type.get_element_type()) != dtype:
            raise TargetLoweringError(f"tile.mma operands differ in element type: a is {op.a.type}, b is {op.b.type}")
        (m, k), (_, n) = op.a.type.get_shape(), op.acc.type.get_shape()
        instr = platforms.mma_instruction(self.platform, dtype, (m, n, k))
        if instr is None and not platforms.mma_instructions(self.platform, dtype):
            return
        if instr is None:
            have = ", ".join(f"{i.family} {list(i.shape)}" for i in platforms.mma_instructions(self.platform, dtype))
            raise TargetLoweringError(
                f"tile.mma {m}x{n}x{k} on {dtype}: {self.platform.arch} has no matrix instruction that covers it"
                f" ({'its ' + dtype + ' instructions: ' + have if have else 'no ' + dtype + ' matrix instructions'})")
        layout = "nt" if op.transpose_b is not None else "nn"
        rewriter.replace(op, target.TensorCoreOp(
            instr.family, op.a, op.b, op.acc, instr.fit((m, n, k)), layout, instr.operand))


@dataclass
class LowerAllocShared(RewritePattern):
    """tile.alloc_shared -> tessera_target.allocate pool = "shared"."""

    align: int

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AllocSharedOp, rewriter: PatternRewriter) -> None:
        t: MemRefType = op.result.type
        rewriter.replace(op, target.AllocateOp(t, "shared", target.memref_bytes(t), self.align))


@dataclass
class LowerCopyAsync(RewritePattern):
    """tile.copy_async -> tessera_target.memcpy global_to_shared, async, with the
    registry's mechanism for its padding; tile_dims, padding and offsets carry
    over so the emitter can address the tile."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.CopyAsyncOp, rewriter: PatternRewriter) -> None:
        mechanism = platforms.copy_mechanism(self.platform, op.padding.value.data)
        rewriter.replace(op, target.MemcpyOp(
            op.dst, [op.stage], op.src, op.offsets, "global_to_shared", True, mechanism,
            tuple(op.tile_dims.get_values()), op.padding))


#: What closes a group of async copies, per copy mechanism: TMA copies of one group
#: complete on their stage's mbarrier (armed with the group's byte count), cp.async
#: copies form a commit group, plain loads are done when issued.
_COMMIT = {"tma": "mbarrier.arrive.expect_tx", "cp.async": "cp.async.commit_group", "ld.global": None}


@dataclass
class LowerAsyncCommit(RewritePattern):
    """tile.async_commit -> the mechanism's way of closing a group of copies (`_COMMIT`)."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AsyncCommitOp, rewriter: PatternRewriter) -> None:
        instruction = _COMMIT[platforms.copy_mechanism(self.platform)]
        if instruction:
            rewriter.replace(op, target.PTXInstrOp(instruction))
        else:
            rewriter.erase(op)


@dataclass
class LowerAsyncWait(RewritePattern):
    """tile.async_wait -> tessera_target.sync scope = "async_group" pending = N; with TMA,
    sync scope = "mbarrier": the stage read next waits for its mbarrier's phase."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.AsyncWaitOp, rewriter: PatternRewriter) -> None:
        if platforms.copy_mechanism(self.platform) == "tma":
            rewriter.replace(op, target.SyncOp("mbarrier"))
        else:
            rewriter.replace(op, target.SyncOp("async_group", op.pending.value.data))


@dataclass
class LowerMmaWait(RewritePattern):
    """tile.mma_wait -> tessera_target.sync scope = "mma_group" where mmas run asynchronously
    (wgmma); elsewhere they are done when issued and the wait goes."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.MmaWaitOp, rewriter: PatternRewriter) -> None:
        if self.platform.has("wgmma"):
            rewriter.replace(op, target.SyncOp("mma_group", op.pending.value.data))
        else:
            rewriter.erase(op)


@dataclass
class LowerBarrier(RewritePattern):
    """tile.barrier -> tessera_target.sync scope = "block". With TMA, the stage's mbarrier publishes
    the copied data to every thread that waits on it, so a barrier that only publishes copies (right
    after a tile.async_wait, not followed by copies into a stage it frees) goes.

    Measured on an H100 (bench/run_all.py): dropping it gives the native GEMM +17% and attention
    +4-10%; replacing the block barrier before a refill by per-warpgroup releases (the last
    warpgroup done with a stage issues its copies) lost 15% on GEMM and 8% on causal attention."""

    platform: Platform

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.BarrierOp, rewriter: PatternRewriter) -> None:
        if platforms.copy_mechanism(self.platform) == "tma" and _publishes_copies(op) and not _guards_refill(op):
            rewriter.erase(op)
        else:
            rewriter.replace(op, target.SyncOp("block"))


def _publishes_copies(op: tile.BarrierOp) -> bool:
    """Whether `op` directly follows a tile.async_wait (or its lowering, a sync)."""
    return isinstance(op.prev_op, (tile.AsyncWaitOp, target.SyncOp))


def _guards_refill(op: tile.BarrierOp) -> bool:
    """Whether the next tile op after `op` (index arithmetic aside) is a copy into shared memory."""
    nxt = op.next_op
    while nxt is not None and nxt.dialect_name() == "arith":
        nxt = nxt.next_op
    return isinstance(nxt, tile.CopyAsyncOp)


@dataclass
class LowerLaunch(RewritePattern):
    """tile.launch -> tessera_target.launch with the kernel's grid, block and shared."""

    configs: dict[str, target.KernelConfigAttr]

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: tile.LaunchOp, rewriter: PatternRewriter) -> None:
        cfg = self.configs[op.kernel.string_value()]
        rewriter.replace(op, target.LaunchOp(
            op.kernel.string_value(), op.args, cfg.grid_dims, cfg.block_dims, cfg.shared.data))


def patterns(platform: Platform, tensor_cores: bool = True) -> Iterable[RewritePattern]:
    """The rewrite patterns for the ops inside a kernel lowered for `platform`; without
    `tensor_cores`, every tile.mma stays on the CUDA cores."""
    return (
        LowerReturn(), *([LowerMma(platform)] if tensor_cores else []),
        LowerAllocShared(_SHARED_ALIGN[platforms.copy_mechanism(platform)]), LowerCopyAsync(platform),
        LowerAsyncCommit(platform), LowerAsyncWait(platform), LowerMmaWait(platform), LowerBarrier(platform),
    )


def _rewrite(patterns_: Iterable[RewritePattern], region) -> None:
    PatternRewriteWalker(GreedyRewritePatternApplier(list(patterns_))).rewrite_region(region)


def lower_tile_to_target(module: ModuleOp, platform: Platform | str, *, tensor_cores: bool = True) -> ModuleOp:
    """A Target IR copy of the tile module `module` for `platform` (a Platform or
    an arch name); `module` itself is left unchanged."""
    p = platform if isinstance(platform, Platform) else platforms.get(platform)
    lowered = module.clone()
    configs = kernel_configs(lowered, p, tensor_cores)
    kernels = [op for op in lowered.ops if isinstance(op, tile.KernelOp)]
    chosen = {k.sym_name.data: _chosen_platform(k, p, tensor_cores) for k in kernels}
    for kernel in kernels:
        _rewrite(patterns(chosen[kernel.sym_name.data], tensor_cores), kernel.body)
    _rewrite([LowerKernel(configs, chosen), LowerLaunch(configs)], lowered.body)
    return lowered
