"""What a score mask says about which key blocks a query block can skip.

A flash-attention kernel computes softmax over `where(cond, s, -inf)`. When
`cond` compares a column index with a row index, `col <= row + c` (causal,
c = 0) or `col >= row + c` (a window's lower edge), every key block outside
those bounds contributes exp(-inf) = 0 and need not be loaded at all. This
module reads such conditions from the graph ops of the mask, whatever the
user wrote them as (`i[:, None] >= i[None, :]`, `j[None, :] <= i[:, None] + 2`,
with reshapes, transposes or casts in between).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.ir import SSAValue

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


def index_expression(v: SSAValue, m: Map, bindings) -> tuple[str, int] | None:
    """`v` as `arange` along an axis plus an integer constant: (axis, constant), or None."""
    op = v.owner
    if isinstance(op, g.ArangeOp):
        return (m[0], 0) if m[0] is not None else None
    if isinstance(op, (g.ReshapeOp, g.TransposeOp, g.CastOp)):
        (inner,) = operand_maps(op, m, bindings)
        return index_expression(op.operands[0], inner, bindings)
    if isinstance(op, g.ElementwiseOp) and op.kind in ("add", "sub"):
        a, b = op.inputs
        ma, mb = operand_maps(op, m, bindings)
        cb, ca = _constant(b), _constant(a)
        if cb is not None and float(cb).is_integer():
            inner = index_expression(a, ma, bindings)
            return (inner[0], inner[1] + int(cb) * (1 if op.kind == "add" else -1)) if inner else None
        if ca is not None and float(ca).is_integer() and op.kind == "add":
            inner = index_expression(b, mb, bindings)
            return (inner[0], inner[1] + int(ca)) if inner else None
    return None


def column_bounds(softmax_input: SSAValue, m: Map, row_axis: str, col_axis: str, bindings) -> ColumnBounds:
    """The bounds a `where(col REL row + c, s, -inf)` mask puts on the columns of each row."""
    none = ColumnBounds(None, None)
    op = softmax_input.owner
    if not (isinstance(op, g.ElementwiseOp) and op.kind == "where"):
        return none
    fill = _constant(op.inputs[2])
    if fill is None or not (math.isinf(fill) and fill < 0):
        return none
    return condition_bounds(op.inputs[0], operand_maps(op, m, bindings)[0], row_axis, col_axis, bindings)


def condition_bounds(cond: SSAValue, cond_map: Map, row_axis: str, col_axis: str, bindings) -> ColumnBounds:
    """The columns a condition `col REL row + c` holds at, for each row (unbounded when it is not
    such a comparison)."""
    none = ColumnBounds(None, None)
    cmp = cond.owner
    if not (isinstance(cmp, g.ElementwiseOp) and cmp.kind in _RELATION):
        return none
    left, right = (index_expression(v, vm, bindings) for v, vm in zip(cmp.inputs, operand_maps(cmp, cond_map, bindings)))
    if left is None or right is None:
        return none
    if (left[0], right[0]) == (col_axis, row_axis):
        relation, c = _RELATION[cmp.kind][0], right[1] - left[1]
    elif (left[0], right[0]) == (row_axis, col_axis):
        relation, c = _RELATION[cmp.kind][1], left[1] - right[1]
    else:
        return none
    return {"le": ColumnBounds(None, c), "lt": ColumnBounds(None, c - 1),
            "ge": ColumnBounds(c, None), "gt": ColumnBounds(c + 1, None)}[relation]


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
