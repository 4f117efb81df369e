"""`TensorMapSpec`, the description of a TMA tensor map a kernel takes by value.

It lives here, apart from the PTX backend that writes it, because the runtime reads it back from
serialized artifacts (`tessera.runtime.artifact`) in processes that never import the compiler
(or xDSL, which the backend needs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: bytes of one TMA box row: one 128-byte swizzle span (the lowering's copies and wgmma
#: descriptors, and fusion's choice of tiles that take them)
TMA_ROW_BYTES = 128
#: the one narrower box row: an 8-bit tile exactly this wide (fp8 Q and K at a head dim of 64) lands
#: in TMA's 64-byte swizzle, which wgmma's descriptors read as well
NARROW_ROW_BYTES = 64


def box_row_bytes(cols: int, element_bytes: int) -> int:
    """Bytes of one TMA box row, the swizzle span, of a tile `cols` elements wide: NARROW_ROW_BYTES
    for an 8-bit tile that wide, else TMA_ROW_BYTES. (16-bit tiles of 32 columns would take it too;
    not measured, they stay off the Hopper path.)"""
    return NARROW_ROW_BYTES if element_bytes == 1 and cols == NARROW_ROW_BYTES else TMA_ROW_BYTES


def whole_box_rows(cols: int, element_bytes: int) -> bool:
    """Whether a tile `cols` elements wide is whole TMA box rows (`box_row_bytes`)."""
    return cols * element_bytes % box_row_bytes(cols, element_bytes) == 0

#: a dim of `TensorMapSpec.shape` the kernel takes at run time (`tessera.dims`; a buffer has one),
#: whose size each call's map is encoded with (`TensorMapSpec.bound`)
DYNAMIC = -1


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA tensor map a kernel takes by value (a 128-byte `.param`, after its pointer params):
    the tile box it copies out of kernel argument `arg`, a tensor of `shape` with elements of
    tessera dtype `dtype`, row-major or laid out with element `strides` (innermost 1). Boxes
    are `swizzle` bytes wide along the innermost dim (`box_row_bytes`: 128, or 64 for a 64-wide
    8-bit tile) and land in shared memory in that swizzle; out-of-bounds elements read as zero."""

    arg: int
    dtype: str
    shape: tuple[int, ...]     # a dynamic dim: DYNAMIC
    box: tuple[int, ...]       # per dim, outermost first, like `shape`
    swizzle: int = TMA_ROW_BYTES
    strides: tuple[int, ...] | None = None   # element strides, outermost first; None: row-major

    @property
    def dynamic(self) -> bool:
        return DYNAMIC in self.shape

    def bound(self, shape) -> TensorMapSpec:
        """The map over a buffer of this call's `shape`: a dynamic dim takes its size there, at its
        axis (a kernel may read a view of the buffer of another rank: views keep the dynamic dim at
        its axis, `schedule_to_tile._require_same_dynamic_axis`). Row-major strides follow from it."""
        if not self.dynamic:
            return self
        return dataclasses.replace(self, shape=tuple(int(shape[axis]) if d == DYNAMIC else d
                                                     for axis, d in enumerate(self.shape)))


#: cuTensorMapEncodeTiled's bound on an outer dim's byte stride
MAX_STRIDE_BYTES = 2 ** 40


def stride_problem(strides: tuple[int, ...], element_bytes: int) -> str | None:
    """Why a TMA tensor map cannot describe a tensor with these element strides (outermost first),
    or None: its innermost dim must be contiguous and every other dim's byte stride a positive
    multiple of 16 below 2^40 (the driver's rule; a broadcast dim's stride 0 is refused)."""
    if strides and strides[-1] != 1:
        return f"a tensor whose innermost dim has stride {strides[-1]}"
    for d, st in enumerate(strides[:-1]):
        nbytes = st * element_bytes
        if nbytes == 0:
            return f"a tensor broadcast along dim {d} (stride 0)"
        if nbytes % 16:
            return f"a tensor whose rows are not 16-byte aligned (dim {d} steps {nbytes} bytes)"
        if not 0 < nbytes < MAX_STRIDE_BYTES:
            return f"a tensor whose dim {d} steps {nbytes} bytes (TMA takes up to 2^40)"
    return None
