"""Attention over few heads (issue 15, item 2): grids of a few waves, where the schedule decides
whether every SM has work to the end. Tessera against torch SDPA (cuDNN, FlashAttention-2) and,
for the soft-capped causal attention, FlexAttention with the same score_mod.

    python3 bench/attention_small_grids.py [--dtypes bf16,fp16] [--space heavy_first=0,block_m=128]

The attention functions of tests/attention_cases.py as written (plain, causal, tanh soft-capped
causal), one process, the same inputs for every peer, each output checked against an fp32 torch
reference first. `--space` pins schedule params in every Tessera run (heavy_first=0,block_m=128 is
the schedule these shapes had before `fusion._schedule_few_heads`). The better of two medians of
triton's do_bench, in ms; TFLOP/s counts 4 B H S^2 D (half for causal); "vs best" is the best peer's time over
Tessera's (above 1: Tessera faster). The last shape, 128 heads, is the control the rule leaves alone.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import tessera as tsr  # noqa: E402
from activations import flex_softcap  # noqa: E402
from attention_cases import FUNCTIONS, torch_reference  # noqa: E402
from tessera.bench.timing import rel_err  # noqa: E402

SHAPES = [(3, 5, 1531, 128), (1, 8, 4096, 128), (2, 8, 4096, 128), (1, 16, 8192, 128), (4, 8, 2048, 64),
          (8, 16, 4096, 128)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ms(fn) -> float:
    """The better of two do_bench medians: these kernels take tens of microseconds, and the first
    run after a compile can catch the GPU's clocks still rising."""
    return min(triton.testing.do_bench(fn, rep=100, return_mode="median") for _ in range(2))


def sdpa(backend, q, k, v, causal: bool):
    from torch.nn.attention import sdpa_kernel

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def schedule_of(fn, dims: dict, dtype: str) -> str:
    """The attention kernel's block_m and heavy_first, as this GPU's compile derives them."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=platform.arch, sm_count=platform.sm_count,
                          **({"space": fn.space} if fn.space else {}))
    host = next(iter(compiled.modules["schedule"].ops))
    (kernel,) = (op for op in host.body.block.ops if op.name == "schedule.kernel")
    p = kernel.param_values
    return f"{p['block_m']}/{p['heavy_first']}"


def peers(kind: str, q, k, v) -> dict:
    if kind == "softcap_causal":
        flex = flex_softcap(q, k, v)
        return {"flex": flex} if flex is not None else {}
    backends = torch.nn.attention.SDPBackend
    return {"cudnn": sdpa(backends.CUDNN_ATTENTION, q, k, v, kind == "causal"),
            "flash": sdpa(backends.FLASH_ATTENTION, q, k, v, kind == "causal")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--space", default="", help="schedule params pinned in every Tessera run")
    args = parser.parse_args()
    space = {k: [int(v)] for k, v in (item.split("=") for item in args.space.split(",") if item)}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/attention_small_grids.py {' '.join(sys.argv[1:])}")
    print("| kind | B x H x S x D | dtype | block_m/heavy_first | tessera ms | TFLOP/s | cudnn | flash | flex "
          "| vs best | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    status = 0
    warm = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ms(lambda: warm @ warm)   # the clocks up before the first case, whose kernels take tens of microseconds
    for dtype in args.dtypes.split(","):
        for b, h, s, d in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).to(DTYPES[dtype]) for _ in range(3))
            for kind in ("causal", "softcap_causal", "plain"):
                fn = FUNCTIONS[kind]
                fn = tsr.function(fn.fn, space=space) if space else fn
                dims = dict(B=b, H=h, M=s, N=s, D=d) if kind == "plain" else dict(B=b, H=h, S=s, D=d)
                err = rel_err(fn(q, k, v), torch_reference(torch, kind, q.float(), k.float(), v.float()))
                if err > 2e-2:
                    status = 1
                t = ms(lambda: fn(q, k, v))
                times = {}
                for name, peer in peers(kind, q, k, v).items():
                    peer()
                    times[name] = ms(peer)
                flops = 4 * b * h * s * s * d / (1 if kind == "plain" else 2)
                best = min(times.values(), default=None)
                cells = " | ".join(f"{times[p]:.3f}" if p in times else "-" for p in ("cudnn", "flash", "flex"))
                print(f"| {kind} | {b}x{h}x{s}x{d} | {dtype} | {schedule_of(fn, dims, dtype)} | {t:.3f} "
                      f"| {flops / t / 1e9:.0f} | {cells} | {f'{best / t:.2f}x' if best else '-'} | {err:.1e} |",
                      flush=True)
            del q, k, v
    return status


if __name__ == "__main__":
    sys.exit(main())
