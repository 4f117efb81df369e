"""Distributed layouts: which thread holds which elements of a register tile.

A tile value in PTX is a list of per-thread registers. A layout says, for
register i of a thread, which tile coordinate it holds, always in the form

    coordinate[d] = base[d](lane, warp) + offsets[i][d]

with `base` computed once per kernel from %tid and `offsets` compile-time
constants, so per-element address arithmetic folds into the instruction's
immediate offset. Each base is named by a hashable *base key*; two layouts
whose keys and offsets agree along a dim index that dim identically, which is
what makes broadcasts and row statistics free.

* `Blocked` (rank 2, like Triton's blocked layout): each thread holds `vec`
  consecutive columns; `tc` lanes span the columns and `tr` the rows; warps
  are split `wr` x `wc`; the pattern repeats to cover the tile.
* `Mma` (rank 2): the accumulator fragments of `mma.sync.m16n8k16`, warps split
  `wm` x `wn`: register (mi, ni, c) holds row `16 mi + 8 (c // 2) + lane / 4`
  and column `8 ni + 2 (lane % 4) + c % 2` of its warp's sub-tile; with `byte_a`, the columns
  of each 16 in the order an 8-bit A fragment reads them (see `Mma.byte_a`).
* `Slice` (rank 1): one dim of a rank-2 parent (a row statistic after a
  reduction, a column vector such as a LayerNorm weight or a mask index).
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
    def base_keys(self) -> tuple[tuple, tuple]:
        return (("blocked_row", self.tc, self.wc, self.tr), ("blocked_col", self.tc, self.wc, self.vec))

    def lane_masks(self, axis: int) -> list[int]:
        """Lane xor-masks that visit every lane holding the same row (axis 1 reductions: the
        lanes along the columns, lane % tc) or the same column (axis 0: lane // tc)."""
        if axis == 1:
            return [1 << k for k in range(self.tc.bit_length() - 1)]
        return [self.tc << k for k in range(self.tr.bit_length() - 1)]

    def warps_along(self, axis: int) -> int:
        return self.wc if axis == 1 else self.wr

    def over_covers(self, dim: int) -> bool:
        return self.cover[dim] * self.reps[dim] > self.shape[dim] or self.cover[dim] > self.shape[dim]


@dataclass(frozen=True)
class Mma:
    """Accumulator fragments (see the module docstring).

    `byte_a`: the tile's columns are keys loaded permuted (`lowering.byte_fragments`): register
    (mi, ni, c) holds column `16 (ni // 2) + 4 (lane % 4) + 2 (ni % 2) + c % 2`, so that each
    lane's four columns of two neighbouring 8-column chunks are the four consecutive k of an
    8-bit (k 32) A fragment, and the tile narrowed to 8 bits is its own A operand, with no
    exchange between lanes."""

    shape: tuple[int, int]
    wm: int
    wn: int
    byte_a: bool = False

    def __post_init__(self):
        if self.byte_a and self.warp_tile[1] % 16:
            raise ValueError(f"an Mma layout in 8-bit A order permutes each 16 columns; a warp holds {self.warp_tile[1]}")

    @staticmethod
    def fits(shape: tuple[int, int], wm: int, wn: int) -> bool:
        return shape[0] % (16 * wm) == 0 and shape[1] % (8 * wn) == 0

    @property
    def warp_tile(self) -> tuple[int, int]:
        return (self.shape[0] // self.wm, self.shape[1] // self.wn)

    @property
    def fragments(self) -> tuple[int, int]:
        """(MI, NI): 16x8 accumulator fragments per warp."""
        wm, wn = self.warp_tile
        return (wm // 16, wn // 8)

    @cached_property
    def offsets(self) -> list[tuple[int, int]]:
        mi_n, ni_n = self.fragments
        col = (lambda ni, c: 16 * (ni // 2) + 2 * (ni % 2) + c % 2) if self.byte_a else (lambda ni, c: 8 * ni + c % 2)
        return [(mi * 16 + 8 * (c // 2), col(ni, c)) for mi in range(mi_n) for ni in range(ni_n) for c in range(4)]

    def register(self, mi: int, ni: int, c: int) -> int:
        return (mi * self.fragments[1] + ni) * 4 + c

    @property
    def base_keys(self) -> tuple[tuple, tuple]:
        return (("mma_row", self.wn, self.warp_tile[0]),
                ("mma_col_byte_a" if self.byte_a else "mma_col", self.wn, self.warp_tile[1]))

    def lane_masks(self, axis: int) -> list[int]:
        assert axis == 1
        return [1, 2]

    def warps_along(self, axis: int) -> int:
        return self.wn if axis == 1 else self.wm

    def over_covers(self, dim: int) -> bool:
        return False


@dataclass(frozen=True, eq=False)
class Slice:
    """A rank-1 tile along dim `keep` of `parent`. Slices that index their dim the same
    way (same base key and offsets) are equal, whatever their parents."""

    parent: Blocked | Mma
    keep: int

    @property
    def shape(self) -> tuple[int]:
        return (self.parent.shape[self.keep],)

    @property
    def base_keys(self) -> tuple[tuple]:
        return (self.parent.base_keys[self.keep],)

    @cached_property
    def offsets(self) -> list[tuple[int]]:
        seen: dict[int, None] = {}
        for off in self.parent.offsets:
            seen.setdefault(off[self.keep], None)
        return [(o,) for o in seen]

    def registers_for(self, layout: "Blocked | Mma", dim: int) -> list[int] | None:
        """For each register of `layout`, the slice register with its coordinate along `dim`;
        None when `layout` indexes `dim` differently."""
        if layout.base_keys[dim] != self.base_keys[0]:
            return None
        index = {o[0]: i for i, o in enumerate(self.offsets)}
        try:
            return [index[off[dim]] for off in layout.offsets]
        except KeyError:
            return None

    @cached_property
    def parent_register(self) -> list[int]:
        return self.registers_for(self.parent, self.keep)

    def over_covers(self, dim: int = 0) -> bool:
        return self.parent.over_covers(self.keep)

    def _key(self):
        return (self.base_keys, tuple(self.offsets), self.shape)

    def __eq__(self, other) -> bool:
        return isinstance(other, Slice) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


Layout = Blocked | Mma | Slice
