"""Tensor parallelism (issue 19): a Llama-style block (examples/llama_block.py) sharded with
`tessera.distributed` against torch's DTensor tensor parallelism of the same block, on every
visible GPU (one process each, NCCL).

    python3 bench/tensor_parallel.py [--gpus N] [--batch 4] [--seq 2048]

The block is Llama-3-8B's (d_model 4096, 32 heads of 128, SwiGLU hidden 14336, no rotary positions),
bf16. Configs:
- "tp": heads and the MLP's hidden dim split (Megatron-LM's layout): Tessera derives an all-reduce
  after each of the two output projections; torch: `parallelize_module` with ColwiseParallel and
  RowwiseParallel (torchtitan's plan).
- "tp+sp": with sequence parallelism along S: Tessera's `shard(..., sequence="S")` derives
  reduce-scatters and all-gathers with the norms and residuals on 1/tp of the rows; torch: the
  same plan with SequenceParallel norms and PrepareModuleInput (torchtitan's).
- torch's compiled column: `torch.compile` of the DTensor block, with Inductor's async tensor
  parallelism (`_micro_pipeline_tp`, symmetric memory) under sequence parallelism.
- "mlp 4 chunks": the SwiGLU MLP alone, its all-reduce overlapped with its kernels in 4 chunks of
  tokens, against the same call unchunked.

Per config and pass (forward; forward + backward with every weight's gradient): Tessera's step,
torch's, the communication alone (the collectives Tessera's plan runs, `ShardedFunction.communication`,
on tensors of their shapes), Tessera's compute alone (the step with each collective replaced by a
local stand-in of its result's shape), and hidden = (compute + communication - step) /
communication, the share of the communication the step did not pay for. Medians of CUDA-event
times on rank 0, each step after a barrier; outputs checked against torch's first.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.distributed import DeviceMesh, collectives, shard  # noqa: E402
from llama_block import llama_block  # noqa: E402

MODEL, HEADS, HEAD_DIM, HIDDEN, EPS = 4096, 32, 128, 14336, 1e-5


@tsr.function
def swiglu(x: Tensor["N", "C"], wg: Tensor["C", "F"], wu: Tensor["C", "F"], wd: Tensor["F", "C"]):
    return tsr.matmul(tsr.silu(tsr.matmul(x, wg)) * tsr.matmul(x, wu), wd)


# --- torch's side: torchtitan's module layout and plans -------------------------------------------

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(MODEL, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(HEADS * HEAD_DIM, MODEL, bias=False)

    def forward(self, h):
        b, s = h.shape[0], h.shape[1]

        def heads(t):
            return t.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(heads(self.wq(h)), heads(self.wk(h)), heads(self.wv(h)),
                                                       is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(MODEL, HIDDEN, bias=False), nn.Linear(MODEL, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, MODEL, bias=False)

    def forward(self, h):
        return self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(MODEL, eps=EPS), nn.RMSNorm(MODEL, eps=EPS)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def torch_plan(sequence: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": row, "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel()}
    if sequence:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": gather, "feed_forward": PrepareModuleInput(
                         input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    return plan


def torch_block(weights: list, mesh, sequence: bool) -> nn.Module:
    """torch's Block holding the whole weights (Tessera's [in, out] transposed), then parallelized."""
    from torch.distributed.tensor.parallel import parallelize_module

    attn_norm, wq, wk, wv, wo, mlp_norm, wg, wu, wd = [w.detach() for w in weights]
    block = Block().to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for param, w in [(block.attention_norm.weight, attn_norm), (block.attention.wq.weight, wq.T),
                         (block.attention.wk.weight, wk.T), (block.attention.wv.weight, wv.T),
                         (block.attention.wo.weight, wo.T), (block.ffn_norm.weight, mlp_norm),
                         (block.feed_forward.w1.weight, wg.T), (block.feed_forward.w3.weight, wu.T),
                         (block.feed_forward.w2.weight, wd.T)]:
            param.copy_(w)
    return parallelize_module(block, mesh, torch_plan(sequence))


# --- timing -----------------------------------------------------------------------------------------

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


def communication_ms(transfers, mesh, phases) -> float:
    """The plan's collectives alone, on fresh tensors of their shapes."""
    from tessera.runtime.interop import torch_dtype
    buffers = [(t, torch.randn(t.shape, device="cuda").to(torch_dtype(t.dtype))) for t in transfers
               if t.phase in phases]
    if not buffers:
        return 0.0

    def run():
        for t, x in buffers:
            collectives.run(x, t.kind, t.dim, tuple(mesh.group(a) for a in t.axes), in_place=True)
    return median_ms(run)


@contextlib.contextmanager
def without_communication():
    """Each collective replaced by a local stand-in with its result's shape (the compute alone)."""
    def local(x, kind, dim, groups, *rest, **kw):
        n = dist.get_world_size(groups[0]) if groups else 1
        if kind == "reduce_scatter" or kind == "split":
            return x.narrow(dim, 0, x.shape[dim] // n).contiguous()
        if kind == "all_gather":
            return torch.cat([x] * n, dim=dim)
        return x.clone() if kind == "all_reduce" else x

    def local_async(x, groups, pending, training):
        return x.clone()
    kept = collectives.run, collectives.all_reduce_async
    collectives.run, collectives.all_reduce_async = local, local_async
    try:
        yield
    finally:
        collectives.run, collectives.all_reduce_async = kept


def rel_err(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


# --- the job ----------------------------------------------------------------------------------------

def compiled_reference(reference, mesh, sequence: bool):
    """torch.compile of the DTensor block; with sequence parallelism, Inductor's async tensor
    parallelism (all-gather and reduce-scatter decomposed and overlapped with the matmuls through
    symmetric memory: `_micro_pipeline_tp`)."""
    import torch._inductor.config as inductor

    if sequence:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(mesh.get_group().group_name)
        inductor._micro_pipeline_tp = True
    else:
        inductor._micro_pipeline_tp = False
    torch._dynamo.reset()
    return torch.compile(reference, fullgraph=True)


def rank_main(rank: int, world: int, port: int, batch: int, seq: int, configs: set[str], chunks: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    mesh = DeviceMesh("cuda", (world,), ("tp",))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    q = HEADS * HEAD_DIM
    weights = [1.0 + rand(MODEL, scale=0.1), rand(MODEL, q, scale=MODEL ** -0.5), rand(MODEL, q, scale=MODEL ** -0.5),
               rand(MODEL, q, scale=MODEL ** -0.5), rand(q, MODEL, scale=q ** -0.5), 1.0 + rand(MODEL, scale=0.1),
               rand(MODEL, HIDDEN, scale=MODEL ** -0.5), rand(MODEL, HIDDEN, scale=MODEL ** -0.5),
               rand(HIDDEN, MODEL, scale=HIDDEN ** -0.5)]
    weights = [w.detach().requires_grad_() for w in weights]
    x = rand(batch, seq, MODEL)
    if rank == 0:
        print(f"# {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"# python3 bench/tensor_parallel.py --gpus {world} --batch {batch} --seq {seq}")
        print(f"# Llama-style block: B={batch} S={seq} d_model={MODEL} heads={HEADS}x{HEAD_DIM} hidden={HIDDEN}, bf16")
        print("| config | pass | tessera ms | torch DTensor ms | torch compiled ms | vs best torch | communication ms | "
              "tessera compute ms | hidden | rel err vs torch |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for config, sequence in (("tp", None), ("tp+sp", "S")):
        if config not in configs:
            continue
        sharded = shard(llama_block, mesh, {"Q": "tp", "F": "tp"}, sequence=sequence, chunks=chunks)
        args = [a.detach().requires_grad_() for a in sharded.local(x, *weights)]
        reference = torch_block(weights, mesh.torch_mesh, sequence is not None)
        x_torch = args[0].detach().requires_grad_()
        ours, want = sharded(*args, HEAD_DIM, EPS), reference(x_torch)
        err = rel_err(ours, want)
        if rank == 0:
            print(f"# {sharded.report(*args, HEAD_DIM, EPS)}".replace("\n", "\n# "), flush=True)
        cotangent = torch.randn_like(ours)
        transfers = sharded.communication(*args, HEAD_DIM, EPS)
        try:
            compiled = compiled_reference(reference, mesh.torch_mesh, sequence is not None)
            compiled_err = rel_err(compiled(x_torch), want)
        except Exception as e:   # noqa: BLE001  a peer that cannot run here is reported, not fatal
            compiled = None
            if rank == 0:
                print(f"# torch.compile of the DTensor block failed: {type(e).__name__}: {str(e)[:300]}")
        for backward in (False, True):
            t_ours = median_ms(step(lambda *a: sharded(*a, HEAD_DIM, EPS), args, cotangent, backward))
            t_torch = median_ms(step(reference, [x_torch], cotangent, backward))
            t_compiled = median_ms(step(compiled, [x_torch], cotangent, backward)) if compiled is not None else float("nan")
            comm = communication_ms(transfers, mesh, {"forward", "backward"} if backward else {"forward"})
            with without_communication():
                compute = median_ms(step(lambda *a: sharded(*a, HEAD_DIM, EPS), args, cotangent, backward))
            hidden = (compute + comm - t_ours) / comm if comm else 0.0
            if rank == 0:
                best = min(t_torch, t_compiled) if compiled is not None else t_torch
                errs = f"{err:.1e}" + (f" ({compiled_err:.1e} compiled)" if compiled is not None else "")
                print(f"| {config}{f' {chunks} chunks' if chunks > 1 else ''} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{t_ours:.2f} | {t_torch:.2f} | {t_compiled:.2f} | {best / t_ours:.2f}x | {comm:.2f} | "
                      f"{compute:.2f} | {max(hidden, 0.0):.0%} | {errs} |", flush=True)
        del reference, compiled
    if "mlp" in configs:
        mlp_overlap(mesh, rank, batch * seq)
    dist.destroy_process_group()


def mlp_overlap(mesh, rank: int, tokens: int) -> None:
    """The SwiGLU MLP alone (hidden dim split): in 4 chunks of tokens, each chunk's all-reduce
    overlapping the next chunk's kernels, against the same call unchunked."""
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    whole = [rand(tokens, MODEL), rand(MODEL, HIDDEN, scale=MODEL ** -0.5), rand(MODEL, HIDDEN, scale=MODEL ** -0.5),
             rand(HIDDEN, MODEL, scale=HIDDEN ** -0.5)]
    chunked, serial = shard(swiglu, mesh, {"F": "tp"}, chunks=4), shard(swiglu, mesh, {"F": "tp"})
    args = [a.detach().requires_grad_() for a in chunked.local(*whole)]
    err = rel_err(chunked(*args), serial(*args))
    if rank == 0:
        print(f"# {chunked.report(*args)}".replace("\n", "\n# "), flush=True)
    cotangent = torch.randn(tokens, MODEL, device="cuda", dtype=torch.bfloat16)
    transfers = serial.communication(*args)
    for backward in (False, True):
        t_chunked = median_ms(step(chunked, args, cotangent, backward))
        t_serial = median_ms(step(serial, args, cotangent, backward))
        comm = communication_ms(transfers, mesh, {"forward", "backward"} if backward else {"forward"})
        with without_communication():
            compute = median_ms(step(chunked, args, cotangent, backward))
        hidden = (compute + comm - t_chunked) / comm if comm else 0.0
        if rank == 0:
            print(f"| mlp 4 chunks | {'fwd+bwd' if backward else 'fwd'} | {t_chunked:.2f} | - | "
                  f"{t_serial / t_chunked:.2f}x unchunked ({t_serial:.2f}) | {comm:.2f} | {compute:.2f} | "
                  f"{max(hidden, 0.0):.0%} | {err:.1e} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--configs", default="tp,tp+sp,mlp", help="which of tp, tp+sp, mlp to run")
    parser.add_argument("--chunks", type=int, default=1, help="shard(..., chunks=) for the block")
    args = parser.parse_args()
    if args.gpus < 2:
        print(f"(tensor parallelism needs 2 or more GPUs; {args.gpus} visible)")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(rank_main, args=(args.gpus, port, args.batch, args.seq, set(args.configs.split(",")),
                                             args.chunks), nprocs=args.gpus, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
