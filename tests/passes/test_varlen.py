"""Variable-length (packed) attention on the CPU interpreter against float64, and what makes it fast.

examples/varlen_attention.py packs sequences of different lengths without padding (FlashAttention's
cumulative lengths); its mask compares each key with the first and last keys of the query's own
sequence, which the compiler reads per row: a query block's key loop runs between the least and the
greatest of its rows' limits (`tile.load_index_reduce`), unmasked inside. Also here: what that
needed elsewhere (a transposed attention output stored by the attention itself, grids past CUDA's
axis limits, a unit dim keeping its axis through a view, two blocks an SM for attention tiles)."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera.errors import ShapeError
from tessera import Tensor
from tessera.backends.ptx import emit_module
from tessera.ir import graph as g
from tessera.ir.masks import attention_mask
from tessera import platforms
from tessera.passes import backend_choice, fusion
from tessera.runtime.ptxas import assemble, find_tool
from varlen_attention import varlen_attention

needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")


def cumulative(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def reference(q, k, v, cu_q, cu_k):
    """float64 causal attention per sequence, the diagonal at the bottom right; rows of a sequence
    with no keys are NaN (softmax over nothing)."""
    t, h, d = q.shape
    g_ = h // k.shape[1]
    out = np.full((t, h, d), np.nan)
    for b in range(len(cu_q) - 1):
        a, e, ka, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if e == a:
            continue
        kk, vv = (np.repeat(x[ka:ke].astype(np.float64), g_, axis=1) for x in (k, v))
        s = np.einsum("thd,nhd->htn", q[a:e].astype(np.float64), kk) / math.sqrt(d)
        s = np.where(np.arange(ke - ka)[None, :] <= np.arange(e - a)[:, None] + (ke - ka) - (e - a), s, -np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(-1, keepdims=True))
            out[a:e] = np.einsum("htn,nhd->thd", p / p.sum(-1, keepdims=True), vv)
    return out


def inputs(rng, queries, keys, h, hk, d):
    q = rng.standard_normal((sum(queries), h, d)).astype(np.float32)
    k, v = (rng.standard_normal((sum(keys), hk, d)).astype(np.float32) for _ in range(2))
    return q, k, v, cumulative(queries), cumulative(keys)


def compiled(args, **options):
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
    return varlen_attention.compile(varlen_attention.arg_specs(list(zip(names, args)))[1], **options)


@pytest.mark.parametrize("queries,keys,h,hk,d", [
    ([5, 17, 1, 40], [5, 17, 1, 40], 4, 2, 32),        # prefill: a sequence of one token among others
    ([3, 70, 1], [30, 90, 200], 4, 1, 32),              # fewer queries than keys (MQA)
    ([1] * 7, [100, 3, 50, 64, 1, 17, 300], 2, 2, 64),  # a decode step of each sequence
    ([1], [1], 2, 1, 64),                                # one token
    ([13, 0, 29], [13, 0, 29], 2, 2, 16),                # a sequence of no tokens
    ([1, 2, 3, 1, 5, 2, 1, 1, 4, 3, 2, 1, 1, 2, 3, 1, 1, 1, 2, 5], [7, 3, 30, 1, 9, 2, 64, 5, 4, 3, 2, 1, 1, 2, 17,
                                                                 1, 1, 1, 2, 5], 8, 1, 32),   # many short: blocks span them
])
@pytest.mark.parametrize("block", [16, 64])
def test_varlen_against_float64(queries, keys, h, hk, d, block):
    rng = np.random.default_rng(sum(queries) + block)
    args = inputs(rng, queries, keys, h, hk, d)
    out = compiled(args, space={"block_m": [block], "block_n": [block]}).run(*args)[0]
    np.testing.assert_allclose(out, reference(*args), atol=2e-6)


def test_a_query_block_reads_its_sequences_keys_only():
    """Values no query's sequence holds are NaN: a key block none of a query block's rows keeps
    would poison its rows (0 * NaN); the loop never reaches them."""
    rng = np.random.default_rng(7)
    q, k, v, cu, _ = inputs(rng, [32, 64, 16, 48], [32, 64, 16, 48], 2, 2, 32)
    v[32:96] = np.nan                                   # the second sequence's values
    out = compiled((q, k, v, cu, cu), space={"block_m": [16], "block_n": [16]}).run(q, k, v, cu, cu)[0]
    outside = np.r_[0:32, 96:160]
    assert not np.isnan(out[outside]).any()
    np.testing.assert_allclose(out[outside], reference(q, k, v, cu, cu)[outside], atol=2e-6)


DIMS = dict(T=16384, N=16384, H=32, Hk=8, D=128, B1=9)


def test_the_attention_reads_each_blocks_rows_limits():
    c = varlen_attention.compile(varlen_attention.arg_specs_for(DIMS, "bf16"), arch="sm_90a", sm_count=132)
    tile_ir = c.ir("tile")
    # the least and greatest of the first key, the last key and the last query over a block's rows
    assert tile_ir.count("tile.load_index_reduce") == 6
    assert [name.split("_")[-2] for name in c.kernel_names][-1] == "attention"   # the output stored by it


def test_the_limits_are_per_row_and_lower_as_well_as_upper():
    """In the attention's kernel, where fusion has made each row's limits kernel inputs."""
    c = varlen_attention.compile(varlen_attention.arg_specs_for(dict(T=40, N=40, H=2, Hk=2, D=16, B1=3), "fp32"))
    host = next(iter(c.modules["schedule"].ops))
    (sm,) = [op for op in host.walk() if isinstance(op, g.SoftmaxOp)]
    terms = attention_mask(sm.input, ("b0", "b1", "m", "n"), "m", "n", g.bindings_of(host))
    assert [(limit.lower, limit.rows, len(limit.terms), limit.per_row("m")) for limit in terms.limits] == [
        (True, None, 1, True), (False, None, 1, True), (False, "index", 2, True)]
    assert sorted(term.sign for term in terms.limits[2].terms) == [-1, 1]   # end_key - end_query


@needs_ptxas
@pytest.mark.parametrize("space", [{}, {"warp_specialize": [1]}, {"qk_ahead": [1], "num_stages": [3]},
                                   {"block_n": [128]}])
def test_varlen_kernels_assemble(space):
    """On the Hopper path, each schedule: the async checker runs each block with the indices it
    samples (conftest turns it on); a producer's one thread reads a block's limits on its own,
    the computing warps share them out over lanes."""
    c = varlen_attention.compile(varlen_attention.arg_specs_for(DIMS, "bf16"), arch="sm_90a", sm_count=132,
                                 space=space)
    for name, kernel in emit_module(c.modules["target"]).items():
        if "flash_attention" in name:
            assert "shfl.sync.bfly.b32" in kernel.ptx
        assemble(kernel.ptx, "sm_90a")


@tsr.function
def masked_by_a_tensor(q: Tensor["M", "D"], k: Tensor["N", "D"], v: Tensor["N", "D"], keep: Tensor["M", "N", tsr.int32]):
    scores = tsr.where(keep > 0, tsr.matmul(q, k.transpose(-2, -1)), -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


def test_the_cuda_tile_backend_passes_row_limits_to_ptx():
    """A mask read from memory per row is the PTX backend's (fusion's `reads_indices` fact); a
    mask read from memory elementwise only (a bias) is not such a fact."""
    c = varlen_attention.compile(varlen_attention.arg_specs_for(DIMS, "bf16"), arch="sm_90a")
    host = next(iter(c.modules["schedule"].ops))
    (attention,) = [op for op in host.body.block.ops if getattr(op, "kind", None) and op.kind.data == "flash_attention"]
    assert fusion._reads_indices(attention.body.block, g.bindings_of(host))
    specs = masked_by_a_tensor.arg_specs_for(dict(M=64, N=64, D=32), "bf16")
    host = next(iter(masked_by_a_tensor.compile(specs, arch="sm_90a").modules["schedule"].ops))
    (attention,) = [op for op in host.body.block.ops if getattr(op, "kind", None) and op.kind.data == "flash_attention"]
    assert not fusion._reads_indices(attention.body.block, g.bindings_of(host))
    facts = backend_choice.KernelFacts("flash_attention", dtypes=frozenset({"bf16"}), target=platforms.get("sm_90a"),
                                       reads_indices=True)
    assert "a mask's limits per sequence" in backend_choice.cannot_compile("cuda-tile", facts)


# --- what varlen needed elsewhere ----------------------------------------------------------------

@tsr.function
def bshd_gqa(q: Tensor["B", "S", "H", "D"], k: Tensor["B", "S", "Hk", "D"], v: Tensor["B", "S", "Hk", "D"]):
    """[B, S, H, D] in and out, GQA: the output's transposes and merged heads are the kernel's store."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    qh = q.reshape(b, s, hk, h // hk, d).transpose(1, 2).transpose(2, 3)
    kh, vh = (x.transpose(1, 2)[:, :, None] for x in (k, v))
    scores = tsr.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    out = tsr.matmul(tsr.softmax(scores, dim=-1), vh)
    return out.transpose(2, 3).transpose(1, 2).reshape(b, s, h, d)


@pytest.mark.parametrize("dims", [dict(B=2, S=37, H=4, Hk=2, D=16), dict(B=1, S=1, H=4, Hk=1, D=16),
                                  dict(B=3, S=20, H=2, Hk=2, D=8)])
def test_a_transposed_attention_output_is_stored_by_the_attention(dims):
    specs = bshd_gqa.arg_specs_for(dims, "fp32")
    c = bshd_gqa.compile(specs)
    assert len(c.kernel_names) == 1, c.kernel_names
    rng = np.random.default_rng(dims["S"])
    xs = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]
    np.testing.assert_allclose(c.run(*xs)[0], c.reference(*xs)[0], atol=2e-6)


@tsr.function
def transposed_twice(x: Tensor["A", "B", "C", "D"]):
    return x.transpose(0, 2) * 2.0


def test_a_grid_past_65535_on_axis_2_is_laid_along_axis_0():
    """[3, 70000, 2, 4] -> [2, 70000, 3, 4]: 140,000 batch programs, more than CUDA's 65,535 along
    grid axis 2; the launch has them along axis 0 and the kernel finds its coordinates from there."""
    x = np.random.default_rng(0).standard_normal((3, 70000, 2, 4)).astype(np.float32)
    c = transposed_twice.compile(transposed_twice.arg_specs([("x", x)])[1])
    assert "grid = array<i64: 140000, 1, 1>" in c.ir("tile")
    np.testing.assert_array_equal(c.run(x)[0], x.transpose(2, 1, 0, 3) * 2.0)


@tsr.function
def tall(x: Tensor["M", "N"]):
    return x * 2.0 + 1.0


def test_a_dynamic_dim_on_grid_axis_1_is_laid_along_axis_0():
    """A dim taken at run time may pass 65,535 blocks at any call."""
    fn = tsr.function(tall.fn, dynamic=["M"])
    c = fn.compile(fn.arg_specs_for({"M": 1000, "N": 3}), dynamic=frozenset({"M"}))
    launch = next(line for line in c.ir("tile").splitlines() if "tile.launch" in line)
    assert "grid = array<i64: 1, 1, 1>, grid_dims = array<i64: 0, 0, 0, 16>" in launch   # 1 x cdiv(M, 16) along x
    for rows in (1000, 17):
        y = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        np.testing.assert_array_equal(c.run(y)[0], y * 2.0 + 1.0)


@pytest.mark.parametrize("space,blocks", [({}, 2), ({"block_n": [128]}, None), ({"warp_specialize": [1]}, None)])
def test_attention_tiles_that_leave_room_ask_for_two_blocks_an_sm(space, blocks):
    """fusion._occupancy: two blocks of 128 x 64 tiles at D=128 on 8 warps; none with 128 keys (one
    block's worth of registers) or warp-specialized (a register split), nor on the mma.sync path."""
    c = varlen_attention.compile(varlen_attention.arg_specs_for(DIMS, "bf16"), arch="sm_90a", sm_count=132,
                                 space=space)
    kernels = emit_module(c.modules["target"])
    ptx = next(k.ptx for name, k in kernels.items() if name.endswith("attention_5"))
    assert (".minnctapersm 2" in ptx) == (blocks == 2)
    ampere = varlen_attention.compile(varlen_attention.arg_specs_for(DIMS, "bf16"), arch="sm_80")
    assert ".minnctapersm" not in "".join(k.ptx for k in emit_module(ampere.modules["target"]).values())


# --- what a review found ---------------------------------------------------------------------------

@tsr.function
def attention_and_transposed_lse(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                                 v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * 0.25
    return tsr.matmul(tsr.softmax(s, dim=-1), v), tsr.logsumexp(s, -1, keepdim=True).transpose(1, 2)


@tsr.function
def decode_squeezed(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
    o = tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1), v)   # [B, H, 1, D]
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[1], q.shape[3])                 # the query dim dropped


@tsr.function
def chain_squeezed(x: Tensor["B", "M", "C"], w1: Tensor["C", "F"], w2: Tensor["F", "E"]):
    r = tsr.matmul(tsr.relu(tsr.matmul(x, w1)), w2)                 # [B, M, 1]
    return r.transpose(-2, -1).reshape(x.shape[0], x.shape[1])


@pytest.mark.parametrize("fn,dims,space", [
    (attention_and_transposed_lse, dict(B=2, H=4, S=20, D=16), {}),       # the log-sum-exp is a copy
    (attention_and_transposed_lse, dict(B=1, H=4, S=4, D=16), {}),
    (attention_and_transposed_lse, dict(B=1, H=2, S=40, D=16), {"split_kv": [3], "block_n": [16]}),
    (decode_squeezed, dict(B=2, H=3, S=1, N=20, D=16), {}),               # a view that drops a tiled dim
    (chain_squeezed, dict(B=2, M=50, C=32, F=300, E=1), {}),
])
def test_outputs_the_kernel_cannot_store_transposed_are_copied(fn, dims, space):
    specs = fn.arg_specs_for(dims, "fp32")
    c = fn.compile(specs, space=space)
    rng = np.random.default_rng(sum(dims.values()))
    xs = [rng.standard_normal(s.shape).astype(np.float32) for s in specs]
    for out, ref in zip(c.run(*xs), c.reference(*xs)):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)


@tsr.function
def limited_by_a_difference(q: Tensor["M", "D"], k: Tensor["N", "D"], v: Tensor["N", "D"],
                            a: Tensor["M", tsr.int32], b: Tensor["M", tsr.int32]):
    cols, rows = tsr.arange(k.shape[0])[None, :], tsr.arange(q.shape[0])[:, None]
    s = tsr.where(cols <= rows + (a - b)[:, None], tsr.matmul(q, k.transpose(-2, -1)), -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def test_a_limit_of_several_huge_terms_bounds_nothing_rather_than_wrap():
    """A per-row limit a - b where a block's greatest a and greatest b (of different rows) would
    wrap a 32-bit sum: the block reads every key, masked, and the rows are right."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((40, 16)).astype(np.float32) for _ in range(3))
    a = np.zeros(40, np.int32)
    b = np.zeros(40, np.int32)
    a[::2], b[1::2] = 2 ** 31 - 1, -5           # a row keeping everything next to one keeping a few
    c = limited_by_a_difference.compile(limited_by_a_difference.arg_specs(
        [("q", q), ("k", k), ("v", v), ("a", a), ("b", b)])[1], space={"block_m": [16], "block_n": [16]})
    tile_ir = c.ir("tile")
    assert tile_ir.count("tile.load_index_reduce") == 4
    # the interpreter's indices are 64-bit: what guards the GPU's 32-bit sums is the bounds' fallback
    assert sum(1 for line in tile_ir.splitlines() if "arith.select" in line and line.endswith(": index")) == 2
    np.testing.assert_allclose(c.run(q, k, v, a, b)[0], c.reference(q, k, v, a, b)[0], atol=2e-6)


def test_batches_in_buffers_of_one_capacity_compile_once():
    """A serving loop's packed buffers keep their capacity (tokens, keys, sequences) from batch to
    batch: rows past the last sequence belong to none (NaN: softmax over no key), keys past the
    last are never read, and trailing empty sequences change nothing, so one compile serves every
    batch (a function whose T and N vary compiles once per class of them: the next test)."""
    fn = tsr.function(varlen_attention.fn)
    cap_t, cap_n, cap_b, h, d = 96, 128, 6, 2, 16
    rng = np.random.default_rng(11)
    q = rng.standard_normal((cap_t, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((cap_n, h, d)).astype(np.float32) for _ in range(2))
    for batch in range(4):
        b = int(rng.integers(1, cap_b))
        queries = rng.integers(0, cap_t // cap_b + 1, b)
        keys = queries + rng.integers(0, 4, b)
        cu_q, cu_k = (np.concatenate([x, np.full(cap_b + 1 - len(x), x[-1])]).astype(np.int32)
                      for x in (cumulative(queries), cumulative(keys)))
        out = fn(q, k, v, cu_q, cu_k)
        t = cu_q[-1]
        np.testing.assert_allclose(out[:t], reference(q[:t], k, v, cu_q, cu_k)[:t], atol=2e-6)
        assert np.isnan(out[t:]).all()
    assert fn.cache_info().compiles == 1


def test_batches_of_any_total_compile_once_per_class_of_the_totals():
    """T and N (the packed queries and keys) taken at run time: the view of the rows by KV head
    (`q.reshape(t, hk, h // hk, d)`) keeps T whole, so a serving loop whose totals change every
    batch compiles once per class of them (`tessera.dims.CLASSES`), not once per batch."""
    fn = tsr.function(varlen_attention.fn, dynamic=["T", "N"])
    rng = np.random.default_rng(12)
    batches = [([5, 17, 1, 40], [5, 17, 1, 40]), ([3, 30, 1, 2], [30, 90, 2, 2]), ([41, 1, 1, 16], [41, 9, 1, 60]),
               ([1, 1, 1, 1], [100, 3, 50, 64]), ([2, 3, 2, 1], [2, 3, 2, 1]), ([9, 9, 9, 9], [9, 19, 29, 39]),
               ([64, 64, 0, 0], [64, 64, 0, 0]), ([100, 1, 20, 7], [128, 1, 20, 107])]   # (totals of 128 and 256)
    for queries, keys in batches:
        args = inputs(rng, queries, keys, 4, 2, 32)
        np.testing.assert_allclose(fn(*args), reference(*args), atol=2e-6)
    info = fn.cache_info()
    assert info.fixed == {} and set(info.dynamic) == {"T", "N"}
    # (the key loop's blocks are whole for a multiple of 128 keys: N's multiples compile apart, T's not)
    classes = {(tsr.dims.class_of(sum(q), aligned=False), tsr.dims.class_of(sum(k))) for q, k in batches}
    assert info.compiles == len(classes) < len(batches)
    assert {(key["T"], key["N"]) for key in info.keys} == classes
    assert ("dynamic<=128", "dynamic<=128%128") in classes and fn.specialization.unaligned == {"T"}


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_the_generic_varlen_kernels_assemble(arch):
    fn = tsr.function(varlen_attention.fn, dynamic=["T", "N"])
    c = fn.compile(fn.arg_specs_for(DIMS, "bf16"), dynamic=frozenset({"T", "N"}), arch=arch, sm_count=132)
    kernels = emit_module(c.modules["target"])
    assert any("flash_attention" in name for name in kernels)
    for kernel in kernels.values():
        assemble(kernel.ptx, arch)


def test_a_reshape_keeps_a_dynamic_dim_whole_or_asks_for_its_value():
    """The static dims between dynamic ones regroup freely; merging a dynamic dim with another
    needs its value (the dim is then compiled as a constant, and `cache_info` says why)."""
    @tsr.function(dynamic=["T"])
    def split_heads(x: Tensor["T", "H", "D"]):
        return x.reshape(x.shape[0], 2, -1, x.shape[2]) * 2.0

    @tsr.function(dynamic=["T"])
    def flatten(x: Tensor["T", "H", "D"]):
        return x.reshape(-1, x.shape[1] * x.shape[2]).reshape(-1) + 1.0

    x = np.random.default_rng(3).standard_normal((37, 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(split_heads(x), x.reshape(37, 2, 3, 5) * 2.0)
    np.testing.assert_array_equal(flatten(x), x.reshape(-1) + 1.0)
    assert split_heads.cache_info().fixed == {} and split_heads.cache_info().keys[0]["T"] == "dynamic<=64"
    assert "T" in flatten.cache_info().fixed and "reshape" in flatten.cache_info().fixed["T"]


def test_a_reshape_moving_static_dims_across_a_dynamic_one_fixes_it_and_a_wrong_one_is_an_error():
    """[T, C, D] viewed as [C, T, D] holds for every T but needs its value: the dim becomes a
    constant (a second length, which made T dynamic, still runs); a view no T makes hold is a
    ShapeError naming the tensor and the counts."""
    @tsr.function
    def heads_first(x: Tensor["T", "C", "D"]):
        return x.reshape(x.shape[1], x.shape[0], x.shape[2]) + 1.0

    @tsr.function(dynamic=["T"])
    def wrong(x: Tensor["T", "C"]):
        return x.reshape(x.shape[0], 3) + 1.0

    rng = np.random.default_rng(4)
    for t in (37, 40):
        x = rng.standard_normal((t, 2, 4)).astype(np.float32)
        np.testing.assert_array_equal(heads_first(x), x.reshape(2, t, 4) + 1.0)
    assert "moves or merges it" in heads_first.cache_info().fixed["T"]
    with pytest.raises(ShapeError, match=r"cannot view x \[T=\?, C=4\] as \[T=\?, 3\]: its static dims hold 4 "
                                         r"elements for each value of T, the new shape's 3"):
        wrong(np.zeros((5, 4), np.float32))


def test_the_backwards_chain_kernels_ask_for_what_shared_memory_holds_where_registers_allow():
    """The attention backward's dK/dV kernel at D=64 (tiles of 128 registers a thread: 3 blocks, 4 by
    shared memory) and dQ (96: 4); at D=128 shared memory holds 2, which registers allow."""
    for d, wanted in ((64, [4, 3]), (128, [2, 2])):
        features = {"wgmma": 1, "head_dim": d, "row_tiles": 2, "streamed_tiles": 2, "element_bytes": 2}
        params = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
        planner = type("P", (), {"platform": platforms.get("sm_90a")})()
        got = [fusion._occupancy("flash_chain", planner, params, {**features, "sink_columns": columns}).get("occupancy")
               for columns in (d, 2 * d)]   # dQ's one sink, dK's and dV's two
        assert got == wanted, (d, got)


@pytest.mark.parametrize("kind,asked", [("causal", True), ("plain", False)])
def test_only_chain_kernels_of_uneven_blocks_ask_for_more(kind, asked):
    """A one-sided mask (causal) makes a backward's blocks uneven, and a third block an SM fills
    the slots short ones leave (+5% at D=64); unmasked, the squeeze only costs."""
    from attention_cases import FUNCTIONS
    from tessera.autodiff.api import _vjp_function, saving
    f = FUNCTIONS[kind]
    q = np.zeros((2, 4, 512, 64), np.float16)
    forward = saving(f)
    positions = forward.layout(*f._split_args([q, q, q]))[1]
    outs = forward.compile(forward.arg_specs([("q", q), ("k", q), ("v", q)])[1], arch="sm_90a",
                           sm_count=132).host_function().function_type.inputs.data[3:]
    saved = [np.zeros(tuple(outs[i].get_shape()), np.float32 if "f32" in str(outs[i]) else np.float16)
             for i in positions]
    backward = _vjp_function(f, (0,), len(saved))
    specs = backward.arg_specs(list(zip(backward.signature.parameters, [q, q, q, *saved, q])))[1]
    schedule = backward.compile(specs, arch="sm_90a", sm_count=132).ir("schedule")
    chains = [line for line in schedule.splitlines() if '"flash_chain"' in line and "params" in line]
    assert chains and all(("occupancy = " in line) == asked for line in chains)
