"""Tessera against its peers, in one process, on one GPU, on the same inputs.

    python3 bench/run_all.py [--quick] [--out DIR]

Peers: torch SDPA (flash and cuDNN backends), torch.matmul (cuBLAS),
torch layer_norm and softmax; for the mma.sync GEMM also Triton's matmul
compiled to mma.sync (bench/triton_mma_sync.py), at its fastest tiling. Each case first checks Tessera's output against
the peer (a wrong kernel gets no timing), then times both with
triton.testing.do_bench (median of many runs, L2 flushed between runs).
`ratio` is peer time / Tessera time: above 1 means Tessera is faster.
Attention at S = 4096 and 8192 keeps B * S = 32 * 2048 tokens. GEMM and
attention run on both code paths: "(native)" is what a plain call runs (on
an H100/H200: TMA + wgmma), "(ampere)" the mma.sync + cp.async path.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from triton_mma_sync import best_triton_matmul  # noqa: I001 (before triton: it sets DISABLE_MMA_V3)
import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * scale, dim=-1), v)


@tsr.function
def causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def bench_attention(rows, quick: bool):
    """The native path (what a plain call runs) against SDPA's flash and cuDNN backends, and the
    mma.sync path against flash (FA2, itself an mma.sync kernel)."""
    from torch.nn.attention import SDPBackend
    peers = {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    lengths = [2048] if quick else [2048, 4096, 8192]
    for s in lengths:
        for causal in (False, True):
            b, h, d = max(1, 32 * 2048 // s), 12, 128
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
            fn = causal_attention if causal else attention
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            for path, against in (("native", peers), ("ampere", {"sdpa-flash": peers["sdpa-flash"]})):
                ours = on_path(fn, path, dict(B=b, H=h, S=s, D=d), "fp16")
                out = ours(q, k, v)
                for name, peer in against.items():
                    try:
                        ref = peer(q, k, v, causal)
                    except RuntimeError as e:
                        print(f"  {name} unavailable: {str(e).splitlines()[0]}")
                        continue
                    err = rel_err(out, ref)
                    case = f"attention B={b} H={h} S={s} D={d} fp16{' causal' if causal else ''} ({path})"
                    if err > 1e-2:
                        rows.append(dict(case=case, peer=name, error=err, note="WRONG: not timed"))
                        continue
                    t_ms = median_ms(lambda: ours(q, k, v))
                    p_ms = median_ms(lambda: peer(q, k, v, causal))
                    rows.append(dict(case=case, peer=name, tessera_ms=t_ms, peer_ms=p_ms, ratio=p_ms / t_ms,
                                     tessera_rate=flops / t_ms / 1e9, peer_rate=flops / p_ms / 1e9, unit="TFLOP/s",
                                     error=err))


def on_path(fn, path: str, dims: dict[str, int], dtype: str, space: dict | None = None):
    """`fn` compiled for `dims` on one code path ("native": what a plain call runs; "ampere": the
    mma.sync + cp.async path), with the schedule `space` pins if given, as a callable returning its
    one output."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=platform.arch, sm_count=platform.sm_count, path=path,
                          **({"space": space} if space else {}))
    program = compiled.gpu_program(0)
    return lambda *xs: program(*xs)[0]


def bench_gemm(rows, quick: bool):
    """Both code paths against cuBLAS: the native one (TMA + wgmma on Hopper) and mma.sync; the
    mma.sync one also against Triton's matmul on the same instructions."""
    sizes = [4096] if quick else [4096, 8192]
    for n in sizes:
        for dt, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            a, b = torch.randn(n, n, device="cuda", dtype=dt), torch.randn(n, n, device="cuda", dtype=dt)
            ref = torch.matmul(a, b)
            for path in ("native", "ampere"):
                ours = on_path(gemm, path, dict(M=n, K=n, N=n), name)
                case = f"gemm {n}^3 {name} ({path})"
                err = rel_err(ours(a, b), ref)
                if err > 1e-2:
                    rows.append(dict(case=case, peer="torch.matmul", error=err, note="WRONG: not timed"))
                    continue
                t_ms = median_ms(lambda: ours(a, b))
                peers = {"torch.matmul": median_ms(lambda: torch.matmul(a, b))}
                if path == "ampere":
                    peers["triton mma.sync"] = best_triton_matmul(a, b, ref, rel_err, median_ms)[0]
                flops = 2 * n ** 3
                for peer, p_ms in peers.items():
                    rows.append(dict(case=case, peer=peer, tessera_ms=t_ms, peer_ms=p_ms, ratio=p_ms / t_ms,
                                     tessera_rate=flops / t_ms / 1e9, peer_rate=flops / p_ms / 1e9,
                                     unit="TFLOP/s", error=err))


def bench_call_overhead(rows, calls: int = 2000):
    """Host time per call (the GPU work is negligible): a 64 x 256 layer_norm called back to back,
    wall clock over `calls` calls, synchronised at the end. What a small kernel costs end to end."""
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    w, b = torch.randn(256, device="cuda", dtype=torch.float16), torch.randn(256, device="cuda", dtype=torch.float16)

    def per_call_us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6
    t_us = per_call_us(lambda: layer_norm(x, w, b))
    p_us = per_call_us(lambda: torch.nn.functional.layer_norm(x, (256,), w, b))
    rows.append(dict(case="call overhead: layer_norm 64x256 fp16", peer="torch.layer_norm", tessera_ms=t_us / 1e3,
                     peer_ms=p_us / 1e3, ratio=p_us / t_us, tessera_rate=t_us, peer_rate=p_us, unit="us/call",
                     error=rel_err(layer_norm(x, w, b), torch.nn.functional.layer_norm(x, (256,), w, b))))


def copy_bandwidth() -> float:
    """The device's measured memory ceiling: a large device-to-device copy, bytes read + written."""
    x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def bench_rows(rows, quick: bool, ceiling_gbs: float):
    m, n = (4096, 8192) if quick else (16384, 8192)
    x = torch.randn(m, n, device="cuda", dtype=torch.float16)
    w, b = torch.randn(n, device="cuda", dtype=torch.float16), torch.randn(n, device="cuda", dtype=torch.float16)
    cases = [
        ("layer_norm", lambda: layer_norm(x, w, b), lambda: torch.nn.functional.layer_norm(x, (n,), w, b)),
        ("softmax", lambda: softmax(x), lambda: torch.softmax(x, dim=-1)),
    ]
    moved = 2 * x.numel() * x.element_size()
    for name, ours, peer in cases:
        err = rel_err(ours(), peer())
        case = f"{name} {m}x{n} fp16"
        if err > 1e-2:
            rows.append(dict(case=case, peer=f"torch.{name}", error=err, note="WRONG: not timed"))
            continue
        t_ms, p_ms = median_ms(ours), median_ms(peer)
        rows.append(dict(case=case, peer=f"torch.{name}", tessera_ms=t_ms, peer_ms=p_ms, ratio=p_ms / t_ms,
                         tessera_rate=moved / t_ms / 1e6, peer_rate=moved / p_ms / 1e6, unit="GB/s", error=err,
                         of_copy_bw=moved / t_ms / 1e6 / ceiling_gbs))


def table(rows) -> str:
    head = f"| {'case':53} | {'peer':15} | {'tessera ms':>10} | {'peer ms':>9} | {'ratio':>6} | {'tessera':>9} | {'peer':>9} | unit    | rel err |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        if "tessera_ms" not in r:
            lines.append(f"| {r['case']:53} | {r['peer']:15} | {r.get('note', ''):>10} | | | | | | {r['error']:.1e} |")
            continue
        lines.append(f"| {r['case']:53} | {r['peer']:15} | {r['tessera_ms']:10.3f} | {r['peer_ms']:9.3f} | "
                     f"{r['ratio']:6.2f} | {r['tessera_rate']:9.1f} | {r['peer_rate']:9.1f} | {r['unit']:7} | "
                     f"{r['error']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one size per kind")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = parser.parse_args(argv)
    device = torch.cuda.get_device_name()
    start = time.time()
    ceiling = copy_bandwidth()
    rows: list[dict] = []
    bench_rows(rows, args.quick, ceiling)
    bench_call_overhead(rows)
    bench_gemm(rows, args.quick)
    bench_attention(rows, args.quick)
    report = (f"device: {device}; torch {torch.__version__}; python {platform.python_version()}; "
              f"copy bandwidth {ceiling:.0f} GB/s; {time.strftime('%Y-%m-%d')}\n"
              f"command: python3 bench/run_all.py{' --quick' if args.quick else ''}\n\n{table(rows)}\n")
    print(report)
    print(f"({time.time() - start:.0f} s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report)
    (out / "bench.json").write_text(json.dumps(dict(device=device, copy_gbs=ceiling, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
