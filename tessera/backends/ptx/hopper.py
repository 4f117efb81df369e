"""The Hopper-native path (sm_90a): TMA copies completing on mbarriers, wgmma from shared memory.

Target IR chooses it per kernel (`lowering.tile_to_target.kernel_platform`); the
Tile IR pipeline is the same one the Ampere path runs, only its ops mean more:

* `allocate` gives a `TmaBuffer`: a [rows, cols] tile stored as boxes 64 16-bit
  elements (one 128-byte row) wide, each [rows, 64] box in TMA's 128-byte swizzle
  (16-byte chunk c of row r at chunk c ^ (r % 8)), boxes one after another, each
  stage 1024-byte aligned. That is the canonical layout wgmma reads through a
  matrix descriptor, so no thread ever touches the tile. An 8-bit tile 64 elements
  wide is one [rows, 64] box in TMA's 64-byte swizzle instead (`NarrowTmaBuffer`).
* `tensor_map` is a 128-byte by-value `.param` after the pointer params, which
  the runtime encodes for the kernel argument (`TensorMapSpec`); `tma_load` issues
  one `cp.async.bulk.tensor` of one box from it. Every box of a tile is copied,
  also one past the tensor's end (the copy engine zero-fills what lies outside), so
  a tile wider than the tensor (a head dim of 192 in a 256-wide tile) reads zeros.
* The mbarrier ops (`mbarrier_alloc`, `_init`, `_arrive_expect_tx`, `_arrive`,
  `_try_wait`) print as the PTX instructions of the same names, at the offsets the
  allocation pass chose; thread 0 initialises mbarriers and (outside a producer
  region) arms them and issues the copies. Which stage waits on which phase is the
  Target IR's (`lowering.async_pipelines`), not this module's.
* `warp_specialize` branches the producer warps to the producer region, where after
  the register split (`setmaxnreg`) one thread stays to issue the copies.
* `tensor_core "wgmma"` issues `wgmma.mma_async` m64nNk16 per warpgroup (warpgroup
  g computes accumulator rows 64g..64g+63: the Mma layout with every warp along
  M), updating the accumulator registers in place, between the `wgmma_fence` and
  `wgmma_commit` the lowering put around it; `wgmma_wait` waits for the groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import arith
from xdsl.dialects.builtin import FloatAttr
from xdsl.ir import BlockArgument

from ... import dtypes
from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Mma
from ...runtime.tensor_maps import NARROW_ROW_BYTES, TMA_ROW_BYTES
from ...runtime import tensor_maps
from . import tensor_core
from .core import KernelEmitter, TensorMapSpec
from .tensor_core import TileBuffer, _a_fragments, register_tile, stage_address
from .types import B8, F32, PRED, S32, U64, UnsupportedByBackend

#: bytes of one TMA box row (`tensor_maps.TMA_ROW_BYTES`) and of the swizzle pattern's repeat (8 rows)
ROW_BYTES = TMA_ROW_BYTES
SWIZZLE_ATOM = 8 * ROW_BYTES
#: a wgmma descriptor's swizzle field (bits 62-63) per swizzle width in bytes
_SWIZZLE_MODE = {128: 1, 64: 2}


@dataclass(frozen=True)
class TmaBuffer(TileBuffer):
    """A tile buffer filled by TMA boxes 128 bytes wide (see the module docstring)."""

    row_bytes = ROW_BYTES   # (a box row, the swizzle's span)

    @property
    def box_cols(self) -> int:
        return self.row_bytes // self.elem

    @property
    def boxes(self) -> int:
        return self.cols // self.box_cols

    @property
    def box_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def stage_bytes(self) -> int:
        atom = 8 * self.row_bytes
        return -(-self.boxes * self.box_bytes // atom) * atom

    def chunk_slots(self, e: KernelEmitter, stage: str, row: str, col: str) -> list[str]:
        """As `SharedBuffer.chunk_slots`: within a box, chunk j of row r sits at chunk j ^ (r % 8)."""
        if self.cols % self.box_cols or self.row_bytes != ROW_BYTES:
            raise UnsupportedByBackend(f"PTX backend: a store into a TMA-laid-out buffer of {self.cols} columns, not "
                                       f"whole {self.box_cols}-column boxes of {ROW_BYTES} bytes")
        f, first = e.new(S32), e.new(S32)
        e.emit(f"and.b32 {f}, {row}, 7;")
        e.emit(f"mad.lo.s32 {first}, {row}, {ROW_BYTES}, {stage};")
        e.emit(f"mad.lo.s32 {first}, {col}, {self.elem}, {first};")
        return tensor_core._xor_slots(e, first, f, 8)

    def chunk_at(self, chunk: int, row: int) -> tuple[int, int]:
        """(slot of `chunk_slots`, byte offset from it) of chunk `chunk`, `row` rows further: chunks
        past a box's 8 are the next box's."""
        return chunk % 8, (chunk // 8) * self.box_bytes + row * ROW_BYTES

    def start(self, row: int, col: int) -> int:
        """Byte offset in a stage of the 16-byte chunk holding element (row, col), before swizzling:
        where a descriptor of a sub-tile starting there points (row a multiple of 8)."""
        return (col // self.box_cols) * self.box_bytes + row * self.row_bytes + (col % self.box_cols) * self.elem


@dataclass(frozen=True)
class NarrowTmaBuffer(TmaBuffer):
    """A tile buffer of 8-bit elements filled by TMA boxes 64 bytes wide, in TMA's 64-byte swizzle
    (`tensor_maps.box_row_bytes`: fp8 Q and K at a head dim of 64), which wgmma reads through its
    descriptors; no thread stores into it."""

    row_bytes = NARROW_ROW_BYTES


def leader(e: KernelEmitter) -> str:
    """Thread 0's predicate (it initialises the mbarriers), computed at entry; the first call also
    checks at entry that the dynamic shared memory sits on a 1024-byte line (the swizzle is on
    address bits)."""
    if "leader" not in e.state:
        tid, leader, low, misaligned = e.new(S32), e.new(PRED), e.new(S32), e.new(PRED)
        e.at_entry(f"mov.u32 {tid}, %tid.x;")
        e.at_entry(f"setp.eq.u32 {leader}, {tid}, 0;")
        e.at_entry(f"and.b32 {low}, {e.smem_base()}, {SWIZZLE_ATOM - 1};")
        e.at_entry(f"setp.ne.u32 {misaligned}, {low}, 0;")
        e.at_entry(f"@{misaligned} trap;")
        e.smem_align = max(e.smem_align, SWIZZLE_ATOM)
        e.state["leader"] = leader
        e.state["tid_at_entry"] = tid
    return e.state["leader"]


def _issuer(e: KernelEmitter) -> str:
    """The predicate of the thread that arms mbarriers and issues bulk copies: thread 0, or in a
    warp-specialized kernel's producer region its one running thread (the first producer thread)."""
    if e.role != "producer":
        return leader(e)
    if "issuer" not in e.state:
        leader(e)
        issuer = e.new(PRED)
        e.at_entry(f"setp.eq.u32 {issuer}, {e.state['tid_at_entry']}, {e.threads - e.producer_threads};")
        e.state["issuer"] = issuer
    return e.state["issuer"]


def _tensor_map(e: KernelEmitter, op: tgt.TensorMapOp) -> None:
    """A by-value tensor-map `.param` after the pointer params, and its generic address."""
    m: tgt.TensorMapType = op.result.type
    shape = tuple(tensor_maps.DYNAMIC if n == t.DYNAMIC else n for n in m.shape_dims)
    spec = TensorMapSpec(op.tensor.index, str(m.element_type), shape, m.box_dims, m.swizzle.data,
                         m.element_strides if m.strides.data else None)
    name = f"{e.name}_tmap_{len(e.tensor_maps)}"
    e.tensor_maps.append(spec)
    e.extra_params.append(f"    .param .align 64 .b8 {name}[128]")
    raw, generic = e.new(U64), e.new(U64)
    e.at_entry(f"mov.u64 {raw}, {name};")
    e.at_entry(f"cvta.param.u64 {generic}, {raw};")
    e.env[op.result] = generic


def _mbarrier_alloc(e: KernelEmitter, op: tgt.MBarrierAllocOp) -> None:
    """The shared address of the group's first mbarrier, at the offset the allocation pass chose."""
    leader(e)
    offset = op.offset.value.data
    base = e.new(S32)
    e.at_entry(f"add.u32 {base}, {e.smem_base()}, {offset};")
    e.env[op.result] = base


def _in_block(e: KernelEmitter, op, key: tuple, compute) -> str:
    """`compute()`'s register, computed once per (op's block, key): a group's copies share their
    stage's address and mbarrier (ptxas does not merge the copies' uniform address arithmetic)."""
    memo = e.state.setdefault("in_block", {})
    full = (op.parent_block(), *key)
    if full not in memo:
        memo[full] = compute()
    return memo[full]


def _barrier_at(e: KernelEmitter, op, barriers, stage) -> str:
    def compute():
        r = e.new(S32)
        e.emit(f"mad.lo.s32 {r}, {e.value(stage)}, 8, {e.value(barriers)};")
        return r
    return _in_block(e, op, ("mbarrier", barriers, stage), compute)


def _mbarrier_init(e: KernelEmitter, op: tgt.MBarrierInitOp) -> None:
    thread0, first = leader(e), e.value(op.barriers)
    for s in range(op.barriers.type.count.data):
        e.emit(f"@{thread0} mbarrier.init.shared::cta.b64 [{first}+{8 * s}], {op.arrivals.value.data};")


def _arrive_expect_tx(e: KernelEmitter, op: tgt.MBarrierArriveExpectTxOp) -> None:
    e.emit(f"@{_issuer(e)} mbarrier.arrive.expect_tx.shared::cta.b64 _, [{_barrier_at(e, op, op.barriers, op.stage)}], "
           f"{op.bytes.value.data};")


def _arrive(e: KernelEmitter, op: tgt.MBarrierArriveOp) -> None:
    """One arrival per thread, or from lane 0 of each warp (once the warp's reads are done: wgmma
    waits are warp-wide; one arrive per thread costs 256 shared atomics a stage), or from the
    issuing thread on the mbarrier of every block of the cluster (its address there by `mapa`)."""
    barrier = _barrier_at(e, op, op.barriers, op.stage)
    if op.per.data == "cluster":
        for rank in range(e.kernel.cluster.value.data):
            there = e.new(S32)
            e.emit(f"mapa.shared::cluster.u32 {there}, {barrier}, {rank};")
            e.emit(f"@{_issuer(e)} mbarrier.arrive.shared::cluster.b64 _, [{there}];")
        return
    if op.per.data == "thread":
        e.emit(f"mbarrier.arrive.shared::cta.b64 _, [{barrier}];")
        return
    _, lane, _ = e.tid()
    first_lane = e.new(PRED)
    e.emit(f"setp.eq.u32 {first_lane}, {lane}, 0;")
    e.emit(f"@{first_lane} mbarrier.arrive.shared::cta.b64 _, [{barrier}];")


def _try_wait(e: KernelEmitter, op: tgt.MBarrierTryWaitOp) -> None:
    """Spins until the mbarrier completes the phase of the given parity."""
    barrier, done = _barrier_at(e, op, op.barriers, op.stage), e.new(PRED)
    again = e.label("wait")
    e.lines.append(f"{again}:")
    e.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{barrier}], {e.value(op.parity)};")
    e.emit(f"@!{done} bra {again};")


def _tma_load(e: KernelEmitter, op: tgt.TmaLoadOp) -> None:
    """One box (`cp.async.bulk.tensor`); of a multicast copy, the block's own box (its rank's rows)
    into every block of the cluster (`.multicast::cluster`, a mask of all its ranks)."""
    buf: TmaBuffer = e.env[op.dst]
    m: tgt.TensorMapType = op.tensor_map.type
    dst = _in_block(e, op, ("stage", op.dst, op.stage), lambda: stage_address(e, buf, e.value(op.stage)))
    coords = [e.value(c) for c in op.coords]
    barrier = _barrier_at(e, op, op.barriers, op.barrier_stage)
    multicast, mask = "", ""
    if op.copies > 1:
        rank, row, mine, bits = e.cluster_rank(), e.new(S32), e.new(S32), e.new(B8)
        e.emit(f"mad.lo.s32 {row}, {rank}, {m.box_dims[-2]}, {coords[-2]};")
        e.emit(f"mad.lo.s32 {mine}, {rank}, {m.box_bytes}, {dst};")
        e.emit(f"mov.b16 {bits}, {(1 << op.copies) - 1};")
        coords[-2], dst, multicast, mask = row, mine, ".multicast::cluster", f", {bits}"
    e.emit(f"@{_issuer(e)} cp.async.bulk.tensor.{len(m.shape_dims)}d.shared::cluster.global.tile.mbarrier::"
           f"complete_tx::bytes{multicast} [{dst}+{op.offset.value.data}], [{e.value(op.tensor_map)}, "
           f"{{{', '.join(reversed(coords))}}}], [{barrier}]{mask};")


#: the PTX of each `tessera_target.fence` kind
FENCE_PTX = {"mbarrier_init": "fence.mbarrier_init.release.cluster;", "async_shared": "fence.proxy.async.shared::cta;"}


def _fence(e: KernelEmitter, op: tgt.FenceOp) -> None:
    e.emit(FENCE_PTX[op.kind.data])


def _warp_specialize(e: KernelEmitter, op: tgt.WarpSpecializeOp) -> None:
    """The producer warps branch to the producer region; after its register split all but its first
    thread exit, and that thread issues the copies; the other warps run the consumer region."""
    consumers = e.threads - e.producer_threads
    tid, _, _ = e.tid()
    is_producer = e.new(PRED)
    to_consumers, to_exit = e.label("consumers"), e.label("idle")
    e.emit(f"setp.ge.u32 {is_producer}, {tid}, {consumers};")
    e.emit(f"@!{is_producer} bra {to_consumers};")
    e.role = "producer"
    ops = list(op.producer.block.ops)
    while ops and isinstance(ops[0], tgt.SetMaxNRegOp):
        e.op(ops.pop(0))
    idle = e.new(PRED)
    e.emit(f"setp.ne.u32 {idle}, {tid}, {consumers};")
    e.emit(f"@{idle} bra {to_exit};")
    for inner in ops:
        e.op(inner)
    e.lines.append(f"{to_exit}:")
    e.emit("ret;")
    e.lines.append(f"{to_consumers}:")
    e.role = "consumer"
    e.block(op.consumer.block)
    e.role = None


def _warpgroup_turn(e: KernelEmitter, op: tgt.WarpgroupTurnOp) -> None:
    """Warpgroup w of the computing warps takes its turn at named barrier TURN_BARRIER + w (bar.sync
    of 256 threads: its own 128 meet the 128 of the warpgroup whose give arrived there) and gives
    it at the next warpgroup's (bar.arrive, which does not wait)."""
    consumers = e.threads - e.producer_threads
    groups = consumers // 128
    if groups < 2 or consumers % 128:
        raise UnsupportedByBackend(f"PTX backend: warpgroups take turns among 2+ whole warpgroups, not {consumers} threads")
    meeting = 2 * 128   # (the taker and the giver, however many warpgroups take turns)
    _, _, warp = e.tid()
    group = e.new(S32)
    e.emit(f"shr.u32 {group}, {warp}, 2;")
    if op.warpgroup is not None:
        w = op.warpgroup.value.data
        mine = e.new(PRED)
        e.emit(f"setp.eq.u32 {mine}, {group}, {w};")
        e.emit(f"@{mine} bar.arrive {tgt.TURN_BARRIER + (w + 1) % groups}, {meeting};")
        return
    barrier = e.new(S32)
    if op.action.data == "take":
        e.emit(f"add.s32 {barrier}, {group}, {tgt.TURN_BARRIER};")
        e.emit(f"bar.sync {barrier}, {meeting};")
        return
    e.emit(f"add.s32 {barrier}, {group}, 1;")
    e.emit(f"rem.u32 {barrier}, {barrier}, {groups};")
    e.emit(f"add.s32 {barrier}, {barrier}, {tgt.TURN_BARRIER};")
    e.emit(f"bar.arrive {barrier}, {meeting};")


def _setmaxnreg(e: KernelEmitter, op: tgt.SetMaxNRegOp) -> None:
    e.emit(f"setmaxnreg.{op.action.data}.sync.aligned.u32 {op.regs.value.data};")


# --- wgmma -----------------------------------------------------------------------------------------

#: the shared address bits a wgmma descriptor holds (bits 4-17, as address / 16 in its bits 0-13): in a
#: kernel launched in clusters a block's shared addresses also carry its rank in the cluster (bit 24
#: up), which unmasked spilled into the leading byte offset and read every 64-column box past the
#: first 256 bytes off in rank 1 (H200, session 39)
DESCRIPTOR_ADDRESS_MASK = 0x3FFFF


def _wgmma_descriptor(e: KernelEmitter, op: tgt.WgmmaDescriptorOp) -> None:
    """The 64-bit descriptor of the op's stage: address / 16 in bits 0-13, the leading and stride
    byte offsets / 16 in bits 16-29 and 32-45, the swizzle in bits 62-63; a warpgroup's A rows
    start `per_warpgroup` bytes further per warpgroup before it."""
    buf: TmaBuffer = e.env[op.buffer]
    if not isinstance(buf, TmaBuffer):
        raise UnsupportedByBackend("PTX backend: wgmma descriptors describe TMA-filled (tma_128b) buffers only")
    rows = None
    if op.per_warpgroup.value.data:
        _, _, warp = e.tid()
        group, rows = e.new(S32), e.new(S32)
        e.emit(f"shr.u32 {group}, {warp}, 2;")
        e.emit(f"mul.lo.s32 {rows}, {group}, {op.per_warpgroup.value.data};")
    addr = stage_address(e, buf, e.value(op.stage))
    if rows is not None:
        e.emit(f"add.s32 {addr}, {addr}, {rows};")
    fields = (_SWIZZLE_MODE[op.swizzle.value.data] << 62 | (op.stride.value.data >> 4) << 32
              | (op.leading.value.data >> 4) << 16)
    if e.kernel.cluster is not None:   # (a cluster block's shared addresses carry its rank in bit 24 and up)
        low = e.new(S32)
        e.emit(f"and.b32 {low}, {addr}, {DESCRIPTOR_ADDRESS_MASK};")
        addr = low
    desc = e.new(U64)
    e.emit(f"cvt.u64.u32 {desc}, {addr};")
    e.emit(f"shr.u64 {desc}, {desc}, 4;")
    e.emit(f"or.b64 {desc}, {desc}, {fields};")
    e.env[op.result] = (desc, buf)


def _step(e: KernelEmitter, desc: str, byte_offset: int) -> str:
    if byte_offset == 0:
        return desc
    r = e.new(U64)
    e.emit(f"add.s64 {r}, {desc}, {byte_offset >> 4};")
    return r


def _wgmma(e: KernelEmitter, op: tgt.TensorCoreOp) -> None:
    """m64nNk16 (16-bit operands) or m64nNk32 (8-bit) instructions over the tile, stepping each
    descriptor along K (and B's along N) by its buffer's layout (`TmaBuffer.start`); A from its
    descriptor or, in accumulator layout (attention's probabilities), from registers as mma.sync's
    A fragments. 8-bit operands are read K-major only (wgmma transposes only 16-bit ones)."""
    acc: Mma = e.layouts[op.acc]
    a_shared = isinstance(op.a.type, tgt.WgmmaDescriptorType)
    rows, cols = acc.shape
    if acc.wn != 1 or acc.warp_tile[0] != 16:
        raise UnsupportedByBackend(f"PTX backend: wgmma needs one 64-row slice per warpgroup, got {acc}")
    _, n_instr, k = t.int_values(op.shape)
    a_k_major = not a_shared or op.a.type.major.data == "k"   # A stored [M, K]; else [K, M] (M-major)
    k_steps = op.operand_shape(op.a)[1 if a_k_major else 0] // k
    b_k_major = op.b.type.major.data == "k"     # B stored [N, K]; else [K, N] (N-major)
    eight_bit = dtypes.BY_MLIR[op.precision.data].bits == 8
    if eight_bit and not (a_k_major and b_k_major):
        raise UnsupportedByBackend(f"PTX backend: an 8-bit wgmma (tessera.loc {op.attributes.get('tessera.loc')}) "
                                   f"reads both operands K-major")
    if a_shared:
        desc_a, a_buf = e.env[op.a]
    else:
        fragments = _a_fragments(e, register_tile(e, op.a), acc, k_steps, 1, k=k)
    desc_b, b_buf = e.env[op.b]
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
    ptx_a, ptx_b = tensor_core.operand_ptx_types(op)
    per_instr = n_instr // 8 * 4           # accumulator registers one instruction writes
    if e.state.pop("wgmma_fence", False):
        e.emit("wgmma.fence.sync.aligned;")
    for kk in range(k_steps):
        if a_shared:
            da = _step(e, desc_a, a_buf.start(0, k * kk) if a_k_major else a_buf.start(k * kk, 0))
        else:
            da = f"{{{', '.join(fragments[kk][0])}}}"
        for n0 in range(0, cols, n_instr):
            if b_k_major:
                db = _step(e, desc_b, b_buf.start(n0, k * kk))
            else:
                db = _step(e, desc_b, b_buf.start(k * kk, n0))
            first = n0 // 8 * 4
            d = ", ".join(regs[first:first + per_instr])
            # transposes (16-bit only; A in registers has none)
            trans = "" if eight_bit else f", {f'{0 if a_k_major else 1}, ' if a_shared else ''}{0 if b_k_major else 1}"
            scale_d = ignore if from_zero and kk == 0 else accumulate
            e.emit(f"wgmma.mma_async.sync.aligned.m64n{n_instr}k{k}.f32.{ptx_a}.{ptx_b} "
                   f"{{{d}}}, {da}, {db}, {scale_d}, 1, 1{trans};")
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


def _wgmma_fence(e: KernelEmitter, op: tgt.WgmmaFenceOp) -> None:
    """Written right before the next wgmma's first instruction, after the code that builds its
    descriptors and places its accumulator registers (the writes the fence orders)."""
    e.state["wgmma_fence"] = True


def _wgmma_commit(e: KernelEmitter, op: tgt.WgmmaCommitOp) -> None:
    e.emit("wgmma.commit_group.sync.aligned;")


def _wgmma_wait(e: KernelEmitter, op: tgt.WgmmaWaitOp) -> None:
    e.emit(f"wgmma.wait_group.sync.aligned {op.pending.value.data};")


#: the Hopper-native path's handlers, on top of the Ampere-class path's (`paths.HOPPER`); its
#: tensor_core handler emits wgmma besides mma.sync
HANDLERS = {
    tgt.TensorCoreOp: tensor_core.tensor_core_handler({**tensor_core.FAMILIES, "wgmma": _wgmma}),
    tgt.TensorMapOp: _tensor_map,
    tgt.MBarrierAllocOp: _mbarrier_alloc,
    tgt.MBarrierInitOp: _mbarrier_init,
    tgt.MBarrierArriveExpectTxOp: _arrive_expect_tx,
    tgt.MBarrierArriveOp: _arrive,
    tgt.MBarrierTryWaitOp: _try_wait,
    tgt.TmaLoadOp: _tma_load,
    tgt.WgmmaDescriptorOp: _wgmma_descriptor,
    tgt.FenceOp: _fence,
    tgt.WgmmaFenceOp: _wgmma_fence,
    tgt.WgmmaCommitOp: _wgmma_commit,
    tgt.WgmmaWaitOp: _wgmma_wait,
    tgt.WarpSpecializeOp: _warp_specialize,
    tgt.SetMaxNRegOp: _setmaxnreg,
    tgt.WarpgroupTurnOp: _warpgroup_turn,
}

#: the layout of the shared tile buffers bulk copies (TMA) fill
BUFFERS = {"tma_128b": TmaBuffer, "tma_64b": NarrowTmaBuffer}
