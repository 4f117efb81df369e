"""Tracing Python into Graph IR: the ops users call, the IR they produce, and the errors they raise.

Every DSL op exported by `tessera/__init__.py` is traced, compiled and run here at least
once against a NumPy formula written independently of the oracle (torch argument
conventions for layer_norm / rms_norm / gelu). Errors must be TesseraError subclasses
whose message names the user's arguments and dims and whose `.location` is the user's line.
"""
import math
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import DTypeError, ShapeError, TesseraError

from seed_kernels import flash_attention

THIS_FILE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line of this file holding `# <marker>` (so the tests survive edits above them)."""
    with open(__file__) as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def graph_ops(fn, dims, dtype="fp32"):
    module = fn.trace(fn.arg_specs_for(dims, dtype))
    module.verify()
    f = next(iter(module.ops))
    return f, [op for op in f.body.block.ops]


def tensor_shape(value):
    from tessera.ir import graph
    return graph.tensor_type(value).shape


def tensor_dtype(value):
    from tessera.ir import graph
    return graph.tensor_type(value).dtype


# --- what tracing produces ------------------------------------------------------------------------------------------


def test_seed_attention_traces_to_the_expected_graph():
    f, ops = graph_ops(flash_attention, {"B": 2, "H": 4, "S": 1000, "D": 64}, "fp16")
    assert [op.name for op in ops] == ["graph.transpose", "graph.matmul", "graph.constant", "graph.mul",
                                       "graph.softmax", "graph.matmul", "func.return"]
    assert [tensor_shape(a) for a in f.body.block.args] == [("B", "H", "S", "D")] * 3
    transpose, scores, const, scaled, softmax, out = ops[:6]
    assert transpose.permutation == (0, 1, 3, 2)
    assert tensor_shape(scores.res) == ("B", "H", "S", "S")
    assert const.value.value.data == pytest.approx(1.0 / math.sqrt(64))
    assert tensor_dtype(const.res) == tsr.fp16  # Python numbers take the tensor's dtype (weak typing)
    assert softmax.axis.data == 3
    assert tensor_shape(out.res) == ("B", "H", "S", "D") and tensor_dtype(out.res) == tsr.fp16
    dims = {k: v.value.data for k, v in f.attributes["tessera.dims"].data.items()}
    assert dims == {"B": 2, "H": 4, "S": 1000, "D": 64}
    assert [a.data for a in f.attributes["tessera.arg_names"].data] == ["q", "k", "v"]


def test_dims_are_ints_that_remember_their_names():
    seen = []

    @tsr.function
    def f(q: Tensor["B", "S", "D"]):
        d = q.shape[-1]
        seen.append((d, d.name, math.sqrt(d), q.shape[0] * 2, len(q), q.ndim, q.size(1)))
        return q * (1.0 / math.sqrt(d))

    f.trace(f.arg_specs_for({"B": 3, "S": 5, "D": 64}))
    d, name, root, twice, length, ndim, size1 = seen[0]
    assert d == 64 and isinstance(d, int) and name == "D" and root == 8.0
    assert twice == 6 and length == 3 and ndim == 3 and size1 == 5


def test_the_function_body_runs_once_per_specialisation():
    calls = []

    @tsr.function
    def f(x: Tensor["N"]):
        calls.append(1)
        return x + 1.0

    for _ in range(3):
        f(np.zeros(4, np.float32))
    f(np.zeros(5, np.float32))
    assert len(calls) == 2


def test_unannotated_arguments_get_positional_dim_names():
    @tsr.function
    def f(x, y):
        return x + y

    module = f.trace(f.arg_specs(
        [("x", np.zeros((2, 3), np.float32)), ("y", np.zeros((3,), np.float32))])[1])
    func = next(iter(module.ops))
    assert [tensor_shape(a) for a in func.body.block.args] == [("x_0", "x_1"), ("y_0",)]


@pytest.mark.parametrize("a,b,want", [
    (tsr.fp16, tsr.fp16, tsr.fp16), (tsr.fp16, tsr.fp32, tsr.fp32), (tsr.bf16, tsr.fp32, tsr.fp32),
    (tsr.fp16, tsr.bf16, tsr.fp32), (tsr.int32, tsr.fp16, tsr.fp16), (tsr.bool_, tsr.int32, tsr.int32),
])
def test_dtype_promotion(a, b, want):
    @tsr.function
    def f(x: Tensor["N", a], y: Tensor["N", b]):
        return x + y

    _, ops = graph_ops(f, {"N": 4})
    assert tensor_dtype(ops[0].res) == want


def test_python_scalars_are_weakly_typed():
    @tsr.function
    def f(x: Tensor["N", tsr.fp16], i: Tensor["N", tsr.int32]):
        return x * 2.5, i + 1, i * 0.5, x > 0

    f_op, _ = graph_ops(f, {"N": 4})
    ret = f_op.body.block.last_op
    assert [tensor_dtype(v) for v in ret.operands] == [tsr.fp16, tsr.int32, tsr.fp32, tsr.bool_]


def test_arange_over_a_symbolic_dim_keeps_its_name():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x * tsr.arange(x.shape[-1])

    _, ops = graph_ops(f, {"M": 3, "N": 5})
    (arange,) = [op for op in ops if op.name == "graph.arange"]
    assert tensor_shape(arange.res) == ("N",) and tensor_dtype(arange.res) == tsr.int32
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    np.testing.assert_allclose(f(x), x * np.arange(5), rtol=1e-6)


def test_none_indexing_and_broadcasting_shapes():
    @tsr.function
    def f(x: Tensor["M", "N"], y: Tensor["N"]):
        return x[:, None, :], y[None], x[..., None] + y, y[:, None] * y[None, :]

    f_op, _ = graph_ops(f, {"M": 3, "N": 5})
    ret = f_op.body.block.last_op
    assert [tensor_shape(v) for v in ret.operands] == [("M", 1, "N"), (1, "N"), ("M", "N", "N"), ("N", "N")]


# --- every DSL op, against NumPy -------------------------------------------------------------------------------

def np_erf(x):
    return np.vectorize(math.erf)(x.astype(np.float64))


def np_layer_norm(x, w=None, b=None, eps=1e-5):
    x = x.astype(np.float64)
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def np_rms_norm(x, w=None, eps=None):
    eps = float(np.finfo(np.float32).eps) if eps is None else eps   # torch's: its compute type's
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * (1 if w is None else w)


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


#: name -> (tessera function of x, y, w, p (p > 0); NumPy formula of the same arrays)
UNARY_BINARY = {
    "add": (lambda x, y, w, p: tsr.add(x, y), lambda x, y, w, p: x + y),
    "sub": (lambda x, y, w, p: tsr.sub(x, y) - x, lambda x, y, w, p: -y),
    "mul": (lambda x, y, w, p: tsr.mul(x, w), lambda x, y, w, p: x * w),
    "div": (lambda x, y, w, p: tsr.div(x, p), lambda x, y, w, p: x / p),
    "operators": (lambda x, y, w, p: (x + y) * 2.0 - y / p + (-x) + 1.5 ** y,
                  lambda x, y, w, p: (x + y) * 2 - y / p - x + 1.5 ** y),
    "reflected": (lambda x, y, w, p: 1.0 - x + 2.0 * y, lambda x, y, w, p: 1 - x + 2 * y),
    "neg": (lambda x, y, w, p: tsr.neg(x), lambda x, y, w, p: -x),
    "abs": (lambda x, y, w, p: tsr.abs(x) + abs(y), lambda x, y, w, p: np.abs(x) + np.abs(y)),
    "exp": (lambda x, y, w, p: tsr.exp(x), lambda x, y, w, p: np.exp(x)),
    "exp2": (lambda x, y, w, p: tsr.exp2(x), lambda x, y, w, p: np.exp2(x)),
    "log": (lambda x, y, w, p: tsr.log(p), lambda x, y, w, p: np.log(p)),
    "log2": (lambda x, y, w, p: tsr.log2(p), lambda x, y, w, p: np.log2(p)),
    "tanh": (lambda x, y, w, p: tsr.tanh(x) + y.tanh(), lambda x, y, w, p: np.tanh(x) + np.tanh(y)),
    "sqrt": (lambda x, y, w, p: tsr.sqrt(p) + p.sqrt(), lambda x, y, w, p: 2 * np.sqrt(p)),
    "rsqrt": (lambda x, y, w, p: tsr.rsqrt(p), lambda x, y, w, p: 1 / np.sqrt(p)),
    "sin_cos": (lambda x, y, w, p: tsr.sin(x) * tsr.cos(y), lambda x, y, w, p: np.sin(x) * np.cos(y)),
    "erf": (lambda x, y, w, p: tsr.erf(x), lambda x, y, w, p: np_erf(x)),
    "pow": (lambda x, y, w, p: tsr.pow(p, y) + x ** 2.0, lambda x, y, w, p: p ** y + x ** 2),
    "maximum": (lambda x, y, w, p: tsr.maximum(x, y), lambda x, y, w, p: np.maximum(x, y)),
    "minimum": (lambda x, y, w, p: tsr.minimum(x, w), lambda x, y, w, p: np.minimum(x, w)),
    "sigmoid": (lambda x, y, w, p: tsr.sigmoid(x), lambda x, y, w, p: 1 / (1 + np.exp(-x))),
    "relu": (lambda x, y, w, p: tsr.relu(x), lambda x, y, w, p: np.maximum(x, 0)),
    "silu": (lambda x, y, w, p: tsr.silu(x), lambda x, y, w, p: x / (1 + np.exp(-x))),
    "gelu": (lambda x, y, w, p: tsr.gelu(x), lambda x, y, w, p: 0.5 * x * (1 + np_erf(x / math.sqrt(2)))),
    "gelu_tanh": (lambda x, y, w, p: tsr.gelu(x, approximate="tanh"),
                  lambda x, y, w, p: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    "where": (lambda x, y, w, p: tsr.where(x > y, x, y * 2.0), lambda x, y, w, p: np.where(x > y, x, y * 2)),
    "where_scalars": (lambda x, y, w, p: tsr.where(x > 0.0, 1.0, -1.0), lambda x, y, w, p: np.where(x > 0, 1., -1.)),
    "lt": (lambda x, y, w, p: tsr.lt(x, y), lambda x, y, w, p: x < y),
    "le": (lambda x, y, w, p: tsr.le(x, w), lambda x, y, w, p: x <= w),
    "gt": (lambda x, y, w, p: tsr.gt(x, 0.0), lambda x, y, w, p: x > 0),
    "ge": (lambda x, y, w, p: tsr.ge(x, y), lambda x, y, w, p: x >= y),
    "eq": (lambda x, y, w, p: tsr.eq(x, x), lambda x, y, w, p: x == x),
    "ne": (lambda x, y, w, p: tsr.ne(x, y), lambda x, y, w, p: x != y),
    "comparison_operators": (lambda x, y, w, p: (x < y) & (x <= w) | ~(x > p) | (x >= 1.0) & (x == y) | (y != w),
                             lambda x, y, w, p: (x < y) & (x <= w) | ~(x > p) | (x >= 1) & (x == y) | (y != w)),
    "logical": (lambda x, y, w, p: tsr.logical_or(tsr.logical_and(x > 0.0, y > 0.0), tsr.logical_not(w < 0.0)),
                lambda x, y, w, p: ((x > 0) & (y > 0)) | ~(w < 0)),
    "cast_fp16": (lambda x, y, w, p: x.to(tsr.fp16), lambda x, y, w, p: x.astype(np.float16)),
    "cast_bf16": (lambda x, y, w, p: tsr.cast(x, "bf16"), lambda x, y, w, p: x.astype(ml_dtypes.bfloat16)),
    "cast_int32": (lambda x, y, w, p: (x * 10.0).to(tsr.int32), lambda x, y, w, p: (x * 10).astype(np.int32)),
    "cast_bool": (lambda x, y, w, p: (x > 0.0).to(tsr.fp32) + (x > 1.0).float(),
                  lambda x, y, w, p: (x > 0).astype(np.float32) + (x > 1)),
    "half_and_back": (lambda x, y, w, p: tsr.to(x.half(), tsr.float32),
                      lambda x, y, w, p: x.astype(np.float16).astype(np.float32)),
    "broadcast_row_col": (lambda x, y, w, p: x + w * tsr.sum(y, 1, keepdim=True),
                          lambda x, y, w, p: x + w * y.sum(1, keepdims=True)),
}


@pytest.mark.parametrize("name", list(UNARY_BINARY))
def test_elementwise_op(name):
    op, ref = UNARY_BINARY[name]

    @tsr.function
    def f(x: Tensor["M", "N"], y: Tensor["M", "N"], w: Tensor["N"], p: Tensor["M", "N"]):
        return op(x, y, w, p)

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x, y = (rng.standard_normal((5, 7)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(7).astype(np.float32)
    p = rng.uniform(0.5, 3.0, (5, 7)).astype(np.float32)
    out, want = f(x, y, w, p), np.asarray(ref(x, y, w, p))
    assert out.shape == want.shape
    if want.dtype == np.bool_ or want.dtype == np.int32:
        assert out.dtype == want.dtype
        np.testing.assert_array_equal(out, want)
    else:
        assert out.dtype == (want.dtype if want.dtype != np.float64 else np.float32)
        np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=2e-5, atol=2e-6)


REDUCTIONS = {
    "sum_last": (lambda x: tsr.sum(x, -1), lambda x: x.sum(-1)),
    "sum_keepdim": (lambda x: x.sum(dim=1, keepdim=True), lambda x: x.sum(1, keepdims=True)),
    "sum_two_dims": (lambda x: tsr.sum(x, dim=(0, 2)), lambda x: x.sum((0, 2))),
    "max_first": (lambda x: tsr.max(x, 0).values, lambda x: x.max(0)),
    "amax_keepdim": (lambda x: tsr.amax(x, dim=-1, keepdim=True), lambda x: x.max(-1, keepdims=True)),
    "method_max": (lambda x: x.max(dim=1)[0], lambda x: x.max(1)),
    "min": (lambda x: tsr.min(x, dim=2).values, lambda x: x.min(2)),
    "amin_method": (lambda x: tsr.amin(x, 1, keepdim=True) + x.min(dim=1, keepdim=True).values,
                    lambda x: 2 * x.min(1, keepdims=True)),
    "mean": (lambda x: tsr.mean(x, dim=-1), lambda x: x.mean(-1)),
    "mean_keepdim_method": (lambda x: x.mean(dim=(1, 2), keepdim=True), lambda x: x.mean((1, 2), keepdims=True)),
    "softmax_last": (lambda x: tsr.softmax(x, dim=-1), lambda x: np_softmax(x, -1)),
    "softmax_method_dim1": (lambda x: x.softmax(1), lambda x: np_softmax(x, 1)),
    "softmax_dim0": (lambda x: tsr.softmax(x, 0), lambda x: np_softmax(x, 0)),
}


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction_op(name):
    op, ref = REDUCTIONS[name]

    @tsr.function
    def f(x: Tensor["A", "M", "N"]):
        return op(x)

    x = np.random.default_rng(1).standard_normal((3, 4, 9)).astype(np.float32)
    out, want = f(x), ref(x.astype(np.float64))
    assert out.shape == want.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_layer_norm_torch_conventions():
    @tsr.function
    def f(x: Tensor["B", "S", "N"], w: Tensor["N"], b: Tensor["N"]):
        return (tsr.layer_norm(x, (x.shape[-1],)),                     # F.layer_norm(x, (N,))
                tsr.layer_norm(x, [x.shape[-1]], w, b),                 # positional weight, bias
                tsr.layer_norm(x, x.shape[-1], weight=w, eps=1e-3),     # int normalized_shape
                tsr.layer_norm(x, x.shape[-1], bias=b))

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 50)).astype(np.float32)
    w, b = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    outs = f(x, w, b)
    wants = [np_layer_norm(x), np_layer_norm(x, w, b), np_layer_norm(x, w, eps=1e-3), np_layer_norm(x, b=b)]
    for out, want in zip(outs, wants):
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1e-2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_rms_norm_torch_conventions(dtype, scale):
    """F.rms_norm(x, normalized_shape, weight=None, eps=None): eps None means fp32's epsilon, the
    type torch computes in, for 16-bit inputs too (at scale 1e-2, bf16's own epsilon would change
    the result 8-fold)."""
    @tsr.function
    def f(x: Tensor["S", "N"], w: Tensor["N"]):
        return tsr.rms_norm(x, (x.shape[-1],)), tsr.rms_norm(x, [x.shape[-1]], w, eps=1e-6)

    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 33)) * scale).astype(dtype)
    w = rng.standard_normal(33).astype(dtype)
    plain, weighted = f(x, w)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(plain.astype(np.float64), np_rms_norm(x), rtol=tol, atol=tol)
    np.testing.assert_allclose(weighted.astype(np.float64), np_rms_norm(x, w.astype(np.float64), 1e-6),
                               rtol=tol, atol=tol)


def test_matmul_and_views():
    @tsr.function
    def f(a: Tensor["B", "M", "K"], b: Tensor["K", "N"], c: Tensor["B", "N", "M"]):
        return (tsr.matmul(a, b), a @ b, (a @ b).transpose(1, 2) + c, a.permute(2, 0, 1) * 1.0,
                tsr.permute(a, (1, 0, 2)) * 1.0, tsr.transpose(a, 0, -1) * 1.0, b.T @ a.transpose(-2, -1),
                tsr.unsqueeze(b, 0) * 1.0, b.unsqueeze(-1) * 1.0)

    rng = np.random.default_rng(4)
    a = rng.standard_normal((2, 5, 6)).astype(np.float32)
    b = rng.standard_normal((6, 3)).astype(np.float32)
    c = rng.standard_normal((2, 3, 5)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    wants = [a64 @ b64, a64 @ b64, np.swapaxes(a64 @ b64, 1, 2) + c, a.transpose(2, 0, 1), a.transpose(1, 0, 2),
             a.transpose(2, 1, 0), b64.T @ np.swapaxes(a64, -2, -1), b[None], b[..., None]]
    for i, (out, want) in enumerate(zip(f(a, b, c), wants)):
        assert out.shape == want.shape, i
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")


@pytest.mark.parametrize("batch", [(1,), (7,), (2, 3)])
def test_rows_of_one_element_times_a_matrix_are_one_gemm(batch):
    """[..., B, 1, K] @ [K, N] (a decode step's h[:, None, :] @ w) is one GEMM over the B rows, not
    B one-row GEMMs: the unit axis moves out of the way and back as views, and on both PTX paths
    the kernel compiles (its operand used to be a copy with no source dim for its rows)."""
    @tsr.function
    def f(h: Tensor["B", "K"], w: Tensor["K", "N"]):
        return h[:, None, :] @ w, h.reshape(*batch, 1, h.shape[-1]) @ w, tsr.relu(h[:, None, :] @ w - 0.5)

    rng = np.random.default_rng(12)
    rows = int(np.prod(batch))
    h, w = rng.standard_normal((rows, 40)).astype(np.float32), rng.standard_normal((40, 24)).astype(np.float32)
    want = h.astype(np.float64) @ w
    one, nested, epilogue = f(h, w)
    np.testing.assert_allclose(one, want[:, None, :], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(nested, want.reshape(*batch, 1, 24), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(epilogue, np.maximum(want[:, None, :] - 0.5, 0), rtol=1e-5, atol=1e-5)
    for arch in ("sm_80", "sm_90a"):
        compiled = f.compile(f.arg_specs_for({"B": rows, "K": 40, "N": 24}, "f16"), arch=arch)
        assert sum("_gemm_" in name for name in compiled.launches) == 3   # (one a matmul; the epilogue: its own kernel)
        assert compiled.stage("ptx")


def test_reshape_that_only_adds_or_drops_unit_dims():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x.reshape(1, x.shape[0], x.shape[1]) * 2.0, tsr.reshape(x[:, None, :], x.shape[0], -1) + 1.0

    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    a, b = f(x)
    np.testing.assert_allclose(a, x[None] * 2, rtol=1e-6)
    np.testing.assert_allclose(b, x + 1, rtol=1e-6)


def test_reshape_that_merges_and_splits_dims():
    @tsr.function
    def f(x: Tensor["B", "S", "D"], w: Tensor["D", "E"]):
        flat = x.reshape(-1, x.shape[-1])                                   # [B*S, D]
        y = flat @ w                                                        # a GEMM over all tokens
        return y.reshape(x.shape[0], x.shape[1], -1), x.view(x.shape[0], -1) * 2.0

    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    y, flat = f(x, w)
    np.testing.assert_allclose(y, (x.reshape(-1, 4).astype(np.float64) @ w).reshape(2, 3, 5), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(flat, x.reshape(2, 12) * 2, rtol=1e-6)


# --- errors: TesseraError subclasses, user names in the message, the user's line as location -------------------------

def assert_located(info, marker: str | None = None):
    assert isinstance(info.value, TesseraError), type(info.value)
    assert info.value.location is not None and THIS_FILE in info.value.location, info.value.location
    if marker is not None:
        assert info.value.location.endswith(f":{line_of(marker)}"), (info.value.location, line_of(marker))


def test_matmul_contracting_dim_mismatch_names_args_and_dims():
    @tsr.function
    def scores(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "E"]):
        return tsr.matmul(q, k.transpose(-2, -1))  # contracting-mismatch

    with pytest.raises(ShapeError) as info:
        scores.compile(scores.arg_specs_for({"B": 1, "H": 2, "S": 16, "D": 128, "E": 64}, "fp16"))
    msg = info.value.message
    assert "matmul: contracting dims differ" in msg
    assert "q has D=128" in msg and "k has E=64" in msg
    assert_located(info, "contracting-mismatch")


def test_matmul_contracting_mismatch_of_unannotated_args():
    @tsr.function
    def scores(q, k):
        return tsr.matmul(q, k.transpose(-2, -1))  # unannotated-mismatch

    with pytest.raises(ShapeError) as info:
        scores(np.zeros((1, 2, 16, 128), np.float16), np.zeros((1, 2, 16, 64), np.float16))
    msg = info.value.message
    assert "contracting dims differ" in msg and "q" in msg and "k" in msg and "128" in msg and "64" in msg
    assert_located(info, "unannotated-mismatch")


def test_annotated_dim_conflict_names_both_args():
    q = np.zeros((1, 2, 16, 128), np.float16)
    k = np.zeros((1, 2, 16, 64), np.float16)
    with pytest.raises(ShapeError) as info:
        flash_attention(q, k, k)  # dim-conflict
    msg = info.value.message
    assert "'q'" in msg and "'k'" in msg and "D=128" in msg and "D=64" in msg
    assert_located(info, "dim-conflict")


def test_wrong_rank_against_annotation():
    with pytest.raises(ShapeError) as info:
        flash_attention(*[np.zeros((2, 16, 64), np.float16)] * 3)  # wrong-rank
    msg = info.value.message
    assert "'q'" in msg and "rank 4" in msg and "rank 3" in msg and "[2, 16, 64]" in msg
    assert_located(info, "wrong-rank")


def test_wrong_dtype_against_annotation():
    @tsr.function
    def f(a: Tensor["M", "K", tsr.fp16], b: Tensor["K", "N", tsr.fp16]):
        return a @ b

    with pytest.raises(DTypeError) as info:
        f(np.zeros((2, 3), np.float16), np.zeros((3, 4), np.float32))  # wrong-dtype
    msg = info.value.message
    assert "'b'" in msg and "fp16" in msg and "fp32" in msg
    assert_located(info, "wrong-dtype")


def test_wrong_literal_dim_against_annotation():
    @tsr.function
    def f(x: Tensor["B", 3]):
        return x * 1.0

    with pytest.raises(ShapeError) as info:
        f(np.zeros((2, 4), np.float32))  # wrong-literal
    assert "'x'" in info.value.message and "3" in info.value.message and "4" in info.value.message
    assert_located(info, "wrong-literal")


def test_traced_tensor_in_if_is_a_tessera_error():
    @tsr.function
    def relu_by_branch(x: Tensor["N"]):
        if x > 0:  # tensor-in-if
            return x
        return -x

    with pytest.raises(TesseraError) as info:
        relu_by_branch(np.ones(4, np.float32))
    assert "where" in info.value.message
    assert_located(info, "tensor-in-if")


def test_traced_tensor_in_boolean_operator_is_a_tessera_error():
    @tsr.function
    def f(x: Tensor["N"], y: Tensor["N"]):
        return x and y  # tensor-in-and

    with pytest.raises(TesseraError) as info:
        f(np.ones(4, np.float32), np.ones(4, np.float32))
    assert_located(info, "tensor-in-and")


@pytest.mark.parametrize("index", [slice(None, None, -1), [0, 1], (slice(None), 7), (Ellipsis, Ellipsis)],
                         ids=["negative-step", "list", "out-of-range", "two-ellipses"])
def test_unsupported_indexing(index):
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x[index] * 1.0  # bad-index

    with pytest.raises(TesseraError) as info:
        f(np.ones((3, 4), np.float32))
    assert "index" in info.value.message
    assert_located(info, "bad-index")


def test_boolean_mask_indexing_is_unsupported():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return x[x > 0.0]  # mask-index

    with pytest.raises(TesseraError) as info:
        f(np.ones((3, 4), np.float32))
    assert "where" in info.value.message or "index" in info.value.message
    assert_located(info, "mask-index")


def test_broadcast_mismatch_names_args_and_dims():
    @tsr.function
    def f(x: Tensor["M", "K"], y: Tensor["N"]):
        return x + y  # no-broadcast

    with pytest.raises(ShapeError) as info:
        f(np.ones((2, 3), np.float32), np.ones(4, np.float32))
    msg = info.value.message
    assert "x [M=2, K=3]" in msg and "y [N=4]" in msg
    assert_located(info, "no-broadcast")


def test_matmul_dtype_mismatch():
    @tsr.function
    def f(a: Tensor["M", "K", tsr.fp16], b: Tensor["K", "N", tsr.fp32]):
        return a @ b  # dtype-mismatch

    with pytest.raises(DTypeError) as info:
        f.trace(f.arg_specs_for({"M": 2, "K": 3, "N": 4}))
    assert "a is fp16" in info.value.message and "b is fp32" in info.value.message
    assert_located(info, "dtype-mismatch")


def test_matmul_of_rank_one():
    @tsr.function
    def f(a: Tensor["K"], b: Tensor["K", "N"]):
        return a @ b  # rank-one

    with pytest.raises(ShapeError) as info:
        f.trace(f.arg_specs_for({"K": 3, "N": 4}))
    assert "rank >= 2" in info.value.message and "a [K=3]" in info.value.message
    assert_located(info, "rank-one")


def test_where_needs_a_bool_condition():
    @tsr.function
    def f(x: Tensor["N"]):
        return tsr.where(x, x, 0.0)  # where-cond

    with pytest.raises(DTypeError) as info:
        f.trace(f.arg_specs_for({"N": 3}))
    assert "bool" in info.value.message
    assert_located(info, "where-cond")


def test_softmax_dim_out_of_range():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=2)  # bad-dim

    with pytest.raises(ShapeError) as info:
        f.trace(f.arg_specs_for({"M": 2, "N": 3}))
    assert "dim 2" in info.value.message and "rank 2" in info.value.message
    assert_located(info, "bad-dim")


def test_layer_norm_normalized_shape_mismatch():
    @tsr.function
    def f(x: Tensor["M", "N"]):
        return tsr.layer_norm(x, 5)  # bad-norm-shape

    with pytest.raises(ShapeError) as info:
        f.trace(f.arg_specs_for({"M": 2, "N": 3}))
    assert "[5]" in info.value.message and "N=3" in info.value.message
    assert_located(info, "bad-norm-shape")


def test_returning_none():
    @tsr.function
    def f(x: Tensor["N"]):
        x + 1.0  # noqa: B018

    with pytest.raises(TesseraError, match="returned None"):
        f.trace(f.arg_specs_for({"N": 3}))


def test_missing_dim_value_for_arg_specs():
    with pytest.raises(TesseraError, match="no value for dim"):
        flash_attention.arg_specs_for({"B": 1, "H": 1, "S": 4})


def test_messages_render_with_location():
    @tsr.function
    def f(x: Tensor["M", "K"], y: Tensor["N"]):
        return x + y

    with pytest.raises(ShapeError) as info:
        f(np.ones((2, 3), np.float32), np.ones(4, np.float32))
    text = str(info.value)
    assert text.startswith("add: shapes do not broadcast") and f"[at {info.value.location}]" in text


def test_every_exported_op_is_exercised_in_this_file():
    """Guards the op coverage above: each function tessera exports from its ops module appears as tsr.<name>."""
    from tessera.frontend import ops

    exported = sorted(name for name in dir(tsr) if not name.startswith("_")
                      and getattr(getattr(tsr, name), "__module__", None) == ops.__name__
                      and callable(getattr(tsr, name)))
    with open(__file__) as f:
        source = f.read()
    missing = [name for name in exported if f"tsr.{name}(" not in source]
    assert len(exported) > 40
    assert not missing, f"not exercised: {missing}"
