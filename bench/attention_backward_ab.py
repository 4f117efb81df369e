"""Before and after a change to the attention backward (or a score-modified forward): the kernels
of the Tessera checkout at each ROOT, timed one after the other on the same GPU.

    python3 bench/attention_backward_ab.py [--forward] [--kinds plain,causal] [--shape B,H,S,D] [--peers] ROOT [ROOT ...]

Each ROOT (a checkout, a `git archive` or a worktree of another commit) runs in a process of its
own on the same seeded bf16 inputs: the vjp of tests/attention_cases.py's attention (`tsr.vjp`,
the forward run once before), or with `--forward` the forward alone, timed with triton's do_bench
(median ms), and each kernel's own time from torch.profiler. A printed checksum of the results
tells whether two trees compute the same. bench/RESULTS.md session 34 took its before/after
figures this way (from a scratch copy of this script, added here after the run). With `--peers`,
each ROOT's process also times SDPA's backward through cuDNN and FlashAttention-2 on the same
inputs (the vjp only: the peers' backward of one kept forward, `tessera.bench.cases.sdpa_backward`).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def time_root(root: str, kinds: list[str], shape: tuple[int, ...], forward: bool, peers: bool = False) -> None:
    """Prints each case's time with the tessera package under `root` (this process imports it)."""
    sys.path[:0] = [root, str(Path(root) / "tests")]
    import tessera as tsr
    import torch
    import triton
    from attention_cases import FUNCTIONS
    from torch.profiler import ProfilerActivity, profile

    assert Path(tsr.__file__).resolve().is_relative_to(Path(root).resolve()), tsr.__file__
    b, h, s, d = shape
    for kind in kinds:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, g = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
        if forward:
            def call():
                return (FUNCTIONS[kind](q, k, v),)
        else:
            _, f_vjp = tsr.vjp(FUNCTIONS[kind], q, k, v)

            def call():
                return f_vjp(g)
        checksum = sum(x.float().abs().sum().item() for x in call())
        ms = triton.testing.do_bench(call, rep=300, return_mode="median")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kernels.setdefault(e.name, []).append(e.device_time / 1e3)
        print(f"{root:<40} {'forward' if forward else 'backward'} {kind} {b}x{h}x{s}x{d}: {ms:.3f} ms "
              f"(checksum {checksum:.6e})", flush=True)
        for name, times in kernels.items():
            print(f"    {name[:60]:<60} {sorted(times)[len(times) // 2]:.3f} ms", flush=True)
        if peers and not forward and kind in ("plain", "causal"):   # (the kinds SDPA takes)
            from tessera.bench.cases import sdpa_backward
            for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                grad = sdpa_backward(backend, q, k, v, g, kind == "causal")
                grad()
                peer = triton.testing.do_bench(grad, rep=300, return_mode="median")
                print(f"    SDPA {backend:<20} {peer:.3f} ms: Tessera {peer / ms:.3f}x", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+")
    parser.add_argument("--kinds", default="plain,causal")
    parser.add_argument("--shape", default="8,16,4096,128")
    parser.add_argument("--forward", action="store_true", help="time the forward instead of the vjp")
    parser.add_argument("--peers", action="store_true", help="also time SDPA's cuDNN and FlashAttention-2 "
                        "backwards (plain and causal kinds)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds, shape = args.kinds.split(","), tuple(int(n) for n in args.shape.split(","))
    if args.one:
        time_root(args.roots[0], kinds, shape, args.forward, args.peers)
        return 0
    flags = ["--kinds", args.kinds, "--shape", args.shape] + (["--forward"] if args.forward else []) + \
        (["--peers"] if args.peers else [])
    return max(subprocess.call([sys.executable, __file__, "--one", *flags, root]) for root in args.roots)


if __name__ == "__main__":
    sys.exit(main())
