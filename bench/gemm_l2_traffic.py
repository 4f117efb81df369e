"""Tessera's GEMM and cuBLAS (torch.matmul) at the same shapes, each run once after a checked warm-up,
for a profiler to count their L2 traffic: B stored [K, N] with rows of N not a multiple of 64
elements (128 bytes) against a multiple of it.

    ncu --clock-control none --kernel-name regex:"gemm|nvjet|sm90|cutlass" \\
        --metrics gpu__time_duration.sum,lts__t_requests_op_read.sum,lts__t_sectors_op_read.sum,\\
lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \\
        python3 bench/gemm_l2_traffic.py [--shapes 3000x4096x5000,3000x4096x5120]

Shapes are M x K x N, bf16. Without ncu it only checks the outputs against torch.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from tessera.bench.cases import gemm  # noqa: E402  (the benchmarks' A [M, K] @ B [K, N])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="3000x4096x5000,3000x4096x5120,8192x8192x8192")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        m, k, n = (int(d) for d in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ref = a.double() @ b.double()
        err = ((gemm(a, b).double() - ref).abs().max() / ref.abs().max()).item()
        if not err < 1e-2:
            print(f"{shape}: Tessera's output is off by {err:.2e} of the largest element", file=sys.stderr)
            return 1
        torch.cuda.synchronize()
        gemm(a, b)      # the profiled launches, in this order
        torch.matmul(a, b)
        torch.cuda.synchronize()
        print(f"{shape}: checked (relative error {err:.1e}); profiled Tessera, then torch.matmul", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
