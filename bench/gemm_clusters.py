"""GEMMs whose blocks pair up in thread-block clusters sharing B's tiles (TMA multicast), against the
same GEMM without clusters and cuBLAS, in one process on the same inputs.

    python3 bench/gemm_clusters.py [--shapes M,K,N ...]

bf16, A [M, K] @ B with B stored [K, N] ("B") and [N, K] ("B^T"). Each shape runs Tessera's default
schedule (which pairs blocks where `fusion.SPLIT_ROWS_GEMM_CLUSTER` says: B's rows start off 128-byte
lines and the blocks walk several tiles), the same with `cluster` pinned to 1 and to 2, the default
compiled with M taken at run time ("generic M": what a function called with varying row counts
runs), and torch.matmul (cuBLAS). Every output is checked against a float64 product first; medians of three
rounds of do_bench medians (us), the variants alternated within each round.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.bench.cases import gemm, on_path  # noqa: E402

SHAPES = [(3000, 4096, 5000), (4000, 4096, 3000), (3000, 4096, 5120), (4096, 4096, 4096), (8192, 8192, 8104),
          (1000, 8192, 3000)]
VARIANTS = {"default": None, "cluster 1": {"cluster": [1]}, "cluster 2": {"cluster": [2]}, "generic M": None}


@tsr.function
def gemm_bt(a: Tensor["M", "K"], b: Tensor["N", "K"]):
    return a @ b.T


def generic_m(fn, dims: dict[str, int]):
    """`fn`'s default schedule with M a kernel argument, as a callable returning its one output."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = fn.compile(fn.arg_specs_for(dims, "bf16"), dynamic=frozenset({"M"}), arch=platform.arch,
                          sm_count=platform.sm_count)
    program = compiled.gpu_program(0)
    return lambda *xs: program(*xs)[0]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", help="M,K,N triples")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SHAPES
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for m, k, n in shapes:
        for layout, fn in (("B", gemm), ("B^T", gemm_bt)):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(*((n, k) if layout == "B^T" else (k, n)), device="cuda", dtype=torch.bfloat16)
            ref = a.double() @ (b.double().T if layout == "B^T" else b.double())
            calls = {"cuBLAS": (lambda: a @ b.T) if layout == "B^T" else (lambda: a @ b)}
            for name, space in VARIANTS.items():
                program = generic_m(fn, dict(M=m, K=k, N=n)) if name == "generic M" else \
                    on_path(fn, "native", dict(M=m, K=k, N=n), "bf16", space)
                calls[name] = (lambda p=program: p(a, b))
            for name, call in calls.items():
                err = float((call().double() - ref).norm() / ref.norm())
                if err > 1e-2:
                    print(f"{m}x{k}x{n} {layout} {name}: WRONG (relative error {err:.1e})")
                    return 1
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(3):
                for name, call in calls.items():
                    times[name].append(triton.testing.do_bench(call, rep=100, return_mode="median") * 1e3)
            us = {name: median(t) for name, t in times.items()}
            print(f"{m}x{k}x{n} {layout:3} " + "  ".join(
                f"{name} {t:7.1f} us ({us['cuBLAS'] / t:.3f}x)" for name, t in us.items() if name != "cuBLAS")
                + f"  cuBLAS {us['cuBLAS']:7.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
