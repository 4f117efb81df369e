"""Result files: the JSON round trip, the markdown table, and comparisons with cases missing on either side."""
from __future__ import annotations

import json

import pytest
from bench_fakes import NOISY, TIGHT, case, run, scaled

from tessera.bench import results as res


def test_json_round_trip(tmp_path):
    original = run([case("gemm 4096^3 fp16 (native)", TIGHT, NOISY), case("attention x", None, status="wrong")])
    path = res.save(original, tmp_path / "nested" / "bench.json")
    data = json.loads(path.read_text())
    assert data["schema"] == res.SCHEMA
    assert data["cases"][0]["tessera"]["iqr"] == pytest.approx(data["cases"][0]["tessera"]["q3"]
                                                              - data["cases"][0]["tessera"]["q1"])
    assert set(data["environment"]["versions"]) == {"python", "torch", "triton", "cuda-bindings", "tessera"}
    assert res.load(path) == original


def test_a_file_of_another_schema_is_refused(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"device": "H100", "rows": []}))
    with pytest.raises(ValueError, match="old.json"):
        res.load(path)


def test_markdown_has_a_row_per_peer_with_ratio_and_rates():
    r = run([case("gemm 4096^3 fp16 (native)", [0.2] * 5, [0.25] * 5, work=2 * 4096 ** 3)])
    text = res.render_markdown(r)
    assert "NVIDIA H100 80GB HBM3, driver 580.159.04" in text and "commit 1b7b2e7000" in text
    header, rule, row = [line for line in text.splitlines() if line.startswith("|")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == len(res.COLUMNS) == header.count("|") - 1
    assert cells[:3] == ["gemm 4096^3 fp16 (native)", "torch.matmul", "0.200"]
    assert cells[6] == "1.25"                                   # peer / tessera
    assert cells[7] == f"{2 * 4096 ** 3 / 0.2 / 1e9:.1f}"       # TFLOP/s
    assert cells[9] == "TFLOP/s"


def test_markdown_marks_an_untimed_case():
    text = res.render_markdown(run([case("softmax 1x1 fp16", None, status="wrong", unit="GB/s")]))
    assert "| softmax 1x1 fp16 | - | WRONG: rel err 5.0e-01" in text


def test_rates_by_unit():
    assert res.rate(2e12, "TFLOP/s", 2.0) == pytest.approx(1000.0)
    assert res.rate(3e9, "GB/s", 1.0) == pytest.approx(3000.0)
    assert res.rate(None, "us/call", 0.03) == pytest.approx(30.0)
    with pytest.raises(ValueError):
        res.rate(1.0, "furlongs", 1.0)


def test_compare_flags_only_regressions_beyond_noise():
    base = run([case("tight", TIGHT), case("noisy", NOISY)])
    new = run([case("tight", scaled(TIGHT, 1.03)), case("noisy", scaled(NOISY, 1.03))])
    comparison = res.compare_runs(base, new)
    assert {c.name: c.kind for c in comparison.cases} == {"tight": "regression", "noisy": "unchanged"}
    assert [c.name for c in comparison.regressions] == ["tight"]
    assert "tight: 1.0000 -> 1.0300 ms (+3.0%" in comparison.render()


def test_cases_missing_on_either_side_are_reported_not_failed():
    base = run([case("kept", TIGHT), case("dropped", TIGHT)])
    new = run([case("kept", TIGHT), case("added", TIGHT)])
    comparison = res.compare_runs(base, new)
    assert {c.name: c.kind for c in comparison.cases} == {"kept": "unchanged", "dropped": "missing", "added": "new"}
    assert not comparison.regressions
    assert "dropped: in the baseline, not in this run" in comparison.render()


def test_a_case_that_turned_wrong_is_a_regression():
    comparison = res.compare_runs(run([case("c", TIGHT)]), run([case("c", None, status="wrong")]))
    assert [c.kind for c in comparison.regressions] == ["wrong"]


def test_other_device_is_noted():
    comparison = res.compare_runs(run([case("c", TIGHT)]), run([case("c", TIGHT)], device="NVIDIA H200"))
    assert comparison.notes and "NVIDIA H200" in comparison.notes[0]


def test_baseline_path_is_the_device_name_as_a_slug(tmp_path):
    assert res.baseline_path("NVIDIA H100 80GB HBM3", tmp_path) == tmp_path / "nvidia-h100-80gb-hbm3.json"
    assert res.baseline_path("NVIDIA H100 80GB HBM3").parent.name == "baselines"


def test_environment_records_versions_and_commit_without_a_gpu(monkeypatch):
    from tessera.bench import environment
    monkeypatch.setattr(environment, "gpu", lambda: (None, None))
    env = environment.describe("tessera bench --repeats 7", None)
    assert set(env["versions"]) == {"python", "torch", "triton", "cuda-bindings", "tessera"}
    assert env["versions"]["tessera"] == "0.1.0"
    assert env["commit"] is None or len(env["commit"]) == 40
    assert (env["device"], env["command"]) == (None, "tessera bench --repeats 7")


def test_driver_version_from_the_cuda_driver_api():
    from types import SimpleNamespace

    from tessera.bench import environment
    assert environment._cuda_version(SimpleNamespace(_call=lambda api: 13000)) == "CUDA 13.0"
    assert environment._cuda_version(SimpleNamespace(_call=lambda api: 1 / 0)) is None
