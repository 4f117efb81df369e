"""What a forward saves for its backward (issue 14 item 3): an attention's row log-sum-exp, written
by the forward's own flash kernel as a second output, and its output O, which turns rowsum(dP * P)
into rowsum(dO * O); the backward that reads them recomputes no score pass of the forward."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import dtypes
from tessera.autodiff.api import Derivative, saving
from tessera.autodiff.backward import _spec, forward_function, saved_values

from attention_cases import FUNCTIONS, causal, plain, reference_grads


def _kernels(compiled):
    f = next(iter(compiled.modules["schedule"].ops))
    return [op for op in f.body.block.ops if op.name == "schedule.kernel"]


def _specs(fn, b, h, m, n, d, dtype=dtypes.fp16):
    return fn.arg_specs_for({"B": b, "H": h, "M": m, "S": m, "N": n, "D": d}, dtype)


def _lse64(q, k, kind):
    s = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if kind == "causal":
        i, j = np.arange(s.shape[-2])[:, None], np.arange(s.shape[-1])[None, :]
        s = np.where(i >= j, s, -np.inf)
    m = s.max(-1, keepdims=True)
    return np.log(np.exp(s - m).sum(-1, keepdims=True)) + m


def test_an_attention_saves_its_logsumexp_and_output():
    f = forward_function(plain.trace(_specs(plain, 1, 2, 40, 70, 16)))
    saved = saved_values(f)
    assert [s.kind for s in saved] == ["logsumexp", "result"]
    assert saved[1].value(f) is f.body.block.last_op.operands[0]   # O is the returned output
    assert saved_values(forward_function(tsr.function(lambda x: tsr.softmax(x, -1)).trace(
        [tsr.frontend.trace.ArgSpec("x", (4, 8), dtypes.fp32, (4, 8))]))) == []   # no matmul: no attention


@pytest.mark.parametrize("kind,m,n", [("plain", 37, 70), ("causal", 65, 65)])
def test_the_forward_kernel_writes_the_logsumexp_beside_the_output(kind, m, n):
    """The saving forward is one flash_attention kernel with two outputs; its log-sum-exp is the
    float64 one's (fp32 scores of fp16 inputs)."""
    fn = FUNCTIONS[kind]
    forward = saving(fn)
    compiled = forward.compile(_specs(fn, 2, 3, m, n, 32))
    (kernel,) = _kernels(compiled)
    assert kernel.kind.data == "flash_attention" and len(kernel.outputs) == 2
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, m, 32)).astype(np.float16)
    k, v = (rng.standard_normal((2, 3, n, 32)).astype(np.float16) for _ in range(2))
    out, lse = forward(q, k, v)
    assert lse.dtype == np.float32 and lse.shape == (2, 3, m, 1)
    np.testing.assert_allclose(lse, _lse64(q, k, kind), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out, fn(q, k, v))


@pytest.mark.parametrize("splits,n", [(4, 300), (40, 2000)])
def test_a_split_kv_attention_combines_the_splits_logsumexps(splits, n):
    """A decode-shaped attention whose key blocks are split 4 or 40 ways (combined 16 at a time, the
    last 8 after the loop) writes the combined log-sum-exp."""
    forward = saving(plain)
    space = {"split_kv": [splits], "block_n": [32]}
    specs = _specs(plain, 1, 2, 3, n, 16, dtypes.fp32)
    compiled = forward.compile(specs, space=space)
    assert any("partials" in name for name in compiled.kernel_names)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 3, 16)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float32) for _ in range(2))
    out, lse = forward(q, k, v, space=space)
    np.testing.assert_allclose(lse, _lse64(q, k, "plain"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, plain(q, k, v), rtol=1e-4, atol=1e-5)


def test_the_backward_reading_saved_values_recomputes_no_forward():
    """With the log-sum-exp and O given, the backward is rowsum(dO * O), dQ, and dK with dV in one
    kernel, which stores dK transposed itself: no flash_attention kernel, no pass computing rowsum(dP * P),
    no copy."""
    specs = _specs(causal, 2, 3, 200, 200, 64)
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtypes.fp16, specs[0].dims)
    f = forward_function(causal.trace(specs))
    bindings = {k: v.value.data for k, v in f.attributes["tessera.dims"].data.items()}
    saved = [_spec(f"saved{i}", s.type(f), bindings) for i, s in enumerate(saved_values(f))]
    derivative = Derivative(causal, cotangent_names=["d_out"], saved_names=[s.name for s in saved])
    kinds = [k.kind.data for k in _kernels(derivative.compile([*specs, *saved, d_out]))]
    assert kinds == ["row_reduction", "flash_chain", "flash_chain"], kinds


@pytest.mark.parametrize("kind", ["plain", "causal", "softcap_causal"])
def test_vjp_through_saved_values_matches_float64(kind):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 45, 16)).astype(np.float16) for _ in range(3))
    out, f_vjp = tsr.vjp(FUNCTIONS[kind], q, k, v)
    np.testing.assert_array_equal(out, FUNCTIONS[kind](q, k, v))
    assert [key[1] for key in vars(FUNCTIONS[kind])["_vjp_derivatives"]] == [2]   # it took both saved values
    d_out = rng.standard_normal(out.shape).astype(np.float16)
    for name, got, want in zip("qkv", f_vjp(d_out), reference_grads(kind, q, k, v, d_out)):
        assert not np.isnan(got).any()
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-2, f"d{name}: {err}"


@tsr.function
def upcast_attention(q: tsr.Tensor["B", "S", "D"], k: tsr.Tensor["B", "S", "D"], v: tsr.Tensor["B", "S", "D"]):
    s = tsr.matmul(q.float(), k.float().transpose(1, 2)) * 0.25
    return tsr.matmul(tsr.softmax(s, -1).to(tsr.fp16), v)


def test_casts_around_the_scores_and_probabilities():
    """Q and K cast to fp32 before Q K^T (their casts are kernels the chains read, not ops inside
    them) and P cast back to fp16 before P @ V (the backward reads exp(s - lse) through the same
    cast): the vjp takes both saved values and matches float64."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 33, 16)).astype(np.float16) for _ in range(3))
    out, f_vjp = tsr.vjp(upcast_attention, q, k, v)
    assert [key[1] for key in vars(upcast_attention)["_vjp_derivatives"]] == [2]
    d_out = rng.standard_normal(out.shape).astype(np.float16)
    q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k, v, d_out))
    s = q64 @ k64.swapaxes(1, 2) * 0.25
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = g64 @ v64.swapaxes(1, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * 0.25
    for name, got, want in zip("qkv", f_vjp(d_out), (ds @ k64, ds.swapaxes(1, 2) @ q64, p.swapaxes(1, 2) @ g64)):
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-2, f"d{name}: {err}"


@tsr.function
def swiglu(x: tsr.Tensor["N", "C"], wg: tsr.Tensor["C", "F"], wu: tsr.Tensor["C", "F"], wd: tsr.Tensor["F", "C"]):
    return tsr.matmul(tsr.silu(tsr.matmul(x, wg)) * tsr.matmul(x, wu), wd)


def _matmuls(module) -> int:
    return sum(op.name == "graph.matmul" for op in forward_function(module).body.block.ops)


def test_a_gated_mlp_saves_its_up_projections_and_its_backward_recomputes_no_gemm():
    """silu(x @ wg) * (x @ wu): both matmuls' results are read by the backward's rules (through
    the cast to fp32), so the forward saves them; the down projection's result, read by nothing
    (it is the output), is not saved. The backward reading them has the 6 matmuls of the
    gradients (dH, dWd, dX twice, dWg, dWu) and none of the forward's."""
    specs = swiglu.arg_specs_for({"N": 37, "C": 16, "F": 24}, dtypes.fp16)
    f = forward_function(swiglu.trace(specs))
    saved = saved_values(f)
    ops = list(f.body.block.ops)
    assert [(s.kind, ops[s.op].name) for s in saved] == [("result", "graph.matmul")] * 2
    assert {ops[s.op].rhs for s in saved} == {f.body.block.args[1], f.body.block.args[2]}
    bindings = {k: v.value.data for k, v in f.attributes["tessera.dims"].data.items()}
    saved_specs = [_spec(f"saved{i}", s.type(f), bindings) for i, s in enumerate(saved)]
    d_out = tsr.frontend.trace.ArgSpec("d_out", (37, 16), dtypes.fp16, ("N", "C"))
    reading = Derivative(swiglu, cotangent_names=["d_out"], saved_names=[s.name for s in saved_specs])
    recomputing = Derivative(swiglu, cotangent_names=["d_out"])
    assert _matmuls(reading.trace([*specs, *saved_specs, d_out])) == 6
    assert _matmuls(recomputing.trace([*specs, d_out])) == 8


def test_vjp_of_a_gated_mlp_through_saved_values_matches_float64():
    rng = np.random.default_rng(9)
    x, wg, wu, wd = (0.3 * rng.standard_normal(s).astype(np.float32) for s in [(29, 16), (16, 24), (16, 24), (24, 16)])
    out, f_vjp = tsr.vjp(swiglu, x, wg, wu, wd)
    assert [key[1] for key in vars(swiglu)["_vjp_derivatives"]] == [2]
    d_out = rng.standard_normal(out.shape).astype(np.float32)
    x64, g64, u64, d64, o64 = (a.astype(np.float64) for a in (x, wg, wu, wd, d_out))
    a, b = x64 @ g64, x64 @ u64
    sig = 1 / (1 + np.exp(-a))
    h = a * sig * b
    dh = o64 @ d64.T
    da, db = dh * b * (sig + a * sig * (1 - sig)), dh * a * sig
    want = (da @ g64.T + db @ u64.T, x64.T @ da, x64.T @ db, h.T @ o64)
    for got, w in zip(f_vjp(d_out), want):
        assert not np.isnan(got).any()
        assert np.abs(got - w).max() / np.abs(w).max() < 1e-4


@tsr.function
def reshaped_scores(q: tsr.Tensor["B", "H", "S", "D"], k: tsr.Tensor["B", "H", "S", "D"],
                    v: tsr.Tensor["B", "H", "S", "D"]):
    """Scores viewed with heads merged into the batch before the softmax: still scores, never saved."""
    s = tsr.matmul(q, k.transpose(2, 3)).reshape(q.shape[0] * q.shape[1], q.shape[2], q.shape[2]) * 0.25
    return tsr.matmul(tsr.softmax(s, -1).reshape(q.shape[0], q.shape[1], q.shape[2], q.shape[2]), v)


@tsr.function
def scaled_product(x: tsr.Tensor["N", "C"], w: tsr.Tensor["C", "F"]):
    return tsr.matmul(x, w) * 0.5


def test_no_s_by_s_scores_and_no_product_only_a_constant_scales_are_saved():
    f = forward_function(reshaped_scores.trace(reshaped_scores.arg_specs_for(dict(B=2, H=4, S=64, D=16), "fp16")))
    assert [r.kind for r in saved_values(f)] == ["logsumexp"]
    f = forward_function(scaled_product.trace(scaled_product.arg_specs_for(dict(N=4, C=8, F=16), "fp16")))
    assert saved_values(f) == []
