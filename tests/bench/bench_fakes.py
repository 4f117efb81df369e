"""Recorded timings standing in for the GPU in the bench tests: result files and runs built from
plain numbers."""
from __future__ import annotations

from tessera.bench.results import BenchRun, CaseResult, PeerResult
from tessera.bench.stats import summarize

#: rounds of a tight case (spread ~0.1%) and of a noisy one (spread ~5%), both with median 1.0 ms
TIGHT = [0.999, 1.000, 1.001, 1.000, 0.999, 1.001, 1.000]
NOISY = [0.95, 1.00, 1.05, 0.97, 1.03, 1.00, 0.94]


def scaled(samples, factor):
    return [x * factor for x in samples]


def case(name, samples, peer_samples=None, suite="gemm", unit="TFLOP/s", work=2e12, status="ok"):
    """A timed case (or, with samples None, an untimed one of `status`)."""
    peers = {"torch.matmul": PeerResult(summarize(peer_samples) if peer_samples else None, 0.0)}
    return CaseResult(name, suite, unit, work, status, summarize(samples) if samples else None,
                      0.0 if samples else 0.5, "" if samples else "rel err 5.0e-01 against torch.matmul: not timed",
                      peers)


def run(cases, device="NVIDIA H100 80GB HBM3"):
    env = {"device": device, "driver": "580.159.04", "commit": "1b7b2e7" + "0" * 33, "dirty": False,
           "date": "2026-11-23T18:00:00Z", "copy_gbs": 3000.0, "command": "tessera bench --repeats 7",
           "versions": {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "cuda-bindings": "13.0.1",
                        "tessera": "0.1.0"}}
    return BenchRun(env, {"repeats": 7, "warmup_ms": 25, "rep_ms": 100}, list(cases))
