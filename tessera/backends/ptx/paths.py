"""The PTX backend's code paths, composed explicitly: each is the handler table the
emitter prints a kernel with, and the layout of the shared buffers its copies fill.

    base     control flow, coordinates, broadcasts (core.py), scalar and per-element arithmetic
             (arithmetic.py), global loads and stores (memory.py), row reductions (reductions.py)
    ampere   + shared buffers, cp.async groups, ldmatrix and mma.sync       (tensor_core.py)
    hopper   + tensor maps, mbarriers, TMA loads, wgmma, warp specialization (hopper.py),
             cluster gathers and barriers (reductions.py)

A kernel's path is chosen by what its platform has (`path_for`), never by an arch name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ... import platforms
from ...ir import target as tgt
from . import arithmetic, core, hopper, memory, reductions, tensor_core
from .core import KernelEmitter, PtxKernel


@dataclass(frozen=True)
class CodePath:
    name: str
    handlers: dict[type, Callable]
    buffers: dict[str, type]


#: every code path's handlers (no two of these tables handle the same op)
BASE: dict[type, Callable] = {**core.HANDLERS, **arithmetic.HANDLERS, **memory.HANDLERS, **reductions.HANDLERS}

AMPERE = CodePath("ampere", {**BASE, **tensor_core.HANDLERS}, tensor_core.BUFFERS)
HOPPER = CodePath("hopper", {**BASE, **tensor_core.HANDLERS, **hopper.HANDLERS, **reductions.CLUSTER_HANDLERS},
                  {**tensor_core.BUFFERS, **hopper.BUFFERS})


def path_for(platform: platforms.Platform) -> CodePath:
    """Hopper's table where the platform has TMA (its ops only appear there), else Ampere's."""
    return HOPPER if platform.has("tma") else AMPERE


def emitter_for(kernel: tgt.KernelOp) -> KernelEmitter:
    """An emitter of `kernel` with its platform's code path."""
    path = path_for(kernel.platform.platform)
    return KernelEmitter(kernel, path.handlers, path.buffers)


def emit_kernel(kernel: tgt.KernelOp) -> PtxKernel:
    """A complete PTX module (header and one .entry) for a Target IR kernel."""
    platform = kernel.platform.platform
    e = emitter_for(kernel)
    body = e.run()
    arch = platform.arch
    header = f"{platforms.ptx_version(arch)}\n{platforms.ptx_target(arch)}\n.address_size 64\n\n"
    return PtxKernel(e.name, header + body, e.threads, e.smem_bytes, tuple(e.tensor_maps), tuple(e.dims))


def emit_module(module) -> dict[str, PtxKernel]:
    """Every kernel of a Target IR module: {kernel name: PtxKernel}."""
    return {op.sym_name.data: emit_kernel(op) for op in module.ops if isinstance(op, tgt.KernelOp)}
