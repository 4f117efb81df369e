"""Sharded Tessera functions over NCCL (torch.distributed), one process per GPU: the cases of
tests/distributed/sharded_cases.py in fp16/bf16 against the function run whole on each GPU.
One rank runs wherever there is a GPU (NCCL's collectives with a group of one); two and four ranks
need as many GPUs."""
import pytest

from sharded_cases import cases_for, check, free_port, init


def _rank(rank: int, world: int, port: int, dtype: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    init(rank, world, port, "nccl")
    try:
        for case in cases_for(world):
            check(case, world, "cuda", dtype, 2e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sharded_functions_over_nccl_match_the_whole_function(torch_cuda, world, dtype):
    if torch_cuda.cuda.device_count() < world:
        pytest.skip(f"{world} GPUs needed, {torch_cuda.cuda.device_count()} visible")
    torch_cuda.multiprocessing.spawn(_rank, args=(world, free_port(), dtype), nprocs=world, join=True)
