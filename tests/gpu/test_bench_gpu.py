"""`tessera bench` and `tessera profile` timing on a real GPU: the timing calls the CPU tests replace
with recorded numbers (do_bench rounds, torch's profiler per kernel, the copy bandwidth)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tessera import cli
from tessera.bench import results as res

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "flash_attention.py")


@pytest.fixture
def triton_available(torch_cuda):
    pytest.importorskip("triton")
    return torch_cuda


def test_bench_times_a_case_and_its_peer_into_json(triton_available, tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = cli.main(["bench", "--quick", "--filter", "^softmax", "--repeats", "3", "--json", str(out)])
    assert status == 0, capsys.readouterr()
    run = res.load(out)
    (case,) = run.cases
    assert case.status == "ok" and case.tessera.n == 3 and case.tessera.median > 0
    assert case.peers["torch.softmax"].stats.median > 0
    assert run.environment["device"] and run.environment["driver"] and run.environment["copy_gbs"] > 100
    status = cli.main(["bench", "--compare", str(out), "--results", str(out)])
    assert status == 0


def test_kernel_times_from_the_profiler(triton_available, arch):
    from tessera.bench import timing
    from tessera.bench.cases import gemm
    torch = triton_available
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    compiled = gemm.compile(gemm.arg_specs_for(dict(M=1024, K=1024, N=1024), "fp16"), arch=arch)
    program = compiled.gpu_program(0)
    times = timing.kernel_times(lambda: program(a, a), list(compiled.launches), repeats=5)
    assert all(len(t) == 5 and min(t) > 0 for t in times.values()), times


def test_profile_reports_rates_roofline_and_occupancy(torch_cuda, capsys):
    # S / 4 = 1024 FLOP per byte: right of the ridge, under the compute roof
    status = cli.main(["profile", f"{EXAMPLE}:causal_flash_attention", "--shape", "B=1,H=2,S=4096,D=128",
                       "--device", "gpu", "--no-ncu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "cycles per block" in out and "TFLOP/s" in out and "GB/s" in out
    assert "compute-bound" in out and "occupancy" in out and "limited by" in out
