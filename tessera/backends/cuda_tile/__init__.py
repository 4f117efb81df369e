"""The CUDA Tile IR backend: Tessera tile programs as NVIDIA `cuda_tile` bytecode for `tileiras`.

`ir` models the dialect (types, ops as data, a Builder), `text` prints it as MLIR text, `bytecode`
encodes it, `tools` runs tileiras/tileirdisasm, `lower` turns Tile IR kernels into it and
`kernels` holds the compiler's stages (docs/CUDA_TILE.md). `import tessera` imports none of it,
and importing `tools` (which every compile's backend rules ask whether tileiras is installed)
imports none of the rest: the names below load `kernels` when first used.
"""
import importlib

__all__ = ["CudaTileKernel", "assemble_kernels", "dump_kernels", "kernel_launches", "lower_module"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.kernels"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
