"""What a score mask says about which key blocks a query block can skip.

A flash-attention kernel computes softmax over `where(cond, s, -inf)`. When
`cond` compares a column index with a row index, `col <= row + c` (causal,
c = 0) or `col >= row + c` (a window's lower edge), every key block outside
those bounds contributes exp(-inf) = 0 and need not be loaded at all. This
module reads such conditions from the graph ops of the mask, whatever the
user wrote them as (`i[:, None] >= i[None, :]`, `j[None, :] <= i[:, None] + 2`,
`i[:, None] - j[None, :] < 1024`, with reshapes, transposes or casts in between).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.ir import Operation, SSAValue

from .. import dtypes
from ..ir import graph as g
from ..ir.index_maps import Map, operand_maps

#: comparison -> (relation of `col` to `row` when the column index is on the left, when it is on the right)
_RELATION = {"le": ("le", "ge"), "lt": ("lt", "gt"), "ge": ("ge", "le"), "gt": ("gt", "lt")}


@dataclass(frozen=True)
class ColumnBounds:
    """Columns a row may attend to: row + lower <= col <= row + upper (None: unbounded)."""

    lower: int | None
    upper: int | None


def _constant(v: SSAValue) -> float | None:
    op = v.owner
    while isinstance(op, g.CastOp):
        op = op.input.owner
    return op.value.value.data if isinstance(op, g.ConstantOp) else None


@dataclass(frozen=True)
class Term:
    """`sign` times an int32 kernel input read at run time, its dims walking `value_map`: per
    program (none of them the tile's axes: a sequence's length) or per row (one on the row axis:
    each packed query's first or last key, varlen attention); or a dim's size taken at run time
    (`graph.dim_size`: a decode step's key count)."""

    value: SSAValue
    value_map: Map
    sign: int = 1

    def negated(self) -> "Term":
        return Term(self.value, self.value_map, -self.sign)


@dataclass(frozen=True)
class _Linear:
    """An int index expression on a mask's tile: `axis`'s index (reduced `% modulo` if set) + `const`
    + the sum of `terms` (values read at run time)."""

    axis: str | None = None
    const: int = 0
    terms: tuple[Term, ...] = ()
    modulo: int | None = None

    def plus(self, other: "_Linear") -> "_Linear | None":
        if self.axis and other.axis:
            return None
        a = self if self.axis or not other.axis else other
        return _Linear(a.axis, self.const + other.const, self.terms + other.terms, a.modulo)


def _linear(v: SSAValue, m: Map, bindings, col_axis: str | None) -> _Linear | None:
    """`v` as a `_Linear` (its kernel inputs read at run time, none along `col_axis`), or None."""
    op = v.owner
    if isinstance(op, g.ConstantOp):   # (a bool constant or a cast is no integer: no casts are looked through)
        c = op.value.value.data
        return _Linear(const=int(c)) if g.tensor_type(v).dtype != dtypes.bool_ and float(c).is_integer() else None
    if isinstance(op, g.ArangeOp):
        return _Linear(axis=m[0]) if m[0] is not None else None
    if isinstance(op, g.DimSizeOp):   # a dim's size, taken at run time: the same for every program
        return _Linear(terms=(Term(v, m),))
    if not isinstance(op, Operation):   # a kernel input: an int read per program, or per row
        if (col_axis is not None and col_axis in m) or g.tensor_type(v).dtype != dtypes.int32:
            return None
        return _Linear(terms=(Term(v, m),))
    if isinstance(op, (g.ReshapeOp, g.TransposeOp, g.CastOp)):
        if isinstance(op, g.CastOp) and not (g.tensor_type(v).dtype == g.tensor_type(op.input).dtype == dtypes.int32):
            return None   # (a cast to bool, to a float or from one changes the value)
        (inner,) = operand_maps(op, m, bindings)
        return _linear(op.operands[0], inner, bindings, col_axis)
    if not isinstance(op, g.ElementwiseOp) or op.kind not in ("add", "sub", "remainder"):
        return None
    a, b = (_linear(x, xm, bindings, col_axis) for x, xm in zip(op.inputs, operand_maps(op, m, bindings)))
    if a is None or b is None:
        return None
    if op.kind == "add":
        return a.plus(b)
    if op.kind == "sub":   # minus constants and values, not an index
        return None if b.axis else _Linear(a.axis, a.const - b.const, a.terms + tuple(x.negated() for x in b.terms),
                                           a.modulo)
    # remainder: a bare index modulo a positive constant (query_groups' merged rows' query position)
    if a.axis and a.const == 0 and not a.terms and a.modulo is None and not b.axis and not b.terms and b.const > 0:
        return _Linear(a.axis, modulo=b.const)
    return None


def index_expression(v: SSAValue, m: Map, bindings) -> tuple[str, int] | None:
    """`v` as `arange` along an axis plus an integer constant: (axis, constant), or None."""
    x = _linear(v, m, bindings, None)
    return (x.axis, x.const) if x is not None and x.axis and not x.terms and x.modulo is None else None


@dataclass(frozen=True)
class ColumnLimit:
    """A mask's bound on the columns a row keeps, beyond `ColumnBounds`: col < (col >= where
    `lower`) `const` + the sum of `terms` (values read at run time: per program, a sequence's
    length; per row, a packed query's first or last key) + the row's index (`rows` "index"), or
    its index % `modulo` (`rows` "modulo": the query position of rows merged from several heads'
    queries), or nothing (`rows` None)."""

    const: int
    terms: tuple[Term, ...]
    rows: str | None = None
    modulo: int | None = None
    lower: bool = False

    def per_row(self, row_axis: str) -> bool:
        """Whether a term is read per row (a query block then reads a run of it)."""
        return any(row_axis in term.value_map for term in self.terms)


@dataclass(frozen=True)
class MaskTerms:
    """What a mask's conjuncts say: constant bounds relative to the row, and limits read at run time."""

    bounds: ColumnBounds
    limits: tuple[ColumnLimit, ...] = ()


def _intersect(a: ColumnBounds, b: ColumnBounds) -> ColumnBounds:
    lower = [x for x in (a.lower, b.lower) if x is not None]
    upper = [x for x in (a.upper, b.upper) if x is not None]
    return ColumnBounds(max(lower) if lower else None, min(upper) if upper else None)


def mask_terms(cond: SSAValue, cond_map: Map, row_axis: str, col_axis: str, bindings) -> MaskTerms | None:
    """The columns `cond` keeps for each row, where it is a conjunction (`&`) of comparisons of the
    column index with a row index plus a constant (`ColumnBounds`) or with a limit read at run time
    (`ColumnLimit`: `col < length`, `col <= row + length - m`, `col >= first[row]`); None where a
    conjunct is neither (the mask is then computed on every block)."""
    op = cond.owner
    while isinstance(op, (g.ReshapeOp, g.TransposeOp, g.CastOp)):
        (cond_map,) = operand_maps(op, cond_map, bindings)
        cond = op.operands[0]
        op = cond.owner
    if isinstance(op, g.ElementwiseOp) and op.kind == "logical_and":
        parts = [mask_terms(x, xm, row_axis, col_axis, bindings)
                 for x, xm in zip(op.inputs, operand_maps(op, cond_map, bindings))]
        if None in parts:
            return None
        return MaskTerms(_intersect(parts[0].bounds, parts[1].bounds), parts[0].limits + parts[1].limits)
    if not (isinstance(op, g.ElementwiseOp) and op.kind in _RELATION):
        return None
    left, right = (_linear(v, vm, bindings, col_axis) for v, vm in zip(op.inputs, operand_maps(op, cond_map, bindings)))
    if left is not None and right is not None and left.axis == col_axis and not left.terms \
            and left.modulo is None and right.axis != col_axis:
        relation, other, shift = _RELATION[op.kind][0], right, left.const
    elif left is not None and right is not None and right.axis == col_axis and not right.terms \
            and right.modulo is None and left.axis != col_axis:
        relation, other, shift = _RELATION[op.kind][1], left, right.const
    elif (solved := _solved_for_column(op, cond_map, row_axis, col_axis, bindings)) is not None:
        (relation, other), shift = solved, 0
    else:
        return None
    c = other.const - shift            # col REL other - shift
    if other.axis not in (None, row_axis):
        return None
    if not other.terms and other.modulo is None and other.axis == row_axis:
        return MaskTerms({"le": ColumnBounds(None, c), "lt": ColumnBounds(None, c - 1),
                          "ge": ColumnBounds(c, None), "gt": ColumnBounds(c + 1, None)}[relation])
    if other.modulo and any(row_axis in term.value_map for term in other.terms):
        return None                    # (values per row of merged rows: not read as limits)
    rows = None if other.axis is None else "modulo" if other.modulo else "index"
    const = c + (relation in ("le", "gt"))   # col < const + ... (col >= const + ... where lower)
    return MaskTerms(ColumnBounds(None, None),
                     (ColumnLimit(const, other.terms, rows, other.modulo, lower=relation in ("ge", "gt")),))


def _signed_parts(v: SSAValue, m: Map, bindings, col_axis: str, sign: int) -> list[tuple[int, _Linear]] | None:
    """`v` as a sum of signed `_Linear`s: its tree of adds and subtracts flattened (through reshapes,
    transposes and int32 casts), so that both indices may appear (`i - j`); None where a leaf is
    not a `_Linear`."""
    op = v.owner
    if isinstance(op, (g.ReshapeOp, g.TransposeOp)) or (
            isinstance(op, g.CastOp) and g.tensor_type(v).dtype == g.tensor_type(op.input).dtype == dtypes.int32):
        (inner,) = operand_maps(op, m, bindings)
        return _signed_parts(op.operands[0], inner, bindings, col_axis, sign)
    if isinstance(op, g.ElementwiseOp) and op.kind in ("add", "sub"):
        a, b = (_signed_parts(x, xm, bindings, col_axis, sign if i == 0 or op.kind == "add" else -sign)
                for i, (x, xm) in enumerate(zip(op.inputs, operand_maps(op, m, bindings))))
        return None if a is None or b is None else a + b
    leaf = _linear(v, m, bindings, col_axis)
    return None if leaf is None else [(sign, leaf)]


def _solved_for_column(op: g.ElementwiseOp, cond_map: Map, row_axis: str, col_axis: str,
                       bindings) -> tuple[str, _Linear] | None:
    """A comparison with the column and row indices anywhere in sums and differences on either side
    (`i - j < w`: a window written as a distance), solved for the column: (relation, other) with
    `col relation other`, `other` the row index (coefficient 1) or none plus constants and values
    read at run time; None where the column's coefficient is not +-1, the row's would not be 0 or
    1 (`col <= 5 - row`), another axis appears, or an index is reduced modulo."""
    sides = [_signed_parts(x, xm, bindings, col_axis, sign)
             for x, xm, sign in zip(op.inputs, operand_maps(op, cond_map, bindings), (1, -1))]
    if None in sides:
        return None
    coefficients: dict[str, int] = {}
    const, terms = 0, []               # left - right = sum of coefficient * index + const + terms
    for sign, part in sides[0] + sides[1]:
        if part.modulo is not None:
            return None
        if part.axis is not None:
            coefficients[part.axis] = coefficients.get(part.axis, 0) + sign
        const += sign * part.const
        terms += [t if sign > 0 else t.negated() for t in part.terms]
    col, row = coefficients.pop(col_axis, 0), coefficients.pop(row_axis, 0)
    if col not in (1, -1) or any(coefficients.values()):
        return None
    if col == 1:                       # col + rest REL 0: col REL -rest
        relation, row, const, terms = op.kind, -row, -const, [t.negated() for t in terms]
    else:                              # -col + rest REL 0: col (the relation flipped) rest
        relation = _RELATION[op.kind][1]
    if row not in (0, 1):
        return None
    return relation, _Linear(row_axis if row else None, const, tuple(terms))


def attention_mask(softmax_input: SSAValue, m: Map, row_axis: str, col_axis: str, bindings) -> MaskTerms | None:
    """The terms of a `where(cond, s, -inf)` mask (`mask_terms`), or None."""
    op = softmax_input.owner
    if not (isinstance(op, g.ElementwiseOp) and op.kind == "where"):
        return None
    fill = _constant(op.inputs[2])
    if fill is None or not (math.isinf(fill) and fill < 0):
        return None
    return mask_terms(op.inputs[0], operand_maps(op, m, bindings)[0], row_axis, col_axis, bindings)


def column_bounds(softmax_input: SSAValue, m: Map, row_axis: str, col_axis: str, bindings) -> ColumnBounds:
    """The bounds a `where(col REL row + c, s, -inf)` mask (or a conjunction of such) puts on the
    columns of each row; unbounded where the mask has any other term."""
    terms = attention_mask(softmax_input, m, row_axis, col_axis, bindings)
    return terms.bounds if terms is not None and not terms.limits else ColumnBounds(None, None)


def condition_bounds(cond: SSAValue, cond_map: Map, row_axis: str, col_axis: str, bindings) -> ColumnBounds:
    """The columns a condition `col REL row + c` (or a conjunction of such) holds at, for each row
    (unbounded when it has any other term)."""
    terms = mask_terms(cond, cond_map, row_axis, col_axis, bindings)
    return terms.bounds if terms is not None and not terms.limits else ColumnBounds(None, None)


def masked_value(v: SSAValue, cond: SSAValue, memo: dict | None = None) -> float | None:
    """The constant `v` holds wherever `cond` is false, when the ops between them say (else None):
    `where(cond, x, c)` is c there, and the value passes through views, casts, exp (of -inf: 0), products
    (with 0), sums and differences (of -inf with a finite value, of 0 with 0), assuming the other
    operands finite. This is what lets a flash_chain kernel skip the blocks a causal or window mask
    removes whole: an attention backward's probabilities exp(where(mask, s, -inf) - lse) and its
    dS = where(mask, dX, 0) * scale are 0 there. (A row the mask removes whole then gets zero
    gradients where the unskipped arithmetic gives NaN.)"""
    memo = {} if memo is None else memo
    if v in memo:
        return memo[v]
    memo[v] = None
    op = v.owner
    value = None
    if isinstance(op, (g.CastOp, g.TransposeOp, g.ReshapeOp)):
        value = masked_value(op.operands[0], cond, memo)
    elif isinstance(op, g.ElementwiseOp):
        if op.kind == "where" and op.inputs[0] is cond:
            value = _constant(op.inputs[2])
        else:
            inner = [masked_value(x, cond, memo) for x in op.inputs]
            value = _through(op.kind, inner)
    memo[v] = value
    return value


def _through(kind: str, inner: list) -> float | None:
    if kind == "exp" and inner[0] == -math.inf:
        return 0.0
    if kind == "mul" and 0.0 in inner and all(x is None or math.isfinite(x) for x in inner):
        return 0.0
    if kind in ("add", "sub") and inner[0] == -math.inf and (kind == "add" or inner[1] is None):
        return -math.inf if inner[1] is None or inner[1] == -math.inf else None
    if kind in ("add", "sub") and inner[0] == 0.0 and inner[1] == 0.0:
        return 0.0
    if kind == "neg" and inner[0] == 0.0:
        return 0.0
    return None


def chain_bounds(block, sinks, bindings) -> ColumnBounds:
    """The columns (n) each row (m) of a flash_chain kernel's tile (`index_maps.chain_sinks` of its
    body `block`) can be nonzero at, for every sink: those a mask `where(col REL row + c, ...)` in
    the body keeps, when the reduced value is the reduction's neutral value (0 for a matmul)
    wherever that mask is false (`masked_value`), so the blocks outside are skipped (a causal
    backward loops over half the blocks). Unbounded where the sinks disagree or one has no such mask."""
    found = {_sink_bounds(block, sink, bindings) for sink in sinks}
    return found.pop() if len(found) == 1 else ColumnBounds(None, None)


def _sink_bounds(block, sink, bindings) -> ColumnBounds:
    fill = g.NEUTRAL[sink.op.kind.data] if isinstance(sink.op, g.ReduceOp) else 0.0
    for op in block.ops:
        if not (isinstance(op, g.ElementwiseOp) and op.kind == "where" and op.res in sink.tiling.maps):
            continue
        cond = op.inputs[0]
        bounds = condition_bounds(cond, operand_maps(op, sink.tiling.maps[op.res], bindings)[0], "m", "n", bindings)
        if bounds != ColumnBounds(None, None) and masked_value(sink.computed, cond) == fill:
            return bounds
    return ColumnBounds(None, None)
