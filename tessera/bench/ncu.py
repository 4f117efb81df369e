"""Nsight Compute's view of a function's kernels, where `ncu` is on PATH: `tessera profile` reruns the
function under ncu in a subprocess (`tessera run`, the same unprofiled kernels it timed) and reads the
metrics below from ncu's raw CSV page.
"""
from __future__ import annotations

import csv
import io
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

#: (label, ncu metric) as the report prints them; percentages of peak unless the label says otherwise
METRICS: tuple[tuple[str, str], ...] = (
    ("tensor pipe (mma.sync) %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe (wgmma) %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue slots busy %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("stall long scoreboard", "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"),
    ("stall barrier", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"),
    ("stall wait", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"),
    ("stall math pipe", "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"),
    ("stall MIO throttle", "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio"),
    ("L2 throughput %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM throughput %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
)


def available() -> bool:
    return shutil.which("ncu") is not None


def command(kernels: Sequence[str], run_args: Sequence[str]) -> list[str]:
    """ncu over `python -m tessera run ...`, limited to Tessera's kernels (the inputs' torch kernels are not)."""
    pattern = "regex:^(" + "|".join(kernels) + ")$"
    return ["ncu", "--csv", "--page", "raw", "--kernel-name", pattern,
            "--metrics", ",".join(m for _, m in METRICS), sys.executable, "-m", "tessera", "run", *run_args]


def parse(text: str) -> dict[str, dict[str, float]]:
    """ncu's raw CSV (a header row naming metrics, a units row, a row per kernel launch) -> per kernel
    name, the METRICS ncu reported, by label; a kernel launched more than once keeps its last launch."""
    rows = list(csv.reader(io.StringIO(text[text.find('"ID"'):] if '"ID"' in text else "")))
    if len(rows) < 3:
        return {}
    header, labels = rows[0], {m: label for label, m in METRICS}
    found: dict[str, dict[str, float]] = {}
    for row in rows[2:]:
        record = dict(zip(header, row))
        found[record.get("Kernel Name", "?")] = {labels[k]: v for k, v in
                                                 ((k, _number(record.get(k))) for k in labels) if v is not None}
    return found


def _number(text: str | None) -> float | None:
    try:
        return float(text.replace(",", "")) if text not in (None, "", "n/a") else None
    except ValueError:
        return None


def collect(kernels: Sequence[str], run_args: Sequence[str], timeout: float = 600) -> tuple[dict, str | None]:
    """(metrics per kernel, None), or ({}, why not) when ncu fails (no permission for the counters, say)."""
    try:
        done = subprocess.run(command(kernels, run_args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as err:
        return {}, str(err)
    metrics = parse(done.stdout)
    if not metrics:
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERR" in line]
        return {}, (errors or [f"ncu exited {done.returncode} with no metrics"])[0]
    return metrics, None


def render(metrics: Mapping[str, Mapping[str, float]]) -> str:
    lines = []
    for kernel, values in metrics.items():
        lines.append(f"  ncu {kernel}")
        lines += [f"    {label:24} {values[label]:.2f}" for label, _ in METRICS if label in values]
    return "\n".join(lines)
