"""Reading profile stamps back (medians over blocks, shares of the kernel's time), finding a GPU
program's stamp buffers, and ptxas's -lineinfo for PTX with line info."""
import subprocess

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.runtime import profile, ptxas


def stamps(per_block: list[list[tuple[int, int]]]) -> np.ndarray:
    """A stamp buffer [1, 1, blocks, slots, 4] of i32 words from (begin, end) pairs per block and slot."""
    pairs = np.array(per_block, dtype=np.int64)          # [blocks, slots, 2]
    return pairs.view(np.int32).reshape(1, 1, len(per_block), pairs.shape[1], 4)


def test_summary_takes_medians_over_blocks_and_shares_of_each_block():
    big = 2**40   # stamps past 32 bits survive the two-word encoding
    buffer = stamps([[(big, big + 100), (big + 10, big + 60)],
                     [(big, big + 200), (big + 20, big + 120)],
                     [(big, big + 400), (big + 0, big + 100)]])
    summary = profile.summarize("k", ["k", "loop"], buffer, "cycles")
    assert (summary.kernel, summary.unit, summary.blocks, summary.median) == ("k", "cycles", 3, 200)
    (loop,) = summary.regions
    assert (loop.label, loop.median, loop.share, loop.begin, loop.end) == ("loop", 100, 0.5, 10, 100)
    assert "loop" in str(summary) and "50.0%" in str(summary)


def test_record_keeps_the_latest_launch_of_each_kernel():
    profile.reset_profile()
    profile.record("a", ["a"], stamps([[(0, 5)]]), "ns")
    profile.record("b", ["b"], stamps([[(0, 7)]]), "ns")
    profile.record("a", ["a"], stamps([[(0, 9)]]), "ns")
    report = tsr.profile_report()
    assert list(report) == ["b", "a"] and report["a"].median == 9
    tsr.reset_profile()
    assert str(tsr.profile_report()) == "no profiled kernel has run"


@tsr.function
def two_kernels(x: Tensor["M", "N"]):
    with tsr.profile_region("norm"):
        y = tsr.softmax(x, dim=-1)
    return y.sum(dim=-1, keepdim=True)


def test_profiled_launches_name_each_kernels_stamp_buffer():
    compiled = two_kernels.compile(two_kernels.arg_specs_for({"M": 8, "N": 64}, "fp32"), profile=True)
    launches = profile.profiled_launches(compiled)
    assert [(p.kernel, p.labels) for p in launches] == [
        ("two_kernels_row_reduction_0", ("two_kernels_row_reduction_0", "norm")),
        ("two_kernels_row_reduction_1", ("two_kernels_row_reduction_1",))]
    # host allocations: the first kernel's output, its stamps, the second kernel's stamps
    assert [p.intermediate for p in launches] == [1, 2]


@pytest.mark.parametrize("ptx, flag", [(".version 8.0\n    .loc 1 12 0\n", True), (".version 8.0\n", False)])
def test_ptxas_gets_lineinfo_exactly_when_the_ptx_has_line_info(monkeypatch, ptx, flag):
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ptxas fatal   : stop here")
    monkeypatch.setattr(ptxas, "_tool", lambda name: name)
    monkeypatch.setattr(ptxas.subprocess, "run", fake_run)
    with pytest.raises(ptxas.PtxasError):
        ptxas.assemble(ptx, "sm_80")
    with pytest.raises(ptxas.PtxasError):
        ptxas.assemble(ptx, "sm_80", line_info=True)
    assert [("-lineinfo" in cmd) for cmd in commands] == [flag, True]
