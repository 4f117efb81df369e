"""Profile regions in Tile IR: the timestamps a profiled kernel records.

A kernel built with profiling on gets one more parameter, a buffer [grid z, grid y, grid x,
slots, 4] of i32 (`tile.PROFILE_WORDS`), and `tile.profile_begin`/`tile.profile_end` ops that
write the (begin, end) stamps of each slot for their block, each a 64-bit count in two words
(one thread per block on a GPU, `%clock64` cycles; host nanoseconds on the CPU interpreter).
Slot 0 spans the whole kernel; slot i spans the region that `tessera.profile` (the kernel's
attribute) names at index i.

A region's span is the smallest run of the kernel's top-level ops that holds every op generated
from a graph op traced inside the region (`tessera.regions`, carried by fusion and the tile
lowering), so it survives fusion: each kernel times its own part of the region. Spans are
measured once per block, never inside a loop: a region with an op in a loop spans the whole loop.
"""
from __future__ import annotations

from xdsl.dialects.builtin import ArrayAttr, FunctionType, MemRefType, StringAttr, i32
from xdsl.ir import Block, Operation
from xdsl.traits import IsTerminator

from ..ir import provenance
from ..ir import tile as t


def instrument(kernel: t.KernelOp, grid: tuple[int, int, int]) -> MemRefType:
    """Adds profile stamps to `kernel` (launched over `grid`) and its buffer as a last parameter;
    returns the buffer's type, for the host to allocate."""
    body = kernel.body.block
    spans = region_spans(body)
    labels = [kernel.sym_name.data, *spans]
    buffer_type = MemRefType(i32, [grid[2], grid[1], grid[0], len(labels), t.PROFILE_WORDS])
    buffer = body.insert_arg(buffer_type, len(body.args))
    kernel.properties["function_type"] = FunctionType.from_lists(body.arg_types, [])
    body.insert_op_before(t.ProfileBeginOp(buffer, labels[0], 0), body.first_op)
    body.insert_op_before(t.ProfileEndOp(buffer, labels[0], 0), body.last_op)
    for slot, (label, (first, last)) in enumerate(spans.items(), start=1):
        body.insert_op_before(t.ProfileBeginOp(buffer, label, slot), first)
        body.insert_op_after(t.ProfileEndOp(buffer, label, slot), last)
    kernel.attributes[provenance.PROFILE] = ArrayAttr([StringAttr(label) for label in labels])
    return buffer_type


def region_spans(body: Block) -> dict[str, tuple[Operation, Operation]]:
    """Per region, in order of first appearance: the first and last top-level op of `body` (its
    terminator aside) that is or holds an op of the region."""
    spans: dict[str, tuple[Operation, Operation]] = {}
    for top in body.ops:
        if top.has_trait(IsTerminator):
            continue
        for op in top.walk():
            for label in provenance.regions_of(op):
                first = spans.get(label, (top, top))[0]
                spans[label] = (first, top)
    return spans
