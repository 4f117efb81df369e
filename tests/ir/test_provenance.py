"""Source locations and profile regions ride along every IR level: each level's text prints and
parses them back exactly, fusion and both lowerings carry them to the ops they generate."""
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.compiler import IR_STAGES
from tessera.ir import parse_ir, print_ir, provenance
from tessera.ir import target as tgt
from tessera.ir import tile as t

from seed_kernels import causal_attention


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


@tsr.function
def gemm_checked(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    c = tsr.matmul(a, b)  # matmul
    tsr.device_assert(c == c, "no NaN")  # assert
    with tsr.profile_region("epilogue"):
        return tsr.gelu(c + bias)  # epilogue


@tsr.function
def norm_checked(x: Tensor["M", "N"], w: Tensor["N"]):
    y = tsr.rms_norm(x, (x.shape[-1],), w)
    tsr.device_assert(y < 1e4, "bounded")
    return y


CASES = [(gemm_checked, dict(M=100, K=64, N=70)), (norm_checked, dict(M=10, N=300)),
         (causal_attention, dict(B=1, H=2, S=70, D=64))]


def test_loc_text_parses_back():
    loc = provenance.Loc("/a/b:c/model.py", 12)
    assert provenance.Loc.parse(str(loc)) == loc
    assert provenance.Loc.parse("no line") is None


@pytest.mark.parametrize("fn, dims", CASES, ids=lambda x: getattr(x, "name", ""))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_locations_round_trip_through_every_level(fn, dims, arch):
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch=arch, line_info=True, profile=True)
    for stage in IR_STAGES:
        text = print_ir(compiled.modules[stage])
        assert provenance.LOC in text, stage
        reparsed = parse_ir(text)
        reparsed.verify()
        assert print_ir(reparsed) == text, stage


def test_tile_ops_carry_the_line_of_the_graph_op_they_come_from():
    compiled = gemm_checked.compile(gemm_checked.arg_specs_for(CASES[0][1], "fp16"), arch="sm_80")
    ops = list(compiled.modules["tile"].walk())
    lines = lambda kind: {provenance.loc_of(op).line for op in ops if isinstance(op, kind)}  # noqa: E731
    assert lines(t.MmaOp) == {line_of("matmul")}
    assert lines(t.AssertOp) == {line_of("assert")}
    assert lines(t.StoreOp) == {line_of("epilogue")}
    assert {provenance.regions_of(op) for op in ops if isinstance(op, t.StoreOp)} == {("epilogue",)}


def test_target_ops_keep_the_provenance_of_the_tile_ops_they_replace():
    compiled = gemm_checked.compile(gemm_checked.arg_specs_for(CASES[0][1], "fp16"), arch="sm_80")
    ops = list(compiled.modules["target"].walk())
    (check,) = [op for op in ops if isinstance(op, tgt.AssertOp)]
    assert provenance.loc_of(check).line == line_of("assert")
    assert {provenance.loc_of(op).line for op in ops if isinstance(op, tgt.TensorCoreOp)} == {line_of("matmul")}


def test_opt_round_trips_dumps_with_locations(tmp_path, capsys, monkeypatch):
    from tessera import cli

    compiled = gemm_checked.compile(gemm_checked.arg_specs_for(CASES[0][1], "fp16"), arch="sm_80", profile=True)
    for path in compiled.dump(tmp_path, IR_STAGES):
        assert cli.main(["opt", str(path)]) == 0
        assert capsys.readouterr().out == path.read_text()
