"""GEMMs whose default 128 x 256 tiles fill their waves of the SMs badly, against 128 x 192 tiles
(`fusion.NARROW_TILE`) and the peer, each pinned through `space`.

    python3 bench/gemm_one_wave.py [--bf16 M,K,N ...] [--fp8 M,N,K ...]

bf16: A [M, K] @ B [K, N] against torch.matmul (cuBLAS); fp8: e4m3, B stored [N, K], per-tensor
scales, bf16 out, against torch._scaled_mm (cuBLASLt). Each output checked against the peer first;
medians of three rounds of do_bench medians, the variants alternated within each round.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root), str(root / "tests")]

import tessera as tsr  # noqa: E402
from tessera import Tensor, dtypes  # noqa: E402
from tessera.frontend.trace import ArgSpec  # noqa: E402

from fp8_gemm_cases import scaled_mm  # noqa: E402

BF16 = [(1000, 8192, 3000), (1024, 8192, 3072), (512, 8192, 6000), (1000, 8192, 6000), (1000, 4096, 3000),
        (4096, 4096, 4096)]
FP8 = [(1008, 3008, 8192), (1008, 3008, 4096), (512, 6000, 8192), (4096, 4096, 4096), (8192, 8192, 8192)]
WIDTHS = (256, 192)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return a @ b


def compiled(fn, specs, block_n: int):
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    program = fn.compile(specs, arch=platform.arch, sm_count=platform.sm_count,
                         space={"block_n": [block_n]}).gpu_program(0)
    return lambda *xs: program(*xs)[0]


def rel_err(x, ref) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm())


def timed(peer, ours: dict) -> tuple[float, dict]:
    """Median over three rounds of do_bench medians (us), the peer and each variant alternated."""
    rounds = {"peer": [], **{k: [] for k in ours}}
    for _ in range(3):
        rounds["peer"].append(triton.testing.do_bench(peer, rep=200, return_mode="median"))
        for k, f in ours.items():
            rounds[k].append(triton.testing.do_bench(f, rep=200, return_mode="median"))
    med = {k: 1e3 * sorted(v)[1] for k, v in rounds.items()}
    return med.pop("peer"), med


def report(label: str, peer_name: str, peer: float, ours: dict) -> None:
    cells = " | ".join(f"{ours[w]:.1f} ({peer / ours[w]:.2f}x)" for w in WIDTHS)
    print(f"| {label} | {peer_name} {peer:.1f} | {cells} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", nargs="*", default=None, help="M,K,N triples")
    parser.add_argument("--fp8", nargs="*", default=None, help="M,N,K triples")
    args = parser.parse_args()
    bf16 = [tuple(map(int, s.split(","))) for s in args.bf16] if args.bf16 is not None else BF16
    fp8 = [tuple(map(int, s.split(","))) for s in args.fp8] if args.fp8 is not None else FP8
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/gemm_one_wave.py {' '.join(sys.argv[1:])}")
    print("| case | peer us | " + " | ".join(f"128 x {w} us (vs peer)" for w in WIDTHS) + " |")
    print("|---|---|" + "---|" * len(WIDTHS))
    for m, k, n in bf16:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ref = a @ b
        fns = {w: compiled(gemm, gemm.arg_specs_for(dict(M=m, K=k, N=n), "bf16"), w) for w in WIDTHS}
        for w, f in fns.items():
            assert rel_err(f(a, b), ref) < 1e-2, f"bf16 {m}x{k}x{n} 128 x {w}: wrong"
        peer, ours = timed(lambda: a @ b, {w: (lambda f=f: f(a, b)) for w, f in fns.items()})
        report(f"bf16 {m}x{k}x{n}", "torch.matmul", peer, ours)
    for m, n, k in fp8:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([1.25], device="cuda")
        specs = [ArgSpec("a", (m, k), dtypes.fp8_e4m3, ("M", "K")), ArgSpec("b", (n, k), dtypes.fp8_e4m3, ("N", "K")),
                 ArgSpec("sa", (1,), dtypes.fp32, (1,)), ArgSpec("sb", (1,), dtypes.fp32, (1,))]

        def theirs():
            return torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        want = theirs()
        fns = {w: compiled(scaled_mm, specs, w) for w in WIDTHS}
        for w, f in fns.items():
            assert rel_err(f(a, b, sa, sb), want) < 1e-2, f"fp8 {m}x{n}x{k} 128 x {w}: wrong"
        peer, ours = timed(theirs, {w: (lambda f=f: f(a, b, sa, sb)) for w, f in fns.items()})
        report(f"fp8 e4m3 {m}x{n}x{k} (M x N x K)", "_scaled_mm", peer, ours)
    return 0


if __name__ == "__main__":
    sys.exit(main())
