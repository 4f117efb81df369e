"""Times Tessera kernels over a grid of schedule parameters, to choose defaults (and to seed the autotuner).

    python3 bench/sweep.py [--only attention|gemm] [--path native|ampere] [--grid JSON] [--out DIR]

`--grid '{"block_m": [128, 256], "num_stages": [3, 4]}'` replaces the lists it names in the grid of each
kind swept (use it with --only).

Each variant is checked against torch before it is timed (median, triton.testing.do_bench).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera.bench import cases  # noqa: E402  (the benchmarks' functions)

attention, gemm = cases.attention.fn, cases.gemm.fn   # plain Python functions: each variant wraps its own


def variants(grid: dict) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*grid.values())]


def sweep(name, fn, inputs, reference, grid, flops, rows, path="native"):
    for params in variants(grid):
        f = tsr.function(fn, space={k: [v] for k, v in params.items()})
        try:
            out = f(*inputs, path=path)
        except Exception as e:  # a variant the backend rejects (too much shared memory, too many warps)
            rows.append(dict(case=name, params=params, error=str(e).splitlines()[0][:100]))
            continue
        err = float((out.double() - reference.double()).norm() / reference.double().norm())
        if err > 1e-2:
            rows.append(dict(case=name, params=params, error=f"wrong: rel err {err:.1e}"))
            continue
        ms = triton.testing.do_bench(lambda: f(*inputs, path=path), warmup=25, rep=150, return_mode="median")
        rows.append(dict(case=name, params=params, ms=ms, tflops=flops / ms / 1e9))
        print(f"{name:28} {params} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--only", choices=["attention", "gemm"], help="sweep one kernel kind")
    parser.add_argument("--path", choices=["native", "ampere"], default="native", help="code path (default native)")
    parser.add_argument("--grid", type=json.loads, default={}, help="grid lists to use instead (JSON)")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    for d in (64, 128) if args.only in (None, "attention") else ():
        q, k, v = (torch.randn(16, 12, 2048, d, device="cuda", dtype=torch.float16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        sweep(f"attention S=2048 D={d}", attention, (q, k, v), ref,
              {**dict(block_m=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3]), **args.grid},
              4 * 16 * 12 * 2048 * 2048 * d, rows)
    a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.float16) for _ in range(2))
    gemm_grids = {
        "ampere": dict(block_m=[128, 256], block_n=[128, 256], block_k=[32, 64, 128], num_warps=[4, 8],
                       num_stages=[2, 3, 4]),
        "native": dict(block_m=[128], block_n=[128, 256], block_k=[64], num_warps=[8], num_stages=[3, 4, 5],
                       group_m=[8, 16], mma_async=[0, 1]),
    }
    if args.only in (None, "gemm"):
        grid = {**gemm_grids[args.path], **args.grid}
        sweep(f"gemm 4096^3 {args.path}", gemm, (a, b), a @ b, grid, 2 * 4096 ** 3, rows,
              args.path)
    best = {}
    for r in rows:
        if "ms" in r and (r["case"] not in best or r["ms"] < best[r["case"]]["ms"]):
            best[r["case"]] = r
    print("\nbest:")
    for case, r in best.items():
        print(f"  {case:28} {r['params']} {r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
