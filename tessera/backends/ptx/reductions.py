"""Reductions of a 2-D tile along either axis (sum, max, min): the registers of a row (column) a
thread holds, then its lanes with `shfl.sync.bfly`, then, where a row (column) spans warps, the
warps through shared memory.
"""
from __future__ import annotations

from typing import Callable

from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Blocked, Slice
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


#: reductions
HANDLERS: dict[type, Callable] = {
    t.ReduceOp: _reduce,
}
