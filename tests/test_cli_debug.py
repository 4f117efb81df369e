"""The command line's debugging options: `compile --line-info`, `profile` and `run --profile`."""
from __future__ import annotations

import re
import textwrap

import pytest

from tessera import cli

SOURCE = textwrap.dedent("""\
    import tessera as tsr
    from tessera import Tensor


    @tsr.function
    def scaled_softmax(x: Tensor["M", "N"]):
        with tsr.profile_region("scale"):
            y = x * 2.0
        with tsr.profile_region("softmax"):
            return tsr.softmax(y, dim=-1)
    """)


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cubin-cache"))
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    return status, capsys.readouterr().out


@pytest.mark.parametrize("command", [["profile"], ["run", "--profile"]])
def test_profile_reports_each_region_of_each_kernel(capsys, user_file, command):
    status, out = run_cli(capsys, *command, str(user_file), "--shape", "M=8,N=100", "--dtype", "fp32",
                          "--device", "cpu")
    assert status == 0
    assert re.search(r"scaled_softmax_row_reduction_0: [\d,]+ ns per block \(median of 1 blocks\)", out)
    for region in ("scale", "softmax"):
        assert re.search(rf"^  {region}\s+[\d,]+ ns\s+[\d.]+%$", out, re.MULTILINE), out


def test_run_without_profile_reports_nothing(capsys, user_file):
    status, out = run_cli(capsys, "run", str(user_file), "--shape", "M=8,N=100", "--dtype", "fp32", "--device", "cpu")
    assert status == 0 and "per block" not in out


@pytest.mark.parametrize("line_info", [True, False])
def test_compile_line_info_points_the_ptx_at_the_users_file(capsys, user_file, tmp_path, line_info):
    flags = ["--line-info"] if line_info else []
    status, _ = run_cli(capsys, "compile", str(user_file), "--shape", "M=8,N=100", "--arch", "sm_80",
                        "--dump-ir=ptx", "-o", str(tmp_path / "out"), *flags)
    assert status == 0
    ptx = (tmp_path / "out" / "scaled_softmax_row_reduction_0.ptx").read_text()
    assert (f'.file 1 "{user_file}"' in ptx) == line_info
    assert bool(re.search(r"^\s*\.loc 1 8 0$", ptx, re.MULTILINE)) == line_info   # y = x * 2.0
