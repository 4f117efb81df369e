"""The tracer records where each op comes from, and the DSL's debugging calls: device_assert
and profile regions."""
import re

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import DeviceAssertError, DTypeError, TesseraError
from tessera.ir import graph as g
from tessera.ir import provenance

DIMS = {"M": 5, "N": 7}


def line_of(marker: str) -> int:
    """The line of this file that ends with `# marker`."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


def graph_ops(fn):
    module = fn.trace(fn.arg_specs_for(DIMS, "fp32"))
    return [op for op in next(iter(module.ops)).body.block.ops if not op.name.startswith("func.")]


@tsr.function
def scaled(x: Tensor["M", "N"]):
    y = tsr.exp(x)  # exp
    return y * 2.0  # scale


def test_every_op_records_the_user_line():
    ops = graph_ops(scaled)
    assert [provenance.loc_of(op) for op in ops] == [
        provenance.Loc(__file__, line_of("exp")),
        provenance.Loc(__file__, line_of("scale")),     # the constant 2.0
        provenance.Loc(__file__, line_of("scale"))]


@tsr.function
def regions(x: Tensor["M", "N"]):
    with tsr.profile_region("outer"):
        a = x + 1.0
        tsr.profile_begin("inner")
        b = a * a
        tsr.profile_end("inner")
    return b - 1.0


def test_ops_in_profile_regions_carry_the_open_regions():
    by_kind = {op.name: provenance.regions_of(op) for op in graph_ops(regions)}
    assert by_kind["graph.add"] == ("outer",)
    assert by_kind["graph.mul"] == ("outer", "inner")
    assert by_kind["graph.sub"] == ()


@pytest.mark.parametrize("body, message", [
    (lambda x: tsr.profile_end("a"), "profile_end('a'): no region is open"),
    (lambda x: (tsr.profile_begin("a"), tsr.profile_begin("b"), tsr.profile_end("a")),
     "the innermost open region is 'b'"),
    (lambda x: (tsr.profile_begin("a"), tsr.profile_begin("a")), "region 'a' is already open"),
    (lambda x: tsr.profile_begin(""), "non-empty name"),
])
def test_unbalanced_regions_are_errors(body, message):
    @tsr.function
    def f(x: Tensor["M", "N"]):
        body(x)
        return x + 1.0
    with pytest.raises(TesseraError, match=re.escape(message)):
        f.trace(f.arg_specs_for(DIMS, "fp32"))


def test_a_region_never_ended_is_an_error():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        tsr.profile_begin("open")
        return x + 1.0
    with pytest.raises(TesseraError, match="region 'open' is begun but never ended"):
        f.trace(f.arg_specs_for(DIMS, "fp32"))


@tsr.function
def checked(x: Tensor["M", "N"]):
    tsr.device_assert(x > 0, "x must be positive")  # tensor assert
    return x * 2.0


def test_a_tensor_assert_is_a_graph_op_with_its_message_and_line():
    (check,) = [op for op in graph_ops(checked) if isinstance(op, g.AssertOp)]
    assert check.message.data == "x must be positive"
    assert provenance.loc_of(check) == provenance.Loc(__file__, line_of("tensor assert"))


def test_a_python_bool_assert_is_checked_while_tracing():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        tsr.device_assert(x.shape[-1] % 2 == 1, "odd rows")
        tsr.device_assert(x.shape[-1] % 2 == 0, "even rows")  # python assert
        return x + 1.0
    with pytest.raises(DeviceAssertError) as failure:
        f.trace(f.arg_specs_for(DIMS, "fp32"))
    assert "even rows" in str(failure.value) and f"{__file__}:{line_of('python assert')}" in str(failure.value)
    assert failure.value.location == f"{__file__}:{line_of('python assert')}"


def test_assert_conditions_must_be_bool():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        tsr.device_assert(x, "not bool")
        return x
    with pytest.raises(DTypeError, match="condition must be bool"):
        f.trace(f.arg_specs_for(DIMS, "fp32"))
