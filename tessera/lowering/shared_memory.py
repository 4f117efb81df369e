"""The shared-memory allocation pass: where every byte of a kernel's shared memory goes.

`allocate_shared` places, in the kernel's dynamic shared memory and in this order:

1. the tile buffers (`allocate pool = "shared"`), each at the alignment and in the layout
   (`swizzle`) of the mechanism whose copies fill it (`SHARED_LAYOUT`, chosen when
   `tile.alloc_shared` is lowered);
2. the mbarriers (`mbarrier_alloc`, 8 bytes each);
3. the scratch ops need for themselves, written on the op as `tessera_target.scratch`:
   a row reduction whose rows span warps exchanges the warps' partials through it, a cluster
   gather receives every block's values there, with the mbarrier they complete (a region no
   other op shares: the other blocks write into it while this one runs on), and an accumulator
   tile stored through a shared buffer per warp (`tessera_target.staging`, where
   this pass decides to stage it: `staging_for`) writes its fragments there.

The total is the kernel's `shared` (its config and its launches'); the PTX backend declares
it as is and addresses every buffer from the offsets written here, so no shared memory exists
that a dump of Target IR does not show.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import IntegerAttr, MemRefType, i64
from xdsl.ir import Operation, SSAValue

from .. import platforms
from ..ir import index_facts
from ..ir import target
from ..ir import tile
from ..ir.layouts import Blocked, Layout, Mma
from ..platforms import Platform
from ..runtime.tensor_maps import NARROW_ROW_BYTES, box_row_bytes
from . import TargetLoweringError


#: How a shared tile buffer is laid out, per the mechanism that fills it: (alignment, swizzle).
#: TMA writes [rows, 64] boxes in its 128-byte swizzle, which repeats every 1024 bytes (and is
#: what wgmma's descriptors read); threads write 16-byte chunks XOR-swizzled by row, which ldmatrix
#: reads without bank conflicts.
SHARED_LAYOUT = {"tma": (1024, "tma_128b"), "cp.async": (128, "xor_16b"), "ld.global": (16, "xor_16b")}


def shared_layout(mechanism: str, t: MemRefType) -> tuple[int, str]:
    """(alignment, swizzle) of a shared tile buffer of type `t` ([stages, rows, cols]) that
    `mechanism`'s copies fill: SHARED_LAYOUT's, TMA's 64-byte swizzle for a tile of narrow box rows
    (`tensor_maps.box_row_bytes`)."""
    align, swizzle = SHARED_LAYOUT[mechanism]
    if swizzle == "tma_128b" and t.get_num_dims() == 3:
        element_bytes = max(1, t.get_element_type().bitwidth // 8)
        if box_row_bytes(t.get_shape()[2], element_bytes) == NARROW_ROW_BYTES:
            swizzle = "tma_64b"
    return align, swizzle

#: Stores are staged through shared memory in kernels whose copies use this mechanism (the native
#: path's), where the buffers leave the blocks per SM as they were: a persistent GEMM's one block
#: per SM idles its tensor cores while it stores. The mma.sync path runs several blocks per SM,
#: which hide one another's stores (measured there: within 2%, on an H100).
STAGED_STORE_MECHANISM = "tma"


@dataclass(frozen=True)
class Staging:
    """How an accumulator tile is stored through a warp's own shared buffer: `cols` columns at
    a time (one 128-byte row when the warp tile is that wide), each buffer row `pitch` bytes (16
    more than it holds, so the fragments' eight rows fall in different banks), read back as
    16-byte vectors of `vec` elements, `lanes_per_row` lanes to a row."""

    cols: int
    pitch: int
    vec: int
    lanes_per_row: int

    @property
    def buffer_bytes(self) -> int:
        return 16 * self.pitch

    @staticmethod
    def of(elem_bytes: int, warp_cols: int) -> Staging | None:
        """The staging of a warp's 16-row slab `warp_cols` wide, or None where its rows are not
        whole 16-byte vectors spread over a power-of-two number of lanes."""
        vec = 16 // elem_bytes
        cols = min(128 // elem_bytes, warp_cols)
        lanes_per_row = cols // vec
        if cols % vec or warp_cols % cols or lanes_per_row < 2 or 32 % lanes_per_row:
            return None
        return Staging(cols, cols * elem_bytes + 16, vec, lanes_per_row)

    @staticmethod
    def of_attr(attr: target.StagingAttr, elem_bytes: int) -> Staging:
        """The staging an IR attribute describes, for elements of `elem_bytes`."""
        vec = 16 // elem_bytes
        cols = attr.cols.data
        return Staging(cols, attr.pitch.data, vec, cols // vec)


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _elem_bytes(v: SSAValue) -> int:
    return max(1, v.type.get_element_type().bitwidth // 8)


def _exchange_bytes(op: tile.ReduceOp, layouts: dict[SSAValue, Layout]) -> int:
    """Bytes a reduction exchanges between warps (4 per kept row or column per warp along the
    reduced axis), 0 where what is reduced stays inside one warp."""
    src, axis = layouts.get(op.x), op.axis.value.data
    if not isinstance(src, Blocked) or src.warps_along(axis) <= 1:
        return 0
    kept = 1 - axis
    return 4 * src.cover[kept] * src.reps[kept] * src.warps_along(axis)


def cluster_exchange_rows(layout: Layout) -> int:
    """The rows a cluster gather's 1-D tile spans in its layout (its parent's cover along the
    kept dim, padding included): each block's values take 4 bytes a row in every block's scratch."""
    parent = layout.parent
    return parent.cover[layout.keep] * parent.reps[layout.keep]


#: a cluster gather's mbarrier a buffer (the values it receives complete its phase)
CLUSTER_MBARRIER_BYTES = 8


def cluster_exchange_bytes(op: tile.ClusterGatherOp, layouts: dict[SSAValue, Layout], cluster: int) -> int:
    """A cluster gather's mbarrier and buffer (4 bytes a row of each operand from each of the
    `cluster` blocks), twice over where it is `target.DOUBLE_BUFFERED`: the mbarriers first."""
    buffer = 4 * sum(cluster_exchange_rows(layouts[x]) for x in op.xs) * cluster
    return (CLUSTER_MBARRIER_BYTES + buffer) * (2 if target.DOUBLE_BUFFERED in op.attributes else 1)


def staging_for(op: tile.StoreOp, layouts: dict[SSAValue, Layout], platform: Platform, used: int,
                storing_warps: int) -> Staging | None:
    """A Staging for storing an mma accumulator tile with 16-byte row-contiguous stores, or None
    where the direct per-fragment stores stay: another layout, a row that is not a whole number
    of 16-byte vectors, or buffers that would exceed the platform's shared memory or lower the
    blocks per SM below what `used` bytes allow (attention's two per SM already overlap one's
    stores with the other's work).

    Why: a fragment store writes 4 (fp16) or 8 (fp32) bytes per thread, eight rows per
    instruction: half-filled sectors, and many more memory instructions than the bytes need. A
    persistent GEMM's block stores each tile in a burst while its tensor cores wait; staged, the
    stores are fewer, whole lines, and quickly off the warp's hands."""
    layout, shape = layouts.get(op.value), op.dst.type.get_shape()
    elem = _elem_bytes(op.value)
    if (not isinstance(layout, Mma) or platforms.copy_mechanism(platform) != STAGED_STORE_MECHANISM
            or list(tile.int_values(op.tile_dims)) != [len(shape) - 2, len(shape) - 1] or elem not in (2, 4)):
        return None
    staging = Staging.of(elem, layout.warp_tile[1])
    if (staging is None or shape[-1] == tile.DYNAMIC or shape[-1] % staging.vec
            or not tile.rows_aligned(op.dst.type, staging.vec)
            or index_facts.known_multiple(list(op.offsets)[-1]) % staging.vec):   # 16-byte aligned columns
        return None
    staged = _align_up(used, 16) + storing_warps * staging.buffer_bytes
    if (staged > platform.max_shared_per_block
            or platforms.blocks_per_sm_by_shared(platform, staged) < platforms.blocks_per_sm_by_shared(platform, used)):
        return None
    return staging


def bulk_reduction_pitch(op: tile.AtomicAddOp, layouts: dict[SSAValue, Layout], platform: Platform) -> int | None:
    """The row pitch of the shared buffer an atomic add of an accumulator tile goes through, as one
    bulk reduction of the whole tile (`cp.reduce.async.bulk .add.f32`: the copy engine adds it in
    L2), or None where each thread's `red`s stay: no bulk copies on the platform, or a tile that is
    not whole rows of its destination (over its last two dims, either order, the rows contiguous:
    a tile is then one run of memory, and its buffer holds it as laid out there) but for at most
    16 bytes a row, which the buffer holds as zeros (a padded destination: an across sum's, whose
    padding puts a warp's rows in different banks).

    Why: the attention backward's dQ sums take 8.6 GB of fp32 adds at B=8 H=16 S=4096 D=128 (a
    [64, 128] block a step per 128-key block); issued as `red.global.add.v2.f32` by the warps
    computing, they stalled them: the kernel took 6.44 ms on an H200, 3.82 without the adds and
    5.75 with plain stores in their place; a bulk reduction a row took 6.73 (bench/RESULTS.md,
    session 33)."""
    layout, shape = layouts.get(op.value), op.dst.type.get_shape()
    rank, tile_dims = len(shape), list(tile.int_values(op.tile_dims))
    if not platform.has("tma") or not isinstance(layout, Mma) or sorted(tile_dims) != [rank - 2, rank - 1] \
            or tile.is_strided(op.dst.type) or index_facts.constant_value(list(op.offsets)[-1]) != 0:
        return None
    cols, row = layout.shape[tile_dims.index(rank - 1)], shape[-1]
    return row * 4 if row != tile.DYNAMIC and row % 4 == 0 and 0 <= row - cols <= 4 else None


def _place(op: Operation, total: int, size: int, align: int) -> int:
    """Writes the op's scratch at the next `align`ed byte; returns the new total."""
    offset = _align_up(total, align)
    op.attributes[target.SCRATCH] = target.ScratchAttr.of(offset=offset, size=size)
    return offset + size


def _place_scratch(kernel, platform: Platform, layouts: dict[SSAValue, Layout], storing_warps: int,
                   total: int) -> int:
    """Scratch for cross-warp reductions, staged stores and bulk-reduced atomic adds, in program
    order (a store is staged only where the shared memory placed before it leaves room)."""
    for op in kernel.walk():
        if isinstance(op, tile.ReduceOp) and (size := _exchange_bytes(op, layouts)):
            total = _place(op, total, size, 4)
        elif isinstance(op, tile.ClusterGatherOp):
            total = _place(op, total, cluster_exchange_bytes(op, layouts, tile.cluster_size(kernel)), 8)
        elif isinstance(op, tile.StoreOp) and (st := staging_for(op, layouts, platform, total, storing_warps)):
            op.attributes[target.STAGING] = target.StagingAttr.of(cols=st.cols, pitch=st.pitch)
            total = _place(op, total, storing_warps * st.buffer_bytes, 16)
        elif isinstance(op, tile.AtomicAddOp) and (pitch := bulk_reduction_pitch(op, layouts, platform)):
            rank = op.dst.type.get_num_dims()
            rows = layouts[op.value].shape[list(tile.int_values(op.tile_dims)).index(rank - 2)]
            if _align_up(total, 16) + rows * pitch <= platform.max_shared_per_block:   # (else the `red`s)
                op.attributes[target.STAGING] = target.StagingAttr.of(cols=pitch // 4, pitch=pitch)
                total = _place(op, total, rows * pitch, 16)
    return total


def allocate_shared(kernel, platform: Platform, layouts: dict[SSAValue, Layout] | None = None,
                    storing_warps: int = 0) -> int:
    """The pass (see the module docstring) over a kernel whose tile ops are lowered: writes each
    claim's offset and returns the total. Scratch is placed only where `layouts` (the
    assign-layouts pass's, with `storing_warps` warps holding tiles) are given."""
    total, buffers = 0, []
    for op in kernel.body.block.ops:
        if isinstance(op, target.AllocateOp) and op.pool.data == "shared":
            offset = _align_up(total, op.align.value.data)
            op.properties["offset"] = IntegerAttr(offset, i64)
            total = offset + op.size.value.data
            buffers.append(f"{op.result.type} = {op.size.value.data}")
    for op in kernel.walk():
        if isinstance(op, target.MBarrierAllocOp):
            offset = _align_up(total, 8)
            op.properties["offset"] = IntegerAttr(offset, i64)
            total = offset + 8 * op.result.type.count.data
    if layouts is not None:
        before = total
        total = _place_scratch(kernel, platform, layouts, storing_warps, total)
        if total > before:
            buffers.append(f"scratch = {total - before}")
    if total > platform.max_shared_per_block:
        raise TargetLoweringError(
            f"kernel @{kernel.sym_name.data} needs {total} bytes of shared memory ({', '.join(buffers)}) but "
            f"{platform.arch} allows {platform.max_shared_per_block} per block; use fewer stages or smaller tiles")
    return total
