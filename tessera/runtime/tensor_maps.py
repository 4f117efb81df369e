"""`TensorMapSpec`, the description of a TMA tensor map a kernel takes by value.

It lives here, apart from the PTX backend that writes it, because the runtime reads it back from
serialized artifacts (`tessera.runtime.artifact`) in processes that never import the compiler
(or xDSL, which the backend needs).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA tensor map a kernel takes by value (a 128-byte `.param`, after its pointer params):
    the tile box it copies out of kernel argument `arg`, a row-major tensor of `shape` with
    elements of tessera dtype `dtype`. Boxes are 128 bytes wide along the innermost dim and
    land in shared memory with the 128-byte swizzle; out-of-bounds elements read as zero."""

    arg: int
    dtype: str
    shape: tuple[int, ...]
    box: tuple[int, ...]       # per dim, outermost first, like `shape`
    swizzle: int = 128
