"""Where an op came from in the user's program, carried as attributes through every IR level.

The tracer stamps each Graph IR op with the user's source line (`tessera.loc = "/path/f.py:12"`)
and, inside `tsr.profile_region`s, the regions open around it (`tessera.regions = ["attn"]`).
Fusion clones graph ops with their attributes; the Tile IR lowering copies a graph op's
provenance onto the tile ops generated for it (`emit.Builder.origin`); the Target IR lowering
keeps the attributes of the ops it rewrites (`CarryProvenance`). Backends read them: the PTX
backend turns `tessera.loc` into `.loc` line info, the profiler turns regions into timed spans.

Plain string attributes, so every dialect's printer and parser round-trips them as they are.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from xdsl.dialects.builtin import ArrayAttr, StringAttr
from xdsl.ir import Attribute, Operation
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

#: an op's source line in the user's program, "file:line"
LOC = "tessera.loc"
#: the profile regions (outermost first) an op was traced in
REGIONS = "tessera.regions"
#: kernel attribute: the backend emits line info (PTX `.file`/`.loc`) for the kernel
LINE_INFO = "tessera.line_info"
#: kernel attribute: the kernel records profile stamps, one slot per label (slot 0: the whole kernel)
PROFILE = "tessera.profile"

#: attributes with this prefix travel with an op through every lowering
PREFIX = "tessera."


@dataclass(frozen=True)
class Loc:
    """A line of the user's program."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    @staticmethod
    def parse(text: str) -> Loc | None:
        """`"file:line"` back to a Loc (None when the text has no line number)."""
        file, sep, line = text.rpartition(":")
        return Loc(file, int(line)) if sep and file and line.isdigit() else None


def loc_attributes(loc: Loc | None, regions: Iterable[str] = ()) -> dict[str, Attribute]:
    """The attributes that record `loc` and the open `regions` on an op."""
    attrs: dict[str, Attribute] = {}
    if loc is not None:
        attrs[LOC] = StringAttr(str(loc))
    regions = list(regions)
    if regions:
        attrs[REGIONS] = ArrayAttr([StringAttr(r) for r in regions])
    return attrs


def loc_of(op: Operation) -> Loc | None:
    attr = op.attributes.get(LOC)
    return Loc.parse(attr.data) if isinstance(attr, StringAttr) else None


def regions_of(op: Operation) -> tuple[str, ...]:
    attr = op.attributes.get(REGIONS)
    return tuple(r.data for r in attr.data) if isinstance(attr, ArrayAttr) else ()


def provenance(op: Operation, regions: bool = True) -> dict[str, Attribute]:
    """What the ops generated for graph op `op` carry: its location, and its regions unless
    `regions` is False (ops recomputed wherever they are used, such as constants, would stretch
    a region's span to every place that reads them)."""
    keys = (LOC, REGIONS) if regions else (LOC,)
    return {k: op.attributes[k] for k in keys if k in op.attributes}


def carry(old: Operation, new: Operation) -> None:
    """Gives `new` the provenance attributes of `old` it does not have yet."""
    for key, value in old.attributes.items():
        if key.startswith(PREFIX):
            new.attributes.setdefault(key, value)


@dataclass
class CarryProvenance(RewritePattern):
    """`pattern`, with the provenance of each op it replaces copied onto the ops replacing it
    (the ops inserted where the matched op was), so that lowering keeps source locations."""

    pattern: RewritePattern

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        block, before, after = op.parent_block(), op.prev_op, op.next_op
        self.pattern.match_and_rewrite(op, rewriter)
        if op.parent is not None or block is None:
            return   # not replaced
        new = before.next_op if before is not None else block.first_op
        while new is not None and new is not after:
            carry(op, new)
            new = new.next_op
