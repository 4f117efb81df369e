"""Times Tessera kernels over a grid of schedule parameters, to choose defaults (and to seed the autotuner).

    python3 bench/sweep.py [--only attention|gemm] [--path native|ampere] [--grid JSON] [--out DIR]
    python3 bench/sweep.py --only gemm-tiles [--shapes 512x512x512,1000x8192x3000]   # M x K x N, bf16
    python3 bench/sweep.py --only column-tiles [--shapes 16384x8192]                  # M x N column sums, bf16
    python3 bench/sweep.py --only fp32-tiles [--prebuild]   # fp32 GEMM 4096^3 on CUDA Tile IR (--prebuild,
                                                            # where tileiras is: the cubins, into the cache)

`--grid '{"block_m": [128, 256], "num_stages": [3, 4]}'` replaces the lists it names in the grid of each
kind swept (use it with --only).

Each variant is checked against torch before it is timed (median, triton.testing.do_bench; the tile
sweeps, whose small problems take less GPU time than a call's host time, time CUDA-graph replays).
The tile sweeps time the derived schedule ("derived") beside each pinned tile, and the peer (cuBLAS,
the copy bandwidth) beside them: they chose `fusion.GEMM_TILES` and the column-sum tile
(bench/RESULTS.md session 22).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera.bench import cases  # noqa: E402  (the benchmarks' functions)

attention, gemm = cases.attention.fn, cases.gemm.fn   # plain Python functions: each variant wraps its own


def variants(grid: dict) -> list[dict]:
    keys = list(grid)
    return [dict(zip(keys, values)) for values in itertools.product(*grid.values())]


def timed_ms(f, graphs: bool = False) -> float:
    import triton.testing
    if graphs:
        return triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median")
    return triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median")


def sweep(name, fn, inputs, reference, grid, flops, rows, path="native", graphs=False, unit="flop", backend="auto"):
    """Each variant of `grid` (a dict of lists, or a list of param dicts; {} is the derived
    schedule) checked against `reference`, then timed; `flops` is bytes where `unit` is "byte"."""
    for params in grid if isinstance(grid, list) else variants(grid):
        f = tsr.function(fn, space={k: [v] for k, v in params.items()})
        label = params or "derived"
        try:
            out = f(*inputs, path=path, backend=backend)
        except Exception as e:  # a variant the backend rejects (too much shared memory, too many warps)
            rows.append(dict(case=name, params=params, error=str(e).splitlines()[0][:100]))
            continue
        err = float((out.double() - reference.double()).norm() / reference.double().norm())
        if err > 1e-2:
            rows.append(dict(case=name, params=params, error=f"wrong: rel err {err:.1e}"))
            continue
        ms = timed_ms(lambda: f(*inputs, path=path, backend=backend), graphs)
        rate = flops / ms / 1e9 if unit == "flop" else flops / ms / 1e6
        rows.append(dict(case=name, params=params, ms=ms, tflops=rate) if unit == "flop"
                    else dict(case=name, params=params, ms=ms, gbs=rate))
        print(f"{name:28} {label} {ms * 1e3:9.1f} us {rate:7.1f} {'TFLOP/s' if unit == 'flop' else 'GB/s'}", flush=True)


#: the native GEMM tiles the small-GEMM rule picks from (fusion.GEMM_TILES), pinned one by one
GEMM_TILE_VARIANTS = [{}, *({"block_m": m, "block_n": n, "num_warps": w}
                           for m, n, w in [(128, 256, 8), (128, 128, 8), (128, 64, 8), (64, 128, 4), (64, 64, 4)])]
FP32_TILE_VARIANTS = [{"block_m": m, "block_n": n} for m, n in itertools.product([64, 128], [64, 128])]
COLUMN_TILE_VARIANTS = [{}, *({"block_m": m, "block_n": n, "num_warps": w}
                             for m, n, w in itertools.product([32, 64], [128, 256], [4, 8]))]


def column_sum(x: tsr.Tensor["M", "N"]):
    return tsr.sum(x, 0)


def prebuild_fp32_tiles() -> None:
    """The fp32 tile sweep's CUDA Tile IR cubins, assembled into the cubin cache (TESSERA_CACHE_DIR)
    on a machine with tileiras, for a GPU machine without it."""
    from tessera.frontend.function import ArgSpec
    specs = [ArgSpec(name, (4096, 4096), tsr.fp32, None) for name in ("a", "b")]
    for params in FP32_TILE_VARIANTS:
        f = tsr.function(gemm, space={k: [v] for k, v in params.items()})
        f.compile(specs, backend="cuda-tile", arch="sm_90a", sm_count=132).stage("cubin")


def tile_sweeps(kind: str, shapes: list[tuple[int, ...]], rows: list) -> None:
    """The small-GEMM tile sweep (M x K x N, bf16, cuBLAS beside), the column-sum tile sweep
    (M x N, bf16, of the copy bandwidth), or the fp32 GEMM tiles of CUDA Tile IR, CUDA-graph timed."""
    if kind == "fp32-tiles":
        a, b = (torch.randn(4096, 4096, device="cuda") for _ in range(2))
        sweep("gemm 4096^3 fp32 cuda-tile", gemm, (a, b), a.double() @ b.double(), FP32_TILE_VARIANTS, 2 * 4096 ** 3,
              rows, graphs=True, backend="cuda-tile")
        return
    if kind == "gemm-tiles":
        for m, k, n in shapes or [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (16, 4096, 4096),
                                  (128, 4096, 4096), (256, 4096, 4096)]:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            print(f"gemm {m}x{k}x{n}: cuBLAS {timed_ms(lambda: a @ b, True) * 1e3:.1f} us", flush=True)
            sweep(f"gemm {m}x{k}x{n}", gemm, (a, b), a @ b, GEMM_TILE_VARIANTS, 2 * m * k * n, rows, graphs=True)
        return
    from tessera.bench.timing import copy_bandwidth
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:.0f} GB/s")
    for m, n in shapes or [(16384, 8192), (65536, 1024), (4096, 32768), (8192, 4096)]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        sweep(f"column sum {m}x{n}", column_sum, (x,), x.double().sum(0), COLUMN_TILE_VARIANTS, 2 * m * n, rows,
              graphs=True, unit="byte")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--only", choices=["attention", "gemm", "gemm-tiles", "column-tiles", "fp32-tiles"],
                        help="sweep one kernel kind, or the GEMM or column-sum tiles")
    parser.add_argument("--prebuild", action="store_true", help="with --only fp32-tiles: assemble its cubins (no GPU)")
    parser.add_argument("--shapes", default="", help="the tile sweeps' shapes, e.g. 512x512x512,16x4096x4096")
    parser.add_argument("--path", choices=["native", "ampere"], default="native", help="code path (default native)")
    parser.add_argument("--grid", type=json.loads, default={}, help="grid lists to use instead (JSON)")
    args = parser.parse_args(argv)
    if args.prebuild:   # (no GPU or triton needed)
        prebuild_fp32_tiles()
        return 0
    rows: list[dict] = []
    if args.only in ("gemm-tiles", "column-tiles", "fp32-tiles"):
        tile_sweeps(args.only, [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s], rows)
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
        rate = f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r else f"{r['gbs']:.0f} GB/s"
        print(f"  {case:28} {r['params'] or 'derived'} {r['ms'] * 1e3:.1f} us {rate}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
