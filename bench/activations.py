"""Transcendental epilogues and score modifications (issue 15): GEMM + bias + gelu (erf and tanh
forms) and silu against torch's matmul followed by the separate activation, and causal
tanh-soft-capped attention against the same attention without the soft-cap (the cost of the
tanh per score) and against FlexAttention with the same score_mod where it compiles.

    python3 bench/activations.py

bf16, one process, the same inputs for every peer, outputs checked against torch first. Medians
of triton's do_bench, in ms.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tessera as tsr  # noqa: E402
from attention_cases import FUNCTIONS, torch_reference  # noqa: E402


@tsr.function
def gemm_gelu(a, b, bias):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@tsr.function
def gemm_gelu_tanh(a, b, bias):
    return tsr.gelu(tsr.matmul(a, b) + bias, approximate="tanh")


@tsr.function
def gemm_silu(a, b, bias):
    return tsr.silu(tsr.matmul(a, b) + bias)


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gemm_rows() -> None:
    import torch.nn.functional as F
    peers = {"gemm_gelu": lambda x: F.gelu(x), "gemm_gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
             "gemm_silu": F.silu}
    for n in (4096, 8192):
        gen = torch.Generator(device="cuda").manual_seed(0)
        a, b = (torch.randn(n, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
        bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
        for fn in (gemm_gelu, gemm_gelu_tanh, gemm_silu):
            act = peers[fn.name]

            def peer():
                return act(a @ b + bias)
            err = rel_err(fn(a, b, bias), peer())
            assert err < 2e-2, f"{fn.name} {n}: relative error {err:.1e}"
            t, tp = ms(lambda: fn(a, b, bias)), ms(peer)
            print(f"| {fn.name} | {n}^3 | {t:.3f} | {2 * n ** 3 / t / 1e9:.0f} TFLOP/s | {tp:.3f} | {tp / t:.2f}x "
                  f"| {err:.1e} |", flush=True)


def flex_softcap(q, k, v):
    """FlexAttention with the soft-capped causal score_mod, compiled; None where it does not build."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        s = q.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, s, s)
        compiled = torch.compile(flex_attention)

        def mod(score, b, h, i, j):
            return 20.0 * torch.tanh(score / 20.0)
        return lambda: compiled(q, k, v, score_mod=mod, block_mask=mask)
    except Exception as e:   # noqa: BLE001  (a torch without FlexAttention, or one that fails to compile it)
        print(f"# FlexAttention unavailable: {type(e).__name__}: {e}")
        return None


def attention_rows() -> None:
    b, h, s, d = 8, 16, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * s * s * d / 2
    for kind in ("causal", "softcap_causal"):
        fn = FUNCTIONS[kind]
        err = rel_err(fn(q, k, v), torch_reference(torch, kind, q.float(), k.float(), v.float()))
        assert err < 2e-2, f"{kind}: relative error {err:.1e}"
        t = ms(lambda: fn(q, k, v))
        flex = flex_softcap(q, k, v) if kind == "softcap_causal" else None
        peer = ""
        if flex is not None:
            flex()
            tf = ms(flex)
            peer = f"{tf:.3f} | {tf / t:.2f}x"
        print(f"| {kind} | {b}x{h}x{s}x{d} | {t:.3f} | {flops / t / 1e9:.0f} TFLOP/s | {peer or 'n/a | n/a'} "
              f"| {err:.1e} |", flush=True)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/activations.py {' '.join(sys.argv[1:])}")
    print("| case | size | tessera ms | rate | peer ms | peer / tessera | rel err |")
    print("|---|---|---|---|---|---|---|")
    gemm_rows()
    attention_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
