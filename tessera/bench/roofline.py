"""The arithmetic of `tessera profile`'s kernel report: each kernel's work from the Schedule IR, and
its time against the device's roofline.

Work, per `schedule.kernel` (one fusion group; a split-K GEMM's group launches two kernels, timed
together): FLOPs are 2 M N K per matmul (batch dims multiplied in), so an attention kernel counts
4 B H Sq Sk D, halved when its scores are masked by a triangle (`where(i >= j, s, -inf)` over two
index ranges: the kernel skips the blocks above the diagonal); other ops count no FLOPs, which leaves
those kernels on the memory roof. Bytes are the group's inputs read once and outputs written once.

Against the roofline: a kernel's arithmetic intensity (FLOPs / byte) left of the ridge point
(peak FLOP/s / bandwidth) puts it under the memory roof, and its fraction of the roofline is its
GB/s over the bandwidth; right of it, its TFLOP/s over the peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .. import platforms
from ..dims import hint


@dataclass(frozen=True)
class KernelWork:
    """What one fusion group does: FLOPs, bytes moved, the dtype its arithmetic runs in."""

    name: str
    kind: str
    flops: float
    bytes: float
    dtype: str              # "fp16"/"bf16" (tensor cores) for matmul groups, else "fp32"

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


def _size(shape, dims: Mapping[str, int]) -> int:
    return math.prod(d if isinstance(d, int) else dims[d] for d in shape)


def _tensor_bytes(value, dims: Mapping[str, int]) -> int:
    from ..ir import graph as g
    t = g.tensor_type(value)
    return _size(t.shape, dims) * t.dtype.itemsize


def _from_index_ranges(value) -> bool:
    """Whether `value` is computed from `arange`s alone (through views, casts and constant offsets)."""
    from ..ir import graph as g
    op = value.owner
    if isinstance(op, g.SOURCE_OPS):
        return True
    if isinstance(op, g.ReshapeOp | g.TransposeOp | g.CastOp) or isinstance(op, g.ElementwiseOp) and op.kind in ("add", "sub"):
        return all(_from_index_ranges(v) for v in op.operands)
    return False


def triangle_masked(softmax) -> bool:
    """A softmax over `where(a CMP b, s, -inf)` with a and b index ranges: a causal (triangle) mask."""
    from ..ir import graph as g
    where = softmax.operands[0].owner
    if not (isinstance(where, g.ElementwiseOp) and where.kind == "where"):
        return False
    fill, cond = where.inputs[2].owner, where.inputs[0].owner
    return (isinstance(fill, g.ConstantOp) and fill.value.value.data == -math.inf
            and isinstance(cond, g.ElementwiseOp) and cond.kind in ("le", "lt", "ge", "gt")
            and all(_from_index_ranges(v) for v in cond.inputs))


def group_work(kernel, dims: Mapping[str, int]) -> KernelWork:
    """A `schedule.kernel`'s FLOPs and bytes, for the dims of the compile."""
    from ..ir import graph as g
    flops, dtype, causal = 0.0, "fp32", False
    for op in kernel.body.walk():
        if isinstance(op, g.MatmulOp):
            k = _size(g.tensor_type(op.lhs).shape[-1:], dims)
            flops += 2.0 * _size(g.tensor_type(op.res).shape, dims) * k
            dtype = g.tensor_type(op.lhs).dtype.name if dtype == "fp32" else dtype
        elif isinstance(op, g.SoftmaxOp):
            causal = causal or triangle_masked(op)
    moved = sum(_tensor_bytes(v, dims) for v in (*kernel.operands, *kernel.results))
    return KernelWork(kernel.sym_name.data, kernel.kind.data, flops * (0.5 if causal else 1.0), float(moved), dtype)


def kernel_work(compiled) -> list[KernelWork]:
    """Every fusion group of a compiled function, in launch order."""
    from ..ir import schedule
    module = compiled.modules["schedule"]
    works = []
    from ..ir import graph as g
    for func in module.ops:
        dims = {k: hint(v) for k, v in g.bindings_of(func).items()}   # a generic compile: its hints
        works += [group_work(op, dims) for op in func.walk() if isinstance(op, schedule.KernelOp)]
    return works


def launched_by(group: str, kernel_names: Sequence[str]) -> list[str]:
    """The kernels a fusion group launches: itself, and for a split-K GEMM or a split-KV attention
    its `_partials` kernel."""
    from ..lowering.schedule_to_tile import SPLIT_PARTIALS
    return [n for n in (group + SPLIT_PARTIALS, group) if n in kernel_names]


@dataclass(frozen=True)
class Roof:
    """The device's ceilings: peak TFLOP/s per dtype and memory bandwidth (a measured copy)."""

    peaks: Mapping[str, float | None]
    bandwidth_gbs: float

    def ridge(self, dtype: str) -> float | None:
        """FLOPs per byte where the memory roof meets the compute roof."""
        peak = self.peaks.get(dtype)
        return peak * 1e3 / self.bandwidth_gbs if peak else None


def roof_for(platform, bandwidth_gbs: float) -> Roof:
    return Roof({d: platforms.peak_tflops(platform, d) for d in ("fp16", "bf16", "fp32")}, bandwidth_gbs)


@dataclass(frozen=True)
class KernelPerf:
    """One fusion group's measured time against its work and the roofline."""

    work: KernelWork
    time_ms: float | None
    roof: Roof | None
    occupancy: tuple[tuple[str, int, tuple[str, ...]], ...] = ()   # (kernel, blocks per SM, limits)

    @property
    def tflops(self) -> float | None:
        return self.work.flops / self.time_ms / 1e9 if self.time_ms else None

    @property
    def gbs(self) -> float | None:
        return self.work.bytes / self.time_ms / 1e6 if self.time_ms else None

    @property
    def bound(self) -> str | None:
        """"compute" or "memory": which roof is above the kernel's arithmetic intensity."""
        ridge = self.roof.ridge(self.work.dtype) if self.roof else None
        if ridge is None:   # no peak rate for this dtype: only a kernel without FLOPs has a roof
            return "memory" if self.roof and not self.work.flops else None
        return "compute" if self.work.intensity >= ridge else "memory"

    @property
    def fraction(self) -> float | None:
        """Achieved rate over the roof the kernel is under."""
        if self.time_ms is None or self.bound is None:
            return None
        if self.bound == "compute":
            return self.tflops / self.roof.peaks[self.work.dtype]
        return self.gbs / self.roof.bandwidth_gbs


def median(xs: Sequence[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2


def group_times(works: Sequence[KernelWork], times: Mapping[str, Sequence[float]]) -> dict[str, float | None]:
    """Each group's time: the sum over the kernels it launches of their median times (ms); None when a
    kernel of the group was not seen."""
    out = {}
    for w in works:
        names = launched_by(w.name, list(times))
        medians = [median(times[n]) for n in names]
        out[w.name] = sum(medians) if medians and None not in medians else None
    return out


def _fmt(x: float | None, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def render(perfs: Sequence[KernelPerf]) -> str:
    """The kernel table of `tessera profile`."""
    lines = []
    for p in perfs:
        w = p.work
        lines.append(f"{w.name} ({w.kind}): {_fmt(p.time_ms, '.4f', ' ms')}, {w.flops / 1e9:.3f} GFLOP, "
                     f"{w.bytes / 1e6:.3f} MB, {_fmt(w.intensity, '.1f')} FLOP/byte")
        lines.append(f"  achieved   {_fmt(p.tflops, '.1f', ' TFLOP/s')}, {_fmt(p.gbs, '.1f', ' GB/s')}")
        if p.roof is not None and p.bound is None:
            lines.append(f"  roofline   no peak rate for {w.dtype} on this platform (tessera/platforms.py)")
        elif p.roof is not None:
            peak = p.roof.peaks.get(w.dtype)
            lines.append(f"  roofline   {p.bound}-bound ({w.dtype} peak {_fmt(peak, '.1f', ' TFLOP/s')}, copy "
                         f"bandwidth {p.roof.bandwidth_gbs:.0f} GB/s): {_fmt(p.fraction and 100 * p.fraction, '.1f', '%')}")
        for kernel, blocks, limits in p.occupancy:
            lines.append(f"  occupancy  {kernel}: {blocks} block{'s' if blocks != 1 else ''} per SM "
                         f"(limited by {' and '.join(limits)})")
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot on a file backend; a user error naming the extra where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..errors import TesseraError
        raise TesseraError("--plot needs matplotlib: pip install 'tessera[plot]'") from None
    return plt


def plot(perfs: Sequence[KernelPerf], roof: Roof, path: str) -> None:
    """The kernels as points under the roofline (log-log), written to `path` (needs matplotlib)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [p.work.intensity for p in perfs if p.tflops] or [1.0]
    lo, hi = min(min(xs) / 4, 0.1), max(max(xs) * 4, 1e3)
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    by_peak: dict[float, list[str]] = {}
    for dtype, peak in roof.peaks.items():
        if peak:
            by_peak.setdefault(peak, []).append(dtype)
    for peak, dtypes in by_peak.items():   # fp16 and bf16 share one roof
        ax.plot(grid, [min(peak, x * roof.bandwidth_gbs / 1e3) for x in grid], label=f"{'/'.join(dtypes)} roof")
    for p in perfs:
        if p.tflops:
            ax.scatter([p.work.intensity], [p.tflops])
            ax.annotate(p.work.name, (p.work.intensity, p.tflops), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="TFLOP/s",
           title=f"roofline (copy bandwidth {roof.bandwidth_gbs:.0f} GB/s)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
