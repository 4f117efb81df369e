"""User-facing errors.

A TesseraError carries the location in the *user's* file (found by walking the
stack out of the tessera package), so the CLI can print one clear line plus
`file:line` instead of a traceback through compiler internals.
"""
from __future__ import annotations

import functools
import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class TesseraError(Exception):
    """An error in the user's program or inputs (shape, dtype, unsupported construct)."""

    def __init__(self, message: str, location: str | None = None):
        super().__init__(message)
        self.message = message
        self.location = location if location is not None else user_location()

    def __str__(self) -> str:
        return f"{self.message}  [at {self.location}]" if self.location else self.message


class ShapeError(TesseraError, ValueError):
    """Shapes or symbolic dims that do not agree."""


class DTypeError(TesseraError, TypeError):
    """Element types that do not agree or are unsupported."""


class ArgumentKindError(TesseraError, TypeError):
    """A value of the wrong kind: a number or an object where a tensor is needed, or the reverse."""


class DeviceAssertError(TesseraError, AssertionError):
    """A `tsr.device_assert` that failed: while tracing (a Python bool), or on the CPU interpreter
    (a tensor), where `block` is the program id and `element` the first failing element's index in
    the block's tile."""

    def __init__(self, message: str, location: str | None = None, block: tuple[int, ...] | None = None,
                 element: tuple[int, ...] | None = None):
        where = [f"block {block}"] if block is not None else []
        where += [f"element {element}"] if element is not None else []
        at = f" at {location}" if location else ""
        super().__init__(f"device_assert failed{at}: {message}" + (f" ({', '.join(where)})" if where else ""),
                         location)
        self.user_message, self.block, self.element = message, block, element

    def __str__(self) -> str:
        return self.message   # which names the location already


_TOOLING = (os.sep + "_pytest" + os.sep, os.sep + "pluggy" + os.sep, "<frozen")


def user_location() -> str | None:
    """The innermost stack frame outside the tessera package (and test tooling), as `file:line`."""
    frame = user_frame()
    return f"{frame[0]}:{frame[1]}" if frame else None


def user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost stack frame outside the tessera package and test tooling.
    Walks frames without formatting them (the tracer asks for every op it records)."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_internal(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=256)
def is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) or any(t in path for t in _TOOLING)
