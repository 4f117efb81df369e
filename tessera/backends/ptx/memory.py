"""Tile loads and stores in global memory, predicated per element against the tensor bounds (tails)
and the tile extent, in vectors of up to 16 bytes where registers hold consecutive elements. A
store the allocation pass staged (`tessera_target.staging`, `lowering.shared_memory`) writes an
accumulator tile through a shared buffer per warp, in 16-byte row-contiguous stores
(`emit_staged_store`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from xdsl.dialects.builtin import MemRefType
from xdsl.ir import SSAValue

from ...ir import index_facts
from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Layout, Mma
from ...lowering.assign_layouts import is_tile
from ...lowering.shared_memory import Staging
from . import hopper
from .core import KernelEmitter, pack_words, vector_load
from .types import (B8, PRED, S32, U64, PtxType, UnsupportedByBackend, braced, mov_constant, ptx_type, storage_suffix,
                    vector_suffix)


def _memory_access(e: KernelEmitter, memref: SSAValue, offsets, tile_dims, layout: Layout):
    """Per element: byte offset from a per-thread base address, and a predicate (in bounds and in tile)."""
    mt: MemRefType = memref.type
    strides = e.strides(memref, tuple(tile_dims))
    elem = ptx_type(mt).bytes
    bases, offs = e.coords(layout)
    terms = [(e.value(off), strides[d]) for d, off in enumerate(offsets)]
    terms += [(bases[k], strides[d]) for k, d in enumerate(tile_dims)]
    addr = e.element_address(e.value(memref), terms, elem, e.reach(mt))
    # bounds: coordinate along each tiled memory dim = offset + base + const
    starts = []
    for k, d in enumerate(tile_dims):
        s = e.new(S32)
        e.emit(f"add.s32 {s}, {e.value(offsets[d])}, {bases[k]};")
        starts.append(s)
    # a tile may start before the tensor only where a concatenation shifts it back
    below = [k for k, d in enumerate(tile_dims) if not index_facts.is_non_negative(offsets[d])]
    preds: dict[tuple, str] = {}
    result = []
    extents = layout.shape
    for off in offs:
        key = tuple(off)
        if key not in preds:
            p = None
            for k, d in enumerate(tile_dims):
                q = e.new(PRED)
                e.emit(f"setp.lt.s32 {q}, {starts[k]}, {e.dim_limit(memref, d, off[k])};")
                if layout.over_covers(k):
                    q2 = e.new(PRED)
                    e.emit(f"setp.lt.s32 {q2}, {bases[k]}, {extents[k] - off[k]};")
                    e.emit(f"and.pred {q}, {q}, {q2};")
                if k in below:
                    q3 = e.new(PRED)
                    e.emit(f"setp.ge.s32 {q3}, {starts[k]}, {-off[k]};")
                    e.emit(f"and.pred {q}, {q}, {q3};")
                if p is not None:
                    e.emit(f"and.pred {q}, {q}, {p};")
                p = q
            preds[key] = p
        byte = sum(o * strides[d] for o, d in zip(off, tile_dims)) * elem
        result.append((byte, preds[key]))
    return addr, result


def _load_scalar(e: KernelEmitter, op: t.LoadOp) -> None:
    """A rank-0 tile: one element, the same for the whole program (e.g. a per-head ALiBi slope)."""
    ty = ptx_type(op.result.type)
    terms = [(e.value(off), st) for off, st in zip(op.offsets, e.strides(op.src))]
    addr, r = e.element_address(e.value(op.src), terms, ty.bytes, e.reach(op.src.type)), e.new(ty)
    if ty is PRED:
        e.env[op.result] = _load_bool(e, addr, 0, None, 0.0)
        return
    e.emit(f"ld.global.{storage_suffix(ty)} {r}, [{addr}];")
    e.env[op.result] = r


def _load_index(e: KernelEmitter, op: t.LoadIndexOp) -> None:
    """One s32 element as an index (its offsets lie inside the memref, as scalar offsets do)."""
    terms = [(e.value(off), st) for off, st in zip(op.offsets, e.strides(op.src))]
    addr, r = e.element_address(e.value(op.src), terms, 4, e.reach(op.src.type)), e.new(S32)
    e.emit(f"ld.global.nc.s32 {r}, [{addr}];")
    e.env[op.result] = r


def _load_index_reduce(e: KernelEmitter, op: t.LoadIndexReduceOp) -> None:
    """The min or max of a run of s32 elements along one dim. Every warp reads it on its own, lane l
    the elements l, l + 32, ... inside the dim (the first element lies inside), and combines its
    lanes with butterfly shuffles: a few loads a thread, not one per element. In a producer region
    (one thread running) that thread reads every element itself."""
    axis, count, kind = op.axis.value.data, op.count.value.data, op.kind.data
    strides = e.strides(op.src, (axis,))
    terms = [(e.value(off), st) for off, st in zip(op.offsets, strides)]
    addr = e.element_address(e.value(op.src), terms, 4, e.reach(op.src.type))
    left = e.new(S32)                      # the run's elements inside the dim
    e.emit(f"sub.s32 {left}, {e.extent(op.src, axis)}, {e.value(op.offsets[axis])};")
    e.emit(f"min.s32 {left}, {left}, {count};")
    acc = e.new(S32)
    e.emit(f"ld.global.nc.s32 {acc}, [{addr}];")   # the first element: inside, and any lane's neutral value
    if e.role == "producer":               # one thread: each further element at a constant offset
        for i in range(1, count):
            inside, r = e.new(PRED), e.new(S32)
            e.emit(f"setp.lt.s32 {inside}, {i}, {left};")
            e.emit(f"mov.s32 {r}, {acc};")
            e.emit(f"@{inside} ld.global.nc.s32 {r}, [{addr}+{i * strides[axis] * 4}];")
            e.emit(f"{kind}.s32 {acc}, {acc}, {r};")
        e.env[op.result] = acc
        return
    lane = e.tid()[1]
    for i in range(0, count, 32):          # lane l: elements l + i
        index, inside, r, at = e.new(S32), e.new(PRED), e.new(S32), e.new(U64)
        e.emit(f"add.s32 {index}, {lane}, {i};")
        e.emit(f"setp.lt.s32 {inside}, {index}, {left};")
        e.emit(f"mov.s32 {r}, {acc};")
        e.emit(f"mul.wide.s32 {at}, {index}, {strides[axis] * 4};")
        e.emit(f"add.s64 {at}, {addr}, {at};")
        e.emit(f"@{inside} ld.global.nc.s32 {r}, [{at}];")
        e.emit(f"{kind}.s32 {acc}, {acc}, {r};")
    for mask in (16, 8, 4, 2, 1):
        other = e.new(S32)
        e.emit(f"shfl.sync.bfly.b32 {other}, {acc}, {mask}, 31, -1;")
        e.emit(f"{kind}.s32 {acc}, {acc}, {other};")
    e.env[op.result] = acc


def _load_gather(e: KernelEmitter, op: t.LoadGatherOp) -> None:
    """Each element of the index tile a thread holds picks its own element of the source: an
    address from the base of the other dims' offsets plus the row times its stride (64-bit), a
    load where the row is inside the dim (an unsigned compare: a negative row is outside), 0
    elsewhere."""
    axis, ty, mt = op.axis.value.data, ptx_type(op.result.type), op.src.type
    strides = e.strides(op.src, (axis,))
    terms = [(e.value(off), st) for d, (off, st) in enumerate(zip(op.offsets, strides)) if d != axis]
    base = e.element_address(e.value(op.src), terms, ty.bytes, e.reach(mt))
    rows = e.extent(op.src, axis)
    regs = []
    for row in e.env[op.index]:
        inside, addr = e.new(PRED), e.new(U64)
        e.emit(f"setp.lt.u32 {inside}, {row}, {rows};")
        e.emit(f"mad.wide.s32 {addr}, {row}, {strides[axis] * ty.bytes}, {base};")
        if ty is PRED:
            regs.append(_load_bool(e, addr, 0, inside, 0.0))
            continue
        r = e.new(ty)
        e.emit(mov_constant(ty, r, 0.0))
        e.emit(f"@{inside} ld.global.{storage_suffix(ty)} {r}, [{addr}];")
        regs.append(r)
    e.env[op.result] = regs


def _load_bool(e: KernelEmitter, addr: str, byte: int, pred: str | None, pad: float) -> str:
    """A bool element: PTX has no predicate loads, so its byte is loaded (`pad` where `pred` is false)
    and compared with zero."""
    b, r = e.new(B8), e.new(PRED)
    e.emit(f"mov.u16 {b}, {int(pad != 0)};")
    e.emit(f"{f'@{pred} ' if pred else ''}ld.global.u8 {b}, [{addr}+{byte}];")
    e.emit(f"setp.ne.u16 {r}, {b}, 0;")
    return r


def _store_bool(e: KernelEmitter, addr: str, byte: int, pred: str, value: str) -> None:
    """A bool element as the byte 0 or 1 (NumPy's and torch's bool storage)."""
    b = e.new(B8)
    e.emit(f"selp.u16 {b}, 1, 0, {value};")
    e.emit(f"@{pred} st.global.u8 [{addr}+{byte}], {b};")


def _vector_runs(memref: SSAValue, tile_dims, layout: Layout, ty: PtxType, tile_offsets: Sequence[SSAValue]) -> int:
    """How many consecutive registers each access may move at once (16 bytes at most).

    Registers i..i+w-1 must hold consecutive elements of the tensor's innermost dim, whose length
    and every outer stride (so every row start) are multiples of w, from a tile whose offset along
    it (among `tile_offsets`, one per memref dim) is one too (a slice's shifted tile may not be): a
    run is then wholly inside or outside the tensor and 16-byte aligned (arguments are checked aligned).
    An innermost dim taken at run time (`tile.DYNAMIC`: a rank-1 tensor's) has no known length:
    one element a register, each checked against it. Trailing size-1 dims (a row statistic kept
    as [..., S, 1], read along S) count as absent.
    """
    shape = memref.type.get_shape()
    strides = t.stride_factors(memref.type)
    inner = len(shape) - 1
    while inner > 0 and shape[inner] == 1 and inner not in tile_dims:
        inner -= 1
    if not tile_dims or tile_dims[-1] != inner or shape[inner] == t.DYNAMIC or strides[inner] != 1:
        return 1
    width = 16 // ty.bytes
    aligned = index_facts.known_multiple(tile_offsets[inner])
    offsets = layout.offsets
    while width > 1:
        if shape[inner] % width == 0 and all(st % width == 0 for st in strides[:inner]) and len(offsets) % width == 0 \
                and aligned % width == 0 and all(
                offsets[i + j][:-1] == offsets[i][:-1] and offsets[i + j][-1] == offsets[i][-1] + j
                and offsets[i][-1] % width == 0
                for i in range(0, len(offsets), width) for j in range(width)):
            return width
        width //= 2
    return 1


def _vector_width(memref: SSAValue, tile_dims, layout: Layout, ty: PtxType, tile_offsets: Sequence[SSAValue]) -> int:
    """`_vector_runs`, where 8-bit elements (fp8) move four or more at a time (in 32-bit words) or
    one at a time."""
    width = _vector_runs(memref, tile_dims, layout, ty, tile_offsets)
    return width if ty.bytes > 1 or width >= 4 else 1


def _load(e: KernelEmitter, op: t.LoadOp):
    if not is_tile(op.result):
        return _load_scalar(e, op)
    layout = e.layouts[op.result]
    ty = ptx_type(op.result.type)
    tile_dims = t.int_values(op.tile_dims)
    addr, elems = _memory_access(e, op.src, list(op.offsets), tile_dims, layout)
    pad = op.padding.value.data
    if ty is PRED:
        e.env[op.result] = [_load_bool(e, addr, byte, pred, pad) for byte, pred in elems]
        return
    width = _vector_width(op.src, tile_dims, layout, ty, list(op.offsets))
    regs = []
    for i in range(0, len(elems), width):   # (the padding, where a run is out of bounds)
        byte, pred = elems[i]
        regs.extend(vector_load(e, ty, width, "global", f"{addr}+{byte}", pred, pad))
    e.env[op.result] = regs


def _store(e: KernelEmitter, op: t.StoreOp):
    layout = e.layouts[op.value]
    ty = ptx_type(op.value.type)
    tile_dims = t.int_values(op.tile_dims)
    if tgt.STAGING in op.attributes:
        return _store_staged(e, op)
    addr, elems = _memory_access(e, op.dst, list(op.offsets), tile_dims, layout)
    regs = e.regs_of(op.value)
    if ty is PRED:
        for (byte, pred), value in zip(elems, regs):
            _store_bool(e, addr, byte, pred, value)
        return
    width = _vector_width(op.dst, tile_dims, layout, ty, list(op.offsets))
    suffix, pack = vector_suffix(ty, width)
    for i in range(0, len(elems), width):
        byte, pred = elems[i]
        run = regs[i:i + width]
        if pack > 1:
            run = pack_words(e, run, pack)
        e.emit(f"@{pred} st.global.{suffix} [{addr}+{byte}], {braced(run)};")


def _atomic_add(e: KernelEmitter, op: t.AtomicAddOp):
    """`red.global.add.f32` of each in-bounds element, two at a time (`.v2`) where the platform has
    vector reductions and a register pair holds adjacent elements of a row. (One the allocation
    pass staged is a bulk reduction by then: `tile_to_target.lower_bulk_reductions`.)"""
    if tgt.STAGING in op.attributes:
        raise UnsupportedByBackend("PTX backend: a staged tile.atomic_add not lowered to a bulk reduction")
    layout = e.layouts[op.value]
    tile_dims = t.int_values(op.tile_dims)
    addr, elems = _memory_access(e, op.dst, list(op.offsets), tile_dims, layout)
    regs = e.regs_of(op.value)
    width = 1
    if e.platform.has("vector_red"):
        width = min(2, _vector_width(op.dst, tile_dims, layout, ptx_type(op.value.type), list(op.offsets)))
    for i in range(0, len(elems), width):
        byte, pred = elems[i]
        vector = ".v2" if width == 2 else ""
        e.emit(f"@{pred} red.global.add{vector}.f32 [{addr}+{byte}], {braced(regs[i:i + width])};")


def _scratch_address(e: KernelEmitter, op) -> str:
    """The shared address of the op's scratch buffer."""
    buffer = e.new(S32)
    e.emit(f"add.s32 {buffer}, {e.smem_base()}, {op.attributes[tgt.SCRATCH].offset.data};")
    return buffer


def _stage_rows(e: KernelEmitter, op: tgt.StageRowsOp) -> None:
    """Every thread's fragments into the scratch buffer (a pair of adjacent columns at a time where
    the tile's columns are the buffer's), each row padded with zeros to the staging's columns."""
    pitch, width = op.attributes[tgt.STAGING].pitch.data, op.attributes[tgt.STAGING].cols.data
    layout = e.layouts[op.value]
    k_r = op.rows_dim.value.data
    k_c = 1 - k_r
    buffer = _scratch_address(e, op)
    bases, offs = e.coords(layout)
    mine = e.new(S32)
    e.emit(f"mad.lo.s32 {mine}, {bases[k_r]}, {pitch}, {buffer};")
    e.emit(f"mad.lo.s32 {mine}, {bases[k_c]}, 4, {mine};")
    regs = e.regs_of(op.value)
    i = 0
    while i < len(regs):
        at = offs[i][k_r] * pitch + offs[i][k_c] * 4
        paired = k_c == 1 and i + 1 < len(regs) and offs[i + 1] == (offs[i][0], offs[i][1] + 1)
        if paired:
            e.emit(f"st.shared.v2.f32 [{mine}+{at}], {{{regs[i]}, {regs[i + 1]}}};")
        else:
            e.emit(f"st.shared.f32 [{mine}+{at}], {regs[i]};")
        i += 2 if paired else 1
    cols = layout.shape[k_c]
    if width > cols:   # the row's padding past the tile: zeros, which add nothing
        tid, pad, row_of = e.state["tid_at_entry"], e.new(S32), e.new(PRED)
        e.emit(f"setp.lt.u32 {row_of}, {tid}, {layout.shape[k_r]};")
        e.emit(f"mad.lo.s32 {pad}, {tid}, {pitch}, {buffer};")
        for col in range(cols, width):
            e.emit(f"@{row_of} st.shared.b32 [{pad}+{4 * col}], 0;")


def _bulk_reduce(e: KernelEmitter, op: tgt.BulkReduceOp) -> None:
    """Thread 0 (`hopper.leader`: its thread id is read at entry) adds the buffer's rows inside the
    destination with one `cp.reduce.async.bulk .add.f32` and commits the bulk group."""
    pitch, dst = op.attributes[tgt.STAGING].pitch.data, op.dst
    shape, offsets = dst.type.get_shape(), [e.value(o) for o in op.offsets]
    r = len(shape) - 2
    buffer = _scratch_address(e, op)
    issuer = hopper.leader(e)
    rows, left, ok = e.new(S32), e.new(S32), e.new(PRED)   # the tile's rows inside the destination
    e.emit(f"sub.s32 {left}, {e.dim_limit(dst, r, 0)}, {offsets[r]};")
    e.emit(f"min.s32 {rows}, {left}, {op.rows.value.data};")
    e.emit(f"setp.gt.s32 {ok}, {rows}, 0;")
    e.emit(f"and.pred {ok}, {ok}, {issuer};")
    e.emit(f"mul.lo.s32 {rows}, {rows}, {pitch};")
    strides = e.strides(dst, (r, r + 1))
    terms = [(offsets[d], strides[d]) for d in range(r + 1)]
    address = e.element_address(e.value(dst), terms, 4, e.reach(dst.type))
    e.emit(f"@{ok} cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{address}], [{buffer}], {rows};")
    e.emit(f"@{ok} cp.async.bulk.commit_group;")


def _bulk_wait(e: KernelEmitter, op: tgt.BulkWaitOp) -> None:
    e.emit(f"cp.async.bulk.wait_group{'.read' if op.read is not None else ''} {op.pending.value.data};")


# --- staged stores -------------------------------------------------------------------------------

def _store_staged(e: KernelEmitter, op: t.StoreOp) -> None:
    """A store the allocation pass staged (`tessera_target.staging`), through the per-warp buffers
    of its scratch."""
    scratch = op.attributes.get(tgt.SCRATCH)
    if scratch is None:
        raise UnsupportedByBackend("PTX backend: a staged tile.store has no tessera_target.scratch (the "
                                   "shared-memory allocation pass places its buffers)")
    ty = ptx_type(op.value.type)
    emit_staged_store(e, e.layouts[op.value], ty, op.dst, e.regs_of(op.value),
                      [e.value(o) for o in op.offsets], Staging.of_attr(op.attributes[tgt.STAGING], ty.bytes),
                      scratch.offset.data)


def _storing_warps(e: KernelEmitter) -> int:
    """Warps that store tiles: a warp-specialized kernel's producer warps (the last) store none."""
    return (e.threads - e.producer_threads) // 32


def emit_staged_store(e: KernelEmitter, layout: Mma, ty: PtxType, memref: SSAValue, regs: list[str],
                      offsets: list[str], st: Staging, scratch: int) -> None:
    """Stores the accumulator tile `regs` (laid out as `layout`) at `offsets` of global tensor
    `memref` (its rows bounded by a size param where they are a dynamic dim). Each warp writes its
    fragments for 16 rows x `st.cols` columns into its own shared buffer, then reads them back a
    row-contiguous 16 bytes per lane and stores those to global
    memory; warp barriers order the buffer's reuse (no block barrier: warps store independently).
    The buffers lie one after another from byte `scratch` of the dynamic shared memory."""
    mt: MemRefType = memref.type
    row_dim, col_dim = mt.get_num_dims() - 2, mt.get_num_dims() - 1
    dst, strides = e.value(memref), e.strides(memref, (row_dim, col_dim))
    warps = _storing_warps(e)
    _, lane, warp = e.tid()

    e.emit(f"// staged store: per warp, 16 rows x {st.cols} columns at a time through shared bytes "
           f"{scratch}..{scratch + warps * st.buffer_bytes}")
    mine = e.new(S32)
    e.emit(f"mad.lo.s32 {mine}, {warp}, {st.buffer_bytes}, {scratch};")
    e.emit(f"add.s32 {mine}, {mine}, {e.smem_base()};")
    quad, group = e.divmod(lane, 4)
    frag = e.new(S32)   # this lane's fragment slot: row lane/4, columns 2 (lane % 4) and + 1
    e.emit(f"mad.lo.s32 {frag}, {group}, {st.pitch}, {mine};")
    e.emit(f"mad.lo.s32 {frag}, {quad}, {2 * ty.bytes}, {frag};")
    piece, row_in = e.divmod(lane, st.lanes_per_row)
    vec_at = e.new(S32)  # this lane's 16-byte vector in the buffer: row lane / lanes_per_row
    e.emit(f"mad.lo.s32 {vec_at}, {row_in}, {st.pitch}, {mine};")
    e.emit(f"mad.lo.s32 {vec_at}, {piece}, 16, {vec_at};")

    # the warp's origin in the tile: the layout's bases less their lane parts
    bases, _ = e.coords(layout)
    row0, col0 = e.new(S32), e.new(S32)
    e.emit(f"sub.s32 {row0}, {bases[0]}, {group};")
    e.emit(f"mad.lo.s32 {col0}, {quad}, -2, {bases[1]};")
    row, col = e.new(S32), e.new(S32)   # this lane's first global row and column
    e.emit(f"add.s32 {row}, {row0}, {row_in};")
    e.emit(f"add.s32 {row}, {row}, {offsets[row_dim]};")
    e.emit(f"mad.lo.s32 {col}, {piece}, {st.vec}, {col0};")
    e.emit(f"add.s32 {col}, {col}, {offsets[col_dim]};")
    terms = [(row, strides[row_dim]), (col, 1), *((offsets[d], strides[d]) for d in range(row_dim))]
    addr = e.element_address(dst, terms, ty.bytes, e.reach(mt))

    rows_per_pass = 32 // st.lanes_per_row
    mi_n, ni_n = layout.fragments
    per_chunk = st.cols // 8
    row_ok: dict[int, str] = {}
    for mi in range(mi_n):
        for chunk in range(layout.warp_tile[1] // st.cols):
            for n in range(per_chunk):
                ni = chunk * per_chunk + n
                for half in range(2):
                    pair = [regs[layout.register(mi, ni, 2 * half + c)] for c in range(2)]
                    at = 8 * half * st.pitch + 8 * n * ty.bytes
                    if ty.bytes == 2:
                        word = e.new(S32)
                        e.emit(f"mov.b32 {word}, {{{pair[0]}, {pair[1]}}};")
                        e.emit(f"st.shared.b32 [{frag}+{at}], {word};")
                    else:
                        e.emit(f"st.shared.v2.{storage_suffix(ty)} [{frag}+{at}], {{{pair[0]}, {pair[1]}}};")
            e.emit("bar.warp.sync -1;")
            col_ok = e.new(PRED)
            e.emit(f"setp.lt.s32 {col_ok}, {col}, {e.dim_limit(memref, col_dim, chunk * st.cols)};")
            for p in range(16 // rows_per_pass):
                r = 16 * mi + p * rows_per_pass
                if r not in row_ok:
                    q = row_ok[r] = e.new(PRED)
                    e.emit(f"setp.lt.s32 {q}, {row}, {e.dim_limit(memref, row_dim, r)};")
                ok = e.new(PRED)
                e.emit(f"and.pred {ok}, {row_ok[r]}, {col_ok};")
                words = [e.new(S32) for _ in range(4)]
                e.emit(f"ld.shared.v4.b32 {braced(words)}, [{vec_at}+{p * rows_per_pass * st.pitch}];")
                byte = (r * strides[row_dim] + chunk * st.cols) * ty.bytes
                e.emit(f"@{ok} st.global.v4.b32 [{addr}+{byte}], {braced(words)};")
            e.emit("bar.warp.sync -1;")


#: tile loads and stores (a rank-0 tile's load is one scalar)
HANDLERS: dict[type, Callable] = {
    t.LoadOp: _load,
    t.LoadIndexOp: _load_index,
    t.LoadIndexReduceOp: _load_index_reduce,
    t.LoadGatherOp: _load_gather,
    t.StoreOp: _store,
    t.AtomicAddOp: _atomic_add,
    tgt.StageRowsOp: _stage_rows,
    tgt.BulkReduceOp: _bulk_reduce,
    tgt.BulkWaitOp: _bulk_wait,
}
