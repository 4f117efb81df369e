"""The NumPy Tile IR interpreter against NumPy references: a pipelined tiled GEMM, an
online-softmax row kernel, arange/cmpi/select masking, tile windows, elementwise
semantics (rounding, NaN compares, C-style integer division) and async-copy timing."""
import math as pymath

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from xdsl.dialects import arith, func, math, scf
from xdsl.dialects.builtin import (
    DenseIntOrFPElementsAttr,
    FloatAttr,
    IndexType,
    IntegerAttr,
    MemRefType,
    ModuleOp,
    TensorType,
    bf16,
    f16,
    f32,
    i1,
    i32,
)
from xdsl.ir import Block, SSAValue

from tessera.interpreter.tile_interp import TileProgram, run_host
from tessera.ir import tile

SETTINGS = settings(max_examples=6, deadline=None)
ELEMENT = {np.dtype(np.float32): f32, np.dtype(np.float16): f16, np.dtype(ml_dtypes.bfloat16): bf16,
           np.dtype(np.int32): i32, np.dtype(np.bool_): i1}


class Emit:
    """Appends ops to a block; calling it returns the op's single result."""

    def __init__(self, block: Block):
        self.block = block

    def __call__(self, op):
        self.block.add_op(op)
        return op.results[0] if len(op.results) == 1 else op

    def index(self, value: int) -> SSAValue:
        return self(arith.ConstantOp(IntegerAttr(value, IndexType())))

    def full(self, shape, value, element=f32) -> SSAValue:
        return self(arith.ConstantOp(DenseIntOrFPElementsAttr.from_list(TensorType(element, shape), [value])))

    def splat(self, shape, value: float) -> SSAValue:
        """An f32 tile of a non-finite value: xDSL 0.74 misreads hex floats inside dense<...>,
        so the value is a scalar constant broadcast to the tile."""
        return self(tile.BroadcastOp(self(arith.ConstantOp(FloatAttr(value, f32))), (), shape))

    def loop(self, lb, ub, inits, body):
        """scf.for from lb to ub (index values) step 1; `body(emit, iv, *carried)` returns the yields."""
        block = Block(arg_types=[IndexType()] + [SSAValue.get(v).type for v in inits])
        inner = Emit(block)
        inner(scf.YieldOp(*body(inner, *block.args)))
        op = scf.ForOp(lb, ub, self.index(1), inits, block)
        self.block.add_op(op)
        return op.results


def kernel(name, arg_types):
    op = tile.KernelOp.build_kernel(name, arg_types, num_warps=4, num_stages=2)
    return op, Emit(op.body.block), op.body.block.args


def host_module(kernels, launches, arg_types):
    """A module whose host `main(args)` launches `(kernel name, grid, arg indices)` in order."""
    host = func.FuncOp("main", (arg_types, []))
    args = host.body.block.args
    for name, grid, which in launches:
        host.body.block.add_op(tile.LaunchOp(name, grid, [args[i] for i in which]))
    host.body.block.add_op(func.ReturnOp())
    module = ModuleOp([*kernels, host])
    module.verify()
    return tile.parse_tile_module(tile.print_module(module))  # run what the text says


def cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------- (a) tiled GEMM

BM, BN, BK = 32, 32, 16


def gemm_module(m, n, k, dtype, transpose_b=False, wait_pending=1):
    """C = A @ B (B stored N x K when transpose_b): a 2-stage cp.async pipeline over K.

    Each iteration issues the copy of k-tile kt+1 into the other stage, waits until
    only that newest group is in flight, and multiplies k-tile kt from shared memory.
    """
    el = ELEMENT[np.dtype(dtype)]
    a_t, c_t = MemRefType(el, [m, k]), MemRefType(el, [m, n])
    b_t = MemRefType(el, [n, k] if transpose_b else [k, n])
    op, e, (a, b, c) = kernel("gemm", [a_t, b_t, c_t])
    om = e(arith.MuliOp(e(tile.ProgramIdOp(0)), e.index(BM)))
    on = e(arith.MuliOp(e(tile.ProgramIdOp(1)), e.index(BN)))
    sa = e(tile.AllocSharedOp([2, BM, BK], el))
    sb = e(tile.AllocSharedOp([2, BN, BK] if transpose_b else [2, BK, BN], el))
    two, bk = e.index(2), e.index(BK)

    def issue(e, kt):
        stage, ko = e(arith.RemSIOp(kt, two)), e(arith.MuliOp(kt, bk))
        e(tile.CopyAsyncOp(a, sa, stage, [om, ko], (0, 1)))
        e(tile.CopyAsyncOp(b, sb, stage, [on, ko] if transpose_b else [ko, on], (0, 1)))
        e(tile.AsyncCommitOp())

    def step(e, kt, acc):
        issue(e, e(arith.AddiOp(kt, e.index(1))))
        e(tile.AsyncWaitOp(wait_pending))
        e(tile.BarrierOp())
        stage = e(arith.RemSIOp(kt, two))
        acc = e(tile.MmaOp(e(tile.LoadSharedOp(sa, stage)), e(tile.LoadSharedOp(sb, stage)), acc,
                           transpose_b=transpose_b))
        e(tile.BarrierOp())
        return [acc]

    issue(e, e.index(0))
    (acc,) = e.loop(e.index(0), e.index(cdiv(k, BK)), [e.full([BM, BN], 0.0)], step)
    out = acc if el == f32 else e(arith.TruncFOp(acc, TensorType(el, [BM, BN])))
    e(tile.StoreOp(out, c, [om, on], (0, 1)))
    e(tile.ReturnOp())
    return host_module([op], [("gemm", (cdiv(m, BM), cdiv(n, BN), 1), (0, 1, 2))], [a_t, b_t, c_t])


TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}


@SETTINGS
@given(m=st.integers(1, 80), n=st.integers(1, 80), k=st.integers(1, 100),
       dtype=st.sampled_from(list(TOLERANCE)), transpose_b=st.booleans())
@example(m=77, n=45, k=100, dtype=np.float32, transpose_b=False)
@example(m=77, n=45, k=100, dtype=np.float16, transpose_b=False)
@example(m=77, n=45, k=100, dtype=np.float16, transpose_b=True)
def test_tiled_gemm_matches_numpy(m, n, k, dtype, transpose_b):
    rng = np.random.default_rng(m * 10_000 + n * 100 + k)
    a = rng.uniform(-1, 1, (m, k)).astype(dtype)
    b = rng.uniform(-1, 1, (n, k) if transpose_b else (k, n)).astype(dtype)
    c = np.full((m, n), 7, dtype)
    run_host(gemm_module(m, n, k, dtype, transpose_b), "main", [a, b, c])
    b32 = b.astype(np.float32)
    ref = (a.astype(np.float32) @ (b32.T if transpose_b else b32)).astype(dtype).astype(np.float32)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(c.astype(np.float32), ref, rtol=tol, atol=tol * np.sqrt(k))


def test_reading_a_stage_before_its_copy_is_waited_for_sees_stale_shared_memory():
    """With async_wait {pending = 2} the newest groups are still in flight: stage 0 is unwritten (NaN)."""
    a, b = np.ones((40, 40), np.float32), np.ones((40, 40), np.float32)
    c = np.zeros((40, 40), np.float32)
    TileProgram(gemm_module(40, 40, 40, np.float32, wait_pending=2))(a, b, c)
    assert np.isnan(c).all()


# ---------------------------------------------------------------- (b) online softmax

BR, BC = 8, 16


def softmax_module(rows, cols):
    """Y = softmax(X, axis=1): one pass for the running max and sum (scf.for iter_args), one to write."""
    x_t = MemRefType(f32, [rows, cols])
    op, e, (x, y) = kernel("softmax", [x_t, x_t])
    r0 = e(arith.MuliOp(e(tile.ProgramIdOp(0)), e.index(BR)))
    bc, n_blocks = e.index(BC), e.index(cdiv(cols, BC))

    def load(e, j):
        return e(tile.LoadOp(x, [r0, e(arith.MuliOp(j, bc))], (0, 1), (BR, BC), padding=-np.inf))

    def rows_to_tile(e, v):
        return e(tile.BroadcastOp(v, (0,), (BR, BC)))

    def running(e, j, m, s):
        xs = load(e, j)
        m_new = e(arith.MaximumfOp(m, e(tile.ReduceOp(xs, "max", 1))))
        p = e(math.ExpOp(e(arith.SubfOp(xs, rows_to_tile(e, m_new)))))
        rescaled = e(arith.MulfOp(s, e(math.ExpOp(e(arith.SubfOp(m, m_new))))))
        return [m_new, e(arith.AddfOp(rescaled, e(tile.ReduceOp(p, "sum", 1))))]

    def write(e, j):
        p = e(math.ExpOp(e(arith.SubfOp(load(e, j), rows_to_tile(e, m)))))
        e(tile.StoreOp(e(arith.DivfOp(p, rows_to_tile(e, s))), y, [r0, e(arith.MuliOp(j, bc))], (0, 1)))
        return []

    m, s = e.loop(e.index(0), n_blocks, [e.splat([BR], -np.inf), e.full([BR], 0.0)], running)
    e.loop(e.index(0), n_blocks, [], write)
    e(tile.ReturnOp())
    return host_module([op], [("softmax", (cdiv(rows, BR), 1, 1), (0, 1))], [x_t, x_t])


@SETTINGS
@given(rows=st.integers(1, 40), cols=st.integers(1, 70))
@example(rows=13, cols=50)
def test_online_softmax_matches_numpy(rows, cols):
    x = np.random.default_rng(rows * 100 + cols).normal(0, 3, (rows, cols)).astype(np.float32)
    y = np.full_like(x, np.nan)
    run_host(softmax_module(rows, cols), "main", [x, y])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------- (c) masking

BLOCK = 16


def masking_module(n):
    """Per block: sum of the in-bounds elements (padding is NaN, so masking must work),
    and y = x on even indices, -x on odd ones."""
    x_t, s_t = MemRefType(f32, [n]), MemRefType(f32, [cdiv(n, BLOCK)])
    op, e, (x, y, sums) = kernel("mask", [x_t, x_t, s_t])
    pid = e(tile.ProgramIdOp(0))
    off = e(arith.MuliOp(pid, e.index(BLOCK)))
    idx = e(tile.ArangeOp(off, BLOCK))
    limit = e(tile.BroadcastOp(e(arith.IndexCastOp(e.index(n), i32)), (), (BLOCK,)))
    in_bounds = e(tile.CmpiOp(idx, limit, "slt"))
    xs = e(tile.LoadOp(x, [off], (0,), (BLOCK,), padding=np.nan))
    kept = e(tile.SelectOp(in_bounds, xs, e.full([BLOCK], 0.0)))
    e(tile.StoreOp(e(tile.ReduceOp(kept, "sum", 0)), sums, [pid], ()))
    even = e(tile.CmpiOp(e(arith.RemSIOp(idx, e.full([BLOCK], 2, i32))), e.full([BLOCK], 0, i32), "eq"))
    e(tile.StoreOp(e(tile.SelectOp(even, xs, e(arith.NegfOp(xs)))), y, [off], (0,)))
    e(tile.ReturnOp())
    return host_module([op], [("mask", (cdiv(n, BLOCK), 1, 1), (0, 1, 2))], [x_t, x_t, s_t])


@SETTINGS
@given(n=st.integers(1, 100))
@example(n=37)
def test_arange_cmpi_select_masking(n):
    x = np.random.default_rng(n).normal(size=n).astype(np.float32)
    y, sums = np.full(n, np.nan, np.float32), np.full(cdiv(n, BLOCK), np.nan, np.float32)
    run_host(masking_module(n), "main", [x, y, sums])
    padded = np.zeros(cdiv(n, BLOCK) * BLOCK, np.float32)
    padded[:n] = x
    np.testing.assert_allclose(sums, padded.reshape(-1, BLOCK).sum(axis=1, dtype=np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y, np.where(np.arange(n) % 2 == 0, x, -x))


# ---------------------------------------------------------------- tile windows


def window_module(shape, offsets, tile_dims, tile_shape, padding):
    """Copies one (possibly transposed, partly out-of-bounds) tile from src to dst at the same place."""
    t = MemRefType(f32, shape)
    op, e, (src, dst) = kernel("window", [t, t])
    offs = [e.index(o) for o in offsets]
    e(tile.StoreOp(e(tile.LoadOp(src, offs, tile_dims, tile_shape, padding)), dst, offs, tile_dims))
    e(tile.ReturnOp())
    return ModuleOp([op])


@SETTINGS
@given(offsets=st.tuples(st.integers(0, 1), st.integers(-3, 6), st.integers(-3, 8)),
       transposed=st.booleans())
@example(offsets=(1, 3, 5), transposed=True)
def test_load_and_store_windows(offsets, transposed):
    """r[i, j] = src[o0, o1 + j, o2 + i] for tile_dims (2, 1); out of bounds (along the tiled dims)
    reads padding, stores skip."""
    shape, tile_dims = (2, 5, 7), ((2, 1) if transposed else (1, 2))
    src = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    dst = np.full(shape, -7.0, np.float32)
    program = TileProgram(window_module(shape, offsets, tile_dims, (4, 4), padding=-1.0))
    program.launch("window", (1,), src, dst)

    o0, o1, o2 = offsets
    inside = (dst != -7.0)
    expect = np.zeros(shape, bool)
    if 0 <= o0 < shape[0]:
        expect[o0, max(o1, 0):max(o1 + 4, 0), max(o2, 0):max(o2 + 4, 0)] = True
    np.testing.assert_array_equal(inside, expect)
    np.testing.assert_array_equal(dst[inside], src[inside])


@pytest.mark.parametrize("o0", [-1, 2])
def test_an_offset_outside_a_dim_the_tile_does_not_span_is_an_error(o0):
    """The GPU bounds-checks a tile only along the dims it spans, so the interpreter, the oracle of
    what the kernels compute, refuses to read padding (or skip a store) where the GPU would touch
    another tensor; a tile masked whole along a dim it spans touches nothing, whatever the others."""
    src = np.zeros((2, 5, 7), np.float32)
    program = TileProgram(window_module((2, 5, 7), (o0, 0, 0), (1, 2), (4, 4), padding=-1.0))
    with pytest.raises(Exception, match="that the tile does not span"):
        program.launch("window", (1,), src, src.copy())
    t = MemRefType(f32, [2, 5, 7])
    op, e, (dst,) = kernel("store_only", [t])
    e(tile.StoreOp(e.full((4, 4), 1.0), dst, [e.index(o0), e.index(0), e.index(0)], (1, 2)))
    e(tile.ReturnOp())
    with pytest.raises(Exception, match="that the tile does not span"):
        TileProgram(ModuleOp([op])).launch("store_only", (1,), src.copy())
    masked = TileProgram(window_module((2, 5, 7), (o0, 5, 0), (1, 2), (4, 4), padding=-1.0))
    masked.launch("window", (1,), src, src.copy())


def test_load_reads_padding_out_of_bounds_and_transposes():
    t = MemRefType(f32, [3, 4])
    op, e, (src, out) = kernel("k", [t, MemRefType(f32, [4, 4])])
    zero, one = e.index(0), e.index(1)
    e(tile.StoreOp(e(tile.LoadOp(src, [one, zero], (1, 0), (4, 4), padding=-1.0)), out, [zero, zero], (0, 1)))
    e(tile.ReturnOp())
    src_a, out_a = np.arange(12, dtype=np.float32).reshape(3, 4), np.zeros((4, 4), np.float32)
    TileProgram(ModuleOp([op])).launch("k", (1,), src_a, out_a)
    expect = np.full((4, 4), -1.0, np.float32)
    expect[:, :2] = src_a[1:].T  # r[i, j] = src[1 + j, i]
    np.testing.assert_array_equal(out_a, expect)


# ---------------------------------------------------------------- elementwise semantics


def elementwise(build, *inputs, out_dtype):
    """Runs `build(emit, *tiles)` on 1-D tiles loaded from `inputs`; returns the stored result."""
    n = len(inputs[0])
    in_types = [MemRefType(ELEMENT[a.dtype], [n]) for a in inputs]
    op, e, args = kernel("k", [*in_types, MemRefType(ELEMENT[np.dtype(out_dtype)], [n])])
    zero = e.index(0)
    tiles = [e(tile.LoadOp(a, [zero], (0,), (n,))) for a in args[:-1]]
    e(tile.StoreOp(build(e, *tiles), args[-1], [zero], (0,)))
    e(tile.ReturnOp())
    out = np.zeros(n, out_dtype)
    TileProgram(ModuleOp([op])).launch("k", (1,), *inputs, out)
    return out


F16 = np.array([1.0, 1e-3, 2049.0, -3.5, 65000.0, 0.1], np.float16)
I32 = np.array([7, -7, 7, -7, 0, 2**31 - 1], np.int32)
I32_D = np.array([2, 2, -2, -2, 3, 1], np.int32)
NAN = np.array([1.0, np.nan, 2.0, np.nan], np.float32)
ONE = np.array([1.0, 1.0, 3.0, np.nan], np.float32)
with np.errstate(over="ignore"):
    F16_SQUARED = F16 * F16

ELEMENTWISE_CASES = {
    "addf rounds to f16": (lambda e, a, b: e(arith.AddfOp(a, b)), (F16, F16[::-1].copy()), np.float16,
                           F16 + F16[::-1]),
    "mulf overflows f16": (lambda e, a: e(arith.MulfOp(a, a)), (F16,), np.float16, F16_SQUARED),
    "exp in f32 then f16": (lambda e, a: e(math.ExpOp(a)), (F16 / 10_000,), np.float16,
                            np.exp((F16 / 10_000).astype(np.float32)).astype(np.float16)),
    "divsi truncates": (lambda e, a, b: e(arith.DivSIOp(a, b)), (I32, I32_D), np.int32,
                        np.array([3, -3, -3, 3, 0, 2**31 - 1])),
    "remsi keeps dividend sign": (lambda e, a, b: e(arith.RemSIOp(a, b)), (I32, I32_D), np.int32,
                                  np.array([1, -1, 1, -1, 0, 0])),
    "floordivsi": (lambda e, a, b: e(arith.FloorDivSIOp(a, b)), (I32, I32_D), np.int32,
                   np.array([3, -4, -4, 3, 0, 2**31 - 1])),
    "ceildivsi": (lambda e, a, b: e(arith.CeilDivSIOp(a, b)), (I32, I32_D), np.int32,
                  np.array([4, -3, -3, 4, 0, 2**31 - 1])),
    "addi wraps": (lambda e, a: e(arith.AddiOp(a, a)), (I32,), np.int32, I32 * 2),
    "cmpf olt is false on NaN": (lambda e, a, b: e(tile.CmpfOp(a, b, "olt")), (NAN, ONE + 1), np.bool_,
                                 np.array([True, False, True, False])),
    "cmpf ult is true on NaN": (lambda e, a, b: e(tile.CmpfOp(a, b, "ult")), (NAN, ONE + 1), np.bool_,
                                np.array([True, True, True, True])),
    "cmpf une": (lambda e, a, b: e(tile.CmpfOp(a, b, "une")), (NAN, ONE), np.bool_,
                 np.array([False, True, True, True])),
    "cmpi ult is unsigned": (lambda e, a, b: e(tile.CmpiOp(a, b, "ult")), (I32, I32_D), np.bool_,
                             np.array([False, False, True, True, True, False])),
    "maximumf propagates NaN": (lambda e, a, b: e(arith.MaximumfOp(a, b)), (NAN, ONE), np.float32,
                                np.array([1.0, np.nan, 3.0, np.nan])),
    "sitofp/fptosi round trip": (lambda e, a: e(tile.FPToSIOp(e(tile.SIToFPOp(a, f32)), i32)), (I32[:5],),
                                 np.int32, I32[:5]),
    "truncf to bf16": (lambda e, a: e(arith.TruncFOp(a, TensorType(bf16, [4]))),
                       (np.array([1.00390625, 3.14159, -2.5e-3, 1e30], np.float32),),
                       ml_dtypes.bfloat16, np.array([1.00390625, 3.14159, -2.5e-3, 1e30]).astype(ml_dtypes.bfloat16)),
    "rsqrt": (lambda e, a: e(math.RsqrtOp(a)), (np.array([4.0, 0.25, 2.0], np.float32),), np.float32,
              1 / np.sqrt(np.array([4.0, 0.25, 2.0], np.float32))),
}


@pytest.mark.parametrize("case", ELEMENTWISE_CASES)
def test_elementwise_semantics(case):
    build, inputs, out_dtype, expect = ELEMENTWISE_CASES[case]
    out = elementwise(build, *inputs, out_dtype=out_dtype)
    np.testing.assert_array_equal(out, np.asarray(expect).astype(out_dtype))


def test_erf_is_accurate_to_f32():
    x = np.linspace(-5, 5, 2001, dtype=np.float32)
    out = elementwise(lambda e, a: e(math.ErfOp(a)), x, out_dtype=np.float32)
    ref = np.array([pymath.erf(v) for v in x.astype(np.float64)], np.float32)
    ulps = np.abs(out.view(np.int32) - ref.view(np.int32))
    assert ulps.max() <= 2


def test_scf_if_yields_per_program():
    """Program 0 writes 1.0, the others their program id times 10."""
    t = MemRefType(f32, [4])
    op, e, (out,) = kernel("k", [t])
    pid = e(tile.ProgramIdOp(0))
    first = e(arith.CmpiOp(pid, e.index(0), "eq"))
    then, other = Block(), Block()
    Emit(then)(scf.YieldOp(Emit(then).full([1], 1.0)))
    scaled = Emit(other)(arith.SIToFPOp(Emit(other)(arith.IndexCastOp(pid, i32)), f32))
    ten = Emit(other)(arith.MulfOp(scaled, Emit(other)(arith.ConstantOp(FloatAttr(10.0, f32)))))
    Emit(other)(scf.YieldOp(Emit(other)(tile.BroadcastOp(ten, (), (1,)))))
    value = e(scf.IfOp(first, [TensorType(f32, [1])], [then], [other]))
    e(tile.StoreOp(value, out, [pid], (0,)))
    e(tile.ReturnOp())
    result = np.zeros(4, np.float32)
    TileProgram(ModuleOp([op])).launch("k", (4,), result)
    np.testing.assert_array_equal(result, [1.0, 10.0, 20.0, 30.0])


# ---------------------------------------------------------------- host side and errors


def test_alloc_global_intermediates_start_as_nan_and_launches_run_in_order():
    """Host: tmp = alloc_global; copy x -> tmp; copy tmp -> y.  An unwritten tmp would show NaN."""
    t = MemRefType(f32, [5, 3])
    op, e, (src, dst) = kernel("copy", [t, t])
    zero = e.index(0)
    e(tile.StoreOp(e(tile.LoadOp(src, [zero, zero], (0, 1), (8, 4))), dst, [zero, zero], (0, 1)))
    e(tile.ReturnOp())
    host = func.FuncOp("main", ([t, t], []))
    x, y = host.body.block.args
    tmp = tile.AllocGlobalOp([5, 3], f32)
    host.body.block.add_ops([tmp, tile.LaunchOp("copy", (1, 1, 1), [x, tmp.result]),
                             tile.LaunchOp("copy", (1, 1, 1), [tmp.result, y]), func.ReturnOp()])
    module = ModuleOp([op, host])
    module.verify()
    a, b = np.arange(15, dtype=np.float32).reshape(5, 3), np.zeros((5, 3), np.float32)
    TileProgram(module)(a, b)
    np.testing.assert_array_equal(b, a)


def test_arguments_are_checked_against_memref_types():
    program = TileProgram(masking_module(20))
    with pytest.raises(TypeError, match=r"@main argument 0: expected a float32\[20\] array"):
        program.run("main", np.zeros(20, np.float64), np.zeros(20, np.float32), np.zeros(2, np.float32))
    with pytest.raises(KeyError, match="no tile.kernel @main"):
        program.launch("main", (1,))


def test_errors_name_the_op_and_program():
    t = MemRefType(f32, [2, 4, 4])
    op, e, (buf,) = kernel("k", [t])
    shared = e(tile.AllocSharedOp([2, 4, 4], f32))
    e(tile.LoadSharedOp(shared, e(arith.MuliOp(e(tile.ProgramIdOp(0)), e.index(2)))))
    e(tile.ReturnOp())
    with pytest.raises(IndexError) as info:
        TileProgram(ModuleOp([op])).launch("k", (3,), np.zeros((2, 4, 4), np.float32))
    assert info.value.__notes__ == ["  in tile.load_shared (tensor<4x4xf32>)", "  in @k, program id (1, 0, 0)"]


CLUSTER_ROWS = """builtin.module {
  tile.kernel @halves(%x: memref<4x128xf32>, %sums: memref<4x2xf32>, %maxes: memref<4x2xf32>) attributes \
{num_warps = 4 : i64, num_stages = 1 : i64, tessera.cluster = 2 : i64} {
    %pid = tile.program_id {axis = 0 : i64}
    %c0 = arith.constant 0 : index
    %c64 = arith.constant 64 : index
    %col = arith.muli %pid, %c64 : index
    %limit = arith.constant LIMIT : index
    %ok = arith.cmpi slt, %pid, %limit : index
    tile.assert %ok {message = "block past the limit"} : i1
    %t = tile.load %x[%c0, %col] {tile_dims = array<i64: 0, 1>} : memref<4x128xf32> -> tensor<4x64xf32>
    %r = tile.reduce %t {kind = "sum", axis = 1 : i64} : tensor<4x64xf32> -> tensor<4xf32>
    %h = tile.reduce %t {kind = "max", axis = 1 : i64} : tensor<4x64xf32> -> tensor<4xf32>
    %r0, %r1, %h0, %h1 = tile.cluster_gather %r, %h : tensor<4xf32>, tensor<4xf32> -> tensor<4xf32>, tensor<4xf32>, \
tensor<4xf32>, tensor<4xf32>
    %s = arith.addf %r0, %r1 : tensor<4xf32>
    %m = arith.maximumf %h0, %h1 : tensor<4xf32>
    tile.store %s, %sums[%c0, %pid] {tile_dims = array<i64: 0>} : tensor<4xf32>, memref<4x2xf32>
    tile.store %m, %maxes[%c0, %pid] {tile_dims = array<i64: 0>} : tensor<4xf32>, memref<4x2xf32>
    tile.return
  }
}
"""


def test_a_cluster_gather_gives_every_block_the_shares_of_every_block_of_the_cluster():
    """The two blocks of a cluster (each on a thread) reduce their halves of each row and gather
    both halves' sums and maxes: both get the whole row's."""
    x = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    sums, maxes = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    TileProgram(tile.parse_tile_module(CLUSTER_ROWS.replace("LIMIT", "2"))).launch("halves", (2,), x, sums, maxes)
    np.testing.assert_allclose(sums, np.repeat((x[:, :64].sum(1) + x[:, 64:].sum(1))[:, None], 2, 1), rtol=1e-6)
    np.testing.assert_array_equal(maxes, np.repeat(x.max(1)[:, None], 2, 1))


def test_a_failing_block_of_a_cluster_raises_and_releases_the_others():
    """Block 1 fails before the gather that block 0 waits at: the error is raised, nothing hangs."""
    from tessera.errors import DeviceAssertError, TesseraError
    program = TileProgram(tile.parse_tile_module(CLUSTER_ROWS.replace("LIMIT", "1")))
    args = np.zeros((4, 128), np.float32), np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(DeviceAssertError, match="block past the limit"):
        program.launch("halves", (2,), *args)
    with pytest.raises(TesseraError, match="a grid of 3 blocks along axis 0 is not whole clusters of 2"):
        program.launch("halves", (3,), *args)


UNEVEN_GATHERS = """builtin.module {
  tile.kernel @uneven(%x: memref<4x128xf32>, %out: memref<4x2xf32>) attributes {num_warps = 4 : i64, \
num_stages = 1 : i64, tessera.cluster = 2 : i64} {
    %pid = tile.program_id {axis = 0 : i64}
    %c0 = arith.constant 0 : index
    %t = tile.load %x[%c0, %c0] {tile_dims = array<i64: 0, 1>} : memref<4x128xf32> -> tensor<4x64xf32>
    %r = tile.reduce %t {kind = "sum", axis = 1 : i64} : tensor<4x64xf32> -> tensor<4xf32>
    %go = arith.cmpi ne, %pid, %c0 : index
    scf.if %go {
      %r0, %r1 = tile.cluster_gather %r : tensor<4xf32> -> tensor<4xf32>, tensor<4xf32>
      tile.store %r0, %out[%c0, %pid] {tile_dims = array<i64: 0>} : tensor<4xf32>, memref<4x2xf32>
      scf.yield
    }
    tile.return
  }
}
"""


def test_blocks_of_a_cluster_gathering_unalike_raise_rather_than_hang():
    """Block 0 skips the gather (what only a miscompile could do): block 1, left waiting, is
    released with an error, not hung."""
    from tessera.errors import TesseraError
    args = np.zeros((4, 128), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(TesseraError, match="the blocks of a cluster must run every"):
        TileProgram(tile.parse_tile_module(UNEVEN_GATHERS)).launch("uneven", (2,), *args)
