"""fp8 attention schedules side by side: the derived schedule and pinned variants, one process.

    python3 bench/fp8_attention_schedules.py [--variants JSON] [--shapes 8x16x4096x128,...] [--causal 0,1]

examples/fp8_attention.py as written (e4m3 Q, K, V, per-tensor scales, bf16 out): V passed
transposed (`fp8_attention_vt`) without a causal mask, as stored (`causal_fp8_attention`, its
transposed copy timed with it) with one. Every variant is `space` pins on top of the derived
schedule ({} is the derived one), e.g. `--variants '[{}, {"pingpong": 1}]'`. Each output is checked
against float64 attention over the first two heads of batch 0 before timing (relative error below
5e-2: e4m3 probabilities); times are the middle of three CUDA-graph medians, in us, with TFLOP/s
(4 B H S^2 D, half for causal). What chose fp8's `pingpong` default and its D = 64 schedule
(bench/RESULTS.md session 42).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import tessera as tsr  # noqa: E402
from fp8_attention import causal_fp8_attention, fp8_attention_vt  # noqa: E402

SCALES = (0.5, 1.5, 0.75)


def graph_us(f) -> float:
    return sorted(1e3 * triton.testing.do_bench_cudagraph(f, rep=200) for _ in range(3))[1]


def reference(q, k, v, causal: bool):
    """float64 attention of batch 0, heads 0-1, on the fp8 values."""
    q, k, v = (x[:1, :2].double() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * (SCALES[0] * SCALES[1] / math.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    return torch.softmax(s, -1) @ v * SCALES[2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default='[{}, {"pingpong": 1}]', help="JSON list of space pins")
    parser.add_argument("--shapes", default="8x16x4096x128,16x16x2048x64", help="B x H x S x D, comma-separated")
    parser.add_argument("--causal", default="0,1", help="which of plain (0) and causal (1) to run")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/fp8_attention_schedules.py {' '.join(sys.argv[1:])}")
    print("| B x H x S x D | causal | variant | us | TFLOP/s | rel err |")
    print("|---|---|---|---|---|---|")
    scales = [torch.tensor([x], device="cuda") for x in SCALES]
    for shape in args.shapes.split(","):
        b, h, s, d = map(int, shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(3))
        vt = v.transpose(-1, -2).contiguous()
        for causal in (c == "1" for c in args.causal.split(",")):
            fn, values = (causal_fp8_attention, v) if causal else (fp8_attention_vt, vt)
            ref = reference(q, k, v, causal)
            for pins in json.loads(args.variants):
                f = tsr.function(fn.fn, space={key: [value] for key, value in pins.items()})
                out = f(q, k, values, *scales)[:1, :2].double()
                err = float((out - ref).norm() / ref.norm())
                assert err < 5e-2, f"{shape} causal={causal} {pins}: relative error {err:.1e}"
                us = graph_us(lambda: f(q, k, values, *scales))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                print(f"| {shape} | {causal} | {json.dumps(pins)} | {us:.1f} | {flops / us / 1e6:.0f} | {err:.1e} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
