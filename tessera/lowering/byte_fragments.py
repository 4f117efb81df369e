"""Which key copies load their rows permuted, so that fp8 attention's probabilities need no
exchange between lanes on their way into the second product.

An 8-bit mma (k 32) reads its A operand from registers as four consecutive k per lane in each 16,
while the accumulator layout of the scores before it gives a lane two consecutive columns in each
8: narrowed to 8 bits as they are, the probabilities cross lanes (`tensor_core._byte_a_fragments`:
8 shuffles and 4 permutes per 32 keys of 16 rows, 62 SHFLs of a warp's ~690 softmax instructions
per 256-key block at 8x16x4096x128 on an H200, bench/RESULTS.md session 47). Loading each 16 keys
permuted (box row 16h + 8g + 2t + e holds key 16h + 4t + 2g + e: `TensorMapType.byte_a_rows`) puts
every lane's columns where the A fragment wants them; the scores' tile then has the `Mma.byte_a`
layout, whose column offsets say which key each register holds, so masks, the key tail and
anything else computed from a column index stay right, and V needs no change. (FlashAttention-3
permutes V instead; V^T's keys are its contiguous dim, which a TMA box cannot permute.)

Measured (H200, fp8, bench/RESULTS.md session 48): without turns, causal at 8x16x4096x128
0.801 -> 0.770 ms (bench/fp8_attention.py); compiled for their shape (bench/fp8_attention_specialized.py)
32x12x2048x128 713 -> 681 us, 4x16x8192x128 1485 -> 1431, 16x16x2048x64 372 -> 364. Where the computing warpgroups take turns at their products (`tile.mma_turn`) it
lost, 1360 -> 1391 us at 8x16x4096x128 and 2627 -> 2782 at 4x16x8192x128: the stall samples moved
to the turn's barrier, which ptxas placed about 380 instructions before the second product instead
of 115, the softmax's tail after it. Making the barrier's id depend on the row sums (a dependency
ptxas cannot drop) moved it back after the exponentials and the time back to the exchanges' (1332
against 1333 us), no further: with turns the softmax hides behind the other warpgroup's products.
So kernels with turns keep the exchanges.

It applies where every piece holds: the kernel has no turns; the copies are TMA boxes of whole
stages from a static tensor whose rows are one evenly strided run (`rows_are_one_run`: the boxes
then read it as five dims), 16-aligned along the keys; the key buffer feeds only the product that
computes the scores, which is the only product of its tile shape (an output of the same shape
would share its layout); and no tile of that shape, or of one of its columns, moves to or from
memory, where code that assumes the plain accumulator order would handle it.
"""
from __future__ import annotations

import math

from xdsl.dialects.builtin import MemRefType, TensorType, UnitAttr
from xdsl.ir import Operation, SSAValue

from ..ir import index_facts, target, tile
from ..platforms import Platform, copy_mechanism

#: a copy_async whose keys are loaded permuted (`permuted_key_copies`; `async_pipelines` reads it)
BYTE_A_ROWS = "tessera_target.byte_a_rows"

#: tile ops that move a register tile to or from memory
_MEMORY_OPS = (tile.LoadOp, tile.LoadIndexOp, tile.LoadIndexReduceOp, tile.LoadGatherOp, tile.StoreOp,
               tile.AtomicAddOp, tile.StoreSharedOp, tile.ClusterGatherOp)


def mark_permuted_key_copies(kernel: tile.KernelOp, platform: Platform) -> None:
    """Marks (`BYTE_A_ROWS`) the copies whose keys load permuted."""
    for op in permuted_key_copies(kernel, platform):
        op.attributes[BYTE_A_ROWS] = UnitAttr()


def permuted_key_copies(kernel: tile.KernelOp, platform: Platform) -> list[tile.CopyAsyncOp]:
    """The copies of key tiles to load in 8-bit A order (see the module docstring)."""
    if copy_mechanism(platform) != "tma" or any(isinstance(op, tile.MmaTurnOp) for op in kernel.walk()):
        return []
    mmas = [op for op in kernel.walk() if isinstance(op, tile.MmaOp)]
    out: list[tile.CopyAsyncOp] = []
    for second in mmas:
        a = second.a
        if isinstance(a.owner, tile.LoadSharedOp) or a.type.get_element_type().bitwidth != 8:
            continue
        shape = tuple(a.type.get_shape())
        producers = [m for m in mmas if tuple(m.result.type.get_shape()) == shape]
        if len(producers) != 1 or shape[1] % 16 or _moves_through_memory(kernel, shape):
            continue
        copies = _key_copies(producers[0])
        if copies and all(_whole_run_of_keys(c) for c in copies):
            out.extend(copies)
    return out


def _key_copies(scores: tile.MmaOp) -> list[tile.CopyAsyncOp] | None:
    """The copies filling the buffer of the scores' keys (their product's B, rows = keys), if that
    buffer is read by this product alone."""
    if scores.transpose_b is None or not isinstance(scores.b.owner, tile.LoadSharedOp):
        return None
    buffer = scores.b.owner.src
    readers = [u.operation for u in buffer.uses if isinstance(u.operation, tile.LoadSharedOp)]
    if any(u.operation is not scores for r in readers for u in r.result.uses):
        return None
    return [u.operation for u in buffer.uses
            if isinstance(u.operation, tile.CopyAsyncOp) and u.operation.dst is buffer]


def _whole_run_of_keys(op: tile.CopyAsyncOp) -> bool:
    """A TMA copy of a whole stage, rows 16-aligned along a static tensor's rows that are one run
    (of fewer than 2^31 groups of 16: the 32-bit coordinates of `async_pipelines._byte_a_coords`)."""
    t: MemRefType = op.src.type
    rank = t.get_num_dims()
    rows = op.dst.type.get_shape()[1]
    return (op.dst_rows is None and op.cluster_shared is None and op.padding.value.data == 0.0
            and list(tile.int_values(op.tile_dims)) == [rank - 2, rank - 1] and target.rows_are_one_run(t)
            and t.get_shape()[-2] % 16 == 0 and rows % 16 == 0 and math.prod(t.get_shape()[:-1]) < 2 ** 35
            and index_facts.known_multiple(list(op.offsets)[-2]) % 16 == 0)


def _moves_through_memory(kernel: tile.KernelOp, shape: tuple[int, int]) -> bool:
    """Whether a register tile of `shape`, or one of its columns, is loaded or stored."""
    def touches(op: Operation) -> bool:
        values: list[SSAValue] = [*op.operands, *op.results]
        return any(isinstance(v.type, TensorType) and tuple(v.type.get_shape()) in (shape, (shape[1],))
                   for v in values)
    return any(touches(op) for op in kernel.walk()
               if isinstance(op, _MEMORY_OPS) or (isinstance(op, tile.LoadSharedOp) and op.into_registers))


def byte_a_shapes(kernel) -> set[tuple[int, int]]:
    """The tile shapes of a Target IR kernel computed over permuted keys: the results of products
    whose B is read from a buffer the permuted maps (`TensorMapOp.byte_a_rows`) fill, through a
    wgmma descriptor or a load of shared tiles (mma.sync's fragments have the same accumulator and
    8-bit A layouts). The layout pass gives them `Mma.byte_a`."""
    buffers = {op.dst for op in kernel.walk() if isinstance(op, target.TmaLoadOp)
               and op.tensor_map.owner.byte_a_rows is not None}
    return {tuple(op.result.type.get_shape()) for op in kernel.walk()
            if isinstance(op, target.TensorCoreOp) and _shared_source(op.b) in buffers}


def _shared_source(v: SSAValue) -> SSAValue | None:
    """The shared buffer an mma operand is read from, if it is."""
    if isinstance(v.owner, target.WgmmaDescriptorOp):
        return v.owner.buffer
    if isinstance(v.owner, tile.LoadSharedOp):
        return v.owner.src
    return None
