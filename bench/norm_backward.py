"""LayerNorm and RMSNorm backward (issue 14): Tessera's generated backward against torch's, and
against the copy bandwidth over the bytes the backward must move.

    python3 bench/norm_backward.py

Tessera's is the vjp of the norm written with tsr.layer_norm / tsr.rms_norm (with a weight, and
a bias for layer_norm), timed alone (the forward ran once before); torch's is torch.autograd.grad
of F.layer_norm / F.rms_norm kept from one forward. The bytes a backward must move: read x and
dy, write dx (3 M x N), plus the weight and its gradient (and the bias's). The copy bandwidth is a
device-to-device copy of an M x N tensor (2 M x N bytes moved) on the same GPU. Gradients are
checked against torch's first. Medians of triton's do_bench, in ms.

    python3 bench/norm_backward.py [--shapes 16384x8192,...] [--kernels] [--sweep]

`--kernels` adds each kernel's median time (torch.profiler, us); `--sweep` the backward's speed
with the row walk's schedule pinned (warps w, stages s, programs p: `tsr.function(space=...)`), of
the copy bandwidth, each checked against the default's gradients. Before/after across checkouts:
run each checkout's own copy of this script (it imports the Tessera beside it), alternating.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

import tessera as tsr  # noqa: E402
from tessera.bench.cases import layer_norm, rms_norm  # noqa: E402  (eps 1e-5 and 1e-6)

SHAPES = [(16384, 8192), (4096, 32768), (65536, 1024), (32768, 4096)]
#: the row walk's pins `--sweep` times: warps, stages, programs an SM
PINS = list(itertools.product([4, 8, 16], [1, 2, 3], [1, 2, 3]))


def ms(fn) -> float:
    return triton.testing.do_bench(fn, rep=100, return_mode="median")


def kernel_times(fn) -> str:
    """Each kernel's median over 10 calls of `fn` (torch.profiler), in us."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            times.setdefault(event.name, []).append(event.device_time)
    return ", ".join(f"{name.split('_vjp_')[-1]} {sorted(v)[len(v) // 2]:.1f}" for name, v in times.items())


def sweep(fn, inputs, dy, ours, moved: int, copy_gbs: float) -> str:
    """The backward with each of PINS pinned, of the copy bandwidth (gradients checked against `ours`)."""
    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for warps, stages, per_sm in PINS:
        pinned = tsr.function(fn.fn, space={"num_warps": [warps], "num_stages": [stages], "programs": [sms * per_sm]})
        _, f_vjp = tsr.vjp(pinned, *inputs)
        got = f_vjp(dy)
        err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ours))
        if err > 1e-2:
            raise AssertionError(f"w{warps}s{stages}p{sms * per_sm}: gradients {err:.1e} from the default's")
        out.append(f"w{warps}s{stages}p{sms * per_sm} {moved / ms(lambda: f_vjp(dy)) / 1e6 / copy_gbs:.3f}")
    return " ".join(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"# python3 bench/norm_backward.py {' '.join(sys.argv[1:])}")
    extra = (["kernels (us)"] if args.kernels else []) + (["pinned: vs copy"] if args.sweep else [])
    print("| norm | shape | dtype | tessera ms | GB/s | vs copy | torch ms | vs torch | max rel err |"
          + "".join(f" {column} |" for column in extra))
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra))
    for m, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
        b = (0.1 * torch.randn(n, device="cuda", generator=gen)).to(torch.bfloat16)
        copy_dst = torch.empty_like(x)
        copy_gbs = 2 * x.numel() * x.element_size() / ms(lambda: copy_dst.copy_(x)) / 1e6
        for name, fn, params in (("rms_norm", rms_norm, [w]), ("layer_norm", layer_norm, [w, b])):
            _, f_vjp = tsr.vjp(fn, x, *params)
            ours = f_vjp(dy)
            leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
            if name == "rms_norm":
                out = torch.nn.functional.rms_norm(leaves[0], (n,), leaves[1], 1e-6)
            else:
                out = torch.nn.functional.layer_norm(leaves[0], (n,), leaves[1], leaves[2], 1e-5)
            want = torch.autograd.grad(out, leaves, dy, retain_graph=True)
            err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(ours, want))
            t_ours = ms(lambda: f_vjp(dy))
            t_torch = ms(lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True))
            moved = (3 * m * n + 2 * len(params) * n) * x.element_size()
            gbs = moved / t_ours / 1e6
            columns = ([kernel_times(lambda: f_vjp(dy))] if args.kernels else []) + \
                ([sweep(fn, [x, *params], dy, ours, moved, copy_gbs)] if args.sweep else [])
            print(f"| {name} | {m}x{n} | bf16 | {t_ours:.3f} | {gbs:.0f} | {gbs / copy_gbs:.2f}x | {t_torch:.3f} | "
                  f"{t_torch / t_ours:.2f}x | {err:.1e} |" + "".join(f" {c} |" for c in columns), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
