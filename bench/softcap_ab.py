"""Before and after a change: the causal tanh-soft-capped attention's forward and backward, timed with
the Tessera checkout at ROOT.

    python3 bench/softcap_ab.py ROOT [ROOT ...]

Each ROOT (a checkout, a worktree or an exported tree of another commit) runs in a process of its
own, one after the other on the same GPU, on the same seeded inputs: tests/attention_cases.py's
softcap_causal, bf16, at issue 15's 8x16x4096x128 and three more shapes; the forward call and
`tsr.vjp`'s backward call, triton do_bench medians (L2 flushed), and the forward's error against a
float64 torch reference on the first batch (bench/RESULTS.md, session 30).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHAPES = [(8, 16, 4096, 128), (16, 16, 2048, 64), (1, 8, 4096, 128), (3, 5, 1531, 128)]


def time_root(root: str) -> None:
    """Prints each shape's times with the tessera package under `root` (this process imports it)."""
    sys.path[:0] = [root, str(Path(root) / "tests"), str(Path(root) / "examples")]
    import attention_cases
    import tessera as tsr
    import torch
    import triton
    assert Path(tsr.__file__).resolve().is_relative_to(Path(root).resolve()), tsr.__file__
    fn = attention_cases.FUNCTIONS["softcap_causal"]
    for b, h, s, d in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, d_out = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
                          for _ in range(4))
        out, f_vjp = tsr.vjp(fn, q, k, v)
        ref = attention_cases.torch_reference(torch, "softcap_causal", *(x[:1].double() for x in (q, k, v)))
        err = float((out[:1].double() - ref).norm() / ref.norm())
        fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=200)
        bwd = triton.testing.do_bench(lambda: f_vjp(d_out), warmup=25, rep=200)
        flops = 4 * b * h * s * s * d / 2
        print(f"{root:40s} {b}x{h}x{s}x{d}: forward {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s, "
              f"error {err:.1e}), backward {bwd:.3f} ms", flush=True)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--root":
        time_root(sys.argv[2])
        return 0
    roots = sys.argv[1:] or [str(Path(__file__).resolve().parents[1])]
    for root in roots:
        subprocess.run([sys.executable, __file__, "--root", str(Path(root).resolve())], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
