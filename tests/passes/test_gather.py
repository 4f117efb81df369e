"""Gathers (`x[index]`, graph.gather) and paged KV attention, on the CPU interpreter against float64.

A gather anywhere is an elementwise kernel reading one row per program; a gather whose pages are
merged into the keys or values of an attention (examples/paged_attention.py) is read page by page
inside the attention's key loop, through the block table, with no gathered copy. Indices outside
the table read zeros everywhere."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import TesseraError
from tessera.interpreter import reference
from tessera import platforms
from tessera.passes import backend_choice
from tessera.runtime.ptxas import assemble, find_tool
from tessera.backends.ptx import emit_module
from paged_attention import paged_decode_attention, paged_prefill_attention

needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")


def rows_of(w: np.ndarray, index: np.ndarray) -> np.ndarray:
    inside = (index >= 0) & (index < w.shape[0])
    picked = w.astype(np.float64)[np.clip(index, 0, max(w.shape[0] - 1, 0))] if w.shape[0] else \
        np.zeros((*index.shape, *w.shape[1:]))
    return np.where(inside.reshape(*index.shape, *[1] * (w.ndim - 1)), picked, 0.0)


@tsr.function
def embed(w: Tensor["V", "D"], ids: Tensor["T", tsr.int32]):
    return w[ids] * 2.0


@tsr.function
def embed_2d(w: Tensor["V", "C", "D"], ids: Tensor["B", "T", tsr.int32]):
    return tsr.exp(w)[ids]                      # the rows of a computed tensor


@tsr.function
def lookup(w: Tensor["V"], ids: Tensor["B", "T", tsr.int32]):
    return w[ids, ...] + 1.0                      # a row is one element


@tsr.function
def lookup_transposed(w: Tensor["V", "D"], ids: Tensor["T", "B", tsr.int32]):
    return w[ids.transpose(0, 1)].transpose(0, 2)   # an index read through a view; the rows transposed


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("v,d,t", [(10, 37, 5), (1, 1, 1), (7, 130, 0), (1000, 3, 17)])
def test_embedding_rows_with_indices_outside(dtype, v, d, t):
    rng = np.random.default_rng(v + d + t)
    w = rng.standard_normal((v, d)).astype(tsr.dtypes.lookup(dtype).np)
    ids = rng.integers(-2, v + 2, t).astype(np.int32)
    out = np.asarray(embed(w, ids), np.float64)
    np.testing.assert_allclose(out, rows_of(w, ids) * 2.0, rtol=1e-2 if dtype != "fp32" else 1e-6)


def test_gathers_of_other_ranks_and_views():
    rng = np.random.default_rng(1)
    w3 = rng.standard_normal((6, 3, 17)).astype(np.float32)
    ids = rng.integers(-1, 8, (2, 5)).astype(np.int32)
    np.testing.assert_allclose(embed_2d(w3, ids), np.where(rows_of(w3, ids) != 0, np.exp(rows_of(w3, ids)), 0.0)
                               * ((ids >= 0) & (ids < 6))[..., None, None], rtol=1e-6)
    w1 = rng.standard_normal(9).astype(np.float32)
    np.testing.assert_allclose(lookup(w1, ids), rows_of(w1, ids) + 1.0, rtol=1e-6)
    w2 = rng.standard_normal((9, 11)).astype(np.float32)
    ids_tb = rng.integers(0, 9, (4, 3)).astype(np.int32)
    np.testing.assert_allclose(lookup_transposed(w2, ids_tb), rows_of(w2, ids_tb.T).transpose(2, 1, 0), rtol=1e-6)


def test_the_reference_reads_zeros_outside():
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    specs = embed.arg_specs([("w", w), ("ids", np.array([2, -1, 3], np.int32))])[1]
    (out,) = reference.run_graph(embed.trace(specs).ops.first, [w, np.array([2, -1, 3], np.int32)])
    np.testing.assert_array_equal(out, [[8, 10], [0, 0], [0, 0]])


def test_a_gather_kernel_takes_a_row_a_program():
    """The token dim is one element a tile (each is its own row), and no tuning moves it."""
    compiled = embed.compile(embed.arg_specs_for(dict(V=50000, D=4096, T=64), "bf16"))
    (line,) = [line for line in compiled.ir("schedule").splitlines() if "schedule.kernel" in line]
    assert "block_m = 1 : i64, block_n = 128" in line and "block_m = [1 : i64]" in line, line
    assert "tile.load_index" in compiled.ir("tile")


@pytest.mark.parametrize("index,message", [
    (lambda x, i: x[i.to(tsr.fp32)], "the index must be int32, got fp32"),
    (lambda x, i: x[i > 0], "a bool mask selects a data-dependent number of rows"),
    (lambda x, i: x[:, i], "along the first dim only"),
    (lambda x, i: x[i, 0], "only ':' and '...' may follow the index"),
])
def test_unsupported_indexing_is_refused_clearly(index, message):
    @tsr.function
    def f(x: Tensor["N", "D"], i: Tensor["N", tsr.int32]):
        return index(x, i)
    with pytest.raises(TesseraError, match=message):
        f(np.ones((4, 4), np.float32), np.zeros(4, np.int32))


def test_the_gradient_of_a_gather_is_refused_clearly():
    @tsr.function
    def loss(w: Tensor["V", "D"], ids: Tensor["T", tsr.int32]):
        return tsr.sum(w[ids])
    with pytest.raises(TesseraError, match=r"gradient of x\[index\] \(a gather\) with respect to x is a scatter-add"):
        tsr.grad(loss)(np.ones((4, 3), np.float32), np.zeros(2, np.int32))


def test_the_cuda_tile_backend_passes_gathers_to_ptx():
    facts = backend_choice.KernelFacts("elementwise", dtypes=frozenset({"bf16"}), target=platforms.get("sm_90a"),
                                       reads_indices=True)
    assert "a gather" in backend_choice.cannot_compile("cuda-tile", facts)


# --- paged KV attention ----------------------------------------------------------------------------

def paged_case(rng, b, hk, g, m, d, pages, page, j, lengths):
    q = rng.standard_normal((b, hk, g, m, d)).astype(np.float32)
    k_cache = rng.standard_normal((pages, page, hk, d)).astype(np.float32)
    v_cache = rng.standard_normal((pages, page, hk, d)).astype(np.float32)
    table = rng.permutation(pages)[:b * j].reshape(b, j).astype(np.int32) if pages >= b * j else \
        rng.integers(0, pages, (b, j)).astype(np.int32)
    for row, n in enumerate(lengths):   # entries past a sequence's pages: -1, or garbage past the cache
        table[row, math.ceil(n / page):] = -1 if row % 2 == 0 else pages + 7
    return q, k_cache, v_cache, table, np.array(lengths, np.int32)


def decode_reference(q, k_cache, v_cache, table, lengths):
    b, hk, g, m, d = q.shape
    out = np.zeros(q.shape)
    for i in range(b):
        k = rows_of(k_cache, table[i]).reshape(-1, hk, d)
        v = rows_of(v_cache, table[i]).reshape(-1, hk, d)
        n = k.shape[0]
        rows = np.arange(m)[:, None] + (lengths[i] - m)
        keep = (np.arange(n)[None, :] <= rows) & (np.arange(n)[None, :] < lengths[i])
        for h in range(hk):
            s = np.einsum("gmd,nd->gmn", q[i, h].astype(np.float64), k[:, h]) / math.sqrt(d)
            s = np.where(keep, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h]
    return out


@pytest.mark.parametrize("b,hk,g,m,d,pages,page,j,lengths", [
    (2, 2, 3, 2, 64, 9, 32, 3, [91, 57]),        # GQA, merged rows, a partly filled last page
    (1, 1, 1, 1, 64, 3, 16, 3, [1]),             # one key
    (3, 2, 1, 4, 32, 12, 16, 4, [17, 64, 40]),    # MHA, a page and a key
    (1, 2, 2, 1, 64, 40, 64, 4, [200]),           # pages not in the table
])
def test_paged_decode_against_float64(b, hk, g, m, d, pages, page, j, lengths):
    rng = np.random.default_rng(sum(lengths))
    case = paged_case(rng, b, hk, g, m, d, pages, page, j, lengths)
    out = paged_decode_attention(*case)
    np.testing.assert_allclose(out, decode_reference(*case), atol=2e-6)


def test_paged_prefill_against_float64():
    rng = np.random.default_rng(3)
    b, h, s, d, pages, page = 1, 2, 40, 32, 5, 16
    q = rng.standard_normal((b, h, s, d)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((pages, page, h, d)).astype(np.float32) for _ in range(2))
    table = np.array([[4, 0, 2]], np.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, table)
    k, v = (rows_of(c, table[0]).reshape(-1, h, d).transpose(1, 0, 2) for c in (k_cache, v_cache))
    n = k.shape[1]
    scores = np.einsum("hsd,hnd->hsn", q[0].astype(np.float64), k) / math.sqrt(d)
    scores = np.where(np.arange(n)[None, :] <= np.arange(s)[:, None] + (n - s), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(out[0], (p / p.sum(-1, keepdims=True)) @ v, atol=2e-6)


def paged_compile(dims, arch="sm_90a", **options):
    return paged_decode_attention.compile(paged_decode_attention.arg_specs_for(dims, "bf16"), arch=arch, **options)


DIMS = dict(B=4, Hk=8, G=4, M=1, P=512, PAGE=64, D=128, J=32)


def test_the_attention_reads_the_cache_through_the_table():
    compiled = paged_compile(DIMS)
    assert all("flash_attention" in k for k in compiled.kernel_names), compiled.kernel_names
    tile_ir = compiled.ir("tile")
    assert "tile.load_index" in tile_ir
    assert "memref<512x64x8x128xbf16>" in tile_ir     # the cache itself, never a gathered copy


@pytest.mark.parametrize("page,block_n,copies", [(16, 64, 4), (32, 64, 2), (64, 64, 1), (48, 16, 1),
                                                  (256, 64, 1)])
def test_key_blocks_span_whole_pages_or_part_of_one(page, block_n, copies):
    """A key block of the default's 64 keys reads whole pages, a copy each (into its rows of the
    stage), or part of one; a page of 48 keys takes 16-key blocks."""
    compiled = paged_compile({**DIMS, "PAGE": page, "P": 4096 // page * 4, "J": 4096 // page})
    assert f"block_n = {block_n}" in compiled.ir("schedule")
    tile_ir = compiled.ir("tile")
    if copies == 1:
        assert "dst_rows" not in tile_ir
    else:
        assert all(f"dst_rows = array<i64: {j * page}, {page}>" in tile_ir for j in range(copies))


def test_a_pinned_key_block_across_part_of_a_page_is_refused():
    with pytest.raises(TesseraError, match="block_n=64 neither divides the KV cache's pages of 48 keys nor spans"):
        paged_compile({**DIMS, "PAGE": 48, "P": 512, "J": 32}, space={"block_n": [64]})


def test_pages_of_another_size_are_gathered_first():
    """A page of 24 keys fits no key block: a gather kernel writes the pages out, the attention reads
    them, and the result is the same."""
    rng = np.random.default_rng(5)
    case = paged_case(rng, 1, 2, 2, 1, 32, 4, 24, 3, [60])
    assert len(paged_decode_attention.compile(paged_decode_attention.arg_specs(
        list(zip(("q", "k_cache", "v_cache", "table", "lengths"), case)))[1]).kernel_names) >= 3
    np.testing.assert_allclose(paged_decode_attention(*case), decode_reference(*case), atol=2e-6)


@needs_ptxas
@pytest.mark.parametrize("queries", [1, 4, 16])
@pytest.mark.parametrize("arch,path", [("sm_90a", "native"), ("sm_90a", "ampere"), ("sm_80", "ampere")])
def test_paged_kernels_assemble(arch, path, queries):
    """Every paged kernel, the async checker running each block with the lengths and pages it
    samples (conftest turns it on), then ptxas."""
    for compiled in (paged_compile({**DIMS, "M": queries}, arch=arch, path=path),
                     paged_prefill_attention.compile(paged_prefill_attention.arg_specs_for(
                         dict(B=2, H=16, S=2048, P=512, PAGE=128, D=128, J=16), "bf16"), arch=arch, path=path),
                     embed.compile(embed.arg_specs_for(dict(V=50000, D=4096, T=64), "bf16"), arch=arch, path=path)):
        kernels = emit_module(compiled.modules["target"])
        assert any("ld.global.nc.s32" in kernel.ptx for kernel in kernels.values())   # the table's reads
        for kernel in kernels.values():
            assemble(kernel.ptx, arch)


# --- what a review found ---------------------------------------------------------------------------

@tsr.function
def values_paged_on_their_columns(q: Tensor["H", "M", "D"], k: Tensor["H", "N", "D"],
                                  v_cache: Tensor["P", "PAGE", "H", "N"], table: Tensor["J", tsr.int32]):
    """V's pages merged into its value dim (E), not the keys: read as a gathered copy."""
    h, n = k.shape[0], k.shape[1]
    v = v_cache[table].reshape(table.shape[0] * v_cache.shape[1], h, n).transpose(0, 1).transpose(1, 2)
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


def test_pages_merged_along_another_axis_than_the_keys_are_gathered_first():
    rng = np.random.default_rng(11)
    q, k = rng.standard_normal((2, 5, 32)).astype(np.float32), rng.standard_normal((2, 48, 32)).astype(np.float32)
    v_cache, table = rng.standard_normal((6, 16, 2, 48)).astype(np.float32), np.array([3, 0, 5, 1], np.int32)
    fn = values_paged_on_their_columns
    specs = fn.arg_specs([("q", q), ("k", k), ("v_cache", v_cache), ("table", table)])[1]
    assert any("elementwise" in name for name in fn.compile(specs).kernel_names)
    v = rows_of(v_cache, table).reshape(64, 2, 48).transpose(1, 2, 0)
    s = np.einsum("hmd,hnd->hmn", q.astype(np.float64), k) / math.sqrt(32)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(fn(q, k, v_cache, table), (p / p.sum(-1, keepdims=True)) @ v, atol=1e-6)


@tsr.function
def gathered_then_concatenated(w: Tensor["V", "D"], ids: Tensor["T", tsr.int32], x: Tensor["S", "D"]):
    return tsr.cat([w[ids], x], 0)


def test_a_gather_read_in_a_shifted_context_stays_inside_its_index():
    """cat reads every input at every row: the index's offsets are clamped into it (the GPU would
    read past its end), and the rows past it are the other input's."""
    rng = np.random.default_rng(12)
    w, x = rng.standard_normal((9, 37)).astype(np.float32), rng.standard_normal((4, 37)).astype(np.float32)
    ids = np.array([8, -1, 0, 3, 9, 2], np.int32)
    np.testing.assert_allclose(gathered_then_concatenated(w, ids, x), np.concatenate([rows_of(w, ids), x]), rtol=1e-6)


@tsr.function
def scaled_by_gathered_scalars(x: Tensor["T", "D"], s: Tensor["V"], ids: Tensor["T", tsr.int32]):
    return tsr.softmax(x, dim=-1) * s[ids][:, None]


@tsr.function
def rows_in_order(w: Tensor["V", "D"]):
    return w[tsr.arange(w.shape[0] - 1) + 1]


def test_gathers_of_rank_one_tensors_and_by_aranges():
    rng = np.random.default_rng(13)
    x, s = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    ids = np.array([3, 0, -2, 1, 4], np.int32)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(scaled_by_gathered_scalars(x, s, ids),
                               e / e.sum(-1, keepdims=True) * rows_of(s, ids)[:, None], rtol=1e-5)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    np.testing.assert_allclose(rows_in_order(w), w[1:], rtol=1e-6)


@tsr.function
def scalars_by_index(s: Tensor["V"], ids: Tensor["B", "T", tsr.int32]):
    return s[ids + 1] * 2.0


@pytest.mark.parametrize("b,t", [(3, 77), (1, 1), (2, 1000)])
def test_rows_of_one_element_are_read_an_element_a_row(b, t):
    """A gather of scalars tiles its index like any elementwise kernel (tile.load_gather), rather
    than one program an element; indices outside read zeros, and computed ones are fine."""
    rng = np.random.default_rng(t)
    s = rng.standard_normal(50).astype(np.float32)
    ids = rng.integers(-3, 53, (b, t)).astype(np.int32)
    c = scalars_by_index.compile(scalars_by_index.arg_specs([("s", s), ("ids", ids)])[1])
    if t > 1:   # (a tile of one element reads its one row as an index)
        assert "tile.load_gather" in c.ir("tile") and "block_n = 1 " not in c.ir("schedule")
    np.testing.assert_allclose(c.run(s, ids)[0], rows_of(s, ids + 1) * 2.0, rtol=1e-6)


def test_a_length_read_per_program_is_clamped_before_the_index_arithmetic():
    """A length of 2^31 - 1 ("all of it") must not wrap the 32-bit index sums on the GPU: the value
    is clamped to just past the keys first (what the interpreter's 64-bit indices cannot show)."""
    tile_ir = paged_compile({**DIMS, "M": 4}).ir("tile")
    assert tile_ir.count("arith.minsi") >= 2 and tile_ir.count("arith.maxsi") >= 2
    rng = np.random.default_rng(14)
    case = paged_case(rng, 1, 2, 2, 3, 32, 4, 16, 4, [64])
    q, k_cache, v_cache, table, _ = case
    huge = np.array([2 ** 31 - 1], np.int32)
    np.testing.assert_allclose(paged_decode_attention(q, k_cache, v_cache, table, huge),
                               decode_reference(q, k_cache, v_cache, table, huge.astype(np.int64)), atol=2e-6)


@tsr.function
def keys_and_values_of_other_pages(q: Tensor["H", "M", "D"], k_cache: Tensor["PK", "PAGEK", "H", "D"],
                                   v_cache: Tensor["PV", "PAGEV", "H", "D"], kt: Tensor["JK", tsr.int32],
                                   vt: Tensor["JV", tsr.int32]):
    h, m, d = q.shape
    k = k_cache[kt].reshape(kt.shape[0] * k_cache.shape[1], h, d).transpose(0, 1)
    v = v_cache[vt].reshape(vt.shape[0] * v_cache.shape[1], h, d).transpose(0, 1)
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@pytest.mark.parametrize("k_page,v_page,n,block_n", [(96, 64, 192, 32), (48, 16, 96, 16), (32, 48, 96, 16),
                                                     (32, 16, 256, 64)])
def test_keys_and_values_in_pages_of_different_sizes(k_page, v_page, n, block_n):
    """A key block fits every cache's pages (each a multiple of it, or it of each): a block that
    straddled two of K's pages read padding past the first."""
    rng = np.random.default_rng(k_page + v_page)
    h, m, d = 2, 3, 64
    q = rng.standard_normal((h, m, d)).astype(np.float32)
    k_cache = rng.standard_normal((n // k_page + 2, k_page, h, d)).astype(np.float32)
    v_cache = rng.standard_normal((n // v_page + 2, v_page, h, d)).astype(np.float32)
    kt = rng.permutation(n // k_page + 2)[:n // k_page].astype(np.int32)
    vt = rng.permutation(n // v_page + 2)[:n // v_page].astype(np.int32)
    fn = keys_and_values_of_other_pages
    args = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kt", kt), ("vt", vt)]
    compiled = fn.compile(fn.arg_specs(args)[1])
    assert f"block_n = {block_n}" in compiled.ir("schedule")
    k, v = (rows_of(c, t).reshape(n, h, d).transpose(1, 0, 2) for c, t in ((k_cache, kt), (v_cache, vt)))
    s = np.einsum("hmd,hnd->hmn", q.astype(np.float64), k) / math.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(compiled.run(q, k_cache, v_cache, kt, vt)[0], (p / p.sum(-1, keepdims=True)) @ v,
                               atol=2e-6)


def test_a_pinned_key_block_must_fit_every_caches_pages():
    fn = keys_and_values_of_other_pages
    specs = fn.arg_specs_for(dict(H=2, M=3, D=64, PK=4, PAGEK=48, PV=8, PAGEV=16, JK=2, JV=6), "fp32")
    with pytest.raises(TesseraError, match="block_n=32 neither divides the KV cache's pages of 16, 48 keys"):
        fn.compile(specs, space={"block_n": [32]})


@pytest.mark.parametrize("page", [16, 64])
def test_the_cuda_tile_backend_forced_on_a_paged_attention_says_why_not(page):
    specs = paged_decode_attention.arg_specs_for(dict(B=2, Hk=2, G=4, M=1, P=64, PAGE=page, D=64, J=8), "bf16")
    with pytest.raises(TesseraError, match="tile.load_index|backend='ptx'"):
        paged_decode_attention.compile(specs, arch="sm_90a", backend="cuda-tile").stage("cubin")
