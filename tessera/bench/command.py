"""`tessera bench`: the benchmark suites, their statistics, baselines and regression checks.

    tessera bench [--filter REGEX] [--quick] [--repeats N] [--json OUT.json] [--write-baseline]
                  [--compare BASELINE.json]          time the cases (GPU), write the JSON, print the table
    tessera bench --list [--filter REGEX] [--quick]    the cases, without running them
    tessera bench --compare BASELINE.json --results RUN.json   compare two result files (no GPU)
    tessera bench --report RUN.json ... >> bench/RESULTS.md    markdown tables of result files (no GPU)

Exit status: 1 when a compared case regressed (the rule is in tessera/bench/stats.py) or when a case
of this run failed or was wrong; 0 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

from ..errors import TesseraError
from . import results as res
from .cases import all_cases, select

DEFAULT_REPEATS = 7
MIN_REPEATS = 3   # a median and a MAD of fewer rounds say nothing about the noise


def default_json() -> Path:
    """$OUT/bench.json on the GPU machine (what comes back from it), bench/results/bench.json elsewhere."""
    return Path(os.environ["OUT"]) / "bench.json" if os.environ.get("OUT") else Path("bench/results/bench.json")


def add_parser(sub, parents) -> None:
    """The `bench` subcommand on the CLI's subparsers."""
    p = sub.add_parser("bench", parents=parents, help="time Tessera against its peers; JSON results, baselines, "
                       "regression checks", description=__doc__.splitlines()[0])
    p.add_argument("--filter", metavar="REGEX", help="only cases whose name or suite matches (re.search)")
    p.add_argument("--quick", action="store_true", help="one size per kind")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timing rounds per case and peer (default {DEFAULT_REPEATS}, at least {MIN_REPEATS})")
    p.add_argument("--json", metavar="OUT.json", help="where the results go (default $OUT/bench.json, else "
                                                       "bench/results/bench.json)")
    p.add_argument("--write-baseline", action="store_true",
                   help="also write the results as this device's baseline, bench/baselines/<device>.json")
    p.add_argument("--compare", metavar="BASELINE.json",
                   help="flag cases slower than the baseline beyond both runs' noise; exit 1 on any")
    p.add_argument("--results", metavar="RUN.json", help="with --compare: compare this result file instead of running")
    p.add_argument("--report", nargs="+", metavar="RUN.json", help="print the markdown table of result files and exit")
    p.add_argument("--list", action="store_true", help="print the cases that would run, and exit")
    p.set_defaults(command=cmd_bench)


def check_arguments(args: argparse.Namespace) -> None:
    """Combinations that mean nothing are errors, before anything runs."""
    if args.repeats < MIN_REPEATS:
        raise TesseraError(f"--repeats must be at least {MIN_REPEATS}, got {args.repeats}")
    if args.filter is not None:
        try:
            re.compile(args.filter)
        except re.error as err:
            raise TesseraError(f"bad --filter regular expression {args.filter!r}: {err}") from None
    if args.results and not args.compare:
        raise TesseraError("--results names a run to compare: give --compare BASELINE.json too")
    running = [o for o, v in (("--write-baseline", args.write_baseline), ("--json", args.json)) if v]
    if args.results and running:
        raise TesseraError(f"--results compares an existing run; {', '.join(running)} belong to a new run")
    if args.report and (args.compare or args.list or running):
        raise TesseraError("--report renders result files; it takes no other action")


def load(path: str) -> res.BenchRun:
    try:
        return res.load(path)
    except ValueError as err:
        raise TesseraError(f"not a tessera bench result: {err}") from None


def command_text(args: argparse.Namespace) -> str:
    """The command line that reproduces a run (what the result file records)."""
    words = ["tessera", "bench", *(["--quick"] if args.quick else []),
             *(["--filter", args.filter] if args.filter else []), "--repeats", str(args.repeats)]
    return shlex.join(words)


def cmd_bench(args: argparse.Namespace) -> int:
    """Renders (--report), compares files (--results), lists (--list), or runs the cases, then saves,
    records a baseline and compares as asked."""
    check_arguments(args)
    if args.report:
        print("\n".join(res.render_markdown(load(p)) for p in args.report), end="")
        return 0
    if args.results:
        return report_comparison(load(args.compare), load(args.results))
    cases = select(all_cases(args.quick), args.filter)
    if not cases:
        raise TesseraError(f"no benchmark case matches --filter {args.filter!r} (see tessera bench --list)")
    if args.list:
        for case in cases:
            print(f"{case.suite:9}  {case.name}")
        return 0
    baseline = load(args.compare) if args.compare else None
    run = run_benchmarks(cases, args)
    written = res.save(run, args.json or default_json())
    print(res.render_markdown(run))
    print(f"wrote {written}")
    if args.write_baseline:
        print(f"wrote baseline {res.save(run, res.baseline_path(run.environment['device'] or 'unknown'))}")
    status = 0 if all(c.status == "ok" for c in run.cases) else 1
    return max(status, report_comparison(baseline, run) if baseline else 0)


def report_comparison(baseline: res.BenchRun, run: res.BenchRun) -> int:
    """Prints the case-by-case comparison; 1 when any case regressed."""
    comparison = res.compare_runs(baseline, run)
    print(comparison.render())
    return 1 if comparison.regressions else 0


def require_gpu() -> None:
    """Timing needs torch with CUDA, Triton (do_bench) and Tessera's driver bindings."""
    try:
        import torch
        import triton  # noqa: F401
        from ..runtime import driver
        if torch.cuda.is_available() and driver.device_count() > 0:
            return
        reason = "torch sees no CUDA device"
    except ImportError as err:
        reason = f"{err.name or err} is not installed"
    except RuntimeError as err:
        reason = str(err).splitlines()[0]
    raise TesseraError(f"tessera bench times kernels on a CUDA GPU: {reason} (--list, --report and "
                       f"--compare with --results work without one)")


def measure_on_gpu(args: argparse.Namespace):
    """(the GPU's Instruments, its measured copy bandwidth in GB/s): the run's only GPU-bound piece."""
    require_gpu()
    from . import timing
    from .runner import gpu_instruments
    return gpu_instruments(args.repeats), timing.copy_bandwidth()


def run_benchmarks(cases, args: argparse.Namespace) -> res.BenchRun:
    """Times `cases` with this machine's instruments, with its copy bandwidth and description."""
    from . import environment, timing
    from .runner import run_cases
    instruments, copy_gbs = measure_on_gpu(args)
    env = environment.describe(command_text(args), copy_gbs)
    print(f"{env['device']}: {len(cases)} cases, {args.repeats} rounds each", flush=True)
    results = run_cases(cases, instruments, log=lambda line: print(line, flush=True))
    settings = {"repeats": args.repeats, "warmup_ms": timing.WARMUP_MS, "rep_ms": timing.REP_MS}
    return res.BenchRun(env, settings, results)
