"""Graph IR as text: print -> parse -> print is the identity, parsed modules mean the same thing,
and the verifier rejects hand-edited mistakes with messages that name the dims involved."""
import math
import re

import numpy as np
import pytest
from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException

import tessera as tsr
from tessera import Tensor
from tessera.compiler import compile_module
from tessera.ir import parse_ir, print_ir

from seed_kernels import flash_attention

IR_ERRORS = (VerifyException, DiagnosticException, ParseError)


@tsr.function
def causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)  # -inf prints as a hex float
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def alibi_softcap(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"],
                  slopes: Tensor["H"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
    i = tsr.arange(q.shape[-2])
    s = 30.0 * tsr.tanh((s + slopes[:, None, None] * (i[None, :] - i[:, None])) / 30.0)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def mlp_block(x: Tensor["T", "E"], w1: Tensor["E", "F"], b1: Tensor["F"], w2: Tensor["F", "E"], g: Tensor["E"]):
    h = tsr.gelu(x @ w1 + b1, approximate="tanh")
    y = tsr.layer_norm(h @ w2 + x, x.shape[-1], g, None, eps=1e-6)
    return tsr.rms_norm(y, [y.shape[-1]], g).to(tsr.fp16)


@tsr.function
def reductions_and_views(x: Tensor["A", 1, "N"], m: Tensor["N", "A"]):
    s = tsr.sum(x, dim=-1, keepdim=True) + tsr.amax(x, 0)
    t = (x.permute(2, 1, 0) * m[:, None, :]).mean(dim=(0, 1))
    return s, t, (x > 0.0) & ~(x < -1.0), (x * 4.0).to(tsr.int32)


@tsr.function
def exotic_dtypes(x: Tensor["B", 1, "N", tsr.fp8_e4m3], y: Tensor["N", tsr.bf16], z: Tensor["N", tsr.fp8_e5m2]):
    return x.to(tsr.fp32) + y, z.to(tsr.bf16) * 2.0


DIMS = {"B": 2, "H": 3, "S": 17, "D": 64, "T": 5, "E": 8, "F": 12, "A": 3, "N": 7}
FUNCTIONS = [flash_attention, causal_attention, alibi_softcap, mlp_block, reductions_and_views, exotic_dtypes]


def graph_text(fn, dtype="fp16") -> str:
    return print_ir(fn.trace(fn.arg_specs_for(DIMS, dtype)))


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.name)
def test_round_trip_is_identity(fn, dtype):
    text = graph_text(fn, dtype)
    module = parse_ir(text)
    module.verify()
    assert print_ir(module) == text
    assert print_ir(parse_ir(print_ir(module))) == text


def test_text_keeps_symbolic_dims_and_their_values():
    text = graph_text(flash_attention)
    assert "!graph.tensor<[B, H, S, D], f16>" in text
    assert "!graph.tensor<[B, H, S, S], f16>" in text
    assert re.search(r"tessera\.dims = \{B = 2 : i64, H = 3 : i64, S = 17 : i64, D = 64 : i64\}", text)


@pytest.mark.parametrize("fn", [causal_attention, alibi_softcap, mlp_block], ids=lambda f: f.name)
def test_parsed_graph_compiles_to_the_same_program(fn, random_inputs):
    """The text is the whole program: -inf, eps, perms, dims all survive the round trip."""
    module = fn.trace(fn.arg_specs_for(DIMS, "fp32"))
    original = compile_module(module)
    reparsed = compile_module(parse_ir(print_ir(module)))
    arrays = random_inputs(fn.arg_specs_for(DIMS, "fp32"), seed=11)
    for a, b, r in zip(original.run(*arrays), reparsed.run(*arrays), original.reference(*arrays)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a.astype(np.float64), r.astype(np.float64), rtol=1e-4, atol=1e-4)
    assert original.ir("tile") == reparsed.ir("tile")


# --- the verifier, on hand-edited text --------------------------------------------------------------------

@tsr.function
def matmul_fn(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@tsr.function
def add_fn(x: Tensor["M", "N"], y: Tensor["M", 1]):
    return x + y


@tsr.function
def assorted(x: Tensor["M", "N"], w: Tensor["N"]):
    c = tsr.where(x > 0.0, x, 0.0)
    return tsr.softmax(c, dim=-1), tsr.sum(x, dim=1), tsr.layer_norm(x, x.shape[-1], w), x.T * 1.0


SMALL = {"M": 3, "K": 5, "N": 4}


def verify_text(text: str):
    module = parse_ir(text)
    module.verify()
    return module


def edited(fn, old: str, new: str, count: int = 0) -> str:
    text = print_ir(fn.trace(fn.arg_specs_for(SMALL, "fp32")))
    assert old in text, f"{old!r} not in:\n{text}"
    return text.replace(old, new, count or -1)


def test_unedited_text_verifies():
    for fn in (matmul_fn, add_fn, assorted):
        verify_text(print_ir(fn.trace(fn.arg_specs_for(SMALL, "fp32"))))


def test_matmul_contracting_dims_mismatch():
    text = edited(matmul_fn, "!graph.tensor<[K, N], f32>", "!graph.tensor<[7, N], f32>")
    with pytest.raises(IR_ERRORS, match=r"matmul: contracting dims differ: lhs has K=5, rhs has 7"):
        verify_text(text)


def test_matmul_contracting_symbolic_dims_with_different_values():
    text = edited(matmul_fn, "[K, N], f32", "[M, N], f32")
    with pytest.raises(IR_ERRORS, match=r"contracting dims differ: lhs has K=5, rhs has M=3"):
        verify_text(text)


def test_elementwise_operands_that_do_not_broadcast():
    text = edited(add_fn, "[M, 1]", "[M, 3]")
    with pytest.raises(IR_ERRORS, match=r"graph\.add operands do not broadcast: dim N=4 vs 3"):
        verify_text(text)


def test_elementwise_wrong_result_dtype():
    # x becomes f16, y stays f32: f16 + f32 promotes to f32, but the result still says f16.
    text = edited(add_fn, "[M, N], f32", "[M, N], f16")
    with pytest.raises(IR_ERRORS, match=r"graph\.add: result dtype fp16 should be fp32"):
        verify_text(text)


def test_elementwise_wrong_result_shape():
    # The add's result (and so the return and the signature) says [M, 1] where broadcasting gives [M, N].
    text = print_ir(add_fn.trace(add_fn.arg_specs_for(SMALL, "fp32")))
    text = re.sub(r"(graph\.add\b[^\n]*-> !graph\.tensor<)\[M, N\]", r"\1[M, 1]", text)
    text = re.sub(r"(func\.return\b[^\n]*)\[M, N\]", r"\1[M, 1]", text)
    text = text.replace(") -> !graph.tensor<[M, N], f32> attributes", ") -> !graph.tensor<[M, 1], f32> attributes")
    with pytest.raises(IR_ERRORS, match=r"graph\.add: result shape \['?M'?, 1\] is not the broadcast shape"):
        verify_text(text)


@tsr.function
def where_fn(c: Tensor["M", "N", tsr.bool_], x: Tensor["M", "N"]):
    return tsr.where(c, x, 0.0)


def test_where_condition_must_be_bool():
    text = edited(where_fn, "[M, N], i1>", "[M, N], f32>")
    with pytest.raises(IR_ERRORS, match=r"where: the condition must be bool"):
        verify_text(text)


def test_comparison_result_must_be_bool():
    text = print_ir(assorted.trace(assorted.arg_specs_for(SMALL, "fp32")))
    text = re.sub(r"\[M, N\], i1>", "[M, N], f32>", text)
    with pytest.raises(IR_ERRORS, match=r"graph\.gt: result dtype fp32 should be bool"):
        verify_text(text)


def test_softmax_axis_out_of_range():
    text = print_ir(assorted.trace(assorted.arg_specs_for(SMALL, "fp32")))
    text = re.sub(r"(graph\.softmax[^\n]*axis = )(#builtin\.int<)?1", r"\g<1>\g<2>5", text)
    with pytest.raises(IR_ERRORS, match=r"softmax: axis 5 out of range"):
        verify_text(text)


def test_layer_norm_weight_must_match_the_last_dim():
    text = edited(assorted, "!graph.tensor<[N], f32>", "!graph.tensor<[M], f32>")
    with pytest.raises(IR_ERRORS, match=r"layer_norm: weight/bias must have shape \[N\]"):
        verify_text(text)


def test_transpose_with_a_bad_permutation():
    text = print_ir(assorted.trace(assorted.arg_specs_for(SMALL, "fp32")))
    text = re.sub(r"(perm = \[(?:#builtin\.int<)?)1", r"\g<1>0", text, count=1)
    with pytest.raises(IR_ERRORS, match=r"transpose: \[0, 0\] is not a permutation of 2 dims"):
        verify_text(text)


def test_unknown_reduction_kind():
    text = print_ir(assorted.trace(assorted.arg_specs_for(SMALL, "fp32")))
    assert '"sum"' in text
    with pytest.raises(IR_ERRORS, match=r"reduce: unknown kind 'product'"):
        verify_text(text.replace('"sum"', '"product"'))
