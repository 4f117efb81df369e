"""Attention schedules side by side: the derived schedule and pinned variants against cuDNN, one process.

    python3 bench/attention_schedules.py [--variants JSON] [--shapes 8x16x4096x128,...] [--dtype bf16]

Each shape runs plain and causal (the bench's `attention` / `causal_attention` functions); every
variant is `space` pins on top of the derived schedule ({} is the derived one itself), e.g.
`--variants '[{}, {"qk_ahead": 0, "warp_specialize": 0, "block_n": 64}]'` (the D = 128 default
before session 41). Outputs are checked against cuDNN's (fp32 relative error) before timing;
times are the middle of three CUDA-graph medians, in us, with TFLOP/s (4 B H S^2 D, half for causal)
and the ratio to cuDNN's time (above 1: Tessera faster). What chose the Hopper D = 128 default
(bench/RESULTS.md session 41).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera.bench import cases  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def graph_us(f) -> float:
    return sorted(1e3 * triton.testing.do_bench_cudagraph(f, rep=200) for _ in range(3))[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="[{}]", help="JSON list of space pins (params to values)")
    parser.add_argument("--shapes", default="8x16x4096x128,32x12x2048x128", help="B x H x S x D, comma-separated")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = parser.parse_args()
    variants = json.loads(args.variants)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/attention_schedules.py {' '.join(sys.argv[1:])}")
    print("| B x H x S x D | causal | variant | us | TFLOP/s | cuDNN us | vs cuDNN | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        b, h, s, d = map(int, shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, generator=gen, device="cuda", dtype=DTYPES[args.dtype]) for _ in range(3))
        for causal in (False, True):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal).float()
                cudnn = graph_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fn = (cases.causal_attention if causal else cases.attention).fn
            for pins in variants:
                f = tsr.function(fn, space={key: [value] for key, value in pins.items()})
                err = float((f(q, k, v).float() - ref).norm() / ref.norm())
                assert err < 1e-2, f"{shape} causal={causal} {pins}: relative error {err:.1e}"
                us = graph_us(lambda: f(q, k, v))
                print(f"| {shape} | {causal} | {json.dumps(pins) if pins else 'derived'} | {us:.1f} | "
                      f"{flops / us / 1e6:.0f} | {cudnn:.1f} | {cudnn / us:.3f}x | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
