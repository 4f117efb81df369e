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
  by value as a 128-byte `.param`). Every box of a tile is copied, also one past
  the tensor's end (the copy engine zero-fills what lies outside), so a tile wider
  than the tensor (a head dim of 192 in a 256-wide tile) reads zeros, not stale data.
* `ptx_instr "mbarrier.arrive.expect_tx"` closes the group of copies into one
  stage: thread 0 arms the stage's mbarrier with the group's bytes, then issues
  the copies, which complete on it. Copies for steps a loop never reads (past a
  causal diagonal, past K) are drained before the block exits.
* `sync scope = "mbarrier"` makes the next read of a stage wait for its
  mbarrier's current phase (one phase bit per stage, flipped per wait).
* In a warp-specialized kernel (`producer_warps`) one producer thread issues every
  copy and the computing warps never meet at a block barrier: the barrier that
  guards a stage's refill becomes, for the consumers, an arrive on the stage's
  second ("free") mbarrier once they are done reading it, and for the producer a
  wait on that mbarrier before it refills the stage.
* `tensor_core "wgmma"` issues `wgmma.mma_async` m64nNk16 per warpgroup (warpgroup
  g computes accumulator rows 64g..64g+63: the Mma layout with every warp along
  M), updating the accumulator registers in place, and commits them as a group;
  `sync scope = "mma_group" pending = N` (a `tile.mma_wait`) waits for the groups,
  or, in a kernel without such waits, each group is waited for where it is issued.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import FloatAttr
from xdsl.ir import BlockArgument, Operation

from ...ir import target as tgt
from ...ir import tile as t
from .emitter import F32, PRED, S32, SYNC, U64, KernelEmitter, TensorMapSpec, UnsupportedByBackend
from .layout import Mma
from .tensor_core import (BEFORE_READ, BUFFERS, COPIES, FAMILIES, INSTRUCTIONS, SMEM_SYMBOL, SharedTile,
                          TileBuffer, _a_fragments, stage_address)

#: bytes of one TMA box row and of the swizzle pattern's repeat (8 rows)
ROW_BYTES = 128
SWIZZLE_ATOM = 8 * ROW_BYTES
#: wgmma descriptor fields: bits 16-29 leading byte offset, 32-45 stride byte offset, 62-63 swizzle (1 = 128B)
SWIZZLE_128B = 1 << 62


@dataclass(frozen=True)
class TmaBuffer(TileBuffer):
    """A tile buffer filled by TMA boxes 128 bytes wide (see the module docstring)."""

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

    def start(self, row: int, col: int) -> int:
        """Byte offset in a stage of the 16-byte chunk holding element (row, col), before swizzling:
        where a descriptor of a sub-tile starting there points (row a multiple of 8)."""
        return (col // self.box_cols) * self.box_bytes + row * ROW_BYTES + (col % self.box_cols) * self.elem


@dataclass
class Pipeline:
    """The mbarriers of one set of buffers filled together (one per stage, in dynamic shared memory
    after the tiles), the parity each stage's next phase completes with (bit s of `phase`), and
    which stages have copies in flight (bit s of `armed`)."""

    barriers: str                    # register: shared address of stage 0's mbarrier
    stages: int
    phase: str
    armed: str
    free: str | None = None          # warp-specialized: stage 0's "free" mbarrier (consumers arrive)
    free_phase: str | None = None    # the producer's parity per stage of its next wait for a free stage
    filled: str | None = None        # the producer's parity per stage of its fills (bit s: fills % 2)

    def barrier(self, e: KernelEmitter, stage: str) -> str:
        return self._at(e, self.barriers, stage)

    def free_barrier(self, e: KernelEmitter, stage: str) -> str:
        return self._at(e, self.free, stage)

    @staticmethod
    def _at(e: KernelEmitter, first: str, stage: str) -> str:
        r = e.new(S32)
        e.emit(f"mad.lo.s32 {r}, {stage}, 8, {first};")
        return r


@dataclass
class TmaState:
    """Per kernel: thread 0's predicate (it initialises the mbarriers), the predicate of the thread
    that arms them and issues the copies, the pipeline of each buffer, the copies of the group
    being issued, and whether a `sync mbarrier` wait is due."""

    leader: str
    pipelines: dict                  # buffer offset -> Pipeline
    group: list                      # [(buffer, stage register, PTX copy, bytes)]
    issuer: str = ""                 # predicate of the thread that issues copies (the leader, or the producer)
    waiting: set = field(default_factory=set)    # ids of pipelines whose next read waits (`sync mbarrier`)
    drained: bool = False
    refill_guard: str | None = None  # warp-specialized: predicate of the stage handshake before the next copy


def _state(e: KernelEmitter) -> TmaState:
    """Created at the kernel's first TMA copy, with code at entry that checks the tile alignment."""
    if "tma" not in e.state:
        tid, leader, base, low, misaligned = e.new(S32), e.new(PRED), e.new(S32), e.new(S32), e.new(PRED)
        e.at_entry(f"mov.u32 {tid}, %tid.x;")
        e.at_entry(f"setp.eq.u32 {leader}, {tid}, 0;")
        e.at_entry(f"mov.u32 {base}, {SMEM_SYMBOL};")
        e.at_entry(f"and.b32 {low}, {base}, {SWIZZLE_ATOM - 1};")
        e.at_entry(f"setp.ne.u32 {misaligned}, {low}, 0;")
        e.at_entry(f"@{misaligned} trap;")   # the swizzle is on address bits: tiles must sit on 1024-byte lines
        e.smem_align = max(e.smem_align, SWIZZLE_ATOM)
        issuer = leader
        if e.producer_threads:
            issuer = e.new(PRED)
            e.at_entry(f"setp.eq.u32 {issuer}, {tid}, {e.threads - e.producer_threads};")
        e.state["tma"] = TmaState(leader, {}, [], issuer)
        e.exit_hooks.append(_drain)
    return e.state["tma"]


def _pipeline(e: KernelEmitter, buffers: list[TmaBuffer]) -> Pipeline:
    """The pipeline of a group's buffers; a new one gets its mbarriers initialised at entry."""
    st = _state(e)
    found = {id(st.pipelines.get(b.offset)) for b in buffers}
    if len(found) != 1:
        raise UnsupportedByBackend("PTX backend: TMA copies filling a stage must always fill the same buffers")
    pipe = st.pipelines.get(buffers[0].offset)
    if pipe is not None:
        return pipe
    stages = buffers[0].stages
    specialized = bool(e.producer_threads)
    offset = -(-e.smem_bytes // 8) * 8
    e.smem_bytes = offset + 8 * stages * (2 if specialized else 1)
    barriers, phase, armed = e.new(S32), e.new(S32), e.new(S32)
    e.at_entry(f"mov.u32 {barriers}, {SMEM_SYMBOL};")
    e.at_entry(f"add.u32 {barriers}, {barriers}, {offset};")
    for s in range(stages):
        e.at_entry(f"@{st.leader} mbarrier.init.shared::cta.b64 [{barriers}+{8 * s}], 1;")
    pipe = Pipeline(barriers, stages, phase, armed)
    if specialized:   # a stage is free once every consumer warp arrived
        pipe.free, pipe.free_phase, pipe.filled = e.new(S32), e.new(S32), e.new(S32)
        e.at_entry(f"add.u32 {pipe.free}, {barriers}, {8 * stages};")
        for s in range(stages):
            e.at_entry(f"@{st.leader} mbarrier.init.shared::cta.b64 [{pipe.free}+{8 * s}], "
                       f"{(e.threads - e.producer_threads) // 32};")
        e.at_entry(f"mov.u32 {pipe.free_phase}, 0;")
        e.at_entry(f"mov.u32 {pipe.filled}, 0;")
    e.at_entry("fence.mbarrier_init.release.cluster;")
    e.at_entry("bar.sync 0;")
    e.at_entry(f"mov.u32 {phase}, 0;")
    e.at_entry(f"mov.u32 {armed}, 0;")
    for b in buffers:
        st.pipelines[b.offset] = pipe
    return pipe


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
    """One box copy per 128-byte column block of the tile, queued until the group's arrive. In a
    warp-specialized kernel, a copy after a refill guard first hands the stage over: the consumers
    arrive on its free mbarrier (and copy nothing), the producer waits on it."""
    buf: TmaBuffer = e.env[op.dst]
    (stage,) = [e.value(v) for v in op.dst_indices]
    st = _state(e)
    if st.refill_guard is not None:
        _hand_over(e, st.pipelines[buf.offset], stage, st.refill_guard)
        st.refill_guard = None
    if e.role == "consumer":
        return
    src = op.src
    shape = tuple(src.type.get_shape())
    rank = len(shape)
    row_dim, _ = t.int_values(op.tile_dims)
    box = tuple(buf.rows if d == row_dim else buf.box_cols if d == rank - 1 else 1 for d in range(rank))
    spec = TensorMapSpec(src.index, str(src.type.get_element_type()), shape, box)
    tmap = _tensor_map(e, spec)
    offsets = [e.value(v) for v in op.src_indices]
    base = stage_address(e, buf, stage)
    for j in range(buf.boxes):
        inner = e.new(S32)
        e.emit(f"add.s32 {inner}, {offsets[-1]}, {j * buf.box_cols};")
        listed = ", ".join(reversed([*offsets[:-1], inner]))
        st.group.append((buf, stage, f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::"
                                     f"complete_tx::bytes [{base}+{j * buf.box_bytes}], [{tmap}, {{{listed}}}], "
                                     f"[%BAR%];", buf.box_bytes))


def _arrive_expect_tx(e: KernelEmitter, op: tgt.PTXInstrOp) -> None:
    """Closes a group: the issuing thread arms the stage's mbarrier with the group's bytes, then
    issues its boxes; every thread that runs the copies (not a warp-specialized kernel's consumers)
    marks the stage armed."""
    st = _state(e)
    if e.role == "consumer":
        return
    stages = {stage for _, stage, *_ in st.group}
    if len(stages) != 1:
        raise UnsupportedByBackend("PTX backend: a group of TMA copies must fill one stage")
    stage = stages.pop()
    pipe = _pipeline(e, list({b.offset: b for b, *_ in st.group}.values()))
    barrier = pipe.barrier(e, stage)
    e.emit(f"@{st.issuer} mbarrier.arrive.expect_tx.shared::cta.b64 _, [{barrier}], "
           f"{sum(nbytes for *_, nbytes in st.group)};")
    for _, _, copy, _ in st.group:
        e.emit(f"@{st.issuer} {copy.replace('%BAR%', barrier)}")
    bit = _stage_bit(e, stage)
    e.emit(f"or.b32 {pipe.armed}, {pipe.armed}, {bit};")
    if e.role == "producer":
        e.emit(f"xor.b32 {pipe.filled}, {pipe.filled}, {bit};")
    st.group.clear()


def _hand_over(e: KernelEmitter, pipe: Pipeline, stage: str, guard: str) -> None:
    """Where `guard` holds (not in a loop's first iteration, whose refill fills a stage never used):
    each consumer warp arrives on the stage's free mbarrier (one lane, once the warp's reads are
    done: wgmma waits are warp-wide; one arrive per thread costs 256 shared atomics a stage),
    the producer waits for its current phase."""
    skip = e.label("handed")
    e.emit(f"@!{guard} bra {skip};")
    barrier = pipe.free_barrier(e, stage)
    if e.role == "consumer":
        _, lane, _ = e.tid()
        first_lane = e.new(PRED)
        e.emit(f"setp.eq.u32 {first_lane}, {lane}, 0;")
        e.emit(f"@{first_lane} mbarrier.arrive.shared::cta.b64 _, [{barrier}];")
    else:
        _wait_parity(e, pipe.free_phase, stage, barrier)
    e.lines.append(f"{skip}:")


def _block_sync(e: KernelEmitter, op: tgt.SyncOp) -> None:
    """A block barrier; in a warp-specialized kernel one that guards a stage's refill becomes the
    stage handshake (see `_hand_over`), any other one a barrier of the consumer warps alone."""
    if e.role is None:
        e.emit("bar.sync 0;")
        return
    loop = op.parent_op()
    if _guards_refill(op) and isinstance(loop, scf.ForOp):
        guard = e.new(PRED)
        e.emit(f"setp.gt.s32 {guard}, {e.value(loop.body.block.args[0])}, {e.value(loop.lb)};")
        _state(e).refill_guard = guard
    elif e.role == "consumer":
        e.emit(f"bar.sync 1, {e.threads - e.producer_threads};")


def _guards_refill(op: tgt.SyncOp) -> bool:
    """Whether the next op after `op`, index arithmetic aside, is a copy into a shared stage."""
    nxt = op.next_op
    while nxt is not None and nxt.dialect_name() == "arith":
        nxt = nxt.next_op
    return isinstance(nxt, tgt.MemcpyOp)


def _stage_bit(e: KernelEmitter, stage: str) -> str:
    one, bit = e.new(S32), e.new(S32)
    e.emit(f"mov.b32 {one}, 1;")
    e.emit(f"shl.b32 {bit}, {one}, {stage};")
    return bit


def _mbarrier_sync(e: KernelEmitter, op: tgt.SyncOp) -> None:
    st = _state(e)
    st.waiting = {id(p) for p in st.pipelines.values()}


def _wait_phase(e: KernelEmitter, pipe: Pipeline, stage: str, barrier: str) -> None:
    """Spins until the stage's mbarrier completes its current phase, then flips the stage's parity
    bit and clears its armed bit."""
    bit = _wait_parity(e, pipe.phase, stage, barrier)
    e.emit(f"not.b32 {bit}, {bit};")
    e.emit(f"and.b32 {pipe.armed}, {pipe.armed}, {bit};")


def _wait_parity(e: KernelEmitter, phases: str, stage: str, barrier: str) -> str:
    """Spins until `barrier` completes the phase whose parity is bit `stage` of register `phases`,
    then flips that bit; returns the register holding the stage's bit."""
    parity, done, bit = e.new(S32), e.new(PRED), _stage_bit(e, stage)
    e.emit(f"bfe.u32 {parity}, {phases}, {stage}, 1;")
    again = e.label("wait")
    e.lines.append(f"{again}:")
    e.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{barrier}], {parity};")
    e.emit(f"@!{done} bra {again};")
    e.emit(f"xor.b32 {phases}, {phases}, {bit};")
    return bit


def _wait_for_stage(e: KernelEmitter, tile_: SharedTile) -> None:
    """After a `sync mbarrier`, the first read of each pipeline's buffers waits for the stage's phase."""
    st = _state(e)
    pipe = st.pipelines[tile_.buffer.offset]
    if id(pipe) not in st.waiting:
        return
    st.waiting.discard(id(pipe))
    _wait_phase(e, pipe, tile_.stage, pipe.barrier(e, tile_.stage))


def _drain(e: KernelEmitter) -> None:
    """Before the block exits, every stage still armed (copies issued for steps the loop did not
    reach, e.g. key blocks past a causal diagonal) is waited for: no bulk copy may still be
    writing the shared memory of a finished block. Done once, at the first wait for all mmas
    (after the pipelined loop) or else at the exit; ptxas serializes wgmmas whose pipeline
    a drain after the epilogue crosses."""
    st = _state(e)
    if e.role == "consumer":
        return   # consumers issue no copies; the producer waits for its own
    if e.role == "producer":
        _drain_fills(e, st)
        return
    if st.drained:
        return
    st.drained = True
    for pipe in {id(p): p for p in st.pipelines.values()}.values():
        for s in range(pipe.stages):
            armed, skip = e.new(S32), e.new(PRED)
            e.emit(f"bfe.u32 {armed}, {pipe.armed}, {s}, 1;")
            e.emit(f"setp.eq.u32 {skip}, {armed}, 0;")
            done = e.label("drained")
            e.emit(f"@{skip} bra {done};")
            stage = e.const_s32(s)
            _wait_phase(e, pipe, stage, pipe.barrier(e, stage))
            e.lines.append(f"{done}:")


def _drain_fills(e: KernelEmitter, st: TmaState) -> None:
    """The producer's exit: for every stage it ever filled, wait until its last fill landed (the
    parity of that fill's phase is the stage's fill count - 1), consumed or not."""
    for pipe in {id(p): p for p in st.pipelines.values()}.values():
        for s in range(pipe.stages):
            used, parity, skip, done = e.new(S32), e.new(S32), e.new(PRED), e.new(PRED)
            e.emit(f"bfe.u32 {used}, {pipe.armed}, {s}, 1;")
            e.emit(f"setp.eq.u32 {skip}, {used}, 0;")
            after = e.label("landed")
            e.emit(f"@{skip} bra {after};")
            e.emit(f"bfe.u32 {parity}, {pipe.filled}, {s}, 1;")
            e.emit(f"xor.b32 {parity}, {parity}, 1;")
            again = e.label("wait")
            barrier = pipe.barrier(e, e.const_s32(s))
            e.lines.append(f"{again}:")
            e.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{barrier}], {parity};")
            e.emit(f"@!{done} bra {again};")
            e.lines.append(f"{after}:")


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
    a_shared = isinstance(a, SharedTile)
    if not (isinstance(b, SharedTile) and isinstance(b.buffer, TmaBuffer)
            and (not a_shared or isinstance(a.buffer, TmaBuffer))):
        raise UnsupportedByBackend("PTX backend: wgmma reads B (and A, unless in registers) from TMA-filled "
                                   "shared tiles")
    rows, cols = acc.shape
    if acc.wn != 1 or acc.warp_tile[0] != 16:
        raise UnsupportedByBackend(f"PTX backend: wgmma needs one 64-row slice per warpgroup, got {acc}")
    _, n_instr, _ = t.int_values(op.shape)
    k_steps = op.a.type.get_shape()[1] // 16
    b_k_major = op.layout.data == "nt"     # B stored [N, K]; "nn" stores it [K, N] (N-major)
    if a_shared:
        _, _, warp = e.tid()
        group, a_rows = e.new(S32), e.new(S32)
        e.emit(f"shr.u32 {group}, {warp}, 2;")
        e.emit(f"mul.lo.s32 {a_rows}, {group}, {64 * ROW_BYTES};")
        desc_a = _descriptor(e, a, k_major=True, extra=a_rows)
    else:   # registers in accumulator layout (attention's probabilities): per warp, mma.sync's A fragments
        fragments = _a_fragments(e, (e.regs_of(op.a), e.layouts[op.a]), acc, k_steps, 1)
    desc_b = _descriptor(e, b, k_major=b_k_major)
    regs = e.regs_of(op.acc)
    from_zero = _is_zero_fill(op.acc)
    if from_zero:        # D = A @ B: fresh registers, the first step ignores them (scale-d false)
        regs = [e.new(F32) for _ in regs]
    elif len(set(regs)) != len(regs) or len(list(op.acc.uses)) != 1 or not _defined_in_block_of(op.acc, op):
        copied = [e.new(F32) for _ in regs]   # wgmma updates its accumulator in place
        for dst, src_ in zip(copied, regs):
            e.emit(f"mov.f32 {dst}, {src_};")
        regs = copied
    accumulate, ignore, one = e.new(PRED), e.new(PRED), e.new(S32)
    e.emit(f"mov.b32 {one}, 1;")
    e.emit(f"setp.ne.b32 {accumulate}, {one}, 0;")
    e.emit(f"setp.eq.b32 {ignore}, {one}, 0;")
    precision = op.precision.data
    per_instr = n_instr // 8 * 4           # accumulator registers one instruction writes
    e.emit("wgmma.fence.sync.aligned;")
    for kk in range(k_steps):
        da = _step(e, desc_a, a.buffer.start(0, 16 * kk)) if a_shared else f"{{{', '.join(fragments[kk][0])}}}"
        for n0 in range(0, cols, n_instr):
            if b_k_major:
                db = _step(e, desc_b, b.buffer.start(n0, 16 * kk))
            else:
                db = _step(e, desc_b, b.buffer.start(16 * kk, n0))
            first = n0 // 8 * 4
            d = ", ".join(regs[first:first + per_instr])
            trans = f"{'0, ' if a_shared else ''}{0 if b_k_major else 1}"   # A in registers has no transpose
            scale_d = ignore if from_zero and kk == 0 else accumulate
            e.emit(f"wgmma.mma_async.sync.aligned.m64n{n_instr}k16.f32.{precision}.{precision} "
                   f"{{{d}}}, {da}, {db}, {scale_d}, 1, 1, {trans};")
    e.emit("wgmma.commit_group.sync.aligned;")
    if not _waited_for_later(op):
        e.emit("wgmma.wait_group.sync.aligned 0;")
    e.env[op.result] = list(regs)


def _is_zero_fill(v) -> bool:
    """Whether tile `v` is a broadcast 0.0 (a fresh accumulator, whose registers are one name repeated)."""
    op = v.owner
    if not isinstance(op, t.BroadcastOp) or not isinstance(op.x.owner, arith.ConstantOp):
        return False
    value = op.x.owner.value
    return isinstance(value, FloatAttr) and value.value.data == 0.0


def _defined_in_block_of(v, op) -> bool:
    """Whether `v` is defined in `op`'s block (an op there, or the block's argument): only then may
    `op` update its registers in place, which a value from outside a loop must keep every iteration."""
    block = v.owner if isinstance(v, BlockArgument) else v.owner.parent_block()
    return block is op.parent_block()


def _waited_for_later(op: tgt.TensorCoreOp) -> bool:
    """Whether a `sync scope = "mma_group"` follows `op` in its block before anything there reads
    its result; if not, the wgmma is waited for where it is issued."""
    readers = [use.operation for use in op.result.uses if not isinstance(use.operation, scf.YieldOp)]
    nxt = op.next_op
    while nxt is not None:
        if isinstance(nxt, tgt.SyncOp) and nxt.scope.data == "mma_group":
            return True
        if any(r is nxt or nxt.is_ancestor(r) for r in readers):   # read here, or in a region of it
            return False
        nxt = nxt.next_op
    return False


def _wait_mmas(e: KernelEmitter, op: tgt.SyncOp) -> None:
    """Waits for all but `pending` wgmma groups; the first wait for all of them outside any loop or
    branch also drains the copies still in flight (one inside a loop would, every iteration, consume
    the phase of a stage the next iteration waits for, and hang the block)."""
    e.emit(f"wgmma.wait_group.sync.aligned {op.pending.value.data};")
    if op.pending.value.data == 0 and "tma" in e.state and not _inside_control_flow(op):
        _drain(e)


def _inside_control_flow(op: Operation) -> bool:
    parent = op.parent_op()
    while parent is not None:
        if isinstance(parent, (scf.ForOp, scf.IfOp)):
            return True
        parent = parent.parent_op()
    return False


BUFFERS["tma"] = TmaBuffer
COPIES["tma"] = _tma_copy
INSTRUCTIONS["mbarrier.arrive.expect_tx"] = _arrive_expect_tx
SYNC["mbarrier"] = _mbarrier_sync
SYNC["block"] = _block_sync
SYNC["mma_group"] = _wait_mmas
BEFORE_READ[TmaBuffer] = _wait_for_stage
FAMILIES["wgmma"] = _wgmma
