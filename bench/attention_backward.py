"""Attention backward (issue 14): Tessera's generated backward against torch SDPA's and FlexAttention's.

    python3 bench/attention_backward.py [--quick] [--few-heads] [--gqa] [--dtypes bf16,fp16]

Tessera differentiates the attention functions of tests/attention_cases.py as
written (`tsr.vjp`), a grouped-query causal one (32 query heads over 8 KV heads, against SDPA's
`enable_gqa`) among them: each reader of the probabilities is a `flash_chain` kernel recomputing the
scores block by block (passes/recompute.py), so no S x S tensor reaches memory. The timed call is
the vjp alone (the forward ran once before); the peers' is `torch.autograd.grad` of an output
kept from one forward (SDPA through FlashAttention-2 and through cuDNN); FlexAttention (compiled,
for the soft-capped causal case) needs a forward per backward, so its time is forward + backward
minus forward. Every gradient is checked against torch's in fp32 first.
Times are medians (triton's do_bench), in ms; TFLOP/s counts the backward's 2.5x the forward's
4 B H S^2 D flops (half for causal); "vs best" is the best peer's time over Tessera's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tessera as tsr  # noqa: E402
from attention_cases import FUNCTIONS, gqa_causal_attention  # noqa: E402
from tessera.bench.cases import sdpa_backward  # noqa: E402

SHAPES = [(8, 16, 4096, 128), (16, 16, 2048, 64)]
#: few heads (grids of a few waves), where the schedule decides whether every SM has work to the end
FEW_HEADS = [(1, 8, 4096, 128), (3, 5, 1531, 128)]
#: grouped-query attention (B, H query heads, KV heads, S, D): Llama-3's 32 over 8
GQA_SHAPES = [(2, 32, 8, 4096, 128), (8, 32, 8, 1024, 128)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def flex_grad(q, k, v, d_out):
    """FlexAttention's backward: its compiled backward frees what its forward saved (donated
    buffers), so each backward needs a forward of its own; it is timed as forward + backward minus
    the forward (`Timed.minus`)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def softcap(score, b, h, i, j):
        return 20.0 * torch.tanh(score / 20.0)
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[-2], k.shape[-2])
    flex = torch.compile(flex_attention)

    def forward():
        return flex(q, k, v, score_mod=softcap, block_mask=mask)
    grad = Timed(lambda: torch.autograd.grad(forward(), (q, k, v), d_out))
    grad.minus = forward
    return grad


class Timed:
    """A backward to time; `minus`, when set, is timed too and subtracted (a forward it needs)."""

    def __init__(self, fn):
        self.fn, self.minus = fn, None

    def __call__(self):
        return self.fn()

    def ms(self) -> float:
        return ms(self.fn) - (ms(self.minus) if self.minus is not None else 0.0)


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bf16 only, the first shape")
    parser.add_argument("--few-heads", action="store_true", help="only the shapes with few heads")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--gqa", action="store_true", help="only the grouped-query causal attention")
    args = parser.parse_args()
    dtypes = ["bf16"] if args.quick else args.dtypes.split(",")
    shapes = SHAPES[:1] if args.quick else FEW_HEADS if args.few_heads else SHAPES + FEW_HEADS
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/attention_backward.py {' '.join(sys.argv[1:])}")
    print("| case | shape | dtype | tessera ms | TFLOP/s | flash2 ms | cudnn ms | flex ms | vs best | max rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = [(kind, (b, h, h, s, d)) for kind in ("plain", "causal", "softcap_causal") for b, h, s, d in shapes]
    cases = [c for c in cases if not args.gqa] + [("gqa_causal", shape) for shape in GQA_SHAPES if not args.quick]
    for kind, (b, h, hk, s, d) in cases:
        for name in dtypes:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, d_out = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=DTYPES[name]) for _ in range(2))
            k, v = (torch.randn(b, hk, s, d, device="cuda", generator=gen, dtype=DTYPES[name]) for _ in range(2))
            qkv = [x.requires_grad_() for x in (q.clone(), k.clone(), v.clone())]
            peers = {}
            if kind != "softcap_causal":
                for label, backend in (("flash2", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
                    try:
                        grad = sdpa_backward(backend, q, k, v, d_out, "causal" in kind)
                        grad()   # (its forward: a backend this machine lacks raises here)
                        peers[label] = Timed(grad)
                    except RuntimeError as e:
                        print(f"# {label} unavailable: {str(e)[:80]}")
            else:
                peers["flex"] = flex_grad(*qkv, d_out)
            _, f_vjp = tsr.vjp(gqa_causal_attention if kind == "gqa_causal" else FUNCTIONS[kind], q, k, v)
            ours = f_vjp(d_out)
            want = next(iter(peers.values()))()
            err = max(rel_err(g, w) for g, w in zip(ours, want))
            t_ours = ms(lambda: f_vjp(d_out))
            t_peer = {label: fn.ms() for label, fn in peers.items()}
            flops = 2.5 * 4 * b * h * s * s * d * (0.5 if "causal" in kind else 1.0)
            cells = [f"{t_peer[p]:.3f}" if p in t_peer else "-" for p in ("flash2", "cudnn", "flex")]
            heads = f"{h}/{hk}" if hk != h else f"{h}"
            print(f"| {kind} | {b}x{heads}x{s}x{d} | {name} | {t_ours:.3f} | {flops / t_ours / 1e9:.0f} | "
                  f"{' | '.join(cells)} | {min(t_peer.values()) / t_ours:.2f}x | {err:.1e} |", flush=True)
            del peers
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
