"""Reductions of a 2-D tile along either axis (sum, max, min): the registers of a row (column) a
thread holds, then its lanes with `shfl.sync.bfly`, then, where a row (column) spans warps, the
warps through shared memory; and row statistics gathered from the blocks of a thread-block
cluster, through distributed shared memory.
"""
from __future__ import annotations

from typing import Callable

from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Blocked, Slice
from ...lowering.shared_memory import CLUSTER_MBARRIER_BYTES, cluster_exchange_rows
from .arithmetic import emit_nan_minmax
from .core import KernelEmitter
from .types import F32, PRED, S32, U64, UnsupportedByBackend, ptx_type


def _instruction(name: str) -> Callable[[KernelEmitter, str, str, str], None]:
    return lambda e, r, a, b: e.emit(f"{name} {r}, {a}, {b};")


def _float_extreme(kind: str) -> Callable[[KernelEmitter, str, str, str], None]:
    return lambda e, r, a, b: emit_nan_minmax(e, kind, r, a, b)   # (NaN-propagating on any arch)


#: (kind, register type) -> what emits r = a combined with b
_COMBINE = {("sum", "f32"): _instruction("add.f32"), ("max", "f32"): _float_extreme("max"),
            ("min", "f32"): _float_extreme("min"), ("sum", "s32"): _instruction("add.s32"),
            ("max", "s32"): _instruction("max.s32"), ("min", "s32"): _instruction("min.s32")}


def _reduce(e: KernelEmitter, op: t.ReduceOp):
    """Reduction of a 2-D tile along either axis: the registers a thread holds of each kept row
    (axis 1) or column (axis 0), then its lanes (butterfly shuffles), then its warps (shared memory)."""
    src, axis = e.layouts[op.x], op.axis.value.data
    if axis == 0 and not isinstance(src, Blocked):
        raise UnsupportedByBackend("PTX backend: reducing the rows of an accumulator tile is not supported yet")
    ty = ptx_type(op.x.type)
    combine = _COMBINE[(op.kind.data, ty.op if ty is F32 else "s32")]
    out = e.layouts[op.result]
    regs = e.env[op.x]
    if src.over_covers(axis):
        regs = _outside_as_neutral(e, src, axis, regs, ty, _NEUTRAL[(op.kind.data, ty.op if ty is F32 else "s32")])
    partial: list[str | None] = [None] * len(out.offsets)
    for i, slot in enumerate(out.parent_register):
        if partial[slot] is None:
            partial[slot] = regs[i]
        else:
            r = e.new(ty)
            combine(e, r, partial[slot], regs[i])
            partial[slot] = r
    for mask in src.lane_masks(axis):
        for j, p in enumerate(partial):
            other, r = e.new(ty), e.new(ty)
            e.emit(f"shfl.sync.bfly.b32 {other}, {p}, {mask}, 31, -1;")
            combine(e, r, p, other)
            partial[j] = r
    if src.warps_along(axis) > 1:
        if not isinstance(src, Blocked):
            raise UnsupportedByBackend("PTX backend: reducing accumulator rows across warps is not supported yet")
        partial = _reduce_across_warps(e, op, src, out, partial, ty, combine)
    e.env[op.result] = partial


#: what an element outside the tile contributes to a reduction
_NEUTRAL = {("sum", "f32"): "0f00000000", ("max", "f32"): "0fFF800000", ("min", "f32"): "0f7F800000",
            ("sum", "s32"): "0", ("max", "s32"): "-2147483648", ("min", "s32"): "2147483647"}


def _outside_as_neutral(e: KernelEmitter, src: Blocked, axis: int, regs: list[str], ty, neutral: str) -> list[str]:
    """`regs` with the elements a thread holds past the tile along `axis` (where the layout covers
    more than the tile: a [1, 64] tile on a warp of 4 x 8 lanes) replaced by the reduction's
    neutral value, so that the exchanges along `axis` count each element of the tile once."""
    base, extent = e.base(src.base_keys[axis]), src.shape[axis]
    out, inside = [], {}
    for r, off in zip(regs, src.offsets):
        if off[axis] not in inside:
            p = e.new(PRED)
            e.emit(f"setp.lt.s32 {p}, {base}, {extent - off[axis]};")
            inside[off[axis]] = p
        q = e.new(ty)
        e.emit(f"selp.{'f32' if ty is F32 else 's32'} {q}, {r}, {neutral}, {inside[off[axis]]};")
        out.append(q)
    return out


def _reduce_across_warps(e: KernelEmitter, op: t.ReduceOp, src: Blocked, out: Slice, partial, ty, combine):
    """The warps' partials of each kept row (column, for axis 0) meet in the reduction's scratch
    (`tessera_target.scratch`, 4 bytes per kept index per warp along the reduced axis, placed by the
    allocation pass) between two block barriers."""
    axis = op.axis.value.data
    kept = 1 - axis
    extent, warps = src.cover[kept] * src.reps[kept], src.warps_along(axis)
    scratch = op.attributes.get(tgt.SCRATCH)
    if scratch is None or scratch.size.data < 4 * extent * warps:
        raise UnsupportedByBackend(f"PTX backend: a reduction across {warps} warps needs "
                                   f"{4 * extent * warps} bytes of tessera_target.scratch (the shared-memory "
                                   f"allocation pass places it), got {scratch}")
    tid, lane, warp = e.tid()
    lane_c, lane_r = e.divmod(lane, src.tc)
    warp_c, warp_r = e.divmod(warp, src.wc)
    lane_along, warp_along = (lane_c, warp_c) if axis == 1 else (lane_r, warp_r)
    index = e.base(src.base_keys[kept])
    leader = e.new(PRED)
    e.emit(f"setp.eq.s32 {leader}, {lane_along}, 0;")
    base = e.new(S32)
    e.emit(f"mad.lo.s32 {base}, {warp_along}, {extent}, {index};")
    addr = e.new(U64)
    e.emit(f"cvt.u64.u32 {addr}, {e.smem_base()};")
    e.emit(f"add.s64 {addr}, {addr}, {scratch.offset.data};")
    mine = e.new(U64)
    e.emit(f"mul.wide.s32 {mine}, {base}, 4;")
    e.emit(f"add.s64 {mine}, {addr}, {mine};")
    e.emit("bar.sync 0;")
    for (off,), p in zip(out.offsets, partial):
        e.emit(f"@{leader} st.shared.b32 [{mine}+{4 * off}], {p};")
    e.emit("bar.sync 0;")
    kept_addr = e.new(U64)
    e.emit(f"mul.wide.s32 {kept_addr}, {index}, 4;")
    e.emit(f"add.s64 {kept_addr}, {addr}, {kept_addr};")
    result = []
    for (off,) in out.offsets:
        acc = None
        for w in range(warps):
            v = e.new(ty)
            e.emit(f"ld.shared.b32 {v}, [{kept_addr}+{4 * (off + w * extent)}];")
            if acc is None:
                acc = v
            else:
                r = e.new(ty)
                combine(e, r, acc, v)
                acc = r
        result.append(acc)
    return result


def _cluster_gather(e: KernelEmitter, op: t.ClusterGatherOp):
    """Row statistics gathered from every block of the kernel's cluster through distributed shared
    memory: thread 0 arms the gather's mbarrier for the bytes every block will send it, the
    threads holding column 0 of each row write the block's values into its rank's slots of every
    block's buffer, each write completing its share of that block's mbarrier (`st.async` ...
    `complete_tx`), and every thread waits on its own block's mbarrier, then reads the slots of
    its rows. No block waits for the others to arrive anywhere, only for their values. A
    double-buffered one (in a loop, after the block barrier the lowering put before it) takes its
    two buffers and mbarriers in turn, by a count of its runs; why that is enough across the
    cluster: `tgt.ClusterBarrierOp`."""
    layouts = [e.layouts[x] for x in op.xs]
    if any(not isinstance(layout.parent, Blocked) for layout in layouts):
        raise UnsupportedByBackend("PTX backend: a cluster gather of accumulator rows is not supported yet")
    if any(x.type.get_element_type().bitwidth != 32 for x in op.xs):
        raise UnsupportedByBackend("PTX backend: a cluster gather exchanges 32-bit values (row statistics in "
                                   f"f32 or i32), got {', '.join(str(x.type) for x in op.xs)}")
    size = e.kernel.cluster.value.data
    double = tgt.DOUBLE_BUFFERED in op.attributes
    rows = [cluster_exchange_rows(layout) for layout in layouts]
    buffers = 2 if double else 1
    data = 4 * sum(rows) * size
    scratch = op.attributes.get(tgt.SCRATCH)
    if scratch is None or scratch.size.data < buffers * (CLUSTER_MBARRIER_BYTES + data) or scratch.offset.data % 8:
        raise UnsupportedByBackend(f"PTX backend: a cluster gather over {size} blocks needs {buffers} x "
                                   f"{CLUSTER_MBARRIER_BYTES + data} bytes of tessera_target.scratch at an 8-byte "
                                   f"offset (the shared-memory allocation pass places it), got {scratch}")
    first_bar = e.new(S32)
    e.at_entry(f"add.s32 {first_bar}, {e.smem_base()}, {scratch.offset.data};")
    thread0 = _thread0(e)
    for k in range(buffers):   # (made visible to the cluster by the kernel's first meeting: ClusterBarrierOp)
        e.at_entry(f"@{thread0} mbarrier.init.shared::cta.b64 [{first_bar}+{8 * k}], 1;")
    e.at_entry("fence.mbarrier_init.release.cluster;")
    bar, base = e.new(S32), e.new(S32)
    if double:
        runs, which, phase = e.new(S32), e.new(S32), e.new(S32)
        e.at_entry(f"mov.u32 {runs}, 0;")
        e.emit(f"and.b32 {which}, {runs}, 1;")
        e.emit(f"bfe.u32 {phase}, {runs}, 1, 1;")
        e.emit(f"add.s32 {runs}, {runs}, 1;")
        e.emit(f"mad.lo.s32 {bar}, {which}, 8, {first_bar};")
        e.emit(f"mad.lo.s32 {base}, {which}, {data}, {first_bar};")
        e.emit(f"add.s32 {base}, {base}, {buffers * CLUSTER_MBARRIER_BYTES};")
    else:
        phase = "0"
        e.emit(f"mov.u32 {bar}, {first_bar};")
        e.emit(f"add.s32 {base}, {first_bar}, {CLUSTER_MBARRIER_BYTES};")
    e.emit(f"@{thread0} mbarrier.arrive.expect_tx.shared::cta.b64 _, [{bar}], {data};")
    rank = e.cluster_rank()
    remote_bars = []
    for peer in range(size):
        there = e.new(S32)
        e.emit(f"mapa.shared::cluster.u32 {there}, {bar}, {peer};")
        remote_bars.append(there)
    _, lane, warp = e.tid()
    region, placed = 0, []   # (each operand's region of the buffer: its rows from every rank)
    for x, layout, n in zip(op.xs, layouts, rows):
        parent, keep = layout.parent, layout.keep
        lane_c, lane_r = e.divmod(lane, parent.tc)
        warp_c, warp_r = e.divmod(warp, parent.wc)
        across = e.new(S32)
        e.emit(f"or.b32 {across}, {lane_c if keep == 0 else lane_r}, {warp_c if keep == 0 else warp_r};")
        writer = e.new(PRED)
        e.emit(f"setp.eq.s32 {writer}, {across}, 0;")
        first = e.new(S32)   # (rank 0's slot of the thread's first row)
        e.emit(f"mad.lo.s32 {first}, {e.base(parent.base_keys[keep])}, 4, {base};")
        if region:
            e.emit(f"add.s32 {first}, {first}, {region};")
        mine = e.new(S32)
        e.emit(f"mad.lo.s32 {mine}, {rank}, {4 * n}, {first};")
        for peer, remote_bar in enumerate(remote_bars):
            there = e.new(S32)
            e.emit(f"mapa.shared::cluster.u32 {there}, {mine}, {peer};")
            for (off,), v in zip(layout.offsets, e.env[x]):
                e.emit(f"@{writer} st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [{there}+{4 * off}], "
                       f"{v}, [{remote_bar}];")
        placed.append((first, n))
        region += 4 * n * size
    done, again = e.new(PRED), e.label("cluster_values")
    e.lines.append(f"{again}:")
    e.emit(f"mbarrier.try_wait.parity.shared::cta.b64 {done}, [{bar}], {phase};")
    e.emit(f"@!{done} bra {again};")
    for i, (layout, (first, n)) in enumerate(zip(layouts, placed)):
        for peer, result in enumerate(op.of(i)):
            values = []
            for (off,) in layout.offsets:
                v = e.new(ptx_type(result.type))
                e.emit(f"ld.shared.b32 {v}, [{first}+{4 * (off + peer * n)}];")
                values.append(v)
            e.env[result] = values


def _thread0(e: KernelEmitter) -> str:
    """Thread 0's predicate, computed at entry (it initialises and arms the cluster gathers' mbarriers)."""
    if "cluster_thread0" not in e.state:
        tid, thread0 = e.new(S32), e.new(PRED)
        e.at_entry(f"mov.u32 {tid}, %tid.x;")
        e.at_entry(f"setp.eq.u32 {thread0}, {tid}, 0;")
        e.state["cluster_thread0"] = thread0
    return e.state["cluster_thread0"]


def _cluster_barrier(e: KernelEmitter, op: tgt.ClusterBarrierOp) -> None:
    e.emit(f"barrier.cluster.{op.phase.data}.aligned;")


#: reductions
HANDLERS: dict[type, Callable] = {
    t.ReduceOp: _reduce,
}
#: ... gathered across a thread-block cluster (the platforms with clusters: Hopper's code path)
CLUSTER_HANDLERS: dict[type, Callable] = {
    t.ClusterGatherOp: _cluster_gather,
    tgt.ClusterBarrierOp: _cluster_barrier,
}
