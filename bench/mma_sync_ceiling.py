"""What the mma.sync (Ampere-class) path can reach on this GPU, to read Tessera's mma.sync GEMM against.

    python3 bench/mma_sync_ceiling.py

Prints two ceilings next to cuBLAS (torch.matmul, which uses wgmma on a Hopper GPU):
- the instruction ceiling: a kernel that does nothing but independent mma.sync.m16n8k16 (fp16 in, fp32
  accumulate) from registers, on every SM, at several warps per SM;
- Triton's own matmul on the mma.sync path (Triton compiles `tl.dot` to mma.sync when DISABLE_MMA_V3=1),
  best of a set of tilings, on the same 4096^3 / 8192^3 problems, next to Tessera's mma.sync GEMM.
(tessera/bench/triton_mma_sync.py holds that peer.)
Each line also gives the SM clock and board power while that kernel runs back to back (nvidia-smi,
sampled every 50 ms), and the work done per SM per clock: a GPU that runs at its power limit trades
clock for work per clock, so TFLOP/s alone does not say how well a kernel uses the tensor cores.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.bench.triton_mma_sync import best_triton_matmul  # noqa: E402,I001 (first: it sets DISABLE_MMA_V3)
import cupy  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

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


def under_load(fn, seconds: float = 2.0) -> tuple[float, float]:
    """(median SM clock in MHz, median board power in W) while `fn` runs back to back; (nan, nan)
    where nvidia-smi is missing."""
    fn()
    torch.cuda.synchronize()
    try:
        smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), "-lms", "50",
                                "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                               stdout=subprocess.PIPE, text=True)
    except FileNotFoundError:
        return float("nan"), float("nan")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines()[4:] if line.count(",") == 1]
    return (statistics.median(float(c) for c, _ in samples), statistics.median(float(w) for _, w in samples))


def rate(name: str, flops: int, fn, ms: float, sms: int, against: float | None = None) -> str:
    """One kernel's line: TFLOP/s, ratio to `against` (ms), clock, power and FLOP per SM per clock."""
    mhz, watts = under_load(fn)
    ratio = f" = {against / ms:.2f}x cuBLAS" if against else ""
    return (f"  {name:34} {flops / ms / 1e9:6.1f} TFLOP/s{ratio:17} at {mhz:5.0f} MHz {watts:4.0f} W: "
            f"{flops / (ms * 1e-3) / sms / (mhz * 1e6):6.0f} FLOP/clk/SM")


def mma_instruction_ceiling(sms: int) -> list[tuple[int, float, str]]:
    """TFLOP/s of back-to-back mma.sync at 4, 8 and 16 warps per SM (one block per SM), each with
    its line from `rate`."""
    major, minor = torch.cuda.get_device_capability()
    kernel = cupy.RawKernel(MMA_LOOP % {"chains": CHAINS}, "mma_loop", options=(f"-arch=sm_{major}{minor}",))
    rows = []
    for warps in (4, 8, 16):
        out = cupy.empty(sms * warps * 32, dtype=cupy.float32)

        def run():
            kernel((sms,), (warps * 32,), (out, cupy.int32(ITERS)))
        ms = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
        flops = 2 * 16 * 8 * 16 * CHAINS * ITERS * warps * sms
        rows.append((warps, flops / ms / 1e9, rate(f"mma.sync loop, {warps} warps/SM", flops, run, ms, sms)))
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
    sms = props.multi_processor_count
    print("mma.sync m16n8k16 f16->f32 from registers:")
    for _, _, line in mma_instruction_ceiling(sms):
        print(line)
    fn = tsr.function(gemm)
    for n in (4096, 8192):
        for dt in (torch.float16, torch.bfloat16):
            a, b = (torch.randn(n, n, device="cuda", dtype=dt) for _ in range(2))
            ref = a @ b
            flops = 2 * n ** 3
            kernels = {"cuBLAS (torch.matmul)": lambda: a @ b}
            _, tiling, triton_run = best_triton_matmul(a, b, ref, rel_err, median_ms)
            kernels[f"triton mma.sync {tiling}"] = triton_run
            for path in ("ampere", "native"):
                assert rel_err(fn(a, b, path=path), ref) < 1e-2, path
                kernels[f"tessera {'mma.sync' if path == 'ampere' else 'native'}"] = (
                    lambda path=path: fn(a, b, path=path))
            times = {name: median_ms(run) for name, run in kernels.items()}
            cublas = times["cuBLAS (torch.matmul)"]
            print(f"gemm {n}^3 {str(dt).removeprefix('torch.')}:")
            for name, run in kernels.items():
                print(rate(name, flops, run, times[name], sms, cublas), flush=True)
    waves(fn, sms)
    return 0


def waves(fn, sms: int, blocks_per_sm: int = 3, k: int = 4096) -> None:
    """The mma.sync GEMM (128 x 128 tiles, three blocks an SM) where its tiles fill whole waves of
    blocks and where they do not (4096^2 leaves the last of 2.59 waves on 132 SMs part-empty). Equal
    throughput at whole waves means the last wave is not what holds it back."""
    rows = sms // 4 if sms % 4 == 0 else sms
    per_wave = blocks_per_sm * sms // rows
    print(f"gemm K={k} fp16, tessera mma.sync at whole waves of {blocks_per_sm * sms} blocks:")
    for m, n in [(4096, 4096), *((128 * rows, 128 * per_wave * w) for w in (2, 3, 4))]:
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        assert rel_err(fn(a, b, path="ampere"), a @ b) < 1e-2
        flops = 2 * m * n * k
        ours = median_ms(lambda: fn(a, b, path="ampere"))
        cublas = median_ms(lambda: a @ b)
        tiles = -(-m // 128) * -(-n // 128)
        print(f"  {m}x{n}: {tiles / (blocks_per_sm * sms):4.2f} waves  tessera mma.sync "
              f"{flops / ours / 1e9:5.1f} TFLOP/s  cuBLAS {flops / cublas / 1e9:5.1f}  = {cublas / ours:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
