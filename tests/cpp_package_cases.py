"""The functions the AOT C/C++ package tests (CPU build and GPU run) package, and where the CUDA
toolkit the generated CMake project builds against lies."""
from pathlib import Path
import shutil

KERNELS = '''
import tessera as tsr
from tessera import Tensor


@tsr.kernel
def add_into(a: Tensor["N", "N"], b: Tensor["N", "N"], c: Tensor["N", "N"]):
    c[:] = a + b


@tsr.kernel
def accumulate(a: Tensor["N", "N"], c: Tensor["N", "N"]):
    c[:] = tsr.matmul(c, a)


@tsr.function
def scaled(a: Tensor["N", "N"], b: Tensor["N", "N"]):
    return tsr.matmul(a, b) * 0.5
'''
FUNCS = ["add_into", "accumulate", "scaled"]

#: a function packaged shape-generic (`--dynamic M`): its C entry point takes M after the buffers
ROWS = '''
import tessera as tsr
from tessera import Tensor


@tsr.function
def norm_gelu(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.gelu(tsr.rms_norm(x, (x.shape[-1],), w, 1e-6))


@tsr.function
def project(x: Tensor["M", "K"], w: Tensor["K", "N"]):
    return tsr.gelu(tsr.matmul(x, w))
'''
ROWS_FUNCS = ["norm_gelu", "project"]


def cuda_root() -> Path | None:
    """The CUDA toolkit whose include/cuda.h the generated project compiles against, or None."""
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]:
        if (root / "include" / "cuda.h").is_file():
            return root
    return None
