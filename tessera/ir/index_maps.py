"""Index maps: which iteration axis each dim of a Graph IR value walks inside a kernel.

A map has one entry per dim of a value: an axis name, or None where the dim has size 1 and
broadcasts. A template gives its roots maps (an output's dims walk its tile's axes) and maps flow
back through elementwise broadcasting, transposes and unsqueezes (`operand_maps`), so a transpose
is a load with swapped tile dims and `i[:, None] >= i[None, :]` reads one `arange` along two axes.
The fusion pass asks the same questions of a group before it makes one (`chain_tile`), so the
decisions and the code the templates build agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from xdsl.ir import Operation

from ..dims import is_dynamic
from ..errors import TesseraError
from . import graph as g

Map = tuple  # per dim: an axis name or None


def _size(d, bindings) -> int:
    return g.dim_value(d, bindings)


def operand_maps(op, result_map: Map, bindings) -> list[Map]:
    """Index maps of an op's operands, given its result's map."""
    if isinstance(op, (g.ElementwiseOp, g.CastOp)):
        out_shape = g.tensor_type(op.results[0]).shape
        maps = []
        for v in op.operands:
            shape = g.tensor_type(v).shape
            lead = len(out_shape) - len(shape)
            maps.append(tuple(None if _size(d, bindings) == 1 and _size(out_shape[lead + j], bindings) != 1
                              else result_map[lead + j] for j, d in enumerate(shape)))
        return maps
    if isinstance(op, g.TransposeOp):
        m = [None] * len(result_map)
        for i, p in enumerate(op.permutation):
            m[p] = result_map[i]
        return [tuple(m)]
    if isinstance(op, g.ReshapeOp):
        return [_unsqueeze_map(op, result_map, bindings)]
    raise TesseraError(f"{op.name} cannot be computed inside this kernel")


def _unsqueeze_map(op: g.ReshapeOp, result_map: Map, bindings) -> Map:
    """The input's map of a reshape that adds or removes size-1 dims (`unit_reshape_map`)."""
    return unit_reshape_map(g.tensor_type(op.res).shape, result_map, g.tensor_type(op.input).shape, bindings)


def unit_reshape_map(from_dims, m: Map, to_dims, bindings) -> Map:
    """The map of a tensor of `to_dims` that is a view of one of `from_dims` (walking `m`) by adding
    or removing size-1 dims: its other dims walk the view's in order, and its size-1 dims the axes
    of the last as many of the view's size-1 dims between the same neighbours (a dim inserted by
    `x[:, None]` comes before the one it pushes along): a one-key sequence's dim of 1 in
    `k[:, None]` stays the keys' axis. (Either way the element read is the dim's one element; what
    differs is whether the tile keeps the axis.)"""
    src = [_size(d, bindings) for d in to_dims]
    dst = [_size(d, bindings) for d in from_dims]
    if [s for s in src if s != 1] != [s for s in dst if s != 1]:
        raise TesseraError(f"reshape {src} <-> {dst} inside a fused kernel is not supported yet "
                           f"(only adding or removing size-1 dims is)")

    def unit_gaps(sizes):   # each size-1 dim's gap: the number of other dims before it
        return [sum(1 for x in sizes[:i] if x != 1) if n == 1 else None for i, n in enumerate(sizes)]
    dst_units: dict[int, list] = {}
    for axis, gap in zip(m, unit_gaps(dst)):
        if gap is not None:
            dst_units.setdefault(gap, []).append(axis)
    src_gaps = unit_gaps(src)
    kept = iter([axis for axis, size in zip(m, dst) if size != 1])
    out = []
    for i, gap in enumerate(src_gaps):
        if gap is None:
            out.append(next(kept))
            continue
        there = dst_units.get(gap, [])
        j = len(there) - 1 - src_gaps[i + 1:].count(gap)   # (this gap's size-1 dims after this one)
        out.append(there[j] if j >= 0 else None)
    return tuple(out)


def view_map(op, m: Map, bindings) -> Map:
    """The map of a view's result (a transpose, or a reshape adding or removing size-1 dims) from
    its input's `m`: what `operand_maps` inverts."""
    if isinstance(op, g.TransposeOp):
        return tuple(m[p] for p in op.permutation)
    return unit_reshape_map(g.tensor_type(op.input).shape, m, g.tensor_type(op.res).shape, bindings)


def matmul_operand_maps(op: g.MatmulOp, result_map: Map, k_axis: str, bindings) -> tuple[Map, Map]:
    """Maps of a matmul's operands: batch dims right-aligned (broadcasting), then (m, k) and (k, n)."""
    batch_map = result_map[:-2]
    out_batch = g.tensor_type(op.res).shape[:-2]

    def batch_part(v):
        shape = g.tensor_type(v).shape[:-2]
        lead = len(out_batch) - len(shape)
        return tuple(None if g.dim_value(d, bindings) == 1 and g.dim_value(out_batch[lead + j], bindings) != 1
                     else batch_map[lead + j] for j, d in enumerate(shape))
    return ((*batch_part(op.lhs), result_map[-2], k_axis), (*batch_part(op.rhs), k_axis, result_map[-1]))


# --- flash_chain kernels ------------------------------------------------------------------------

#: a flash_chain kernel's axes: its block's rows ("m"), the reduced axis it loops over ("n"), and a
#: matmul sink's output columns ("e"); batch dims walk "b0", "b1", ... (one index per block)
CHAIN_ROWS, CHAIN_LOOP, CHAIN_COLS = "m", "n", "e"


@dataclass(frozen=True)
class ChainTile:
    """How a flash_chain kernel tiles its sink: the map of the operand it computes (its last two
    dims walk m and n), of the sink's result, and of each score matmul's result in the region."""

    operand_map: Map
    result_map: Map
    scores: dict          # score matmul -> its result's map
    maps: dict            # every value of the region -> its map


def chain_tile(sink, operand, region: set, bindings, across: bool = False) -> ChainTile | None:
    """The tiling of a flash_chain kernel whose `sink` (a ReduceOp or MatmulOp) reduces `operand`,
    computed by the ops of `region` (views included: maps are followed through them only); None when a score matmul of the region is not read along the
    tile's two axes (or is read in two orientations). `across`: a matmul sink that reduces the
    kernel's rows instead of its loop (`ChainSink.across`)."""
    operand_map, result_map = _sink_maps(sink, operand, bindings, across)
    maps: dict = {operand: operand_map}
    scores: dict = {}
    work, seen = [(operand, operand_map)], set()
    while work:   # every (value, map) a region reads: a value read in two orientations is walked in both
        v, m = work.pop()
        op = v.owner
        if (v, m) in seen or op not in region or not isinstance(
                op, (g.ElementwiseOp, g.CastOp, g.MatmulOp, g.TransposeOp, g.ReshapeOp)):
            continue
        seen.add((v, m))
        if isinstance(op, g.MatmulOp):   # one recomputed tile per score matmul: one orientation
            if m[:-2].count(CHAIN_ROWS) or m[:-2].count(CHAIN_LOOP) or \
                    set(m[-2:]) != {CHAIN_ROWS, CHAIN_LOOP} or scores.get(op, m) != m:
                return None
            scores[op] = m
            continue
        for x, xm in zip(op.operands, operand_maps(op, m, bindings)):
            maps.setdefault(x, xm)
            work.append((x, xm))
    return ChainTile(operand_map, result_map, scores, maps) if scores else None


def _sink_maps(sink, operand, bindings, across: bool = False) -> tuple[Map, Map]:
    """(the computed operand's map, the sink's result map)."""
    if across:   # reduced over the rows, its result walks the loop: one block of it a step
        batch = tuple(f"b{d}" for d in range(g.tensor_type(sink.res).rank - 2))
        lhs_computed = sink.lhs is operand
        result = (*batch, CHAIN_LOOP, CHAIN_COLS) if lhs_computed else (*batch, CHAIN_COLS, CHAIN_LOOP)
        lhs_map, rhs_map = matmul_operand_maps(sink, result, CHAIN_ROWS, bindings)
        return (lhs_map if lhs_computed else rhs_map), result
    if isinstance(sink, g.ReduceOp):
        rank, axis = g.tensor_type(sink.input).rank, sink.axis.data
        m = tuple(CHAIN_LOOP if d == axis else CHAIN_ROWS if d >= rank - 2 else f"b{d}" for d in range(rank))
        result = tuple(None if a == CHAIN_LOOP else a for a in m) if sink.keepdim.data else \
            tuple(a for a in m if a != CHAIN_LOOP)
        return m, result
    batch = tuple(f"b{d}" for d in range(g.tensor_type(sink.res).rank - 2))
    lhs_computed = sink.lhs is operand
    result = (*batch, CHAIN_ROWS, CHAIN_COLS) if lhs_computed else (*batch, CHAIN_COLS, CHAIN_ROWS)
    lhs_map, rhs_map = matmul_operand_maps(sink, result, CHAIN_LOOP, bindings)
    return (lhs_map if lhs_computed else rhs_map), result


@dataclass(frozen=True)
class ChainSink:
    """One sink of a flash_chain kernel body: the reduction or matmul an output is computed from
    (through its elementwise epilogue), the operand of it the kernel computes, and its tiling."""

    output: object        # the yielded value
    op: object            # the ReduceOp or MatmulOp
    computed: object      # its operand computed in the kernel (the other, if any, is read from memory)
    tiling: ChainTile
    #: a matmul sink reducing the kernel's rows (m), its result a block of the loop axis (n) per
    #: step, summed over the row blocks' programs: the attention backward's dQ = dS @ K in the
    #: kernel of dK and dV (keys as rows), where a kernel of its own computed S and dP again
    across: bool = False


def chain_sinks(block, bindings) -> list[ChainSink]:
    """The sinks of a flash_chain kernel body (a block whose arguments are the kernel's inputs and
    whose last op yields its outputs), one per output, in the yield's order; a TesseraError when
    an output has no sink or a sink cannot be tiled as one. The first sink's tiling orients the
    kernel: a later matmul sink whose score tiles it reads transposed is an `across` sink."""
    out = []
    for value in block.last_op.operands:
        sink = _sink_behind(value)
        computed = [v for v in sink.operands if chain_source(v) is None]
        if isinstance(sink, g.ReduceOp) or len(computed) == 1:
            tiling = chain_tile(sink, computed[0], set(block.ops), bindings) if computed else None
            across = False
            if tiling is not None and out and isinstance(sink, g.MatmulOp) and \
                    _transposed_scores(tiling.scores, out[0].tiling.scores):
                tiling, across = chain_tile(sink, computed[0], set(block.ops), bindings, across=True), True
            if tiling is not None:
                out.append(ChainSink(value, sink, computed[0], tiling, across))
                continue
        raise TesseraError(f"a flash_chain kernel's {sink.name} must reduce one operand computed from score "
                           f"matmuls along the kernel's tile")
    return out


def swap_rows_and_loop(m: Map) -> Map:
    """A map (or any axes) with a chain kernel's rows and loop axes swapped."""
    swap = {CHAIN_ROWS: CHAIN_LOOP, CHAIN_LOOP: CHAIN_ROWS}
    return tuple(swap.get(a, a) for a in m)


def _transposed_scores(scores: dict, kernel_scores: dict) -> bool:
    """Whether a sink reads the kernel's score tiles each with its rows and loop swapped."""
    common = set(scores) & set(kernel_scores)
    return bool(common) and all(swap_rows_and_loop(scores[mm]) == kernel_scores[mm] for mm in common)


def chain_axis_dims(sinks: list[ChainSink], size: Callable[[g.Dim], int]) -> dict[str, g.Dim]:
    """Every axis's dim in a flash_chain kernel, from its sinks' computed operands and results
    (the same for every sink: fusion merges only such kernels): a dim taken at run time where one
    is, else the largest (a size-1 dim broadcasts); `size` gives a dim's extent."""
    dims: dict[str, g.Dim] = {}
    for sink in sinks:
        for v, m in ((sink.computed, sink.tiling.operand_map), (sink.op.results[0], sink.tiling.result_map)):
            for axis, d in zip(m, g.tensor_type(v).shape):
                known = dims.get(axis)
                if axis is not None and (known is None or is_dynamic(size(d)) or
                                         not is_dynamic(size(known)) and size(d) > size(known)):
                    dims[axis] = d
    return dims


def chain_axis_sizes(sinks: list[ChainSink], size: Callable[[g.Dim], int]) -> dict[str, int]:
    """Every axis's extent in a flash_chain kernel (`chain_axis_dims`; a dynamic dim's `Dynamic`)."""
    return {axis: size(d) for axis, d in chain_axis_dims(sinks, size).items()}


def _sink_behind(v):
    work, seen = [v], set()
    while work:
        op = work.pop().owner
        if op in seen or not isinstance(op, Operation):
            continue
        seen.add(op)
        if isinstance(op, (g.ReduceOp, g.MatmulOp)):
            return op
        work.extend(op.operands)
    raise TesseraError("a flash_chain kernel's output must be computed from a matmul or a reduction")


def chain_source(v):
    """The kernel input `v` views (through transposes and reshapes), or None if computed in it."""
    while isinstance(v.owner, (g.TransposeOp, g.ReshapeOp)):
        v = v.owner.input
    return None if isinstance(v.owner, Operation) else v
