"""The autotuner on the GPU: it times the space's points, picks one, writes the caller's output
with it, keeps the choice per key (in memory and on disk) and skips points that cannot run."""
import json
import re

import pytest

import tessera as tsr
from tessera import Tensor


def tuned_gemm(cache_dir):
    @tsr.kernel.autotune(space=dict(BLOCK_M=[64, 128], BLOCK_N=[64, 128], num_warps=[4, 8]),
                         key=["M", "N", "K"], cache=str(cache_dir))
    def gemm(A: Tensor["M", "K"], B: Tensor["K", "N"], C: Tensor["M", "N"]):
        C[:] = tsr.matmul(A, B)
    return gemm


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_autotuned_gemm_is_correct_and_tuned_once_per_key(torch_cuda, tmp_path, dtype):
    torch = torch_cuda
    gemm = tuned_gemm(tmp_path)
    dt = getattr(torch, dtype)
    a, b = torch.randn(300, 200, device="cuda", dtype=dt), torch.randn(200, 1000, device="cuda", dtype=dt)
    c = torch.full((300, 1000), float("nan"), device="cuda", dtype=dt)
    gemm(a, b, c)
    ref = a.float() @ b.float()
    assert float((c.float() - ref).norm() / ref.norm()) < 1e-2
    (key, tuned), = gemm.tuner.results.items()
    assert len(tuned.trials) == 8 and sum(t.ms is not None for t in tuned.trials) >= 2
    assert tuned.config in [t.config for t in tuned.trials if t.ms is not None]
    assert tuned.ms == min(t.ms for t in tuned.trials if t.ms is not None)
    assert json.loads(gemm.tuner.cache.path.read_text())[key]["config"] == tuned.config

    c2 = torch.full_like(c, float("nan"))
    gemm(a, b, c2)                      # same key: no new trials
    assert gemm.tuner.results[key] is tuned and torch.equal(c, c2)

    fresh = tuned_gemm(tmp_path)        # another process, same function: read from disk
    fresh(a, b, c2)
    assert fresh.tuner.results[key].config == tuned.config and not fresh.tuner.results[key].trials

    small = torch.randn(64, 200, device="cuda", dtype=dt)
    gemm(small, b, torch.empty(64, 1000, device="cuda", dtype=dt))   # another M: tuned anew
    assert len(gemm.tuner.results) == 2


def test_points_the_backend_rejects_are_skipped(torch_cuda, tmp_path):
    torch = torch_cuda

    @tsr.kernel.autotune(space=dict(block_m=[128], block_n=[128], block_k=[64], num_stages=[2, 8]),
                         cache=str(tmp_path))
    def gemm(A: Tensor["M", "K"], B: Tensor["K", "N"], C: Tensor["M", "N"]):
        C[:] = tsr.matmul(A, B)
    a, b = (torch.randn(256, 256, device="cuda", dtype=torch.float16) for _ in range(2))
    c = torch.empty(256, 256, device="cuda", dtype=torch.float16)
    gemm(a, b, c)
    (tuned,) = gemm.tuner.results.values()
    assert tuned.config["num_stages"] == 2
    assert [t.skipped is not None for t in tuned.trials] == [False, True]
    assert re.search(r"needs \d+ bytes of shared memory", tuned.trials[1].skipped)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-1)
