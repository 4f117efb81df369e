"""What `tessera bench` writes: one run's environment and cases as JSON, read back, compared with a
baseline and rendered as the markdown table of bench/RESULTS.md.

    {"schema": "tessera-bench/1",
     "environment": {"device": ..., "driver": ..., "versions": {"python", "torch", "triton",
                     "cuda-bindings", "tessera"}, "commit": ..., "dirty": bool, "date": ...,
                     "copy_gbs": measured device-to-device copy bandwidth, "command": ...},
     "settings": {"repeats": N, "warmup_ms": ..., "rep_ms": ...},
     "cases": [{"name", "suite", "unit", "work", "status": "ok" | "wrong" | "error", "note",
                "error": rel err of Tessera's output against the case's reference,
                "tessera": STATS | null,
                "peers": {NAME: {"stats": STATS | null, "error": rel err | null, "note": ...}}}]}

STATS is `stats.Stats.to_json()`: median, q1, q3, iqr, mad, n (ms) and the round samples. `work` is
FLOPs (unit TFLOP/s) or bytes moved (GB/s); host-timed cases have unit us/call and no work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .stats import Stats, Verdict, compare

SCHEMA = "tessera-bench/1"


def rate(work: float | None, unit: str, ms: float) -> float:
    """A case's rate in its unit from its median time: TFLOP/s from FLOPs, GB/s from bytes, us/call."""
    if unit == "TFLOP/s":
        return work / ms / 1e9
    if unit == "GB/s":
        return work / ms / 1e6
    if unit == "us/call":
        return ms * 1e3
    raise ValueError(f"unknown unit {unit!r}")


@dataclass
class PeerResult:
    """A peer's timing on a case, and how far Tessera's output is from the peer's."""

    stats: Stats | None
    error: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        return {"stats": self.stats.to_json() if self.stats else None, "error": self.error, "note": self.note}

    @staticmethod
    def from_json(d: dict) -> "PeerResult":
        return PeerResult(Stats.from_json(d["stats"]) if d.get("stats") else None, d.get("error"), d.get("note", ""))


@dataclass
class CaseResult:
    """One case of one run: Tessera's timing (None when its output was wrong or it failed) and its peers'."""

    name: str
    suite: str
    unit: str
    work: float | None
    status: str                      # "ok", "wrong" (output checked and wrong: not timed), "error"
    tessera: Stats | None = None
    error: float | None = None
    note: str = ""
    peers: dict[str, PeerResult] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "suite": self.suite, "unit": self.unit, "work": self.work, "status": self.status,
                "note": self.note, "error": self.error, "tessera": self.tessera.to_json() if self.tessera else None,
                "peers": {name: p.to_json() for name, p in self.peers.items()}}

    @staticmethod
    def from_json(d: dict) -> "CaseResult":
        return CaseResult(d["name"], d["suite"], d["unit"], d.get("work"), d["status"],
                          Stats.from_json(d["tessera"]) if d.get("tessera") else None, d.get("error"),
                          d.get("note", ""), {n: PeerResult.from_json(p) for n, p in d.get("peers", {}).items()})


@dataclass
class BenchRun:
    """A whole `tessera bench` run."""

    environment: dict
    settings: dict
    cases: list[CaseResult]

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "environment": self.environment, "settings": self.settings,
                "cases": [c.to_json() for c in self.cases]}

    @staticmethod
    def from_json(d: dict) -> "BenchRun":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} result (schema {d.get('schema')!r})")
        return BenchRun(d["environment"], d.get("settings", {}), [CaseResult.from_json(c) for c in d["cases"]])

    def by_name(self) -> dict[str, CaseResult]:
        return {c.name: c for c in self.cases}


def save(run: BenchRun, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run.to_json(), indent=1) + "\n")
    return path


def load(path: str | Path) -> BenchRun:
    """A result file, its schema checked (a ValueError naming the file otherwise)."""
    try:
        return BenchRun.from_json(json.loads(Path(path).read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None


# --- markdown -------------------------------------------------------------------------------

COLUMNS = ("case", "peer", "tessera ms", "MAD", "IQR", "peer ms", "ratio", "tessera", "peer", "unit", "rel err")


def _ms(stats: Stats | None) -> str:
    return f"{stats.median:.3f}" if stats else "-"


def _rows(case: CaseResult) -> list[list[str]]:
    """One markdown row per (case, peer); a case without peers or not timed gets one row."""
    t = case.tessera
    own = [case.name, "", _ms(t), f"{t.mad:.4f}" if t else "-", f"{t.iqr:.4f}" if t else "-"]
    if t is None:
        return [own[:1] + ["-", case.status.upper() + (f": {case.note}" if case.note else ""), "", "", "", "", "", "",
                           case.unit, f"{case.error:.1e}" if case.error is not None else "-"]]
    rows = []
    for name, peer in (case.peers or {"-": PeerResult(None)}).items():
        p = peer.stats
        ratio = f"{p.median / t.median:.2f}" if p else peer.note or "-"
        err = peer.error if peer.error is not None else case.error
        rows.append([case.name, name, *own[2:], _ms(p), ratio, f"{rate(case.work, case.unit, t.median):.1f}",
                     f"{rate(case.work, case.unit, p.median):.1f}" if p else "-", case.unit,
                     f"{err:.1e}" if err is not None else "-"])
    return rows


def heading(run: BenchRun) -> str:
    e = run.environment
    v = e.get("versions", {})
    versions = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    commit = (e.get("commit") or "unknown")[:10] + (" (uncommitted changes)" if e.get("dirty") else "")
    copy = f"; copy bandwidth {e['copy_gbs']:.0f} GB/s" if e.get("copy_gbs") else ""
    return (f"{e.get('date', '')}: {e.get('device', '?')}, driver {e.get('driver', '?')}; {versions}; "
            f"commit {commit}{copy}; {run.settings.get('repeats', '?')} rounds per case, median, MAD and IQR in ms")


def render_markdown(run: BenchRun) -> str:
    """The run as RESULTS.md shows runs: a line saying where and how, then the table."""
    rows = [r for case in run.cases for r in _rows(case)]
    lines = ["### " + heading(run), "", "| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    command = run.environment.get("command")
    return "\n".join(lines[:2] + ([f"command: `{command}`", ""] if command else []) + lines[2:]) + "\n"


# --- comparing with a baseline --------------------------------------------------------------

@dataclass(frozen=True)
class CaseComparison:
    """A case of the baseline, the current run or both: what became of it."""

    name: str
    kind: str       # regression, improvement, unchanged, wrong, failed, missing, new, untimed
    base: Stats | None = None
    new: Stats | None = None
    verdict: Verdict | None = None

    @property
    def is_regression(self) -> bool:
        return self.kind in ("regression", "wrong", "failed")

    def __str__(self) -> str:
        if self.verdict is None:
            return f"{self.kind:11}  {self.name}" + {
                "missing": ": in the baseline, not in this run",
                "new": ": not in the baseline",
                "untimed": ": timed in neither run",
                "wrong": ": output WRONG (the baseline timed it)",
                "failed": ": did not run (the baseline timed it)"}.get(self.kind, "")
        v = self.verdict
        return (f"{self.kind:11}  {self.name}: {self.base.median:.4f} -> {self.new.median:.4f} ms "
                f"({100 * v.change_ms / self.base.median:+.1f}%; change {v.change_ms:+.4f} ms, noise threshold "
                f"{v.threshold_ms:.4f} ms)")


def compare_case(name: str, base: CaseResult | None, new: CaseResult | None) -> CaseComparison:
    """One case's fate; a case missing on either side is reported as such, never an error."""
    if new is None:
        return CaseComparison(name, "missing", base.tessera if base else None)
    if base is None:
        return CaseComparison(name, "new", None, new.tessera)
    if new.tessera is None:
        kind = "untimed" if base.tessera is None else "wrong" if new.status == "wrong" else "failed"
        return CaseComparison(name, kind, base.tessera)
    if base.tessera is None:
        return CaseComparison(name, "new", None, new.tessera)
    verdict = compare(base.tessera, new.tessera)
    return CaseComparison(name, verdict.kind, base.tessera, new.tessera, verdict)


@dataclass(frozen=True)
class Comparison:
    """A run against a baseline, case by case (baseline order, then cases new in this run)."""

    cases: tuple[CaseComparison, ...]
    notes: tuple[str, ...]

    @property
    def regressions(self) -> list[CaseComparison]:
        return [c for c in self.cases if c.is_regression]

    def render(self) -> str:
        counts = {}
        for c in self.cases:
            counts[c.kind] = counts.get(c.kind, 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in counts.items())
        return "\n".join([*self.notes, *map(str, self.cases), f"{summary}"])


def compare_runs(base: BenchRun, new: BenchRun) -> Comparison:
    """Every case of either run against the other; a note when the devices differ."""
    old, cur = base.by_name(), new.by_name()
    names = list(old) + [n for n in cur if n not in old]
    notes = []
    devices = (base.environment.get("device"), new.environment.get("device"))
    if devices[0] != devices[1]:
        notes.append(f"warning: baseline device {devices[0]!r}, this run's {devices[1]!r}")
    return Comparison(tuple(compare_case(n, old.get(n), cur.get(n)) for n in names), tuple(notes))


BASELINES = Path(__file__).resolve().parents[2] / "bench" / "baselines"


def baseline_path(device: str, root: str | Path | None = None) -> Path:
    """Where the repository keeps a device's baseline: bench/baselines/<device name as a slug>.json."""
    slug = "".join(ch if ch.isalnum() else "-" for ch in device.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return Path(root or BASELINES) / f"{slug}.json"
