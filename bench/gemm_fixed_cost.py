"""Where a GEMM's time goes: the main loop against everything paid once per tile or launch.

    python3 bench/gemm_fixed_cost.py

Times M = N = 4096 GEMMs (fp16) over K = 256 ... 8192 on both of Tessera's code paths and cuBLAS
(torch.matmul), each output checked against cuBLAS first, and fits t = a + b K by least squares
(K >= 512). The slope b is the main loop's cost; the intercept a is what does not grow with K: the
epilogue (storing the tiles), filling the pipeline, the last partial wave of blocks, the launch.
Two kernels with the same slope and different intercepts differ outside their main loops; this is
how the native GEMM's direct fragment stores were found (bench/RESULTS.md, session 6).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.bench.cases import gemm, on_path  # noqa: E402  (the benchmarks' shared pieces)
from tessera.bench.timing import median_ms  # noqa: E402

N = 4096
KS = (256, 512, 1024, 2048, 4096, 8192)


def median_us(fn) -> float:
    return 1e3 * median_ms(fn)


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; M = N = {N}, fp16")
    times: dict[str, list[float]] = {"cuBLAS": [], "tessera native": [], "tessera mma.sync": []}
    for k in KS:
        a = torch.randn(N, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, N, device="cuda", dtype=torch.float16)
        ref = (a @ b).double()
        times["cuBLAS"].append(median_us(lambda: a @ b))
        for name, path in (("tessera native", "native"), ("tessera mma.sync", "ampere")):
            fn = on_path(gemm, path, dict(M=N, K=k, N=N), "fp16")
            err = float((fn(a, b).double() - ref).norm() / ref.norm())
            if err > 1e-2:
                print(f"K={k} {name}: WRONG (rel err {err:.1e})")
                return 1
            times[name].append(median_us(lambda: fn(a, b)))
        print(f"K={k:5d} " + "  ".join(f"{name} {t[-1]:7.1f} us ({2 * N * N * k / t[-1] / 1e6:4.0f} TFLOP/s)"
                                       for name, t in times.items()), flush=True)
    fit = [i for i, k in enumerate(KS) if k >= 512]
    for name, t in times.items():
        slope, intercept = np.polyfit([KS[i] for i in fit], [t[i] for i in fit], 1)
        print(f"{name:17}: t = {intercept:5.1f} us + {1000 * slope:5.2f} us per 1000 of K")
    return 0


if __name__ == "__main__":
    sys.exit(main())
