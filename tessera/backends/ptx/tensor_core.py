"""The Ampere-class tensor-core path: shared buffers, cp.async, ldmatrix, mma.sync.

* Shared buffers live in the kernel's dynamic shared memory, XOR-swizzled:
  the 16-byte chunk c of row r is stored at chunk `c ^ f(r)`, where f(r)
  takes 8 different values over any 8 consecutive rows (`SharedBuffer.swizzle`).
  The 8 row addresses of an `ldmatrix`, and 8 rows of 16-byte `cp.async`
  writes, then fall in 8 different 16-byte bank groups: no bank conflicts, and
  no padding.
* `memcpy global_to_shared` (a `tile.copy_async`) is spread over all threads in
  16-byte chunks with `cp.async.cg ... 16, src_size`: a chunk outside the
  tensor copies 0 bytes and is zero-filled, so tails need no other masking.
  Tiles whose rows are not 16-byte aligned (or that are read transposed) are
  copied element by element with predicated loads instead.
* `tensor_core "mma.sync"` loads its operands with `ldmatrix` (`.trans` for a B
  stored K-major), or, for an A held in registers in accumulator layout (the
  probabilities of flash attention), repacks the f32 accumulator fragment
  pairs into f16 A fragments without moving data between threads.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import arith
from xdsl.dialects.builtin import MemRefType

from ... import dtypes, platforms
from ...ir import index_facts
from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Blocked, Mma
from .core import KernelEmitter, pack_bytes, vector_load
from .types import F32, PRED, S32, U64, UnsupportedByBackend, mov_constant, ptx_type, storage_suffix


@dataclass(frozen=True)
class TileBuffer:
    """A [stages, rows, cols] tile buffer at `offset` bytes into dynamic shared memory; how a stage
    is laid out (its `stage_bytes`, its addressing) is each subclass's."""

    offset: int
    stages: int
    rows: int
    cols: int
    elem: int

    @property
    def size(self) -> int:
        return self.stages * self.stage_bytes


@dataclass(frozen=True)
class SharedBuffer(TileBuffer):
    """A tile buffer filled by threads (cp.async), rows XOR-swizzled in 16-byte chunks."""

    #: rows after which the swizzle repeats: rows r and r + 8k of a stage share their XOR mask
    SWIZZLE_PERIOD = 8

    @property
    def row_bytes(self) -> int:
        return self.cols * self.elem

    @property
    def chunks(self) -> int:
        """16-byte chunks per row."""
        return max(1, self.row_bytes // 16)

    def swizzle(self, e: KernelEmitter, row: str) -> str:
        """f(row): rows sharing a 128-byte line get different XOR masks (rows_per_line = 8 / chunks),
        and the mask cycles every 8 rows, so any 8 consecutive rows land in 8 different chunk slots."""
        period = min(self.chunks, 8)
        rows_per_line = max(1, 8 // self.chunks)
        f = e.new(S32)
        e.emit(f"shr.u32 {f}, {row}, {rows_per_line.bit_length() - 1};")
        e.emit(f"and.b32 {f}, {f}, {period - 1};")
        return f

    def chunk_slots(self, e: KernelEmitter, stage: str, row: str, col: str) -> list[str]:
        """For a thread whose rows are `row` + multiples of 8 and whose columns `col` + multiples of
        8 (`col` inside the first 16-byte chunk): the address of its element in chunk j of its first
        row, per j below the swizzle's period (its XOR mask f(row) is the same for all its rows)."""
        f = self.swizzle(e, row)
        first = e.new(S32)
        e.emit(f"mad.lo.s32 {first}, {row}, {self.row_bytes}, {stage};")
        e.emit(f"mad.lo.s32 {first}, {col}, {self.elem}, {first};")
        return _xor_slots(e, first, f, min(self.chunks, 8))

    def chunk_at(self, chunk: int, row: int) -> tuple[int, int]:
        """(slot of `chunk_slots`, byte offset from it) of chunk `chunk`, `row` rows further."""
        period = min(self.chunks, 8)
        return chunk % period, (chunk - chunk % period) * 16 + row * self.row_bytes

    def address(self, e: KernelEmitter, base: str, row: str, chunk: str, f: str | None = None) -> str:
        """base + row * row_bytes + (chunk ^ f(row)) * 16."""
        f = f or self.swizzle(e, row)
        x, addr = e.new(S32), e.new(S32)
        e.emit(f"xor.b32 {x}, {chunk}, {f};")
        e.emit(f"mad.lo.s32 {addr}, {row}, {self.row_bytes}, {base};")
        e.emit(f"mad.lo.s32 {addr}, {x}, 16, {addr};")
        return addr

    @property
    def stage_bytes(self) -> int:
        return self.rows * self.row_bytes


def _xor_slots(e: KernelEmitter, first: str, f: str, period: int) -> list[str]:
    """first + (j ^ f) * 16 for j in range(period)."""
    slots = []
    for j in range(period):
        x, slot = e.new(S32), e.new(S32)
        e.emit(f"xor.b32 {x}, {f}, {j};")
        e.emit(f"mad.lo.s32 {slot}, {x}, 16, {first};")
        slots.append(slot)
    return slots


@dataclass(frozen=True)
class SharedTile:
    """What `tile.load_shared` yields: a stage of a buffer, read by the mma that uses it."""

    buffer: SharedBuffer
    stage: str


def stage_address(e: KernelEmitter, buf: SharedBuffer, stage: str) -> str:
    r = e.new(S32)
    e.emit(f"mad.lo.s32 {r}, {stage}, {buf.stage_bytes}, {buf.offset};")
    e.emit(f"add.s32 {r}, {r}, {e.smem_base()};")
    return r


#: shared tile buffer layout per `allocate` swizzle; the Hopper path adds TMA's (`hopper.TmaBuffer`)
BUFFERS: dict[str, type] = {"xor_16b": SharedBuffer}


def _allocate(e: KernelEmitter, op: tgt.AllocateOp) -> None:
    if op.pool.data != "shared":
        raise UnsupportedByBackend(f"PTX backend: allocate pool={op.pool.data!r} is not supported yet")
    mt: MemRefType = op.result.type
    stages, rows, cols = mt.get_shape()
    if op.offset is None:
        raise UnsupportedByBackend(f"PTX backend: allocate {mt} has no offset (the shared-memory allocation pass "
                                   f"places buffers)")
    offset = op.offset.value.data
    if op.swizzle is None or op.swizzle.data not in e.buffers:
        raise UnsupportedByBackend(f"PTX backend: allocate {mt} has no buffer layout this code path lays out "
                                   f"(swizzle = {op.swizzle.data if op.swizzle else None!r})")
    buf = e.buffers[op.swizzle.data](offset, stages, rows, cols, ptx_type(mt).bytes)
    if buf.size > op.size.value.data:   # the layout must fit what the allocation pass placed
        raise UnsupportedByBackend(f"PTX backend: a {type(buf).__name__} of {mt} takes {buf.size} bytes, more than "
                                   f"the {op.size.value.data} its allocate holds")
    e.smem_align = max(e.smem_align, op.align.value.data)
    e.env[op.result] = buf


def _store_shared(e: KernelEmitter, op: t.StoreSharedOp) -> None:
    """A 16-bit accumulator-layout tile into a stage of a shared buffer in the buffer's layout (the
    XOR swizzle ldmatrix reads, or TMA's 128-byte one wgmma's descriptors read): each register pair
    (two adjacent columns of a row) is one 32-bit store. A thread's rows differ by multiples of 8,
    so its chunks' XOR mask is one per thread (`TileBuffer.chunk_slots`), and the 8 rows x 4 pairs
    a warp stores at once fall in 32 different banks."""
    layout = e.layouts[op.value]
    buf = e.env[op.dst]
    if not isinstance(layout, Mma) or layout.wn != 1 or buf.elem != 2:
        raise UnsupportedByBackend(f"PTX backend: tile.store_shared stores 16-bit accumulator tiles whose rows "
                                   f"a warp holds whole, not {layout} of {buf.elem}-byte elements")
    (row, col), _ = e.coords(layout)
    slots = buf.chunk_slots(e, stage_address(e, buf, e.value(op.stage)), row, col)
    regs = e.regs_of(op.value)
    mi_n, ni_n = layout.fragments
    for mi in range(mi_n):
        for ni in range(ni_n):
            for half in range(2):
                pair = [regs[layout.register(mi, ni, 2 * half + c)] for c in range(2)]
                word = e.new(S32)
                e.emit(f"mov.b32 {word}, {{{pair[0]}, {pair[1]}}};")
                slot, offset = buf.chunk_at(ni, mi * 16 + 8 * half)
                e.emit(f"st.shared.b32 [{slots[slot]}+{offset}], {word};")


def _thread_chunks(e: KernelEmitter, rows: int, chunks_per_row: int, chunk: int):
    """Spreads rows x chunks_per_row chunks over the block: (row base, col base, [(row off, col off)],
    whether some thread's row base + row off can fall past the tile's last row)."""
    tid, _, _ = e.tid()
    threads = e.threads
    total = rows * chunks_per_row
    if chunks_per_row <= threads:
        col_idx, row = e.divmod(tid, chunks_per_row)
        step = threads // chunks_per_row
        offsets = [(j * step, 0) for j in range(-(-rows // step))]
        overhang = threads % chunks_per_row != 0 or rows % step != 0
    else:
        col_idx, row = tid, e.const_s32(0)
        offsets = [((j * threads) // chunks_per_row, ((j * threads) % chunks_per_row) * chunk)
                   for j in range(total // threads)]
        overhang = False
    col = e.new(S32)
    e.emit(f"mul.lo.s32 {col}, {col_idx}, {chunk};")
    return row, col, offsets, overhang


def _memcpy(e: KernelEmitter, op: tgt.MemcpyOp) -> None:
    if op.kind.data != "global_to_shared" or op.mechanism.data not in ("cp.async", "ld.global"):
        raise UnsupportedByBackend(f"PTX backend: memcpy kind {op.kind.data!r} by {op.mechanism.data!r} is not "
                                   f"supported yet")
    _copy_by_threads(e, op)


def _copy_by_threads(e: KernelEmitter, op: tgt.MemcpyOp) -> None:
    """Every thread copies its share of the tile: 16-byte cp.async chunks, or elements.

    A tile whose origin is a multiple of its extent, along both tile dims of a tensor whose size is a
    multiple of it too, lies wholly inside the tensor or wholly outside (a pipeline's steps past the
    end), so one predicate per copy decides every chunk (`_whole_tile`)."""
    buf: SharedBuffer = e.env[op.dst]
    (stage,) = [e.value(v) for v in op.dst_indices]
    src = op.src
    dims = t.int_values(op.tile_dims)
    shape, strides = src.type.get_shape(), e.strides(src, tuple(dims))
    padding = op.padding.value.data if op.padding is not None else 0.0
    elem = buf.elem
    vector = (op.mechanism.data == "cp.async" and dims[1] == len(shape) - 1 and padding == 0.0
              and shape[-1] != t.DYNAMIC and (shape[-1] * elem) % 16 == 0 and t.rows_aligned(src.type, 16 // elem)
              and (buf.cols * elem) % 16 == 0)
    chunk = 16 // elem if vector else 1
    start, rows = op.rows or (0, buf.rows)   # (the stage's rows this copy fills)
    row, col, offsets, overhang = _thread_chunks(e, rows, buf.cols // chunk, chunk)
    offs = [e.value(v) for v in op.src_indices]
    # global element index of this thread's first chunk, and its coordinates along the two tile dims
    terms = [*((off, strides[d]) for d, off in enumerate(offs)), (row, strides[dims[0]]), (col, strides[dims[1]])]
    gbase = e.element_address(e.value(src), terms, elem, e.reach(src.type))
    sbase = stage_address(e, buf, stage)
    first = _shared_slot(e, buf, sbase, row, start, col, 0)

    def shared_slot(r_off: int, c_off: int) -> str:
        if c_off == 0 and r_off % SharedBuffer.SWIZZLE_PERIOD == 0:  # same swizzle as row + 0
            return f"{first}+{r_off * buf.row_bytes}"
        return _shared_slot(e, buf, sbase, row, start + r_off, col, c_off)

    def in_tile(r_off: int) -> str | None:
        if not overhang:
            return None
        p = e.new(PRED)
        e.emit(f"setp.lt.s32 {p}, {row}, {rows - r_off};")
        return p

    def gbyte(r_off: int, c_off: int) -> int:
        return (r_off * strides[dims[0]] + c_off * strides[dims[1]]) * elem

    if vector and _whole_tile(op, shape, dims, (rows, buf.cols)):
        ok, ok_c, src_at, size = e.new(PRED), e.new(PRED), e.new(U64), e.new(S32)
        e.emit(f"setp.lt.s32 {ok}, {offs[dims[0]]}, {e.dim_limit(src, dims[0], 0)};")
        e.emit(f"setp.lt.s32 {ok_c}, {offs[dims[1]]}, {e.dim_limit(src, dims[1], 0)};")
        e.emit(f"and.pred {ok}, {ok}, {ok_c};")
        e.emit(f"selp.b64 {src_at}, {gbase}, {e.value(src)}, {ok};")  # a tile wholly outside reads 0 bytes
        e.emit(f"selp.b32 {size}, 16, 0, {ok};")
        for r_off, c_off in offsets:
            guard = in_tile(r_off)
            e.emit(f"{f'@{guard} ' if guard else ''}cp.async.cg.shared.global [{shared_slot(r_off, c_off)}], "
                   f"[{src_at}+{gbyte(r_off, c_off)}], 16, {size};")
        return
    at_r, at_c = e.new(S32), e.new(S32)
    e.emit(f"add.s32 {at_r}, {offs[dims[0]]}, {row};")
    e.emit(f"add.s32 {at_c}, {offs[dims[1]]}, {col};")
    for r_off, c_off in offsets:
        ok, ok_c = e.new(PRED), e.new(PRED)
        e.emit(f"setp.lt.s32 {ok}, {at_r}, {e.dim_limit(src, dims[0], r_off)};")
        e.emit(f"setp.lt.s32 {ok_c}, {at_c}, {e.dim_limit(src, dims[1], c_off)};")
        e.emit(f"and.pred {ok}, {ok}, {ok_c};")
        guard, saddr = in_tile(r_off), shared_slot(r_off, c_off)
        if vector:
            _cp_async(e, gbase, gbyte(r_off, c_off), saddr, ok, guard)
        else:
            _copy_element(e, gbase, gbyte(r_off, c_off), saddr, ok, guard, ptx_type(src.type), padding)


def _whole_tile(op: tgt.MemcpyOp, shape, dims, extents) -> bool:
    """Whether the copied tile is always wholly inside its tensor or wholly outside it: its origin
    a multiple of its extent, along dims whose size the extent divides (a dim taken at run time:
    where the copy says its compile promises that, `whole`)."""
    return all((op.whole is not None if shape[d] == t.DYNAMIC else shape[d] % n == 0)
               and index_facts.known_multiple(op.src_indices[d]) % n == 0 for d, n in zip(dims, extents))


def _shared_slot(e: KernelEmitter, buf: SharedBuffer, base: str, row: str, r_off: int, col: str, c_off: int) -> str:
    """The swizzled shared address of element (row + r_off, col + c_off) of a stage."""
    r, byte = e.new(S32), e.new(S32)
    e.emit(f"add.s32 {r}, {row}, {r_off};")
    e.emit(f"mad.lo.s32 {byte}, {col}, {buf.elem}, {c_off * buf.elem};")
    chunk, within = e.new(S32), e.new(S32)
    e.emit(f"shr.u32 {chunk}, {byte}, 4;")
    e.emit(f"and.b32 {within}, {byte}, 15;")
    addr = buf.address(e, base, r, chunk)
    e.emit(f"add.s32 {addr}, {addr}, {within};")
    return addr


def _cp_async(e: KernelEmitter, gbase, gbyte, saddr, ok, in_tile: str | None) -> None:
    addr, size = e.new(U64), e.new(S32)
    e.emit(f"add.s64 {addr}, {gbase}, {gbyte};")
    e.emit(f"selp.b64 {addr}, {addr}, {gbase}, {ok};")
    e.emit(f"selp.b32 {size}, 16, 0, {ok};")
    e.emit(f"{f'@{in_tile} ' if in_tile else ''}cp.async.cg.shared.global [{saddr}], [{addr}], 16, {size};")


def _copy_element(e: KernelEmitter, gbase, gbyte, saddr, ok, in_tile: str | None, ty, padding) -> None:
    r = e.new(ty)
    e.emit(mov_constant(ty, r, padding))
    e.emit(f"@{ok} ld.global.{storage_suffix(ty)} {r}, [{gbase}+{gbyte}];")
    e.emit(f"{f'@{in_tile} ' if in_tile else ''}st.shared.{storage_suffix(ty)} [{saddr}], {r};")


@dataclass(frozen=True)
class Fragments:
    """A-operand fragments already in registers ([k step][mi] = 4 registers)."""

    a: list


def _load_shared(e: KernelEmitter, op: t.LoadSharedOp) -> None:
    """A stage of a shared buffer, read by the mma that uses it. An A operand loaded outside the
    loop of its mma (flash attention's Q) is read into fragments here, once, not every iteration.
    A stage that ops computing in registers read (`into_registers`) is read into its tile's layout."""
    tile_ = SharedTile(e.env[op.src], e.value(op.stage))
    if op.into_registers:
        return _load_shared_blocked(e, op, tile_)
    if not isinstance(tile_.buffer, SharedBuffer):
        raise UnsupportedByBackend(f"PTX backend: a {type(tile_.buffer).__name__} is read by wgmma through "
                                   f"descriptors (tessera_target.wgmma_descriptor), not by tile.load_shared")
    uses = [u.operation for u in op.result.uses]
    if (len(uses) == 1 and isinstance(uses[0], tgt.TensorCoreOp) and uses[0].a is op.result
            and uses[0].parent_block() is not op.parent_block()):
        acc, transposed = e.layouts[uses[0].acc], _a_transposed(uses[0])
        k = t.int_values(uses[0].shape)[2]
        k_steps = op.result.type.get_shape()[0 if transposed else 1] // k
        e.env[op.result] = Fragments(_a_fragments(e, tile_, acc, k_steps, acc.wn, transposed, k))
        return
    e.env[op.result] = tile_


def _load_shared_blocked(e: KernelEmitter, op: t.LoadSharedOp, tile_: SharedTile) -> None:
    """A stage read into a `Blocked` register tile (a row walk's staged rows): each run of a
    thread's consecutive columns, up to a 16-byte chunk, one vector load from its swizzled chunk.
    The lanes of a warp read consecutive chunks of a row (or 8 rows' chunks, which the swizzle
    spreads over the banks), so no two share a bank. A layout covering more than the tile reads
    nothing past it (those registers are 0)."""
    layout, buf = e.layouts[op.result], tile_.buffer
    if not isinstance(layout, Blocked) or not isinstance(buf, SharedBuffer):
        raise UnsupportedByBackend(f"PTX backend: tile.load_shared into registers reads a thread-copied stage "
                                   f"into a blocked layout, not a {type(buf).__name__} into {layout}")
    ty = ptx_type(op.result.type)
    (row, col), offsets = e.coords(layout)
    base = stage_address(e, buf, tile_.stage)
    width = min(layout.vec, max(1, 16 // buf.elem))   # (a run never crosses a 16-byte chunk)
    regs = []
    for i in range(0, len(offsets), width):
        r_off, c_off = offsets[i]
        guard = _inside_tile(e, layout, (row, col), (r_off, c_off))
        regs.extend(vector_load(e, ty, width, "shared", _shared_slot(e, buf, base, row, r_off, col, c_off), guard))
    e.env[op.result] = regs


def _inside_tile(e: KernelEmitter, layout: Blocked, bases: tuple[str, str], offset: tuple[int, int]) -> str | None:
    """A predicate: the element at a thread's `bases` + `offset` is inside the layout's tile (None
    where the layout covers the tile exactly)."""
    guard = None
    for dim in (0, 1):
        if not layout.over_covers(dim):
            continue
        p = e.new(PRED)
        e.emit(f"setp.lt.s32 {p}, {bases[dim]}, {layout.shape[dim] - offset[dim]};")
        if guard is not None:
            e.emit(f"and.pred {p}, {p}, {guard};")
        guard = p
    return guard


# --- mma.sync --------------------------------------------------------------------------------------

def _lane_parts(e: KernelEmitter, wn: int):
    _, lane, warp = e.tid()
    warp_n, warp_m = e.divmod(warp, wn)
    return lane, warp_m, warp_n


def _expr(e: KernelEmitter, terms: list[tuple[str, int]], const: int = 0) -> str:
    """sum(reg * coeff) + const as one s32 register."""
    r = e.new(S32)
    e.emit(f"mov.s32 {r}, {const};")
    for reg, coeff in terms:
        e.emit(f"mad.lo.s32 {r}, {reg}, {coeff}, {r};")
    return r


def _bits(e: KernelEmitter, lane: str, shift: int, mask: int) -> str:
    r = e.new(S32)
    e.emit(f"bfe.u32 {r}, {lane}, {shift}, {mask.bit_length()};")
    return r


def _ldmatrix(e: KernelEmitter, count: int, addr: str, trans: bool) -> list[str]:
    regs = [e.new(S32) for _ in range(count)]
    e.emit(f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if trans else ''}.shared.b16 "
           f"{{{', '.join(regs)}}}, [{addr}];")
    return regs


def _a_transposed(op: tgt.TensorCoreOp) -> bool:
    """Whether the op's A is stored K x M (`layout` "tn" / "tt")."""
    return op.layout.data[0] == "t"


def _a_fragments(e: KernelEmitter, a, acc: Mma, k_steps: int, wn: int, transposed: bool = False,
                 k: int = 16) -> list[list[list[str]]]:
    """A fragments [kk][mi] = 4 registers, from shared memory (stored M x K, or K x M when
    `transposed`) or repacked accumulator registers, for an instruction of `k` (16: 16-bit
    elements; 32: 8-bit ones, whose M x K fragment is ldmatrix's of the same 32 bytes a row)."""
    mi_n = acc.fragments[0]
    if isinstance(a, SharedTile) and transposed:
        return _a_fragments_transposed(e, a, acc, k_steps, wn)
    if isinstance(a, SharedTile):
        lane, warp_m, _ = _lane_parts(e, wn)
        buf = a.buffer
        base = stage_address(e, buf, a.stage)
        lo, hi = _bits(e, lane, 0, 15), _bits(e, lane, 4, 1)
        row = _expr(e, [(warp_m, acc.warp_tile[0]), (lo, 1)])        # + 16 mi: same swizzle mask
        f = buf.swizzle(e, row)
        out = []
        for kk in range(k_steps):
            chunk = e.new(S32)
            e.emit(f"add.s32 {chunk}, {hi}, {kk * _step_bytes(k, buf.elem) // 16};")
            addr = buf.address(e, base, row, chunk, f)
            out.append([_ldmatrix(e, 4, f"{addr}+{mi * 16 * buf.row_bytes}", trans=False) for mi in range(mi_n)])
        return out
    regs, layout = a.regs, a.layout
    if not isinstance(layout, Mma) or layout.wn != 1 or layout.fragments[0] != mi_n:
        raise UnsupportedByBackend("PTX backend: an mma A operand in registers must be a full-row accumulator tile")
    if k == 32:
        return _byte_a_fragments(e, a, k_steps)
    out = []
    for kk in range(k_steps):
        row = []
        for mi in range(mi_n):
            frag = []
            for ni, pair in ((2 * kk, (0, 1)), (2 * kk, (2, 3)), (2 * kk + 1, (0, 1)), (2 * kk + 1, (2, 3))):
                r = e.new(S32)
                lo, hi = (regs[layout.register(mi, ni, c)] for c in pair)
                e.emit(f"mov.b32 {r}, {{{lo}, {hi}}};")
                frag.append(r)
            row.append(frag)
        out.append(row)
    return out


@dataclass(frozen=True)
class RegisterTile:
    """An mma A operand computed in the kernel: its registers in accumulator layout, and for an
    8-bit tile narrowed from f32 in range (`tile.IN_RANGE`: attention's probabilities) the f32
    registers it was narrowed from, which `_byte_a_fragments` converts two at a time."""

    regs: list[str]
    layout: object
    ty: object                      # the PtxType of the elements
    wide: list[str] | None = None


def register_tile(e: KernelEmitter, v) -> RegisterTile:
    """Tile `v`, an mma's A operand in registers, as `_a_fragments` takes it."""
    op = v.owner
    wide = None
    if isinstance(op, arith.TruncFOp) and t.IN_RANGE in op.attributes and ptx_type(op.input.type) is F32 \
            and ptx_type(v.type).bytes == 1:
        wide = e.regs_of(op.input)
    return RegisterTile(e.regs_of(v), e.layouts[v], ptx_type(v.type), wide)


def _byte_a_fragments(e: KernelEmitter, a: RegisterTile, k_steps: int) -> list[list[list[str]]]:
    """A fragments of an 8-bit instruction (k 32) from an accumulator-layout tile of 8-bit values
    (attention's probabilities cast to fp8), by shuffles within each quad of lanes.

    In the accumulator layout, lane t of a quad holds columns 2t, 2t+1 of every 8-column chunk (of
    rows g and g + 8); an 8-bit A fragment wants columns 4t..4t+3 and 16+4t..19+4t of each 32, which
    lanes 2(t % 2) and 2(t % 2) + 1 hold in chunk t // 2 (and t // 2 + 2). So each lane packs its
    bytes of chunks (0, 1) and (2, 3) of a row into a word each, and every lane takes both source
    lanes' words and keeps the half its chunk is in (`prmt`): 8 shuffles and 4 permutes per 32
    columns of 16 rows. A tile in `Mma.byte_a` order (scores over keys loaded permuted:
    `lowering.byte_fragments`) holds each lane's fragment already: its words go in as they are."""
    layout = a.layout
    first, second, select = (None, None, None) if layout.byte_a else _byte_fragment_lanes(e)
    out = []
    for kk in range(k_steps):
        row = []
        for mi in range(layout.fragments[0]):
            frag = []
            for chunk in (4 * kk, 4 * kk + 2):          # columns 0-15, then 16-31, of the step
                for pair in ((0, 1), (2, 3)):           # rows g, then g + 8
                    index = [layout.register(mi, ni, c) for ni in (chunk, chunk + 1) for c in pair]
                    word = pack_bytes(e, [a.regs[i] for i in index]) if a.wide is None else \
                        _narrow_pairs(e, [a.wide[i] for i in index], a.ty)
                    if layout.byte_a:   # (the lane's own columns are the fragment's k)
                        frag.append(word)
                        continue
                    lo, hi, r = e.new(S32), e.new(S32), e.new(S32)
                    e.emit(f"shfl.sync.idx.b32 {lo}, {word}, {first}, 31, -1;")
                    e.emit(f"shfl.sync.idx.b32 {hi}, {word}, {second}, 31, -1;")
                    e.emit(f"prmt.b32 {r}, {lo}, {hi}, {select};")
                    frag.append(r)
            row.append(frag)
        out.append(row)
    return out


def _byte_fragment_lanes(e: KernelEmitter) -> tuple[str, str, str]:
    """(first source lane, second source lane, prmt selector) of `_byte_a_fragments`, computed once
    at entry: lanes 2(t % 2) and 2(t % 2) + 1 of the quad, and bytes 0-1 (t < 2) or 2-3 of each."""
    if "byte_fragment_lanes" not in e.state:
        tid, t, quad, odd, first, second, select = (e.new(S32) for _ in range(7))
        high = e.new(PRED)
        e.at_entry(f"mov.u32 {tid}, %tid.x;")
        e.at_entry(f"and.b32 {t}, {tid}, 3;")
        e.at_entry(f"and.b32 {quad}, {tid}, 28;")
        e.at_entry(f"and.b32 {odd}, {tid}, 1;")
        e.at_entry(f"mad.lo.u32 {first}, {odd}, 2, {quad};")
        e.at_entry(f"or.b32 {second}, {first}, 1;")
        e.at_entry(f"setp.ge.u32 {high}, {t}, 2;")
        e.at_entry(f"selp.b32 {select}, 0x7632, 0x5410, {high};")
        e.state["byte_fragment_lanes"] = (first, second, select)
    return e.state["byte_fragment_lanes"]


def _narrow_pairs(e: KernelEmitter, values: list[str], ty) -> str:
    """One 32-bit word of four f32 values narrowed to 8 bits with saturation (in range: see
    `tile.IN_RANGE`), two to an instruction: the narrowing's own one-per-element instructions are
    then left unread, and ptxas drops them."""
    halves = []
    for lo, hi in ((values[0], values[1]), (values[2], values[3])):
        h = e.new(ty)
        e.emit(f"cvt.rn.satfinite.{ty.op}x2.f32 {h}, {hi}, {lo};")
        halves.append(h)
    word = e.new(S32)
    e.emit(f"mov.b32 {word}, {{{halves[0]}, {halves[1]}}};")
    return word


def _a_fragments_transposed(e: KernelEmitter, a: SharedTile, acc: Mma, k_steps: int, wn: int):
    """A fragments from a [K, M] buffer with `ldmatrix.trans`: matrix j of an x4 covers k rows
    8 (j >> 1) .. + 8 at m columns 8 (j & 1) .. + 8 of the fragment, so lane L gives the address
    of k row (L & 7) + 8 ((L >> 4) & 1) at m column 8 ((L >> 3) & 1); transposed on the way into
    registers, each matrix lands as the m16k16 fragment's a0..a3 need it."""
    lane, warp_m, _ = _lane_parts(e, wn)
    buf = a.buffer
    base = stage_address(e, buf, a.stage)
    l8, mid, hi = _bits(e, lane, 0, 7), _bits(e, lane, 3, 1), _bits(e, lane, 4, 1)
    chunk_elems = 16 // buf.elem
    row = _expr(e, [(l8, 1), (hi, 8)])
    lane_chunk = _expr(e, [(warp_m, acc.warp_tile[0] // chunk_elems), (mid, 8 // chunk_elems)])
    f = buf.swizzle(e, row)
    out = []
    for kk in range(k_steps):
        frags = []
        for mi in range(acc.fragments[0]):
            chunk = e.new(S32)
            e.emit(f"add.s32 {chunk}, {lane_chunk}, {mi * 16 // chunk_elems};")
            frags.append(_ldmatrix(e, 4, f"{buf.address(e, base, row, chunk, f)}+{kk * 16 * buf.row_bytes}", trans=True))
        out.append(frags)
    return out


def _b_fragments(e: KernelEmitter, b: SharedTile, acc: Mma, k_steps: int, wn: int, k_major: bool, k: int = 16):
    """B fragments [kk][ni] = 2 registers, loaded with ldmatrix (x4 covers two n-fragments), for
    an instruction of `k` (`_a_fragments`)."""
    lane, _, warp_n = _lane_parts(e, wn)
    buf = b.buffer
    base = stage_address(e, buf, b.stage)
    l8, mid, hi = _bits(e, lane, 0, 7), _bits(e, lane, 3, 1), _bits(e, lane, 4, 1)
    wcols = acc.warp_tile[1]
    chunk_elems = 16 // buf.elem
    ni_n = acc.fragments[1]
    if k_major:   # buffer is [K, N]: rows are k (this lane: l8 + 8 mid + 16 kk), read transposed
        row = _expr(e, [(l8, 1), (mid, 8)])
        lane_chunk = _expr(e, [(warp_n, wcols // chunk_elems), (hi, 8 // chunk_elems)])
    else:         # buffer is [N, K]: rows are n (this lane: warp tile + l8 + 8 hi + 8 p)
        row = _expr(e, [(warp_n, wcols), (l8, 1), (hi, 8)])
        lane_chunk = mid
    f = buf.swizzle(e, row)
    out = []
    for kk in range(k_steps):
        frags: list[list[str]] = []
        for p in range(0, ni_n, 2):
            chunk = e.new(S32)
            if k_major:
                e.emit(f"add.s32 {chunk}, {lane_chunk}, {p * 8 // chunk_elems};")
                addr = f"{buf.address(e, base, row, chunk, f)}+{kk * 16 * buf.row_bytes}"
            else:
                e.emit(f"add.s32 {chunk}, {lane_chunk}, {kk * _step_bytes(k, buf.elem) // 16};")
                addr = f"{buf.address(e, base, row, chunk, f)}+{p * 8 * buf.row_bytes}"
            regs = _ldmatrix(e, 4 if p + 1 < ni_n else 2, addr, trans=k_major)
            frags.append(regs[0:2])
            if p + 1 < ni_n:
                frags.append(regs[2:4])
        out.append(frags)
    return out


def tensor_core_handler(families: dict):
    """The tensor_core handler of a code path: `families` maps each matrix instruction family it
    emits to its handler."""
    def handle(e: KernelEmitter, op: tgt.TensorCoreOp) -> None:
        handler = families.get(op.family.data)
        if handler is None or not _shape_emitted(op.family.data, t.int_values(op.shape)):
            m, n, k = t.int_values(op.shape)
            raise UnsupportedByBackend(
                f"PTX backend: {e.platform.arch}'s matrix instruction for this matmul ({op.family.data} "
                f"m{m}n{n}k{k}) is not emitted yet; the backend's matmuls are mma.sync m16n8k16 (sm_80 to "
                f"sm_89) and wgmma (sm_90a): compile for one of those, or call with NumPy arrays to run it on "
                f"the CPU interpreter")
        handler(e, op)
    return handle


#: the mma.sync shapes emitted: m16n8k16 of 16-bit operands, m16n8k32 of 8-bit ones. Both take a
#: k step of 32 bytes, so fragments load alike, in bytes (`_step_bytes`)
MMA_SYNC_SHAPES = ((16, 8, 16), (16, 8, 32))


def _step_bytes(k: int, elem: int) -> int:
    """The bytes of one instruction's k step along a row of an operand (32 for every shape emitted)."""
    return k * elem


def operand_ptx_types(op: tgt.TensorCoreOp) -> tuple[str, str]:
    """The PTX element types of a tensor_core op's A and B (the op's `precision` names A's; the two
    fp8 formats mix, so B's is read from its own type)."""
    def ptx(v) -> str:
        t = v.type
        element = t.element_type if isinstance(t, tgt.WgmmaDescriptorType) else t.get_element_type()
        return dtypes.BY_MLIR[str(element)].ptx
    return ptx(op.a), ptx(op.b)


def _mma_sync(e: KernelEmitter, op: tgt.TensorCoreOp) -> None:
    acc: Mma = e.layouts[op.acc]
    ptx_a, ptx_b = operand_ptx_types(op)
    k = t.int_values(op.shape)[2]
    a = e.env[op.a]
    transposed = _a_transposed(op)
    k_major_b = op.layout.data[1] == "n"
    if k == 32 and (transposed or k_major_b):
        raise UnsupportedByBackend(
            f"PTX backend: an 8-bit matmul (tessera.loc {op.attributes.get('tessera.loc')}) reads both operands "
            f"K-contiguous from shared memory (ldmatrix transposes only 16-bit elements): store A as [M, K] and "
            f"B as [N, K], and write a @ b.T")
    k_steps = op.a.type.get_shape()[0 if transposed else 1] // k
    if isinstance(a, Fragments):
        a_frags = a.a
    else:
        a_frags = _a_fragments(e, a if isinstance(a, SharedTile) else register_tile(e, op.a),
                               acc, k_steps, acc.wn, transposed, k)
    b_frags = _b_fragments(e, e.env[op.b], acc, k_steps, acc.wn, k_major_b, k)
    regs = list(e.regs_of(op.acc))
    mi_n, ni_n = acc.fragments
    for kk in range(k_steps):
        for mi in range(mi_n):
            for ni in range(ni_n):
                index = [acc.register(mi, ni, c) for c in range(4)]
                c_in = [regs[i] for i in index]
                d = [e.new(F32) for _ in range(4)]
                e.emit(f"mma.sync.aligned.m16n8k{k}.row.col.f32.{ptx_a}.{ptx_b}.f32 "
                       f"{{{', '.join(d)}}}, {{{', '.join(a_frags[kk][mi])}}}, "
                       f"{{{', '.join(b_frags[kk][ni])}}}, {{{', '.join(c_in)}}};")
                for i, r in zip(index, d):
                    regs[i] = r
    e.env[op.result] = regs


#: tensor_core family -> handler on this path
FAMILIES = {"mma.sync": _mma_sync}


def _cp_async_commit(e: KernelEmitter, op: tgt.CpAsyncCommitOp) -> None:
    e.emit("cp.async.commit_group;")


def _cp_async_wait(e: KernelEmitter, op: tgt.CpAsyncWaitOp) -> None:
    e.emit(f"cp.async.wait_group {op.pending.value.data};")


def _mma_without_tensor_cores(e: KernelEmitter, op: t.MmaOp):
    """A `tile.mma` the target lowering kept: its operands have no matrix instruction this backend
    emits on the platform (fp32 anywhere, anything before sm_80), or tensor cores were turned off.
    There is no CUDA-core matmul in this backend yet; the error names the operand dtypes its
    tensor-core matmuls take there, or the arch to compile for."""
    taken = sorted({dtypes.lookup(i.operand).name for i in platforms.mma_instructions(e.platform) if emitted(i)})
    operands = dtypes.lookup(str(op.a.type.get_element_type())).name
    if operands in taken:
        raise UnsupportedByBackend(
            f"PTX backend: kernel {e.name} has a matmul of {operands} operands kept off the tensor cores "
            f"(tensor_cores=False, or a tile no instruction covers), and no CUDA-core matmul runs it on the GPU "
            f"yet: compile it with tensor cores, or call with NumPy arrays to run it on the CPU interpreter")
    if taken:
        raise UnsupportedByBackend(
            f"PTX backend: kernel {e.name} has a matmul of {operands} operands; this backend's tensor-core "
            f"matmuls on {e.platform.arch} take {', '.join(taken)}, and no CUDA-core matmul runs it on the GPU "
            f"yet: give the matmul {' or '.join(taken)} operands (x.to(tsr.{taken[0]})), or call with NumPy "
            f"arrays to run it on the CPU interpreter")
    raise UnsupportedByBackend(
        f"PTX backend: kernel {e.name} has a matmul of {operands} operands; this backend emits no tensor-core "
        f"matmul for {e.platform.arch} yet (nor a CUDA-core one): compile for sm_80 to sm_89 or sm_90a, or "
        f"call with NumPy arrays to run it on the CPU interpreter")


def emitted(instr: platforms.MmaInstr) -> bool:
    """Whether this backend emits `instr` (mma.sync at MMA_SYNC_SHAPES, wgmma); sm_75's m16n8k8,
    sm_70's wmma and sm_100's tcgen05 are in the platform tables but not emitted yet."""
    return instr.family in ("mma.sync", "wgmma") and _shape_emitted(instr.family, instr.shape)


def _shape_emitted(family: str, shape) -> bool:
    """Whether a family's instruction of this (m, n, k) has a form here: mma.sync only at MMA_SYNC_SHAPES."""
    return family != "mma.sync" or tuple(shape) in MMA_SYNC_SHAPES


#: the Ampere-class path's handlers (on top of `paths.BASE`): shared buffers, cp.async, mma.sync, and
#: the error of a tile.mma left without tensor cores
HANDLERS = {
    t.MmaOp: _mma_without_tensor_cores,
    tgt.AllocateOp: _allocate,
    tgt.MemcpyOp: _memcpy,
    tgt.CpAsyncCommitOp: _cp_async_commit,
    tgt.CpAsyncWaitOp: _cp_async_wait,
    t.LoadSharedOp: _load_shared,
    t.StoreSharedOp: _store_shared,
    tgt.TensorCoreOp: tensor_core_handler(FAMILIES),
}
