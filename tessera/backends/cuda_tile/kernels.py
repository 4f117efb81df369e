"""The CUDA Tile IR backend's stages as the compiler calls them (compiler.py's STAGES):
`lower_module` (Tile IR -> a cuda_tile module per kernel), `assemble_kernels` (tileiras, through
the on-disk cubin cache), `kernel_launches` (how the runtime launches each cubin) and
`dump_kernels` (each kernel's text and bytecode)."""
from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from ...ir import tile as t
from . import bytecode, lower, text, tools
from . import ir as ct

#: the bytecode version Tessera writes: the oldest tileiras takes (13.1) carries every op it emits
BYTECODE_VERSION = (13, 1)


@dataclass(frozen=True)
class CudaTileKernel:
    """One kernel as CUDA Tile IR, and what its launch needs from the Tile IR module."""

    name: str
    module: ct.Module
    grid: tuple[int, int, int]
    pointers: int                     # kernel params: one pointer per Tile IR kernel argument

    @functools.cached_property
    def text(self) -> str:
        return text.print_module(self.module)

    @functools.cached_property
    def bytecode(self) -> bytes:
        return bytecode.encode(self.module, BYTECODE_VERSION)


def _grids(tile_module) -> dict[str, tuple[int, int, int]]:
    """Each kernel's grid, from the host functions' launches."""
    grids = {}
    for op in tile_module.walk():
        if isinstance(op, t.LaunchOp):
            grids[op.kernel.string_value()] = tuple(int(g) for g in op.grid.get_values())
    return grids


def lower_module(tile_module, arch: str) -> dict[str, CudaTileKernel]:
    """Each of `tile_module`'s kernels this backend compiles (`tile.BACKEND`; built with
    `stage_operands` off) as a cuda_tile module for `arch` (its hints name tileiras's arch)."""
    grids = _grids(tile_module)
    kernels = {}
    for op in t.kernels_of(tile_module, "cuda-tile"):
        name = op.sym_name.data
        kernels[name] = CudaTileKernel(name, lower.lower_kernel(op, tileiras_arch(arch)), grids[name],
                                       len(op.body.block.args))
    return kernels


def tileiras_arch(arch: str) -> str:
    """tileiras names an arch without the `a` suffix (sm_90a -> sm_90): it uses the arch-specific
    features (wgmma, setmaxnreg) of the GPU it targets itself."""
    return arch.removesuffix("a")


@dataclass(frozen=True)
class TileCubin:
    """tileiras's output for one kernel: what the runtime loads (`cubin`, as ptxas.Assembled has it)."""

    cubin: bytes
    arch: str


@functools.cache
def _cache():
    from ...runtime.cache import CubinCache
    return CubinCache()


def assemble_kernels(kernels: dict[str, CudaTileKernel], arch: str, opt_level: int = 3) -> dict[str, TileCubin]:
    """Each kernel's cubin from tileiras, kept in the on-disk cubin cache under a key of its
    bytecode, the arch, the optimization level and tileiras's version. Each entry is also kept
    under a key without the version, which a machine without tileiras looks up instead: any
    tileiras's cubin of the same bytecode is the same program, and it cannot build a newer one."""
    cache = _cache()
    target = tileiras_arch(arch)
    version = tools.version() if tools.available() else None
    out = {}
    for name, kernel in kernels.items():
        source = ["cuda_tile", kernel.bytecode.hex(), target, opt_level]
        any_version = cache.key_of(source)
        if version is None:
            cubin = cache.get(any_version)
            if cubin is None:
                tools.require_tool("tileiras")   # the error says how to install it
        else:
            key = cache.key_of([*source, version])
            cubin = cache.get(key)
            if cubin is None:
                cubin = tools.assemble(kernel.bytecode, target, opt_level=opt_level)
                cache.put(key, cubin)
                cache.put(any_version, cubin)
        out[name] = TileCubin(cubin, target)
    return out


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """An ELF file's sections by name (NOBITS sections as zeros of their size)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    out = {}
    for name, kind, _, _, offset, size in headers:
        label = elf[names + name:elf.index(b"\0", names + name)].decode()
        out[label] = bytes(size) if kind == 8 else elf[offset:offset + size]
    return out


#: .nv.info attribute holding the block size a kernel must be launched with (three u32: x, y, z)
EIATTR_REQNTID = 0x10
#: .nv.info entry format carrying a sized payload (the others carry a 2-byte value)
EIFMT_SVAL = 0x04


def nv_info(section: bytes) -> list[tuple[int, bytes | int]]:
    """The (attribute, payload bytes or 2-byte value) entries of a `.nv.info` section."""
    out, i = [], 0
    while i + 4 <= len(section):
        fmt, attr, value = section[i], section[i + 1], struct.unpack_from("<H", section, i + 2)[0]
        if fmt == EIFMT_SVAL:
            out.append((attr, section[i + 4:i + 4 + value]))
            i += 4 + value
        else:
            out.append((attr, value))
            i += 4
    return out


def required_threads(cubin: bytes, kernel: str) -> int:
    """The threads per block tileiras compiled `kernel` for (its REQNTID): a launch must use
    exactly these. Read from the cubin's `.nv.info.<kernel>` section."""
    info = elf_sections(cubin).get(f".nv.info.{kernel}")
    if info is None:
        raise tools.TesseraError(f"tileiras's cubin has no .nv.info section for kernel {kernel}")
    for attr, payload in nv_info(info):
        if attr == EIATTR_REQNTID:
            return math.prod(struct.unpack_from("<III", payload))
    raise tools.TesseraError(f"tileiras's cubin does not say how many threads kernel {kernel} needs (no REQNTID)")


def static_shared_bytes(cubin: bytes, kernel: str) -> int:
    return len(elf_sections(cubin).get(f".nv.shared.{kernel}", b""))


def kernel_launches(kernels: dict[str, CudaTileKernel], cubins: dict[str, TileCubin]) -> dict:
    """Each kernel's launch: its Tile IR grid, the threads tileiras compiled it for, its pointer
    params (no tensor maps: tileiras encodes its own), no dynamic shared memory."""
    from ...compiler import KernelLaunch

    return {name: KernelLaunch(name, k.grid, required_threads(cubins[name].cubin, name), 0, k.pointers, (),
                               cubins[name].arch)
            for name, k in kernels.items()}


def dump_kernels(kernels: dict[str, CudaTileKernel], directory: Path) -> list[Path]:
    """Each kernel's `<kernel>.cuda_tile.mlir` (text) and `<kernel>.tilebc` (the bytecode tileiras takes)."""
    written = []
    for name, kernel in kernels.items():
        written.append(directory / f"{name}.cuda_tile.mlir")
        written[-1].write_text(kernel.text)
        written.append(directory / f"{name}.tilebc")
        written[-1].write_bytes(kernel.bytecode)
    return written
