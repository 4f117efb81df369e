"""Running cases: each one built, Tessera's output checked against its reference peer, then Tessera and
each peer timed in rounds, one after the other in this process on the same inputs.

The timing and error measures come in as an `Instruments`, so this logic runs the same with the GPU's
(`gpu_instruments`) and with the recorded numbers the CPU tests inject.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .cases import Case
from .results import CaseResult, PeerResult
from .stats import summarize



@dataclass(frozen=True)
class Instruments:
    """How a run measures: `rounds(fn, timer)` -> per-round times (ms) of a no-argument callable, for
    the case's timer ("device" or "host"); `error(out, ref)` -> relative error."""

    rounds: Callable[[Callable[[], object], str], list[float]]
    error: Callable[[object, object], float]


def gpu_instruments(repeats: int) -> Instruments:
    """Rounds of do_bench medians (device timer) or wall clock per call (host timer) on the GPU."""
    from . import timing

    def rounds(fn, timer: str) -> list[float]:
        return timing.host_rounds(fn, repeats) if timer == "host" else timing.device_rounds(fn, repeats)
    return Instruments(rounds, timing.rel_err)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _outputs(peers: dict[str, Callable[[], object]]) -> tuple[dict[str, object], dict[str, str]]:
    """Each peer's output, and for peers this machine cannot run (an SDPA backend missing), why."""
    outputs, notes = {}, {}
    for name, peer in peers.items():
        try:
            outputs[name] = peer()
        except RuntimeError as err:
            notes[name] = f"unavailable: {_first_line(err)}"
    return outputs, notes


def run_case(case: Case, instruments: Instruments) -> CaseResult:
    """`case` checked and timed; a case that fails to build or run is recorded as an error, not raised."""
    result = CaseResult(case.name, case.suite, case.unit, case.work, "ok")
    try:
        prepared = case.build()
        out = prepared.ours()
    except Exception as err:   # a compile or launch failure of this case must not end the whole run
        result.status, result.note = "error", f"{type(err).__name__}: {_first_line(err)}"
        return result
    outputs, notes = _outputs(prepared.peers)
    notes.update(prepared.notes)
    errors = {name: instruments.error(out, ref) for name, ref in outputs.items()}
    reference = prepared.reference or next(iter(outputs), None)
    result.error = errors.get(reference)
    result.peers = {name: PeerResult(None, errors.get(name), notes.get(name, "")) for name in prepared.peers}
    if result.error is None:
        result.note = "unchecked: no peer ran"
    elif not result.error <= case.tolerance:
        result.status, result.note = "wrong", f"rel err {result.error:.1e} against {reference}: not timed"
        return result
    result.tessera = summarize(instruments.rounds(prepared.ours, case.timer))
    for name in outputs:
        result.peers[name].stats = summarize(instruments.rounds(prepared.peers[name], case.timer))
    return result


def run_cases(cases: Iterable[Case], instruments: Instruments, log: Callable[[str], None] = print) -> list[CaseResult]:
    """Every case in order, a line logged as each finishes."""
    results = []
    for case in cases:
        result = run_case(case, instruments)
        results.append(result)
        t = result.tessera
        log(f"  {case.name}: " + (f"{t.median:.4f} ms (MAD {t.mad:.4f})" if t else f"{result.status.upper()} {result.note}"))
    return results
