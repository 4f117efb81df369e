"""The Hopper-native path (sm_90a): TMA copies completing on mbarriers, wgmma from shared memory.

Target IR chooses it per kernel (`lowering.tile_to_target.kernel_platform`); the
Tile IR pipeline is the same one the Ampere path runs, only its ops mean more:

* `allocate` gives a `TmaBuffer`: a [rows, cols] tile stored as boxes 64 16-bit
  elements (one 128-byte row) wide, each [rows, 64] box in TMA's 128-byte swizzle
  (16-byte chunk c of row r at chunk c ^ (r % 8)), boxes one after another, each
  stage 1024-byte aligned. That is the canonical layout wgmma reads through a
  matrix descriptor, so no thread ever touches the tile.
* `memcpy mechanism = "tma"` issues one `cp.async.bulk.tensor` per box from a
  tensor map the runtime encodes for the kernel argument (`TensorMapSpec`, passed
  by value as a 128-byte `.param`). Boxes wholly outside the tensor are skipped;
  partial ones are zero-filled by the copy engine.
* `ptx_instr "mbarrier.arrive.expect_tx"` closes the group of copies into one
  stage: thread 0 arms the stage's mbarrier with the group's bytes, then issues
  the copies, which complete on it.
* `sync scope = "mbarrier"` makes the next read of a stage wait for its
  mbarrier's current phase (one phase bit per stage, flipped per wait).
* `tensor_core "wgmma"` issues `wgmma.mma_async` m64nNk16 per warpgroup (warpgroup
  g computes accumulator rows 64g..64g+63: the Mma layout with every warp along
  M), updating the accumulator registers in place, and commits them as a group;
  `sync scope = "mma_group" pending = N` (a `tile.mma_wait`) waits for the groups,
  or, in a kernel without such waits, each group is waited for where it is issued.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import target as tgt
from ...ir import tile as t
from .emitter import F32, PRED, S32, SYNC, U64, KernelEmitter, TensorMapSpec, UnsupportedByBackend
from .layout import Mma
from .tensor_core import BEFORE_READ, BUFFERS, COPIES, FAMILIES, INSTRUCTIONS, SMEM_SYMBOL, SharedTile, stage_address

#: bytes of one TMA box row and of the swizzle pattern's repeat (8 rows)
ROW_BYTES = 128
SWIZZLE_ATOM = 8 * ROW_BYTES
#: wgmma descriptor fields: bits 16-29 leading byte offset, 32-45 stride byte offset, 62-63 swizzle (1 = 128B)
SWIZZLE_128B = 1 << 62


@dataclass(frozen=True)
class TmaBuffer:
    """A [stages, rows, cols] tile buffer filled by TMA boxes 128 bytes wide (see the module docstring)."""

    offset: int
    stages: int
    rows: int
    cols: int
    elem: int

    @property
    def box_cols(self) -> int:
        return ROW_BYTES // self.elem

    @property
    def boxes(self) -> int:
        return self.cols // self.box_cols

    @property
    def box_bytes(self) -> int:
        return self.rows * ROW_BYTES

    @property
    def stage_bytes(self) -> int:
        return -(-self.boxes * self.box_bytes // SWIZZLE_ATOM) * SWIZZLE_ATOM

    @property
    def size(self) -> int:
        return self.stages * self.stage_bytes

    def start(self, row: int, col: int) -> int:
        """Byte offset in a stage of the 16-byte chunk holding element (row, col), before swizzling:
        where a descriptor of a sub-tile starting there points (row a multiple of 8)."""
        return (col // self.box_cols) * self.box_bytes + row * ROW_BYTES + (col % self.box_cols) * self.elem


@dataclass
class Pipeline:
    """The kernel's mbarriers (one per stage, in dynamic shared memory after the tiles), the
    phase bit of each, the copies of the group being issued, and whether a wait is due."""

    barriers: str                    # register: shared address of stage 0's mbarrier
    phase: str                       # register: bit s = parity of stage s's next phase
    leader: str                      # predicate: thread 0, which arms barriers and issues copies
    group: list                      # [(stage register, predicate, PTX copy, bytes)]
    waiting: bool = False


def _pipeline(e: KernelEmitter, stages: int) -> Pipeline:
    """Created at the first TMA copy: mbarriers initialised at the kernel's entry, before any copy."""
    if "pipeline" in e.state:
        return e.state["pipeline"]
    offset = -(-e.smem_bytes // 8) * 8
    e.smem_bytes = offset + 8 * stages
    tid, leader, barriers, phase, misaligned = e.new(S32), e.new(PRED), e.new(S32), e.new(S32), e.new(PRED)
    low = e.new(S32)
    e.at_entry(f"mov.u32 {tid}, %tid.x;")
    e.at_entry(f"setp.eq.u32 {leader}, {tid}, 0;")
    e.at_entry(f"mov.u32 {barriers}, {SMEM_SYMBOL};")
    e.at_entry(f"and.b32 {low}, {barriers}, {SWIZZLE_ATOM - 1};")
    e.at_entry(f"setp.ne.u32 {misaligned}, {low}, 0;")
    e.at_entry(f"@{misaligned} trap;")   # the swizzle is on address bits: tiles must sit on 1024-byte lines
    e.at_entry(f"add.u32 {barriers}, {barriers}, {offset};")
    for s in range(stages):
        e.at_entry(f"@{leader} mbarrier.init.shared::cta.b64 [{barriers}+{8 * s}], 1;")
    e.at_entry("fence.mbarrier_init.release.cluster;")
    e.at_entry("bar.sync 0;")
    e.at_entry(f"mov.u32 {phase}, 0;")
    e.smem_align = max(e.smem_align, SWIZZLE_ATOM)
    e.state["pipeline"] = Pipeline(barriers, phase, leader, [])
    return e.state["pipeline"]


def _tensor_map(e: KernelEmitter, spec: TensorMapSpec) -> str:
    """The generic address of the kernel's tensor-map parameter for `spec` (one per distinct spec)."""
    maps = e.state.setdefault("tensor_map_regs", {})
    if spec not in maps:
        name = f"{e.name}_tmap_{len(e.tensor_maps)}"
        e.tensor_maps.append(spec)
        e.extra_params.append(f"    .param .align 64 .b8 {name}[128]")
        raw, generic = e.new(U64), e.new(U64)
        e.at_entry(f"mov.u64 {raw}, {name};")
        e.at_entry(f"cvta.param.u64 {generic}, {raw};")
        maps[spec] = generic
    return maps[spec]


def _tma_copy(e: KernelEmitter, op: tgt.MemcpyOp) -> None:
    """One box copy per 128-byte column block of the tile, queued until the group's arrive."""
    buf: TmaBuffer = e.env[op.dst]
    (stage,) = [e.value(v) for v in op.dst_indices]
    src = op.src
    shape = tuple(src.type.get_shape())
    rank = len(shape)
    row_dim, _ = t.int_values(op.tile_dims)
    box = tuple(buf.rows if d == row_dim else buf.box_cols if d == rank - 1 else 1 for d in range(rank))
    spec = TensorMapSpec(src.index, str(src.type.get_element_type()), shape, box)
    tmap = _tensor_map(e, spec)
    pipe = _pipeline(e, buf.stages)
    offsets = [e.value(v) for v in op.src_indices]
    base = stage_address(e, buf, stage)
    for j in range(buf.boxes):
        inner = e.new(S32)
        e.emit(f"add.s32 {inner}, {offsets[-1]}, {j * buf.box_cols};")
        coords = [*offsets[:-1], inner]
        inside = e.new(PRED)
        e.emit(f"setp.lt.and.s32 {inside}, {coords[0]}, {shape[0]}, {pipe.leader};")
        for c, size in zip(coords[1:], shape[1:]):
            e.emit(f"setp.lt.and.s32 {inside}, {c}, {size}, {inside};")
        listed = ", ".join(reversed(coords))
        copy = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                f"[{base}+{j * buf.box_bytes}], [{tmap}, {{{listed}}}], [%BAR%];")
        pipe.group.append((stage, inside, copy, buf.box_bytes))


def _arrive_expect_tx(e: KernelEmitter, op: tgt.PTXInstrOp) -> None:
    """Closes a group: thread 0 arms the stage's mbarrier with the bytes of its boxes inside the
    tensor, then issues them."""
    pipe: Pipeline = e.state["pipeline"]
    stages = {stage for stage, *_ in pipe.group}
    if len(stages) != 1:
        raise UnsupportedByBackend("PTX backend: a group of TMA copies must fill one stage")
    barrier, total = e.new(S32), e.new(S32)
    e.emit(f"mad.lo.s32 {barrier}, {stages.pop()}, 8, {pipe.barriers};")
    e.emit(f"mov.s32 {total}, 0;")
    for _, inside, _, nbytes in pipe.group:
        part = e.new(S32)
        e.emit(f"selp.b32 {part}, {nbytes}, 0, {inside};")
        e.emit(f"add.s32 {total}, {total}, {part};")
    e.emit(f"@{pipe.leader} mbarrier.arrive.expect_tx.shared::cta.b64 _, [{barrier}], {total};")
    for _, inside, copy, _ in pipe.group:
        e.emit(f"@{inside} {copy.replace('%BAR%', barrier)}")
    pipe.group.clear()


def _mbarrier_sync(e: KernelEmitter, op: tgt.SyncOp) -> None:
    e.state["pipeline"].waiting = True


def _wait_for_stage(e: KernelEmitter, tile_: SharedTile) -> None:
    """The first read of a stage after a `sync mbarrier` waits for the stage's phase, then flips its bit."""
    pipe: Pipeline = e.state["pipeline"]
    if not pipe.waiting:
        return
    pipe.waiting = False
    barrier, parity, bit, one, done = e.new(S32), e.new(S32), e.new(S32), e.new(S32), e.new(PRED)
    e.emit(f"mad.lo.s32 {barrier}, {tile_.stage}, 8, {pipe.barriers};")
    e.emit(f"bfe.u32 {parity}, {pipe.phase}, {tile_.stage}, 1;")
    again = e.label("wait")
    e.lines.append(f"{again}:")
    e.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{barrier}], {parity};")
    e.emit(f"@!{done} bra {again};")
    e.emit(f"mov.b32 {one}, 1;")
    e.emit(f"shl.b32 {bit}, {one}, {tile_.stage};")
    e.emit(f"xor.b32 {pipe.phase}, {pipe.phase}, {bit};")


# --- wgmma -----------------------------------------------------------------------------------------

def _descriptor(e: KernelEmitter, tile_: SharedTile, k_major: bool, extra: str | None = None) -> str:
    """The 64-bit matrix descriptor of a stage (plus `extra` bytes, a register), without per-step
    offsets: 128-byte swizzle; 8-row groups 1024 bytes apart (stride byte offset); for operands
    stored M/N-major, 64-element column blocks one box apart (leading byte offset)."""
    buf: TmaBuffer = tile_.buffer
    addr = stage_address(e, buf, tile_.stage)
    if extra is not None:
        e.emit(f"add.s32 {addr}, {addr}, {extra};")
    leading = 1 if k_major else buf.box_bytes >> 4
    fields = SWIZZLE_128B | ((SWIZZLE_ATOM >> 4) << 32) | (leading << 16)
    desc = e.new(U64)
    e.emit(f"cvt.u64.u32 {desc}, {addr};")
    e.emit(f"shr.u64 {desc}, {desc}, 4;")
    e.emit(f"or.b64 {desc}, {desc}, {fields};")
    return desc


def _step(e: KernelEmitter, desc: str, byte_offset: int) -> str:
    if byte_offset == 0:
        return desc
    r = e.new(U64)
    e.emit(f"add.s64 {r}, {desc}, {byte_offset >> 4};")
    return r


def _wgmma(e: KernelEmitter, op: tgt.TensorCoreOp) -> None:
    acc: Mma = e.layouts[op.acc]
    a, b = e.env[op.a], e.env[op.b]
    if not (isinstance(a, SharedTile) and isinstance(b, SharedTile)
            and isinstance(a.buffer, TmaBuffer) and isinstance(b.buffer, TmaBuffer)):
        raise UnsupportedByBackend("PTX backend: wgmma reads both operands from TMA-filled shared tiles")
    rows, cols = acc.shape
    if acc.wn != 1 or acc.warp_tile[0] != 16:
        raise UnsupportedByBackend(f"PTX backend: wgmma needs one 64-row slice per warpgroup, got {acc}")
    _, n_instr, _ = t.int_values(op.shape)
    k_steps = op.a.type.get_shape()[1] // 16
    b_k_major = op.layout.data == "nt"     # B stored [N, K]; "nn" stores it [K, N] (N-major)
    _, _, warp = e.tid()
    group, a_rows = e.new(S32), e.new(S32)
    e.emit(f"shr.u32 {group}, {warp}, 2;")
    e.emit(f"mul.lo.s32 {a_rows}, {group}, {64 * ROW_BYTES};")
    desc_a = _descriptor(e, a, k_major=True, extra=a_rows)
    desc_b = _descriptor(e, b, k_major=b_k_major)
    regs = e.regs_of(op.acc)
    if len(list(op.acc.uses)) != 1:
        copied = [e.new(F32) for _ in regs]
        for dst, src_ in zip(copied, regs):
            e.emit(f"mov.f32 {dst}, {src_};")
        regs = copied
    scale_d, one = e.new(PRED), e.new(S32)
    e.emit(f"mov.b32 {one}, 1;")
    e.emit(f"setp.ne.b32 {scale_d}, {one}, 0;")
    precision = op.precision.data
    per_instr = n_instr // 8 * 4           # accumulator registers one instruction writes
    e.emit("wgmma.fence.sync.aligned;")
    for kk in range(k_steps):
        da = _step(e, desc_a, a.buffer.start(0, 16 * kk))
        for n0 in range(0, cols, n_instr):
            if b_k_major:
                db = _step(e, desc_b, b.buffer.start(n0, 16 * kk))
            else:
                db = _step(e, desc_b, b.buffer.start(16 * kk, n0))
            first = n0 // 8 * 4
            d = ", ".join(regs[first:first + per_instr])
            e.emit(f"wgmma.mma_async.sync.aligned.m64n{n_instr}k16.f32.{precision}.{precision} "
                   f"{{{d}}}, {da}, {db}, {scale_d}, 1, 1, 0, {0 if b_k_major else 1};")
    e.emit("wgmma.commit_group.sync.aligned;")
    if not _waits_explicitly(e):
        e.emit("wgmma.wait_group.sync.aligned 0;")
    e.env[op.result] = list(regs)


def _waits_explicitly(e: KernelEmitter) -> bool:
    """Whether the kernel says when its wgmmas must be done (`sync scope = "mma_group"`); if not,
    each one is waited for where it is issued."""
    if "mma_waits" not in e.state:
        e.state["mma_waits"] = any(isinstance(op, tgt.SyncOp) and op.scope.data == "mma_group"
                                   for op in e.kernel.walk())
    return e.state["mma_waits"]


BUFFERS["tma"] = TmaBuffer
COPIES["tma"] = _tma_copy
INSTRUCTIONS["mbarrier.arrive.expect_tx"] = _arrive_expect_tx
SYNC["mbarrier"] = _mbarrier_sync
SYNC["mma_group"] = lambda e, op: e.emit(f"wgmma.wait_group.sync.aligned {op.pending.value.data};")
BEFORE_READ[TmaBuffer] = _wait_for_stage
FAMILIES["wgmma"] = _wgmma
