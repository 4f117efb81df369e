"""device_assert and profile regions on a real GPU.

A failing device assert traps the kernel, which leaves the process's CUDA context unusable, so
those cases run in a subprocess and check its output: CUDA prints the message, the user's
file:line and the block and thread."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tessera as tsr
from tessera import Tensor

CHECKED = textwrap.dedent("""\
    import torch
    import tessera as tsr
    from tessera import Tensor


    @tsr.function
    def checked(x: Tensor["M", "N"]):
        y = x * 2.0
        tsr.device_assert(y > 0, "x must be positive")
        return y + 1.0


    x = torch.ones(64, 300, device="cuda")
    x[{row}, {col}] = {value}
    out = checked(x)
    torch.cuda.synchronize()
    print("finished", float(out.sum()))
    """)
ASSERT_LINE = 9   # the device_assert's line in CHECKED


def run_script(tmp_path, row: int, col: int, value: float) -> tuple[subprocess.CompletedProcess, str]:
    script = tmp_path / "checked.py"
    script.write_text(CHECKED.format(row=row, col=col, value=value))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    return proc, str(script)


def test_a_failing_device_assert_stops_the_kernel_and_names_the_line(torch_cuda, tmp_path):
    proc, script = run_script(tmp_path, row=20, col=200, value=-1.0)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "finished" not in proc.stdout, output
    assert "x must be positive" in output, output
    assert f"{script}:{ASSERT_LINE}" in output, output
    assert "block: [" in output and "thread: [" in output, output


def test_a_holding_device_assert_lets_the_kernel_finish(torch_cuda, tmp_path):
    proc, _ = run_script(tmp_path, row=20, col=200, value=5.0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished" in proc.stdout


@tsr.function
def profiled(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    with tsr.profile_region("mainloop"):
        c = tsr.matmul(a, b)
    with tsr.profile_region("epilogue"):
        return tsr.gelu(c)


@tsr.function
def profiled_softmax(x: Tensor["M", "N"]):
    with tsr.profile_region("scale"):
        y = x * 0.5
    with tsr.profile_region("softmax"):
        return tsr.softmax(y, dim=-1)


@pytest.mark.parametrize("fn, shapes", [
    (profiled, [(1024, 512), (512, 1024)]),
    (profiled_softmax, [(512, 4096)]),
])
def test_profile_regions_read_back_plausible_cycles(torch_cuda, fn, shapes):
    torch = torch_cuda
    inputs = [torch.randn(*s, device="cuda", dtype=torch.float16) for s in shapes]
    expected = fn(*inputs)
    tsr.reset_profile()
    out = fn(*inputs, profile=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    report = tsr.profile_report()
    assert report, "no profiled kernel recorded"
    labels = set()
    for kernel in report.values():
        assert kernel.unit == "cycles" and kernel.blocks >= 1 and kernel.median > 0
        for region in kernel.regions:
            labels.add(region.label)
            assert region.median > 0 and 0 <= region.begin < region.end
            assert 0 < region.share <= 1
    assert labels == ({"mainloop", "epilogue"} if fn is profiled else {"scale", "softmax"})
