"""The CUDA Tile IR backend: Tessera tile programs as NVIDIA `cuda_tile` bytecode for `tileiras`.

`ir` models the dialect (types, ops as data, a Builder), `text` prints it as MLIR text, `bytecode`
encodes it, `tools` runs tileiras/tileirdisasm, `lower` turns Tile IR kernels into it and
`kernels` holds the compiler's stages (docs/CUDA_TILE.md). `import tessera` imports none of it.
"""
from .kernels import CudaTileKernel, assemble_kernels, dump_kernels, kernel_launches, lower_module

__all__ = ["CudaTileKernel", "assemble_kernels", "dump_kernels", "kernel_launches", "lower_module"]
