"""User-facing errors.

A TesseraError carries the location in the *user's* file (found by walking the
stack out of the tessera package), so the CLI can print one clear line plus
`file:line` instead of a traceback through compiler internals.
"""
from __future__ import annotations

import os
import traceback

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


_TOOLING = (os.sep + "_pytest" + os.sep, os.sep + "pluggy" + os.sep, "<frozen")


def user_location() -> str | None:
    """The innermost stack frame outside the tessera package (and test tooling), as `file:line`."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_PACKAGE_DIR + os.sep) and not any(t in path for t in _TOOLING):
            return f"{frame.filename}:{frame.lineno}"
    return None
