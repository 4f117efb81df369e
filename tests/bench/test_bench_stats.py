"""The regression rule on synthetic timings: a change counts only beyond both runs' measured noise."""
from __future__ import annotations

import pytest
from bench_fakes import NOISY, TIGHT, scaled

from tessera.bench.stats import K_SIGMA, RESOLUTION_MS, compare, summarize


def test_summary_median_quartiles_and_mad():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.iqr, s.mad, s.n) == (3.0, 2.0, 4.0, 2.0, 1.0, 5)
    assert s.samples == (1.0, 2.0, 3.0, 4.0, 5.0)


def test_summary_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        summarize([])


def test_three_percent_slower_in_a_tight_case_is_a_regression():
    assert compare(summarize(TIGHT), summarize(scaled(TIGHT, 1.03))).kind == "regression"


def test_three_percent_slower_inside_a_noisy_case_is_not():
    verdict = compare(summarize(NOISY), summarize(scaled(NOISY, 1.03)))
    assert verdict.kind == "unchanged"
    assert verdict.threshold_ms > verdict.change_ms > 0


def test_a_noisy_case_still_flags_a_change_far_beyond_its_noise():
    assert compare(summarize(NOISY), summarize(scaled(NOISY, 1.30))).kind == "regression"


def test_faster_beyond_the_noise_is_an_improvement():
    assert compare(summarize(TIGHT), summarize(scaled(TIGHT, 0.97))).kind == "improvement"


def test_threshold_is_k_sigma_of_the_difference_of_two_rounds():
    base, new = summarize(NOISY), summarize(scaled(NOISY, 1.01))
    expected = K_SIGMA * (base.sigma ** 2 + new.sigma ** 2) ** 0.5
    assert compare(base, new).threshold_ms == pytest.approx(expected)
    assert base.sigma == pytest.approx(1.4826 * base.mad)


def test_identical_rounds_get_the_timer_resolution_not_zero_spread():
    flat = summarize([1.0] * 5)
    assert flat.sigma == RESOLUTION_MS
    assert compare(flat, summarize([1.0001] * 5)).kind == "unchanged"
    assert compare(flat, summarize([1.01] * 5)).kind == "regression"
