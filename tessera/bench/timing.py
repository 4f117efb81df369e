"""The timing calls themselves: the only code of `tessera bench` and `tessera profile` that needs a GPU
(torch, and Triton's do_bench). Everything they return is plain floats, which the rest of the package
summarizes, compares and reports, and which the CPU tests inject.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

#: do_bench's warm-up and measuring time per round, in ms
WARMUP_MS, REP_MS = 25, 100


def median_ms(fn: Callable[[], object], warmup: int = 50, rep: int = 300) -> float:
    """One do_bench median: warm-up, then many calls with L2 flushed before each (Triton zeroes a
    buffer larger than L2), each timed with CUDA events."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64, for torch tensors; for tuples of them (a backward's
    gradients), the largest over the pairs."""
    if isinstance(out, (tuple, list)):
        return max(rel_err(o, r) for o, r in zip(out, ref, strict=True))
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def device_rounds(fn: Callable[[], object], repeats: int, warmup: int = WARMUP_MS, rep: int = REP_MS) -> list[float]:
    """`repeats` do_bench medians (ms) of `fn`: the samples a case's statistics are taken over."""
    return [median_ms(fn, warmup, rep) for _ in range(repeats)]


def host_rounds(fn: Callable[[], object], repeats: int, calls: int = 2000) -> list[float]:
    """`repeats` measurements (ms per call) of `fn` called back to back `calls` times, wall clock,
    synchronised at the end: what a call costs end to end when its GPU work is negligible."""
    import torch
    rounds = []
    for _ in range(repeats):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return rounds


def copy_bandwidth() -> float:
    """The device's measured memory ceiling in GB/s: a 1 GiB device-to-device copy, bytes read + written."""
    import torch
    x = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def kernel_times(call: Callable[[], object], names: Sequence[str], repeats: int = 20) -> dict[str, list[float]]:
    """Each named kernel's GPU time (ms) in `repeats` calls of `call`, from torch's profiler (CUPTI sees
    kernels launched through the driver API too), L2 flushed before each call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            flush.zero_()
            call()
        torch.cuda.synchronize()
    wanted = set(names)
    times: dict[str, list[float]] = {n: [] for n in names}
    for event in prof.events():
        if event.name in wanted and event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name].append(event.time_range.elapsed_us() / 1e3)   # us -> ms
    return times
