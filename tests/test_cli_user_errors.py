"""`tessera` on mistakes in the user's code and on targets without a backend: one `error:` line with
the user's file:line, exit 1 (issue 13, item 6)."""
from __future__ import annotations

import textwrap

import pytest

from tessera import cli

MATMUL = """
import tessera as tsr
from tessera import Tensor


@tsr.function
def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return a @ b
"""


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cubin-cache"))


def write(tmp_path, source: str, name: str = "model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_an_exception_in_user_code_is_one_line_at_its_line(capsys, tmp_path):
    path = write(tmp_path, """
        import tessera as tsr
        from tessera import Tensor


        @tsr.function
        def f(x: Tensor["S", "D"]):
            return x.no_such_method(2)
    """)
    status, _, err = run_cli(capsys, "run", str(path), "--shape", "S=4,D=8", "--device", "cpu")
    assert status == 1
    assert err.splitlines() == ["error: AttributeError: 'Tensor' object has no attribute 'no_such_method'",
                                f"  at {path}:8"]


def test_an_exception_raised_while_importing_the_file_is_one_line(capsys, tmp_path):
    path = write(tmp_path, "import tessera\nvalue = undefined_name + 1\n")
    status, _, err = run_cli(capsys, "run", str(path), "--shape", "S=4")
    assert status == 1
    assert err.splitlines() == ["error: NameError: name 'undefined_name' is not defined", f"  at {path}:2"]


def test_a_syntax_error_is_one_line(capsys, tmp_path):
    path = write(tmp_path, "import tessera\ndef f(:\n")
    status, _, err = run_cli(capsys, "compile", str(path), "--shape", "S=4")
    assert status == 1
    assert err.splitlines()[0].startswith("error: SyntaxError: ")
    assert err.splitlines()[1] == f"  at {path}:2"


def test_a_compiler_bug_keeps_its_traceback(capsys, tmp_path, monkeypatch):
    """An exception raised inside Tessera is not the user's to fix: it propagates with its traceback."""
    path = write(tmp_path, MATMUL)

    def broken(*args, **kwargs):
        raise RuntimeError("internal")
    monkeypatch.setattr(cli, "parse_shape", broken)
    with pytest.raises(RuntimeError, match="internal"):
        cli.main(["compile", str(path), "--shape", "M=64,N=64,K=64"])


def test_compile_for_a_target_without_a_backend_fails_naming_it(capsys, tmp_path):
    path = write(tmp_path, MATMUL)
    status, _, err = run_cli(capsys, "compile", str(path), "--shape", "M=64,N=64,K=64", "--arch", "gfx90a",
                             "-o", str(tmp_path / "out"))
    assert status == 1
    assert err.startswith("error: no backend for gfx90a (amd): Tessera emits code for nvidia GPUs (PTX and CUDA Tile IR) only")
    assert (tmp_path / "out" / "tile.mlir").is_file()   # the IR dumps are still written


def test_compile_of_a_kernel_the_backend_cannot_emit_fails(capsys, tmp_path):
    """sm_75's tensor-core instruction (mma.sync m16n8k8) has no PTX emitter: exit 1, not a silent success."""
    path = write(tmp_path, MATMUL)
    status, _, err = run_cli(capsys, "compile", str(path), "--shape", "M=64,N=64,K=64", "--arch", "sm_75",
                             "-o", str(tmp_path / "out"))
    assert status == 1
    assert err.startswith("error: the PTX backend cannot compile mm for sm_75: ")
