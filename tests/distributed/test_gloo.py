"""Sharded Tessera functions across processes on the CPU: torch.distributed with gloo, each rank
running its shards on the CPU tile interpreter; results and gradients against the function run
whole (`sharded_cases.check`)."""
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from sharded_cases import CASES, check, free_port, init  # noqa: E402

WORLD = 2


def _rank(rank: int, port: int, cases: list[str]) -> None:
    import torch.distributed as dist

    init(rank, WORLD, port, "gloo")
    try:
        for case in cases:
            check(case, WORLD, "cpu", "float32", 1e-4)
    finally:
        dist.destroy_process_group()


def test_sharded_functions_over_two_gloo_processes_match_the_whole_function():
    """One job for every case (starting processes costs more than the cases): a column- then
    row-parallel MLP (an all-reduce of its output and of its input's gradient), the same MLP data
    parallel (its weights' gradients all-reduced), attention with its heads sharded (none)."""
    mp.spawn(_rank, args=(free_port(), sorted(CASES)), nprocs=WORLD, join=True)
