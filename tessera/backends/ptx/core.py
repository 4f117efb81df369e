"""The kernel emitter: one `tessera_target.kernel` becomes one `.entry`.

`KernelEmitter` walks the kernel's ops once, printing each with the handler table of its code
path (`paths.py`). Scalars are one register; a tile is a list of registers, one per element the
thread holds, in the layout the assign-layouts pass wrote on the IR (`kernel_layouts`). The emitter
keeps the registers, labels, the code run at entry and each layout's per-thread bases (from %tid);
`emit_kernel` (paths.py) returns its PTX as a `PtxKernel`, with the `TensorMapSpec`s it takes.

Besides, every code path's handlers for control flow (scf.for, scf.if, return, barriers), program
ids, index tiles (arange) and broadcasts, which move no data: they reuse register names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from xdsl.dialects import scf
from xdsl.dialects.builtin import MemRefType
from xdsl.ir import Block, BlockArgument, Operation, SSAValue

from ...dims import DynamicDim
from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Layout, Slice
from ...lowering.assign_layouts import UnsupportedLayout, is_tile, kernel_layouts
from ...runtime.tensor_maps import TensorMapSpec
from .debug import KernelDebug
from .types import (F32, PRED, S32, U64, PtxType, UnsupportedByBackend, braced, f32_literal, mov_constant, mov_suffix,
                    ptx_type, vector_suffix)

#: the kernel's dynamic shared memory, which holds every shared byte it uses
SMEM_SYMBOL = "tsr_smem"


# --- a kernel's PTX ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PtxKernel:
    """One kernel's PTX module and what launching it needs besides the grid."""

    name: str
    ptx: str
    threads: int
    dynamic_shared: int
    tensor_maps: tuple[TensorMapSpec, ...] = ()
    #: the (argument, dim) of each dynamic dim it takes, a u32 param each after the tensor maps
    dims: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RunTimeStride:
    """The element stride of a dim before a tensor's dynamic dim: `factor` times the dynamic dim's
    size, held in register `size` (`KernelEmitter.strides`)."""

    size: str
    factor: int


# --- the emitter ---------------------------------------------------------------------------------

@dataclass
class Regs:
    counts: dict[PtxType, int] = field(default_factory=dict)

    def new(self, ty: PtxType) -> str:
        n = self.counts.get(ty, 0)
        self.counts[ty] = n + 1
        return f"%{ty.reg}{n}"

    def declarations(self) -> list[str]:
        return [f"    .reg {ty.decl} %{ty.reg}<{n}>;" for ty, n in self.counts.items()]


class KernelEmitter:
    """Writes one kernel's PTX with the handler table of its code path (`paths.CodePath`)."""

    def __init__(self, kernel: tgt.KernelOp, handlers: dict[type, Callable], buffers: dict[str, type]):
        self.kernel = kernel
        self.handlers = handlers
        self.buffers = buffers                # shared tile buffer layout, by the allocate's swizzle
        self.name = kernel.sym_name.data
        self.platform = kernel.platform.platform
        self.threads = kernel.config.threads
        self.producer_threads = 32 * (kernel.producer_warps.value.data if kernel.producer_warps else 0)
        try:
            self.layouts = kernel_layouts(kernel)
        except UnsupportedLayout as e:
            raise UnsupportedByBackend(f"PTX backend: {e.message}") from None
        self.role: str | None = None          # in a warp_specialize region: "producer" or "consumer"
        self.regs = Regs()
        self.lines: list[str] = []
        self.env: dict[SSAValue, object] = {}
        self._labels = 0
        #: a 16-bit register a load unpacked from a 32-bit word -> (the word, which half): a
        #: widening reads the half from the word in one instruction (`arithmetic._extf`)
        self.packed_halves: dict[str, tuple[str, int]] = {}
        self.smem_bytes = kernel.config.shared.data   # dynamic shared memory, as the allocation pass placed it
        self._smem_base: str | None = None   # register holding the dynamic shared memory's address
        self._tid_regs: tuple[str, str, str] | None = None
        self._bases: dict[tuple, str] = {}
        self.entry: list[str] = []            # lines run once at entry, before the body (`at_entry`)
        self.extra_params: list[str] = []     # .param declarations after the pointer params
        self.tensor_maps: list[TensorMapSpec] = []
        self.dim_regs: dict[tuple[int, int], str] = {}   # (argument, dim) -> its size, a dynamic dim's
        self.dims: list[tuple[int, int]] = []              # (argument, dim) of each size param
        self.smem_align = 128                 # alignment the dynamic shared memory is declared with
        self.state: dict[str, object] = {}    # per-kernel state of a backend path (e.g. its leader thread)
        self.debug = KernelDebug.of(kernel)   # line info, asserts, profile stamps; None: the kernel has none

    # -- plumbing --
    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def at_entry(self, line: str) -> None:
        """Emits `line` at the kernel's entry, after the parameter loads and before the body,
        whatever op asks for it (so registers it defines are live in every loop)."""
        self.entry.append("    " + line)

    def new(self, ty: PtxType) -> str:
        return self.regs.new(ty)

    def smem_base(self) -> str:
        """The register holding the dynamic shared memory's address (set at entry): every shared
        byte of a kernel is there, at an offset the allocation pass chose."""
        if self._smem_base is None:
            self._smem_base = self.new(S32)
            self.at_entry(f"mov.u32 {self._smem_base}, {SMEM_SYMBOL};")
        return self._smem_base

    def label(self, stem: str) -> str:
        self._labels += 1
        return f"$L_{stem}_{self._labels}"

    def const_s32(self, value: int) -> str:
        r = self.new(S32)
        self.emit(f"mov.s32 {r}, {value};")
        return r

    def const_f32(self, value: float) -> str:
        r = self.new(F32)
        self.emit(f"mov.f32 {r}, {f32_literal(value)};")
        return r

    # -- thread coordinates --
    def base(self, key: tuple) -> str:
        """The register holding a layout's per-thread base along one dim, computed once."""
        if key not in self._bases:
            self._bases[key] = BASES[key[0]](self, *key[1:])
        return self._bases[key]

    def tid(self) -> tuple[str, str, str]:
        """(thread id, lane, warp), computed once at the kernel's entry."""
        if self._tid_regs is None:
            tid, lane, warp = self.new(S32), self.new(S32), self.new(S32)
            self.emit(f"mov.u32 {tid}, %tid.x;")
            self.emit(f"and.b32 {lane}, {tid}, 31;")
            self.emit(f"shr.u32 {warp}, {tid}, 5;")
            self._tid_regs = (tid, lane, warp)
        return self._tid_regs

    def cluster_rank(self) -> str:
        """The block's rank in its thread-block cluster, read once at the kernel's entry."""
        if "cluster_rank" not in self.state:
            rank = self.new(S32)
            self.at_entry(f"mov.u32 {rank}, %cluster_ctarank;")
            self.state["cluster_rank"] = rank
        return self.state["cluster_rank"]

    def divmod(self, x: str, n: int) -> tuple[str, str]:
        """(x % n, x / n) for a power of two n."""
        lo, hi = self.new(S32), self.new(S32)
        self.emit(f"and.b32 {lo}, {x}, {n - 1};")
        self.emit(f"shr.u32 {hi}, {x}, {n.bit_length() - 1};")
        return lo, hi

    def strides(self, memref: SSAValue, tiled: tuple[int, ...] = ()) -> list[int | RunTimeStride]:
        """The element strides of global tensor `memref`: constants, but for the dims before its
        dynamic dim (`tile.DYNAMIC`), whose strides grow with it (`RunTimeStride`). A tile spans
        only dims of constant stride (`tiled`): its elements' offsets from its origin are constants."""
        shape = memref.type.get_shape()
        if t.DYNAMIC not in shape:
            return list(t.element_strides(memref.type))
        dynamic = shape.index(t.DYNAMIC)
        strides = []
        for d, factor in enumerate(t.stride_factors(memref.type)):
            strides.append(RunTimeStride(self.extent(memref, dynamic), factor) if d < dynamic else factor)
        if any(d < dynamic for d in tiled):
            names = self.kernel.attributes.get(t.BUFFER_DIMS)
            name = names.data[memref.index].data if names is not None and isinstance(memref, BlockArgument) else "?"
            raise DynamicDim(name, "a tile spans a dim before it, whose stride grows with it")
        return strides

    def _stride_register(self, stride: RunTimeStride, ty: PtxType, scale: int) -> str:
        """A register (made once, at entry) holding `stride` times `scale`: an s32 in a kernel of
        32-bit offsets, else a u64."""
        regs = self.state.setdefault("stride_regs", {})
        key = (stride, ty, scale)
        if key not in regs:
            regs[key] = self.new(ty)
            if ty is S32:
                self.at_entry(f"mul.lo.s32 {regs[key]}, {stride.size}, {stride.factor * scale};")
            else:
                wide = self.new(U64)
                self.at_entry(f"cvt.u64.u32 {wide}, {stride.size};")
                self.at_entry(f"mul.lo.u64 {regs[key]}, {wide}, {stride.factor * scale};")
        return regs[key]

    def element_address(self, base: str, terms: list[tuple[str, int | RunTimeStride]], elem_bytes: int,
                        reach: int) -> str:
        """A u64 register holding base + elem_bytes * sum(index * stride) over `terms` (s32 index
        registers, element strides: constants, or `RunTimeStride`s), the address of an element of
        a tensor at `base` whose elements lie within `reach` elements of it (`tile.reach`: its
        element count when contiguous). Below a reach of 2^31 the sum is taken in 32-bit integers
        and widened once; a larger tensor (an 8 x 32 x 131072 x 128 KV cache has 2^32) sums 64-bit
        products, which a 32-bit sum would wrap into an address outside the tensor."""
        addr = self.new(U64)
        if reach < 2 ** 31:
            linear = self.new(S32)
            self.emit(f"mov.s32 {linear}, 0;")
            for index, stride in terms:
                if isinstance(stride, RunTimeStride):
                    stride = self._stride_register(stride, S32, 1)
                self.emit(f"mad.lo.s32 {linear}, {index}, {stride}, {linear};")
            self.emit(f"mul.wide.s32 {addr}, {linear}, {elem_bytes};")
            self.emit(f"add.s64 {addr}, {base}, {addr};")
            return addr
        self.emit(f"mov.b64 {addr}, {base};")
        for index, stride in terms:
            if isinstance(stride, RunTimeStride):
                wide = self.new(U64)
                self.emit(f"cvt.s64.s32 {wide}, {index};")
                self.emit(f"mad.lo.s64 {addr}, {wide}, {self._stride_register(stride, U64, elem_bytes)}, {addr};")
            elif stride * elem_bytes < 2 ** 31:
                self.emit(f"mad.wide.s32 {addr}, {index}, {stride * elem_bytes}, {addr};")
            else:
                wide = self.new(U64)
                self.emit(f"cvt.s64.s32 {wide}, {index};")
                self.emit(f"mad.lo.s64 {addr}, {wide}, {stride * elem_bytes}, {addr};")
        return addr

    def coords(self, layout: Layout) -> tuple[list[str], list[tuple[int, ...]]]:
        """Base registers per tile dim and the per-register constant offsets."""
        return [self.base(k) for k in layout.base_keys], layout.offsets

    # -- driver --
    def run(self) -> str:
        block = self.kernel.body.block
        params = []
        for i, arg in enumerate(block.args):
            if not isinstance(arg.type, MemRefType):
                raise UnsupportedByBackend(f"PTX backend: kernel parameter of type {arg.type}")
            params.append(f"    .param .u64 {self.name}_param_{i}")
            raw, ptr = self.new(U64), self.new(U64)
            self.emit(f"ld.param.u64 {raw}, [{self.name}_param_{i}];")
            self.emit(f"cvta.to.global.u64 {ptr}, {raw};")
            self.env[arg] = ptr
        dim_params = self._dim_params()
        at = len(self.lines)
        for key in dict.fromkeys(k for lay in self.layouts.values() for k in lay.base_keys):
            self.base(key)  # at entry: a loop body must not be the first to define them (in a fixed
            # order: the PTX text must not vary from process to process, or the cubin cache misses)
        self.block(block)
        self.lines[at:at] = self._programmatic(self.entry)
        params += self.extra_params + dim_params
        extern = [f".extern .shared .align {self.smem_align} .b8 {SMEM_SYMBOL}[];", ""] if self.smem_bytes else []
        extern = (self.debug.directives() if self.debug else []) + extern
        maxnreg = self.kernel.maxnreg
        bounds = f".maxntid {self.threads}, 1, 1" + (f" .maxnreg {maxnreg.value.data}" if maxnreg else "")
        if self.kernel.min_blocks is not None:   # registers for that many blocks per SM (tile.OCCUPANCY)
            bounds += f" .minnctapersm {self.kernel.min_blocks.value.data}"
        if self.kernel.cluster is not None:   # launched as clusters of that many blocks along x (tile.CLUSTER)
            bounds += f" .reqnctapercluster {self.kernel.cluster.value.data}, 1, 1"
        head = [f".visible .entry {self.name}(", ",\n".join(params), f") {bounds}", "{"]
        return "\n".join(extern + head + self.regs.declarations() + self.lines + ["}"]) + "\n"

    def _dim_params(self) -> list[str]:
        """A u32 param per dynamic dim (`tile.DYNAMIC`), loaded at entry; arguments whose dynamic
        dim is one dim (the kernel's `tile.BUFFER_DIMS`) share it, so their bounds checks are one.
        The launch passes their sizes after the tensor maps (`PtxKernel.dims`)."""
        attr = self.kernel.attributes.get(t.BUFFER_DIMS)
        names = [a.data for a in attr.data] if attr is not None else []
        params, by_name = [], {}
        for i, arg in enumerate(self.kernel.body.block.args):
            for axis, n in enumerate(arg.type.get_shape()):
                if n != t.DYNAMIC:
                    continue
                dim = names[i] if i < len(names) and names[i] else (i, axis)
                if dim not in by_name:
                    param, by_name[dim] = f"{self.name}_dim_{i}_{axis}", self.new(S32)
                    params.append(f"    .param .u32 {param}")
                    self.emit(f"ld.param.u32 {by_name[dim]}, [{param}];")
                    self.dims.append((i, axis))
                self.dim_regs[(i, axis)] = by_name[dim]
        return params

    def reach(self, memref_type: MemRefType) -> int:
        """`tile.reach` of a global tensor, under the kernel's offset width where a dim is dynamic."""
        bits = self.kernel.attributes.get(t.INDEX_BITS)
        return t.reach(memref_type, bits.value.data if bits is not None else 64)

    def extent(self, memref: SSAValue, axis: int) -> int | str:
        """Dim `axis` of a global tensor: its size, or the register holding a dynamic dim's."""
        n = memref.type.get_shape()[axis]
        if n != t.DYNAMIC:
            return n
        owner = getattr(memref, "block", None)
        if owner is not self.kernel.body.block:
            raise UnsupportedByBackend(f"PTX backend: a dynamic dim of {memref.type} that is not a kernel argument's")
        return self.dim_regs[(memref.index, axis)]

    def dim_limit(self, memref: SSAValue, axis: int, off: int) -> int | str:
        """Dim `axis` of a global tensor less `off` (the bound an element `off` into a tile checks
        its tile's start against): a constant, or for a dynamic dim a register made once per offset."""
        n = self.extent(memref, axis)
        if isinstance(n, int):
            return n - off
        if off == 0:
            return n
        limits = self.state.setdefault("dim_limits", {})
        if (n, off) not in limits:
            limits[(n, off)] = self.new(S32)
            self.at_entry(f"sub.s32 {limits[(n, off)]}, {n}, {off};")
        return limits[(n, off)]

    def _programmatic(self, entry: list[str]) -> list[str]:
        """The entry lines of a kernel launched as a programmatic dependent (`tgt.PROGRAMMATIC_LAUNCH`):
        its setup (parameter loads, thread ids and shared-memory addresses: nothing that touches
        global memory), then the wait for the kernel before this one; the body, mbarrier setup
        included, follows the wait."""
        if tgt.PROGRAMMATIC_LAUNCH not in self.kernel.attributes:
            return entry
        return [*entry, "    griddepcontrol.wait;"]

    def block(self, block: Block) -> None:
        for op in block.ops:
            self.op(op)

    def op(self, op: Operation) -> None:
        if self.debug is not None and self.debug.emit(self, op):
            return
        handler = self.handlers.get(type(op))
        if handler is None:
            raise UnsupportedByBackend(f"PTX backend: {op.name} is not supported yet (kernel {self.name})")
        handler(self, op)

    # -- values --
    def value(self, v: SSAValue):
        return self.env[v]

    def regs_of(self, v: SSAValue) -> list[str]:
        return self._as_list(v, len(self.layouts[v].offsets))

    def elementwise(self, op: Operation, build: Callable[[list[str]], str]) -> None:
        """Applies `build(operand registers) -> result register` to every element."""
        result = op.results[0]
        if not is_tile(result):
            self.env[result] = build([self.env[v] for v in op.operands])
            return
        n = len(self.layouts[result].offsets)
        columns = [self._as_list(v, n) for v in op.operands]
        self.env[result] = [build([c[i] for c in columns]) for i in range(n)]

    def _as_list(self, v: SSAValue, n: int) -> list[str]:
        x = self.env[v]
        return x if isinstance(x, list) else [x] * n


def copy_mechanism(e: KernelEmitter) -> str:
    """The mechanism the kernel's copies use (Target IR gives one kernel one)."""
    if "copy_mechanism" not in e.state:
        found = {"tma" if isinstance(op, tgt.TmaLoadOp) else op.mechanism.data
                 for op in e.kernel.walk() if isinstance(op, (tgt.MemcpyOp, tgt.TmaLoadOp))}
        e.state["copy_mechanism"] = found.pop() if len(found) == 1 else "cp.async"
    return e.state["copy_mechanism"]


# --- per-thread layout bases (from %tid) ---------------------------------------------------------

def _blocked_row(e: KernelEmitter, tc: int, wc: int, tr: int) -> str:
    _, lane, warp = e.tid()
    _, lane_r = e.divmod(lane, tc)
    _, warp_r = e.divmod(warp, wc)
    r = e.new(S32)
    e.emit(f"mad.lo.s32 {r}, {warp_r}, {tr}, {lane_r};")
    return r


def _blocked_col(e: KernelEmitter, tc: int, wc: int, vec: int) -> str:
    _, lane, warp = e.tid()
    lane_c, _ = e.divmod(lane, tc)
    warp_c, _ = e.divmod(warp, wc)
    r = e.new(S32)
    e.emit(f"mad.lo.s32 {r}, {warp_c}, {tc}, {lane_c};")
    e.emit(f"mul.lo.s32 {r}, {r}, {vec};")
    return r


def _mma_row(e: KernelEmitter, wn: int, warp_rows: int) -> str:
    _, lane, warp = e.tid()
    _, warp_m = e.divmod(warp, wn)
    _, group = e.divmod(lane, 4)
    r = e.new(S32)
    e.emit(f"mad.lo.s32 {r}, {warp_m}, {warp_rows}, {group};")
    return r


def _mma_col(e: KernelEmitter, wn: int, warp_cols: int, lane_step: int = 2) -> str:
    """An accumulator's column base: `lane_step` (lane % 4) in the warp's columns; 4 for
    `Mma.byte_a`'s, where each lane holds four consecutive keys of every 16."""
    _, lane, warp = e.tid()
    warp_n, _ = e.divmod(warp, wn)
    quad, _ = e.divmod(lane, 4)
    r, q = e.new(S32), e.new(S32)
    e.emit(f"shl.b32 {q}, {quad}, {lane_step.bit_length() - 1};")
    e.emit(f"mad.lo.s32 {r}, {warp_n}, {warp_cols}, {q};")
    return r


#: base key kind -> how to compute it from %tid
BASES: dict[str, Callable] = {
    "blocked_row": _blocked_row, "blocked_col": _blocked_col, "mma_row": _mma_row, "mma_col": _mma_col,
    "mma_col_byte_a": lambda e, wn, warp_cols: _mma_col(e, wn, warp_cols, lane_step=4),
}


# --- program ids, index tiles, broadcasts --------------------------------------------------------

def _dim(e: KernelEmitter, op: t.DimOp):
    e.env[op.result] = e.extent(op.source, op.axis.value.data)


def _extract(e: KernelEmitter, op: t.ExtractOp):
    e.env[op.result] = e.env[op.x]   # (a rank-0 tile is held as its scalar already)


def _program_id(e: KernelEmitter, op: t.ProgramIdOp):
    r = e.new(S32)
    e.emit(f"mov.u32 {r}, %ctaid.{'xyz'[op.axis.value.data]};")
    e.env[op.result] = r


def _arange(e: KernelEmitter, op: t.ArangeOp):
    layout = e.layouts[op.result]
    (base,), offsets = e.coords(layout)
    start = e.value(op.start)
    first = e.new(S32)
    e.emit(f"add.s32 {first}, {start}, {base};")
    regs = []
    for (off,) in offsets:
        r = e.new(S32)
        e.emit(f"add.s32 {r}, {first}, {off};")
        regs.append(r)
    e.env[op.result] = regs


def _broadcast(e: KernelEmitter, op: t.BroadcastOp):
    out = e.layouts[op.result]
    if not is_tile(op.x):
        e.env[op.result] = e.env[op.x]
        return
    src = e.layouts[op.x]
    (dim,) = t.int_values(op.dims)
    mapping = src.registers_for(out, dim) if isinstance(src, Slice) else None
    if mapping is None:
        raise UnsupportedByBackend(f"PTX backend: broadcast from {src} to {out} is not supported yet")
    regs = e.env[op.x]
    e.env[op.result] = [regs[i] for i in mapping]


# --- control flow --------------------------------------------------------------------------------

def _if(e: KernelEmitter, op: scf.IfOp):
    """A uniform branch (the condition is the same in every thread): each side ends by moving
    its yielded values into the if's result registers."""
    results = []
    for r in op.results:
        ty = ptx_type(r.type)
        results.append((ty, [e.new(ty) for _ in (e.layouts[r].offsets if is_tile(r) else [0])]))
    other, end = e.label("else"), e.label("endif")
    e.emit(f"@!{e.value(op.cond)} bra.uni {other};")
    for region, label in ((op.true_region, end), (op.false_region, None)):
        if not region.blocks:   # no else
            continue
        block = region.block
        for inner in block.ops:
            if not isinstance(inner, scf.YieldOp):
                e.op(inner)
        for (ty, regs), y in zip(results, block.last_op.operands):
            for dst, src in zip(regs, e.regs_of(y) if is_tile(y) else [e.value(y)]):
                e.emit(f"mov.{mov_suffix(ty)} {dst}, {src};")
        if label is not None:
            e.emit(f"bra.uni {end};")
            e.lines.append(f"{other}:")
    e.lines.append(f"{end}:")
    for r, (_, regs) in zip(op.results, results):
        e.env[r] = regs if is_tile(r) else regs[0]


def _for(e: KernelEmitter, op: scf.ForOp):
    body = op.body.block
    iv = e.new(S32)
    e.emit(f"mov.s32 {iv}, {e.value(op.lb)};")
    carried = []
    for init, arg in zip(op.iter_args, body.args[1:]):
        src = e.regs_of(init) if is_tile(init) else [e.value(init)]
        ty = ptx_type(init.type)
        regs = []
        for s in src:
            r = e.new(ty)
            e.emit(f"mov.{mov_suffix(ty)} {r}, {s};")
            regs.append(r)
        e.env[arg] = regs if is_tile(init) else regs[0]
        carried.append((arg, ty, regs))
    e.env[body.args[0]] = iv
    top, end = e.label("loop"), e.label("done")
    done = e.new(PRED)
    e.lines.append(f"{top}:")
    e.emit(f"setp.ge.s32 {done}, {iv}, {e.value(op.ub)};")
    e.emit(f"@{done} bra {end};")
    for inner in body.ops:
        if isinstance(inner, scf.YieldOp):
            break
        e.op(inner)
    yielded = list(body.last_op.operands)
    staged = []
    for (arg, ty, regs), y in zip(carried, yielded):
        src = e.regs_of(y) if is_tile(y) else [e.value(y)]
        if list(src) == list(regs):
            continue   # updated in place (an async wgmma accumulator must not be touched here)
        tmp = []
        for s in src:
            r = e.new(ty)
            e.emit(f"mov.{mov_suffix(ty)} {r}, {s};")
            tmp.append(r)
        staged.append((ty, regs, tmp))
    for ty, regs, tmp in staged:
        for dst, s in zip(regs, tmp):
            e.emit(f"mov.{mov_suffix(ty)} {dst}, {s};")
    e.emit(f"add.s32 {iv}, {iv}, {e.value(op.step)};")
    e.emit(f"bra {top};")
    e.lines.append(f"{end}:")
    for (arg, ty, regs), res in zip(carried, op.results):
        e.env[res] = regs if is_tile(res) else regs[0]


def _return(e: KernelEmitter, op) -> None:
    e.emit("ret;")


def _barrier(e: KernelEmitter, op: tgt.BarrierOp) -> None:
    """bar.sync 0 (the block), or a named barrier of the first `threads` threads."""
    e.emit("bar.sync 0;" if op.id is None else f"bar.sync {op.id.value.data}, {op.threads.value.data};")


#: control flow, coordinates and broadcasts: every code path's (`paths.BASE`)
HANDLERS: dict[type, Callable] = {
    scf.ForOp: _for,
    scf.IfOp: _if,
    tgt.ReturnOp: _return,
    tgt.BarrierOp: _barrier,
    t.ProgramIdOp: _program_id,
    t.ExtractOp: _extract,
    t.DimOp: _dim,
    t.ArangeOp: _arange,
    t.BroadcastOp: _broadcast,
}


def pack_bytes(e: KernelEmitter, values: list[str]) -> str:
    """One 32-bit word of four 8-bit values, each the low byte of a 16-bit register (fp8 elements)."""
    lo, hi, word = e.new(S32), e.new(S32), e.new(S32)
    e.emit(f"mov.b32 {lo}, {{{values[0]}, {values[1]}}};")
    e.emit(f"mov.b32 {hi}, {{{values[2]}, {values[3]}}};")
    e.emit(f"prmt.b32 {word}, {lo}, {hi}, 0x6420;")
    return word


def unpack_bytes(e: KernelEmitter, word: str, ty) -> list[str]:
    """The four bytes of a 32-bit word, each the low byte of a 16-bit register of type `ty` (its
    high byte zero, as a byte load leaves it)."""
    halves, out = [e.new(ty), e.new(ty)], []
    e.emit(f"mov.b32 {{{halves[0]}, {halves[1]}}}, {word};")
    for half in halves:
        low, high = e.new(ty), e.new(ty)
        e.emit(f"and.b16 {low}, {half}, 255;")
        e.emit(f"shr.u16 {high}, {half}, 8;")
        out += [low, high]
    return out


def pack_words(e: KernelEmitter, run: list[str], pack: int) -> list[str]:
    """A run's registers as 32-bit words of `pack` elements each."""
    if pack == 4:
        return [pack_bytes(e, run[i:i + 4]) for i in range(0, len(run), 4)]
    words = [e.new(S32) for _ in range(len(run) // 2)]
    for w, (lo, hi) in zip(words, zip(run[::2], run[1::2])):
        e.emit(f"mov.b32 {w}, {{{lo}, {hi}}};")
    return words


def vector_load(e: KernelEmitter, ty: PtxType, width: int, space: str, address: str, pred: str | None,
                fill: float = 0.0) -> list[str]:
    """A run of `width` elements of type `ty` in one load from `space` ("global", "shared") at
    `address`, where `pred` holds (`fill` where it does not): its registers, one an element (16-bit
    and 8-bit elements loaded packed in 32-bit words, `vector_suffix`)."""
    suffix, pack = vector_suffix(ty, width)
    run = [e.new(ty) for _ in range(width)]
    if pred is not None:
        for r in run:
            e.emit(mov_constant(ty, r, fill))
    words = run if pack == 1 else pack_words(e, run, pack) if pred is not None else \
        [e.new(S32) for _ in range(width // pack)]
    e.emit(f"{f'@{pred} ' if pred else ''}ld.{space}.{suffix} {braced(words)}, [{address}];")
    if pack == 2:
        for w, (lo, hi) in zip(words, zip(run[::2], run[1::2])):
            e.emit(f"mov.b32 {{{lo}, {hi}}}, {w};")
            e.packed_halves[lo], e.packed_halves[hi] = (w, 0), (w, 1)
    elif pack == 4:
        run = [r for w in words for r in unpack_bytes(e, w, ty)]
    return run
