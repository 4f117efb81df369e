"""The CUDA Tile IR backend against Tessera's PTX backend (issue 18): the same functions, the same
inputs, one process; torch beside them for scale.

    python3 bench/cuda_tile.py              # on the GPU
    python3 bench/cuda_tile.py --prebuild   # on a machine with tileiras and no GPU: assemble every
                                            # cubin into the cubin cache (TESSERA_CACHE_DIR), for a
                                            # GPU machine without tileiras to run from

Each row: both backends' outputs checked against torch's first; medians of triton's do_bench, in ms;
TFLOP/s for matmuls and attention, GB/s for the memory-bound kernels (KV bytes for decode); `tile/ptx`
> 1 means the CUDA Tile IR kernel is faster. These rows are the measurements behind
`tessera.passes.backend_choice.RULES` (`backend="auto"`). With `--dtypes fp32`: matmuls of fp32
operands, which only the CUDA Tile IR backend compiles (rule `fp32_matmul`), against torch's fp32
matmul (TF32 off).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "examples")]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402

import attention_cases  # noqa: E402
from cuda_tile_cases import column_sum, gelu_scale, gemm_bias_gelu, layer_norm, rms_norm, softmax  # noqa: E402
from decode_attention import gqa_decode_attention  # noqa: E402


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def _qkv(b, h, s, d):
    return {"q": (b, h, s, d), "k": (b, h, s, d), "v": (b, h, s, d)}


#: (label, function, argument shapes, work: FLOP for matmuls and attention, bytes for reductions)
CASES = [
    ("gemm 4096^3", gemm, {"a": (4096, 4096), "b": (4096, 4096)}, ("flop", 2 * 4096 ** 3)),
    ("gemm 8192^3", gemm, {"a": (8192, 8192), "b": (8192, 8192)}, ("flop", 2 * 8192 ** 3)),
    ("gemm 4000x4096x4096", gemm, {"a": (4000, 4096), "b": (4096, 4096)}, ("flop", 2 * 4000 * 4096 * 4096)),
    ("gemm 1000x3000x8192", gemm, {"a": (1000, 8192), "b": (8192, 3000)}, ("flop", 2 * 1000 * 3000 * 8192)),
    ("gemm 512^3", gemm, {"a": (512, 512), "b": (512, 512)}, ("flop", 2 * 512 ** 3)),
    ("gemm 1024^3", gemm, {"a": (1024, 1024), "b": (1024, 1024)}, ("flop", 2 * 1024 ** 3)),
    ("gemm 2048^3", gemm, {"a": (2048, 2048), "b": (2048, 2048)}, ("flop", 2 * 2048 ** 3)),
    ("gemm 16x4096x4096", gemm, {"a": (16, 4096), "b": (4096, 4096)}, ("flop", 2 * 16 * 4096 * 4096)),
    ("gemm 128x4096x4096", gemm, {"a": (128, 4096), "b": (4096, 4096)}, ("flop", 2 * 128 * 4096 * 4096)),
    ("gemm 512x256x384", gemm, {"a": (512, 256), "b": (256, 384)}, ("flop", 2 * 512 * 256 * 384)),
    ("gemm+bias+gelu 8192^3", gemm_bias_gelu, {"a": (8192, 8192), "b": (8192, 8192), "bias": (8192,)},
     ("flop", 2 * 8192 ** 3)),
    ("attention 8x16x4096x128", attention_cases.FUNCTIONS["plain"], _qkv(8, 16, 4096, 128),
     ("flop", 4 * 8 * 16 * 4096 * 4096 * 128)),
    ("causal 8x16x4096x128", attention_cases.FUNCTIONS["causal"], _qkv(8, 16, 4096, 128),
     ("flop", 2 * 8 * 16 * 4096 * 4096 * 128)),
    ("attention 16x16x2048x64", attention_cases.FUNCTIONS["plain"], _qkv(16, 16, 2048, 64),
     ("flop", 4 * 16 * 16 * 2048 * 2048 * 64)),
    ("softcap causal 8x16x4096x128", attention_cases.FUNCTIONS["softcap_causal"], _qkv(8, 16, 4096, 128),
     ("flop", 2 * 8 * 16 * 4096 * 4096 * 128)),
    ("softmax 16384x8192", softmax, {"x": (16384, 8192)}, ("bytes", 2 * 2 * 16384 * 8192)),
    ("layer_norm 16384x8192", layer_norm, {"x": (16384, 8192), "w": (8192,), "b": (8192,)},
     ("bytes", 2 * 2 * 16384 * 8192)),
    ("rms_norm 16384x8192", rms_norm, {"x": (16384, 8192), "w": (8192,)}, ("bytes", 2 * 2 * 16384 * 8192)),
    ("gelu(x)*2+y 16384x8192", gelu_scale, {"x": (16384, 8192), "y": (8192,)}, ("bytes", 2 * 2 * 16384 * 8192)),
    ("column sum 16384x8192", column_sum, {"x": (16384, 8192)}, ("bytes", 2 * 16384 * 8192)),
    ("column sum 65536x1024", column_sum, {"x": (65536, 1024)}, ("bytes", 2 * 65536 * 1024)),
    ("column sum 4096x32768", column_sum, {"x": (4096, 32768)}, ("bytes", 2 * 4096 * 32768)),
    ("column sum 1000x3000", column_sum, {"x": (1000, 3000)}, ("bytes", 2 * 1000 * 3000)),
    ("decode GQA 32/8 B=8 N=32768", gqa_decode_attention,
     {"q": (8, 8, 4, 1, 128), "k": (8, 8, 1, 32768, 128), "v": (8, 8, 1, 32768, 128)},
     ("bytes", 2 * 2 * 8 * 8 * 32768 * 128)),
    ("decode GQA 32/8 B=1 N=131072", gqa_decode_attention,
     {"q": (1, 8, 4, 1, 128), "k": (1, 8, 1, 131072, 128), "v": (1, 8, 1, 131072, 128)},
     ("bytes", 2 * 2 * 8 * 131072 * 128)),
]

#: matmuls of fp32 operands: the CUDA Tile IR backend's only (the PTX backend has no CUDA-core matmul)
FP32_CASES = [
    ("gemm 4096^3", gemm, {"a": (4096, 4096), "b": (4096, 4096)}, ("flop", 2 * 4096 ** 3)),
    ("gemm 4000x4096x1000", gemm, {"a": (4000, 1000), "b": (1000, 4096)}, ("flop", 2 * 4000 * 4096 * 1000)),
    ("gemm+bias+gelu 4096^3", gemm_bias_gelu, {"a": (4096, 4096), "b": (4096, 4096), "bias": (4096,)},
     ("flop", 2 * 4096 ** 3)),
]


def prebuild(dtype: str) -> int:
    from tessera.frontend.function import ArgSpec
    for label, fn, shapes, _ in (FP32_CASES if dtype == "fp32" else CASES):
        specs = [ArgSpec(n, s, getattr(tsr, dtype), None) for n, s in shapes.items()]
        compiled = fn.compile(specs, backend="cuda-tile")
        compiled.stage("cubin")
        print(f"{label}: {', '.join(compiled.kernel_names)} ({compiled.compile_seconds:.1f} s)", flush=True)
    return 0


def torch_reference(torch, fn, args):
    F = torch.nn.functional
    if fn is gemm:
        return lambda: args[0] @ args[1]
    if fn is gemm_bias_gelu:
        return lambda: F.gelu(args[0] @ args[1] + args[2])
    if fn is softmax:
        return lambda: torch.softmax(args[0], dim=-1)
    if fn is layer_norm:
        return lambda: F.layer_norm(args[0], (args[0].shape[-1],), args[1], args[2])
    if fn is rms_norm:
        return lambda: F.rms_norm(args[0], (args[0].shape[-1],), args[1])
    if fn is gelu_scale:
        return lambda: (F.gelu(args[0]) * 2.0 + args[1]).to(args[0].dtype)
    if fn is column_sum:
        return lambda: args[0].sum(0)
    if fn is gqa_decode_attention:
        def decode():   # (one query, the last position: the causal mask keeps every key)
            q, k, v = (x.float() for x in args)
            return torch.softmax((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), -1) @ v
        return decode
    kind = next(k for k, f in attention_cases.FUNCTIONS.items() if f is fn)
    return lambda: attention_cases.torch_reference(torch, kind, *args)


def _header(torch, triton, columns: list[str]) -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/cuda_tile.py {' '.join(sys.argv[1:])}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def _inputs(torch, shapes: dict) -> list:
    """fp32 normal inputs of `shapes`, each over the square root of its last dim (seeded)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(s, device="cuda", generator=gen) / math.sqrt(s[-1] if len(s) > 1 else 1) for s in shapes.values()]


def run(dtype: str, graphs: bool = False) -> int:
    import torch
    import triton

    def ms(f) -> float:
        if graphs:   # replays of a CUDA graph of the calls: the kernels' time without the host's
            return triton.testing.do_bench_cudagraph(f, rep=100, return_mode="median")
        return triton.testing.do_bench(f, rep=200, return_mode="median")

    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    _header(torch, triton, ["case", "dtype", "ptx ms", "cuda-tile ms", "tile/ptx", "ptx rate", "cuda-tile rate",
                            "torch ms", "max rel err"])
    for label, fn, shapes, (unit, work) in CASES:
        args = [x.to(tdtype) for x in _inputs(torch, shapes)]
        want = torch_reference(torch, fn, args)().float()
        outs, times = {}, {}
        for backend in ("ptx", "cuda-tile"):
            outs[backend] = fn(*args, backend=backend)
            times[backend] = ms(lambda: fn(*args, backend=backend))
        err = max(((o.float() - want).norm() / want.norm()).item() for o in outs.values())
        t_torch = ms(torch_reference(torch, fn, args))

        def rate(t):
            return f"{work / t / 1e9:.0f} TFLOP/s" if unit == "flop" else f"{work / t / 1e6:.0f} GB/s"
        print(f"| {label} | {dtype} | {times['ptx']:.3f} | {times['cuda-tile']:.3f} | "
              f"{times['ptx'] / times['cuda-tile']:.2f}x | {rate(times['ptx'])} | {rate(times['cuda-tile'])} | "
              f"{t_torch:.3f} | {err:.1e} |", flush=True)
    return 0


def run_fp32() -> int:
    """fp32 matmuls on the CUDA Tile IR backend (what `backend="auto"` gives them) against torch's
    fp32 matmul with TF32 off, outputs checked against float64 first."""
    import torch
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    _header(torch, triton, ["case", "dtype", "cuda-tile ms", "torch ms", "cuda-tile/torch", "cuda-tile rate",
                            "torch rate", "rel err (cuda-tile, torch)"])
    for label, fn, shapes, (_, work) in FP32_CASES:
        args = _inputs(torch, shapes)
        reference = torch_reference(torch, fn, args)
        want = torch_reference(torch, fn, [a.double() for a in args])()
        errs = [((o.double() - want).norm() / want.norm()).item() for o in (fn(*args, backend="cuda-tile"), reference())]
        ours = triton.testing.do_bench(lambda: fn(*args, backend="cuda-tile"), rep=200, return_mode="median")
        theirs = triton.testing.do_bench(reference, rep=200, return_mode="median")
        print(f"| {label} | fp32 | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f}x | {work / ours / 1e9:.1f} TFLOP/s | "
              f"{work / theirs / 1e9:.1f} TFLOP/s | {errs[0]:.1e}, {errs[1]:.1e} |", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prebuild", action="store_true", help="only assemble the cuda-tile cubins (no GPU)")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated from fp16, bf16, fp32 (default bf16)")
    parser.add_argument("--graphs", action="store_true",
                        help="time CUDA-graph replays of the calls (the kernels alone: small problems take "
                             "less GPU time than a call takes host time)")
    parser.add_argument("--filter", default="", help="only the cases whose label contains this")
    args = parser.parse_args()
    CASES[:] = [c for c in CASES if args.filter in c[0]]
    FP32_CASES[:] = [c for c in FP32_CASES if args.filter in c[0]]
    for dtype in args.dtypes.split(","):
        code = prebuild(dtype) if args.prebuild else run_fp32() if dtype == "fp32" else run(dtype, args.graphs)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
