"""`tessera profile`'s arithmetic with recorded kernel timings: FLOPs and bytes from the Schedule IR,
rates, the roofline fraction and bound, occupancy and its limiter, split-K groups; ncu's CSV; --plot."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera import cli, platforms
from tessera.bench import ncu, roofline
from tessera.bench.cases import attention, causal_attention, gemm, layer_norm
from tessera.bench.profile_command import kernel_perfs
from tessera.errors import TesseraError

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "flash_attention.py")
H100 = platforms.get("sm_90a")
ROOF = roofline.Roof({"fp16": 989.4, "bf16": 989.4, "fp32": 66.9}, 3000.0)


def compiled(fn, dims, dtype="fp16"):
    return fn.compile(fn.arg_specs_for(dims, dtype), arch="sm_90a")


def test_matmul_work_is_2mnk_and_bytes_read_and_written_once():
    (w,) = roofline.kernel_work(compiled(gemm, dict(M=256, K=512, N=128), "bf16"))
    assert w.flops == 2 * 256 * 512 * 128
    assert w.bytes == 2 * (256 * 512 + 512 * 128 + 256 * 128)
    assert (w.kind, w.dtype) == ("gemm", "bf16")


@pytest.mark.parametrize("fn, factor", [(attention, 1.0), (causal_attention, 0.5)])
def test_attention_work_is_4bhssd_halved_for_causal(fn, factor):
    (w,) = roofline.kernel_work(compiled(fn, dict(B=2, H=3, S=256, D=64)))
    assert w.flops == 4 * 2 * 3 * 256 * 256 * 64 * factor
    assert w.bytes == 4 * 2 * 3 * 256 * 64 * 2


def test_row_kernels_do_no_tensor_work_and_sit_under_the_memory_roof():
    c = compiled(layer_norm, dict(M=1024, N=4096))
    (w,) = roofline.kernel_work(c)
    assert w.flops == 0 and w.bytes == 2 * (2 * 1024 * 4096 + 2 * 4096)
    (p,) = kernel_perfs(c, [w], {w.name: [0.004, 0.005, 0.006]}, ROOF, H100, {})
    assert p.bound == "memory"
    assert p.gbs == pytest.approx(w.bytes / 0.005 / 1e6)
    assert p.fraction == pytest.approx(p.gbs / 3000.0)


def test_a_compute_bound_gemm_against_the_peak_with_its_occupancy():
    c = compiled(gemm, dict(M=4096, K=4096, N=4096))
    works = roofline.kernel_work(c)
    name = works[0].name
    resources = {name: SimpleNamespace(registers=168, shared_bytes=0)}
    (p,) = kernel_perfs(c, works, {name: [0.21, 0.20, 0.19], "other_kernel": [9.0]}, ROOF, H100, resources)
    assert p.time_ms == 0.20 and p.bound == "compute"
    assert p.tflops == pytest.approx(2 * 4096 ** 3 / 0.20 / 1e9)
    assert p.fraction == pytest.approx(p.tflops / 989.4)
    launch = c.launches[name]
    blocks, limits = platforms.occupancy(H100, launch.threads, 168, launch.dynamic_shared)
    assert p.occupancy == ((name, blocks, limits),)
    text = roofline.render([p])
    assert f"{100 * p.fraction:.1f}%" in text and f"limited by {' and '.join(limits)}" in text


def test_ridge_point_decides_the_bound():
    assert ROOF.ridge("fp16") == pytest.approx(989.4e3 / 3000.0)
    work = roofline.KernelWork("k", "gemm", 300.0 * 1e6, 1e6, "fp16")   # 300 FLOP/byte, under the ridge
    assert roofline.KernelPerf(work, 1.0, ROOF).bound == "memory"


def test_no_peak_rate_means_no_roof_for_a_kernel_with_flops():
    work = roofline.KernelWork("k", "gemm", 1e9, 1e6, "fp8_e4m3")
    p = roofline.KernelPerf(work, 1.0, ROOF)
    assert (p.bound, p.fraction) == (None, None)
    assert "no peak rate for fp8_e4m3" in roofline.render([p])
    assert roofline.KernelPerf(roofline.KernelWork("e", "elementwise", 0.0, 1e6, "fp8_e4m3"), 1.0, ROOF).bound == "memory"


def test_split_k_groups_sum_their_kernels_and_unseen_kernels_have_no_time():
    works = [roofline.KernelWork("g", "gemm", 1.0, 1.0, "fp16"), roofline.KernelWork("h", "gemm", 1.0, 1.0, "fp16")]
    times = {"g_partials": [0.3, 0.1, 0.2], "g": [0.05]}
    assert roofline.group_times(works, times) == {"g": pytest.approx(0.25), "h": None}


def test_no_timings_leaves_rates_and_fraction_empty():
    c = compiled(gemm, dict(M=128, K=128, N=128))
    (p,) = kernel_perfs(c, roofline.kernel_work(c), None, None, H100, {})
    assert (p.time_ms, p.tflops, p.gbs, p.fraction, p.bound) == (None, None, None, None, None)


def test_peak_rates_scale_with_the_devices_sms():
    assert platforms.peak_tflops("sm_90a", "bf16") == 989.4
    assert platforms.peak_tflops(dataclasses.replace(H100, sm_count=66), "fp16") == pytest.approx(989.4 / 2)
    assert platforms.peak_tflops("sm_70", "bf16") is None
    assert platforms.peak_tflops("gfx942", "fp16") is None
    assert all(platforms.peak_tflops(p, "fp32") for p in platforms.all_platforms() if p.vendor == "nvidia")


def test_profile_on_the_cpu_reports_work_and_regions(capsys):
    status = cli.main(["profile", f"{EXAMPLE}:causal_flash_attention", "--shape", "B=1,H=2,S=128,D=32",
                       "--device", "cpu"])
    out = capsys.readouterr().out
    assert status == 0
    assert "ns per block" in out                       # the profile regions' report stays
    assert f"{4 * 2 * 128 * 128 * 32 * 0.5 / 1e9:.3f} GFLOP" in out and "no GPU" in out


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    status = cli.main(["profile", f"{EXAMPLE}:flash_attention", "--shape", "B=1,H=1,S=64,D=32",
                       "--device", "cpu", "--plot", "r.png"])
    assert status == 1 and "pip install 'tessera[plot]'" in capsys.readouterr().err
    with pytest.raises(TesseraError, match="matplotlib"):
        roofline.plot([], ROOF, "r.png")


NCU_CSV = '''==PROF== Connected to process 1
"ID","Process ID","Kernel Name","dram__throughput.avg.pct_of_peak_sustained_elapsed","sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
"","","","%","%","ratio"
"0","1","gemm_0","12.5","1,000.25","0.5"
"1","1","layer_norm_0","88.1","n/a",""
'''


def test_ncu_raw_csv_is_read_per_kernel():
    metrics = ncu.parse(NCU_CSV)
    assert metrics["gemm_0"] == {"DRAM throughput %": 12.5, "tensor pipe (mma.sync) %": 1000.25, "stall barrier": 0.5}
    assert metrics["layer_norm_0"] == {"DRAM throughput %": 88.1}
    assert ncu.parse("==ERROR== no kernels were profiled") == {}
    assert "tensor pipe (mma.sync) %" in ncu.render(metrics)


def test_ncu_runs_tessera_run_on_the_kernels_only():
    argv = ncu.command(["a_0", "b_1"], ["f.py:f", "--shape", "M=1"])
    assert argv[:6] == ["ncu", "--csv", "--page", "raw", "--kernel-name", "regex:^(a_0|b_1)$"]
    assert argv[-6:] == ["-m", "tessera", "run", "f.py:f", "--shape", "M=1"]


def gpu_stand_in(monkeypatch, ncu_result):
    """`tessera profile`'s GPU branch with the CPU interpreter running the kernels, recorded kernel
    times (0.5 ms each), the H100 roof, and ncu answering `ncu_result`."""
    from tessera.bench import profile_command
    device = dataclasses.replace(cli.DEVICES["cpu"], name="gpu", arch=lambda: "sm_90a")
    monkeypatch.setattr(cli, "pick_device", lambda name: device)
    monkeypatch.setattr(profile_command, "_gpu_platform", lambda: H100)
    monkeypatch.setattr(profile_command, "_gpu_measure",
                        lambda compiled, specs, seed, platform: ({n: [0.5] for n in compiled.launches}, ROOF))
    monkeypatch.setattr(ncu, "available", lambda: True)
    calls = []
    monkeypatch.setattr(ncu, "collect", lambda kernels, run_args: calls.append((kernels, run_args)) or ncu_result)
    return calls


def test_profile_with_timings_reports_rates_and_asks_ncu(monkeypatch, capsys):
    calls = gpu_stand_in(monkeypatch, ({}, "==ERROR== ERR_NVGPUCTRPERM - no permission for the counters"))
    status = cli.main(["profile", f"{EXAMPLE}:causal_flash_attention", "--shape", "B=1,H=2,S=512,D=32"])
    out = capsys.readouterr().out
    flops = 4 * 2 * 512 * 512 * 32 * 0.5
    assert status == 0
    assert f"{flops / 0.5 / 1e9:.1f} TFLOP/s" in out and "-bound (fp16 peak 989.4 TFLOP/s" in out
    assert "ncu: ==ERROR== ERR_NVGPUCTRPERM" in out
    ((kernels, run_args),) = calls
    assert kernels == ["causal_flash_attention_flash_attention_0"] and run_args[-2:] == ["--device", "gpu"]


def test_profile_prints_ncu_metrics_per_kernel(monkeypatch, capsys):
    gpu_stand_in(monkeypatch, ({"k_0": {"DRAM throughput %": 42.0}}, None))
    assert cli.main(["profile", f"{EXAMPLE}:flash_attention", "--shape", "B=1,H=1,S=64,D=32"]) == 0
    assert "ncu k_0\n    DRAM throughput %        42.00" in capsys.readouterr().out


def test_plot_draws_the_measured_kernels(tmp_path):
    work = roofline.KernelWork("gemm_0", "gemm", 2 * 4096 ** 3, 3 * 2 * 4096 ** 2, "fp16")
    roofline.plot([roofline.KernelPerf(work, 0.2, ROOF)], ROOF, str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
