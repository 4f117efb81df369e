"""The IR levels (one module per dialect) and the text helpers they share.

Importing this package is cheap; the dialect modules import xDSL, which only a
compile pays for.
"""
from __future__ import annotations

import io


def context():
    """An xDSL context that knows every dialect Tessera prints, at every level."""
    from xdsl.context import Context
    from xdsl.dialects import builtin, func, math, memref, scf

    from .graph import Graph
    from .schedule import Schedule
    from .target import TesseraTarget
    from .tile import ArithOnTiles, Tile

    ctx = Context()
    for dialect in (builtin.Builtin, func.Func, ArithOnTiles, math.Math, scf.Scf, memref.MemRef,
                    Graph, Schedule, Tile, TesseraTarget):
        ctx.load_dialect(dialect)
    return ctx


def print_ir(op) -> str:
    """MLIR text of an op (usually a builtin.module)."""
    from xdsl.printer import Printer

    out = io.StringIO()
    Printer(stream=out).print_op(op)
    return out.getvalue() + "\n"


def parse_ir(text: str):
    """Parse MLIR text of any Tessera level into a builtin.module."""
    from xdsl.parser import Parser

    return Parser(context(), text).parse_module()
