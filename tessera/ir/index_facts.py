"""Facts about index values that hold for every thread and every launch: what a value is always a
multiple of, and whether it is never negative.

Backends use them to leave out work the facts make redundant: a tile whose origin is a multiple of
its extent, in a tensor whose size is too, is either wholly inside the tensor or wholly outside, so
one check per copy replaces one per element chunk; and a remainder or quotient of a value that is
never negative can use unsigned arithmetic, which a constant divisor turns into a multiply. The
facts are read off the ops that define a value (constants, integer arithmetic, program ids and
the induction variables of loops whose bounds are known), like Triton's axis analysis, in its
smallest form.
"""
from __future__ import annotations

import math

from xdsl.dialects import arith, scf
from xdsl.ir import BlockArgument, SSAValue

from . import tile as t



def constant_value(v: SSAValue) -> int | None:
    op = v.owner
    if isinstance(op, arith.ConstantOp) and hasattr(op.value, "value"):
        value = op.value.value.data
        return value if isinstance(value, int) else None
    return None


def _loop_of(v: SSAValue) -> scf.ForOp | None:
    """The scf.for whose induction variable `v` is, if it is one."""
    if isinstance(v, BlockArgument) and v.index == 0 and isinstance(v.block.parent_op(), scf.ForOp):
        return v.block.parent_op()
    return None


def known_multiple(v: SSAValue) -> int:
    """An m >= 0 such that `v` is always a multiple of m: 1 when nothing is known, 0 when `v` is
    always 0 (a multiple of everything; gcd(0, m) = m and 0 * m = 0 keep the arithmetic exact)."""
    c = constant_value(v)
    if c is not None:
        return abs(c)
    loop = _loop_of(v)
    if loop is not None:  # lb + i * step
        return math.gcd(known_multiple(loop.lb), known_multiple(loop.step))
    op = v.owner
    if isinstance(op, arith.MuliOp):
        return known_multiple(op.lhs) * known_multiple(op.rhs)
    if isinstance(op, (arith.AddiOp, arith.SubiOp, arith.MinSIOp, arith.MaxSIOp)):
        return math.gcd(known_multiple(op.lhs), known_multiple(op.rhs))
    if isinstance(op, t.SelectOp):   # one of two values (a copy past a split's run reads past the end)
        return math.gcd(known_multiple(op.lhs), known_multiple(op.rhs))
    if isinstance(op, arith.IndexCastOp):
        return known_multiple(op.input)
    return 1


def is_non_negative(v: SSAValue, assumed: frozenset = frozenset()) -> bool:
    """True when `v` can never be negative (`assumed`: loop-carried values taken as non-negative
    while their own update is checked, the induction step of `_is_counter`)."""
    if v in assumed:
        return True
    c = constant_value(v)
    if c is not None:
        return c >= 0
    loop = _loop_of(v)
    if loop is not None:  # counts up from a non-negative start
        return is_non_negative(loop.lb, assumed) and (constant_value(loop.step) or 0) > 0
    if _is_counter(v, assumed):
        return True
    op = v.owner
    if isinstance(op, (t.ProgramIdOp, t.DimOp)):   # (a dim's size, taken at run time)
        return True
    if isinstance(op, (arith.AddiOp, arith.MuliOp, arith.MinSIOp, arith.DivSIOp, arith.RemSIOp)):
        return is_non_negative(op.lhs, assumed) and is_non_negative(op.rhs, assumed)
    if isinstance(op, arith.MaxSIOp):
        return is_non_negative(op.lhs, assumed) or is_non_negative(op.rhs, assumed)
    if isinstance(op, arith.IndexCastOp):
        return is_non_negative(op.input, assumed)
    if isinstance(op, t.SelectOp):
        return is_non_negative(op.lhs, assumed) and is_non_negative(op.rhs, assumed)
    return False


def _is_counter(v: SSAValue, assumed: frozenset) -> bool:
    """Whether `v` is a loop-carried value that starts non-negative and each iteration adds a
    non-negative amount to (a persistent GEMM's first pipeline step of each tile): by induction,
    the amount is checked with `v` itself assumed non-negative."""
    if not (isinstance(v, BlockArgument) and v.index > 0 and isinstance(v.block.parent_op(), scf.ForOp)):
        return False
    loop = v.block.parent_op()
    yielded = v.block.last_op.operands[v.index - 1]
    step = yielded.owner
    inner = assumed | {v}
    return (is_non_negative(loop.iter_args[v.index - 1], assumed) and isinstance(step, arith.AddiOp)
            and v in (step.lhs, step.rhs)
            and is_non_negative(step.rhs if step.lhs is v else step.lhs, inner))
