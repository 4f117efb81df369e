"""Row kernels forward (softmax, layer_norm, rms_norm) against the copy bandwidth and torch, at issue
15's shapes, fp16 and bf16; `--sweep` also times the `space` pins behind their defaults (warps and
chunk length, schedule.SHAPE_DEFAULTS).

    python3 bench/row_kernels.py [--dtypes bf16,fp16] [--shapes 4096x32768,...] [--sweep]

`--sweep` pins (warps, chunk, rows a block) without clusters, and (cluster, chunk, warps) splitting
each row across a thread-block cluster (the `cluster` param, on GPUs with clusters).

"vs copy" is 2 M x N elements moved (a read and a write) per second over a device-to-device copy of
the same tensor on the same GPU. Outputs are checked against torch first. Medians of triton's do_bench.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import tessera as tsr  # noqa: E402
from tessera.bench import cases  # noqa: E402  (the benchmarks' functions)
from tessera.runtime import driver  # noqa: E402

SHAPES = [(16384, 8192), (4096, 32768), (65536, 1024)]
#: (warps, chunk length, rows a block) pinned by --sweep
PINS = [(4, 8192, 1), (8, 8192, 1), (8, 16384, 1), (16, 16384, 1), (16, 32768, 1), (4, 1024, 4), (8, 1024, 8)]
#: (most blocks of a cluster sharing a row, chunk length, warps) pinned by --sweep, for rows past a chunk
CLUSTER_PINS = [(8, 8192, 4), (8, 8192, 8), (8, 16384, 8), (8, 4096, 4)]


# plain Python functions: each pinned variant wraps its own
softmax, layer_norm, rms_norm = cases.softmax.fn, cases.layer_norm.fn, cases.rms_norm.fn


TORCH = {"softmax": lambda x: torch.softmax(x, -1),
         "layer_norm": lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
         "rms_norm": lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=50, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    shapes = [tuple(int(d) for d in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/row_kernels.py {' '.join(sys.argv[1:])}")
    print("| op | shape | dtype | tessera ms | vs copy | torch ms | vs torch | pinned (warps, chunk, rows): vs copy |")
    print("|---|---|---|---|---|---|---|---|")
    for (m, n) in shapes:
        for dt in args.dtypes.split(","):
            tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(m, n, device="cuda", generator=gen).to(tdt)
            w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(tdt)
            b = (0.1 * torch.randn(n, device="cuda", generator=gen)).to(tdt)
            dst = torch.empty_like(x)
            moved = 2 * x.numel() * x.element_size()
            copy = moved / ms(lambda: dst.copy_(x))
            for f, params in ((softmax, []), (layer_norm, [w, b]), (rms_norm, [w])):
                want = TORCH[f.__name__](x, *params)

                def timed(space=None):
                    fn = tsr.function(f, space=space)
                    got = fn(x, *params)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert err < 2e-2, f"{f.__name__} {m}x{n} {dt} {space}: relative error {err:.1e}"
                    return ms(lambda: fn(x, *params))
                t = timed()
                t_torch = ms(lambda: TORCH[f.__name__](x, *params))
                pinned = ""
                if args.sweep:
                    pinned = " ".join(f"({w_}, {c}, {r}): {moved / timed(dict(num_warps=[w_], block_n=[c], block_m=[r], cluster=[1])) / copy:.2f}x"
                                      for w_, c, r in PINS if c <= max(n, 1024))
                    if n > 8192 and driver.Device(0).platform().has("clusters"):
                        pinned += " " + " ".join(
                            f"cluster ({k}, {c}, {w_}): {moved / timed(dict(cluster=[k], block_n=[c], num_warps=[w_])) / copy:.2f}x"
                            for k, c, w_ in CLUSTER_PINS)
                print(f"| {f.__name__} | {m}x{n} | {dt} | {t:.3f} | {moved / t / copy:.2f}x | {t_torch:.3f} | "
                      f"{t_torch / t:.2f}x | {pinned} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
