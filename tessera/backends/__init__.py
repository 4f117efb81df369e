"""Code generators, one package per target family: `ptx` (Target IR -> PTX, assembled by ptxas)
and `cuda_tile` (Tile IR -> NVIDIA's CUDA Tile IR, assembled by tileiras)."""
from ..errors import TesseraError


class UnsupportedByBackend(TesseraError):
    """The kernel uses an op this backend cannot emit yet (the message names the backend)."""
