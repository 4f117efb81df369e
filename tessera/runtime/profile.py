"""Reading back profile regions and reporting them.

A kernel compiled with profiling on (`profile=True`, TESSERA_PROFILE=1, `tessera profile`) writes,
per block, the (begin, end) stamps of each of its slots into a buffer of its own
(`tessera.lowering.profile`): slot 0 spans the whole kernel, the others its profile regions. After a
call, the runtime (the CPU interpreter, or the GPU launcher) hands each profiled kernel's buffer to
`record`; `profile_report()` returns what the last calls recorded, one `KernelProfile` per kernel:
per region, the median over blocks of its duration (GPU: `%clock64` cycles; CPU: nanoseconds)
and of its share of the block's kernel time.

    y = f(x, profile=True)
    print(tsr.profile_report())
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RegionProfile:
    """One region of one kernel, over its blocks: durations and shares of the kernel's time."""

    label: str
    median: float         # duration, in the kernel's unit
    share: float          # median over blocks of duration / the block's kernel time
    begin: float          # median over blocks of the region's begin stamp, relative to the kernel's
    end: float            # same for its end stamp


@dataclass(frozen=True)
class KernelProfile:
    """A profiled kernel's last launch: its time per block and its regions."""

    kernel: str
    unit: str             # "cycles" (GPU) or "ns" (CPU interpreter)
    blocks: int
    median: float         # the whole kernel's duration per block, median over blocks
    regions: tuple[RegionProfile, ...]

    def __str__(self) -> str:
        rows = [f"{self.kernel}: {self.median:,.0f} {self.unit} per block (median of {self.blocks} blocks)"]
        width = max((len(r.label) for r in self.regions), default=0)
        rows += [f"  {r.label:<{width}}  {r.median:>12,.0f} {self.unit}  {100 * r.share:5.1f}%" for r in self.regions]
        return "\n".join(rows)


def summarize(kernel: str, labels: Sequence[str], stamps: np.ndarray, unit: str) -> KernelProfile:
    """A kernel's profile from its stamp buffer, i32 [z, y, x, slots, 4]: per slot (slot 0: the
    kernel) its begin and end stamps, each a 64-bit count in two words, low first."""
    words = np.ascontiguousarray(stamps, dtype=np.int32)
    per_block = words.view(np.int64).reshape(-1, len(labels), 2).astype(np.float64)
    begin, end = per_block[:, :, 0], per_block[:, :, 1]
    total = end[:, 0] - begin[:, 0]
    regions = []
    for slot, label in enumerate(labels[1:], start=1):
        duration = end[:, slot] - begin[:, slot]
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(total > 0, duration / total, 0.0)
        regions.append(RegionProfile(label, float(np.median(duration)), float(np.median(share)),
                                     float(np.median(begin[:, slot] - begin[:, 0])),
                                     float(np.median(end[:, slot] - begin[:, 0]))))
    return KernelProfile(kernel, unit, len(total), float(np.median(total)), tuple(regions))


class Report(dict):
    """Kernel name -> its KernelProfile, in the order they were recorded."""

    def __str__(self) -> str:
        return "\n".join(str(k) for k in self.values()) if self else "no profiled kernel has run"


_recorded = threading.local()


def record(kernel: str, labels: Sequence[str], stamps, unit: str) -> KernelProfile:
    """Summarizes a profiled kernel's stamps (a NumPy array, a torch tensor or a CuPy array; reading
    a GPU one waits for the kernel) and keeps the result for `profile_report`; the latest launch of
    a kernel replaces earlier ones."""
    if hasattr(stamps, "cpu"):
        stamps = stamps.cpu().numpy()
    elif hasattr(stamps, "get"):
        stamps = stamps.get()
    summary = summarize(kernel, labels, stamps, unit)
    report = profile_report()
    report.pop(kernel, None)
    report[kernel] = summary
    return summary


def profile_report() -> Report:
    """What profiled kernels recorded in this thread since `reset_profile`: their latest launches."""
    if not hasattr(_recorded, "report"):
        _recorded.report = Report()
    return _recorded.report


def reset_profile() -> None:
    """Forgets what profiled kernels recorded in this thread."""
    _recorded.report = Report()


@dataclass(frozen=True)
class ProfiledLaunch:
    """A profiled kernel of a GPU program: which of the program's intermediates holds its stamps."""

    kernel: str
    labels: tuple[str, ...]
    intermediate: int


def profiled_launches(compiled) -> list[ProfiledLaunch]:
    """The profiled kernels of a compiled function, with the index among its host function's
    `tile.alloc_global`s (the runtime's intermediates, in order) of each one's stamp buffer: the
    last argument of its launch."""
    from ..ir import provenance, tile

    kernels = {op.sym_name.data: op for op in compiled.modules["tile"].ops if isinstance(op, tile.KernelOp)}
    allocs: dict = {}
    found = []
    for op in compiled.host_function().body.block.ops:
        if isinstance(op, tile.AllocGlobalOp):
            allocs[op.result] = len(allocs)
        elif isinstance(op, tile.LaunchOp):
            labels = kernels[op.kernel.string_value()].attributes.get(provenance.PROFILE)
            if labels is not None:
                found.append(ProfiledLaunch(op.kernel.string_value(), tuple(a.data for a in labels.data),
                                            allocs[op.args[-1]]))
    return found


def record_launches(launches: Sequence[ProfiledLaunch], intermediates: Sequence) -> None:
    """After a GPU call: reads back each profiled kernel's stamps from the call's intermediates
    (this waits for the kernels) and records them, in cycles."""
    for launch in launches:
        record(launch.kernel, launch.labels, intermediates[launch.intermediate], "cycles")
