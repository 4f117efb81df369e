"""What each rank of a sharded test job runs (tests/distributed/test_gloo.py on the CPU with gloo,
tests/gpu/test_distributed_gpu.py on GPUs with NCCL): a sharded function's results and gradients
on this rank's shards against the same function run whole, on the same inputs (every rank makes
them from one seed), then cut to this rank's shards."""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import tessera as tsr
from tessera import Tensor
from tessera.distributed import DeviceMesh, shard
from tessera.distributed import sharded as sharded_module

from llama_block import llama_block


@tsr.function
def mlp(x: Tensor["N", "C"], w1: Tensor["C", "F"], b1: Tensor["F"], w2: Tensor["F", "C"]):
    return tsr.matmul(tsr.gelu(tsr.matmul(x, w1) + b1), w2)


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= j[None, :], s, -math.inf), dim=-1), v)


@tsr.function
def mlp_then_gelu(x: Tensor["N", "C"], w1: Tensor["C", "F"], b1: Tensor["F"], w2: Tensor["F", "C"]):
    """A row-parallel output read by a nonlinearity: its all-reduce goes inside the function."""
    return tsr.gelu(mlp.fn(x, w1, b1, w2))


@dataclass(frozen=True)
class Case:
    fn: object
    dims: dict            # the whole tensors' dim sizes
    sharding: dict        # shard's dims
    sequence: str | None = None
    constants: tuple = ()   # the function's non-tensor arguments
    chunks: int = 1
    mesh: tuple = ()        # ((axis, size), ...) for a mesh of several dims; else 1-D over every rank


BLOCK = {"B": 2, "S": 12, "C": 16, "Q": 32, "F": 24}   # 4 heads of 8
CASES = {
    "mlp-tp": Case(mlp, {"N": 37, "C": 32, "F": 64}, {"F": "tp"}),
    "mlp-tp-overlap": Case(mlp, {"N": 40, "C": 32, "F": 64}, {"F": "tp"}, chunks=4),   # all-reduces overlapped
    "mlp-dp": Case(mlp, {"N": 44, "C": 32, "F": 64}, {"N": "dp"}),
    "mlp-gelu-tp": Case(mlp_then_gelu, {"N": 13, "C": 16, "F": 32}, {"F": "tp"}),
    "mlp-gelu-sp": Case(mlp_then_gelu, {"N": 20, "C": 16, "F": 32}, {"F": "tp"}, sequence="N"),
    "attention-heads": Case(attention, {"B": 1, "H": 4, "S": 33, "D": 16}, {"H": "tp"}),
    "block-tp": Case(llama_block, BLOCK, {"Q": "tp", "F": "tp"}, constants=(8, 1e-5)),
    "block-sp": Case(llama_block, BLOCK, {"Q": "tp", "F": "tp"}, sequence="S", constants=(8, 1e-5)),
    # 2 x 2 meshes: data parallel over dp, tensor (and sequence) parallel over tp
    "mlp-dp-tp": Case(mlp, {"N": 22, "C": 16, "F": 32}, {"N": "dp", "F": "tp"}, mesh=(("dp", 2), ("tp", 2))),
    "block-dp-sp": Case(llama_block, BLOCK, {"B": "dp", "Q": "tp", "F": "tp"}, sequence=("S", "tp"),
                        constants=(8, 1e-5), mesh=(("dp", 2), ("tp", 2))),
}


def cases_for(world: int) -> list[str]:
    """The cases a job of `world` ranks runs: the 1-D ones, and those whose mesh has that many ranks."""
    return sorted(n for n, c in CASES.items() if not c.mesh or math.prod(size for _, size in c.mesh) == world)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)


def check(case: str, world: int, device: str, dtype_name: str, tolerance: float) -> None:
    """Runs `case` sharded over its mesh (1-D over the `world` ranks unless it names one) and checks this rank's results and
    gradients against the whole function's (an AssertionError otherwise)."""
    import torch

    c = CASES[case]
    if c.mesh:
        mesh = DeviceMesh(device, tuple(size for _, size in c.mesh), tuple(name for name, _ in c.mesh))
    else:
        (axis,) = set(c.sharding.values())
        mesh = DeviceMesh(device, (world,), (axis,))
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    whole = [(0.5 * torch.randn(tuple(c.dims[d] for d in spec.dims), generator=gen)).to(device=device, dtype=dtype)
             .requires_grad_() for spec in c.fn.annotations.values()]
    want = c.fn(*whole, *c.constants)
    cotangent = torch.randn(want.shape, generator=gen).to(device=device, dtype=dtype)
    want.backward(cotangent)

    sharded = shard(c.fn, mesh, c.sharding, chunks=c.chunks, sequence=c.sequence)
    mine = [x.detach().requires_grad_() for x in sharded.local(*whole)]
    if c.chunks > 1:   # chunks this small only here, where the interpreter runs them
        sharded_module.MIN_CHUNK_ROWS, kept = 8, sharded_module.MIN_CHUNK_ROWS
        try:
            got = sharded(*mine, *c.constants)
            report = sharded.report(*mine, *c.constants)
        finally:
            sharded_module.MIN_CHUNK_ROWS = kept
        assert "in 4 chunks along N" in report, report
    else:
        got = sharded(*mine, *c.constants)
        assert "chunks" not in sharded.report(*mine, *c.constants)
    (placement,) = sharded.placements(*mine, *c.constants)
    want_mine = want.detach()
    local_cotangent = cotangent
    for i, ax in placement.sharded:   # a sharded result stays this rank's shard
        part = want.shape[i] // mesh.size(ax)
        want_mine = want_mine.narrow(i, mesh.rank(ax) * part, part)
        local_cotangent = local_cotangent.narrow(i, mesh.rank(ax) * part, part)
    assert _rel(got, want_mine) < tolerance, (case, "result", _rel(got, want_mine))
    got.backward(local_cotangent.contiguous())
    for name, x, w in zip(c.fn.annotations, mine, sharded.local(*[t.grad for t in whole])):
        assert _rel(x.grad, w) < tolerance, (case, f"gradient of {name}", _rel(x.grad, w))


def _rel(got, want) -> float:
    got, want = got.double(), want.double()
    assert not got.isnan().any()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
