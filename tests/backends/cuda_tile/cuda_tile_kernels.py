"""Hand-built cuda_tile kernels the backend tests share: each returns a Module with one entry."""
from tessera.backends.cuda_tile.ir import (BF16, F16, F32, I32, Bounded, DivBy, EntryHints, LoadStoreHints, Module,
                                           TensorViewType, ptr, tile)


def elementwise_exp_scale(n_tile: int = 256) -> Module:
    """y = exp(x) * 2 over a 1-D f32 array of dynamic length, one tile per block; the tail tile loads
    zero padding past the end and its out-of-bounds stores are dropped."""
    m = Module("elementwise")
    e, b = m.entry("exp_scale", [tile(ptr(F32)), tile(ptr(F32)), tile(I32)], ["x", "y", "n"],
                   hints={"sm_90": EntryHints(num_cta_in_cga=1, occupancy=2)})
    x, y, n = e.args
    bid, _, _ = b.get_tile_block_id()
    x, y = b.assume(x, DivBy(16)), b.assume(y, DivBy(16))
    n = b.assume(n, Bounded(0, None))
    view = TensorViewType(F32, (None,), (1,))
    xs = b.make_partition_view(b.make_tensor_view(x, view, [n]), (n_tile,), padding="zero")
    ys = b.make_partition_view(b.make_tensor_view(y, view, [n]), (n_tile,))
    t, tok = b.load_view_tko(xs, [bid], hints={"sm_90": LoadStoreHints(latency=3)})
    r = b.mulf(b.exp(t), b.constant(2.0, tile(F32, n_tile)))
    b.store_view_tko(r, ys, [bid], token=tok)
    b.return_()
    return m


def row_softmax(cols: int = 4097, tile_cols: int = 8192) -> Module:
    """softmax over each row of a [rows, cols] f16 array: one [1, tile_cols] tile per block, padded with
    -inf so the padding adds exp(-inf) = 0 to the sum; max and sum are `reduce`s, math in f32."""
    m = Module("softmax")
    e, b = m.entry("row_softmax", [tile(ptr(F16)), tile(ptr(F16)), tile(I32)], ["x", "y", "rows"])
    x, y, rows = e.args
    bid, _, _ = b.get_tile_block_id()
    view = TensorViewType(F16, (None, cols), (cols, 1))
    xs = b.make_partition_view(b.make_tensor_view(x, view, [rows]), (1, tile_cols), padding="neg_inf")
    ys = b.make_partition_view(b.make_tensor_view(y, view, [rows]), (1, tile_cols))
    zero = b.constant(0, tile(I32))
    t, tok = b.load_view_tko(xs, [bid, zero])
    t = b.ftof(t, F32)
    with b.reduce(t, 1, [float("-inf")]) as r:
        acc, elem = r.args
        b.yield_([b.maxf(acc, elem)])
    row_max = b.broadcast(b.reshape(r.results[0], (1, 1)), (1, tile_cols))
    p = b.exp(b.subf(t, row_max))
    with b.reduce(p, 1, [0.0]) as s:
        acc, elem = s.args
        b.yield_([b.addf(acc, elem)])
    total = b.broadcast(b.reshape(s.results[0], (1, 1)), (1, tile_cols))
    out = b.ftof(b.divf(p, total), F16)
    b.store_view_tko(out, ys, [bid, zero], token=tok)
    b.return_()
    return m


def gemm_bf16(bm: int = 128, bn: int = 128, bk: int = 64) -> Module:
    """C[M,N] (bf16) = A[M,K] @ B[K,N] (bf16) with an f32 accumulator carried through a `for` over K
    tiles (`mmaf`); K tails load zero padding, so any K works."""
    m = Module("gemm")
    e, b = m.entry("gemm_bf16", [tile(ptr(BF16))] * 3 + [tile(I32)] * 3, ["a", "b", "c", "M", "N", "K"])
    a, bb, c, M, N, K = e.args
    a, bb, c = (b.assume(p, DivBy(16)) for p in (a, bb, c))
    K8, N8 = b.assume(K, DivBy(8)), b.assume(N, DivBy(8))
    bx, by, _ = b.get_tile_block_id()
    view = TensorViewType(BF16, (None, None), (None, 1))
    av = b.make_partition_view(b.make_tensor_view(a, view, [M, K8], [K8]), (bm, bk), padding="zero")
    bv = b.make_partition_view(b.make_tensor_view(bb, view, [K8, N8], [N8]), (bk, bn), padding="zero")
    cv = b.make_partition_view(b.make_tensor_view(c, view, [M, N8], [N8]), (bm, bn))
    zero, one = b.constant(0, tile(I32)), b.constant(1, tile(I32))
    k_tiles = b.divi(K, b.constant(bk, tile(I32)), rounding="positive_inf")
    with b.for_(zero, k_tiles, one, [b.constant(0.0, tile(F32, bm, bn))]) as loop:
        ta, _ = b.load_view_tko(av, [bx, loop.iv])
        tb, _ = b.load_view_tko(bv, [loop.iv, by])
        b.continue_([b.mmaf(ta, tb, loop.iter_values[0])])
    b.store_view_tko(b.ftof(loop.results[0], BF16), cv, [bx, by])
    b.return_()
    return m


def masked_gather(n_tile: int = 128) -> Module:
    """y[i] = x[idx[i]] (+1 in block 0, through an `if` with a result) for i < n: pointer arithmetic
    with `offset`, a masked `load_ptr_tko` gather with zero padding and a masked `store_ptr_tko`."""
    m = Module("gather")
    e, b = m.entry("gather", [tile(ptr(F32)), tile(ptr(I32)), tile(ptr(F32)), tile(I32)], ["x", "idx", "y", "n"])
    x, idx, y, n = e.args
    bid, _, _ = b.get_tile_block_id()

    def splat(v, shape):
        return b.broadcast(b.reshape(v, (1,) * len(shape)), shape)

    i = b.addi(b.iota(n_tile), splat(b.muli(bid, b.constant(n_tile, tile(I32))), (n_tile,)))
    mask = b.cmpi("less_than", i, splat(n, (n_tile,)))
    j, tok = b.load_ptr_tko(b.offset(splat(idx, (n_tile,)), i), mask, b.constant(0, tile(I32, n_tile)))
    g, tok = b.load_ptr_tko(b.offset(splat(x, (n_tile,)), j), mask, b.constant(0.0, tile(F32, n_tile)), token=tok)
    first = b.cmpi("equal", bid, b.constant(0, tile(I32)))
    with b.if_(first, [tile(F32, n_tile)]) as branch:
        with branch.then():
            b.yield_([b.addf(g, b.constant(1.0, tile(F32, n_tile)))])
        with branch.else_():
            b.yield_([g])
    b.store_ptr_tko(b.offset(splat(y, (n_tile,)), i), branch.results[0], mask, token=tok)
    b.return_()
    return m


ALL = {"elementwise": elementwise_exp_scale, "softmax": row_softmax, "gemm": gemm_bf16, "gather": masked_gather}
