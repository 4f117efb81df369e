"""Before and after a change: examples/flash_attention.py's kernels timed with the Tessera checkout at ROOT.

    python3 bench/attention_ab.py ROOT [ROOT ...]

Each ROOT (a checkout or a worktree of another commit) runs in a process of its own, one after the
other on the same GPU, on the same seeded inputs: plain and causal attention at the seeds' head dims,
bf16, CUDA-graph medians of three rounds (the middle one), in us and TFLOP/s. What a change to
shared attention code must leave as it was (bench/RESULTS.md, session 24).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CASES = [("flash_attention", 32, 12, 2048, 128), ("causal_flash_attention", 32, 12, 2048, 128),
         ("flash_attention", 8, 16, 4096, 128), ("causal_flash_attention", 8, 16, 4096, 128),
         ("flash_attention", 16, 16, 2048, 64), ("causal_flash_attention", 16, 16, 2048, 64)]


def time_root(root: str) -> None:
    """Prints each case's time with the tessera package under `root` (this process imports it)."""
    sys.path[:0] = [root, str(Path(root) / "examples")]
    import flash_attention
    import tessera
    import torch
    import triton
    assert Path(tessera.__file__).resolve().is_relative_to(Path(root).resolve()), tessera.__file__
    for name, b, h, s, d in CASES:
        fn = getattr(flash_attention, name)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fn(q, k, v)
        us = sorted(1e3 * triton.testing.do_bench_cudagraph(lambda: fn(q, k, v), rep=200) for _ in range(3))[1]
        flops = 4 * b * h * s * s * d / (2 if name.startswith("causal") else 1)
        print(f"{root:<40} {name:<24} {b}x{h}x{s}x{d} {us:9.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        time_root(sys.argv[2])
        return 0
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    return max(subprocess.call([sys.executable, __file__, "--one", root]) for root in sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
