"""Tessera's GEMM with and without the `persistent` schedule switch, on both code paths, against cuBLAS.

    python3 bench/persistent_gemm.py

For 4096^3 and 8192^3, fp16 and bf16: TFLOP/s of the native (TMA + wgmma) and mma.sync paths with
one output tile per block (persistent=0) and with one block per SM walking tiles (persistent=1,
the native path's default), each output checked against torch.matmul before it is timed (median,
triton.testing.do_bench).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera.bench.cases import gemm  # noqa: E402  (the benchmarks' shared pieces)
from tessera.bench.timing import median_ms  # noqa: E402


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for n in (4096, 8192):
        for dt in (torch.float16, torch.bfloat16):
            a, b = (torch.randn(n, n, device="cuda", dtype=dt) for _ in range(2))
            ref = a @ b
            for path in ("native", "ampere"):
                for persistent in (0, 1):
                    f = tsr.function(gemm.fn, space={"persistent": [persistent]})
                    err = float((f(a, b, path=path).double() - ref.double()).norm() / ref.double().norm())
                    if err > 1e-2:
                        print(f"{n}^3 {dt} {path} persistent={persistent}: WRONG (rel err {err:.1e})")
                        continue
                    ms = median_ms(lambda: f(a, b, path=path))
                    cublas = median_ms(lambda: a @ b)   # right after: both at the same clocks and power
                    print(f"gemm {n}^3 {str(dt).removeprefix('torch.'):8} {path:6} persistent={persistent}: "
                          f"{2 * n ** 3 / ms / 1e9:6.1f} TFLOP/s = {cublas / ms:.2f}x cuBLAS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
