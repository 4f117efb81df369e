"""Causal fp8 attention compiled for one shape (issue 16 item 3), timed alone in its process.

    python3 bench/fp8_attention_specialized.py 32x12x2048x128

bench/fp8_attention.py calls each function with several shapes in one process, so from its second
shape on the compile is shape-generic (S taken at run time: `fn.cache_info()`); this times the
kernel compiled for the shape given, as a caller with one shape gets it. examples/fp8_attention.py's
causal_fp8_attention, Q, K, V in e4m3 from randn (seed 0), V passed as models store it (its
transposed copy timed with the call), scales 0.5, 1.5, 0.75. The middle of three medians of
CUDA-graph replays, in us, and the compile's cache key (to show it is the shape's own). Run it from
two checkouts (`cd OTHER && python3 bench/...`) for a before/after: it imports the tree it runs from.
"""
from __future__ import annotations

import os
import sys

import torch
import triton

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "examples")]

import tessera as tsr  # noqa: E402
from fp8_attention import causal_fp8_attention  # noqa: E402


def main() -> int:
    assert tsr.__file__.startswith(os.getcwd()), f"run from a checkout's root (imported {tsr.__file__})"
    b, h, s, d = map(int, sys.argv[1].split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(torch.float8_e4m3fn) for _ in range(3))
    scales = [torch.tensor([x], device="cuda") for x in (0.5, 1.5, 0.75)]
    causal_fp8_attention(q, k, v, *scales)
    torch.cuda.synchronize()
    times = sorted(1e3 * triton.testing.do_bench_cudagraph(lambda: causal_fp8_attention(q, k, v, *scales), rep=200)
                   for _ in range(3))
    print(f"# {torch.cuda.get_device_name()}, python3 bench/fp8_attention_specialized.py {sys.argv[1]}")
    print(f"{sys.argv[1]:16s} {times[1]:8.1f} us  {causal_fp8_attention.cache_info().keys}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
