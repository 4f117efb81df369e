"""The differential fuzzer on the CPU tile interpreter: random programs (tests/fuzz/programs.py) against
their own float64 NumPy evaluation. Deterministic (derandomized hypothesis, no database); a failure
shrinks to a minimal program, printed as DSL source. TESSERA_FUZZ_EXAMPLES sets the number of programs
(default: what fits in about two minutes on a 2-core CI machine)."""
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fuzz import programs as P
from fuzz.programs import check, describe, function, programs, random_inputs

EXAMPLES = int(os.environ.get("TESSERA_FUZZ_EXAMPLES", "1500"))


def run_on_cpu(program, seed: int) -> None:
    inputs = random_inputs(program, seed)
    try:
        outs = function(program)(*inputs)
    except Exception as e:   # a compiler error on a valid program is a bug too: show the program
        raise AssertionError(f"{type(e).__name__}: {e}\n\nminimal program:\n{describe(program)}") from e
    check(program, inputs, outs if isinstance(outs, tuple) else (outs,))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=list(HealthCheck))
@given(program=programs("cpu"), seed=st.integers(0, 2**16))
def test_fuzz_cpu(program, seed):
    run_on_cpu(program, seed)


def _buggy(program, inputs):
    """A stand-in compiler with one bug: it computes tanh as sin. Otherwise exact, rounded once."""
    swapped = P.Program(program.dtype, program.sizes, program.inputs,
                        tuple(P.Node(n.kind, "sin", n.args, n.params) if n.op == "tanh" else n
                              for n in program.nodes), program.outputs, program.family)
    return [o.astype(P.NP_DTYPES[program.dtype]) for o in P.evaluate(swapped, inputs)]


def test_a_wrong_result_shrinks_to_a_minimal_program_printed_as_dsl():
    """The fuzzer's own machinery: exact answers pass, a wrong op is found and shrunk to one line."""
    @settings(max_examples=300, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(program=programs("cpu", families=("elementwise",)), seed=st.integers(0, 2**16))
    def fuzz(program, seed):
        inputs = random_inputs(program, seed)
        check(program, inputs, _buggy(program, inputs))

    with pytest.raises(AssertionError) as failure:
        fuzz()
    message = str(failure.value)
    assert "minimal program:" in message and "tsr.tanh(" in message, message
    body = message.split("def fuzz(")[1].split("# tessera run")[0]
    # the wrong op, and at most one op feeding it (tanh and sin agree to 1e-2 on small inputs, so a
    # failing program may need a scale in front)
    assert body.count(" = ") <= 2 and "tsr.tanh(" in body, f"not shrunk to a minimal program:\n{message}"
