"""Target IR -> PTX text, written by Tessera itself (no CUDA C++ in between).

One `tessera_target.kernel` becomes one `.entry`. The emitter
1. assigns every tile value a layout (`assign_layouts`): rank-2 tiles share one
   `Blocked` layout chosen from the kernel's tile shape and warp count, or, in a
   kernel with tensor-core ops, an `Mma` layout per shape (the accumulators');
   rank-1 tiles are `Slice`s of it, along the dim their reductions and broadcasts say;
2. walks the ops once, emitting per-register PTX from a table of op handlers.
   Scalars are one register; tiles are a list of registers, one per element the
   thread holds. Broadcasts move no data: they reuse register names.

Loads and stores are predicated per element against the tensor bounds (tails)
and the tile extent; in native (TMA) kernels an accumulator tile is stored
through a shared buffer per warp, in 16-byte row-contiguous stores
(`_store_staged`). Row reductions combine a thread's registers, then lanes
with `shfl.sync.bfly`, then warps through shared memory.

The matrix instructions and shared-memory pipelines live beside this module:
`tensor_core.py` (mma.sync, ldmatrix, cp.async) and `hopper.py` (TMA,
mbarriers, wgmma). Target IR this backend has no form for (sm_100's tcgen05,
say) raises `UnsupportedByBackend`.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Callable

from xdsl.dialects import arith, scf
from xdsl.dialects import math as mathd
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float16Type,
    Float32Type,
    IndexType,
    IntegerType,
    MemRefType,
    TensorType,
)
from xdsl.ir import Attribute, Block, BlockArgument, Operation, SSAValue

from ... import platforms
from ...errors import TesseraError
from ...ir import index_facts
from ...ir import target as tgt
from ...ir import tile as t
from ...ir.layouts import Blocked, Layout, Mma, Slice
from ...lowering.assign_layouts import UnsupportedLayout, is_tile, kernel_layouts


class UnsupportedByBackend(TesseraError):
    """The kernel uses an op this PTX backend cannot emit yet."""


# --- types ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PtxType:
    reg: str        # register class prefix and declaration type: ("f", ".f32")
    decl: str
    op: str         # type suffix for arithmetic / ld / st
    bytes: int


F32 = PtxType("f", ".f32", "f32", 4)
F16 = PtxType("h", ".b16", "f16", 2)
BF16 = PtxType("hb", ".b16", "bf16", 2)
S32 = PtxType("r", ".b32", "s32", 4)
PRED = PtxType("p", ".pred", "pred", 1)
U64 = PtxType("rd", ".b64", "u64", 8)


def ptx_type(t: Attribute) -> PtxType:
    element = t.get_element_type() if isinstance(t, (TensorType, MemRefType)) else t
    if isinstance(element, Float32Type):
        return F32
    if isinstance(element, Float16Type):
        return F16
    if isinstance(element, BFloat16Type):
        return BF16
    if isinstance(element, IndexType):
        return S32
    if isinstance(element, IntegerType):
        return PRED if element.width.data == 1 else S32
    raise UnsupportedByBackend(f"PTX backend: element type {element} is not supported yet")


def f32_literal(x: float) -> str:
    return "0f" + struct.pack(">f", x).hex().upper()


# --- layouts ---------------------------------------------------------------------------------------


# --- the emitter -------------------------------------------------------------------------------------

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
        self.buffers = buffers                # shared tile buffer layout, by the mechanism filling it
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
        self.shared: list[str] = []
        self._labels = 0
        self.smem_bytes = 0          # dynamic shared memory the kernel needs
        self.static_smem = 0         # .shared arrays the kernel declares (reductions, staged stores)
        self.smem_base: str | None = None    # register holding the dynamic shared memory's address
        self._tid_regs: tuple[str, str, str] | None = None
        self._bases: dict[tuple, str] = {}
        self.entry: list[str] = []            # lines run once at entry, before the body (`at_entry`)
        self.extra_params: list[str] = []     # .param declarations after the pointer params
        self.tensor_maps: list[TensorMapSpec] = []
        self.smem_align = 128                 # alignment the dynamic shared memory is declared with
        self.state: dict[str, object] = {}    # per-kernel state of a backend path (e.g. its leader thread)
        from .debug import KernelDebug   # (imports this module)
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

    def divmod(self, x: str, n: int) -> tuple[str, str]:
        """(x % n, x / n) for a power of two n."""
        lo, hi = self.new(S32), self.new(S32)
        self.emit(f"and.b32 {lo}, {x}, {n - 1};")
        self.emit(f"shr.u32 {hi}, {x}, {n.bit_length() - 1};")
        return lo, hi

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
        at = len(self.lines)
        for key in dict.fromkeys(k for lay in self.layouts.values() for k in lay.base_keys):
            self.base(key)  # at entry: a loop body must not be the first to define them (in a fixed
            # order: the PTX text must not vary from process to process, or the cubin cache misses)
        self.block(block)
        self.lines[at:at] = self.entry
        params += self.extra_params
        extern = [f".extern .shared .align {self.smem_align} .b8 tsr_smem[];", ""] if self.smem_bytes else []
        extern = (self.debug.directives() if self.debug else []) + extern
        maxnreg = self.kernel.maxnreg
        bounds = f".maxntid {self.threads}, 1, 1" + (f" .maxnreg {maxnreg.value.data}" if maxnreg else "")
        head = [f".visible .entry {self.name}(", ",\n".join(params), f") {bounds}", "{"]
        return "\n".join(extern + head + self.regs.declarations() + self.shared + self.lines + ["}"]) + "\n"

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


# --- op handlers -------------------------------------------------------------------------------------

def _unary(ty_of: Callable, template: str):
    def handle(e: KernelEmitter, op):
        ty = ty_of(op)

        def build(args):
            r = e.new(ty)
            e.emit(template.format(r=r, a=args[0], t=ty.op))
            return r
        e.elementwise(op, build)
    return handle


def _fma(e: KernelEmitter, op):
    def build(args):
        r = e.new(F32)
        e.emit(f"fma.rn.f32 {r}, {args[0]}, {args[1]}, {args[2]};")
        return r
    e.elementwise(op, build)


def _binary(template_f: str | None, template_i: str | None = None, template_p: str | None = None):
    """Per-element binary op; the template is chosen by the result's register type."""
    templates = {F32: template_f, S32: template_i, PRED: template_p}

    def handle(e: KernelEmitter, op):
        ty = ptx_type(op.results[0].type)
        template = templates.get(ty)
        if template is None:
            raise UnsupportedByBackend(f"PTX backend: {op.name} on {ty.op}")

        carried = _updatable_in_place(e, op)
        if carried is not None:
            others = e._as_list(op.operands[1], len(carried))
            for r, b in zip(carried, others):
                e.emit(template.format(r=r, a=r, b=b, t=ty.op))
            e.env[op.results[0]] = list(carried)
            return

        def build(args):
            r = e.new(ty)
            e.emit(template.format(r=r, a=args[0], b=args[1], t=ty.op))
            return r
        e.elementwise(op, build)
    return handle


def _updatable_in_place(e: KernelEmitter, op) -> list[str] | None:
    """The registers of `op`'s first operand when `op` may overwrite them: a tile a loop carries
    (an iteration argument), of the result's type, that nothing else reads. Then a wgmma that
    accumulates into the result updates the loop's own registers, and the loop carries them to
    the next iteration without copies (copying an accumulator a wgmma is still writing would make
    ptxas serialize the wgmmas)."""
    x, result = op.operands[0], op.results[0]
    if not (is_tile(result) and isinstance(x, BlockArgument) and x.index > 0
            and isinstance(x.block.parent_op(), scf.ForOp) and x.type == result.type and len(list(x.uses)) == 1):
        return None
    regs = e.env.get(x)
    return regs if isinstance(regs, list) and len(set(regs)) == len(regs) else None


def unsigned_magic(divisor: int) -> tuple[int, int]:
    """(m, shift) with x // divisor == mulhi(x, m) >> shift for every 0 <= x < 2**31 (a
    non-negative s32), divisor >= 2 not a power of two: m = ceil(2**(31 + l) / divisor) with
    l = ceil(log2(divisor)) fits 32 bits, and m * divisor exceeds 2**(31 + l) by less than 2**l,
    which keeps the quotient exact over 31-bit dividends (Granlund and Montgomery, 1994)."""
    l = (divisor - 1).bit_length()
    return -(-(1 << (31 + l)) // divisor), l - 1


def _divide_by_constant(e: KernelEmitter, instr: str, x: str, divisor: int) -> str:
    """x / divisor or x % divisor for a non-negative x, without a divide: a shift or mask for a power
    of two, else a multiply-high by a magic number (ptxas, given the divisor as an immediate, builds
    the reciprocal at run time through MUFU.RCP, every time the expression is evaluated)."""
    r = e.new(S32)
    if divisor & (divisor - 1) == 0:
        shift = divisor.bit_length() - 1
        e.emit(f"shr.u32 {r}, {x}, {shift};" if instr == "div" else f"and.b32 {r}, {x}, {divisor - 1};")
        return r
    m, shift = unsigned_magic(divisor)
    q = e.new(S32) if instr == "rem" else r
    e.emit(f"mul.hi.u32 {q}, {x}, {m};")
    if shift:
        e.emit(f"shr.u32 {q}, {q}, {shift};")
    if instr == "rem":
        e.emit(f"mad.lo.s32 {r}, {q}, {-divisor}, {x};")
    return r


def _signed_or_not(instr: str):
    """div/rem: by a positive constant, of a value never negative, a shift, mask or multiply-high
    (`_divide_by_constant`); unsigned where both operands are never negative; else signed."""
    signed = _binary(None, f"{instr}.s32 {{r}}, {{a}}, {{b}};")
    unsigned = _binary(None, f"{instr}.u32 {{r}}, {{a}}, {{b}};")

    def handle(e: KernelEmitter, op):
        both = index_facts.is_non_negative(op.lhs) and index_facts.is_non_negative(op.rhs)
        divisor = index_facts.constant_value(op.rhs)
        if both and divisor and not is_tile(op.result):
            e.env[op.result] = _divide_by_constant(e, instr, e.value(op.lhs), divisor)
            return
        (unsigned if both else signed)(e, op)
    return handle


def _result_type(op):
    return ptx_type(op.results[0].type)


def _f32_chain(*steps: str):
    """A per-element f32 instruction sequence: `{a}`/`{b}` are the operands, `{t0}`, `{t1}`, ...
    fresh temporaries in order; the last instruction's destination is the result."""
    def handle(e: KernelEmitter, op):
        def build(args):
            temps = [e.new(F32) for _ in steps]
            names = {"a": args[0], "b": args[1] if len(args) > 1 else None}
            for i, step in enumerate(steps):
                e.emit(step.format(**names, **{f"t{j}": r for j, r in enumerate(temps)}, r=temps[i]))
            return temps[-1]
        e.elementwise(op, build)
    return handle


_LOG2E, _LN2 = f32_literal(1.4426950408889634), f32_literal(0.6931471805599453)
_exp = _f32_chain(f"mul.f32 {{r}}, {{a}}, {_LOG2E};", "ex2.approx.ftz.f32 {r}, {t0};")
_log = _f32_chain("lg2.approx.ftz.f32 {r}, {a};", f"mul.f32 {{r}}, {{t0}}, {_LN2};")
_pow = _f32_chain("lg2.approx.ftz.f32 {r}, {a};", "mul.f32 {r}, {t0}, {b};", "ex2.approx.ftz.f32 {r}, {t1};")


def _tanh(e: KernelEmitter, op):
    """tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)): accurate to ~1e-7 absolute, unlike tanh.approx."""
    def build(args):
        a, y, z, q, r = (e.new(F32) for _ in range(5))
        e.emit(f"abs.f32 {a}, {args[0]};")
        e.emit(f"mul.f32 {y}, {a}, {f32_literal(2 * 1.4426950408889634)};")
        e.emit(f"ex2.approx.ftz.f32 {z}, {y};")
        e.emit(f"add.f32 {z}, {z}, 0f3F800000;")
        e.emit(f"div.rn.f32 {q}, 0f40000000, {z};")
        e.emit(f"sub.f32 {r}, 0f3F800000, {q};")
        e.emit(f"copysign.f32 {r}, {args[0]}, {r};")
        return r
    e.elementwise(op, build)


_ERF = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429, 0.3275911)


def _erf(e: KernelEmitter, op):
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7)."""
    a1, a2, a3, a4, a5, p = _ERF

    def build(args):
        x = args[0]
        ax, den, tt, poly, x2, ex, r = (e.new(F32) for _ in range(7))
        e.emit(f"abs.f32 {ax}, {x};")
        e.emit(f"fma.rn.f32 {den}, {ax}, {f32_literal(p)}, 0f3F800000;")
        e.emit(f"rcp.rn.f32 {tt}, {den};")
        e.emit(f"mov.f32 {poly}, {f32_literal(a5)};")
        for c in (a4, a3, a2, a1):
            e.emit(f"fma.rn.f32 {poly}, {poly}, {tt}, {f32_literal(c)};")
        e.emit(f"mul.f32 {poly}, {poly}, {tt};")
        e.emit(f"mul.f32 {x2}, {ax}, {ax};")
        e.emit(f"mul.f32 {x2}, {x2}, {f32_literal(-1.4426950408889634)};")
        e.emit(f"ex2.approx.ftz.f32 {ex}, {x2};")
        e.emit(f"mul.f32 {poly}, {poly}, {ex};")
        e.emit(f"sub.f32 {r}, 0f3F800000, {poly};")
        e.emit(f"copysign.f32 {r}, {x}, {r};")
        return r
    e.elementwise(op, build)


_CMPF = {"oeq": "eq", "ogt": "gt", "oge": "ge", "olt": "lt", "ole": "le", "one": "ne", "ord": "num",
         "ueq": "equ", "ugt": "gtu", "uge": "geu", "ult": "ltu", "ule": "leu", "une": "neu", "uno": "nan"}
_CMPI = {"eq": "eq.s32", "ne": "ne.s32", "slt": "lt.s32", "sle": "le.s32", "sgt": "gt.s32", "sge": "ge.s32",
         "ult": "lt.u32", "ule": "le.u32", "ugt": "gt.u32", "uge": "ge.u32"}


def _cmp(e: KernelEmitter, op):
    float_cmp = isinstance(op, t.CmpfOp)
    names = t.CmpfOp.PREDICATES if float_cmp else t.CmpiOp.PREDICATES
    pred = names[op.predicate.value.data]
    suffix = f"{_CMPF[pred]}.f32" if float_cmp else _CMPI[pred]

    def build(args):
        r = e.new(PRED)
        e.emit(f"setp.{suffix} {r}, {args[0]}, {args[1]};")
        return r
    e.elementwise(op, build)


def _select(e: KernelEmitter, op):
    ty = ptx_type(op.result.type)

    def build(args):
        c, a, b = args
        r = e.new(ty)
        if ty is PRED:
            x, y = e.new(PRED), e.new(PRED)
            e.emit(f"and.pred {x}, {c}, {a};")
            e.emit(f"not.pred {y}, {c};")
            e.emit(f"and.pred {y}, {y}, {b};")
            e.emit(f"or.pred {r}, {x}, {y};")
        else:
            e.emit(f"selp.{'f32' if ty is F32 else 'b32'} {r}, {a}, {b}, {c};")
        return r
    e.elementwise(op, build)


def _extf(e: KernelEmitter, op):
    src = ptx_type(op.input.type)

    def build(args):
        r = e.new(F32)
        if src is F16:
            e.emit(f"cvt.f32.f16 {r}, {args[0]};")
        else:
            wide = e.new(S32)
            e.emit(f"cvt.u32.u16 {wide}, {args[0]};")
            e.emit(f"shl.b32 {wide}, {wide}, 16;")
            e.emit(f"mov.b32 {r}, {wide};")
        return r
    e.elementwise(op, build)


def _truncf(e: KernelEmitter, op):
    dst = ptx_type(op.result.type)

    def build(args):
        r = e.new(dst)
        e.emit(f"cvt.rn.{dst.op}.f32 {r}, {args[0]};")
        return r
    e.elementwise(op, build)


def _constant(e: KernelEmitter, op: arith.ConstantOp):
    ty = ptx_type(op.result.type)
    value = op.value
    if isinstance(op.result.type, TensorType):
        raise UnsupportedByBackend("PTX backend: tensor constants (use a broadcast scalar)")
    if ty is F32:
        e.env[op.result] = e.const_f32(value.value.data)
    elif ty is PRED:
        r = e.new(PRED)
        e.emit(f"setp.ne.s32 {r}, {int(value.value.data) & 1}, 0;")
        e.env[op.result] = r
    else:
        e.env[op.result] = e.const_s32(int(value.value.data))


def _program_id(e: KernelEmitter, op: t.ProgramIdOp):
    r = e.new(S32)
    e.emit(f"mov.u32 {r}, %ctaid.{'xyz'[op.axis.value.data]};")
    e.env[op.result] = r


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
        partial = _reduce_across_warps(e, src, out, partial, ty, combine)
    e.env[op.result] = partial


def _reduce_across_warps(e: KernelEmitter, src: Blocked, out: Slice, partial, ty, combine):
    rows = src.cover[0] * src.reps[0]
    buf = f"red_{len(e.shared)}"
    e.shared.append(f"    .shared .align 4 .b8 {buf}[{4 * rows * src.wc}];")
    e.static_smem += 4 * rows * src.wc
    tid, lane, warp = e.tid()
    lane_c, _ = e.divmod(lane, src.tc)
    warp_c, _ = e.divmod(warp, src.wc)
    row = e.base(src.base_keys[0])
    leader = e.new(PRED)
    e.emit(f"setp.eq.s32 {leader}, {lane_c}, 0;")
    base = e.new(S32)
    e.emit(f"mad.lo.s32 {base}, {warp_c}, {rows}, {row};")
    addr = e.new(U64)
    e.emit(f"mov.u64 {addr}, {buf};")
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


def _memory_access(e: KernelEmitter, memref: SSAValue, offsets, tile_dims, layout: Layout):
    """Per element: byte offset from a per-thread base address, and a predicate (in bounds and in tile)."""
    mt: MemRefType = memref.type
    shape = mt.get_shape()
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    elem = ptx_type(mt).bytes
    bases, offs = e.coords(layout)
    linear = e.new(S32)
    e.emit(f"mov.s32 {linear}, 0;")
    for d, off in enumerate(offsets):
        e.emit(f"mad.lo.s32 {linear}, {e.value(off)}, {strides[d]}, {linear};")
    for k, d in enumerate(tile_dims):
        e.emit(f"mad.lo.s32 {linear}, {bases[k]}, {strides[d]}, {linear};")
    addr = e.new(U64)
    e.emit(f"mul.wide.s32 {addr}, {linear}, {elem};")
    e.emit(f"add.s64 {addr}, {e.value(memref)}, {addr};")
    # bounds: coordinate along each tiled memory dim = offset + base + const
    starts = []
    for k, d in enumerate(tile_dims):
        s = e.new(S32)
        e.emit(f"add.s32 {s}, {e.value(offsets[d])}, {bases[k]};")
        starts.append(s)
    preds: dict[tuple, str] = {}
    result = []
    extents = layout.shape
    for off in offs:
        key = tuple(off)
        if key not in preds:
            p = None
            for k, d in enumerate(tile_dims):
                lim_mem = shape[d] - off[k]
                q = e.new(PRED)
                e.emit(f"setp.lt.s32 {q}, {starts[k]}, {lim_mem};")
                if layout.over_covers(k):
                    q2 = e.new(PRED)
                    e.emit(f"setp.lt.s32 {q2}, {bases[k]}, {extents[k] - off[k]};")
                    e.emit(f"and.pred {q}, {q}, {q2};")
                if p is not None:
                    e.emit(f"and.pred {q}, {q}, {p};")
                p = q
            preds[key] = p
        byte = sum(o * strides[d] for o, d in zip(off, tile_dims)) * elem
        result.append((byte, preds[key]))
    return addr, result


def _load_scalar(e: KernelEmitter, op: t.LoadOp) -> None:
    """A rank-0 tile: one element, the same for the whole program (e.g. a per-head ALiBi slope)."""
    shape = op.src.type.get_shape()
    linear = e.new(S32)
    e.emit(f"mov.s32 {linear}, 0;")
    for d, off in enumerate(op.offsets):
        e.emit(f"mad.lo.s32 {linear}, {e.value(off)}, {math.prod(shape[d + 1:])}, {linear};")
    ty = ptx_type(op.result.type)
    addr, r = e.new(U64), e.new(ty)
    e.emit(f"mul.wide.s32 {addr}, {linear}, {ty.bytes};")
    e.emit(f"add.s64 {addr}, {e.value(op.src)}, {addr};")
    e.emit(f"ld.global.{_storage(ty)} {r}, [{addr}];")
    e.env[op.result] = r


def _vector_runs(memref: SSAValue, tile_dims, layout: Layout, ty: PtxType) -> int:
    """How many consecutive registers each access may move at once (16 bytes at most).

    Registers i..i+w-1 must hold consecutive elements of the tensor's innermost dim,
    whose length (and so every row start) is a multiple of w: a run is then wholly
    inside or outside the tensor and 16-byte aligned (arguments are checked aligned).
    """
    shape = memref.type.get_shape()
    if not tile_dims or tile_dims[-1] != len(shape) - 1:
        return 1
    width = 16 // ty.bytes
    offsets = layout.offsets
    while width > 1:
        if shape[-1] % width == 0 and len(offsets) % width == 0 and all(
                offsets[i + j][:-1] == offsets[i][:-1] and offsets[i + j][-1] == offsets[i][-1] + j
                and offsets[i][-1] % width == 0
                for i in range(0, len(offsets), width) for j in range(width)):
            return width
        width //= 2
    return 1


def _vector_suffix(ty: PtxType, width: int) -> tuple[str, int]:
    """(ld/st type with vector prefix, registers packed per 32-bit word) for a run of `width` elements."""
    if ty.bytes == 2 and width >= 2:
        words = width // 2
        return (f"v{words}.b32" if words > 1 else "b32"), 2
    return (f"v{width}.{_storage(ty)}" if width > 1 else _storage(ty)), 1


def _load(e: KernelEmitter, op: t.LoadOp):
    if not is_tile(op.result):
        return _load_scalar(e, op)
    layout = e.layouts[op.result]
    ty = ptx_type(op.result.type)
    tile_dims = t.int_values(op.tile_dims)
    addr, elems = _memory_access(e, op.src, list(op.offsets), tile_dims, layout)
    pad = op.padding.value.data
    width = _vector_runs(op.src, tile_dims, layout, ty)
    suffix, pack = _vector_suffix(ty, width)
    regs = []
    for i in range(0, len(elems), width):
        byte, pred = elems[i]
        run = [e.new(ty) for _ in range(width)]
        for r in run:
            e.emit(_mov_constant(ty, r, pad))
        if pack == 1:
            targets = run
        else:
            targets = [e.new(S32) for _ in range(width // 2)]
            for w, (lo, hi) in zip(targets, zip(run[::2], run[1::2])):
                e.emit(f"mov.b32 {w}, {{{lo}, {hi}}};")
        e.emit(f"@{pred} ld.global.{suffix} {_braced(targets)}, [{addr}+{byte}];")
        if pack == 2:
            for w, (lo, hi) in zip(targets, zip(run[::2], run[1::2])):
                e.emit(f"mov.b32 {{{lo}, {hi}}}, {w};")
        regs.extend(run)
    e.env[op.result] = regs


def _braced(regs: list[str]) -> str:
    return regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"


def _store(e: KernelEmitter, op: t.StoreOp):
    layout = e.layouts[op.value]
    ty = ptx_type(op.value.type)
    tile_dims = t.int_values(op.tile_dims)
    staging = _staging(e, op.dst, list(op.offsets), tile_dims, layout, ty)
    if staging is not None:
        return _store_staged(e, op, staging)
    addr, elems = _memory_access(e, op.dst, list(op.offsets), tile_dims, layout)
    width = _vector_runs(op.dst, tile_dims, layout, ty)
    suffix, pack = _vector_suffix(ty, width)
    regs = e.regs_of(op.value)
    for i in range(0, len(elems), width):
        byte, pred = elems[i]
        run = regs[i:i + width]
        if pack == 2:
            words = [e.new(S32) for _ in range(width // 2)]
            for w, (lo, hi) in zip(words, zip(run[::2], run[1::2])):
                e.emit(f"mov.b32 {w}, {{{lo}, {hi}}};")
            run = words
        e.emit(f"@{pred} st.global.{suffix} [{addr}+{byte}], {_braced(run)};")


@dataclass(frozen=True)
class Staging:
    """How an accumulator tile is stored through a warp's own shared buffer: `cols` columns at
    a time (one 128-byte row when the warp tile is that wide), each buffer row `pitch` bytes (16
    more than it holds, so the fragments' eight rows fall in different banks), read back as
    16-byte vectors of `vec` elements, `lanes_per_row` lanes to a row."""

    cols: int
    pitch: int
    vec: int
    lanes_per_row: int

    @property
    def buffer_bytes(self) -> int:
        return 16 * self.pitch

    @staticmethod
    def of(elem_bytes: int, warp_cols: int) -> Staging | None:
        """The staging of a warp's 16-row slab `warp_cols` wide, or None where its rows are not
        whole 16-byte vectors spread over a power-of-two number of lanes."""
        vec = 16 // elem_bytes
        cols = min(128 // elem_bytes, warp_cols)
        lanes_per_row = cols // vec
        if cols % vec or warp_cols % cols or lanes_per_row < 2 or 32 % lanes_per_row:
            return None
        return Staging(cols, cols * elem_bytes + 16, vec, lanes_per_row)


#: Stores are staged through shared memory in kernels whose copies use this mechanism (the native
#: path's), where the buffers leave the blocks per SM as they were: a persistent GEMM's one block
#: per SM idles its tensor cores while it stores. The mma.sync path runs several blocks per SM,
#: which hide one another's stores (measured there: within 2%, on an H100).
STAGED_STORE_MECHANISM = "tma"


def copy_mechanism(e: KernelEmitter) -> str:
    """The mechanism the kernel's copies use (Target IR gives one kernel one)."""
    if "copy_mechanism" not in e.state:
        found = {"tma" if isinstance(op, tgt.TmaLoadOp) else op.mechanism.data
                 for op in e.kernel.walk() if isinstance(op, (tgt.MemcpyOp, tgt.TmaLoadOp))}
        e.state["copy_mechanism"] = found.pop() if len(found) == 1 else "cp.async"
    return e.state["copy_mechanism"]


def _staging(e: KernelEmitter, memref: SSAValue, offsets, tile_dims, layout: Layout,
             ty: PtxType) -> Staging | None:
    """A Staging for storing an mma accumulator tile with 16-byte row-contiguous stores, or None
    where the direct per-fragment stores stay (another layout, a row length that is not a whole
    number of 16-byte vectors, not enough shared memory).

    Why: a fragment store writes 4 (fp16) or 8 (fp32) bytes per thread, eight rows per
    instruction: half-filled sectors, and many more memory instructions than the bytes need. A
    persistent GEMM's block stores each tile in a burst while its tensor cores wait; staged, the
    stores are fewer, whole lines, and quickly off the warp's hands."""
    shape = memref.type.get_shape()
    if (not isinstance(layout, Mma) or copy_mechanism(e) != STAGED_STORE_MECHANISM
            or list(tile_dims) != [len(shape) - 2, len(shape) - 1] or ty.bytes not in (2, 4)):
        return None
    staging = Staging.of(ty.bytes, layout.warp_tile[1])
    if (staging is None or shape[-1] % staging.vec
            or index_facts.known_multiple(offsets[-1]) % staging.vec):   # 16-byte aligned columns
        return None
    used = shared_total(e, e.static_smem)
    staged = shared_total(e, e.static_smem + _storing_warps(e) * staging.buffer_bytes)
    # the buffers must not lower the blocks per SM: attention's two per SM already overlap one's
    # stores with the other's work
    if (staged > e.platform.max_shared_per_block
            or platforms.blocks_per_sm_by_shared(e.platform, staged) < platforms.blocks_per_sm_by_shared(e.platform, used)):
        return None
    return staging


def _storing_warps(e: KernelEmitter) -> int:
    """Warps that store tiles: a warp-specialized kernel's producer warps (the last) store none."""
    return (e.threads - e.producer_threads) // 32


def shared_total(e: KernelEmitter, static: int) -> int:
    """A block's shared memory with `static` bytes of .shared arrays: ptxas places them before the
    dynamic shared memory, rounded up to its alignment."""
    return -(-static // e.smem_align) * e.smem_align + e.smem_bytes if e.smem_bytes else static


def _store_staged(e: KernelEmitter, op: t.StoreOp, st: Staging) -> None:
    emit_staged_store(e, e.layouts[op.value], ptx_type(op.value.type), op.dst.type.get_shape(),
                      e.regs_of(op.value), e.value(op.dst), [e.value(o) for o in op.offsets], st)


def emit_staged_store(e: KernelEmitter, layout: Mma, ty: PtxType, shape, regs: list[str], dst: str,
                      offsets: list[str], st: Staging) -> None:
    """Stores the accumulator tile `regs` (laid out as `layout`) at `offsets` of the `shape` tensor
    at `dst`. Each warp writes its fragments for 16 rows x `st.cols` columns into its own shared
    buffer, then reads them back a row-contiguous 16 bytes per lane and stores those to global
    memory; warp barriers order the buffer's reuse (no block barrier: warps store independently)."""
    row_dim, col_dim = len(shape) - 2, len(shape) - 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    warps = _storing_warps(e)
    _, lane, warp = e.tid()

    buf = f"stage_{len(e.shared)}"
    e.emit(f"// staged store: per warp, 16 rows x {st.cols} columns at a time through {buf}")
    e.shared.append(f"    .shared .align 16 .b8 {buf}[{warps * st.buffer_bytes}];")
    e.static_smem += warps * st.buffer_bytes
    mine = e.new(S32)
    e.emit(f"mov.u32 {mine}, {buf};")
    e.emit(f"mad.lo.s32 {mine}, {warp}, {st.buffer_bytes}, {mine};")
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
    linear = e.new(S32)
    e.emit(f"mul.lo.s32 {linear}, {row}, {strides[row_dim]};")
    e.emit(f"add.s32 {linear}, {linear}, {col};")
    for d in range(row_dim):
        e.emit(f"mad.lo.s32 {linear}, {offsets[d]}, {strides[d]}, {linear};")
    addr = e.new(U64)
    e.emit(f"mul.wide.s32 {addr}, {linear}, {ty.bytes};")
    e.emit(f"add.s64 {addr}, {dst}, {addr};")

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
                        e.emit(f"st.shared.v2.{_storage(ty)} [{frag}+{at}], {{{pair[0]}, {pair[1]}}};")
            e.emit("bar.warp.sync -1;")
            col_ok = e.new(PRED)
            e.emit(f"setp.lt.s32 {col_ok}, {col}, {shape[col_dim] - chunk * st.cols};")
            for p in range(16 // rows_per_pass):
                r = 16 * mi + p * rows_per_pass
                if r not in row_ok:
                    q = row_ok[r] = e.new(PRED)
                    e.emit(f"setp.lt.s32 {q}, {row}, {shape[row_dim] - r};")
                ok = e.new(PRED)
                e.emit(f"and.pred {ok}, {row_ok[r]}, {col_ok};")
                words = [e.new(S32) for _ in range(4)]
                e.emit(f"ld.shared.v4.b32 {_braced(words)}, [{vec_at}+{p * rows_per_pass * st.pitch}];")
                byte = (r * strides[row_dim] + chunk * st.cols) * ty.bytes
                e.emit(f"@{ok} st.global.v4.b32 [{addr}+{byte}], {_braced(words)};")
            e.emit("bar.warp.sync -1;")


def _storage(ty: PtxType) -> str:
    return {F32: "f32", F16: "b16", BF16: "b16", S32: "b32"}[ty]


def _mov_constant(ty: PtxType, r: str, value: float) -> str:
    if ty is F32:
        return f"mov.f32 {r}, {f32_literal(value)};"
    if ty in (F16, BF16):
        import numpy as np
        import ml_dtypes
        bits = np.array(value, dtype=np.float16 if ty is F16 else ml_dtypes.bfloat16).view(np.uint16)
        return f"mov.b16 {r}, {int(bits)};"
    return f"mov.b32 {r}, {int(value)};"


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
                e.emit(f"mov.{_mov(ty)} {dst}, {src};")
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
            e.emit(f"mov.{_mov(ty)} {r}, {s};")
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
            e.emit(f"mov.{_mov(ty)} {r}, {s};")
            tmp.append(r)
        staged.append((ty, regs, tmp))
    for ty, regs, tmp in staged:
        for dst, s in zip(regs, tmp):
            e.emit(f"mov.{_mov(ty)} {dst}, {s};")
    e.emit(f"add.s32 {iv}, {iv}, {e.value(op.step)};")
    e.emit(f"bra {top};")
    e.lines.append(f"{end}:")
    for (arg, ty, regs), res in zip(carried, op.results):
        e.env[res] = regs if is_tile(res) else regs[0]


def _return(e: KernelEmitter, op) -> None:
    e.emit("ret;")


def _mov(ty: PtxType) -> str:
    return {F32: "f32", F16: "b16", BF16: "b16", S32: "b32", PRED: "pred", U64: "b64"}[ty]


def _barrier(e: KernelEmitter, op: tgt.BarrierOp) -> None:
    """bar.sync 0 (the block), or a named barrier of the first `threads` threads."""
    e.emit("bar.sync 0;" if op.id is None else f"bar.sync {op.id.value.data}, {op.threads.value.data};")


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


def _mma_col(e: KernelEmitter, wn: int, warp_cols: int) -> str:
    _, lane, warp = e.tid()
    warp_n, _ = e.divmod(warp, wn)
    quad, _ = e.divmod(lane, 4)
    r, q2 = e.new(S32), e.new(S32)
    e.emit(f"shl.b32 {q2}, {quad}, 1;")
    e.emit(f"mad.lo.s32 {r}, {warp_n}, {warp_cols}, {q2};")
    return r


#: base key kind -> how to compute it from %tid
BASES: dict[str, Callable] = {
    "blocked_row": _blocked_row, "blocked_col": _blocked_col, "mma_row": _mma_row, "mma_col": _mma_col,
}


def _mma_without_tensor_cores(e: KernelEmitter, op: t.MmaOp):
    """A `tile.mma` the target lowering kept: its operands have no matrix instruction (fp32), or
    tensor cores were turned off. There is no CUDA-core matmul in this backend yet."""
    raise UnsupportedByBackend(
        f"PTX backend: kernel {e.name} has a matmul of {op.a.type.get_element_type()} operands without "
        f"tensor cores, which it cannot run on the GPU yet; give the matmul fp16 or bf16 operands "
        f"(x.to(tsr.fp16)), or call with NumPy arrays to run it on the CPU interpreter")


#: every code path's handlers: scalar and tile arithmetic, loads and stores, reductions, control flow
BASE_HANDLERS: dict[type, Callable] = {
    t.MmaOp: _mma_without_tensor_cores,
    arith.ConstantOp: _constant,
    arith.AddfOp: _binary("add.f32 {r}, {a}, {b};"),
    arith.SubfOp: _binary("sub.f32 {r}, {a}, {b};"),
    arith.MulfOp: _binary("mul.f32 {r}, {a}, {b};"),
    arith.DivfOp: _binary("div.rn.f32 {r}, {a}, {b};"),
    arith.MaximumfOp: _binary("max.NaN.f32 {r}, {a}, {b};"),
    arith.MinimumfOp: _binary("min.NaN.f32 {r}, {a}, {b};"),
    arith.NegfOp: _unary(_result_type, "neg.f32 {r}, {a};"),
    arith.AddiOp: _binary(None, "add.s32 {r}, {a}, {b};"),
    arith.SubiOp: _binary(None, "sub.s32 {r}, {a}, {b};"),
    arith.MuliOp: _binary(None, "mul.lo.s32 {r}, {a}, {b};"),
    arith.DivSIOp: _signed_or_not("div"),
    arith.RemSIOp: _signed_or_not("rem"),
    arith.MaxSIOp: _binary(None, "max.s32 {r}, {a}, {b};"),
    arith.MinSIOp: _binary(None, "min.s32 {r}, {a}, {b};"),
    arith.AndIOp: _binary(None, "and.b32 {r}, {a}, {b};", "and.pred {r}, {a}, {b};"),
    arith.OrIOp: _binary(None, "or.b32 {r}, {a}, {b};", "or.pred {r}, {a}, {b};"),
    arith.XOrIOp: _binary(None, "xor.b32 {r}, {a}, {b};", "xor.pred {r}, {a}, {b};"),
    arith.ShLIOp: _binary(None, "shl.b32 {r}, {a}, {b};"),
    arith.ShRUIOp: _binary(None, "shr.u32 {r}, {a}, {b};"),
    arith.IndexCastOp: lambda e, op: e.env.__setitem__(op.result, e.value(op.input)),
    arith.ExtFOp: _extf,
    arith.TruncFOp: _truncf,
    t.SIToFPOp: _unary(lambda op: F32, "cvt.rn.f32.s32 {r}, {a};"),
    t.FPToSIOp: _unary(lambda op: S32, "cvt.rzi.s32.f32 {r}, {a};"),
    t.CmpfOp: _cmp,
    t.CmpiOp: _cmp,
    t.SelectOp: _select,
    mathd.ExpOp: _exp,
    mathd.Exp2Op: _unary(lambda op: F32, "ex2.approx.ftz.f32 {r}, {a};"),
    mathd.FmaOp: _fma,
    mathd.LogOp: _log,
    mathd.Log2Op: _unary(lambda op: F32, "lg2.approx.ftz.f32 {r}, {a};"),
    mathd.TanhOp: _tanh,
    mathd.SqrtOp: _unary(lambda op: F32, "sqrt.rn.f32 {r}, {a};"),
    mathd.RsqrtOp: _unary(lambda op: F32, "rsqrt.approx.ftz.f32 {r}, {a};"),
    mathd.SinOp: _unary(lambda op: F32, "sin.approx.ftz.f32 {r}, {a};"),
    mathd.CosOp: _unary(lambda op: F32, "cos.approx.ftz.f32 {r}, {a};"),
    mathd.AbsFOp: _unary(lambda op: F32, "abs.f32 {r}, {a};"),
    mathd.ErfOp: _erf,
    mathd.PowFOp: _pow,
    t.ProgramIdOp: _program_id,
    t.BroadcastOp: _broadcast,
    t.ArangeOp: _arange,
    t.ReduceOp: _reduce,
    t.LoadOp: _load,
    t.StoreOp: _store,
    scf.ForOp: _for,
    scf.IfOp: _if,
    tgt.ReturnOp: _return,
    tgt.BarrierOp: _barrier,
}


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA tensor map a kernel takes by value (a 128-byte `.param`, after its pointer params):
    the tile box it copies out of kernel argument `arg`, a row-major tensor of `shape` with
    elements of tessera dtype `dtype`. Boxes are 128 bytes wide along the innermost dim and
    land in shared memory with the 128-byte swizzle; out-of-bounds elements read as zero."""

    arg: int
    dtype: str
    shape: tuple[int, ...]
    box: tuple[int, ...]       # per dim, outermost first, like `shape`
    swizzle: int = 128


@dataclass(frozen=True)
class PtxKernel:
    """One kernel's PTX module and what launching it needs besides the grid."""

    name: str
    ptx: str
    threads: int
    dynamic_shared: int
    tensor_maps: tuple[TensorMapSpec, ...] = ()
