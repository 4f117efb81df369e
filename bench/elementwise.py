"""Elementwise (streaming) kernels: the kernel compiled for each row count and the shape-generic
one, against torch's eager ops, for maps of one to four [M, N] inputs, bf16 and fp32.

    python3 bench/elementwise.py [--rows 4097,16384] [--n 4096] [--dtypes bf16,f32]

Each function is compiled with `static=["M"]` (per value) and `dynamic=["M"]` (once per class of
M: both row counts here are past 1024, one class); every output is checked against float64 first
(which compiles it, so no compile is timed). Times are medians of
CUDA-graph replays (triton's do_bench_cudagraph), in us; GB/s counts the bytes each function must
read and write once. What it watches: how many registers ptxas gives these kernels, and whether it
issues all of a thread's loads before the math (`lowering.tile_to_target.stream_blocks`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.bench.timing import rel_err  # noqa: E402


def add(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    return x + y


def bias_gelu(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.gelu(x * w + b)


def gated(a: Tensor["M", "N"], b: Tensor["M", "N"], c: Tensor["M", "N"], d: Tensor["M", "N"]):
    return tsr.silu(a) * b + c * d


F = torch.nn.functional
#: name -> (function, torch's ops, its arguments' shapes in terms of M and N)
CASES = {
    "add": (add, torch.add, ("MN", "MN")),
    "bias_gelu": (bias_gelu, lambda x, w, b: F.gelu(x * w + b), ("MN", "N", "N")),
    "gated": (gated, lambda a, b, c, d: F.silu(a) * b + c * d, ("MN", "MN", "MN", "MN")),
}
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def arguments(shapes: tuple[str, ...], m: int, n: int, dtype) -> list:
    return [torch.randn((m, n) if s == "MN" else (n,), device="cuda", dtype=dtype) for s in shapes]


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4097,16384")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--dtypes", default="bf16,f32")
    args = parser.parse_args()
    rows, n = [int(r) for r in args.rows.split(",")], args.n
    print(f"# device: {torch.cuda.get_device_name()}  command: python3 bench/elementwise.py --rows {args.rows} "
          f"--n {n} --dtypes {args.dtypes}")
    print("| kernel | dtype | M | specialized us | generic us | torch us | specialized GB/s | generic/specialized |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (fn, ref, shapes) in CASES.items():
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            static, generic = tsr.function(fn, static=["M"]), tsr.function(fn, dynamic=["M"])
            for m in rows:
                xs = arguments(shapes, m, n, dtype)
                expected = ref(*(x.double() for x in xs))
                for f in (static, generic):
                    err = rel_err(f(*xs), expected)
                    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), f"{name} {dname} M={m}: {err:.2e}"
                t_static, t_generic, t_torch = (graph_us(lambda f=f: f(*xs)) for f in (static, generic, ref))
                nbytes = (sum(x.numel() for x in xs) + m * n) * xs[0].element_size()
                print(f"| {name} | {dname} | {m} | {t_static:.1f} | {t_generic:.1f} | {t_torch:.1f} | "
                      f"{nbytes / t_static / 1e3:.0f} | {t_generic / t_static:.3f} |")


if __name__ == "__main__":
    main()
