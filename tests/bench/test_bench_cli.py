"""`tessera bench` and `tessera profile` on the command line, without a GPU: argument errors, listing,
comparing and rendering result files."""
from __future__ import annotations

import sys

import pytest
from bench_fakes import NOISY, TIGHT, case, run, scaled

from tessera import cli
from tessera.bench import command
from tessera.bench import results as res
from tessera.errors import TesseraError


def bench(capsys, *argv):
    status = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "2"], "--repeats must be at least 3"),
    (["--filter", "(unclosed"], "bad --filter regular expression"),
    (["--results", "x.json"], "give --compare BASELINE.json too"),
    (["--compare", "a.json", "--results", "b.json", "--write-baseline"], "--write-baseline belong to a new run"),
    (["--report", "a.json", "--compare", "b.json"], "--report renders result files"),
    (["--list", "--filter", "no such case$"], "no benchmark case matches"),
    (["--report", "missing.json"], "missing.json"),
])
def test_argument_errors_are_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    status, out, err = bench(capsys, *argv)
    assert status == 1 and err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_help_needs_no_gpu(capsys):
    for sub in ("bench", "profile"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([sub, "--help"])
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--compare BASELINE.json" in out and "--plot FILE.png" in out


def test_list_prints_the_selected_cases(capsys):
    status, out, _ = bench(capsys, "--list", "--quick", "--filter", "split_k")
    assert status == 0
    assert out.splitlines() == ["variants   gemm 128x4096x4096 fp16 (native, split_k=derived)",
                                "variants   gemm 128x4096x4096 fp16 (native, split_k=1)"]


def write(tmp_path, name, bench_run):
    return str(res.save(bench_run, tmp_path / name))


def test_compare_files_exits_1_on_a_regression_only(capsys, tmp_path):
    base = write(tmp_path, "base.json", run([case("tight", TIGHT), case("noisy", NOISY), case("gone", TIGHT)]))
    noise = write(tmp_path, "noise.json", run([case("tight", TIGHT), case("noisy", scaled(NOISY, 1.03))]))
    slower = write(tmp_path, "slower.json", run([case("tight", scaled(TIGHT, 1.03)), case("noisy", NOISY)]))
    status, out, _ = bench(capsys, "--compare", base, "--results", noise)
    assert status == 0 and "missing      gone" in out
    status, out, _ = bench(capsys, "--compare", base, "--results", slower)
    assert status == 1 and "regression   tight" in out


def test_report_renders_each_file(capsys, tmp_path):
    a = write(tmp_path, "a.json", run([case("gemm a", TIGHT, NOISY)]))
    b = write(tmp_path, "b.json", run([case("gemm b", TIGHT)], device="NVIDIA H200"))
    status, out, _ = bench(capsys, "--report", a, b)
    assert status == 0 and out == "\n".join(res.render_markdown(res.load(p)) for p in (a, b))
    assert out.startswith("### 2026-11-23T18:00:00Z: NVIDIA H100")


def test_timing_without_a_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)     # import triton -> ImportError
    with pytest.raises(TesseraError, match="triton is not installed"):
        command.require_gpu()


def test_default_json_goes_under_out(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert command.default_json() == tmp_path / "bench.json"
    monkeypatch.delenv("OUT")
    assert str(command.default_json()) == "bench/results/bench.json"


def fake_gpu(monkeypatch, tmp_path, samples, error=lambda out, ref: 0.0 if out == ref else 1.0):
    """`tessera bench` on recorded timings: a case per entry of `samples`, a device name, baselines under
    tmp_path."""
    from tessera.bench import environment
    from tessera.bench.cases import Case, Prepared
    from tessera.bench.runner import Instruments

    cases = [Case(name, "gemm", "TFLOP/s", 2e12, lambda name=name: Prepared(lambda: name, {"torch.matmul": lambda: name}))
             for name in samples]
    monkeypatch.setattr(command, "all_cases", lambda quick: cases)
    monkeypatch.setattr(command, "measure_on_gpu", lambda args: (Instruments(lambda fn, timer: samples[fn()], error),
                                                                 3000.0))
    monkeypatch.setattr(environment, "gpu", lambda: ("NVIDIA H100 80GB HBM3", "580.159.04"))
    monkeypatch.setattr(res, "BASELINES", tmp_path / "baselines")


def test_a_run_writes_json_and_baseline_then_compares(capsys, monkeypatch, tmp_path):
    fake_gpu(monkeypatch, tmp_path, {"tight": TIGHT, "noisy": NOISY})
    status, out, _ = bench(capsys, "--json", "run1.json", "--write-baseline", "--filter", "i")
    assert status == 0 and "| tight | torch.matmul | 1.000 |" in out
    first = res.load("run1.json")
    assert [c.name for c in first.cases] == ["tight", "noisy"]      # "i" matches both
    assert first.environment["device"] == "NVIDIA H100 80GB HBM3" and first.environment["copy_gbs"] == 3000.0
    assert first.environment["command"] == "tessera bench --filter i --repeats 7"
    assert set(first.environment["versions"]) >= {"torch", "triton", "cuda-bindings", "tessera"}
    baseline = tmp_path / "baselines" / "nvidia-h100-80gb-hbm3.json"
    assert res.load(baseline) == first

    fake_gpu(monkeypatch, tmp_path, {"tight": scaled(TIGHT, 1.03), "noisy": scaled(NOISY, 1.03)})
    status, out, _ = bench(capsys, "--json", "run2.json", "--compare", str(baseline))
    assert status == 1 and "regression   tight" in out and "unchanged    noisy" in out


def test_a_wrong_case_fails_the_run(capsys, monkeypatch, tmp_path):
    fake_gpu(monkeypatch, tmp_path, {"c": TIGHT}, error=lambda out, ref: 1.0)
    status, out, _ = bench(capsys, "--json", "run.json")
    assert status == 1 and "WRONG" in out and res.load("run.json").cases[0].status == "wrong"
