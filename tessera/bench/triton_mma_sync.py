"""A peer for Tessera's mma.sync GEMM: Triton's matmul compiled to mma.sync (Triton's "MMA v2"), as
Triton itself runs on an A100, here also on a Hopper GPU, where Triton would otherwise use wgmma.

Triton reads DISABLE_MMA_V3 when it compiles a kernel (it is part of its cache key), so importing
this module sets it for the process; other Triton kernels of the same process (none in bench/)
would also compile to mma.sync.
"""
from __future__ import annotations

import os

os.environ["DISABLE_MMA_V3"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.testing  # noqa: E402


@triton.jit
def triton_matmul(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """C = A @ B for row-major A [M, K], B [K, N] whose sizes are multiples of the tile (what the
    benchmarks use), tiles grouped GROUP rows at a time for L2 reuse."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP * tiles_n)
    first_m = group * GROUP
    rows_in_group = min(tiles_m - first_m, GROUP)
    pid_m = first_m + (pid % (GROUP * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP * tiles_n)) // rows_in_group
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a + rm[:, None] * K + rk[None, :]
    b_ptrs = b + rk[:, None] * N + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        acc += tl.dot(tl.load(a_ptrs), tl.load(b_ptrs))
        a_ptrs += BK
        b_ptrs += BK * N
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


#: (BM, BN, BK, warps, stages): the tilings of Triton's matmul tutorial and their larger neighbours
TILINGS = [
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 32, 4, 4),
    (128, 256, 32, 8, 4), (256, 128, 32, 8, 4), (128, 128, 64, 8, 3), (256, 256, 32, 8, 3),
]


def best_triton_matmul(a, b, ref, rel_err, median_ms):
    """Triton's mma.sync matmul at its fastest tiling for these inputs: (median ms, tiling, function),
    every tiling's output checked against `ref` before it is timed."""
    m, k = a.shape
    n = b.shape[1]
    if m % 256 or n % 256 or k % 64:
        raise ValueError(f"triton_matmul needs M, N multiples of 256 and K of 64, got {m}x{k}x{n}")
    best = (float("inf"), None, None)
    for bm, bn, bk, warps, stages in TILINGS:
        c = torch.empty(m, n, device=a.device, dtype=a.dtype)

        def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, c=c):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            triton_matmul[grid](a, b, c, m, n, k, bm, bn, bk, 8, num_warps=warps, num_stages=stages)
            return c
        try:
            out = run()
        except triton.runtime.errors.OutOfResources:   # a tiling past this GPU's shared memory
            continue
        err = rel_err(out, ref)
        if err > 1e-2:
            raise AssertionError(f"triton_matmul {bm}x{bn}x{bk}: rel err {err:.1e}")
        best = min(best, (median_ms(run), (bm, bn, bk, warps, stages), run), key=lambda x: x[0])
    return best
