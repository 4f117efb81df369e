"""Strided inputs (issue 16 item 4): Tessera's kernels on the views models hand over, against the
same kernels on contiguous tensors, against copying first (what a user had to do before), and
against torch on the same views.

    python3 bench/strided_inputs.py

Cases, each on one set of inputs in one process:
- attention (plain and causal) whose Q, K and V are [B, H, S, D] views of one packed
  [B, S, 3, H, D] projection (as a fused QKV linear layer makes them); torch's is SDPA, which
  takes the views as they are (cuDNN or FlashAttention-2, whichever it picks);
- a GEMM (+ bias) whose A is a column slice of a wider matrix (row stride K + 64); torch's is
  torch.matmul + bias on the same slice;
- decode: one query per head against the first N positions of a longer [B, S_max, H, D] key/value
  cache (rate: key and value bytes read per second); torch's is SDPA on the same views;
- an RMSNorm over rows of a wider buffer (row stride N + 64); torch's is F.rms_norm.
"views" is Tessera reading the views in place; "contiguous" its kernel on contiguous copies made
beforehand (the speed to match); "copy + call" the copies made per call, then the call. Outputs
are checked against torch's before timing. Medians of triton's do_bench, in ms.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import tessera as tsr  # noqa: E402
from attention_cases import causal, plain  # noqa: E402
from tessera.bench.cases import rms_norm  # noqa: E402


@tsr.function
def linear(a, b, bias):
    return tsr.matmul(a, b) + bias


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def row(name: str, shape: str, work: float, unit: str, ours, torch_fn, inputs, tol: float) -> None:
    """Times Tessera on the views, on contiguous copies, and copying per call, and torch on the views;
    `work` is the FLOPs (unit TFLOP/s) or the bytes moved (GB/s) of one call."""
    want = torch_fn(*inputs)
    got = ours(*inputs)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < tol, f"{name} {shape}: relative error {err:.1e} against torch"
    copies = [x.contiguous() for x in inputs]
    t_views = ms(lambda: ours(*inputs))
    t_dense = ms(lambda: ours(*copies))
    t_copy = ms(lambda: ours(*[x.contiguous() for x in inputs]))
    t_torch = ms(lambda: torch_fn(*inputs))
    rate = work / t_views / (1e9 if unit == "TFLOP/s" else 1e6)
    print(f"| {name} | {shape} | {t_views:.3f} | {rate:.0f} {unit} | {t_dense / t_views:.2f}x | "
          f"{t_copy / t_views:.2f}x | {t_torch:.3f} | {t_torch / t_views:.2f}x | {err:.1e} |", flush=True)


def attention_rows(b: int, h: int, s: int, d: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(b, s, 3, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    for name, fn, is_causal in (("attention", plain, False), ("causal attention", causal, True)):
        flops = 4 * b * h * s * s * d / (2 if is_causal else 1)

        def sdpa(q, k, v, is_causal=is_causal):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        row(name, f"{b}x{h}x{s}x{d} bf16", flops, "TFLOP/s", fn, sdpa, [q, k, v], 2e-2)


def decode_rows(b: int, h: int, n: int, d: int) -> None:
    """One query per head against the first n positions of a [B, S_max, H, D] key/value cache."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2, b, n + 1024, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = (cache[i, :, :n].transpose(1, 2) for i in range(2))
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).to(torch.bfloat16)
    row("decode", f"{b}x{h}x1x{n}x{d} bf16, cache of {n + 1024}", 2 * b * h * n * d * 2, "GB/s", plain,
        torch.nn.functional.scaled_dot_product_attention, [q, k, v], 2e-2)


def gemm_rows(m: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k + 64, device="cuda", generator=gen).to(torch.bfloat16)[:, :k]
    b = torch.randn(k, n, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    row("gemm + bias", f"{m}x{n}x{k} bf16, A row stride {k + 64}", 2 * m * n * k, "TFLOP/s",
        linear, lambda a, b, bias: a @ b + bias, [a, b, bias], 2e-2)


def norm_rows(m: int, n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n + 64, device="cuda", generator=gen).to(torch.bfloat16)[:, :n]
    w = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    row("rms_norm", f"{m}x{n} bf16, row stride {n + 64}", 2 * m * n * 2, "GB/s", rms_norm,
        lambda x, w: torch.nn.functional.rms_norm(x, (n,), w, 1e-6), [x, w], 2e-2)


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/strided_inputs.py {' '.join(sys.argv[1:])}")
    print("| case | shape | views ms | rate | contiguous / views | copy + call / views | torch ms | "
          "torch / views | rel err vs torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    attention_rows(8, 16, 4096, 128)
    attention_rows(16, 16, 2048, 64)
    decode_rows(8, 32, 32768, 128)
    gemm_rows(8192, 8192, 8192)
    gemm_rows(4000, 4096, 4096)
    norm_rows(16384, 8192)
    return 0


if __name__ == "__main__":
    sys.exit(main())
