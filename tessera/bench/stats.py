"""Statistics of repeated timings, and the rule that calls a change a regression.

A case is timed in `repeats` rounds (each round itself a do_bench-style median over many calls,
L2 flushed between calls); the round medians are its samples. A run keeps, per case, the median of
the samples and two spreads: the interquartile range and the median absolute deviation (MAD).

The regression rule (`compare`): with sigma = 1.4826 * MAD (the MAD scaled to estimate a standard
deviation of normally distributed samples, robust to the odd slow round), floored at the timer's
resolution, a case regressed when

    new.median - base.median > K * sqrt(sigma_base^2 + sigma_new^2),   K = 3,

that is, when the slowdown exceeds three standard deviations of the difference of two single
rounds drawn from the two runs. It is the rounds' spread, not the standard error of the median:
rounds within one process vary less than runs in separate processes (clocks, power, placement), so
the stricter test would flag run-to-run drift. A noisy case therefore needs a larger change to be
flagged than a tight one; no fixed percentage enters. The mirror condition marks an improvement.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

#: How many combined standard deviations a change must exceed to count.
K_SIGMA = 3.0
#: MAD -> standard deviation for normally distributed samples.
MAD_TO_SIGMA = 1.4826
#: The resolution of a CUDA event timing (about half a microsecond), in ms: the least spread a case is
#: granted, so that identical rounds (MAD 0) do not make any nonzero change a regression.
RESOLUTION_MS = 0.0005


@dataclass(frozen=True)
class Stats:
    """A case's timing over its rounds, in ms."""

    median: float
    q1: float
    q3: float
    mad: float
    n: int
    samples: tuple[float, ...] = ()

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def sigma(self) -> float:
        """Robust standard deviation of one round, floored at the timer's resolution."""
        return max(MAD_TO_SIGMA * self.mad, RESOLUTION_MS)

    def to_json(self) -> dict:
        return {**asdict(self), "samples": list(self.samples), "iqr": self.iqr}

    @staticmethod
    def from_json(d: dict) -> "Stats":
        return Stats(d["median"], d["q1"], d["q3"], d["mad"], d["n"], tuple(d.get("samples", ())))


def summarize(samples: Sequence[float]) -> Stats:
    """Median, quartiles and MAD of a case's round timings."""
    if not samples:
        raise ValueError("no timings to summarize")
    xs = sorted(float(x) for x in samples)
    median = statistics.median(xs)
    q1, q3 = (statistics.quantiles(xs, n=4, method="inclusive")[i] for i in (0, 2)) if len(xs) > 1 else (xs[0], xs[0])
    mad = statistics.median(abs(x - median) for x in xs)
    return Stats(median, q1, q3, mad, len(xs), tuple(xs))


@dataclass(frozen=True)
class Verdict:
    """One case's comparison: the change, the threshold it was held to, and what it is."""

    change_ms: float      # new median - baseline median (positive: slower)
    threshold_ms: float   # K_SIGMA * sqrt(sigma_base^2 + sigma_new^2)
    kind: str             # "regression", "improvement" or "unchanged"


def compare(base: Stats, new: Stats, k: float = K_SIGMA) -> Verdict:
    """Whether `new` is slower (or faster) than `base` beyond both runs' measured noise."""
    change = new.median - base.median
    threshold = k * math.hypot(base.sigma, new.sigma)
    kind = "regression" if change > threshold else "improvement" if -change > threshold else "unchanged"
    return Verdict(change, threshold, kind)
