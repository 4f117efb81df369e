"""Shape-generic compiles on the CPU interpreter: specialization keys, compile counts, dims fixed
as constants and why, and the generic kernels' results against float64 (`tessera.dims`,
`frontend/specialization.py`)."""
import math
import re
import shutil

import numpy as np
import pytest

import tessera as tsr
from seed_kernels import causal_attention, flash_attention
from tessera import Tensor
from tessera.dims import CLASSES, MOST_CLASSES, Dynamic, DynamicDim, bind_shapes, class_of, index_bits
from tessera.errors import ShapeError, TesseraError

ROWS = [2, 3, 17, 1000]


def classes(values, aligned: bool = True) -> list:
    """The specialization classes of these values of a dynamic dim, in first-seen order (one compile
    each: `tessera.dims.CLASSES`; the multiples of 128 apart where the kernels rely on them)."""
    return list(dict.fromkeys(class_of(v, aligned) for v in values))


def layer_norm_ref(x, w, b):
    x = x.astype(np.float64)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def softmax_ref(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_one_compile_serves_every_row_count():
    @tsr.function(dynamic=["M"])
    def norm_gelu(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.gelu(tsr.layer_norm(x, (x.shape[-1],), w, b)) + b

    rng = np.random.default_rng(0)
    w, b = rand(rng, 37), rand(rng, 37)
    for m in ROWS:
        x = rand(rng, m, 37)
        y = layer_norm_ref(x, w, b)
        ref = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2))) + b
        out = norm_gelu(x, w, b)
        assert not np.isnan(out).any()
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    info = norm_gelu.cache_info()
    assert (info.compiles, info.hits, info.dynamic) == (len(classes(ROWS)), len(ROWS) - len(classes(ROWS)), ("M",))
    assert info.keys == [{"M": c, "N": 37} for c in classes(ROWS)]   # one compile a class of row counts


def test_a_dynamic_batch_dim_of_a_3d_softmax():
    @tsr.function(dynamic=["B"])
    def softmax(x: Tensor["B", "S", "N"]):
        return tsr.softmax(x, dim=-1)

    rng = np.random.default_rng(1)
    for batch in (2, 5, 11):
        x = rand(rng, batch, 3, 70)
        np.testing.assert_allclose(softmax(x), softmax_ref(x), rtol=1e-5, atol=1e-7)
    assert softmax.cache_info().compiles == 1


def test_a_kernel_stores_every_row():
    @tsr.kernel(dynamic=["M"])
    def scale_rows(x: Tensor["M", "N"], out: Tensor["M", "N"]):
        out[:] = tsr.softmax(x, dim=-1) * 3.0

    rng = np.random.default_rng(2)
    for m in (2, 13):
        x, out = rand(rng, m, 20), np.full((m, 20), np.nan, np.float32)
        scale_rows(x, out)
        np.testing.assert_allclose(out, 3 * softmax_ref(x), rtol=1e-5, atol=1e-6)
    assert scale_rows.cache_info().compiles == 1


def test_a_dim_called_with_a_second_value_becomes_dynamic():
    @tsr.function
    def softmax(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    rng = np.random.default_rng(3)
    for m in (4, 4, 9, 13, 4):
        x = rand(rng, m, 8)
        np.testing.assert_allclose(softmax(x), softmax_ref(x), rtol=1e-5, atol=1e-7)
    info = softmax.cache_info()
    assert info.keys == [{"M": 4, "N": 8}, {"M": "dynamic<=16", "N": 8}]
    assert info.dynamic == ("M",) and info.compiles == 2


def test_a_static_dim_compiles_once_per_value():
    @tsr.function(static=["M"])
    def softmax(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    for m in (4, 9, 13):
        softmax(np.ones((m, 8), np.float32))
    info = softmax.cache_info()
    assert info.compiles == 3 and info.dynamic == ()


def test_a_dim_of_one_is_its_own_class():
    """A dim of 1 broadcasts, so it never shares a compile with the generic one."""
    @tsr.function(dynamic=["M"])
    def add(x: Tensor["M", "N"], y: Tensor["M", "N"]):
        return x + y

    rng = np.random.default_rng(4)
    for m in (1, 5, 1, 6):
        x, y = rand(rng, m, 3), rand(rng, m, 3)
        np.testing.assert_allclose(add(x, y), x + y)
    assert [k["M"] for k in add.cache_info().keys] == [1, "dynamic<=16"]


def test_zero_rows_launch_nothing_and_keep_the_generic_compile():
    @tsr.function(dynamic=["M"])
    def softmax(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    assert softmax(np.ones((0, 8), np.float32)).shape == (0, 8)
    x = np.random.default_rng(5).standard_normal((7, 8)).astype(np.float32)
    np.testing.assert_allclose(softmax(x), softmax_ref(x), rtol=1e-5, atol=1e-7)


def test_code_that_reads_a_dynamic_dim_fixes_it_and_says_why():
    @tsr.function(dynamic=["M"])
    def scaled_rows(x: Tensor["M", "N"]):
        return x * (1.0 / math.sqrt(x.shape[0]))

    rng = np.random.default_rng(6)
    for m in (3, 8):
        x = rand(rng, m, 5)
        np.testing.assert_allclose(scaled_rows(x), x.astype(np.float64) / np.sqrt(m), rtol=1e-5)
    info = scaled_rows.cache_info()
    assert info.compiles == 2 and "M" in info.fixed and info.dynamic == ()
    assert "'M' is dynamic" in info.fixed["M"]
    # the user's line that used it, and the step that needed its value
    assert "test_specialization.py:" in info.fixed["M"] and "needed by " in info.fixed["M"], info.fixed["M"]


def test_a_dynamic_dim_adds_and_subtracts_as_a_value_read_at_run_time():
    """`x.shape[0] - 1` of a dim taken at run time is a `DimExpr`; in tensor math it becomes
    `graph.dim_size` (read from a buffer of that dim in the kernel), so the dim stays generic."""
    @tsr.function(dynamic=["M"])
    def shifted(x: Tensor["M", "N"]):
        return x / x.shape[0] + (x.shape[0] - 1) - (2 - x.shape[0]) + 2 * x.shape[0] * x

    rng = np.random.default_rng(7)
    for m in (1100, 1500, 3001):
        x = rand(rng, m, 8)
        want = x.astype(np.float64) / m + (m - 1) - (2 - m) + 2 * m * x.astype(np.float64)
        np.testing.assert_allclose(shifted(x), want, rtol=1e-5, atol=1e-2)   # (terms of 10^4: fp32 sums)
    info = shifted.cache_info()
    assert info.compiles == 1 and info.dynamic == ("M",) and not info.fixed
    graph = shifted.compile(shifted.arg_specs_for({"M": 4096, "N": 8}, "f32"), dynamic=frozenset({"M"})).ir("graph")
    assert re.search(r'graph.dim_size {.*dim = "M"}', graph)


def test_dim_expressions_refuse_what_needs_a_value():
    """A `DimExpr` adds and subtracts (collapsing to an int where the dims cancel); every use
    that needs its value raises `DynamicDim`, the signal to compile the dim as a constant."""
    from tessera.frontend.tensor import DimExpr, TracedDim
    n, m = TracedDim(Dynamic("N")), TracedDim(Dynamic("M"))
    e = n - m + 3
    assert isinstance(e, DimExpr) and dict(e.terms) == {"N": 1, "M": -1} and e.const == 3
    assert (n + 2) - n == 2 and repr(n - 1) == "N - 1" and repr(2 * (n - 1)) == "2*N - 2"
    for use in (int, float, bool, hash, abs, round, lambda x: x * 1.5, lambda x: x + 0.5, lambda x: 1.0 - x,
                lambda x: x + True, lambda x: x < 5, lambda x: range(x), lambda x: x ** 2):
        for value in (e, n):
            with pytest.raises(DynamicDim):
                use(value)


def test_what_needs_a_dims_value_fixes_it_and_what_does_not_stays_generic():
    """An index of `x.shape[0] - 1` needs the value (the dim is fixed); a dim sum compared with a
    traced tensor from the right is the tensor's comparison (generic); a float sum of large dims
    does not wrap as int32 would."""
    @tsr.function(dynamic=["M"])
    def last(x: Tensor["M", "N"]):
        return x[x.shape[0] - 1] * 2.0

    @tsr.function(dynamic=["M"])
    def tiny(x: Tensor["M", "N"]):
        return x / (x.shape[0] * 2 ** 22) + ((x.shape[0] - 3) >= tsr.arange(x.shape[0])[:, None]).to(tsr.fp32)

    rng = np.random.default_rng(8)
    x = rand(rng, 1100, 4)
    np.testing.assert_allclose(last(x), x[-1] * 2.0)
    assert "M" in last.cache_info().fixed
    want = x / (1100 * 2 ** 22) + (1097 >= np.arange(1100)[:, None])
    np.testing.assert_allclose(tiny(x), want, rtol=1e-6)
    assert not tiny.cache_info().fixed


def test_a_column_sum_walks_its_reduced_rows_at_run_time():
    """A column sum's (and mean's) reduced rows taken at run time: one compile per class, split
    across the grid as the class's hint says (20000 rows of 96 columns), each run's steps counted
    at run time, the mean divided by the run-time count."""
    @tsr.function(dynamic=["M"])
    def column_stats(x: Tensor["M", "N"]):
        return tsr.sum(x, dim=0) * 0.5, tsr.mean(x, dim=0)

    rng = np.random.default_rng(7)
    for m in (1100, 1537, 3001, 20000):
        x = rand(rng, m, 96)
        total, mean = column_stats(x)
        np.testing.assert_allclose(total, 0.5 * x.astype(np.float64).sum(0), rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(mean, x.astype(np.float64).mean(0), rtol=1e-4, atol=1e-5)
    info = column_stats.cache_info()
    assert info.compiles == 1 and not info.fixed
    c = column_stats.compile(column_stats.arg_specs_for({"M": 65536, "N": 1024}, "bf16"), dynamic=frozenset({"M"}),
                             arch="sm_90a")
    assert any(launch.grid[2] > 1 for launch in c.launches.values()) and c.stage("cubin")   # split rows


def test_a_kernel_that_takes_its_dims_as_constants_fixes_the_dim():
    """A column sum's kept columns size its tiles and partial results: N dynamic is fixed, and every
    later count compiles (correctly) for its value."""
    @tsr.function(dynamic=["N"])
    def column_sum(x: Tensor["M", "N"]):
        return tsr.sum(x, dim=0) * 0.5

    rng = np.random.default_rng(7)
    for n in (5, 12):
        x = rand(rng, 16, n)
        np.testing.assert_allclose(column_sum(x), 0.5 * x.astype(np.float64).sum(0), rtol=1e-5, atol=1e-6)
    info = column_sum.cache_info()
    assert info.compiles == 2 and "'N' is dynamic" in info.fixed["N"]
    assert re.search(r"needed by \w+ in tessera/[\w/]+\.py:\d+", info.fixed["N"]), info.fixed["N"]   # the step


def attention_ref(q, k, v, causal=False):
    scores = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if causal:   # the diagonal at the bottom right (a query count below the keys': the last keys)
        s, n = scores.shape[-2:]
        scores = np.where(np.arange(s)[:, None] + (n - s) >= np.arange(n)[None, :], scores, -np.inf)
    return softmax_ref(scores) @ v.astype(np.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_one_attention_compile_serves_every_sequence_length(causal):
    """The sequence length of an attention (queries and keys) taken at run time: the key loop's
    bound and its last block's mask, the query blocks' grid and the strides of B and H."""
    fn = tsr.function((causal_attention if causal else flash_attention).fn, dynamic=["S"])
    rng = np.random.default_rng(15)
    lengths = (2, 5, 17, 64, 130)
    for s in lengths:
        q, k, v = (rng.standard_normal((2, 3, s, 64)).astype(np.float16) for _ in range(3))
        out = fn(q, k, v)
        assert not np.isnan(out).any()
        np.testing.assert_allclose(out.astype(np.float64), attention_ref(q, k, v, causal), rtol=2e-3, atol=2e-3)
    info = fn.cache_info()
    assert (info.compiles, info.fixed) == (len(classes(lengths)), {})   # one compile a class of lengths
    assert info.keys == [{"B": 2, "H": 3, "S": c, "D": 64} for c in classes(lengths)]


def test_a_decode_loops_cache_length_stays_dynamic_when_the_batch_varies_too():
    """Unmarked, B and N both vary (a serving loop's batch and cache), but a tensor takes one dim at
    run time: N, the later axis, stays generic and B is fixed, so a longer cache never recompiles."""
    from decode_attention import gqa_decode_attention
    fn = tsr.function(gqa_decode_attention.fn)
    rng = np.random.default_rng(19)
    for b, n in ((1, 40), (3, 97), (3, 130), (3, 250), (1, 300)):
        q = rng.standard_normal((b, 2, 2, 1, 16)).astype(np.float16)
        k, v = (rng.standard_normal((b, 2, 1, n, 16)).astype(np.float16) for _ in range(2))
        fn(q, k, v)
    info = fn.cache_info()
    assert info.dynamic == ("N",) and "also has dim 'N'" in info.fixed["B"], info
    assert info.compiles == 4   # (1, 40); B = 3 over N <= 128, then N <= 256; B = 1 over N <= 512


def test_a_dim_that_yielded_to_one_fixed_later_is_released():
    """x [M, K] with M and K varying: K (the later) is kept generic and M yields, but a GEMM needs
    K's value, so K is fixed, and M, fixed only for K's sake, is generic again: new row counts
    compile once per class, not once per value."""
    @tsr.function
    def gemm(x: Tensor["M", "K"], w: Tensor["K", "N"]):
        return tsr.matmul(x, w)
    rng = np.random.default_rng(24)
    for m, k in ((8, 32), (16, 64), (40, 64), (100, 64), (7, 64), (300, 64), (50, 64)):
        x, w = rng.standard_normal((m, k)).astype(np.float16), rng.standard_normal((k, 16)).astype(np.float16)
        np.testing.assert_allclose(gemm(x, w).astype(np.float64), x.astype(np.float64) @ w, rtol=1e-2, atol=1e-2)
    info = gemm.cache_info()
    assert info.dynamic == ("M",) and set(info.fixed) == {"K"} and "value was needed" in info.fixed["K"], info
    assert info.compiles == 5   # (8, 32); then M's classes <= 16 (K fixed on the way), <= 64, <= 128, <= 512


def test_a_marked_length_stays_dynamic_when_the_batch_varies_too():
    """B and S both vary, but a tensor takes one dim at run time: S (marked) stays generic and B is
    fixed, saying why, so new lengths never recompile (only new batch sizes do)."""
    fn = tsr.function(causal_attention.fn, dynamic=["S"])
    rng = np.random.default_rng(17)
    for b, s in ((2, 5), (3, 9), (3, 16), (2, 11), (3, 2)):   # (lengths of one class)
        q, k, v = (rng.standard_normal((b, 2, s, 16)).astype(np.float16) for _ in range(3))
        np.testing.assert_allclose(fn(q, k, v).astype(np.float64), attention_ref(q, k, v, True), rtol=2e-3, atol=2e-3)
    info = fn.cache_info()
    assert info.compiles == 2 and info.dynamic == ("S",) and "also has dim 'S'" in info.fixed["B"], info


def test_each_class_of_a_dynamic_dim_compiles_once_with_its_own_hint():
    """Values compile once per class (`tessera.dims.CLASSES`), each with the schedule its hint picks:
    a GEMM of a decode step's rows splits its K (two kernels), one of thousands of rows does not,
    and a sweep of 60 row counts costs one compile a class (at most len(CLASSES): no kernel of a
    GEMM relies on its rows being a multiple of 128, so the first compile drops that class)."""
    fn = tsr.function(linear_gelu, dynamic=["M"])
    rng = np.random.default_rng(18)
    w, b = rng.standard_normal((1024, 64)).astype(np.float16) / 32, rng.standard_normal(64).astype(np.float16)
    rows = [2, 5, 128, 129, 1024, 1025, 3000] + [int(m) for m in rng.integers(2, 3000, 53)]
    for m in rows[:7]:
        x = rng.standard_normal((m, 1024)).astype(np.float16)
        np.testing.assert_allclose(fn(x, w, b).astype(np.float64), linear_gelu_ref(x, w, b), rtol=1e-2, atol=1e-2)
    for m in rows[7:]:
        fn(rng.standard_normal((m, 1024)).astype(np.float16), w, b)
    info = fn.cache_info()
    assert info.compiles == len(classes(rows, aligned=False)) <= len(CLASSES)
    assert [k["M"] for k in info.keys] == classes(rows, aligned=False) and classes(rows[:7], aligned=False) == \
        ["dynamic<=16", "dynamic<=128", "dynamic<=256", "dynamic<=1024", "dynamic"]
    kernels = {c: len(fn.compile(fn.arg_specs_for({"M": m, "K": 4096, "N": 1024}, "fp16"), dynamic=frozenset({"M"}),
                                 arch="sm_90a").launches) for c, m in (("small", 8), ("large", 4096))}
    assert kernels == {"small": 2, "large": 1}   # split K (its partial products, then their sum), or whole


def test_a_split_k_gemm_over_a_dynamic_row_count():
    """The small class's GEMM splits K: its partial products [splits, M, N] take M inside (sized per
    call through the scratch buffer's dim name), their sum applies the epilogue; every row written."""
    @tsr.kernel(dynamic=["M"])
    def project(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"], out: Tensor["M", "N"]):
        out[:] = tsr.gelu(tsr.matmul(x, w) + b)

    rng = np.random.default_rng(19)
    w, b = rng.standard_normal((2048, 48)).astype(np.float16) / 45, rng.standard_normal(48).astype(np.float16)
    compiled = project.compile(project.arg_specs_for({"M": 5, "K": 2048, "N": 48}, "fp16"), dynamic=frozenset({"M"}))
    assert len(compiled.launches) == 2 and 'tessera.buffer_dims = "M"' in compiled.ir("tile")
    for m in (2, 5, 16):
        x = rng.standard_normal((m, 2048)).astype(np.float16)
        out = np.full((m, 48), np.nan, np.float16)
        project(x, w, b, out)
        np.testing.assert_allclose(out.astype(np.float64), linear_gelu_ref(x, w, b), rtol=1e-2, atol=1e-2)
    assert project.cache_info().compiles == 1


def test_a_decode_step_over_a_cache_of_any_length():
    """One query against a KV cache whose length varies every step: one compile."""
    @tsr.function(dynamic=["N"])
    def decode(q: Tensor["B", "H", "Q", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1), v)

    rng = np.random.default_rng(16)
    lengths = (2, 31, 100, 1500, 3001)
    for n in lengths:
        q = rng.standard_normal((1, 4, 1, 64)).astype(np.float16)
        k, v = (rng.standard_normal((1, 4, n, 64)).astype(np.float16) for _ in range(2))
        np.testing.assert_allclose(decode(q, k, v).astype(np.float64), attention_ref(q, k, v), rtol=2e-3, atol=2e-3)
    assert decode.cache_info().compiles == len(classes(lengths)) and decode.cache_info().fixed == {}
    # a long cache's class splits its key blocks (flash-decoding) as its top value would, whatever
    # the length: the split runs are counted at run time, the partial outputs do not depend on N
    for arch in ("sm_80", "sm_90a"):
        compiled = decode.compile(decode.arg_specs_for({"B": 1, "H": 8, "Q": 1, "N": 3001, "D": 128}, "bf16"),
                                  dynamic=frozenset({"N"}), index_bits=32, arch=arch)
        part, combine = compiled.launches.values()
        assert part.grid[2] > 1 and part.dims and not combine.grid_terms   # (the combine: per query row)
        assert all("9223372036854775808" not in k.ptx for k in compiled.stage("ptx").values())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_generic_attention_reads_its_tensors_through_maps_of_the_calls_length(arch):
    """On sm_90a Q, K and V are read by TMA through maps whose S the call fills in; on both paths the
    query blocks' grid grows with S and no constant stands in for it. (Unsplit: over 8 heads the
    derived split takes its key blocks apart, as a compile for S = 1000 does.)"""
    fn = tsr.function(causal_attention.fn, dynamic=["S"], space={"split_kv": [1]})
    compiled = fn.compile(fn.arg_specs_for({"B": 2, "H": 4, "S": 1000, "D": 128}, "bf16"), dynamic=frozenset({"S"}),
                          index_bits=32, arch=arch)
    (launch,) = compiled.launches.values()
    assert launch.grid_terms[0][:3] == (0, 0, 2) and launch.dims == ((0, 2),)
    ptx = next(iter(compiled.stage("ptx").values())).ptx
    assert "9223372036854775808" not in ptx
    if arch == "sm_90a":
        assert "wgmma" in ptx and [s.shape for s in launch.tensor_maps] == [(2, 4, -1, 128)] * 3
    assert compiled.stage("cubin")



def test_a_generic_attention_over_few_heads_splits_as_its_compile_for_the_hint_would():
    """A causal attention over 8 heads with S taken at run time derives the split a compile for
    S = 1024 derives (its query blocks fill under half the slots): partial outputs sized by S at
    run time, their TMA maps' S left to the call, assembled for sm_90a; against float64 on the
    interpreter at two lengths of the class."""
    fn = tsr.function(causal_attention.fn, dynamic=["S"])
    compiled = fn.compile(fn.arg_specs_for({"B": 2, "H": 4, "S": 1000, "D": 128}, "bf16"), dynamic=frozenset({"S"}),
                          index_bits=32, arch="sm_90a")
    static = causal_attention.compile(causal_attention.arg_specs_for({"B": 2, "H": 4, "S": 1024, "D": 128}, "bf16"),
                                      arch="sm_90a")
    assert len(compiled.launches) == len(static.launches) == 2
    partials = next(launch for name, launch in compiled.launches.items() if name.endswith("_partials"))
    assert partials.tensor_maps and all(-1 in spec.shape for spec in partials.tensor_maps)
    assert compiled.stage("cubin")
    fn = tsr.function(causal_attention.fn, dynamic=["S"], space={"block_n": [16], "split_kv": [3]})
    rng = np.random.default_rng(25)
    for n in (40, 57):
        q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(np.float16) for _ in range(3))
        np.testing.assert_allclose(fn(q, k, v).astype(np.float64), attention_ref(q, k, v, True), rtol=2e-3, atol=2e-3)
    assert fn.cache_info().compiles == 1 and not fn.cache_info().fixed


def test_an_fp32_matmul_fixes_its_dims_for_tileiras(monkeypatch):
    """An fp32 matmul goes to tileiras (the PTX backend has no fp32 matrix instruction), which takes
    every dim as a constant: its dynamic dim is fixed, not passed to a backend that cannot run it
    (where tileiras is installed; without it the kernel goes to PTX either way, generic)."""
    from tessera.passes import backend_choice
    monkeypatch.setattr(backend_choice, "_tileiras_installed", lambda: True)
    @tsr.function(dynamic=["M"])
    def project(x: Tensor["M", "K"], w: Tensor["K", "N"]):
        return tsr.matmul(x, w)

    rng = np.random.default_rng(8)
    w = rand(rng, 24, 40)
    for m in (3, 70):
        x = rand(rng, m, 24)
        np.testing.assert_allclose(project(x, w), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
    info = project.cache_info()
    assert info.compiles == 2 and "rule fp32_matmul gives this kernel to the cuda-tile backend" in info.fixed["M"]


def test_dims_of_unannotated_arguments_stay_static_unless_marked():
    @tsr.function
    def add(x, y):
        return x + y

    for m in (2, 3, 4):
        x = np.ones((m, 4), np.float32)
        np.testing.assert_allclose(add(x, x), 2 * x)
    assert add.cache_info().compiles == 3 and add.cache_info().dynamic == ()


def test_two_dynamic_dims_that_must_agree_are_fixed():
    """Broadcasting two dims compares their values, which two dynamic dims do not have."""
    @tsr.function(dynamic=["M", "K"])
    def add(x: Tensor["M", "N"], y: Tensor["K", "N"]):
        return x + y

    x = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(add(x, 2 * x), 3 * x)
    assert set(add.cache_info().fixed) & {"M", "K"}


def test_bad_dim_names_are_clear_errors():
    with pytest.raises(TesseraError, match="both static and dynamic"):
        tsr.function(static=["M"], dynamic=["M"])(lambda x: x)

    @tsr.function(dynamic=["Q"])
    def f(x: Tensor["M", "N"]):
        return x * 2.0

    with pytest.raises(TesseraError, match="'Q'.*its dims are M, N"):
        f(np.ones((2, 2), np.float32))
    with pytest.raises(TesseraError, match="list of dim names"):
        tsr.function(dynamic="M")(lambda x: x)


def test_a_generic_compile_checks_every_call_shape():
    @tsr.function(dynamic=["M"])
    def add(x: Tensor["M", "N"], b: Tensor["N"]):
        return x + b

    add(np.ones((3, 4), np.float32), np.ones(4, np.float32))
    compiled = next(iter(add._cache.values()))
    with pytest.raises(ShapeError, match="argument 'b' has shape"):
        compiled.run(np.ones((5, 4), np.float32), np.ones(5, np.float32))
    with pytest.raises(ShapeError, match="takes 2 <= M"):
        compiled.run(np.ones((1, 4), np.float32), np.ones(4, np.float32))


def test_bind_shapes_names_disagreeing_arguments():
    declared = [("M", 4), ("M", 4), ("M", 8)]
    assert bind_shapes("f", declared, [(5, 4), (5, 4)], ["x", "y"]) == [(5, 4), (5, 4), (5, 8)]
    with pytest.raises(ShapeError, match="argument 'y' has M=6 but argument 'x' has M=5"):
        bind_shapes("f", declared, [(5, 4), (6, 4)], ["x", "y"])


def test_a_value_past_the_largest_dim_is_in_the_last_class():
    """class_of and hint_of run before bind_shapes can refuse a value: they must not fail first."""
    from tessera.dims import MAX_DIM, hint_of
    assert class_of(MAX_DIM + 5) == "dynamic" and hint_of(MAX_DIM + 5) == CLASSES[-1][1]
    assert [class_of(v) for v in (0, 1, 2, 16, 17, 1000, 1024, 1025, 8192)] == \
        [0, 1, "dynamic<=16", "dynamic<=16", "dynamic<=32", "dynamic<=1024", "dynamic<=1024%128", "dynamic",
         "dynamic%128"]


def test_a_multiple_of_128_compiles_without_tails_and_refuses_other_values():
    """A dynamic dim's multiples of ALIGNMENT are a class of their own: the compile knows no block
    along it is partial (the attention's key loop cuts no tail), says so in its Graph IR
    (`tessera.dim_multiples`), and its program refuses any other value with a ShapeError naming
    the argument, on the interpreter as on the GPU (`bind_shapes`)."""
    fn = tsr.function(flash_attention.fn, dynamic=["S"])
    specs = fn.arg_specs_for({"B": 1, "H": 2, "S": 256, "D": 16}, "fp16")
    aligned = fn.compile(specs, dynamic=frozenset({"S"}), aligned=frozenset({"S"}))
    generic = fn.compile(specs, dynamic=frozenset({"S"}))
    assert "tessera.dim_multiples = {S = 128 : i64}" in aligned.ir("graph")
    assert "dim_multiples" not in generic.ir("graph")
    cuts = [c.ir("tile").count("arith.cmpi slt") for c in (aligned, generic)]
    assert cuts[0] < cuts[1], cuts
    rng = np.random.default_rng(21)
    for s in (128, 384):
        q, k, v = (rng.standard_normal((1, 2, s, 16)).astype(np.float16) for _ in range(3))
        np.testing.assert_allclose(aligned.run(q, k, v)[0].astype(np.float64), attention_ref(q, k, v, False),
                                   rtol=2e-3, atol=2e-3)
    q = np.ones((1, 2, 200, 16), np.float16)
    with pytest.raises(ShapeError, match="argument 'q' has S=200; this compile takes S a multiple of 128"):
        aligned.run(q, q, q)
    with pytest.raises(ShapeError, match="multiple of 128"):
        bind_shapes("f", [("S", 4)], [(200, 4)], ["x"], multiples={"S": 128})


def test_copies_of_a_key_count_in_the_multiples_class_check_once():
    """A decode step's key tiles over a cache length taken at run time, in the class of multiples
    of 128 (which its key loop already relies on): each copy is whole or wholly past the end
    (`tile.copy_async {whole}`), so its chunks share one bounds check as with a constant length;
    the other class's copies keep a check a chunk, and a GEMM over run-time rows (whose loop relies
    on no multiple) marks none and gains no class. A split's copies past its run read at the key
    count's end, a select of two multiples (`index_facts.known_multiple`), and stay whole too. PTX of the mma.sync path (sm_90a's decode tile),
    assembled by ptxas."""
    from decode_attention import gqa_decode_attention
    fn = tsr.function(gqa_decode_attention.fn, dynamic=["N"])
    specs = fn.arg_specs_for(dict(B=64, Hk=8, G=4, M=1, N=8192, D=128), "bf16")   # (unsplit)
    compiled = {aligned: fn.compile(specs, dynamic=frozenset({"N"}), aligned=frozenset({"N"} if aligned else ()),
                                    index_bits=32, arch="sm_90a") for aligned in (True, False)}
    assert "whole" in compiled[True].ir("tile") and "whole" not in compiled[False].ir("tile")
    assert "whole" in compiled[True].ir("target")
    checks = {a: "\n".join(k.ptx for k in c.stage("ptx").values()).count("selp.b32") for a, c in compiled.items()}
    assert checks[True] * 4 < checks[False], checks   # (136 -> 12: a size a copy, not a chunk)
    assert compiled[True].stage("cubin")
    split = fn.compile(fn.arg_specs_for(dict(B=2, Hk=8, G=4, M=1, N=8192, D=128), "bf16"), dynamic=frozenset({"N"}),
                       aligned=frozenset({"N"}), index_bits=32, arch="sm_90a")   # (past a split's run: a select)
    assert len(split.launches) == 2 and "\n".join(k.ptx for k in split.stage("ptx").values()).count("selp.b32") < 20
    attention = tsr.function(flash_attention.fn, dynamic=["S"])   # self-attention: Q's copy along S too
    c = attention.compile(attention.arg_specs_for({"B": 1, "H": 2, "S": 256, "D": 64}, "fp16"),
                          dynamic=frozenset({"S"}), aligned=frozenset({"S"}), arch="sm_80")
    copies = [line for line in c.ir("tile").splitlines() if "tile.copy_async" in line]
    assert copies and all("whole" in line for line in copies)
    gemm = tsr.function(linear_gelu, dynamic=["M"])
    c = gemm.compile(gemm.arg_specs_for({"M": 4096, "K": 256, "N": 256}, "fp16"), dynamic=frozenset({"M"}),
                     aligned=frozenset({"M"}), arch="sm_80")
    assert "whole" not in c.ir("tile") and "dim_multiples" not in c.ir("tile")


def test_calls_of_a_multiple_of_128_and_of_another_value_compile_apart():
    fn = tsr.function(flash_attention.fn, dynamic=["S"])
    rng = np.random.default_rng(22)
    for s in (1536, 1500, 2048, 1999):
        q, k, v = (rng.standard_normal((1, 1, s, 16)).astype(np.float16) for _ in range(3))
        np.testing.assert_allclose(fn(q, k, v).astype(np.float64), attention_ref(q, k, v, False), rtol=2e-3, atol=2e-3)
    info = fn.cache_info()
    assert info.compiles == 2 <= MOST_CLASSES and [k["S"] for k in info.keys] == ["dynamic%128", "dynamic"]


def test_a_function_whose_kernels_ignore_the_multiple_has_no_class_for_it():
    """A norm's kernels never ask whether their rows are whole blocks: its first compile says so
    (no `tessera.dim_multiples` on its host function), and every later multiple of 128 runs the
    compile of its class, on the interpreter against float64."""
    @tsr.function(dynamic=["M"])
    def norm(x: Tensor["M", "N"], w: Tensor["N"]):
        return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)

    rng = np.random.default_rng(23)
    w = rng.standard_normal(64).astype(np.float32)
    rows = (1500, 4096, 2048, 4095, 256, 200)
    for m in rows:
        x = rng.standard_normal((m, 64)).astype(np.float32)
        want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(norm(x, w), want, rtol=1e-5, atol=1e-5)
    info = norm.cache_info()
    assert info.compiles == len(classes(rows, aligned=False)) == 2 and "%" not in str(info.keys)
    assert norm.specialization.unaligned == {"M"}


def test_a_dynamic_dim_refuses_to_be_a_number():
    d = Dynamic("S")
    assert d != 1 and d == Dynamic("S") and not (d == 0)
    for use in (int, lambda d: d + 1, lambda d: d < 4, lambda d: range(d), lambda d: d == Dynamic("T")):
        with pytest.raises(DynamicDim, match="'S'"):
            use(d)


def linear_gelu_ref(x, w, b):
    y = x.astype(np.float64) @ w.astype(np.float64) + b
    return 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))


def linear_gelu(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
    return tsr.gelu(tsr.matmul(x, w) + b)


@pytest.mark.parametrize("space", [
    None,
    dict(block_m=[32], block_n=[32], block_k=[16], group_m=[4]),   # a last group of a run-time height
    dict(persistent=[1], programs=[5], block_m=[32], block_n=[32], block_k=[16], group_m=[4], num_stages=[3]),
], ids=["default", "grouped", "persistent"])
def test_one_gemm_compile_serves_every_row_count(space):
    """A GEMM with a fused epilogue over a dynamic M: one compile, its tile rows counted at run time
    (grouped order, a persistent walk), every row count against float64."""
    fn = tsr.function(linear_gelu, dynamic=["M"], space=space)
    rng = np.random.default_rng(11)
    w, b = (rng.standard_normal(s).astype(np.float16) for s in ((72, 100), (100,)))
    rows = (2, 3, 31, 33, 161, 1000)
    for m in rows:
        x = rng.standard_normal((m, 72)).astype(np.float16)
        out = fn(x, w, b)
        assert out.shape == (m, 100) and not np.isnan(out).any()
        np.testing.assert_allclose(out.astype(np.float64), linear_gelu_ref(x, w, b), rtol=1e-2, atol=1e-2)
    info = fn.cache_info()
    assert (info.compiles, info.hits, info.fixed) == (len(classes(rows)), len(rows) - len(classes(rows)), {})
    assert info.keys == [{"M": c, "K": 72, "N": 100} for c in classes(rows)]


def test_a_gemm_kernel_writes_every_row_of_a_poisoned_output():
    @tsr.kernel(dynamic=["M"])
    def project(x: Tensor["M", "K"], w: Tensor["K", "N"], out: Tensor["M", "N"]):
        out[:] = tsr.matmul(x, w) * 0.5

    rng = np.random.default_rng(12)
    w = rng.standard_normal((40, 24)).astype(np.float16)
    for m in (2, 129):
        x = rng.standard_normal((m, 40)).astype(np.float16)
        out = np.full((m, 24), np.nan, np.float16)
        project(x, w, out)
        np.testing.assert_allclose(out.astype(np.float64), 0.5 * (x.astype(np.float64) @ w), rtol=1e-2, atol=1e-2)
    assert project.cache_info().compiles == len(classes((2, 129)))


def test_a_batched_gemm_over_a_dynamic_batch():
    @tsr.function(dynamic=["B"])
    def bmm(a: Tensor["B", "M", "K"], b: Tensor["B", "K", "N"]):
        return tsr.matmul(a, b)

    rng = np.random.default_rng(13)
    for batch in (2, 7):
        a = rng.standard_normal((batch, 20, 36)).astype(np.float16)
        b = rng.standard_normal((batch, 36, 18)).astype(np.float16)
        np.testing.assert_allclose(bmm(a, b).astype(np.float64), a.astype(np.float64) @ b, rtol=1e-2, atol=1e-2)
    assert bmm.cache_info().compiles == 1 and bmm.cache_info().fixed == {}
    for arch in ("sm_80", "sm_90a"):   # (a grid growing with B, no size read in the kernel: check-async samples it)
        compiled = bmm.compile(bmm.arg_specs_for({"B": 4, "M": 128, "K": 64, "N": 128}, "bf16"),
                               dynamic=frozenset({"B"}), arch=arch)
        assert next(iter(compiled.launches.values())).grid_terms and compiled.stage("cubin")


@pytest.mark.parametrize("dynamic", ["S", "B"])
def test_a_split_kv_attention_takes_a_dynamic_dim(dynamic):
    """A split-KV attention over a query count or a batch taken at run time: its partial outputs
    and log-sum-exps are sized per call (they used to fix the dim), one compile per class,
    checked against float64 on the interpreter (values of two classes; S = 3's compile has one key
    block and runs unsplit)."""
    fn = tsr.function(flash_attention.fn, dynamic=[dynamic], space={"split_kv": [4], "block_n": [16]})
    rng = np.random.default_rng(20)
    for n in (40, 33, 3):
        shape = (1, 2, n, 16) if dynamic == "S" else (n, 2, 40, 16)
        q, k, v = (rng.standard_normal(shape).astype(np.float16) for _ in range(3))
        np.testing.assert_allclose(fn(q, k, v).astype(np.float64), attention_ref(q, k, v), rtol=2e-3, atol=2e-3)
    info = fn.cache_info()
    assert not info.fixed and info.compiles == 2


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_generic_gemm_bounds_its_rows_by_the_size_param(arch):
    """The GEMM's rows are checked against M's u32 param on both paths; on sm_90a the A operand's
    tensor map leaves M to the call (`TensorMapSpec.DYNAMIC`), and no constant stands in for it."""
    fn = tsr.function(linear_gelu, dynamic=["M"])
    compiled = fn.compile(fn.arg_specs_for({"M": 4096, "K": 4096, "N": 1024}, "bf16"), dynamic=frozenset({"M"}),
                          arch=arch)
    (launch,) = compiled.launches.values()
    assert launch.dims == ((0, 0),) and launch.param_types[-1] == "u32"
    ptx = next(iter(compiled.stage("ptx").values())).ptx
    assert "9223372036854775808" not in ptx and ".param .u32" in ptx
    if arch == "sm_90a":
        assert "wgmma" in ptx and [s.shape for s in launch.tensor_maps] == [(-1, 4096), (4096, 1024)]
    assert "?x4096xbf16" in compiled.ir("target")
    assert compiled.stage("cubin")
    # a decode step's rows split K: partial products [splits, M, N] (M inside: its stride-free dim) and their sum
    small = fn.compile(fn.arg_specs_for({"M": 9, "K": 4096, "N": 1024}, "bf16"), dynamic=frozenset({"M"}), arch=arch)
    part, total = small.launches.values()
    assert part.grid[2] > 1 and part.grid_terms and total.grid_terms
    assert "memref<?x?x" not in small.ir("tile") and "x?x1024xf32>" in small.ir("tile")
    assert all("9223372036854775808" not in k.ptx for k in small.stage("ptx").values()) and small.stage("cubin")


def test_a_dynamic_dim_inside_a_tensor():
    """S of [B, S, N]: the strides of B grow with it (taken at run time), one compile serves every S."""
    @tsr.function(dynamic=["S"])
    def norm_softmax(x: Tensor["B", "S", "N"], w: Tensor["N"]):
        return tsr.softmax(tsr.rms_norm(x, (x.shape[-1],), w, 1e-6), dim=-1) + x

    rng = np.random.default_rng(14)
    w = rand(rng, 40)
    for s in (2, 5, 13):
        x = rand(rng, 3, s, 40)
        y = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(norm_softmax(x, w), softmax_ref(y) + x, rtol=1e-5, atol=1e-6)
    info = norm_softmax.cache_info()
    assert (info.compiles, info.fixed, info.keys) == (1, {}, [{"B": 3, "S": "dynamic<=16", "N": 40}])


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_dynamic_dim_inside_a_tensor_addresses_by_run_time_strides(arch):
    @tsr.function(dynamic=["S"])
    def softmax3(x: Tensor["B", "S", "N"]):
        return tsr.softmax(x, dim=-1) * 2.0

    compiled = softmax3.compile(softmax3.arg_specs_for({"B": 3, "S": 9, "N": 4096}, "bf16"),
                                dynamic=frozenset({"S"}), index_bits=32, arch=arch)
    (launch,) = compiled.launches.values()
    assert launch.dims == ((0, 1),) and launch.grid_terms   # x and the output share S's param (dim 1)
    ptx = next(iter(compiled.stage("ptx").values())).ptx
    assert "9223372036854775808" not in ptx and re.search(r"mul\.lo\.s32 %r\d+, %r\d+, 4096;", ptx)   # B's stride
    assert "memref<3x?x4096xbf16>" in compiled.ir("tile")
    assert compiled.stage("cubin")


def test_the_ir_shows_the_dynamic_dim_and_grid():
    @tsr.function(dynamic=["M"])
    def softmax(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    compiled = softmax.compile(softmax.arg_specs_for({"M": 9, "N": 64}), dynamic=frozenset({"M"}))
    text = compiled.ir("tile")
    assert "memref<?x64xf32>" in text and "grid_dims = array<i64: 0, 0, 0," in text
    assert 'tessera.dynamic_dims = ["M"]' in compiled.ir("graph")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
def test_the_generic_kernels_assemble_with_their_size_params():
    @tsr.function(dynamic=["M"])
    def norm(x: Tensor["M", "N", tsr.bf16], w: Tensor["N", tsr.bf16]):
        return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6) * 2.0

    compiled = norm.compile(norm.arg_specs_for({"M": 9, "N": 4096}), dynamic=frozenset({"M"}), arch="sm_90a")
    (launch,) = compiled.launches.values()
    assert launch.grid_terms and launch.dims == ((0, 0),)   # x and the output share M's size param
    assert launch.param_types == ("u64",) * 3 + ("u32",)
    ptx = next(iter(compiled.stage("ptx").values())).ptx
    assert ".param .u32" in ptx
    assert compiled.stage("cubin")


def test_offsets_are_32_bit_below_2_to_the_31_elements_and_part_of_the_key():
    class Shaped:
        def __init__(self, *shape):
            self.shape = shape
    assert index_bits([Shaped(2 ** 20, 2 ** 10)]) == 32
    assert index_bits([Shaped(2 ** 21, 2 ** 10), Shaped(4)]) == 64
    declared = [("M", 2 ** 10), ("M", 2 ** 10)]
    with pytest.raises(ShapeError, match="32-bit offsets"):
        bind_shapes("f", declared, [(2 ** 21, 2 ** 10)], ["x"], bits=32)
    assert bind_shapes("f", declared, [(2 ** 21, 2 ** 10)], ["x"], bits=64)[1] == (2 ** 21, 2 ** 10)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
def test_a_32_bit_generic_kernel_sums_offsets_in_32_bits():
    @tsr.function(dynamic=["M"])
    def add(x: Tensor["M", "N", tsr.fp16], b: Tensor["N", tsr.fp16]):
        return x + b

    specs = add.arg_specs_for({"M": 9, "N": 256})
    ptx = {bits: next(iter(add.compile(specs, dynamic=frozenset({"M"}), index_bits=bits, arch="sm_90a")
                           .stage("ptx").values())).ptx for bits in (32, 64)}
    assert ptx[32].count("mad.wide.s32") < ptx[64].count("mad.wide.s32")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
def test_a_dynamic_innermost_dim_is_not_accessed_in_vectors():
    """A vector access is predicated once for its run, which must lie wholly inside or outside the
    tensor: with a length known only at run time, every element is checked on its own."""
    @tsr.function(dynamic=["M"])
    def double(x: Tensor["M", tsr.fp16]):
        return x * 2.0

    specs = double.arg_specs_for({"M": 4096})
    ptx = {d: next(iter(double.compile(specs, dynamic=d, arch="sm_90a").stage("ptx").values())).ptx
           for d in (frozenset(), frozenset({"M"}))}
    assert "st.global.v" in ptx[frozenset()] and "st.global.v" not in ptx[frozenset({"M"})]


def test_a_set_or_dict_lookup_of_a_dynamic_dim_fixes_it():
    """Membership hashes first and never compares: a dynamic dim refuses to be hashed, so the
    function compiles the dim as a constant and the lookup sees its value (review of session 20)."""
    sizes, scales = {3, 5}, {4: 0.5}

    @tsr.function(dynamic=["M"])
    def f(x: Tensor["M", "N"]):
        return x * (2.0 if x.shape[0] in sizes else 1.0) * scales.get(x.shape[0], 1.0)

    for m, factor in ((3, 2.0), (4, 0.5), (6, 1.0)):
        x = np.ones((m, 2), np.float32)
        np.testing.assert_allclose(f(x), factor * x)
    assert "M" in f.cache_info().fixed


def test_a_column_slice_of_a_varying_input_compiles_per_value():
    """An input read in place through its strides (a column slice) keeps its dim a constant."""
    @tsr.function
    def f(x: Tensor["M", "N"], b: Tensor["N"]):
        return tsr.softmax(x + b, dim=-1)

    rng = np.random.default_rng(8)
    b = rand(rng, 32)
    for m in (100, 37, 5):
        x = rand(rng, m, 96)[:, :32]
        np.testing.assert_allclose(f(x, b), softmax_ref(x + b), rtol=1e-5, atol=1e-7)
    assert "M" in f.cache_info().fixed


def test_outputs_past_32_bit_offsets_recompile_with_64(monkeypatch):
    """The offset class looks at the inputs; an output a broadcast makes larger than every input
    raises OffsetWidthError before any launch, and the function takes 64-bit offsets from then on."""
    import tessera.dims as dims
    monkeypatch.setattr(dims, "INDEX_LIMIT", 2000)

    @tsr.function(dynamic=["M"])
    def outer(x: Tensor["M", 1], y: Tensor[1, "N"]):
        return x * y

    y = np.arange(64, dtype=np.float32)[None, :]
    for m in (17, 32, 20):   # (one class of a dynamic dim: 17..32)
        x = np.arange(m, dtype=np.float32)[:, None]
        np.testing.assert_allclose(outer(x, y), x * y)
    assert outer.specialization.wide and outer.cache_info().compiles == 2


def test_a_row_reduction_to_a_vector_and_an_inserted_unit_dim_stay_generic():
    @tsr.function(dynamic=["M"])
    def means(x: Tensor["M", "N"]):
        return tsr.mean(x, dim=-1)

    @tsr.function(dynamic=["M"])
    def widen(x: Tensor["M", "N"]):
        return tsr.exp(x[:, None, :])

    rng = np.random.default_rng(9)
    for m in (2, 7, 16):
        x = rand(rng, m, 24)
        np.testing.assert_allclose(means(x), x.astype(np.float64).mean(-1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(widen(x), np.exp(x.astype(np.float64))[:, None, :], rtol=1e-5)
    for fn in (means, widen):
        assert fn.cache_info().compiles == 1 and fn.cache_info().fixed == {}, fn.cache_info()


RESHAPES = [   # (shape of x, with "T" the dynamic dim; the new shape, "T" standing for x.shape's T; stays generic)
    (("T", 6), ("T", 2, 3), True), (("T", 6), ("T", 3, -1), True), (("T", 6), (-1, 6), True),
    (("T", 6), (-1, 2, 3), True), (("T", 2, 3), ("T", 6), True), (("T", 6), ("T", 1, 6, 1), True),
    (("T", 3), ("T", 3, 1), True), ((2, "T", 3), (1, 2, "T", 3), True), ((2, "T", 3), (2, -1, 3), True),
    (("T", 1), (-1,), True), ((1, "T"), (-1,), True), (("T", 4), (4, "T"), False), ((2, "T", 4), ("T", -1), False),
    ((2, "T"), ("T", -1), False), (("T", 2, 4), (2, "T", 4), False), (("T", 6), (-1,), False),
]


@pytest.mark.parametrize("before,after,generic", RESHAPES, ids=[f"{b}->{a}" for b, a, _ in RESHAPES])
def test_a_reshape_of_a_dynamic_dim_is_numpys_or_fixes_the_dim(before, after, generic):
    """Every reshape of a tensor with a dim taken at run time gives NumPy's result: kept generic
    where the dim stays whole (one compile for two lengths), else compiled with the dim fixed."""
    def reshaped(x):
        t = x.shape[before.index("T")]
        return x.reshape(*(t if n == "T" else n for n in after)) * 2.0 + 1.0

    names = iter(("A", "C"))
    reshaped.__annotations__ = {"x": Tensor[tuple("T" if n == "T" else next(names) for n in before)]}
    view = tsr.function(reshaped, dynamic=["T"])
    rng = np.random.default_rng(len(before) + len(after))
    for t in (5, 7):
        x = rng.standard_normal(tuple(t if n == "T" else n for n in before)).astype(np.float32)
        want = x.reshape(tuple(t if n == "T" else n for n in after)) * 2.0 + 1.0
        np.testing.assert_array_equal(view(x), want)
    info = view.cache_info()
    assert (info.fixed == {}) == generic, info
    assert info.compiles == (1 if generic else 2)


def test_a_call_whose_tensors_disagree_on_a_dim_fails_early_and_is_no_hit():
    @tsr.function(dynamic=["S"])
    def add(x: Tensor["S", "D"], y: Tensor["S", "D"]):
        return x + y

    add(np.ones((5, 4), np.float32), np.ones((5, 4), np.float32))
    for _ in range(3):
        with pytest.raises(tsr.ShapeError, match="argument 'y' has S=10 but argument 'x' has S=9"):
            add(np.ones((9, 4), np.float32), np.ones((10, 4), np.float32))
    info = add.cache_info()
    assert (info.compiles, info.hits) == (1, 0)


def test_a_call_refused_for_its_ranks_notes_no_dim_values():
    """Else its N=4 and the next call's N=3 made N look varied, and the next compile generic."""
    @tsr.function
    def f(x: Tensor["M", "N"], y: Tensor["N"]):
        return x + y

    with pytest.raises(tsr.ShapeError, match=r"argument 'x' is annotated Tensor\['M', 'N'\] \(rank 2\)"):
        f(np.ones((2, 5, 1), np.float32), np.ones(4, np.float32))
    f(np.ones((2, 3), np.float32), np.ones(3, np.float32))
    assert f.cache_info().keys == [{"M": 2, "N": 3}]
