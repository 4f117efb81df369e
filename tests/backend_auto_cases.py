"""Functions whose kernels two backends compile under `backend="auto"` (the default): fp32 matmuls,
which the PTX backend has no instruction for, go to tileiras (rule `fp32_matmul`), and the rest of
the function stays with PTX. Shared by the CPU test that assembles them (with tileiras; run with
TESSERA_CACHE_DIR set it fills that cubin cache for a GPU machine without tileiras) and
tests/gpu/test_backend_auto_gpu.py, which runs them against float64."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tessera as tsr
from tessera import Tensor

import attention_cases


@tsr.function
def scores(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.softmax(tsr.matmul(a, b) * 0.5, dim=-1)


@tsr.function
def gemm_bias_gelu(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@dataclass(frozen=True)
class Case:
    name: str
    fn: object
    dims: tuple[tuple[str, int], ...]
    backends: tuple[str, ...]        # the backends of its kernels, in order

    def specs(self):
        return self.fn.arg_specs_for(dict(self.dims), tsr.fp32)

    def inputs(self, seed: int) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(spec.shape).astype(np.float32) for spec in self.specs()]


def _dims(**kw) -> tuple[tuple[str, int], ...]:
    return tuple(kw.items())


CASES = {c.name: c for c in [
    Case("scores 1x1x1", scores, _dims(M=1, K=1, N=1), ("cuda-tile", "ptx")),
    Case("scores 70x33x129", scores, _dims(M=70, K=33, N=129), ("cuda-tile", "ptx")),
    Case("scores 1000x257x4097", scores, _dims(M=1000, K=257, N=4097), ("cuda-tile", "ptx")),
    Case("gemm+bias+gelu 129x1000x67 (split-K)", gemm_bias_gelu, _dims(M=129, K=1000, N=67),
         ("cuda-tile", "cuda-tile")),
    Case("gemm+bias+gelu 4097x64x128", gemm_bias_gelu, _dims(M=4097, K=64, N=128), ("cuda-tile",)),
    Case("causal attention 1x2x67x64", attention_cases.causal, _dims(B=1, H=2, S=67, D=64), ("cuda-tile",)),
]}

#: the relative error (norm of the difference over the norm of float64's) an fp32 result stays
#: under: a TF32 matmul (10-bit mantissa) misses it by an order of magnitude
TOLERANCE = 2e-5


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30))


#: an autotune space over the backends, and the problem the GPU test tunes it on
BACKEND_SPACE = {"backend": ["ptx", "cuda-tile"]}
TUNED_DIMS = {"M": 512, "K": 256, "N": 384}


def backend_tuned_gemm(cache_dir):
    """A GEMM whose autotuner times the PTX backend's kernel against tileiras's."""
    @tsr.kernel.autotune(space=BACKEND_SPACE, cache=str(cache_dir))
    def gemm_into(A: Tensor["M", "K"], B: Tensor["K", "N"], C: Tensor["M", "N"]):
        C[:] = tsr.matmul(A, B)
    return gemm_into
