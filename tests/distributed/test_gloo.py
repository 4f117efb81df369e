"""Sharded Tessera functions across processes on the CPU: torch.distributed with gloo, each rank
running its shards on the CPU tile interpreter; results and gradients against the function run
whole (`sharded_cases.check`)."""
import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

from sharded_cases import check, cases_for, free_port, init  # noqa: E402


def _rank(rank: int, world: int, port: int) -> None:
    import os
    import sys

    import torch.distributed as dist

    init(rank, world, port, "gloo")
    try:
        for case in cases_for(world):
            check(case, world, "cpu", "float32", 1e-4)
        dist.barrier()   # every rank's collectives done before any tears its group down (else, at times,
    finally:             # gloo's threads outlived a group the other rank destroyed: "terminate called", SIGABRT)
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's teardown: gloo's threads could still abort
    # it there ("terminate called without an active exception", SIGABRT: 1 CI run of ~40 after the
    # barrier above). A failure raised above still reaches the parent (spawn's error file).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_sharded_functions_over_two_gloo_processes_match_the_whole_function():
    """One job for every case (starting processes costs more than the cases): a column- then
    row-parallel MLP (an all-reduce of its output and of its input's gradient), the same with its
    all-reduces overlapped in chunks, the MLP data parallel (its weights' gradients all-reduced), a
    row-parallel output read by gelu (the all-reduce inside the function), attention with its heads
    sharded (none), a Llama-style block tensor parallel and sequence parallel."""
    mp.spawn(_rank, args=(2, free_port()), nprocs=2, join=True)


def test_a_2d_mesh_over_four_gloo_processes_combines_data_and_tensor_parallelism():
    """A (dp, tp) = (2, 2) mesh: the MLP with its tokens split over dp and hidden dim over tp, the
    block with its batch over dp and heads, hidden dim and (between the tensor-parallel regions)
    sequence over tp."""
    mp.spawn(_rank, args=(4, free_port()), nprocs=4, join=True)
