"""Reverse-mode autodiff (tessera/autodiff): every op's vector-Jacobian rule, `tsr.vjp` and `tsr.grad`.

Each gradient is computed by Tessera's backward graph on the CPU interpreter from fp32 inputs and
checked against central finite differences of a float64 NumPy reference of the function written
here (independent of Tessera), evaluated at the same (fp32-valued) inputs with a random cotangent:
d/dx <cotangent, f(x)>. The step 1e-6 keeps finite differences exact to ~1e-10, so the tolerance
is the fp32 backward's own error. Shapes are drawn by hypothesis from dims 1, 2, 3, 5, 7; ops are
grouped into a few functions with one input per op, so each input's gradient checks one rule and
a hypothesis example costs one forward and one backward compile.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tessera as tsr
from tessera import Tensor
from tessera.errors import DTypeError, ShapeError, TesseraError
from tessera.ir import graph as g

EXAMPLES = settings(max_examples=10, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DIMS = st.sampled_from([1, 2, 3, 5, 7])
STEP = 1e-6


# --- the finite-difference check ----------------------------------------------------------------

def numeric_vjp(ref, arrays, cotangents, wrt, step: float = STEP) -> list[np.ndarray]:
    """d/dx_i sum_k <cotangent_k, ref(*x)_k> by central differences in float64, for i in wrt."""
    xs = [np.asarray(a, np.float64) for a in arrays]

    def loss(values) -> float:
        outs = ref(*values)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(float(np.sum(np.asarray(o, np.float64) * c)) for o, c in zip(outs, cotangents))
    grads = []
    for i in wrt:
        grad = np.zeros_like(xs[i])
        for j in np.ndindex(xs[i].shape):
            values = list(xs)
            up, down = xs[i].copy(), xs[i].copy()
            up[j] += step
            down[j] -= step
            values[i] = up
            high = loss(values)
            values[i] = down
            grad[j] = (high - loss(values)) / (2 * step)
        grads.append(grad)
    return grads


def assert_gradient(got, want, what: str, rtol: float = 1e-4) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: gradient shape {got.shape}, expected {want.shape}"
    err = np.linalg.norm(got - want)
    assert err <= rtol * np.linalg.norm(want) + 1e-6 * math.sqrt(want.size), (
        f"{what}: gradient error {err:.3e} against |grad| {np.linalg.norm(want):.3e}\n got {got}\nwant {want}")


def check_vjp(fn, ref, arrays, names=None, rtol: float = 1e-4, seed: int = 0):
    """tsr.vjp of `fn` at `arrays` against finite differences of `ref`, for every float argument."""
    outputs, f_vjp = tsr.vjp(fn, *arrays)
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    rng = np.random.default_rng(seed)
    cts = [rng.standard_normal(np.shape(o)).astype(o.dtype) for o in outs]
    grads = f_vjp(tuple(cts) if isinstance(outputs, tuple) else cts[0])
    wrt = [i for i, a in enumerate(arrays) if np.asarray(a).dtype.kind == "f"]
    assert len(grads) == len(arrays)
    for i, want in zip(wrt, numeric_vjp(ref, arrays, cts, wrt)):
        assert grads[i].dtype == arrays[i].dtype
        assert_gradient(grads[i], want, f"{fn.name}: gradient of {(names or {}).get(i, i)}", rtol)
    return grads


def normal(shape, rng, positive=False):
    x = rng.standard_normal(shape)
    return (np.abs(x) + 0.5 if positive else x).astype(np.float32)


# --- elementwise ---------------------------------------------------------------------------------

UNARY = ("neg", "abs", "exp", "exp2", "log", "log2", "tanh", "sqrt", "rsqrt", "sin", "cos", "erf", "sigmoid")
POSITIVE = {"log", "log2", "sqrt", "rsqrt"}


@tsr.function
def unary_ops(a, b, c, d, e, f, g_, h, i, j, k, m, n):
    return tuple(getattr(tsr, name)(x) for name, x in zip(UNARY, (a, b, c, d, e, f, g_, h, i, j, k, m, n)))


def unary_reference(*xs):
    return tuple(g.ELEMENTWISE[name].ref(x) for name, x in zip(UNARY, xs))


@EXAMPLES
@given(shape=st.lists(DIMS, min_size=1, max_size=3), seed=st.integers(0, 99))
def test_unary_rules(shape, seed):
    rng = np.random.default_rng(seed)
    arrays = [normal(shape, rng, name in POSITIVE) for name in UNARY]
    check_vjp(unary_ops, unary_reference, arrays, dict(enumerate(UNARY)))


BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "pow", "remainder")
#: ops whose second operand (a divisor) is kept away from 0; pow's base is kept positive
POSITIVE_B = {"div", "remainder"}


@tsr.function
def binary_ops(a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7):
    xs = (a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7)
    return tuple(getattr(tsr, name)(xs[2 * n], xs[2 * n + 1]) for n, name in enumerate(BINARY))


def binary_reference(*xs):
    return tuple(g.ELEMENTWISE[name].ref(xs[2 * n], xs[2 * n + 1]) for n, name in enumerate(BINARY))


def broadcast_pair(draw, shape):
    """Two shapes that broadcast to `shape`: dims set to 1 and leading dims dropped at random."""
    def variant():
        dims = [1 if draw(st.booleans()) else d for d in shape]
        return dims[draw(st.integers(0, len(dims) - 1)):]
    return variant(), variant()


@EXAMPLES
@given(data=st.data(), shape=st.lists(DIMS, min_size=1, max_size=3), seed=st.integers(0, 99))
def test_binary_rules_with_broadcasting(data, shape, seed):
    rng = np.random.default_rng(seed)
    arrays, names = [], {}
    for name in BINARY:
        sa, sb = broadcast_pair(data.draw, shape)
        names[len(arrays)], names[len(arrays) + 1] = f"{name} lhs {sa}", f"{name} rhs {sb}"
        arrays += [normal(sa, rng, name == "pow"), normal(sb, rng, name in POSITIVE_B)]
    check_vjp(binary_ops, binary_reference, arrays, names)


def test_maximum_and_minimum_split_ties_in_half():
    @tsr.function
    def both(a: Tensor["N"], b: Tensor["N"]):
        return tsr.maximum(a, b) + 2 * tsr.minimum(a, b)
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([1.0, 5.0, 0.0], np.float32)
    _, f_vjp = tsr.vjp(both, a, b)
    da, db = f_vjp(np.ones(3, np.float32))
    np.testing.assert_allclose(da, [1.5, 2.0, 1.0])
    np.testing.assert_allclose(db, [1.5, 1.0, 2.0])


def test_extremes_the_user_chains_split_their_ties_call_by_call():
    """As torch: amax(amax(x, 1), 0) splits per call (only one call over several dims is joint)."""
    @tsr.function
    def chained(x: Tensor["M", "N"]):
        return tsr.amax(tsr.amax(x, 1, True), 0).sum() + tsr.max(x, 1, True).values.amax(0).sum()
    x = np.array([[1.0, 1.0], [1.0, 0.0]], np.float32)
    np.testing.assert_allclose(tsr.grad(chained)(x), [[0.25 + 0.5, 0.25], [0.5 + 0.5, 0.0]])


def test_max_along_a_dim_sends_its_gradient_to_the_index_it_returns():
    """torch's max(x, dim).values: all of it to the first extreme (its indices'), not split."""
    @tsr.function
    def f(x: Tensor["R", "C"]):
        top = x.max(1)
        return top.values, top.indices, x.min(0, keepdim=True).values
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 0.0, 5.0]], np.float32)
    out, f_vjp = tsr.vjp(f, x)
    np.testing.assert_array_equal(out[1], [1, 0])
    (dx,) = f_vjp((np.ones(2, np.float32), None, np.full((1, 4), 2.0, np.float32)))
    np.testing.assert_allclose(dx, [[2, 3, 0, 2], [1, 0, 2, 0]])


def test_relu_and_clamp_ties_follow_torch():
    """relu's gradient at 0 is 0, a clamp's at its bounds all to x (torch's; maximum halves)."""
    @tsr.function
    def f(x: Tensor["N"]):
        return tsr.relu(x) + 2 * tsr.clamp(x, -1.0, 1.0) + 4 * tsr.clamp(x, min=0.5)
    x = np.array([-1.0, 0.0, 0.5, 1.0, 3.0], np.float32)
    _, f_vjp = tsr.vjp(f, x)
    (dx,) = f_vjp(np.ones(5, np.float32))
    np.testing.assert_allclose(dx, [2.0, 2.0, 1 + 2 + 4, 1 + 2 + 4, 1 + 4])


@tsr.function
def masked(x, y, m: Tensor["R", "C"]):
    rows, cols = tsr.arange(m.shape[0]), tsr.arange(m.shape[1])
    causal = tsr.where(rows[:, None] >= cols[None, :], m, -1e4)
    picked = tsr.where(x > y, x * y, tsr.sin(y)) + y ** 3   # a mask computed from the inputs
    clamped = tsr.clamp(x, -0.5, 0.5) + tsr.relu(y) + (x // 1.5) * 0.0
    return causal * 2.0, picked, clamped.masked_fill(y > 1.0, 0.0), x.argmax(1)


def masked_reference(x, y, m):
    r, c = np.indices(m.shape)
    causal = np.where(r >= c, m, -1e4)
    clamped = np.clip(x, -0.5, 0.5) + np.maximum(y, 0) + np.floor_divide(x, 1.5) * 0.0
    return causal * 2.0, np.where(x > y, x * y, np.sin(y)) + y ** 3, np.where(y > 1.0, 0.0, clamped), x.argmax(1)


@EXAMPLES
@given(rows=DIMS, cols=DIMS, seed=st.integers(0, 99))
def test_where_masks_and_piecewise_ops(rows, cols, seed):
    """where's branches, clamp and relu take gradients; comparisons, floor_divide and argmax give none."""
    rng = np.random.default_rng(seed)
    check_vjp(masked, masked_reference, [normal((rows, cols), rng) for _ in range(3)])


# --- views ---------------------------------------------------------------------------------------

@tsr.function
def views(a, b, c, d, e, f, h):
    A, B, C = a.shape
    return (tsr.sin(a.permute(2, 0, 1)),
            tsr.sin(b.transpose(0, 1).reshape(-1)),
            tsr.sin(c.unsqueeze(1).expand(A, 3, B, C)),
            tsr.sin(d[:, B // 3:B // 3 + max(1, B // 2), -1]),
            tsr.sin(e[..., ::2]),
            tsr.sin(tsr.cat([f, h * 2.0], dim=1)),
            tsr.sin(tsr.stack([f.mT, h.mT], dim=0)))


def views_reference(a, b, c, d, e, f, h):
    A, B, C = a.shape
    return (np.sin(a.transpose(2, 0, 1)),
            np.sin(b.transpose(1, 0, 2).reshape(-1)),
            np.sin(np.broadcast_to(c[:, None], (A, 3, B, C))),
            np.sin(d[:, B // 3:B // 3 + max(1, B // 2), -1]),
            np.sin(e[..., ::2]),
            np.sin(np.concatenate([f, h * 2.0], axis=1)),
            np.sin(np.stack([f.swapaxes(-1, -2), h.swapaxes(-1, -2)], axis=0)))


@EXAMPLES
@given(shape=st.lists(DIMS, min_size=3, max_size=3), seed=st.integers(0, 99))
def test_view_rules(shape, seed):
    rng = np.random.default_rng(seed)
    check_vjp(views, views_reference, [normal(shape, rng) for _ in range(7)])


# --- reductions ----------------------------------------------------------------------------------

@tsr.function
def reductions(a, b, c, d, e, f):
    return (a.sum((0, 2), keepdim=True) * 1.5, tsr.mean(b, 1), tsr.amax(c, -1), tsr.amin(d, 0, keepdim=True),
            e.sum(), f.var(1, correction=0), f.max(1).values)


def reductions_reference(a, b, c, d, e, f):
    return (a.sum((0, 2), keepdims=True) * 1.5, b.mean(1), c.max(-1), d.min(0, keepdims=True), e.sum(),
            f.var(1), f.max(1))


@EXAMPLES
@given(shape=st.lists(DIMS, min_size=3, max_size=3), seed=st.integers(0, 99))
def test_reduction_rules(shape, seed):
    rng = np.random.default_rng(seed)
    check_vjp(reductions, reductions_reference, [normal(shape, rng) for _ in range(6)])


def test_amax_and_amin_split_ties_evenly():
    @tsr.function
    def extremes(x: Tensor["R", "C"]):
        return tsr.amax(x, 1) + tsr.amin(x, 1)
    x = np.array([[1.0, 3.0, 3.0, 2.0], [4.0, 4.0, 4.0, 0.0]], np.float32)
    _, f_vjp = tsr.vjp(extremes, x)
    (dx,) = f_vjp(np.array([1.0, 3.0], np.float32))
    np.testing.assert_allclose(dx, [[1.0, 0.5, 0.5, 0.0], [1.0, 1.0, 1.0, 3.0]])


@pytest.mark.parametrize("reduce,kind,axes", [
    (lambda x: tsr.amax(x, (0, 2)), "max", (0, 2)),
    (lambda x: tsr.amin(x, (1, 2), keepdim=True), "min", (1, 2)),
    (lambda x: x.max(), "max", (0, 1, 2)),
    (lambda x: x.min(), "min", (0, 1, 2)),
])
def test_an_extreme_over_several_dims_splits_its_ties_evenly_over_all(reduce, kind, axes):
    """As torch's one reduction: each element equal to the extreme gets 1 / (their count), not the
    product of each dim's split (amax over (0, 1) of [[1, 1], [1, 0]] had given 1/4, 1/4, 1/2)."""
    @tsr.function
    def f(x: Tensor["A", "B", "C"]):
        return reduce(x)
    x = np.random.default_rng(3).integers(0, 2, (3, 4, 5)).astype(np.float32)   # many ties
    out, f_vjp = tsr.vjp(f, x)
    (dx,) = f_vjp(np.ones_like(out))
    hit = x == getattr(x, kind)(axis=axes, keepdims=True)
    np.testing.assert_allclose(dx, hit / hit.sum(axis=axes, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_extremes_of_a_value_its_dtype_rounds_find_their_elements(dtype):
    """The extreme of a * b was stored rounded to fp16 while the backward computed a * b again in
    f32: no element equalled it and every gradient was 0 (`ops.equals_extreme`). As torch on the
    rounded product: amax splits among the elements that round to the max, max(dim).values gives
    all to the first, and one amax over both dims splits over all of them."""
    import ml_dtypes
    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)

    @tsr.function
    def f(a: Tensor["R", "C"], b: Tensor["R", "C"]):
        p = a * b
        return tsr.amax(p, 1).to(tsr.fp32), p.max(0).values.to(tsr.fp32), p.amax((0, 1), keepdim=True).to(tsr.fp32)
    rng = np.random.default_rng(5)
    a, b = (rng.integers(-3, 4, (6, 40)).astype(dtype) for _ in range(2))   # (ties aplenty)
    b[0] = rng.standard_normal(40).astype(dtype)
    out, f_vjp = tsr.vjp(f, a, b)
    g_rows, g_cols, g_all = rng.standard_normal(6), rng.standard_normal(40), np.full((1, 1), 1.5)
    da, _ = f_vjp(tuple(np.asarray(v, np.float32) for v in (g_rows, g_cols, g_all)))
    p = (a.astype(np.float64) * b).astype(dtype).astype(np.float64)
    rows = p == p.max(1, keepdims=True)
    first = np.zeros_like(rows)
    first[p.argmax(0), np.arange(40)] = True
    every = p == p.max()
    dp = rows / rows.sum(1, keepdims=True) * g_rows[:, None] + first * g_cols[None, :] + every / every.sum() * g_all
    np.testing.assert_allclose(np.asarray(da, np.float64), (dp * b.astype(np.float64)).astype(dtype).astype(np.float64),
                               rtol=1e-2, atol=1e-2)


# --- matmul --------------------------------------------------------------------------------------

@tsr.function
def products(a: Tensor["M", "K"], b: Tensor["K", "N"], p: Tensor["B", 1, "M", "K"], q: Tensor["H", "N", "K"],
             t: Tensor["K", "M"]):
    return a @ b, tsr.matmul(p, q.mT), t.T @ b


def products_reference(a, b, p, q, t):
    return a @ b, p @ q.swapaxes(-1, -2), t.T @ b


@EXAMPLES
@given(m=DIMS, k=DIMS, n=DIMS, batch=DIMS, heads=DIMS, seed=st.integers(0, 99))
def test_matmul_rules_batched_broadcast_and_transposed(m, k, n, batch, heads, seed):
    rng = np.random.default_rng(seed)
    shapes = [(m, k), (k, n), (batch, 1, m, k), (heads, n, k), (k, m)]
    check_vjp(products, products_reference, [normal(s, rng) for s in shapes])


# --- softmax, norms, casts -----------------------------------------------------------------------

@tsr.function
def normalizations(a, b, c, d, e, w: Tensor["N"], bias: Tensor["N"]):
    n = a.shape[-1]
    return (tsr.softmax(a, dim=-1), tsr.softmax(a * 0.5, dim=0), tsr.log_softmax(b, dim=-1),
            tsr.logsumexp(b, 0), tsr.layer_norm(c, n, w, bias, eps=1e-5), tsr.layer_norm(d, n),
            tsr.rms_norm(e, n, w, eps=1e-6))


def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _layer_norm(x, w=1.0, b=0.0, eps=1e-5):
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + eps) * w + b


def normalizations_reference(a, b, c, d, e, w, bias):
    lse = np.log(np.exp(b).sum(-1, keepdims=True))
    return (_softmax(a, -1), _softmax(a * 0.5, 0), b - lse, np.log(np.exp(b).sum(0)), _layer_norm(c, w, bias),
            _layer_norm(d), e / np.sqrt((e * e).mean(-1, keepdims=True) + 1e-6) * w)


@EXAMPLES
@given(rows=DIMS, n=st.sampled_from([2, 3, 5, 7]), seed=st.integers(0, 99))
def test_softmax_and_norm_rules(rows, n, seed):
    rng = np.random.default_rng(seed)
    arrays = [normal((rows, n), rng) for _ in range(5)] + [normal((n,), rng), normal((n,), rng)]
    check_vjp(normalizations, normalizations_reference, arrays, rtol=3e-4)


def test_cast_gradient_comes_back_in_the_input_dtype():
    @tsr.function
    def widened(x: Tensor["N"], y: Tensor["N"]):
        return tsr.sin(x.float()) * y, (y * 3.0).half()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(9).astype(np.float16), rng.standard_normal(9).astype(np.float32)
    dx, dy = check_vjp(widened, lambda x, y: (np.sin(x) * y, y * 3.0), [x, y], rtol=2e-3)
    assert dx.dtype == np.float16 and dy.dtype == np.float32


# --- attention -----------------------------------------------------------------------------------

@tsr.function
def softcapped_causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                                v: Tensor["B", "H", "S", "D"]):
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = 5.0 * tsr.tanh(scores / 5.0)
    rows, cols = tsr.arange(q.shape[-2]), tsr.arange(k.shape[-2])
    scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


def attention_reference(q, k, v):
    s = 5.0 * np.tanh(q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1]) / 5.0)
    r, c = np.indices(s.shape[-2:])
    return _softmax(np.where(r >= c, s, -np.inf), -1) @ v


@settings(max_examples=4, deadline=None, derandomize=True)
@given(heads=st.sampled_from([1, 2]), s=st.sampled_from([3, 5, 7]), d=st.sampled_from([2, 4]),
       seed=st.integers(0, 99))
def test_causal_softcapped_attention(heads, s, d, seed):
    rng = np.random.default_rng(seed)
    check_vjp(softcapped_causal_attention, attention_reference,
              [normal((1, heads, s, d), rng) for _ in range(3)], {0: "q", 1: "k", 2: "v"}, rtol=3e-4)


# --- tsr.grad, the API's conventions, the IR -------------------------------------------------------

@tsr.function
def norm_loss(x: Tensor["R", "N"], w: Tensor["N"]):
    return (tsr.layer_norm(x, x.shape[-1], w) * tsr.tanh(x)).mean()


def norm_loss_reference(x, w):
    return float((_layer_norm(x, w) * np.tanh(x)).mean())


def test_grad_of_a_scalar_loss():
    rng = np.random.default_rng(3)
    x, w = normal((5, 7), rng), normal((7,), rng)
    dx = tsr.grad(norm_loss)(x, w)
    dx2, dw = tsr.grad(norm_loss, argnums=(0, 1))(x, w)
    (dw_only,) = tsr.grad(norm_loss, argnums=(1,))(x, w)
    want_x, want_w = numeric_vjp(norm_loss_reference, [x, w], [1.0], [0, 1])
    assert_gradient(dx, want_x, "dx")
    assert_gradient(dx2, want_x, "dx (argnums=(0, 1))")
    assert_gradient(dw, want_w, "dw")
    assert_gradient(dw_only, want_w, "dw (argnums=(1,))")


def test_vjp_of_a_scalar_output_and_arguments_without_gradients():
    @tsr.function
    def scaled_sum(x: Tensor["N"], i: Tensor["N", tsr.int32], scale=0.5):
        return (x * i.float() * scale).sum(), i + 1
    x, i = np.arange(4, dtype=np.float32), np.array([1, 2, 3, 4], np.int32)
    (total, shifted), f_vjp = tsr.vjp(scaled_sum, x, i)   # scale: its default
    assert total.shape == () and total == 10.0 and shifted[0] == 2
    dx, di, dscale = f_vjp((np.float32(2.0), None))
    np.testing.assert_allclose(dx, 2.0 * 0.5 * i)
    assert di is None and dscale is None
    _, f_vjp = tsr.vjp(scaled_sum, i.astype(np.int32), i, 0.5)   # no float argument: nothing to compile
    assert f_vjp((np.float32(1.0), None)) == (None, None, None)


def test_unreached_inputs_get_zeros_and_passed_through_cotangents_are_copies():
    @tsr.function
    def passthrough(x: Tensor["N"], y: Tensor["N"], unused: Tensor["N"]):
        return x + y
    x = np.ones(3, np.float32)
    _, f_vjp = tsr.vjp(passthrough, x, x, x)
    ct = np.array([1.0, 2.0, 3.0], np.float32)
    dx, dy, du = f_vjp(ct)
    np.testing.assert_array_equal(dx, ct)
    np.testing.assert_array_equal(dy, ct)
    np.testing.assert_array_equal(du, np.zeros(3))
    tsr.vjp(passthrough, x, x, x)[1](ct)   # a second vjp reuses the first one's compile
    assert len({id(c) for c in tsr.autodiff.api._vjp_function(passthrough, (0,), 0)._cache.values()}) == 1


@tsr.function
def softmax_loss(x: Tensor["R", "N"]):
    return (tsr.softmax(x, dim=-1) * tsr.tanh(x)).sum()


def softmax_loss_reference(x):
    return float((_softmax(x, -1) * np.tanh(x)).sum())


@pytest.mark.parametrize("loss, reference", [(softmax_loss, softmax_loss_reference),
                                             (norm_loss, norm_loss_reference)])
def test_double_backward_hessian_vector_products(loss, reference):
    """tsr.vjp of tsr.grad: the backward of a backward graph, against nested finite differences."""
    rng = np.random.default_rng(5)
    arrays = [normal((3, 5), rng)] + ([normal((5,), rng)] if loss is norm_loss else [])
    v = normal((3, 5), rng)
    gradient, hvp = tsr.vjp(tsr.grad(loss), *arrays)

    def numeric_grad(*xs):
        return numeric_vjp(reference, xs, [1.0], [0], step=1e-5)[0]
    assert_gradient(gradient, numeric_grad(*arrays), "gradient")
    wrt = list(range(len(arrays)))
    for got, want, name in zip(hvp(v), numeric_vjp(numeric_grad, arrays, [v], wrt, step=1e-4), "xw"):
        assert_gradient(got, want, f"Hessian-vector product, {name} part", rtol=1e-3)


def test_backward_graph_prints_parses_back_and_keeps_the_forward_lines(tmp_path):
    from tessera.autodiff.backward import backward_graph
    from tessera.frontend.trace import ArgSpec
    from tessera.ir import parse_ir, print_ir

    specs = [ArgSpec(n, (1, 2, 5, 4), tsr.fp32, ("B", "H", "S", "D")) for n in "qkv"]
    backward = backward_graph(softcapped_causal_attention.trace(specs))
    text = print_ir(backward)
    assert print_ir(parse_ir(text)) == text
    f = next(iter(backward.ops))
    assert [a.data for a in f.attributes["tessera.arg_names"].data] == ["q", "k", "v", "d_out0"]
    assert [a.data for a in f.attributes["tessera.result_names"].data] == ["grad_q", "grad_k", "grad_v"]
    lines = {op.attributes["tessera.loc"].data.rsplit(":", 1)[1] for op in f.body.block.ops
             if "tessera.loc" in op.attributes}
    first = softcapped_causal_attention.fn.__code__.co_firstlineno
    assert lines <= {str(first + n) for n in range(3, 8)}, lines   # the forward's own lines only
    # the same text from a compile's dump, as --dump-ir writes it
    _, f_vjp = tsr.vjp(softcapped_causal_attention, *[np.ones((1, 2, 5, 4), np.float32)] * 3)
    derivative = tsr.autodiff.api._vjp_function(softcapped_causal_attention, (0,), 0)
    compiled = derivative.compile(specs + [ArgSpec("d_out0", (1, 2, 5, 4), tsr.fp32, ("B", "H", "S", "D"))],
                                  dump=["graph", "schedule"], dump_dir=tmp_path)
    assert (tmp_path / "graph.mlir").read_text() == compiled.ir("graph") == text


def test_vjp_call_mistakes_name_what_was_wrong():
    @tsr.function
    def two(x: Tensor["N"]):
        return x * 2.0, x * 3.0
    _, f_vjp = tsr.vjp(two, np.ones(2, np.float32))
    with pytest.raises(TesseraError, match="two returns 2 outputs, so vjp_fn takes a tuple of 2 cotangents"):
        f_vjp(np.ones((2, 2), np.float32))   # (was split into its rows)

    @tsr.function
    def weighted(x: Tensor["N"], w: Tensor["N"]):
        return (x * w).sum()
    with pytest.raises(TesseraError, match="weighted takes 2 arguments \\(x, w\\), got 1: 'w' missing"):
        tsr.vjp(weighted, np.ones(3, np.float32))
    _, f_vjp = tsr.vjp(two, np.ones(2, np.float32))
    with pytest.raises(DTypeError, match="cotangent of output 1 is float64, the output fp32"):
        f_vjp((np.ones(2, np.float32), np.ones(2)))


def test_a_norm_over_x_shape_of_a_dim_that_varies():
    """layer_norm(x, x.shape[-1]) once the last dim is taken at run time (a dim, not a number)."""
    @tsr.function
    def f(x: Tensor["N", "D"], w: Tensor["D"]):
        return tsr.layer_norm(x, x.shape[-1], w) + tsr.rms_norm(x, x.shape[-1], w)
    for d in (4, 8, 12):
        x = np.random.default_rng(d).standard_normal((3, d)).astype(np.float32)
        out, f_vjp = tsr.vjp(f, x, np.ones(d, np.float32))
        centred = x - x.mean(-1, keepdims=True)
        want = centred / np.sqrt(x.var(-1, keepdims=True) + 1e-5) + x / np.sqrt((x * x).mean(-1, keepdims=True) + np.finfo(np.float32).eps)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        assert [g.shape for g in f_vjp(np.ones_like(out))] == [(3, d), (d,)]


def test_mistakes_are_refused_with_their_reason():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ShapeError, match="one 0-d float tensor"):
        tsr.grad(unary_ops)(*[x] * len(UNARY))
    with pytest.raises(DTypeError, match="requires float inputs; argument 'i'"):
        @tsr.function
        def counted(x: Tensor["N"], i: Tensor["N", tsr.int32]):
            return (x * i.float()).sum()
        tsr.grad(counted, argnums=1)(x[0], np.ones(3, np.int32))
    _, f_vjp = tsr.vjp(softcapped_causal_attention, *[np.ones((1, 1, 3, 2), np.float32)] * 3)
    with pytest.raises(ShapeError, match="cotangent of output 0 has shape"):
        f_vjp(np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(DTypeError, match="cotangent of output 0 is fp16"):
        f_vjp(np.ones((1, 1, 3, 2), np.float16))

    @tsr.kernel
    def copy(a: Tensor["N"], c: Tensor["N"]):
        c[:] = a
    with pytest.raises(TesseraError, match="@tsr.kernel"):
        tsr.vjp(copy, x[0], x[0])
    with pytest.raises(TypeError, match="@tsr.function"):
        tsr.grad(lambda x: x)


def test_fp16_attention_backward_runs_on_the_cpu_and_compiles_to_ptx():
    """The backward is an ordinary function: CUDA calls take the same compile through PTX."""
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((1, 2, 7, 8)).astype(np.float16) for _ in range(3)]
    check_vjp(softcapped_causal_attention, attention_reference, arrays, {0: "q", 1: "k", 2: "v"}, rtol=2e-2)
    derivative = tsr.autodiff.api._vjp_function(softcapped_causal_attention, (0,), 2)   # saving the log-sum-exp and the output
    compiled = next(c for c in derivative._cache.values() if "f16" in c.ir("graph"))
    kernels = compiled.stage("ptx")
    assert set(kernels) == set(compiled.kernel_names) and len(kernels) > 4
    assert any("mma" in k.ptx for k in kernels.values())


def test_every_graph_op_with_float_results_has_a_rule(monkeypatch):
    from tessera.autodiff import rules

    elementwise = {f"graph.{e.name}" for e in g.ELEMENTWISE.values() if e.result != "bool"}
    reductions = {f"graph.reduce.{kind}" for kind in g.REDUCTIONS}
    no_operand_or_no_result = {*g.SOURCE_OPS, g.AssertOp}
    structural = {op.name for op in g.STRUCTURAL_OPS if op not in no_operand_or_no_result | {g.ReduceOp}}
    assert elementwise | reductions | structural == set(rules.VJP_RULES)
    monkeypatch.delitem(rules.VJP_RULES, "graph.tanh")
    with pytest.raises(TesseraError, match="no gradient rule for graph.tanh"):
        tsr.grad(softmax_loss)(np.ones((2, 3), np.float32))


@tsr.function
def norm_statistics(x: Tensor["M", "N"]):
    from tessera.frontend import ops
    return (ops.norm_statistic(x, "mean", 1e-5, True), ops.norm_statistic(x, "rstd", 1e-5, True),
            ops.norm_statistic(x, "rstd", 1e-6, False))


def norm_statistics_reference(x):
    mean = x.mean(-1, keepdims=True)
    return (mean, 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5),
            1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6))


def test_norm_statistics_what_norms_save_have_gradients():
    """graph.norm_statistic (a norm's saved mean and rstd) differentiates like the math it stands for."""
    check_vjp(norm_statistics, norm_statistics_reference, [normal((5, 7), np.random.default_rng(3))])
