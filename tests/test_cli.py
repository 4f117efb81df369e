"""The `tessera` command line, called in-process through `main` (one real `python -m tessera`
run checks the module entry point and that errors leave no traceback)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import re
import shutil

import pytest

from tessera import cli
from tessera.compiler import IR_STAGES
from tessera.errors import TesseraError
from tessera.ir import parse_ir, print_ir

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "flash_attention.py")
ATTENTION = f"{EXAMPLE}:flash_attention"
CAUSAL = f"{EXAMPLE}:causal_flash_attention"
SMALL = "B=1,H=2,S=80,D=32"  # S not a multiple of the 64-row blocks: exercises the edge masks


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Default output directories, and the cubin cache, land in the test's own folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cubin-cache"))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Every stage of the small flash attention, written once by `tessera compile`."""
    out = tmp_path_factory.mktemp("dumps")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cubin-cache")))
        assert cli.main(["compile", ATTENTION, "--shape", SMALL, "--dump-ir=all", "-o", str(out)]) == 0
    return out


def test_compile_writes_every_stage_and_each_parses_back(dumps):
    for stage in IR_STAGES:
        text = (dumps / f"{stage}.mlir").read_text()
        module = parse_ir(text)
        module.verify()
        assert print_ir(module) == text
    assert (dumps / "flash_attention_flash_attention_0.ptx").read_text().startswith(".version")


def test_dump_ir_ptx_writes_only_the_kernels_ptx(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "compile", CAUSAL, "--shape", SMALL, "--dump-ir=ptx", "-o", str(tmp_path / "out"))
    assert status == 0
    kernel = "causal_flash_attention_flash_attention_0"
    binaries = [f"{kernel}.cubin"] if shutil.which("ptxas") else []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([*binaries, f"{kernel}.ptx"])
    assert ".entry " + kernel in (tmp_path / "out" / f"{kernel}.ptx").read_text()


def test_compile_summary_and_default_directory(capsys):
    status, out, err = run_cli(capsys, "compile", CAUSAL, "--shape", SMALL, "--dump-ir=graph,tile")
    assert status == 0 and err == ""
    assert "causal_flash_attention_flash_attention_0" in out
    written = sorted(p.name for p in Path("tessera_out", "causal_flash_attention").iterdir())
    kernel = "causal_flash_attention_flash_attention_0"
    binaries = [f"{kernel}.cubin"] if shutil.which("ptxas") else []
    assert written == sorted([*binaries, f"{kernel}.ptx", "graph.mlir", "tile.mlir"])


def test_compile_writes_assembling_ptx(capsys, tmp_path):
    """The PTX written is the backend's, and assembles (the cubin beside it is ptxas's output)."""
    status, out, _ = run_cli(capsys, "compile", CAUSAL, "--shape", SMALL, "-o", str(tmp_path))
    assert status == 0
    ptx = (tmp_path / "causal_flash_attention_flash_attention_0.ptx").read_text()
    assert "mma.sync.aligned.m16n8k16" in ptx and "cp.async.cg.shared.global" in ptx
    if shutil.which("ptxas"):
        assert (tmp_path / "causal_flash_attention_flash_attention_0.cubin").read_bytes()[:4] == b"\x7fELF"


def test_compile_backend_cuda_tile_writes_cuda_tile_ir(capsys, tmp_path):
    """--backend cuda-tile writes each kernel's CUDA Tile IR (text and bytecode) and, with tileiras,
    its cubin and launch; no PTX."""
    from tessera.backends.cuda_tile import tools

    status, out, _ = run_cli(capsys, "compile", CAUSAL, "--shape", SMALL, "--backend", "cuda-tile",
                             "--dump-ir", "tile", "-o", str(tmp_path))
    assert status == 0 and "backend cuda-tile)" in out
    name = "causal_flash_attention_flash_attention_0"
    assert (tmp_path / f"{name}.cuda_tile.mlir").read_text().startswith(f"cuda_tile.module @{name}")
    assert (tmp_path / f"{name}.tilebc").stat().st_size > 0 and not list(tmp_path.glob("*.ptx"))
    if tools.available():
        assert (tmp_path / f"{name}.cubin").read_bytes()[:4] == b"\x7fELF" and "threads" in out
    else:
        assert "tileiras not found" in out


SCORES_SOURCE = """
import tessera as tsr

@tsr.function
def scores(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
    return tsr.softmax(tsr.matmul(a, b), dim=-1)
"""


@pytest.mark.parametrize("installed", [True, False])
def test_compile_auto_reports_each_kernels_backend_and_the_rules(capsys, tmp_path, monkeypatch, installed):
    """fp32 scores under the default `--backend auto`: with tileiras the GEMM is CUDA Tile IR and
    the softmax PTX, each kernel's report says which and by what rule, and the rules' reasons
    follow; without tileiras the report says why the GEMM stayed with PTX, which cannot emit it."""
    from tessera.passes import backend_choice

    monkeypatch.setattr(backend_choice, "_tileiras_installed", lambda: installed)
    source = tmp_path / "scores.py"
    source.write_text(SCORES_SOURCE)
    argv = ("compile", f"{source}:scores", "--shape", "M=64,K=32,N=96", "--dtype", "fp32", "--dump-ir", "schedule",
            "-o", str(tmp_path / "out"))
    if not installed:
        status, _, err = run_cli(capsys, *argv)
        assert status != 0 and re.search(r"PTX backend cannot compile scores .*tessera\[cuda-tile\]", err)
        assert 'backend_why = "rule measured (fp32_matmul: cuda-tile cannot compile it, tileiras is not installed' \
            in (tmp_path / "out" / "schedule.mlir").read_text()
        return
    status, out, _ = run_cli(capsys, *argv)
    assert status == 0 and "native path, backend auto)" in out
    assert (tmp_path / "out" / "scores_gemm_0.cuda_tile.mlir").is_file()
    assert (tmp_path / "out" / "scores_row_reduction_1.ptx").is_file()
    assert not (tmp_path / "out" / "scores_gemm_0.ptx").exists()
    assert re.search(r"scores_gemm_0\n +backend +cuda-tile \(rule fp32_matmul\)", out) or "tileiras not found" in out
    assert re.search(r"backend rules +fp32_matmul: cuda-tile, its matmul's fp32 operands have no matrix instruction", out)


GEMM_SOURCE = """
import tessera as tsr

@tsr.function
def gemm(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
    return tsr.matmul(a, b)
"""


@pytest.mark.parametrize("path, instruction", [("native", "wgmma.mma_async"), ("ampere", "mma.sync.aligned")])
def test_compile_path_picks_the_gemm_instruction(capsys, tmp_path, path, instruction):
    """On sm_90a the native path writes a TMA + wgmma GEMM; --path ampere the mma.sync one."""
    source = tmp_path / "gemm.py"
    source.write_text(GEMM_SOURCE)
    status, out, _ = run_cli(capsys, "compile", f"{source}:gemm", "--shape", "M=256,K=128,N=256", "--arch", "sm_90a",
                             "--path", path, "-o", str(tmp_path / "out"))
    assert status == 0 and f"{path} path" in out
    (ptx,) = (tmp_path / "out").glob("*.ptx")
    assert instruction in ptx.read_text()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_compile_reports_each_kernels_launch_and_resources(capsys, tmp_path):
    """Per kernel: its backend and the rule that chose it, grid and threads, the schedule, ptxas's
    registers and spills, and the blocks an SM holds with what limits them (a persistent native
    GEMM: one per SM, as its grid assumes); then the reason of each rule named."""
    source = tmp_path / "gemm.py"
    source.write_text(GEMM_SOURCE)
    status, out, _ = run_cli(capsys, "compile", f"{source}:gemm", "--shape", "M=4096,K=512,N=4096",
                             "--arch", "sm_90a", "-o", str(tmp_path / "out"))
    assert status == 0
    report = out[out.index("\n  gemm_gemm_0\n    backend"):]
    assert re.search(r"backend +ptx \(rule measured\)", report)
    assert re.search(r"backend rules +measured: ptx, the PTX backend's kernels were faster", report)
    assert re.search(r"launch +grid 132 x 1 x 1, 256 threads, 210\.0 KiB dynamic shared memory", report)   # buffers, mbarriers, staging
    assert re.search(r"schedule +block_m=128 block_n=256 .*persistent=1 .*programs=132", report)
    assert re.search(r"ptxas +\d+ registers, 0 bytes static shared memory, no spills", report)   # all of it placed in the IR
    assert re.search(r"per SM +1 block \(limited by (registers and )?shared memory\)", report)


@pytest.mark.parametrize("target", [ATTENTION, CAUSAL])
def test_run_reports_small_error(capsys, target):
    status, out, _ = run_cli(capsys, "run", target, "--shape", SMALL, "--seed", "1")
    assert status == 0
    line = next(line for line in out.splitlines() if "relative error" in line)
    relative = float(line.split("relative error ")[1].split()[0])
    assert relative < 2e-2 and line.endswith("PASS")


def test_run_exits_nonzero_on_mismatch(capsys, monkeypatch):
    def wrong(compiled, inputs):
        return [np.zeros_like(x) for x in compiled.run(*inputs)]
    monkeypatch.setitem(cli.DEVICES, "cpu", cli.Device("cpu", "wrong on purpose", lambda: True, wrong))
    status, out, _ = run_cli(capsys, "run", ATTENTION, "--shape", SMALL)
    assert status == 1 and out.rstrip().endswith("FAIL")


def test_opt_round_trips_and_fuses(capsys, dumps):
    status, out, _ = run_cli(capsys, "opt", str(dumps / "graph.mlir"))
    assert status == 0 and out == (dumps / "graph.mlir").read_text()
    status, out, _ = run_cli(capsys, "opt", str(dumps / "graph.mlir"), "--passes=fuse")
    assert status == 0 and out == (dumps / "schedule.mlir").read_text()


def test_opt_full_pipeline_with_xdsl_passes(capsys, dumps):
    passes = "fuse,lower-to-tile,canonicalize,cse,lower-to-target"
    status, out, _ = run_cli(capsys, "opt", str(dumps / "graph.mlir"), f"--passes={passes}", "--arch", "gfx90a")
    assert status == 0 and "v_mfma" in out
    parse_ir(out).verify()


def test_opt_verify_only_prints_nothing(capsys, dumps):
    assert run_cli(capsys, "opt", str(dumps / "target.mlir"), "--verify-only") == (0, "", "")


def one_line_error(status: int, err: str) -> str:
    """The error message, after checking the CLI's error format: exit 1, `error:` plus maybe `  at`."""
    lines = err.splitlines()
    assert status == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("  at "))
    return lines[0]


@pytest.mark.parametrize("argv, expected", [
    (["--shape", "B=1,H=2,S"], "bad --shape entry 'S'"),
    (["--shape", "B=1,H=2,S=0,D=32"], "bad --shape entry 'S=0'"),
    (["--shape", "B=1,H=2,S=80"], "no value for dim(s) D"),
    (["--shape", SMALL, "--arch", "sm_91"], "unknown GPU architecture 'sm_91'"),
    (["--shape", SMALL, "--dtype", "fp12"], "unknown dtype 'fp12'"),
    (["--shape", SMALL, "--dump-ir=graph,llvm"], "unknown IR stage(s) llvm"),
])
def test_bad_options_give_one_line_errors(capsys, argv, expected):
    status, _, err = run_cli(capsys, "compile", ATTENTION, *argv)
    message = one_line_error(status, err)
    assert expected in message and "  at " not in err


def test_unknown_function_lists_candidates(capsys):
    status, _, err = run_cli(capsys, "compile", f"{EXAMPLE}:attn", "--shape", SMALL)
    assert "candidates: flash_attention, causal_flash_attention" in one_line_error(status, err)


def test_ambiguous_file_lists_candidates(capsys):
    status, _, err = run_cli(capsys, "compile", EXAMPLE, "--shape", SMALL)
    assert "several @tessera.functions (flash_attention, causal_flash_attention)" in one_line_error(status, err)


@pytest.fixture
def user_dir():
    """A folder outside tmp_path: TesseraError locations skip paths containing "pytest", as tmp_path's do."""
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def test_error_in_user_code_points_at_its_line(capsys, user_dir):
    user = user_dir / "bad.py"
    user.write_text(textwrap.dedent("""\
        import tessera as tsr
        from tessera import Tensor

        @tsr.function
        def f(a: Tensor["M", "K"], b: Tensor["N", "K"]):
            return tsr.matmul(a, b)
    """))
    status, _, err = run_cli(capsys, "compile", str(user), "--shape", "M=4,K=8,N=16")
    assert "matmul" in one_line_error(status, err)
    assert err.splitlines()[1] == f"  at {user}:6"


def test_opt_parse_error_names_file_line_and_column(capsys, dumps, tmp_path):
    bad = tmp_path / "bad.mlir"
    bad.write_text((dumps / "graph.mlir").read_text().replace("graph.matmul", "graph.matmulx", 1))
    status, _, err = run_cli(capsys, "opt", str(bad))
    assert "graph.matmulx is not registered" in one_line_error(status, err)
    assert err.splitlines()[1].startswith(f"  at {bad}:")


def test_opt_rejects_a_pass_for_another_level(capsys, dumps):
    status, _, err = run_cli(capsys, "opt", str(dumps / "tile.mlir"), "--passes=fuse")
    assert "takes graph IR, but its input is tile IR" in one_line_error(status, err)


def test_traceback_flag_reraises(capsys):
    with pytest.raises(TesseraError, match="bad --shape"):
        cli.main(["compile", ATTENTION, "--shape", "B", "--traceback"])


def test_targets_table_and_detail(capsys):
    status, out, _ = run_cli(capsys, "targets")
    archs = [line.split()[0] for line in out.splitlines()[1:]]
    assert status == 0 and "sm_90a" in archs and "gfx90a" in archs
    status, out, _ = run_cli(capsys, "targets", "--arch", "sm_90a")
    assert status == 0 and "wgmma" in out and ".target sm_90a" in out


def test_demo_small(capsys, tmp_path):
    status, out, _ = run_cli(capsys, "demo", "--shape", SMALL, "--out-dir", str(tmp_path / "ir"))
    assert status == 0 and "all outputs match" in out
    for name in cli.DEMO_FUNCTIONS:
        assert sorted(p.stem for p in (tmp_path / "ir" / name).iterdir()) == sorted(IR_STAGES)


def test_python_dash_m_entry_point():
    """The real process: `python -m tessera`, with an error printed as one line, exit 1."""
    proc = subprocess.run([sys.executable, "-m", "tessera", "compile", f"{EXAMPLE}:nope", "--shape", SMALL],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_compile_reports_a_split_k_gemm_as_its_two_kernels(capsys, tmp_path):
    """The partial products' kernel carries the GEMM's schedule (split 4 ways: its grid's third
    axis); the second kernel says it sums them."""
    source = tmp_path / "gemm.py"
    source.write_text(GEMM_SOURCE)
    status, out, _ = run_cli(capsys, "compile", f"{source}:gemm", "--shape", "M=128,K=4096,N=4096",
                             "--arch", "sm_90a", "-o", str(tmp_path / "out"))
    assert status == 0
    partials = out[out.index("\n  gemm_gemm_0_partials\n"):out.index("\n  gemm_gemm_0\n")]
    assert re.search(r"launch +grid 64 x 1 x 4, 128 threads", partials)   # 64 x 128 tiles: a small GEMM's
    assert re.search(r"schedule +block_m=64 block_n=128 .*num_warps=4 .*split_k=4", partials)
    total = out[out.index("\n  gemm_gemm_0\n"):]
    assert re.search(r"schedule +sums the fp32 partial products of gemm_gemm_0_partials", total)
    assert {p.name for p in (tmp_path / "out").glob("gemm_gemm_0*.ptx")} == {"gemm_gemm_0.ptx", "gemm_gemm_0_partials.ptx"}


SEEDS_FILE = str(Path(__file__).resolve().parent / "seed_kernels.py")


def test_run_bf16_alibi_attention_passes_against_the_exact_reference(capsys, monkeypatch):
    """Issue 13, item 5: bf16 ALiBi attention (random normal slopes, so S x S scores in the hundreds).
    The fused kernel keeps the scores in fp32; a reference rounding every op's result to bf16 rounded
    them too and was the less accurate of the two (a false FAIL). The reference is the exact float64
    evaluation now, and the kernel is well inside the bf16 tolerance."""
    target, shape = f"{SEEDS_FILE}:alibi_attention", "B=1,H=2,Sq=200,Sk=200,D=64"
    status, out, _ = run_cli(capsys, "run", target, "--shape", shape, "--dtype", "bf16", "--seed", "1",
                             "--device", "cpu")
    line = next(line for line in out.splitlines() if "relative error" in line)
    relative = float(line.split("relative error ")[1].split()[0])
    assert status == 0 and line.endswith("PASS") and relative < 5e-3, out

    # the old, per-op-rounded reference is off by more than the tolerance on the same inputs
    from tessera.interpreter import reference
    exact = reference.run_graph
    monkeypatch.setattr(reference, "run_graph", lambda f, inputs: exact(f, inputs, exact=False))
    status, out, _ = run_cli(capsys, "run", target, "--shape", shape, "--dtype", "bf16", "--seed", "1",
                             "--device", "cpu")
    assert status == 1 and out.rstrip().endswith("FAIL"), out


def test_run_tolerance_follows_the_dtype_and_the_reduction_length():
    from tessera.interpreter.reference import tolerance

    assert tolerance("bf16").relative > tolerance("fp16").relative > tolerance("fp32").relative
    assert tolerance("fp32", 4096).relative > 4 * tolerance("fp32", 1).relative
    assert tolerance("bf16", 4096).relative < 1.1 * tolerance("bf16", 1).relative   # bf16's roundoff dominates
    assert tolerance("int32").relative == 0.0


def test_layout_compiles_for_an_argument_stored_in_another_order(capsys, tmp_path):
    """`--layout q=B,S,H,D`: q is a [B, S, H, D] buffer seen as its annotated [B, H, S, D]; the report
    says which arguments the kernels read in place and which they copy, and why."""
    code, out, _ = run_cli(capsys, "compile", ATTENTION, "--shape", SMALL, "--layout", "q=B,S,H,D",
                           "--layout", "k=B,D,H,S", "--dump-ir", "tile", "-o", str(tmp_path))
    assert code == 0
    assert re.search(r"strided\s+q \[\d+, \d+, \d+, 1\] \(read in place\)", out)
    assert re.search(r"copied\s+k: its innermost dim has stride \d+, not 1", out)
    assert "strided<[" in (tmp_path / "tile.mlir").read_text()


def test_run_checks_a_strided_layout_against_the_reference(capsys):
    code, out, _ = run_cli(capsys, "run", ATTENTION, "--shape", SMALL, "--layout", "v=2,1,0,3", "--device", "cpu")
    assert code == 0 and "PASS" in out


@pytest.mark.parametrize("layout, message", [
    ("q=B,S,H", r"--layout q=B,S,H: name each of its dims once, .* by name \(B, H, S, D\) or index \(0..3\)"),
    ("x=B,H,S,D", r"--layout names 'x', not an argument of the function"),
    ("q", r"bad --layout 'q': expected ARG=DIM,DIM,..."),
])
def test_a_bad_layout_is_a_clear_error(capsys, layout, message):
    with pytest.raises(TesseraError, match=message):
        cli.main(["compile", ATTENTION, "--shape", SMALL, "--layout", layout, "--dump-ir", "tile", "--traceback"])


def test_compile_dynamic_shows_the_generic_kernels_and_refuses_what_cannot_be(tmp_path, capsys):
    source = tmp_path / "rows.py"
    source.write_text("import tessera as tsr\nfrom tessera import Tensor\n\n\n@tsr.function\n"
                      "def norm(x: Tensor['M', 'N'], w: Tensor['N']):\n"
                      "    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)\n")
    out = tmp_path / "out"
    assert cli.main(["compile", f"{source}:norm", "--shape", "M=100,N=256", "--dynamic", "M", "--dump-ir", "tile",
                     "-o", str(out)]) == 0
    assert "grid cdiv(param 0 dim 0, " in capsys.readouterr().out
    assert "memref<?x256xf16>" in (out / "tile.mlir").read_text()
    assert cli.main(["compile", f"{source}:norm", "--shape", "M=100,N=256", "--dynamic", "N",
                     "-o", str(tmp_path / "n")]) == 1
    assert "norm cannot take dim 'N' at run time" in capsys.readouterr().err


def test_run_dynamic_runs_the_generic_kernels_and_checks_them(capsys):
    """`tessera run --dynamic S` compiles S as a kernel argument and checks the run at --shape's S
    (its reductions' lengths, which the tolerance grows with, at that S)."""
    assert cli.main(["run", ATTENTION, "--shape", "B=1,H=2,S=200,D=64", "--dynamic", "S", "--device", "cpu"]) == 0
    decode = str(Path(EXAMPLE).with_name("decode_attention.py")) + ":decode_attention"   # its mask reads N - M
    assert cli.main(["run", decode, "--shape", "B=1,H=2,M=3,N=300,D=64", "--dynamic", "N", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "FAIL" not in out
    assert cli.main(["run", ATTENTION, "--shape", "B=1,H=2,S=200,D=64", "--dynamic", "Q", "--device", "cpu"]) == 1
    assert "--dynamic names Q, not a dim of flash_attention's arguments" in capsys.readouterr().err


def test_run_counts_nans_where_the_reference_has_them_as_agreement():
    """A softmax over no key is NaN in the reference (a row no packed sequence holds): the output
    must be NaN there too; NaN anywhere else (an unwritten, poisoned element) still fails."""
    ref = np.array([1.0, np.nan, 3.0])
    assert cli.compare("out", np.array([1.0, np.nan, 3.0]), ref, 1e-3).passed
    assert not cli.compare("out", np.array([1.0, 2.0, 3.0]), ref, 1e-3).passed
    assert not cli.compare("out", np.array([np.nan, np.nan, 3.0]), ref, 1e-3).passed


def test_run_checks_the_varlen_example(capsys):
    """examples/varlen_attention.py on random int32 cumulative lengths: rows of no sequence are NaN
    in both."""
    varlen = str(Path(EXAMPLE).with_name("varlen_attention.py")) + ":varlen_attention"
    status, out, _ = run_cli(capsys, "run", varlen, "--shape", "T=40,N=40,H=2,Hk=2,D=16,B1=3")
    assert status == 0 and out.rstrip().endswith("PASS"), out


def test_compile_names_a_layout_copy(capsys, tmp_path):
    """An fp8 attention's V, copied transposed for the 8-bit tensor cores, is named in the summary."""
    target = str(Path(CAUSAL.split(":")[0]).with_name("fp8_attention.py")) + ":fp8_attention"
    status, out, _ = run_cli(capsys, "compile", target, "--shape", "B=2,H=4,S=256,N=256,D=128", "--arch", "sm_90a",
                             "--dump-ir=graph", "-o", str(tmp_path))
    assert status == 0
    assert "layout copy  fp8_attention_elementwise_0: v transposed to [B, H, D, N]" in out
