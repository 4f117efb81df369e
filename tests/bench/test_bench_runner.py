"""Running cases with recorded timings: the check before timing, peers that cannot run, failures."""
from __future__ import annotations

import pytest

from tessera.bench.cases import TOLERANCE, Case, Prepared, all_cases, select
from tessera.bench.runner import Instruments, run_case, run_cases


def recorded(samples_by_output):
    """Instruments whose rounds are recorded per callable output, and whose error is |out - ref|."""
    timed = []

    def rounds(fn, timer):
        timed.append((fn(), timer))
        return samples_by_output[fn()]
    return Instruments(rounds, lambda out, ref: abs(out - ref)), timed


def fixed(name, ours, peers, timer="device"):
    return Case(name, "rows", "GB/s", 1e9, lambda: Prepared(lambda: ours, {k: (lambda v=v: v) for k, v in peers.items()}),
                timer)


def test_checked_then_timed_with_each_peer():
    instruments, timed = recorded({1.0: [0.2, 0.3, 0.25], 1.001: [0.5, 0.5, 0.5]})
    result = run_case(fixed("c", 1.0, {"peer": 1.001}, timer="host"), instruments)
    assert result.status == "ok" and result.error == pytest.approx(0.001)
    assert result.tessera.median == 0.25 and result.peers["peer"].stats.median == 0.5
    assert [t for _, t in timed] == ["host", "host"]


def test_a_wrong_output_is_not_timed():
    instruments, timed = recorded({})
    result = run_case(fixed("c", 1.0, {"peer": 1.0 + 10 * TOLERANCE}), instruments)
    assert result.status == "wrong" and result.tessera is None and not timed
    assert "against peer: not timed" in result.note


def test_a_case_checks_against_its_own_tolerance():
    """An fp8 case is checked at the rounding its e4m3 probabilities give, not at fp16's."""
    instruments, _ = recorded({1.0: [0.2, 0.2, 0.2], 1.03: [0.3, 0.3, 0.3]})
    loose = Case("c", "attention", "TFLOP/s", 1.0, lambda: Prepared(lambda: 1.0, {"peer": lambda: 1.03}),
                 tolerance=5e-2)
    assert run_case(loose, instruments).status == "ok"
    assert run_case(fixed("c", 1.0, {"peer": 1.03}), instruments).status == "wrong"
    fp8 = next(c for c in all_cases() if c.name.startswith("fp8 e4m3 attention"))
    assert fp8.tolerance > TOLERANCE and fp8.suite == "attention"


def test_a_peer_that_cannot_run_is_noted_and_the_next_is_the_reference():
    def broken():
        raise RuntimeError("No available kernel.  Aborting execution.\nmore")

    case = Case("c", "attention", "TFLOP/s", 1.0,
                lambda: Prepared(lambda: 2.0, {"sdpa-cudnn": broken, "sdpa-flash": lambda: 2.0}))
    instruments, _ = recorded({2.0: [1.0, 1.0, 1.0]})
    result = run_case(case, instruments)
    assert result.status == "ok" and result.error == 0.0
    assert result.peers["sdpa-cudnn"].note == "unavailable: No available kernel.  Aborting execution."
    assert result.peers["sdpa-cudnn"].stats is None and result.peers["sdpa-flash"].stats.median == 1.0


def test_a_case_no_peer_could_check_is_timed_and_says_so():
    def broken():
        raise RuntimeError("no cuDNN")

    case = Case("c", "attention", "TFLOP/s", 1.0, lambda: Prepared(lambda: 2.0, {"sdpa-cudnn": broken}))
    result = run_case(case, recorded({2.0: [1.0, 1.0, 1.0]})[0])
    assert (result.status, result.error, result.note) == ("ok", None, "unchecked: no peer ran")


def test_a_case_that_fails_to_build_is_recorded_and_the_run_goes_on():
    def fails():
        raise ValueError("too much shared memory\ndetails")

    lines = []
    results = run_cases([Case("bad", "gemm", "TFLOP/s", 1.0, fails), fixed("good", 1.0, {"p": 1.0})],
                        recorded({1.0: [1.0, 1.0, 1.0]})[0], log=lines.append)
    assert [r.status for r in results] == ["error", "ok"]
    assert results[0].note == "ValueError: too much shared memory"
    assert lines[0] == "  bad: ERROR ValueError: too much shared memory"


def test_cases_are_declared_without_a_gpu_and_keep_run_alls_names():
    names = [c.name for c in all_cases()]
    assert len(names) == len(set(names))
    assert {"gemm 8192^3 bf16 (ampere)", "attention B=8 H=12 S=8192 D=128 fp16 causal (native)",
            "layer_norm 16384x8192 fp16", "call overhead: layer_norm 64x256 fp16"} <= set(names)
    gemm = next(c for c in all_cases() if c.name == "gemm 8192^3 bf16 (ampere)")
    assert gemm.work == 2 * 8192 ** 3 and gemm.unit == "TFLOP/s"
    causal = next(c for c in all_cases() if c.name == "attention B=8 H=12 S=8192 D=128 fp16 causal (native)")
    assert causal.work == 4 * 8 * 12 * 8192 * 8192 * 128 / 2


def test_filter_matches_names_and_suites():
    cases = all_cases(quick=True)
    assert {c.suite for c in select(cases, "^variants$")} == {"variants"}
    assert [c.name for c in select(cases, r"causal \(native\)")] == ["attention B=32 H=12 S=2048 D=128 fp16 causal (native)"]
    assert select(cases, None) == cases


def test_the_training_suite_times_the_attention_backward_against_sdpa():
    """Declared without a GPU: MHA plain and causal and grouped-query causal, bf16, their work 2.5
    forwards (the backward's five matmuls to the forward's two), half for causal."""
    training = [c for c in all_cases() if c.suite == "training"]
    assert [c.name for c in training] == ["attention backward B=8 H=16 S=4096 D=128 bf16",
                                          "attention backward B=8 H=16 S=4096 D=128 bf16 causal",
                                          "attention backward B=2 H=32/8 S=4096 D=128 bf16 causal"]
    assert training[0].work == 2.5 * 4 * 8 * 16 * 4096 * 4096 * 128
    assert training[2].work == 2.5 * 4 * 2 * 32 * 4096 * 4096 * 128 / 2
    assert [c.name for c in select(all_cases(quick=True), "^training$")][0].endswith("S=2048 D=128 bf16")


def test_a_backwards_gradients_are_each_checked():
    """rel_err of gradient tuples is the worst pair's: a wrong dK is not hidden by a right dQ."""
    torch = pytest.importorskip("torch")
    from tessera.bench.timing import rel_err

    right = torch.ones(4, 4)
    wrong = right * 1.5
    assert rel_err((right, right), (right, right)) == 0.0
    assert rel_err((right, wrong), (right, right)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        rel_err((right,), (right, right))
