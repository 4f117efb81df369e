"""The lowering's cuda_tile programs run on the CPU (tessera.backends.cuda_tile.interp): every case of
cuda_tile_cases against the float64 reference and Tessera's own tile interpreter on the same Tile IR,
and small programs that pin down the interpreter's semantics (partition-view tails, masked gathers,
integer division rounding, undefined accesses and races)."""
import math

import cuda_tile_cases
import cuda_tile_kernels
import ml_dtypes
import numpy as np
import pytest

from tessera.backends.cuda_tile import interp
from tessera.backends.cuda_tile.ir import BF16, F32, I32, Module, TensorViewType, ptr, tile

#: case id -> why the lowering gets it wrong (xfail, strict): none known
LOWERING_BUGS: dict[str, str] = {}

#: the cuda_tile program against Tessera's tile interpreter on the same Tile IR (same math, f32
#: accumulation; only op order and the erf/exp formulations differ)
AGREEMENT = {"fp16": 2e-3, "bf16": 1e-2}


def _params():
    for case_id in cuda_tile_cases.CASES:
        marks = [pytest.mark.xfail(strict=True, reason=LOWERING_BUGS[case_id])] if case_id in LOWERING_BUGS else []
        yield pytest.param(case_id, marks=marks, id=case_id)


@pytest.mark.parametrize("case_id", list(_params()))
def test_case_matches_reference_and_tile_interpreter(case_id):
    case = cuda_tile_cases.CASES[case_id]
    compiled = case.fn.compile(case.specs(), backend="cuda-tile")
    kernels = compiled.stage("cuda_tile")
    inputs = [cuda_tile_cases.as_dtype(x, case.dtype) for x in case.inputs()]
    got = interp.run_kernels(kernels, compiled.stage("tile"), *cuda_tile_cases.laid_out(case, inputs))
    want = compiled.reference(*inputs)
    tile_interp = compiled.run(*cuda_tile_cases.laid_out(case, inputs))
    assert len(got) == len(want) == len(tile_interp)
    for i, (g, w, t) in enumerate(zip(got, want, tile_interp)):
        assert g.shape == t.shape and g.dtype == t.dtype, i
        assert not np.isnan(g.astype(np.float32)).any(), f"output {i} has unwritten (NaN) elements"
        err = cuda_tile_cases.relative_error(g, w)
        assert err < cuda_tile_cases.tolerance(case.dtype), f"output {i}: {err:.2e} against float64"
        err = cuda_tile_cases.relative_error(g, t)
        assert err < AGREEMENT[case.dtype], f"output {i}: {err:.2e} against the tile interpreter"


# -- semantics ---------------------------------------------------------------------------------------


def test_partition_view_tail_pads_and_drops_out_of_bounds_stores():
    """exp(x) * 2 over n = 300 elements in tiles of 256: the tail tile reads zero padding and its
    stores past n are dropped, even where the output buffer goes on (y has 512 elements)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(300).astype(np.float32)
    y = np.full(512, np.nan, np.float32)
    interp.run_entry(cuda_tile_kernels.elementwise_exp_scale().entries[0], (2, 1, 1), [x, y, 300])
    np.testing.assert_allclose(y[:300], np.exp(x) * 2, rtol=1e-6)
    assert np.isnan(y[300:]).all()


@pytest.mark.parametrize("padding,value", [("zero", 0.0), ("neg_inf", -math.inf), ("pos_inf", math.inf),
                                           ("nan", math.nan), ("neg_zero", -0.0), (None, math.nan)])
def test_partition_view_padding_values(padding, value):
    """A 5-element tensor loaded as one 8-element tile: elements 5..7 read the view's padding (an
    unspecified padding reads NaN: the program must not depend on it)."""
    m = Module()
    e, b = m.entry("pad", [tile(ptr(F32)), tile(ptr(F32))])
    src = b.make_partition_view(b.make_tensor_view(e.args[0], TensorViewType(F32, (5,), (1,))), (8,), padding)
    dst = b.make_partition_view(b.make_tensor_view(e.args[1], TensorViewType(F32, (8,), (1,))), (8,))
    zero = b.constant(0, tile(I32))
    t, _ = b.load_view_tko(src, [zero])
    b.store_view_tko(t, dst, [zero])
    b.return_()
    x = np.arange(1, 6, dtype=np.float32)
    y = np.zeros(8, np.float32)
    interp.run_entry(e, (1, 1, 1), [x, y])
    np.testing.assert_array_equal(y[:5], x)
    np.testing.assert_array_equal(y[5:], np.full(3, value, np.float32))
    assert np.signbit(y[5:]).all() == (padding in ("neg_inf", "neg_zero"))


def test_masked_gather_and_scatter():
    """y[i] = x[idx[i]] (+1 in block 0) for i < n: a masked gather through offset pointers, then a
    masked scatter; elements past n are neither read (idx has only n) nor written."""
    rng = np.random.default_rng(1)
    n = 200
    x = rng.standard_normal(37).astype(np.float32)
    idx = rng.integers(0, 37, n).astype(np.int32)
    y = np.full(256, np.nan, np.float32)
    interp.run_entry(cuda_tile_kernels.masked_gather().entries[0], (2, 1, 1), [x, idx, y, n])
    want = x[idx] + (np.arange(n) < 128)
    np.testing.assert_array_equal(y[:n], want.astype(np.float32))
    assert np.isnan(y[n:]).all()


def test_gather_outside_the_buffer_raises():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(37).astype(np.float32)
    idx = np.full(200, 37, np.int32)            # one past the end of x
    y = np.zeros(256, np.float32)
    with pytest.raises(interp.InterpError, match="load_ptr_tko at element 37 of a buffer of 37"):
        interp.run_entry(cuda_tile_kernels.masked_gather().entries[0], (2, 1, 1), [x, idx, y, 200])


def _int_program(fn) -> tuple:
    """An entry storing fn(builder, a, b) (a list of i32 [8] tiles) as rows of an i32 buffer."""
    a_vals = [-7, 7, -7, 7, -8, 8, 0, -1]
    b_vals = [2, 2, -2, -2, 4, -4, 3, 3]
    m = Module()
    e, b = m.entry("ints", [tile(ptr(I32))])
    a, bb = b.constant(a_vals, tile(I32, 8)), b.constant(b_vals, tile(I32, 8))
    rows = fn(b, a, bb)
    view = b.make_partition_view(b.make_tensor_view(e.args[0], TensorViewType(I32, (len(rows), 8), (8, 1))), (1, 8))
    bid, _, _ = b.get_tile_block_id()   # not constant: the divisions run at run time too
    zero = b.subi(bid, bid)
    for i, r in enumerate(rows):
        b.store_view_tko(b.reshape(b.addi(r, b.broadcast(b.reshape(zero, (1,)), (8,))), (1, 8)), view,
                         [b.constant(i, tile(I32)), zero])
    b.return_()
    out = np.zeros((len(rows), 8), np.int32)
    interp.run_entry(e, (1, 1, 1), [out])
    return np.array(a_vals), np.array(b_vals), out


def test_integer_division_rounding():
    a, b, out = _int_program(lambda bld, x, y: [bld.divi(x, y), bld.divi(x, y, rounding="negative_inf"),
                                                bld.divi(x, y, rounding="positive_inf"), bld.remi(x, y)])
    trunc = [int(p / q) for p, q in zip(a, b)]
    np.testing.assert_array_equal(out[0], trunc)
    np.testing.assert_array_equal(out[1], a // b)                                      # floor
    np.testing.assert_array_equal(out[2], [-((-p) // q) for p, q in zip(a, b)])        # ceil
    np.testing.assert_array_equal(out[3], [p - t * q for p, q, t in zip(a, b, trunc)])  # sign of the dividend
    assert list(out[1][:4]) == [-4, 3, 3, -4] and list(out[0][:4]) == [-3, 3, 3, -3]


def test_unsigned_integer_ops():
    a, b, out = _int_program(lambda bld, x, y: [bld.divi(x, y, signed=False), bld.maxi(x, y, signed=False),
                                                bld.shri(x, bld.constant(1, tile(I32, 8)), signed=False),
                                                bld.shri(x, bld.constant(1, tile(I32, 8)))])
    au, bu = a.astype(np.uint32), b.astype(np.uint32)
    np.testing.assert_array_equal(out[0].view(np.uint32), au // bu)
    np.testing.assert_array_equal(out[1].view(np.uint32), np.maximum(au, bu))
    np.testing.assert_array_equal(out[2].view(np.uint32), au >> 1)
    np.testing.assert_array_equal(out[3], a >> 1)


def _row_reduce(combine) -> np.ndarray:
    """Each row of a [4, 64] f32 tile reduced with the combiner `combine(builder, acc, elem)`."""
    m = Module()
    e, b = m.entry("reduce", [tile(ptr(F32)), tile(ptr(F32))])
    src = b.make_partition_view(b.make_tensor_view(e.args[0], TensorViewType(F32, (4, 64), (64, 1))), (4, 64))
    dst = b.make_partition_view(b.make_tensor_view(e.args[1], TensorViewType(F32, (4,), (1,))), (4,))
    zero = b.constant(0, tile(I32))
    x, _ = b.load_view_tko(src, [zero, zero])
    with b.reduce(x, 1, [0.0]) as r:
        acc, elem = r.args
        b.yield_([combine(b, acc, elem)])
    b.store_view_tko(r.results[0], dst, [zero])
    b.return_()
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    y = np.full(4, np.nan, np.float32)
    interp.run_entry(e, (1, 1, 1), [x, y])
    return x, y


def test_reduce_general_combiner_matches_fast_path():
    """A one-op combiner is one NumPy reduction; any other combiner runs the region as a tree."""
    x, fast = _row_reduce(lambda b, acc, elem: b.addf(acc, elem))
    _, tree = _row_reduce(lambda b, acc, elem: b.mulf(b.addf(acc, elem), b.constant(1.0, tile(F32))))
    np.testing.assert_allclose(fast, x.sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tree, x.sum(1), rtol=1e-5, atol=1e-5)


def test_gemm_loop_mmaf_and_scalar_arguments():
    """cuda_tile_kernels.gemm_bf16: a `for` carrying an f32 accumulator through `mmaf`, K tails
    zero-padded, dynamic shapes and strides from i32 arguments."""
    rng = np.random.default_rng(4)
    M, N, K = 130, 40, 72
    a = rng.standard_normal((M, K)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((K, N)).astype(ml_dtypes.bfloat16)
    c = np.full((M, N), np.nan, ml_dtypes.bfloat16)
    interp.run_entry(cuda_tile_kernels.gemm_bf16().entries[0], (2, 1, 1), [a, b, c, M, N, K])
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert cuda_tile_cases.relative_error(c, want) < 5e-3


def test_row_softmax_kernel():
    x = np.random.default_rng(5).standard_normal((3, 4097)).astype(np.float16)
    y = np.full((3, 4097), np.nan, np.float16)
    interp.run_entry(cuda_tile_kernels.row_softmax().entries[0], (3, 1, 1), [x, y, 3])
    e = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    assert cuda_tile_cases.relative_error(y, e / e.sum(1, keepdims=True)) < 2e-3


def _tile_store(index_of_block) -> Module:
    """Each block stores ones to the tile at index_of_block(builder, block id) of a 16-element view."""
    m = Module()
    e, b = m.entry("store", [tile(ptr(F32))])
    view = b.make_partition_view(b.make_tensor_view(e.args[0], TensorViewType(F32, (16,), (1,))), (8,))
    bid, _, _ = b.get_tile_block_id()
    b.store_view_tko(b.constant(1.0, tile(F32, 8)), view, [index_of_block(b, bid)])
    b.return_()
    return e


def test_index_outside_the_partition_view_raises():
    """Tile 2 of a 16-element view in tiles of 8 lies wholly outside: undefined in the dialect."""
    e = _tile_store(lambda b, bid: b.addi(bid, b.constant(1, tile(I32))))
    y = np.zeros(16, np.float32)
    with pytest.raises(interp.InterpError, match="outside its index space"):
        interp.run_entry(e, (2, 1, 1), [y])


def test_blocks_writing_one_element_race():
    e = _tile_store(lambda b, bid: b.divi(bid, b.constant(2, tile(I32))))   # blocks 0 and 1 both write tile 0
    with pytest.raises(interp.InterpError, match="race"):
        interp.run_entry(e, (2, 1, 1), [np.zeros(16, np.float32)])
    y = np.zeros(16, np.float32)
    interp.run_entry(_tile_store(lambda b, bid: bid), (2, 1, 1), [y])
    np.testing.assert_array_equal(y, np.ones(16, np.float32))


def test_float_semantics():
    """cmpf ordered/unordered on NaN, maxf with and without propagate_nan, ftof to bf16 rounding
    to nearest even, ftoi toward zero."""
    vals = [1.0, math.nan, -2.5, 3.0]
    other = [math.nan, math.nan, 2.5, 3.0]
    m = Module()
    e, b = m.entry("floats", [tile(ptr(F32))])
    x, y = b.constant(vals, tile(F32, 4)), b.constant(other, tile(F32, 4))
    one, zero = b.constant(1.0, tile(F32, 4)), b.constant(0.0, tile(F32, 4))
    as_float = lambda cond: b.select(cond, one, zero)  # noqa: E731
    rows = [as_float(b.cmpf("equal", x, y)), as_float(b.cmpf("equal", x, y, ordered=False)),
            as_float(b.cmpf("not_equal", x, y)), as_float(b.cmpf("not_equal", x, y, ordered=False)),
            b.maxf(x, y), b.maxf(x, y, propagate_nan=True),
            b.ftof(b.ftof(b.constant([1.00390625, 1.01171875, 3.0, -1.00390625], tile(F32, 4)), BF16), F32),
            b.itof(b.ftoi(b.constant([2.7, -2.7, 0.5, -0.5], tile(F32, 4)), I32), F32)]
    view = b.make_partition_view(b.make_tensor_view(e.args[0], TensorViewType(F32, (len(rows), 4), (4, 1))), (1, 4))
    for i, r in enumerate(rows):
        b.store_view_tko(b.reshape(r, (1, 4)), view, [b.constant(i, tile(I32)), b.constant(0, tile(I32))])
    b.return_()
    out = np.zeros((len(rows), 4), np.float32)
    interp.run_entry(e, (1, 1, 1), [out])
    np.testing.assert_array_equal(out[0], [0, 0, 0, 1])
    np.testing.assert_array_equal(out[1], [1, 1, 0, 1])
    np.testing.assert_array_equal(out[2], [0, 0, 1, 0])
    np.testing.assert_array_equal(out[3], [1, 1, 1, 0])
    np.testing.assert_array_equal(out[4], [1.0, math.nan, 2.5, 3.0])
    np.testing.assert_array_equal(out[5], [math.nan, math.nan, 2.5, 3.0])
    np.testing.assert_array_equal(out[6], [1.0, 1.015625, 3.0, -1.0])   # ties to even
    np.testing.assert_array_equal(out[7], [2, -2, 0, 0])
