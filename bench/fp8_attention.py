"""FP8 attention (issue 16 item 3): Tessera's e4m3 attention against its own bf16 attention.

    python3 bench/fp8_attention.py [--quick] [--space block_m=128,...]

examples/fp8_attention.py as written: Q, K, V in e4m3 with per-tensor scales, the probabilities cast
to e4m3 for P @ V, bf16 out; "fp8" takes V as models store it ([B, H, N, D], which the compiler
copies transposed, a kernel of its own, timed with it), "fp8 V^T" takes it transposed already.
The bf16 rows run examples/flash_attention.py (causal_flash_attention) and SDPA on cuDNN on the
bf16 values of the same fp8 inputs. The issue's goal is 1.3x Tessera's own bf16 attention.

Errors are the relative norm against float64 attention on the same (fp8) values, over the first
two heads of the first batch (float64 scores of every head would not fit); bf16's error beside
fp8's. Times are medians of CUDA-graph replays in ms; TFLOP/s counts 4 * S * N * D per head (half
of it causal).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from flash_attention import causal_flash_attention, flash_attention  # noqa: E402
from fp8_attention import causal_fp8_attention, fp8_attention, fp8_attention_vt  # noqa: E402

SHAPES = [(8, 16, 4096, 128), (32, 12, 2048, 128), (4, 16, 8192, 128), (16, 16, 2048, 64)]


def graph_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def reference(q, k, v, scales, causal):
    """float64 attention of batch 0, heads 0-1."""
    q, k, v = (x[:1, :2].double() for x in (q, k, v))
    sq, sk, sv = scales
    s = q @ k.transpose(-1, -2) * (sq * sk / math.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    return torch.softmax(s, -1) @ v * sv


def rel_err(out, ref) -> float:
    out = out[:1, :2].double()
    return float((out - ref).norm() / ref.norm())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/fp8_attention.py {' '.join(sys.argv[1:])}")
    print("| B x H x S x D | causal | fp8 ms | fp8 V^T ms | bf16 ms | cuDNN bf16 ms | fp8 TFLOP/s | "
          "fp8 / own bf16 | fp8 V^T / own bf16 | fp8 err | bf16 err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, h, s, d in SHAPES[:1] if args.quick else SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(3))
        scales = (0.5, 1.5, 0.75)
        sq, sk, sv = (torch.tensor([x], device="cuda") for x in scales)
        vt = v.transpose(-1, -2).contiguous()
        q16, k16 = (x.to(torch.bfloat16) for x in (q, k))
        v16 = (v.float() * scales[2]).to(torch.bfloat16)
        q16s = (q.float() * (scales[0] * scales[1])).to(torch.bfloat16)   # (the scores' scales folded into q)
        for causal in (False, True):
            ours, ours_vt = (causal_fp8_attention, fp8_attention_vt) if causal else (fp8_attention, fp8_attention_vt)
            bf16 = causal_flash_attention if causal else flash_attention
            runs = {"fp8": lambda: ours(q, k, v, sq, sk, sv),
                    "bf16": lambda: bf16(q16s, k16, v16),
                    "cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(
                        q16s, k16, v16, is_causal=causal, scale=1 / math.sqrt(d))}
            if not causal:
                runs["fp8 V^T"] = lambda: ours_vt(q, k, vt, sq, sk, sv)
            ref = reference(q, k, v, scales, causal)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                errors = {name: rel_err(fn(), ref) for name, fn in runs.items()}
                for name, err in errors.items():
                    assert err < 5e-2, f"{name} {b}x{h}x{s}x{d}: relative error {err:.1e}"
                times = {name: graph_ms(fn) for name, fn in runs.items()}
            flop = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            vt_ms = f"{times['fp8 V^T']:.3f}" if "fp8 V^T" in times else "-"
            vt_ratio = f"{times['bf16'] / times['fp8 V^T']:.2f}x" if "fp8 V^T" in times else "-"
            print(f"| {b}x{h}x{s}x{d} | {causal} | {times['fp8']:.3f} | {vt_ms} | {times['bf16']:.3f} | "
                  f"{times['cudnn']:.3f} | {flop / times['fp8'] / 1e9:.0f} | {times['bf16'] / times['fp8']:.2f}x | "
                  f"{vt_ratio} | {errors['fp8']:.1e} | {errors['bf16']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
