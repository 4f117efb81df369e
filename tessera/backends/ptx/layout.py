"""Distributed layouts: which thread holds which elements of a register tile.

A tile value in PTX is a list of per-thread registers. A layout says, for
register i of a thread, which tile coordinate it holds, always in the form

    coordinate[d] = base[d](lane, warp) + offsets[i][d]

with `base` computed once per kernel from %tid and `offsets` compile-time
constants, so per-element address arithmetic folds into the instruction's
immediate offset.

`Blocked` (rank-2, like Triton's blocked layout): each thread holds `vec`
consecutive columns; `tc` lanes span the columns and `tr` the rows; warps are
split `wr` x `wc`; the pattern repeats to cover the tile. `Slice` is a rank-1
tile indexed by one dim of a `Blocked` parent (a row statistic after a
reduction, a column vector such as a LayerNorm weight): broadcasting it back
to the parent moves no data.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True)
class Blocked:
    shape: tuple[int, int]
    vec: int
    tc: int
    tr: int
    wc: int
    wr: int

    @staticmethod
    def choose(shape: tuple[int, int], num_warps: int, vec: int = 4) -> "Blocked":
        """A layout that never covers more columns than the tile has, so row reductions
        see each element once; extra threads replicate rows instead."""
        rows, cols = shape
        vec = min(vec, _pow2_floor(cols))
        tc = min(32, _pow2_floor(cols // vec))
        tr = 32 // tc
        wc = min(num_warps, _pow2_floor(max(1, cols // (vec * tc))))
        wr = num_warps // wc
        return Blocked(shape, vec, tc, tr, wc, wr)

    @property
    def cover(self) -> tuple[int, int]:
        return (self.tr * self.wr, self.vec * self.tc * self.wc)

    @property
    def reps(self) -> tuple[int, int]:
        return (-(-self.shape[0] // self.cover[0]), -(-self.shape[1] // self.cover[1]))

    @cached_property
    def offsets(self) -> list[tuple[int, int]]:
        """Per register: (row, col) offset from this thread's base."""
        (rr, rc), (cr, cc) = self.reps, self.cover
        return [(i * cr, j * cc + v) for i in range(rr) for j in range(rc) for v in range(self.vec)]

    @property
    def rank(self) -> int:
        return 2

    def over_covers(self, dim: int) -> bool:
        return self.cover[dim] * self.reps[dim] > self.shape[dim] or self.cover[dim] > self.shape[dim]


@dataclass(frozen=True)
class Slice:
    """A rank-1 tile along dim `keep` of `parent` (the other dim was reduced or will be broadcast)."""

    parent: Blocked
    keep: int

    @property
    def shape(self) -> tuple[int]:
        return (self.parent.shape[self.keep],)

    @property
    def rank(self) -> int:
        return 1

    @cached_property
    def offsets(self) -> list[tuple[int]]:
        seen: dict[int, None] = {}
        for off in self.parent.offsets:
            seen.setdefault(off[self.keep], None)
        return [(o,) for o in seen]

    @cached_property
    def parent_register(self) -> list[int]:
        """For each parent register, the slice register holding its coordinate along `keep`."""
        index = {o[0]: i for i, o in enumerate(self.offsets)}
        return [index[off[self.keep]] for off in self.parent.offsets]

    def over_covers(self, dim: int = 0) -> bool:
        return self.parent.over_covers(self.keep)


Layout = Blocked | Slice
