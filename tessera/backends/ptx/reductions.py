"""Row reductions of a 2-D tile (sum, max, min): the registers of a row a thread holds, then its
lanes with `shfl.sync.bfly`, then, where a row spans warps, the warps through shared memory.
"""
from __future__ import annotations

from typing import Callable

from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Blocked, Slice
from .core import KernelEmitter
from .types import F32, PRED, S32, U64, UnsupportedByBackend, ptx_type


_COMBINE = {("sum", "f32"): "add.f32", ("max", "f32"): "max.NaN.f32", ("min", "f32"): "min.NaN.f32",
            ("sum", "s32"): "add.s32", ("max", "s32"): "max.s32", ("min", "s32"): "min.s32"}


def _reduce(e: KernelEmitter, op: t.ReduceOp):
    """Row reduction: registers of a row, then lanes (butterfly shuffles), then warps (shared memory)."""
    src = e.layouts[op.x]
    if op.axis.value.data != 1:
        raise UnsupportedByBackend("PTX backend: only reductions over the columns of a 2-D tile are supported yet")
    ty = ptx_type(op.x.type)
    combine = _COMBINE[(op.kind.data, ty.op if ty is F32 else "s32")]
    out = e.layouts[op.result]
    regs = e.env[op.x]
    partial: list[str | None] = [None] * len(out.offsets)
    for i, slot in enumerate(out.parent_register):
        if partial[slot] is None:
            partial[slot] = regs[i]
        else:
            r = e.new(ty)
            e.emit(f"{combine} {r}, {partial[slot]}, {regs[i]};")
            partial[slot] = r
    for mask in src.lane_masks(1):
        for j, p in enumerate(partial):
            other, r = e.new(ty), e.new(ty)
            e.emit(f"shfl.sync.bfly.b32 {other}, {p}, {mask}, 31, -1;")
            e.emit(f"{combine} {r}, {p}, {other};")
            partial[j] = r
    if src.warps_along(1) > 1:
        if not isinstance(src, Blocked):
            raise UnsupportedByBackend("PTX backend: reducing accumulator rows across warps is not supported yet")
        partial = _reduce_across_warps(e, op, src, out, partial, ty, combine)
    e.env[op.result] = partial


def _reduce_across_warps(e: KernelEmitter, op: t.ReduceOp, src: Blocked, out: Slice, partial, ty, combine):
    """The warps' partials of each row meet in the reduction's scratch (`tessera_target.scratch`,
    4 bytes per row per warp, placed by the allocation pass) between two block barriers."""
    rows = src.cover[0] * src.reps[0]
    scratch = op.attributes.get(tgt.SCRATCH)
    if scratch is None or scratch.size.data < 4 * rows * src.wc:
        raise UnsupportedByBackend(f"PTX backend: a row reduction across {src.wc} warps needs "
                                   f"{4 * rows * src.wc} bytes of tessera_target.scratch (the shared-memory "
                                   f"allocation pass places it), got {scratch}")
    tid, lane, warp = e.tid()
    lane_c, _ = e.divmod(lane, src.tc)
    warp_c, _ = e.divmod(warp, src.wc)
    row = e.base(src.base_keys[0])
    leader = e.new(PRED)
    e.emit(f"setp.eq.s32 {leader}, {lane_c}, 0;")
    base = e.new(S32)
    e.emit(f"mad.lo.s32 {base}, {warp_c}, {rows}, {row};")
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
    row_addr = e.new(U64)
    e.emit(f"mul.wide.s32 {row_addr}, {row}, 4;")
    e.emit(f"add.s64 {row_addr}, {addr}, {row_addr};")
    result = []
    for (off,) in out.offsets:
        acc = None
        for w in range(src.wc):
            v = e.new(ty)
            e.emit(f"ld.shared.b32 {v}, [{row_addr}+{4 * (off + w * rows)}];")
            if acc is None:
                acc = v
            else:
                r = e.new(ty)
                e.emit(f"{combine} {r}, {acc}, {v};")
                acc = r
        result.append(acc)
    return result


#: row reductions
HANDLERS: dict[type, Callable] = {
    t.ReduceOp: _reduce,
}
