"""Tile IR pipelines -> Target IR's explicit TMA protocol (the Hopper-native path).

Tile IR says what a pipeline does: `tile.copy_async` into a stage, `tile.async_commit`
closes a group of copies, `tile.async_wait` + `tile.barrier` make the next stage read
safe, and a barrier before a refill frees the stage. On a target whose copies use TMA
this module writes out *how*, as typed Target IR ops that a dump shows and the
async-hazard checker (`tessera.passes.check_async`) reads:

* per pipeline (the buffers one commit fills together), `mbarrier_alloc` +
  `mbarrier_init arrivals = 1` (one "full" mbarrier per stage; a warp-specialized kernel
  adds a "free" mbarrier per stage that every computing warp arrives on), a
  `fence kind = "mbarrier_init"` and a block barrier;
* per copy, one `tma_load` per 128-byte-wide box of the tile (from a `tensor_map`, the
  kernel's by-value TMA descriptor of the source argument), after the group's
  `mbarrier_arrive_expect_tx` with the group's bytes;
* per wait, an `mbarrier_try_wait` on the stage read next, with the parity of the
  phase it waits for. Phases are explicit i32 values: bit s of `phase` is the parity
  stage s's next wait needs, flipped per wait; bit s of `armed` says stage s has copies
  not yet waited for (both are carried through loops as iter_args, as CUTLASS's
  pipeline state is). The same bits drain the copies no step read before the block
  exits (steps past a causal diagonal, past K);
* in a warp-specialized kernel (`producer_warps`), a `warp_specialize` op whose producer
  region keeps the copies and the scalar code that places them, and whose consumer region
  keeps the rest; the barrier guarding a refill becomes the consumers' `mbarrier_arrive`
  on the stage's free mbarrier and the producer's wait on it, other block barriers become
  a named barrier of the consumers, and `setmaxnreg` ops move the producer's spare
  registers to the consumers (`register_split`);
* in a kernel in clusters whose blocks fill a stage with the same tile (`tile.copy_async`
  `cluster_shared`: a GEMM's B tile, the cluster's blocks computing consecutive tile rows),
  that tile's copy is the cluster's (`tma_load multicast`): each block copies its share of the
  tile's rows into every block. A block may then refill a stage only once every block of the
  cluster is done with it, so such a pipeline has a "free" mbarrier per stage: a
  `tile.release_stage` becomes the issuing thread's arrival on it in every block (`per =
  "cluster"`), and each copy group into the stage first waits for its next phase (the template
  releases every stage once before its first fill, so phases and fills pair up). The blocks
  meet (`cluster_barrier`) after the mbarriers' init, before any copy into another block, and
  before they exit, while another may still arrive on their mbarriers.

Measured on an H100 (bench/run_all.py): dropping the barrier that only publishes copies
(the mbarrier does that) gives the native GEMM +17% and attention +4-10%.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import IndexType, IntegerAttr, MemRefType, i32
from xdsl.ir import Block, Operation, Region, SSAValue

from ..ir import target, tile
from ..platforms import Platform
from ..runtime.tensor_maps import box_row_bytes
from .assign_layouts import is_tile
from .byte_fragments import BYTE_A_ROWS


#: registers a producer warpgroup keeps after handing the rest to the computing warpgroups: its one
#: issuing thread only computes copy coordinates and waits on mbarriers
PRODUCER_REGS = 40


@dataclass(frozen=True)
class RegisterSplit:
    """Per-thread register counts of a warp-specialized kernel: at launch (every warp the same), and
    after setmaxnreg moves the producer warpgroup's spare registers to the computing warpgroups."""

    launch: int
    producer: int
    consumer: int


def register_split(platform: Platform, threads: int, producer_threads: int) -> RegisterSplit | None:
    """The split for one block per SM, where the launch count is what the register file allows for
    all `threads`; None where the target has no setmaxnreg or the consumers would gain nothing.
    The launch count is pinned with .maxnreg: the pool setmaxnreg.inc draws from is the launch count
    times the block's threads, and a request beyond the pool would wait forever."""
    if (not producer_threads or not platform.has("setmaxnreg")
            or producer_threads % 128 or threads % 128 or threads == producer_threads):
        return None   # setmaxnreg is per warpgroup: each role must be whole warpgroups
    launch = min(platform.max_regs_per_thread, platform.regs_per_sm // threads) // 8 * 8
    warpgroups, producers = threads // 128, producer_threads // 128
    spare = warpgroups * launch - producers * PRODUCER_REGS
    consumer = min(platform.max_regs_per_thread // 8 * 8, spare // (warpgroups - producers) // 8 * 8)
    if consumer <= launch:
        return None
    return RegisterSplit(launch, PRODUCER_REGS, consumer)


# ---------------------------------------------------------------------------
# Small builders
# ---------------------------------------------------------------------------


class _Insert:
    """Builds ops before a fixed op (or at the end of a block) and returns their results."""

    def __init__(self, block: Block, before: Operation | None):
        self.block, self.before = block, before

    def __call__(self, op: Operation):
        if self.before is None:
            self.block.add_op(op)
        else:
            self.block.insert_op_before(op, self.before)
        return op.results[0] if op.results else op

    def i32(self, value: int) -> SSAValue:
        return self(arith.ConstantOp(IntegerAttr(value, i32)))

    def index(self, value: int) -> SSAValue:
        return self(arith.ConstantOp(IntegerAttr(value, IndexType())))

    def stage_bit(self, stage: SSAValue) -> SSAValue:
        """1 << stage, as i32."""
        return self(arith.ShLIOp(self.i32(1), self(arith.IndexCastOp(stage, i32))))

    def bit_of(self, bits: SSAValue, stage: SSAValue) -> SSAValue:
        """(bits >> stage) & 1."""
        return self(arith.AndIOp(self(arith.ShRUIOp(bits, self(arith.IndexCastOp(stage, i32)))), self.i32(1)))


# ---------------------------------------------------------------------------
# Pipelines: the buffers one commit fills, and their mbarriers
# ---------------------------------------------------------------------------


@dataclass
class _Pipe:
    index: int
    stages: int
    buffers: list[SSAValue]
    full: SSAValue | None = None      # !mbarriers<stages>: the copies of a stage landed
    free: SSAValue | None = None      # warp-specialized: every computing warp is done with a stage


def _pipes(kernel: tile.KernelOp) -> dict[SSAValue, _Pipe]:
    """Each shared buffer's pipeline: the buffers the copies of one commit group fill together."""
    by_buffer: dict[SSAValue, _Pipe] = {}
    group: list[SSAValue] = []
    pipes: list[_Pipe] = []
    for op in kernel.walk():
        if isinstance(op, tile.CopyAsyncOp):
            group.append(op.dst)
        elif isinstance(op, tile.AsyncCommitOp):
            known = {id(by_buffer[b]) for b in group if b in by_buffer}
            if len(known) > 1 or (known and any(b not in by_buffer for b in group)):
                raise ValueError("TMA copies filling a stage must always fill the same buffers")
            if not known and group:
                buffers = list(dict.fromkeys(group))
                stages = {b.type.get_shape()[0] for b in buffers}
                if len(stages) != 1:
                    raise ValueError("the buffers of one pipeline must have the same number of stages")
                pipe = _Pipe(len(pipes), stages.pop(), buffers)
                pipes.append(pipe)
                by_buffer.update({b: pipe for b in buffers})
            group = []
    return by_buffer


def multicast(op: tile.CopyAsyncOp, cluster: int) -> int:
    """The blocks of the cluster that copy `op`'s tile together (`tma_load multicast`): the cluster
    where the tile is the same in all of them, fills whole stages, and its rows split into a share
    of whole swizzle atoms (8 rows of 128 bytes) each along the map's second-innermost dim; else 1."""
    rows, rank = op.rows[1], op.src.type.get_num_dims()
    if (cluster <= 1 or op.cluster_shared is None or op.dst_rows is not None or rank < 2
            or tile.int_values(op.tile_dims)[0] != rank - 2 or rows % (8 * cluster)):
        return 1
    return cluster


def _row_bytes(op: tile.CopyAsyncOp) -> int:
    """Bytes of one box row of the stage `op` fills (`tensor_maps.box_row_bytes`)."""
    element_bytes = op.dst.type.get_element_type().bitwidth // 8
    return box_row_bytes(op.dst.type.get_shape()[2], element_bytes)


def _box(op: tile.CopyAsyncOp, cluster: int) -> tuple[int, ...]:
    """A TMA box of a copy's tile: its rows along the row dim (a block's share of them, where the
    cluster copies the tile together), one swizzle span (`_row_bytes`) along the contiguous dim, 1
    along every other dim."""
    rank, row_dim = op.src.type.get_num_dims(), tile.int_values(op.tile_dims)[0]
    box_cols = _row_bytes(op) // (op.dst.type.get_element_type().bitwidth // 8)
    rows = op.rows[1] // multicast(op, cluster)
    if BYTE_A_ROWS in op.attributes:   # (keys permuted in each 16: `TensorMapType.byte_a_rows`)
        return (rows // 16, 2, 4, 2, box_cols)
    return tuple(rows if d == row_dim else box_cols if d == rank - 1 else 1 for d in range(rank))


# ---------------------------------------------------------------------------
# The walk: one role's view of the kernel body
# ---------------------------------------------------------------------------

_NONE, _PRODUCER, _CONSUMER = None, "producer", "consumer"


@dataclass
class _Lowering:
    """Rewrites one role's copy of a kernel body (the whole body without warp specialization),
    carrying the pipeline state (`phase`, `armed`, `filled`, `free_phase` bits per pipeline)
    through its loops."""

    pipes: dict[SSAValue, _Pipe]
    maps: dict[tuple, SSAValue]             # (kernel argument, box) -> its tensor_map
    role: str | None
    consumer_threads: int
    cluster: int = 1                                    # the blocks that copy cluster-shared tiles together
    state: dict[tuple[str, int], SSAValue] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)      # pipes whose next read waits for its stage
    pending: list = field(default_factory=list)         # tma_loads of the group being issued
    guarded: bool = False                               # warp-specialized: the copies after a refill's barrier
    handed: set[int] = field(default_factory=set)       # ... whose pipes' stages were handed over
    claimed: set[int] = field(default_factory=set)      # cluster-filled pipes whose group being issued waited
    drained: bool = False
    after_wait: bool = False                            # the op just walked was a tile.async_wait

    def all_pipes(self) -> list[_Pipe]:
        return list({p.index: p for p in self.pipes.values()}.values())

    def keys(self) -> list[tuple[str, int]]:
        return sorted(self.state)

    # -- the walk --
    def block(self, block: Block) -> None:
        for op in list(block.ops):
            self.op(op)

    def op(self, op: Operation) -> None:
        at = _Insert(op.parent_block(), op)
        if self.guarded and not (isinstance(op, (tile.CopyAsyncOp, tile.AsyncCommitOp, tile.ReleaseStageOp))
                                 or op.dialect_name() == "arith" or _computes_index(op)):
            self.guarded = False   # (the copies a barrier guarded are issued)
        if isinstance(op, tile.CopyAsyncOp):
            self.copy(op, at)
        elif isinstance(op, tile.AsyncCommitOp):
            self.commit(op, at)
        elif isinstance(op, tile.AsyncWaitOp):
            if self.role != _PRODUCER:
                self.waiting = {p.index for p in self.all_pipes()}
            _erase(op)
            self.after_wait = True
            return
        elif isinstance(op, tile.BarrierOp):
            self.barrier(op, at)
        elif isinstance(op, tile.ReleaseStageOp):
            self.release(op, at)
        elif isinstance(op, tile.MmaTurnOp):
            self.turn(op, at)
        elif isinstance(op, tile.LoadSharedOp) and op.src in self.pipes:
            self.wait_for_stage(self.pipes[op.src], op.stage, at)
        elif isinstance(op, scf.ForOp):
            self.loop(op)
        elif isinstance(op, tile.MmaWaitOp):
            if (self.role is _NONE and op.pending.value.data == 0 and not self.drained
                    and not _inside_control_flow(op)):
                self.drain(_Insert(op.parent_block(), op.next_op))
        elif isinstance(op, tile.ReturnOp) and self.role is _NONE and not self.drained:
            self.drain(at)
        self.after_wait = False

    # -- copies --
    def copy(self, op: tile.CopyAsyncOp, at: _Insert) -> None:
        pipe = self.pipes[op.dst]
        if self.guarded and pipe.index not in self.handed:
            self.handed.add(pipe.index)
            self.hand_over(pipe, op.stage, at)
        if self.role is not _NONE:
            key = ("used", pipe.index)
            self.state[key] = at(arith.OrIOp(self.state[key], at.stage_bit(op.stage)))
        if self.role is _NONE and pipe.free is not None and pipe.index not in self.claimed:
            self.claim(pipe, op.stage, at)
        if self.role == _CONSUMER:
            _erase(op)
            return
        src, dst = op.src, op.dst
        box = _box(op, self.cluster)
        copies = multicast(op, self.cluster)
        tmap = self.maps[(src, box)]
        rows, cols = dst.type.get_shape()[1:]
        first_row = op.rows[0]   # (a copy of part of the stage: its rows of each box-wide column span)
        box_cols, row_bytes = box[-1], _row_bytes(op)
        offsets = _byte_a_coords(op, at) if BYTE_A_ROWS in op.attributes else list(op.offsets)
        for j in range(cols // box_cols):
            inner = offsets[-1] if j == 0 else at(arith.AddiOp(offsets[-1], at.index(j * box_cols)))
            self.pending.append(target.TmaLoadOp(tmap, [*offsets[:-1], inner], dst, op.stage,
                                                 (j * rows + first_row) * row_bytes, pipe.full, copies))
        _erase(op)

    def commit(self, op: tile.AsyncCommitOp, at: _Insert) -> None:
        if self.role == _CONSUMER or not self.pending:
            _erase(op)
            return
        stages = {load.stage for load in self.pending}
        if len(stages) != 1:
            raise ValueError("a group of TMA copies must fill one stage")
        stage = stages.pop()
        pipe = self.pipes[self.pending[0].dst]
        nbytes = sum(load.tensor_map.type.box_bytes * load.copies for load in self.pending)
        at(target.MBarrierArriveExpectTxOp(pipe.full, stage, nbytes))
        for load in self.pending:
            at(load)
        self.pending = []
        self.claimed.discard(pipe.index)
        bit = at.stage_bit(stage)
        self.state[("armed", pipe.index)] = at(arith.OrIOp(self.state[("armed", pipe.index)], bit))
        if self.role == _PRODUCER:
            self.state[("filled", pipe.index)] = at(arith.XOrIOp(self.state[("filled", pipe.index)], bit))
        _erase(op)

    # -- waits --
    def wait_for_stage(self, pipe: _Pipe, stage: SSAValue, at: _Insert) -> None:
        """The first read of a pipeline's stage after a `tile.async_wait` waits for its phase."""
        if pipe.index not in self.waiting:
            return
        self.waiting.discard(pipe.index)
        phase = self.state[("phase", pipe.index)]
        at(target.MBarrierTryWaitOp(pipe.full, stage, at.bit_of(phase, stage)))
        bit = at.stage_bit(stage)
        self.state[("phase", pipe.index)] = at(arith.XOrIOp(phase, bit))
        if self.role is _NONE:
            cleared = at(arith.XOrIOp(bit, at.i32(-1)))
            self.state[("armed", pipe.index)] = at(arith.AndIOp(self.state[("armed", pipe.index)], cleared))

    def drain(self, at: _Insert) -> None:
        """Before the block exits, every stage still armed (copies issued for steps the loop did not
        reach) is waited for: no bulk copy may still be writing the shared memory of a finished
        block. Placed at the first wait for all mmas after the pipelined loop (ptxas serializes
        wgmmas whose pipeline a drain after the epilogue crosses), else at the exit."""
        self.drained = True
        self._wait_armed_stages(at, lambda inside, pipe, stage: inside.bit_of(self.state[("phase", pipe.index)], stage))

    def drain_fills(self, at: _Insert) -> None:
        """The producer's exit: for every stage it ever filled, wait until its last fill landed (the
        parity of that fill's phase is the stage's fill count - 1), consumed or not."""
        def last_fill(inside, pipe, stage):
            return inside(arith.XOrIOp(inside.bit_of(self.state[("filled", pipe.index)], stage), inside.i32(1)))
        self._wait_armed_stages(at, last_fill)

    def _wait_armed_stages(self, at: _Insert, parity_of) -> None:
        """For each stage of each pipeline whose `armed` bit is set, a wait on the phase of parity
        `parity_of(builder, pipe, stage)`."""
        for pipe in self.all_pipes():
            for s in range(pipe.stages):
                stage = at.index(s)
                armed = at.bit_of(self.state[("armed", pipe.index)], stage)
                cond = at(tile.CmpiOp(armed, at.i32(0), "ne"))
                body = Block()
                inside = _Insert(body, None)
                inside(target.MBarrierTryWaitOp(pipe.full, stage, parity_of(inside, pipe, stage)))
                inside(scf.YieldOp())
                at(scf.IfOp(cond, [], Region(body)))

    # -- barriers --
    def barrier(self, op: tile.BarrierOp, at: _Insert) -> None:
        """A barrier that only publishes copies goes (the stage's mbarrier does that). In a
        warp-specialized kernel, the barrier guarding a refill becomes the stage handshake at the
        copy (`hand_over`), any other one a barrier of the computing warps alone."""
        if self.after_wait and not _guards_refill(op):
            _erase(op)
            return
        if self.role is _NONE:
            return   # a block barrier (tile_to_target's pattern)
        if _guards_refill(op):
            self.guarded, self.handed = True, set()
        elif self.role == _CONSUMER:
            at(target.BarrierOp(target.CONSUMER_BARRIER, self.consumer_threads))
        _erase(op)

    def hand_over(self, pipe: _Pipe, stage: SSAValue, at: _Insert) -> None:
        """The first copy into a pipeline after a barrier guarding refills, where the stage was
        filled before (its `used` bit, which both roles keep alike; a stage's first fill waits for
        nothing): each computing warp arrives on the stage's free mbarrier (one lane, once the
        warp's reads are done: one arrive per thread costs 256 shared atomics a stage), the
        producer waits for its current phase. Every pipeline the guarded copies fill is handed over
        (flash attention ahead refills a value and a key stage after one barrier)."""
        guard = at(tile.CmpiOp(at.bit_of(self.state[("used", pipe.index)], stage), at.i32(0), "ne"))
        body = Block()
        inside = _Insert(body, None)
        if self.role == _CONSUMER:
            inside(target.MBarrierArriveOp(pipe.free, stage, "warp"))
            inside(scf.YieldOp())
            at(scf.IfOp(guard, [], Region(body)))
            return
        key = ("free_phase", pipe.index)
        phases = self.state[key]
        inside(target.MBarrierTryWaitOp(pipe.free, stage, inside.bit_of(phases, stage)))
        flipped = inside(arith.XOrIOp(phases, inside.stage_bit(stage)))
        inside(scf.YieldOp(flipped))
        other = Block()
        other.add_op(scf.YieldOp(phases))
        self.state[key] = at(scf.IfOp(guard, [i32], Region(body), Region(other)))

    # -- stages a cluster fills together --
    def release(self, op: tile.ReleaseStageOp, at: _Insert) -> None:
        """This block is done with a stage (the barrier before says so of every thread): for a
        pipeline the cluster fills, its issuing thread tells every block of the cluster; elsewhere
        the barrier said it all."""
        pipe = self.pipes[op.buf]
        if self.role is _NONE and pipe.free is not None:
            at(target.MBarrierArriveOp(pipe.free, op.stage, "cluster"))
        _erase(op)

    def claim(self, pipe: _Pipe, stage: SSAValue, at: _Insert) -> None:
        """Before a copy group fills a stage the cluster fills together: wait until every block has
        released the stage's previous contents (the free mbarrier's next phase)."""
        self.claimed.add(pipe.index)
        key = ("free_phase", pipe.index)
        at(target.MBarrierTryWaitOp(pipe.free, stage, at.bit_of(self.state[key], stage)))
        self.state[key] = at(arith.XOrIOp(self.state[key], at.stage_bit(stage)))

    # -- warpgroups taking turns --
    def turn(self, op: tile.MmaTurnOp, at: _Insert) -> None:
        """The computing warpgroups of a warp-specialized kernel take turns at their mmas; the
        producer issues none, and without one the block barriers keep every warp in step anyway."""
        if self.role == _CONSUMER:
            at(target.WarpgroupTurnOp(op.action.data, None if op.warpgroup is None else op.warpgroup.value.data))
        _erase(op)

    # -- loops --
    def loop(self, op: scf.ForOp) -> None:
        """Walks the body with the state of the pipelines it touches carried through the loop as
        iter_args."""
        touched = {self.pipes[v].index for inner in op.walk() for v in inner.operands if v in self.pipes}
        keys = [k for k in self.keys() if k[1] in touched]
        if not keys:
            self.block(op.body.block)
            return
        body = op.body.block
        n = len(op.iter_args)
        args = [body.insert_arg(i32, len(body.args)) for _ in keys]
        outer = dict(self.state)
        self.state.update(zip(keys, args))
        self.block(body)
        yield_op = body.last_op
        yield_op.operands = [*yield_op.operands, *(self.state[k] for k in keys)]
        new = scf.ForOp(op.lb, op.ub, op.step, [*op.iter_args, *(outer[k] for k in keys)], op.detach_region(op.body))
        op.parent_block().insert_op_before(new, op)
        for old, res in zip(op.results, new.results[:n]):
            old.replace_all_uses_with(res)
        _erase(op)
        self.state.update(zip(keys, new.results[n:]))


def _erase(op: Operation, safe: bool = True) -> None:
    op.parent_block().erase_op(op, safe_erase=safe)


def _inside_control_flow(op: Operation) -> bool:
    parent = op.parent_op()
    while parent is not None:
        if isinstance(parent, (scf.ForOp, scf.IfOp)):
            return True
        parent = parent.parent_op()
    return False


def _guards_refill(op: Operation) -> bool:
    """Whether the next op after `op`, index arithmetic (a paged copy's table read and the choice
    of its page included) and stage releases aside, is a copy into a shared stage."""
    nxt = op.next_op
    while nxt is not None and (nxt.dialect_name() == "arith" or _computes_index(nxt)
                               or isinstance(nxt, tile.ReleaseStageOp)):
        nxt = nxt.next_op
    return isinstance(nxt, tile.CopyAsyncOp)


def _computes_index(op: Operation) -> bool:
    return isinstance(op, (*tile.INDEX_READS, tile.ProgramIdOp, tile.CmpiOp, tile.SelectOp)) and not is_tile(op.results[0])


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


def lower_tma_pipelines(kernel: tile.KernelOp, platform: Platform, producer_warps: int) -> RegisterSplit | None:
    """Rewrites the pipelines of `kernel`, whose copies use TMA on `platform`, into the explicit
    protocol (see the module docstring); with `producer_warps`, into a warp_specialize op.
    Returns the register split the kernel is launched with, if any."""
    pipes = _pipes(kernel)
    if not pipes:
        return None
    block = kernel.body.block
    if any(isinstance(op, tile.AllocSharedOp) and op.parent_block() is not block for op in kernel.walk()):
        raise ValueError("shared buffers must be allocated at the kernel's top level")
    allocs = [op for op in block.ops if isinstance(op, tile.AllocSharedOp)]
    for op in allocs:   # first (they read nothing): every role of a warp-specialized kernel shares them
        op.detach()
    block.insert_ops_before(allocs, block.first_op)
    at = _Insert(block, allocs[-1].next_op)
    cluster = 1 if producer_warps else tile.cluster_size(kernel)   # (blocks copying shared tiles together)
    maps = _tensor_maps(kernel, at, cluster)
    warps = kernel.num_warps.value.data
    consumers = 32 * warps
    all_pipes = list({p.index: p for p in pipes.values()}.values())
    shared = {pipes[op.dst].index for op in kernel.walk()
              if isinstance(op, tile.CopyAsyncOp) and multicast(op, cluster) > 1}
    for pipe in all_pipes:
        pipe.full = at(target.MBarrierAllocOp(pipe.stages))
        at(target.MBarrierInitOp(pipe.full, 1))
        if producer_warps or pipe.index in shared:
            pipe.free = at(target.MBarrierAllocOp(pipe.stages))
            at(target.MBarrierInitOp(pipe.free, warps if producer_warps else cluster))
    at(target.FenceOp("mbarrier_init"))
    at(target.BarrierOp())
    if shared:   # (no block copies into another's stages, or arrives on its mbarriers, before its init)
        _meet_cluster(at)
        _meet_cluster(_Insert(block, block.last_op))   # (nor after it exits)
    rest = _ops_from(at.before)
    if not producer_warps:
        lowering = _Lowering(pipes, maps, _NONE, consumers, cluster)
        lowering.state = {(k, p.index): at.i32(0) for p in all_pipes for k in ("phase", "armed")}
        lowering.state.update({("free_phase", p.index): at.i32(0) for p in all_pipes if p.free is not None})
        for op in rest:
            lowering.op(op)
        return None
    split = register_split(platform, consumers + 32 * producer_warps, 32 * producer_warps)
    body = [op for op in rest if not isinstance(op, tile.ReturnOp)]
    regions = [_role_region(body, role, keys, _Lowering(pipes, maps, role, consumers), all_pipes, split)
               for role, keys in ((_PRODUCER, ("armed", "filled", "free_phase", "used")),
                                  (_CONSUMER, ("phase", "used")))]
    for op in reversed(body):
        _erase(op, safe=False)
    block.insert_op_before(target.WarpSpecializeOp(producer_warps, *regions), block.last_op)
    return split


def _role_region(ops: list[Operation], role: str, keys: tuple[str, ...], lowering: _Lowering,
                 pipes: list[_Pipe], split: RegisterSplit | None) -> Region:
    """A warp_specialize region: a copy of `ops` lowered for `role`, starting with its register
    split; the producer's keeps no tiles and ends waiting for its last fills."""
    body = Block()
    mapping: dict = {}
    for op in ops:
        body.add_op(op.clone(mapping))
    inside = _Insert(body, body.first_op)
    if split:
        producer = role == _PRODUCER
        inside(target.SetMaxNRegOp("dec" if producer else "inc", split.producer if producer else split.consumer))
    lowering.state = {(k, p.index): inside.i32(0) for p in pipes for k in keys}
    lowering.block(body)
    if role == _PRODUCER:
        lowering.drain_fills(_Insert(body, None))
        _drop_tiles(body)
    _erase_dead(body)
    return Region(body)


def _meet_cluster(at: _Insert) -> None:
    """Every thread of every block of the cluster meets here."""
    at(target.ClusterBarrierOp("arrive"))
    at(target.ClusterBarrierOp("wait"))


def _ops_from(first: Operation | None) -> list[Operation]:
    """`first` and the ops after it in its block."""
    ops, op = [], first
    while op is not None:
        ops.append(op)
        op = op.next_op
    return ops


def _tensor_maps(kernel: tile.KernelOp, at: _Insert, cluster: int) -> dict[tuple, SSAValue]:
    """A tensor_map per (kernel argument, box) the kernel's copies read, in first-use order."""
    maps: dict[tuple, SSAValue] = {}
    for op in kernel.walk():
        if isinstance(op, tile.CopyAsyncOp):
            src = op.src
            box = _box(op, cluster)
            if (src, box) not in maps:
                t: MemRefType = src.type
                if BYTE_A_ROWS in op.attributes:
                    maps[(src, box)] = at(target.TensorMapOp(src, target.TensorMapType.byte_a_rows(
                        t.get_element_type(), t.get_shape(), t.get_strides(), box[0] * 16, box[-1],
                        swizzle=_row_bytes(op)), byte_a_rows=True))
                    continue
                strides = tile.element_strides(t) if tile.is_strided(t) else None   # (None: row-major's)
                maps[(src, box)] = at(target.TensorMapOp(src, target.TensorMapType.of(
                    t.get_element_type(), t.get_shape(), box, swizzle=_row_bytes(op), strides=strides)))
    return maps


def _byte_a_coords(op: tile.CopyAsyncOp, at: _Insert) -> list[SSAValue]:
    """The coordinates of a permuted key copy's box (`TensorMapType.byte_a_rows`), outermost
    first: the 16-row group of its first row in the tensor's one run of rows, 0 along the three
    dims within a group, then the copy's column offset. Its rows' offsets are 16-aligned
    (`byte_fragments`), and so is every outer dim's run of rows."""
    shape, offsets = op.src.type.get_shape(), list(op.offsets)
    group = at(arith.ShRUIOp(offsets[-2], at.index(4)))
    rows = 1
    for d in range(len(shape) - 3, -1, -1):
        rows *= shape[d + 1]
        group = at(arith.AddiOp(group, at(arith.MuliOp(offsets[d], at.index(rows // 16)))))
    return [group, *(at.index(0) for _ in range(3)), offsets[-1]]


_KEEP_IN_PRODUCER = (scf.ForOp, scf.IfOp, scf.YieldOp)


def _drop_tiles(block: Block) -> None:
    """The producer computes no tiles: ops on tiles go, loops stop carrying them."""
    for op in reversed(list(block.ops)):
        if isinstance(op, scf.ForOp):
            _drop_tile_iter_args(op)
            continue
        if isinstance(op, scf.IfOp):
            _drop_tile_results(op)
            continue
        if isinstance(op, (tile.MmaWaitOp, tile.StoreOp)) or (
                not isinstance(op, _KEEP_IN_PRODUCER)
                and any(is_tile(v) for v in (*op.operands, *op.results))):
            _erase(op, safe=False)


def _drop_tile_results(branch: scf.IfOp) -> None:
    """An scf.if in the producer: its branches without their tiles, and without the tile results
    (a block's mask, chosen where the block is cut) -- gone when nothing else is left."""
    blocks = [block for region in branch.regions for block in region.blocks]
    for block in blocks:
        _drop_tiles(block)
    keep = [i for i, v in enumerate(branch.results) if not is_tile(v)]
    if len(keep) == len(branch.results):
        return
    for block in blocks:
        block.last_op.operands = [block.last_op.operands[i] for i in keep]
    if not keep and all(len(block.ops) == 1 for block in blocks):
        _erase(branch, safe=False)
        return
    regions = [branch.detach_region(region) for region in list(branch.regions)]
    new = scf.IfOp(branch.cond, [branch.results[i].type for i in keep], *regions)
    branch.parent_block().insert_op_before(new, branch)
    for j, i in enumerate(keep):
        branch.results[i].replace_all_uses_with(new.results[j])
    _erase(branch, safe=False)


def _drop_tile_iter_args(loop: scf.ForOp) -> None:
    _drop_tiles(loop.body.block)
    body = loop.body.block
    keep = [i for i, v in enumerate(loop.iter_args) if not is_tile(v)]
    if len(keep) == len(loop.iter_args):
        return
    yield_op = body.last_op
    yield_op.operands = [yield_op.operands[i] for i in keep]
    for i in reversed(range(len(loop.iter_args))):
        if i not in keep:
            arg = body.args[i + 1]
            for use in list(arg.uses):
                _erase(use.operation, safe=False)
            body.erase_arg(arg, safe_erase=False)
    new = scf.ForOp(loop.lb, loop.ub, loop.step, [loop.iter_args[i] for i in keep], loop.detach_region(loop.body))
    loop.parent_block().insert_op_before(new, loop)
    for j, i in enumerate(keep):
        loop.results[i].replace_all_uses_with(new.results[j])
    _erase(loop, safe=False)


_PURE = (arith.ConstantOp, arith.AddiOp, arith.SubiOp, arith.MuliOp, arith.DivSIOp, arith.RemSIOp, arith.MinSIOp,
         arith.MaxSIOp, arith.AndIOp, arith.OrIOp, arith.XOrIOp, arith.ShLIOp, arith.ShRUIOp, arith.IndexCastOp,
         tile.ProgramIdOp, tile.CmpiOp, tile.SelectOp, *tile.INDEX_READS)


def _erase_dead(block: Block) -> None:
    """Scalar arithmetic nothing reads (a role's share of code computed for the other) goes."""
    changed = True
    while changed:
        changed = False
        for op in reversed(list(block.walk())):
            if isinstance(op, _PURE) and all(not r.uses for r in op.results):
                _erase(op)
                changed = True
