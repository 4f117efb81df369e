"""GEMMs with too few output tiles to fill the GPU, where Tessera splits K (`split_k`).

    python3 bench/split_k_gemm.py

For each shape (fp16), on both code paths: cuBLAS (torch.matmul), Tessera as a plain call compiles
it (the split the compiler derives), Tessera pinned to split_k = 1, and the fastest split_k of
SPLITS, each output checked against cuBLAS first. Two timings, both medians: "gpu" replays the
call from a CUDA graph (the kernels' own time: these GEMMs take about as long as launching them
from Python), "call" is a plain call per iteration (tessera.bench.timing.median_ms), launch overhead included.
Ratios are cuBLAS time / Tessera time (above 1: Tessera is faster).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.bench.cases import gemm, on_path  # noqa: E402  (the benchmarks' shared pieces)
from tessera.bench.timing import median_ms, rel_err  # noqa: E402

#: (M, K, N): one-row-block and square few-tile problems with long K loops, and one that fills the GPU
SHAPES = [(128, 4096, 4096), (256, 4096, 4096), (4096, 4096, 256), (64, 8192, 8192),
          (1024, 8192, 1024), (512, 16384, 512), (2048, 8192, 2048)]
SPLITS = (1, 2, 4, 8, 16)


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def split_of(dims: dict, path: str) -> int:
    """The split_k a plain compile derives for these dims on this GPU."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = gemm.compile(gemm.arg_specs_for(dims, "fp16"), arch=platform.arch, sm_count=platform.sm_count,
                            path=path)
    host = next(iter(compiled.modules["schedule"].ops))
    (kernel,) = (op for op in host.body.block.ops if op.name == "schedule.kernel")
    return kernel.param_values["split_k"]


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; fp16; times in us, medians")
    status = 0
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        ref = a @ b
        cublas_gpu, cublas_call = graph_us(lambda: a @ b), 1e3 * median_ms(lambda: a @ b)
        dims = dict(M=m, K=k, N=n)
        for path in ("native", "ampere"):
            derived = split_of(dims, path)
            gpu, fns = {}, {}
            for split in sorted({*SPLITS, derived}):
                fn = fns[split] = on_path(gemm, path, dims, "fp16", space={"split_k": [split]})
                err = rel_err(fn(a, b), ref)
                if err > 1e-2:
                    print(f"{m}x{k}x{n} {path} split_k={split}: WRONG (rel err {err:.1e})")
                    status = 1
                    continue
                gpu[split] = graph_us(lambda: fn(a, b))
            if derived not in gpu or 1 not in gpu:
                continue
            call = 1e3 * median_ms(lambda: fns[derived](a, b))
            best = min(gpu, key=gpu.get)
            print(f"M={m:5d} K={k:5d} N={n:5d} {path:6s} | cuBLAS gpu {cublas_gpu:6.1f} call {cublas_call:6.1f} | "
                  f"tessera split_k={derived:2d} gpu {gpu[derived]:6.1f} = {cublas_gpu / gpu[derived]:.2f}x cuBLAS, "
                  f"{gpu[1] / gpu[derived]:.2f}x split_k=1 ({gpu[1]:6.1f}); call {call:6.1f} = "
                  f"{cublas_call / call:.2f}x | best split_k={best:2d} gpu {gpu[best]:6.1f}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
