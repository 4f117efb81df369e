"""`backend="auto"` on the GPU (issue 18): functions whose fp32 matmuls tileiras compiles and whose
other kernels Tessera's PTX does, launched together by Tessera's runtime, against float64, outputs
NaN-poisoned first. The rules see tileiras as installed here; where it is not, the cubins come
from the cubin cache (TESSERA_CACHE_DIR, filled on a machine with tileiras by
tests/passes/test_backend_choice.py), and a case whose cubin is in neither skips, saying so."""
import numpy as np
import pytest

import backend_auto_cases as cases
from cuda_tile_cases import assembled
from tessera.passes import backend_choice


@pytest.fixture(autouse=True)
def tileiras_seen(monkeypatch):
    monkeypatch.setattr(backend_choice, "_tileiras_installed", lambda: True)


def _compiled(case):
    return assembled(case.fn.compile(case.specs()))


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_mixed_backends_match_float64(torch_cuda, name):
    torch = torch_cuda
    case = cases.CASES[name]
    compiled = _compiled(case)
    assert tuple(backend for backend, _ in compiled.kernel_backends.values()) == case.backends
    inputs = case.inputs(seed=1)
    outs = compiled.gpu_program(0)(*[torch.from_numpy(x).cuda() for x in inputs])
    for got, want in zip(outs, compiled.reference(*inputs)):
        got = got.cpu().numpy()
        assert not np.isnan(got).any(), "an output element was not written (or is NaN)"
        assert cases.relative_error(got, want) < cases.TOLERANCE


def test_a_call_on_cuda_tensors_takes_both_backends(torch_cuda):
    """The function called as a user calls it (its own compile for the device, the fast path on
    the second call) gives float64's result."""
    torch = torch_cuda
    case = cases.CASES["scores 70x33x129"]
    _compiled(case)
    a, b = (torch.from_numpy(x).cuda() for x in case.inputs(seed=2))
    want = torch.softmax((a.double() @ b.double()) * 0.5, dim=-1)
    for _ in range(3):
        got = case.fn(a, b)
        assert ((got.double() - want).norm() / want.norm()).item() < cases.TOLERANCE


def test_the_autotuner_times_both_backends_and_keeps_the_faster(torch_cuda, tmp_path):
    """A space listing both backends: each point compiled, checked and timed, the faster kept."""
    torch = torch_cuda
    gemm = cases.backend_tuned_gemm(tmp_path)
    dims = cases.TUNED_DIMS
    a = torch.randn(dims["M"], dims["K"], device="cuda", dtype=torch.float16)
    b = torch.randn(dims["K"], dims["N"], device="cuda", dtype=torch.float16)
    c = torch.full((dims["M"], dims["N"]), float("nan"), device="cuda", dtype=torch.float16)
    gemm(a, b, c)
    (tuned,) = gemm.tuner.results.values()
    if any(t.skipped and "tileiras" in t.skipped for t in tuned.trials):
        pytest.skip(f"no tileiras and no cached cubin: {[t.skipped for t in tuned.trials]}")
    assert [t.config["backend"] for t in tuned.trials] == ["ptx", "cuda-tile"]
    assert all(t.ms is not None for t in tuned.trials)
    assert tuned.ms == min(t.ms for t in tuned.trials)
    want = a.double() @ b.double()
    assert ((c.double() - want).norm() / want.norm()).item() < 1e-3
