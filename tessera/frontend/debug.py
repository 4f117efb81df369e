"""Debugging inside traced functions: `tsr.device_assert` and profile regions.

    @tsr.function
    def f(x: Tensor["M", "N"]):
        tsr.device_assert(x.shape[-1] % 8 == 0, "rows must be whole vectors")   # checked now
        with tsr.profile_region("scale"):
            y = x * 2.0
        tsr.device_assert(y > 0, "x must be positive")                          # checked in the kernel
        return y

A tensor condition becomes a `graph.assert` op that every kernel keeps (fusion puts it in the
kernel computing its operand where it can); a failing element stops the kernel and reports the
message, this line and the block (on the CPU interpreter: a DeviceAssertError). Profile regions
mark the ops traced inside them (`tessera.regions`); with profiling on (`profile=True`,
TESSERA_PROFILE=1, `tessera profile`), each kernel times the span of its ops from each region.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from .. import dtypes
from ..errors import DeviceAssertError, DTypeError, TesseraError
from .tensor import Tensor
from .trace import current_trace, source_loc


def device_assert(cond, message: str = "assertion failed") -> None:
    """Checks that every element of the bool tensor `cond` holds when the kernel runs, or that the
    Python bool `cond` holds now (shape arithmetic, say)."""
    if not isinstance(message, str):
        raise TypeError(f"device_assert: the message must be a str, got {type(message).__name__}")
    if isinstance(cond, (bool, np.bool_)):
        if not cond:
            loc = source_loc()
            raise DeviceAssertError(message, str(loc) if loc else None)
        return
    if not isinstance(cond, Tensor):
        raise TypeError(f"device_assert takes a bool tensor or a Python bool, got {type(cond).__name__}")
    if cond.dtype != dtypes.bool_:
        raise DTypeError(f"device_assert: the condition must be bool, got {cond.dtype} "
                         f"(compare it, e.g. x != 0)")
    from ..ir import graph as g

    current_trace().add(g.AssertOp(cond.value, message))


def profile_begin(name: str) -> None:
    """Opens profile region `name`: the ops traced until `profile_end(name)` belong to it."""
    if not isinstance(name, str) or not name:
        raise TesseraError(f"profile_begin: a region needs a non-empty name, got {name!r}")
    regions = current_trace().regions
    if name in regions:
        raise TesseraError(f"profile_begin: region {name!r} is already open")
    regions.append(name)


def profile_end(name: str) -> None:
    """Closes profile region `name`, the innermost one open."""
    regions = current_trace().regions
    if not regions or regions[-1] != name:
        open_now = f"the innermost open region is {regions[-1]!r}" if regions else "no region is open"
        raise TesseraError(f"profile_end({name!r}): {open_now}")
    regions.pop()


@contextlib.contextmanager
def profile_region(name: str) -> Iterator[None]:
    """`with tsr.profile_region("softmax"): ...`: profile_begin and profile_end around a block."""
    profile_begin(name)
    yield
    profile_end(name)
