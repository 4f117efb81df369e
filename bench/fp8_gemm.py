"""FP8 GEMMs (issue 16 item 3): Tessera's scaled fp8 GEMM, written as tensor math, against
torch._scaled_mm (cuBLASLt) on the same e4m3 inputs, and against Tessera's own bf16 GEMM.

    python3 bench/fp8_gemm.py

Per-tensor scales give a bf16 result (tessera.bench.cases' `scaled_fp8_gemm`); "rowwise" scales A's
rows and B's columns (torch._scaled_mm's rowwise scaling, bf16 out). B is stored [N, K], as both
fp8 tensor cores and cuBLASLt read it. Outputs are checked against torch's before timing. Medians
of triton's do_bench, in ms.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import tessera as tsr  # noqa: E402
from fp8_gemm_cases import scaled_mm  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4000, 4096, 4096), (1008, 3008, 8192)]


@tsr.function
def rowwise(a, b, sa, sb):
    return (tsr.matmul(a, b.transpose(0, 1)) * sa * sb).to(tsr.bf16)


@tsr.function
def bf16_gemm(a, b):
    return tsr.matmul(a, b.transpose(0, 1))


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=200, return_mode="median")


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/fp8_gemm.py {' '.join(sys.argv[1:])}")
    print("| scales | M x N x K | tessera ms | TFLOP/s | _scaled_mm ms | vs _scaled_mm | tessera bf16 ms | "
          "vs own bf16 | rel err vs torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m, n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        a32, b32 = torch.randn(m, k, device="cuda", generator=gen), torch.randn(n, k, device="cuda", generator=gen)
        a, b = a32.to(torch.float8_e4m3fn), b32.to(torch.float8_e4m3fn)
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        t_bf16 = ms(lambda: bf16_gemm(a16, b16))
        cases = [("tensor", scaled_mm, torch.tensor([0.5], device="cuda"), torch.tensor([1.25], device="cuda")),
                 ("rowwise", rowwise, torch.rand(m, 1, device="cuda", generator=gen) + 0.5,
                  torch.rand(1, n, device="cuda", generator=gen) + 0.5)]
        for name, fn, sa, sb in cases:
            def ours():
                return fn(a, b, sa, sb)

            def theirs():
                return torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            got, want = ours(), theirs()
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"{name} {m}x{n}x{k}: relative error {err:.1e} against torch._scaled_mm"
            t_ours, t_theirs = ms(ours), ms(theirs)
            print(f"| {name} | {m}x{n}x{k} | {t_ours:.3f} | {2 * m * n * k / t_ours / 1e9:.0f} | {t_theirs:.3f} | "
                  f"{t_theirs / t_ours:.2f}x | {t_bf16:.3f} | {t_bf16 / t_ours:.2f}x | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
