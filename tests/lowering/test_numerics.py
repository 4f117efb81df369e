"""Generated kernels, run on the CPU tile interpreter, against the Graph IR oracle.

Every case compiles a traced function through the whole pipeline, runs the Tile IR
on fresh random inputs (hypothesis draws the seeds, and shapes where it helps) and
compares in float64: relative error ||out - ref|| / ||ref||, max-abs error, and no
NaN where the reference has none (outputs start as NaN poison, so unwritten elements
show). Tolerances per dtype live in tests/conftest.py.
"""
import functools
import math
import os
import re

import numpy as np
import pytest
from hypothesis import Phase, given, settings, strategies as st

import tessera as tsr
from tessera import Tensor

from seed_kernels import alibi_attention, causal_attention, flash_attention

SEEDS = st.integers(0, 2**32 - 1)


def cases(n: int) -> settings:
    """n hypothesis examples, no deadline, no shrinking (a random seed does not shrink usefully,
    and a failing case should cost seconds, not a minute). TESSERA_TEST_SCALE=k runs k times as many."""
    return settings(max_examples=n * int(os.environ.get("TESSERA_TEST_SCALE", "1")), deadline=None,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))


@functools.lru_cache(maxsize=None)
def compiled(fn, dims: tuple, dtype: str):
    """fn compiled for these dim values (a sorted tuple of items) and default dtype, cached."""
    return fn.compile(fn.arg_specs_for(dict(dims), dtype))


def run_case(fn, dims: dict, dtype: str, seed: int, random_inputs, assert_matches_reference, make_inputs=None):
    """Kernel vs the Graph IR oracle (exact: float64 from the same inputs, rounded once at the end)."""
    c = compiled(fn, tuple(sorted(dims.items())), dtype)
    specs = fn.arg_specs_for(dims, dtype)
    arrays = random_inputs(specs, seed)
    if make_inputs is not None:
        arrays = make_inputs(arrays, dims)
    return assert_matches_reference(c, arrays)


def run_case_exact(fn, dims: dict, dtype: str, seed: int, random_inputs, assert_close):
    """Kernel vs the exact answer for its (rounded) inputs: the oracle of the function's fp32 twin.

    A fused chain computes in f32 registers and rounds once, at the store, while a per-op-rounded
    evaluation rounds after every op (the oracle did, before it became exact); composite ops (gelu, silu) are chains of primitives, so where they cancel
    (gelu(x) for x < -2: 1 + tanh(...) ~ 0.01) the per-op-rounded oracle is off by many ulps of the
    result in fp16/bf16. The kernel must match the exact answer to the storage dtype's tolerance.
    """
    c = compiled(fn, tuple(sorted(dims.items())), dtype)
    twin = compiled(fn, tuple(sorted(dims.items())), "fp32")
    arrays = random_inputs(fn.arg_specs_for(dims, dtype), seed)
    outs = c.run(*arrays)
    exact = twin.reference(*[a.astype(np.float32) if a.dtype.kind != "b" and a.dtype != np.int32 else a
                             for a in arrays])
    for i, (o, r) in enumerate(zip(outs, exact)):
        assert_close(o, r.astype(o.dtype), dtype, what=f"{fn.name} output {i}")
    return outs


# --- attention -----------------------------------------------------------------------------------


@tsr.function
def softcap_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    cap = 20.0
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    s = cap * tsr.tanh(s / cap)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def cross_attention(q: Tensor["B", "H", "Sq", "D"], k: Tensor["B", "H", "Sk", "D"], v: Tensor["B", "H", "Sk", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def alibi_slopes(arrays, dims):
    """ALiBi's geometric per-head slopes 2^(-8h/H) (the last input), not random numbers."""
    H = dims["H"]
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    return [*arrays[:-1], slopes.astype(arrays[-1].dtype)]


ATTENTION = {
    "plain": (flash_attention, None),
    "causal": (causal_attention, None),
    "alibi": (alibi_attention, alibi_slopes),
    "softcap": (softcap_attention, None),
}


def attention_dims(B, H, S, D):
    return {"B": B, "H": H, "S": S, "Sq": S, "Sk": S, "D": D}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1, 17])
@pytest.mark.parametrize("variant", list(ATTENTION))
@cases(2)
@given(seed=SEEDS, B=st.sampled_from([1, 2]), H=st.integers(1, 3))
def test_attention_short(variant, S, D, dtype, seed, B, H, random_inputs, assert_matches_reference):
    fn, make = ATTENTION[variant]
    run_case(fn, attention_dims(B, H, S, D), dtype, seed, random_inputs, assert_matches_reference, make)


@pytest.mark.parametrize("variant,B,H,D,dtype", [
    ("plain", 2, 2, 64, "fp16"),
    ("plain", 1, 1, 128, "fp32"),
    ("causal", 1, 2, 128, "fp16"),
    ("alibi", 2, 1, 64, "fp16"),
    ("softcap", 1, 1, 128, "fp16"),
])
@cases(1)
@given(seed=SEEDS)
def test_attention_long(variant, B, H, D, dtype, seed, random_inputs, assert_matches_reference):
    """S = 1000: many key blocks (online softmax rescaling) and a ragged last block of 1000 % 64 rows."""
    fn, make = ATTENTION[variant]
    run_case(fn, attention_dims(B, H, 1000, D), dtype, seed, random_inputs, assert_matches_reference, make)


@pytest.mark.parametrize("variant", ["plain", "causal", "softcap"])
@cases(2)
@given(seed=SEEDS, S=st.sampled_from([1, 17, 70]))
def test_attention_bf16(variant, S, seed, random_inputs, assert_matches_reference):
    fn, make = ATTENTION[variant]
    run_case(fn, attention_dims(2, 2, S, 64), "bf16", seed, random_inputs, assert_matches_reference, make)


@cases(1)
@given(seed=SEEDS)
def test_causal_attention_4097(seed, random_inputs, assert_matches_reference):
    """One block more than 64 x 64: the last query and key blocks hold a single row (about 3 s)."""
    run_case(causal_attention, attention_dims(1, 1, 4097, 64), "fp16", seed, random_inputs,
             assert_matches_reference)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@cases(4)
@given(seed=SEEDS, Sq=st.integers(1, 150), Sk=st.integers(1, 150), D=st.sampled_from([64, 128]),
       B=st.sampled_from([1, 2]), H=st.integers(1, 2))
def test_cross_attention_different_lengths(dtype, seed, Sq, Sk, D, B, H, random_inputs, assert_matches_reference):
    dims = {"B": B, "H": H, "Sq": Sq, "Sk": Sk, "D": D}
    run_case(cross_attention, dims, dtype, seed, random_inputs, assert_matches_reference)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@cases(3)
@given(seed=SEEDS, Sq=st.integers(1, 100), Sk=st.integers(1, 100), H=st.integers(1, 4))
def test_alibi_attention_different_lengths(dtype, seed, Sq, Sk, H, random_inputs, assert_matches_reference):
    dims = {"B": 2, "H": H, "Sq": Sq, "Sk": Sk, "D": 64}
    run_case(alibi_attention, dims, dtype, seed, random_inputs, assert_matches_reference, alibi_slopes)


MASKS = {
    # name -> mask(i (query positions, [Sq, 1]), j (key positions, [1, Sk]), c, w)
    "shifted_causal": lambda i, j, c, w: j <= i + c,
    "strict_causal": lambda i, j, c, w: i + c > j,
    "window_lower_edge": lambda i, j, c, w: j >= i - w,
    "window": lambda i, j, c, w: (j <= i + c) & (j >= i - w),
    "nested_window": None,  # two nested where()s, one edge each
}


def make_masked_attention(name: str, c: int, w: int):
    mask = MASKS[name]

    def masked(q: Tensor["B", "H", "Sq", "D"], k: Tensor["B", "H", "Sk", "D"], v: Tensor["B", "H", "Sk", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        i = tsr.arange(q.shape[-2])[:, None]
        j = tsr.arange(k.shape[-2])[None, :]
        if mask is None:
            s = tsr.where(j <= i + c, tsr.where(j >= i - w, s, -math.inf), -math.inf)
        else:
            s = tsr.where(mask(i, j, c, w), s, -math.inf)
        return tsr.matmul(tsr.softmax(s, dim=-1), v)
    masked.__name__ = f"masked_{name}"
    return tsr.function(masked)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(MASKS))
@cases(3)
@given(seed=SEEDS, Sq=st.integers(1, 200), Sk=st.integers(1, 200), c=st.integers(-70, 130), w=st.integers(0, 130))
def test_masked_attention(name, dtype, seed, Sq, Sk, c, w, random_inputs, assert_matches_reference):
    """Masks of the form `col REL row + c` (the kernel may skip key blocks they exclude), with query and
    key lengths that differ and are not multiples of the block size. Rows a mask hides entirely are
    NaN in the oracle (softmax of all -inf) and must be NaN in the kernel too."""
    fn = make_masked_attention(name, c, w)
    dims = {"B": 1, "H": 2, "Sq": Sq, "Sk": Sk, "D": 64}
    specs = fn.arg_specs_for(dims, dtype)
    assert_matches_reference(fn.compile(specs), random_inputs(specs, seed))


# --- GEMM with epilogues ------------------------------------------------------------------------------

@tsr.function
def gemm_bias(a: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.matmul(a, w) + b


@tsr.function
def gemm_bias_gelu(a: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, w) + b)


@tsr.function
def gemm_bias_gelu_tanh(a: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(a @ w + b, approximate="tanh")


@tsr.function
def gemm_silu(a: Tensor["M", "K"], w: Tensor["K", "N"]):
    return tsr.silu(tsr.matmul(a, w))


@tsr.function
def gemm_scale(a: Tensor["M", "K"], w: Tensor["K", "N"]):
    return tsr.matmul(a, w) * (1.0 / math.sqrt(a.shape[-1]))


@tsr.function
def gemm_cast_fp16(a: Tensor["M", "K"], w: Tensor["K", "N"]):
    return tsr.matmul(a, w).to(tsr.fp16)


@tsr.function
def gemm_everything(a: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"], r: Tensor["M", 1]):
    return tsr.gelu(tsr.matmul(a, w) * 0.5 + b - r).to(tsr.fp16)


EPILOGUES = [gemm_bias, gemm_bias_gelu, gemm_bias_gelu_tanh, gemm_silu, gemm_scale, gemm_cast_fp16, gemm_everything]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("M,K,N", [(77, 45, 100), (1, 1, 1), (130, 257, 33)])
@pytest.mark.parametrize("fn", EPILOGUES, ids=lambda f: f.name)
@cases(1)
@given(seed=SEEDS)
def test_gemm_epilogue(fn, M, K, N, dtype, seed, random_inputs, assert_matches_reference, assert_close):
    """fp32 against the oracle; fp16 against the exact answer (see run_case_exact: gelu/silu cancel)."""
    if dtype == "fp32":
        run_case(fn, {"M": M, "K": K, "N": N}, dtype, seed, random_inputs, assert_matches_reference)
    else:
        run_case_exact(fn, {"M": M, "K": K, "N": N}, dtype, seed, random_inputs, assert_close)


@pytest.mark.parametrize("fn", [gemm_bias_gelu, gemm_silu], ids=lambda f: f.name)
@cases(2)
@given(seed=SEEDS, M=st.integers(1, 140), K=st.integers(1, 140), N=st.integers(1, 140))
def test_gemm_epilogue_bf16(fn, seed, M, K, N, random_inputs, assert_close):
    run_case_exact(fn, {"M": M, "K": K, "N": N}, "bf16", seed, random_inputs, assert_close)


@tsr.function
def bmm(a: Tensor["B", "M", "K"], w: Tensor["B", "K", "N"]):
    return tsr.matmul(a, w)


@tsr.function
def bmm_broadcast_rhs(a: Tensor["B", "H", "M", "K"], w: Tensor["K", "N"]):
    return tsr.matmul(a, w)


@tsr.function
def bmm_broadcast_both(a: Tensor["B", 1, "M", "K"], w: Tensor["H", "K", "N"], b: Tensor["N"]):
    return tsr.matmul(a, w) + b


@tsr.function
def gemm_transposed_b(a: Tensor["M", "K"], w: Tensor["N", "K"]):
    return tsr.matmul(a, w.T)


@tsr.function
def bmm_transposed_a(a: Tensor["B", "K", "M"], w: Tensor["B", "K", "N"]):
    return tsr.matmul(a.transpose(-2, -1), w)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("fn", [bmm, bmm_broadcast_rhs, bmm_broadcast_both, gemm_transposed_b, bmm_transposed_a],
                         ids=lambda f: f.name)
@cases(2)
@given(seed=SEEDS, B=st.integers(1, 3), H=st.integers(1, 3), M=st.integers(1, 70), K=st.integers(1, 70),
       N=st.integers(1, 70))
def test_batched_matmul(fn, dtype, seed, B, H, M, K, N, random_inputs, assert_matches_reference):
    run_case(fn, {"B": B, "H": H, "M": M, "K": K, "N": N}, dtype, seed, random_inputs, assert_matches_reference)


# --- softmax and normalisations ----------------------------------------------------------------------------

@tsr.function
def softmax_last(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def softmax_first(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=0)


@tsr.function
def softmax_middle(x: Tensor["A", "M", "N"]):
    return x.softmax(dim=1)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("N", [1, 7, 1000, 3000])
@pytest.mark.parametrize("fn", [softmax_last, softmax_first, softmax_middle], ids=lambda f: f.name)
@cases(1)
@given(seed=SEEDS, M=st.integers(1, 9))
def test_softmax(fn, N, dtype, seed, M, random_inputs, assert_matches_reference):
    run_case(fn, {"A": 2, "M": M, "N": N}, dtype, seed, random_inputs, assert_matches_reference)


@cases(3)
@given(seed=SEEDS, M=st.integers(1, 20), N=st.integers(1, 2100))
def test_softmax_bf16(seed, M, N, random_inputs, assert_matches_reference):
    run_case(softmax_last, {"M": M, "N": N}, "bf16", seed, random_inputs, assert_matches_reference)


@tsr.function
def layer_norm_plain(x: Tensor["R", "N"]):
    return tsr.layer_norm(x, x.shape[-1])


@tsr.function
def layer_norm_weight(x: Tensor["R", "N"], w: Tensor["N"]):
    return tsr.layer_norm(x, [x.shape[-1]], weight=w, eps=1e-6)


@tsr.function
def layer_norm_bias(x: Tensor["R", "N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), bias=b)


@tsr.function
def layer_norm_affine(x: Tensor["B", "R", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def rms_norm_weight(x: Tensor["R", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, [x.shape[-1]], w, eps=1e-6)


@tsr.function
def rms_norm_plain(x: Tensor["B", "R", "N"]):
    return tsr.rms_norm(x, [x.shape[-1]])


NORMS = [layer_norm_plain, layer_norm_weight, layer_norm_bias, layer_norm_affine, rms_norm_weight, rms_norm_plain]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("N", [1, 7, 1000, 3000])
@pytest.mark.parametrize("fn", NORMS, ids=lambda f: f.name)
@cases(1)
@given(seed=SEEDS, R=st.integers(1, 9))
def test_norms(fn, N, dtype, seed, R, random_inputs, assert_matches_reference):
    run_case(fn, {"B": 2, "R": R, "N": N}, dtype, seed, random_inputs, assert_matches_reference)


@pytest.mark.parametrize("fn", [layer_norm_affine, rms_norm_plain], ids=lambda f: f.name)
@cases(2)
@given(seed=SEEDS, R=st.integers(1, 9), N=st.integers(1, 1500))
def test_norms_bf16(fn, seed, R, N, random_inputs, assert_matches_reference):
    run_case(fn, {"B": 2, "R": R, "N": N}, "bf16", seed, random_inputs, assert_matches_reference)


@tsr.function
def layer_norm_offset(x: Tensor["R", "N"]):
    return tsr.layer_norm(x + 100.0, x.shape[-1])


@pytest.mark.parametrize("N", [7, 3000])
@cases(1)
@given(seed=SEEDS)
def test_layer_norm_large_mean(N, seed, random_inputs, assert_close):
    """A mean of 100 over unit-variance rows: x + 100 itself carries fp32 rounding of ulp(100) ~ 8e-6, so
    the bound is 1e-4; a one-pass E[x^2] - E[x]^2 variance would be off by ~100^2 * 6e-8 = 6e-4."""
    c = compiled(layer_norm_offset, (("N", N), ("R", 4)), "fp32")
    arrays = random_inputs(layer_norm_offset.arg_specs_for({"R": 4, "N": N}, "fp32"), seed)
    assert_close(c.run(*arrays)[0], c.reference(*arrays)[0], tolerance=(1e-4, 1e-4))


# --- reductions ---------------------------------------------------------------------------------------------

REDUCTIONS = {
    "sum": lambda x, d, k: tsr.sum(x, dim=d, keepdim=k),
    "max": lambda x, d, k: x.amax(dim=d, keepdim=k),
    "min": lambda x, d, k: tsr.amin(x, d, k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
}


def make_reduction(kind: str, dim, keepdim: bool):
    op = REDUCTIONS[kind]

    def reduce(x: Tensor["A", "M", "N"]):
        return op(x, dim, keepdim)
    reduce.__name__ = re.sub(r"\W+", "_", f"{kind}_dim{dim}_{'keep' if keepdim else 'drop'}".replace("-", "m"))
    return tsr.function(reduce)


REDUCTION_FNS = {(k, d, keep): make_reduction(k, d, keep)
                 for k in REDUCTIONS for d in (-1, 0, 1, (1, 2)) for keep in (False, True)}


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("key", list(REDUCTION_FNS), ids=lambda k: f"{k[0]}-dim{k[1]}-keep{k[2]}")
@cases(1)
@given(seed=SEEDS, A=st.integers(2, 3), M=st.integers(1, 9), N=st.sampled_from([1, 7, 130, 1100]))
def test_reduction(key, dtype, seed, A, M, N, random_inputs, assert_matches_reference):
    run_case(REDUCTION_FNS[key], {"A": A, "M": M, "N": N}, dtype, seed, random_inputs, assert_matches_reference)


@tsr.function
def reduce_bool_count(x: Tensor["M", "N"]):
    return tsr.sum(x > 0.0, dim=-1, keepdim=True), (x > 0.5).sum(0), tsr.amax((x * 10.0).to(tsr.int32), dim=1)


@cases(2)
@given(seed=SEEDS, M=st.integers(2, 20), N=st.integers(1, 300))
def test_reduction_of_bools_counts(seed, M, N, random_inputs, assert_matches_reference):
    outs = run_case(reduce_bool_count, {"M": M, "N": N}, "fp32", seed, random_inputs, assert_matches_reference)
    assert outs[0].dtype == np.int32


# --- elementwise chains -----------------------------------------------------------------------------------

@tsr.function
def elementwise_chain(x: Tensor["B", "M", "N"], y: Tensor["N"], z: Tensor["M", 1]):
    a = tsr.exp(-tsr.abs(x)) * y + z
    b = tsr.where(x > y, a, tsr.minimum(a, 0.5))
    c = tsr.sqrt(tsr.abs(b) + 1.0) - tsr.rsqrt(b * b + 2.0) + tsr.log(tsr.abs(x) + 1e-3)
    d = tsr.tanh(c) + tsr.exp2(tsr.maximum(c, -3.0) * 0.1) + tsr.sigmoid(x) + tsr.relu(z)
    return d / (1.0 + y * y) - tsr.log2(2.0 + tsr.sin(x) * tsr.cos(z)) + tsr.erf(x) * (-y) + x ** 2.0


@tsr.function
def compare_and_cast(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    m = (x > 0.0) & ~(y < 0.5) | (x == y) | (x <= -1.0)
    i = m.to(tsr.int32) * 3 - 1
    f = i.to(tsr.fp32) * x.float()
    return (f.half(), tsr.where(m, x, y), (x != y).to(tsr.fp32), tsr.ge(x, y), i,
            tsr.logical_or(tsr.lt(x, 0.0), tsr.logical_not(tsr.le(y, 0.0))))


@tsr.function
def triangular_masks(x: Tensor["S", "S"]):
    i = tsr.arange(x.shape[0])
    return tsr.where(i[:, None] > i[None, :], x, 0.0) + tsr.where(i[:, None] <= i[None, :], 1.0, -x)


@tsr.function
def broadcast_4d(x: Tensor["B", 1, "M", 1], y: Tensor["H", 1, "N"]):
    return x * y - y / 3.0 + x.transpose(1, 3)


@tsr.function
def int_arithmetic(x: Tensor["M", "N"]):
    i = tsr.arange(x.shape[-1])
    j = (i * 3 - 7) + tsr.maximum(i, 5) - tsr.minimum(i, 2)
    return x * j, j[None, :] + tsr.arange(x.shape[0])[:, None], tsr.abs(-j)


ELEMENTWISE = [elementwise_chain, compare_and_cast, triangular_masks, broadcast_4d, int_arithmetic]


@pytest.mark.parametrize("fn", ELEMENTWISE, ids=lambda f: f.name)
@cases(2)
@given(seed=SEEDS, B=st.integers(1, 3), H=st.integers(1, 3), M=st.integers(1, 40), N=st.integers(1, 300),
       S=st.integers(1, 140))
def test_elementwise_fp32(fn, seed, B, H, M, N, S, random_inputs, assert_matches_reference):
    run_case(fn, {"B": B, "H": H, "M": M, "N": N, "S": S}, "fp32", seed, random_inputs, assert_matches_reference)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("fn", ELEMENTWISE, ids=lambda f: f.name)
@cases(2)
@given(seed=SEEDS, B=st.integers(1, 3), H=st.integers(1, 3), M=st.integers(1, 40), N=st.integers(1, 300),
       S=st.integers(1, 140))
def test_elementwise_low_precision(fn, dtype, seed, B, H, M, N, S, random_inputs, assert_close):
    """Against the exact answer (see run_case_exact): the chains cancel, so the per-op-rounded oracle drifts."""
    run_case_exact(fn, {"B": B, "H": H, "M": M, "N": N, "S": S}, dtype, seed, random_inputs, assert_close)


@tsr.function
def mixed_precision(x: Tensor["M", "N", tsr.fp16], y: Tensor["M", "N", tsr.bf16], z: Tensor["N", tsr.fp32]):
    return x + y, (x * z).to(tsr.bf16), y.to(tsr.fp16) - x


@cases(3)
@given(seed=SEEDS, M=st.integers(1, 40), N=st.integers(1, 200))
def test_mixed_precision_promotion(seed, M, N, random_inputs, assert_matches_reference):
    """fp16 + bf16 promotes to fp32 (as in PyTorch); explicit casts round through their storage type."""
    outs = run_case(mixed_precision, {"M": M, "N": N}, None, seed, random_inputs, assert_matches_reference)
    assert [o.dtype.name for o in outs] == ["float32", "bfloat16", "float16"]


# --- a gradient's storage cast ----------------------------------------------------------------------


@tsr.function
def storage_cast_then_scale(x: Tensor["N", tsr.fp32]):
    return tsr.cast(x, tsr.bf16, storage=True) * 3.0, tsr.cast(x, tsr.bf16) * 3.0


def test_a_storage_cast_rounds_where_stored_and_a_plain_cast_where_it_is():
    """A storage cast (a gradient given its primal's dtype) feeding arithmetic in the same kernel
    is rounded once, where the result is stored: round(3x); a plain cast rounds where it is, as the
    user wrote: round(round(x) * 3). The inputs are chosen so the two differ; the exact reference
    agrees with the kernel on both, and the graph text keeps the flag through a round trip."""
    from tessera.ir import parse_ir, print_ir

    rng = np.random.default_rng(5)
    x = (1.0 + rng.random(4096)).astype(np.float32)
    once = (x.astype(np.float64) * 3.0).astype(tsr.bf16.np)
    twice = (x.astype(tsr.bf16.np).astype(np.float64) * 3.0).astype(tsr.bf16.np)
    assert (once != twice).mean() > 0.1
    c = storage_cast_then_scale.compile(storage_cast_then_scale.arg_specs_for({"N": 4096}))
    stored, plain = c.run(x)
    np.testing.assert_array_equal(stored, once)
    np.testing.assert_array_equal(plain, twice)
    for out, ref in zip((stored, plain), c.reference(x)):
        np.testing.assert_array_equal(out, ref)
    text = print_ir(storage_cast_then_scale.trace(storage_cast_then_scale.arg_specs_for({"N": 8})))
    assert text.count("graph.cast") == 2 and len(re.findall(r"graph\.cast [^\n]*\bstorage\b", text)) == 1
    assert print_ir(parse_ir(text)) == text


def test_the_attention_backward_rounds_ds_once():
    """dS = P (dP - D), given the scores' bf16 by the softmax's gradient (a storage cast) and scaled
    by 1/sqrt(D), is rounded once, for its matmuls (FlashAttention's order), where it was rounded,
    widened and rounded again: the dK/dV chain rounds four tiles to bf16, P (for dV) and dS (for
    dK) in its loop and its two outputs, where it rounded five."""
    import re as _re
    from tessera.autodiff.api import Derivative
    from tessera.frontend.trace import ArgSpec
    from attention_cases import FUNCTIONS

    specs = [ArgSpec(n, (1, 2, 256, 64), tsr.bf16, ("B", "H", "S", "D")) for n in ("q", "k", "v", "d_out")]
    compiled = Derivative(FUNCTIONS["plain"], cotangent_names=["d_out"]).compile(specs, arch="sm_90a")
    assert "storage" in compiled.ir("graph")
    kernels = _re.split(r"tile\.kernel @", compiled.ir("tile"))
    (dkdv,) = [k for k in kernels if k.startswith("plain_vjp_flash_chain")
               and "tensor<64x64xf32>, tensor<64x64xf32>" in k and k.count("tile.mma") >= 4]
    assert dkdv.count("arith.truncf") == 4


@tsr.function
def scaled_twice(x: Tensor["N"]):
    return (x * 0.5) * 3.0, (x.to(tsr.fp32) * 0.5) * 3.0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_chained_constant_scales_fold_where_the_dtype_is_16_bit(dtype):
    """(x * c1) * c2 is one multiply by c1 c2 where the product's dtype is bf16 or fp16 (whose graph
    rounds x * c1 anyway: attention's 1/sqrt(d) and a soft-cap's 1/cap); an fp32 product keeps both
    multiplies (IEEE order). Both results are the exact reference's to their dtype's rounding."""
    c = scaled_twice.compile(scaled_twice.arg_specs_for({"N": 1000}, dtype))
    products = [line for line in c.ir("tile").splitlines() if "arith.mulf" in line]
    assert len(products) == 3   # one for the 16-bit result, two for the fp32 one
    x = np.random.default_rng(3).standard_normal(1000).astype(getattr(tsr, dtype).np)
    half, single = c.run(x)
    exact = x.astype(np.float64) * 1.5
    np.testing.assert_array_equal(half, exact.astype(half.dtype))
    np.testing.assert_allclose(single, exact, rtol=1e-6)
