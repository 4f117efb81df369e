"""Scalar and per-element arithmetic: the arith and math dialects' ops, comparisons, selects and
casts, on scalars (one register) or tiles (per register, `KernelEmitter.elementwise`). f32 math
functions are short sequences of approximate instructions (exp through ex2, erf by Abramowitz and
Stegun); a never-negative scalar divided by a constant takes a shift, mask or multiply-high.
"""
from __future__ import annotations

from typing import Callable

from xdsl.dialects import arith, scf
from xdsl.dialects import math as mathd
from xdsl.dialects.builtin import TensorType
from xdsl.ir import BlockArgument

from ...ir import index_facts
from ...ir import tile as t
from ...lowering.assign_layouts import is_tile
from ..approximations import ERF_A_S_7_1_26
from .core import KernelEmitter
from .types import BF16, F16, F32, FP8, PRED, S32, PtxType, UnsupportedByBackend, f32_literal, ptx_type


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


def emit_nan_minmax(e: KernelEmitter, kind: str, r: str, a: str, b: str) -> None:
    """r = min or max (`kind`) of f32 registers a and b, NaN if either is (NumPy's and torch's
    maximum): `max.NaN.f32` where the platform has it (sm_80+), else `max.f32`, which returns the
    other operand, and the sum of the two where either is NaN."""
    if e.platform.has("nan_minmax"):
        e.emit(f"{kind}.NaN.f32 {r}, {a}, {b};")
        return
    nan = e.new(PRED)
    e.emit(f"{kind}.f32 {r}, {a}, {b};")
    e.emit(f"setp.nan.f32 {nan}, {a}, {b};")
    e.emit(f"@{nan} add.f32 {r}, {a}, {b};")


def _nan_minmax(kind: str):
    """arith.maximumf / minimumf: `_binary`'s (in place where it may) with max.NaN / min.NaN, or on
    a platform without them `emit_nan_minmax`'s sequence."""
    with_nan = _binary(f"{kind}.NaN.f32 {{r}}, {{a}}, {{b}};")

    def handle(e: KernelEmitter, op):
        if e.platform.has("nan_minmax"):
            return with_nan(e, op)

        def build(args):
            r = e.new(F32)
            emit_nan_minmax(e, kind, r, args[0], args[1])
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


def _floor_div_si(e: KernelEmitter, op):
    """Signed division rounded down: div.s32 rounds towards zero, so a quotient with a nonzero
    remainder whose sign differs from the divisor's is one less."""
    def build(args):
        a, b = args
        q, r, s, q1 = (e.new(S32) for _ in range(4))
        inexact, opposite = e.new(PRED), e.new(PRED)
        e.emit(f"div.s32 {q}, {a}, {b};")
        e.emit(f"mul.lo.s32 {r}, {q}, {b};")
        e.emit(f"sub.s32 {r}, {a}, {r};")
        e.emit(f"setp.ne.s32 {inexact}, {r}, 0;")
        e.emit(f"xor.b32 {s}, {r}, {b};")
        e.emit(f"setp.lt.s32 {opposite}, {s}, 0;")
        e.emit(f"and.pred {inexact}, {inexact}, {opposite};")
        e.emit(f"sub.s32 {q1}, {q}, 1;")
        e.emit(f"selp.b32 {q}, {q1}, {q}, {inexact};")
        return q
    e.elementwise(op, build)


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
_pow_magnitude = ("abs.f32 {r}, {a};", "lg2.approx.ftz.f32 {r}, {t0};", "mul.f32 {r}, {t1}, {b};",
                  "ex2.approx.ftz.f32 {r}, {t2};")


def _pow(e: KernelEmitter, op):
    """x ** y as NumPy and torch define it: 2 ** (y log2 |x|), negated for a negative x and an odd
    integer y, NaN for a negative x and a fractional y, and 1 for y == 0 (even 0 ** 0 and NaN ** 0)."""
    def build(args):
        x, y = args
        temps = [e.new(F32) for _ in _pow_magnitude]
        for i, step in enumerate(_pow_magnitude):
            e.emit(step.format(a=x, b=y, r=temps[i], **{f"t{j}": r for j, r in enumerate(temps)}))
        whole, half, neg_r, r = (e.new(F32) for _ in range(4))
        is_int, odd, negative, flip, nan, zero = (e.new(PRED) for _ in range(6))
        e.emit(f"cvt.rzi.f32.f32 {whole}, {y};")
        e.emit(f"setp.eq.f32 {is_int}, {whole}, {y};")
        e.emit(f"mul.f32 {half}, {y}, 0f3F000000;")
        e.emit(f"cvt.rzi.f32.f32 {whole}, {half};")
        e.emit(f"setp.ne.f32 {odd}, {whole}, {half};")
        e.emit(f"and.pred {odd}, {odd}, {is_int};")
        e.emit(f"setp.lt.f32 {negative}, {x}, 0f00000000;")
        e.emit(f"and.pred {flip}, {negative}, {odd};")
        e.emit(f"neg.f32 {neg_r}, {temps[-1]};")
        e.emit(f"selp.f32 {r}, {neg_r}, {temps[-1]}, {flip};")
        e.emit(f"not.pred {nan}, {is_int};")
        e.emit(f"and.pred {nan}, {nan}, {negative};")
        e.emit(f"selp.f32 {r}, 0f7FC00000, {r}, {nan};")
        e.emit(f"setp.eq.f32 {zero}, {y}, 0f00000000;")
        e.emit(f"selp.f32 {r}, 0f3F800000, {r}, {zero};")
        return r
    e.elementwise(op, build)


_tanh_approx = _unary(lambda op: F32, "tanh.approx.f32 {r}, {a};")


def _tanh(e: KernelEmitter, op):
    """tanh.approx.f32 where the Tile IR marks the tanh approximate (`afn`: a bf16 result,
    `emit.approximate`) and the platform has it. Else tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)):
    accurate to ~1e-7 absolute, unlike tanh.approx (2^-10.987 relative). Its reciprocal is
    rcp.approx (1 ulp, one MUFU op; exp(2|x|) + 1 >= 2, so no denormal is flushed, and an infinite
    exp gives 0): div.rn's IEEE division is a dozen instructions and a slow-path branch an element."""
    if "afn" in op.fastmath.data and e.platform.has("tanh_approx"):
        return _tanh_approx(e, op)

    def build(args):
        a, y, z, q, r = (e.new(F32) for _ in range(5))
        e.emit(f"abs.f32 {a}, {args[0]};")
        e.emit(f"mul.f32 {y}, {a}, {f32_literal(2 * 1.4426950408889634)};")
        e.emit(f"ex2.approx.ftz.f32 {z}, {y};")
        e.emit(f"add.f32 {z}, {z}, 0f3F800000;")
        e.emit(f"rcp.approx.ftz.f32 {q}, {z};")
        e.emit(f"fma.rn.f32 {r}, {q}, 0fC0000000, 0f3F800000;")
        e.emit(f"copysign.f32 {r}, {args[0]}, {r};")
        return r
    e.elementwise(op, build)


def _erf(e: KernelEmitter, op):
    """Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7). Its reciprocal of 1 + p|x| >= 1 is rcp.approx
    (1 ulp, as `_tanh`'s): rcp.rn's IEEE rounding is a multi-instruction sequence an element."""
    a1, a2, a3, a4, a5, p = ERF_A_S_7_1_26

    def build(args):
        x = args[0]
        ax, den, tt, poly, x2, ex, r = (e.new(F32) for _ in range(7))
        e.emit(f"abs.f32 {ax}, {x};")
        e.emit(f"fma.rn.f32 {den}, {ax}, {f32_literal(p)}, 0f3F800000;")
        e.emit(f"rcp.approx.ftz.f32 {tt}, {den};")
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


def _fp8_conversions(e: KernelEmitter) -> None:
    if not e.platform.has("fp8"):
        raise UnsupportedByBackend(f"PTX backend: fp8 conversions (cvt .e4m3x2/.e5m2x2) need sm_89 or later; "
                                   f"{e.platform.arch} has no fp8")


def _extf_fp8(e: KernelEmitter, op, src: PtxType) -> None:
    """fp8 -> f16 (or on to f32): `cvt.rn.f16x2.e4m3x2` widens the register's two bytes; ours is the low one."""
    _fp8_conversions(e)
    dst = ptx_type(op.result.type)
    if dst not in (F16, F32):
        raise UnsupportedByBackend(f"PTX backend: {src.op} to {dst.op} (fp8 widens to f16 or f32)")

    def build(args):
        pair, lo, hi = e.new(S32), e.new(F16), e.new(F16)
        e.emit(f"cvt.rn.f16x2.{src.op}x2 {pair}, {args[0]};")
        e.emit(f"mov.b32 {{{lo}, {hi}}}, {pair};")
        if dst is F16:
            return lo
        r = e.new(F32)
        e.emit(f"cvt.f32.f16 {r}, {lo};")
        return r
    e.elementwise(op, build)


#: per fp8 type: (the comparison and |x| past which rounding to nearest overflows, the byte an overflow
#: gives for +x and for -x): E4M3FN has no infinity (NaN, as ml_dtypes and torch give), E5M2 has (+-inf)
_FP8_OVERFLOW = {"e4m3": ("gt", 464.0, 0x7F, 0xFF), "e5m2": ("ge", 61440.0, 0x7C, 0xFC)}


def _truncf_fp8(e: KernelEmitter, op, dst: PtxType) -> None:
    """f32 -> fp8, rounded to nearest even. PTX converts only with .satfinite (an overflow becomes the
    largest finite value), so an overflow is then replaced by what the CPU interpreter and torch give
    (`_FP8_OVERFLOW`); NaN stays NaN. Both bytes of the register get the value; stores take the low one."""
    _fp8_conversions(e)
    if ptx_type(op.input.type) is not F32:
        raise UnsupportedByBackend(f"PTX backend: {ptx_type(op.input.type).op} to {dst.op} (fp8 narrows from f32)")
    compare, bound, positive, negative = _FP8_OVERFLOW[dst.op]
    if t.IN_RANGE in op.attributes:    # (no overflow to replace)
        def in_range(args):
            r = e.new(dst)
            e.emit(f"cvt.rn.satfinite.{dst.op}x2.f32 {r}, {args[0]}, {args[0]};")
            return r
        e.elementwise(op, in_range)
        return

    def build(args):
        x = args[0]
        saturated, overflow_byte, r = e.new(dst), e.new(dst), e.new(dst)
        magnitude, over, below_zero = e.new(F32), e.new(PRED), e.new(PRED)
        e.emit(f"cvt.rn.satfinite.{dst.op}x2.f32 {saturated}, {x}, {x};")
        e.emit(f"abs.f32 {magnitude}, {x};")
        e.emit(f"setp.{compare}.f32 {over}, {magnitude}, {f32_literal(bound)};")
        e.emit(f"setp.lt.f32 {below_zero}, {x}, 0f00000000;")
        e.emit(f"selp.b16 {overflow_byte}, {negative}, {positive}, {below_zero};")
        e.emit(f"selp.b16 {r}, {overflow_byte}, {saturated}, {over};")
        return r
    e.elementwise(op, build)


def _extf(e: KernelEmitter, op):
    src = ptx_type(op.input.type)
    if src in FP8:
        return _extf_fp8(e, op, src)

    def build(args):
        r = e.new(F32)
        if src is F16:
            e.emit(f"cvt.f32.f16 {r}, {args[0]};")
            return r
        wide = e.new(S32)
        if args[0] in e.packed_halves:   # (bf16 is f32's high half: one shift or mask of the loaded word)
            word, half = e.packed_halves[args[0]]
            e.emit(f"and.b32 {wide}, {word}, -65536;" if half else f"shl.b32 {wide}, {word}, 16;")
        else:
            e.emit(f"cvt.u32.u16 {wide}, {args[0]};")
            e.emit(f"shl.b32 {wide}, {wide}, 16;")
        e.emit(f"mov.b32 {r}, {wide};")
        return r
    e.elementwise(op, build)


def _truncf(e: KernelEmitter, op):
    dst = ptx_type(op.result.type)
    if dst in FP8:
        return _truncf_fp8(e, op, dst)
    if dst is BF16 and not e.platform.has("bf16"):
        raise UnsupportedByBackend(f"PTX backend: bf16 conversions (cvt.rn.bf16.f32) need sm_80 or later; "
                                   f"{e.platform.arch} has no bf16")

    def build(args):
        r = e.new(dst)
        e.emit(f"cvt.rn.{dst.op}.f32 {r}, {args[0]};")
        return r
    e.elementwise(op, build)


_div_rn, _div_approx = _binary("div.rn.f32 {r}, {a}, {b};"), _binary("div.approx.ftz.f32 {r}, {a}, {b};")


def _divf(e: KernelEmitter, op: arith.DivfOp):
    """IEEE division, or div.approx where the Tile IR marks the division approximate (`afn`)."""
    (_div_approx if "afn" in op.fastmath.data else _div_rn)(e, op)


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


def _remf(e: KernelEmitter, op: t.RemFOp):
    """C's fmod of f32 elements, exact (`tile.RemFOp`), by long division of the significands: |x|
    and |y| as m * 2^e with 24-bit m (subnormals normalized by their leading zeros), one bit of
    quotient a step while x's exponent exceeds y's, each element its own loop (a step per binade
    between them, none where |x| < |y|); the remainder, a multiple of y's unit in the last place
    and below |y|, packed back exactly (subnormal where it falls there), with x's sign. NaN where
    either is NaN, x infinite or y zero; x where y is infinite and x finite."""
    def bits(name_value):
        r = e.new(S32)
        e.emit(f"mov.b32 {r}, {name_value};")
        return r

    def normalized(magnitude: str) -> tuple[str, str]:
        """(24-bit significand with its leading one at bit 23, biased exponent, below 1 for subnormals)."""
        exp, man, lead, shift = e.new(S32), e.new(S32), e.new(PRED), e.new(S32)
        e.emit(f"shr.u32 {exp}, {magnitude}, 23;")
        e.emit(f"and.b32 {man}, {magnitude}, 8388607;")
        e.emit(f"setp.ne.s32 {lead}, {exp}, 0;")
        e.emit(f"@{lead} or.b32 {man}, {man}, 8388608;")
        e.emit(f"@!{lead} mov.s32 {exp}, 1;")
        e.emit(f"clz.b32 {shift}, {man};")
        e.emit(f"sub.s32 {shift}, {shift}, 8;")
        e.emit(f"shl.b32 {man}, {man}, {shift};")
        e.emit(f"sub.s32 {exp}, {exp}, {shift};")
        return man, exp

    def build(args):
        x, y = args
        ux, uy = bits(x), bits(y)
        ax, ay, sign = e.new(S32), e.new(S32), e.new(S32)
        e.emit(f"and.b32 {ax}, {ux}, 2147483647;")
        e.emit(f"and.b32 {ay}, {uy}, 2147483647;")
        e.emit(f"and.b32 {sign}, {ux}, -2147483648;")
        r = e.new(F32)
        nan, small, p = e.new(PRED), e.new(PRED), e.new(PRED)
        e.emit(f"setp.gt.u32 {nan}, {ay}, 2139095040;")          # y NaN
        e.emit(f"setp.ge.u32 {p}, {ax}, 2139095040;")            # x infinite or NaN
        e.emit(f"or.pred {nan}, {nan}, {p};")
        e.emit(f"setp.eq.u32 {p}, {ay}, 0;")                     # y zero
        e.emit(f"or.pred {nan}, {nan}, {p};")
        e.emit(f"setp.lt.u32 {small}, {ax}, {ay};")              # |x| < |y| (y infinite included): x
        done = e.label("fmod_done")
        e.emit(f"mov.b32 {r}, 2147483647;")
        e.emit(f"@{nan} bra {done};")
        e.emit(f"mov.f32 {r}, {x};")
        e.emit(f"@{small} bra {done};")
        mx, ex = normalized(ax)
        my, ey = normalized(ay)
        steps, more, ge = e.new(S32), e.new(PRED), e.new(PRED)
        e.emit(f"sub.s32 {steps}, {ex}, {ey};")
        top, last = e.label("fmod_step"), e.label("fmod_last")
        e.lines.append(f"{top}:")
        e.emit(f"setp.gt.s32 {more}, {steps}, 0;")
        e.emit(f"@!{more} bra {last};")
        e.emit(f"setp.ge.u32 {ge}, {mx}, {my};")
        e.emit(f"@{ge} sub.s32 {mx}, {mx}, {my};")
        e.emit(f"shl.b32 {mx}, {mx}, 1;")
        e.emit(f"sub.s32 {steps}, {steps}, 1;")
        e.emit(f"bra {top};")
        e.lines.append(f"{last}:")
        e.emit(f"setp.ge.u32 {ge}, {mx}, {my};")
        e.emit(f"@{ge} sub.s32 {mx}, {mx}, {my};")
        # the remainder mx * 2^(ey - 150), mx < 2^24: normalized to bit 23 at exponent er, or subnormal
        shift, er, out, sub, zero = e.new(S32), e.new(S32), e.new(S32), e.new(S32), e.new(PRED)
        e.emit(f"clz.b32 {shift}, {mx};")
        e.emit(f"sub.s32 {shift}, {shift}, 8;")
        e.emit(f"shl.b32 {mx}, {mx}, {shift};")
        e.emit(f"sub.s32 {er}, {ey}, {shift};")
        e.emit(f"sub.s32 {out}, {er}, 1;")
        e.emit(f"shl.b32 {out}, {out}, 23;")
        e.emit(f"add.s32 {out}, {out}, {mx};")
        e.emit(f"setp.lt.s32 {p}, {er}, 1;")
        e.emit(f"sub.s32 {sub}, 1, {er};")
        e.emit(f"min.s32 {sub}, {sub}, 31;")
        e.emit(f"shr.u32 {sub}, {mx}, {sub};")
        e.emit(f"selp.b32 {out}, {sub}, {out}, {p};")
        e.emit(f"setp.eq.s32 {zero}, {mx}, 0;")
        e.emit(f"selp.b32 {out}, 0, {out}, {zero};")
        e.emit(f"or.b32 {out}, {out}, {sign};")
        e.emit(f"mov.b32 {r}, {out};")
        e.lines.append(f"{done}:")
        return r
    e.elementwise(op, build)


#: the arith and math dialects' ops, tile comparisons, selects and casts
HANDLERS: dict[type, Callable] = {
    arith.ConstantOp: _constant,
    arith.AddfOp: _binary("add.f32 {r}, {a}, {b};"),
    arith.SubfOp: _binary("sub.f32 {r}, {a}, {b};"),
    arith.MulfOp: _binary("mul.f32 {r}, {a}, {b};"),
    arith.DivfOp: _divf,
    t.RemFOp: _remf,
    arith.MaximumfOp: _nan_minmax("max"),
    arith.MinimumfOp: _nan_minmax("min"),
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
    mathd.AbsIOp: _unary(lambda op: S32, "abs.s32 {r}, {a};"),
    mathd.FloorOp: _unary(lambda op: F32, "cvt.rmi.f32.f32 {r}, {a};"),
    arith.FloorDivSIOp: _floor_div_si,
    mathd.ErfOp: _erf,
    mathd.PowFOp: _pow,
}
