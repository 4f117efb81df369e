"""Tensor parallelism (issue 19): a Llama-style MLP and attention sharded with `tessera.distributed`
against the same sharding written by hand in torch (Megatron-LM's layout), on every visible GPU.

    python3 bench/tensor_parallel.py [--gpus N]     # one process per GPU, NCCL

The SwiGLU MLP's hidden dim F is split (column- then row-parallel: one all-reduce of the output,
which Tessera derives from the function's math); attention's heads are split (no communication).
Per step (forward, then forward + backward): Tessera sharded with its all-reduce overlapped (the
call split into 4 chunks along the token dim, each chunk's all-reduce running while the next
chunk's kernels do: `ShardedFunction.report`) and without (the default), torch eager sharded (its
matmuls, F.silu and SDPA on the same shards, `dist.all_reduce` where Megatron puts it), and the
all-reduce alone; "hidden" is the share of the all-reduce's time the overlap saved. Medians of
CUDA-event times on rank 0, after a barrier; outputs checked against torch's first.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.distributed import DeviceMesh, shard  # noqa: E402
from tessera.distributed.sharded import _autograd  # noqa: E402  Megatron's f and g, for torch's side

TOKENS, MODEL, HIDDEN = 8192, 4096, 14336          # Llama-3-8B's MLP on 4 x 2048 tokens
B, H, S, D = 4, 32, 2048, 128                       # its attention


@tsr.function
def swiglu(x: Tensor["N", "C"], wg: Tensor["C", "F"], wu: Tensor["C", "F"], wd: Tensor["F", "C"]):
    return tsr.matmul(tsr.silu(tsr.matmul(x, wg)) * tsr.matmul(x, wu), wd)


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= j[None, :], s, -math.inf), dim=-1), v)


def torch_swiglu(x, wg, wu, wd):
    """Megatron-LM's MLP: x's gradient all-reduced in the backward (f), the output in the forward (g)."""
    f, g = _autograd()[1], _autograd()[0]
    x = f.apply(x, (None,))
    return g.apply((torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd, (None,))


def torch_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def median_ms(fn, steps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step(fn, args, cotangent, backward: bool):
    def run():
        out = fn(*args)
        if backward:
            out.backward(cotangent)
    return run


def rank_main(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    mesh = DeviceMesh("cuda", (world,), ("tp",))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    cases = {
        "swiglu F/tp": (swiglu, torch_swiglu, {"F": "tp"},
                        [rand(TOKENS, MODEL), rand(MODEL, HIDDEN, scale=MODEL ** -0.5),
                         rand(MODEL, HIDDEN, scale=MODEL ** -0.5), rand(HIDDEN, MODEL, scale=HIDDEN ** -0.5)]),
        "attention H/tp": (attention, torch_attention, {"H": "tp"}, [rand(B, H, S, D) for _ in range(3)]),
    }
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL")
        print(f"# python3 bench/tensor_parallel.py --gpus {world}")
        print("| case | pass | tessera ms | not overlapped ms | torch ms | vs torch | all-reduce ms | hidden | "
              "max rel err |")
        print("|---|---|---|---|---|---|---|---|---|")
    for name, (fn, reference, sharding, whole) in cases.items():
        sharded, serial = shard(fn, mesh, sharding, chunks=4), shard(fn, mesh, sharding)
        args = [x.detach().requires_grad_() for x in sharded.local(*whole)]
        if rank == 0:
            print(f"# {sharded.report(*args)}".replace("\n", "\n# "))
        ours, want = sharded(*args), reference(*args)
        err = ((ours.float() - want.float()).norm() / want.float().norm()).item()
        cotangent = torch.randn_like(ours)
        comm = median_ms(lambda: dist.all_reduce(want.detach().clone())) if sharded.placements(*args)[0].partial \
            else 0.0
        for backward in (False, True):
            t_ours = median_ms(step(sharded, args, cotangent, backward))
            t_serial = median_ms(step(serial, args, cotangent, backward))
            t_torch = median_ms(step(reference, args, cotangent, backward))
            hidden = f"{max(0.0, (t_serial - t_ours) / comm):.0%}" if comm else "-"
            if rank == 0:
                print(f"| {name} | {'fwd+bwd' if backward else 'fwd'} | {t_ours:.2f} | {t_serial:.2f} | {t_torch:.2f} | "
                      f"{t_torch / t_ours:.2f}x | {comm:.2f} | {hidden} | {err:.1e} |", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args.gpus, port), nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
