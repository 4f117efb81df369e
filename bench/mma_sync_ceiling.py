"""What the mma.sync (Ampere-class) path can reach on this GPU, to read Tessera's mma.sync GEMM against.

    python3 bench/mma_sync_ceiling.py

Prints two ceilings next to cuBLAS (torch.matmul, which uses wgmma on a Hopper GPU):
- the instruction ceiling: a kernel that does nothing but independent mma.sync.m16n8k16 (fp16 in, fp32
  accumulate) from registers, on every SM, at several warps per SM;
- Triton's own matmul on the mma.sync path (Triton compiles `tl.dot` to mma.sync when DISABLE_MMA_V3=1),
  best of a set of tilings, on the same 4096^3 / 8192^3 problems, next to Tessera's mma.sync GEMM.
(bench/triton_mma_sync.py holds that peer.)
"""
from __future__ import annotations

import sys
from pathlib import Path

from triton_mma_sync import best_triton_matmul  # noqa: I001 (first: it sets DISABLE_MMA_V3 for Triton)
import cupy
import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402

#: Each thread keeps `CHAINS` independent accumulators, each updated `ITERS` times by one mma.sync.
CHAINS, ITERS = 8, 4096

MMA_LOOP = r"""
extern "C" __global__ void mma_loop(float *out, int iters) {
    unsigned a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 * 11u, b1 = a0 * 13u;
    float acc[%(chains)d][4] = {};
    for (int i = 0; i < iters; ++i) {
        #pragma unroll
        for (int c = 0; c < %(chains)d; ++c) {
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%%0,%%1,%%2,%%3}, "
                         "{%%4,%%5,%%6,%%7}, {%%8,%%9}, {%%0,%%1,%%2,%%3};"
                         : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
    float s = 0.f;
    for (int c = 0; c < %(chains)d; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def mma_instruction_ceiling(sms: int) -> list[tuple[int, float]]:
    """TFLOP/s of back-to-back mma.sync at 4, 8 and 16 warps per SM (one block per SM)."""
    major, minor = torch.cuda.get_device_capability()
    kernel = cupy.RawKernel(MMA_LOOP % {"chains": CHAINS}, "mma_loop", options=(f"-arch=sm_{major}{minor}",))
    rows = []
    for warps in (4, 8, 16):
        out = cupy.empty(sms * warps * 32, dtype=cupy.float32)

        def run():
            kernel((sms,), (warps * 32,), (out, cupy.int32(ITERS)))
        ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
        flops = 2 * 16 * 8 * 16 * CHAINS * ITERS * warps * sms
        rows.append((warps, flops / ms / 1e9))
    return rows


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def main() -> int:
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    for warps, tflops in mma_instruction_ceiling(props.multi_processor_count):
        print(f"mma.sync m16n8k16 f16->f32 from registers, {warps:2d} warps/SM: {tflops:7.1f} TFLOP/s")
    fn = tsr.function(gemm)
    for n in (4096, 8192):
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
        ref = a @ b
        flops = 2 * n ** 3
        cublas = median_ms(lambda: a @ b)
        tms, tiling, _ = best_triton_matmul(a, b, ref, rel_err, median_ms)
        out = fn(a, b, path="ampere")
        assert rel_err(out, ref) < 1e-2
        ams = median_ms(lambda: fn(a, b, path="ampere"))
        print(f"gemm {n}^3 fp16: cuBLAS {flops / cublas / 1e9:6.1f} TFLOP/s | "
              f"triton mma.sync {flops / tms / 1e9:6.1f} (= {cublas / tms:.2f}x cuBLAS, best {tiling}) | "
              f"tessera mma.sync {flops / ams / 1e9:6.1f} (= {cublas / ams:.2f}x cuBLAS, {tms / ams:.2f}x triton)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
