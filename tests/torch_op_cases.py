"""PyTorch's ops (`tsr.clamp`, `x.var()`, `tsr.einsum`, ...) as cases shared by the CPU tests
(interpreter against NumPy in float64, PTX for sm_80 and sm_90a) and the GPU tests: each case
is an op on traced tensors, its NumPy float64 reference, its arguments' dims and its dtypes."""
from dataclasses import dataclass
from typing import Callable

import numpy as np

import tessera as tsr
from tessera import Tensor, dtypes

FLOATS = ("fp32", "fp16", "bf16")
NUMBERS = FLOATS + ("int32",)
#: per result dtype: (rtol, atol) against float64
TOL = {"fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3), "bf16": (1e-2, 1e-2)}
#: awkward sizes: one element, primes, about a thousand (no tile size divides them)
SHAPES = [dict(B=1, M=1, N=1, K=1), dict(B=2, M=7, N=13, K=5), dict(B=3, M=3, N=1000, K=17)]


@dataclass(frozen=True)
class OpCase:
    name: str
    op: Callable            # on traced tensors, in argument order
    ref: Callable           # on float64 (int64, bool) NumPy arrays
    args: tuple = (("x", ("M", "N")),)
    dtypes: tuple = FLOATS
    masks: tuple = ()       # names of the bool arguments


def _logsumexp(x, axis, keepdims=False):
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis)


def _log_softmax(x, axis):
    return x - _logsumexp(x, axis, keepdims=True)


def _var(x, axis=None, ddof=1, keepdims=False):
    return np.var(x, axis=axis, ddof=ddof, keepdims=keepdims)


XY = (("x", ("M", "N")), ("y", ("M", "N")))
XM = (("x", ("M", "N")), ("m", ("M", "N")))
CASES = [
    OpCase("clamp", lambda x: tsr.clamp(x, -0.5, 0.75), lambda x: np.clip(x, -0.5, 0.75), dtypes=FLOATS),
    OpCase("clamp_int", lambda x: x.clamp(min=-3), lambda x: np.maximum(x, -3), dtypes=("int32",)),
    OpCase("clamp_tensors", lambda x, y: x.clip(y, y + 1.0), lambda x, y: np.minimum(np.maximum(x, y), y + 1.0),
           args=XY),
    OpCase("masked_fill", lambda x, m: x.masked_fill(m, -2), lambda x, m: np.where(m, -2, x), args=XM,
           dtypes=NUMBERS, masks=("m",)),
    OpCase("masked_fill_broadcast", lambda x, m: tsr.masked_fill(x, m, 0.5), lambda x, m: np.where(m, 0.5, x),
           args=(("x", ("M", "N")), ("m", ("N",))), masks=("m",)),
    OpCase("tril", lambda x: x.tril(), lambda x: np.tril(x), dtypes=NUMBERS),
    OpCase("triu_diag", lambda x: tsr.triu(x, diagonal=2) + tsr.tril(x, -3),
           lambda x: np.triu(x, 2) + np.tril(x, -3)),
    OpCase("tril_batched", lambda x: x.tril(1), lambda x: np.tril(x, 1), args=(("x", ("B", "M", "N")),)),
    OpCase("floor_divide", lambda x, y: x // y, lambda x, y: np.floor_divide(x, y), args=XY, dtypes=NUMBERS),
    OpCase("remainder", lambda x, y: x % y, lambda x, y: np.remainder(x, y), args=XY, dtypes=NUMBERS),
    OpCase("scalar_floordiv_mod", lambda x: (7 // x) + (x % 3), lambda x: np.floor_divide(7, x) + np.remainder(x, 3),
           dtypes=("int32",)),
    OpCase("max_elementwise", lambda x, y: tsr.max(x, y) - tsr.min(x, y) + x.max(y),
           lambda x, y: np.maximum(x, y) - np.minimum(x, y) + np.maximum(x, y), args=XY, dtypes=NUMBERS),
    OpCase("mT", lambda x: x.mT * 2, lambda x: np.swapaxes(x, -1, -2) * 2, args=(("x", ("B", "M", "N")),),
           dtypes=NUMBERS),
    OpCase("flatten", lambda x: x.flatten(1) + 1, lambda x: x.reshape(x.shape[0], -1) + 1,
           args=(("x", ("B", "M", "N")),), dtypes=NUMBERS),
    OpCase("flatten_all", lambda x: tsr.flatten(x), lambda x: x.reshape(-1)),
    OpCase("expand", lambda x: x[:, None, :].expand(-1, 5, -1) * 2,
           lambda x: np.broadcast_to(x[:, None, :], (x.shape[0], 5, x.shape[1])) * 2, dtypes=NUMBERS),
    OpCase("expand_new_dims", lambda x: x.expand(2, x.shape[0], x.shape[1]),
           lambda x: np.broadcast_to(x, (2,) + x.shape)),
    OpCase("var", lambda x: x.var(-1), lambda x: _var(x, -1)),
    OpCase("var_all_biased", lambda x: tsr.var(x, correction=0), lambda x: _var(x, ddof=0)),
    OpCase("var_dim0_keepdim", lambda x: tsr.var(x, 0, keepdim=True), lambda x: _var(x, 0, keepdims=True)),
    OpCase("std", lambda x: x.std(1), lambda x: np.std(x, 1, ddof=1)),
    OpCase("std_dims", lambda x: tsr.std(x, (0, 2), correction=2, keepdim=True),
           lambda x: np.std(x, (0, 2), ddof=2, keepdims=True), args=(("x", ("B", "M", "N")),)),
    OpCase("logsumexp", lambda x: tsr.logsumexp(x * 4.0, -1), lambda x: _logsumexp(x * 4.0, -1)),
    OpCase("logsumexp_dim0", lambda x: x.logsumexp(0, keepdim=True),
           lambda x: _logsumexp(x, 0, keepdims=True)),
    OpCase("log_softmax", lambda x: tsr.log_softmax(x * 3.0, dim=-1),
           lambda x: _log_softmax(x * 3.0, -1)),
    OpCase("log_softmax_dim0", lambda x: x.log_softmax(0), lambda x: _log_softmax(x, 0)),
    OpCase("argmax", lambda x: tsr.argmax(x, -1), lambda x: np.argmax(x, -1), dtypes=NUMBERS),
    OpCase("argmin_dim0", lambda x: x.argmin(0), lambda x: np.argmin(x, 0), dtypes=NUMBERS),
    OpCase("argmax_flat", lambda x: x.argmax(), lambda x: np.argmax(x)),
    OpCase("argmax_bool", lambda m: m.argmax(1), lambda m: np.argmax(m, 1), args=(("m", ("M", "N")),),
           dtypes=("fp32",), masks=("m",)),
    OpCase("max_dim", lambda x: x.max(1).values + x.min(dim=1).values, lambda x: x.max(1) + x.min(1),
           dtypes=NUMBERS),
    OpCase("max_dim_indices", lambda x: tsr.max(x, 0, keepdim=True).indices,
           lambda x: np.argmax(x, 0)[None, :], dtypes=NUMBERS),
    OpCase("max_all", lambda x: x.max(), lambda x: x.max()),
    OpCase("min_all", lambda x: tsr.min(x), lambda x: x.min(), dtypes=("int32",)),
    OpCase("einsum_matmul", lambda a, b: tsr.einsum("mk,kn->mn", a, b), lambda a, b: a @ b,
           args=(("a", ("M", "K")), ("b", ("K", "N"))), dtypes=("fp16", "bf16")),
    OpCase("einsum_nt", lambda b, a: tsr.einsum("nk,mk->mn", b, a), lambda b, a: a @ b.T,
           args=(("b", ("N", "K")), ("a", ("M", "K"))), dtypes=("fp16", "bf16")),
    OpCase("int_pow", lambda x, y: x ** (y % 4) - x ** 2, lambda x, y: x ** (y % 4) - x ** 2, args=XY,
           dtypes=("int32",)),
    # a vector made a matrix by a view, multiplied (a GEMM's tiles could not read it: now a reduction)
    OpCase("matvec", lambda a, v: a @ v[:, None], lambda a, v: a @ v[:, None],
           args=(("a", ("M", "K")), ("v", ("K",)))),
    OpCase("vecmat", lambda v, b: v[None, :] @ b + 1.0, lambda v, b: v[None, :] @ b + 1.0,
           args=(("v", ("K",)), ("b", ("K", "N")))),
    OpCase("batched_matvec", lambda a, v: a @ v[:, :, None], lambda a, v: a @ v[:, :, None],
           args=(("a", ("B", "M", "K")), ("v", ("B", "K"))), dtypes=("fp16", "bf16")),
    OpCase("einsum_bmm_out_transposed", lambda a, b: tsr.einsum("bmk,bkn->bnm", a, b),
           lambda a, b: np.swapaxes(a @ b, -1, -2),
           args=(("a", ("B", "M", "K")), ("b", ("B", "K", "N"))), dtypes=("fp16", "bf16")),
    OpCase("einsum_attention_scores", lambda q, k: tsr.einsum("bmk,bnk->bmn", q, k), lambda q, k: q @ np.swapaxes(k, -1, -2),
           args=(("q", ("B", "M", "K")), ("k", ("B", "N", "K"))), dtypes=("fp16", "bf16")),
    OpCase("einsum_matvec", lambda a, v: tsr.einsum("mn,n->m", a, v), lambda a, v: a @ v,
           args=(("a", ("M", "N")), ("v", ("N",)))),
    OpCase("einsum_outer", lambda u, v: tsr.einsum("m,n->mn", u, v), lambda u, v: np.outer(u, v),
           args=(("u", ("M",)), ("v", ("N",)))),
    OpCase("einsum_transpose_sum", lambda x: tsr.einsum("bmn->nb", x), lambda x: x.sum(1).T,
           args=(("x", ("B", "M", "N")),)),
    OpCase("einsum_dot", lambda u, v: tsr.einsum("n,n->", u, v), lambda u, v: np.dot(u, v),
           args=(("u", ("N",)), ("v", ("N",)))),
]
XK = (("x", ("M", "N")), ("y", ("M", "K")))
CASES += [
    OpCase("slice_ends", lambda x: x[..., :1] * 2 + x[:, -1:], lambda x: x[..., :1] * 2 + x[:, -1:], dtypes=NUMBERS),
    OpCase("slice_steps", lambda x: x[::2, ::3], lambda x: x[::2, ::3], dtypes=NUMBERS),
    OpCase("slice_ints", lambda x: x[-1] - x[0, None], lambda x: x[-1] - x[0, None]),
    OpCase("slice_batched", lambda x: x[x.shape[0] // 2:, :, x.shape[2] // 2:] + x[:1, :, :1],
           lambda x: x[x.shape[0] // 2:, :, x.shape[2] // 2:] + x[:1, :, :1], args=(("x", ("B", "M", "N")),)),
    OpCase("slice_then_sum", lambda x: x[:, x.shape[1] // 2:].sum(-1), lambda x: x[:, x.shape[1] // 2:].sum(-1)),
    OpCase("cat_last", lambda x, y: tsr.cat([x, y], -1), lambda x, y: np.concatenate([x, y], -1), args=XK,
           dtypes=NUMBERS),
    OpCase("cat_rows", lambda x, y: tsr.cat((x, y * 2), dim=0),
           lambda x, y: np.concatenate([x, y * 2], 0), args=(("x", ("M", "N")), ("y", ("K", "N"))), dtypes=NUMBERS),
    OpCase("cat_three_computed", lambda x, y: tsr.cat([x * 2, y, x.abs()], 1) + 1,
           lambda x, y: np.concatenate([x * 2, y, np.abs(x)], 1) + 1, args=XK),
    OpCase("cat_then_logsumexp", lambda x, y: tsr.cat([x, y], 1).logsumexp(1),
           lambda x, y: _logsumexp(np.concatenate([x, y], 1), 1), args=XK),
    OpCase("cat_batch_dim", lambda x: tsr.cat([x, -x], 0), lambda x: np.concatenate([x, -x], 0),
           args=(("x", ("B", "M", "N")),)),
    OpCase("stack", lambda x, y: tsr.stack([x, y, x], -1), lambda x, y: np.stack([x, y, x], -1), args=XY,
           dtypes=NUMBERS),
    OpCase("stack_first", lambda x, y: tsr.stack([x, y]) * 2, lambda x, y: np.stack([x, y]) * 2, args=XY),
]
CASES_BY_NAME = {c.name: c for c in CASES}
DTYPE_CASES = [(c, dt) for c in CASES for dt in c.dtypes]
IDS = [f"{c.name}-{dt}" for c, dt in DTYPE_CASES]


def function(case: OpCase, dt: str) -> tsr.Function:
    """The case as a @tsr.function whose arguments are annotated with their dims and dtypes."""
    names = [n for n, _ in case.args]
    ns = {"op": case.op}
    exec(f"def {case.name}({', '.join(names)}):\n    return op({', '.join(names)})", ns)
    fn = ns[case.name]
    fn.__annotations__ = {n: Tensor[(*dims, dtypes.bool_ if n in case.masks else dtypes.lookup(dt))]
                          for n, dims in case.args}
    return tsr.function(fn)


def inputs(case: OpCase, dt: str, shape: dict, rng: np.random.Generator) -> list[np.ndarray]:
    """Operands in storage dtypes: normal floats, nonzero ints in [-9, 9], bools at random."""
    arrays = []
    for name, dims in case.args:
        size = tuple(shape[d] for d in dims)
        if name in case.masks:
            arrays.append(rng.random(size) < 0.3)
        elif dt == "int32":
            arrays.append((rng.integers(1, 10, size) * rng.choice([-1, 1], size)).astype(np.int32))
        else:
            arrays.append(rng.standard_normal(size).astype(dtypes.lookup(dt).np))
    return arrays


def reference(case: OpCase, arrays: list[np.ndarray]) -> np.ndarray:
    wide = [a if a.dtype == np.bool_ else a.astype(np.int64 if a.dtype.kind == "i" else np.float64)
            for a in arrays]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(case.ref(*wide))


def check(out, ref: np.ndarray) -> None:
    """Exact for ints and bools; else within the output dtype's tolerance (NaN where NaN)."""
    out = np.asarray(out)
    assert out.shape == ref.shape, f"shape {out.shape}, expected {ref.shape}"
    if out.dtype.kind in "biu":
        np.testing.assert_array_equal(out, ref.astype(out.dtype))
        return
    rtol, atol = TOL[dtypes.lookup(out.dtype).name]
    scale = max(1.0, float(np.nanmax(np.abs(ref)))) if ref.size else 1.0
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=rtol, atol=atol * scale)
