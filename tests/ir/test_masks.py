"""Key-block bounds read from attention masks: exact where they apply, absent where they don't."""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.ir import graph as g
from xdsl.ir import Block

from tessera.ir.masks import ColumnBounds, attention_mask, column_bounds


def bounds_of(mask, fill=-math.inf):
    @tsr.function
    def f(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1))
        i = tsr.arange(q.shape[-2])
        return tsr.matmul(tsr.softmax(tsr.where(mask(i), s, fill), dim=-1), v)
    module = f.trace(f.arg_specs_for(dict(B=1, H=1, S=8, D=16), "fp32"))
    (sm,) = [op for op in module.walk() if isinstance(op, g.SoftmaxOp)]
    return column_bounds(sm.input, ("b0", "b1", "m", "n"), "m", "n", {"S": 8})


@pytest.mark.parametrize("mask,expected", [
    (lambda i: i[:, None] >= i[None, :], ColumnBounds(None, 0)),            # causal
    (lambda i: i[None, :] <= i[:, None], ColumnBounds(None, 0)),            # causal, written the other way
    (lambda i: i[:, None] > i[None, :], ColumnBounds(None, -1)),            # strictly below the diagonal
    (lambda i: i[None, :] <= i[:, None] + 3, ColumnBounds(None, 3)),        # causal shifted by 3
    (lambda i: i[None, :] >= i[:, None] - 100, ColumnBounds(-100, None)),   # a window's lower edge
    (lambda i: (i[None, :] - 2) > i[:, None], ColumnBounds(3, None)),
    # distances: both indices on one side, solved for the column
    (lambda i: i[:, None] - i[None, :] < 100, ColumnBounds(-99, None)),     # a window as a distance
    (lambda i: i[:, None] - i[None, :] >= 0, ColumnBounds(None, 0)),        # causal as a distance
    (lambda i: i[None, :] - i[:, None] <= 3, ColumnBounds(None, 3)),
    (lambda i: 5 > i[None, :] - i[:, None] + 2, ColumnBounds(None, 2)),     # col < row + 3
    (lambda i: i[:, None] - 7 <= i[None, :] - 4, ColumnBounds(-3, None)),   # indices on both sides
])
def test_bounds(mask, expected):
    assert bounds_of(mask) == expected


@pytest.mark.parametrize("mask,fill", [
    (lambda i: i[:, None] >= i[None, :], 0.0),                 # a finite fill still contributes
    (lambda i: i[:, None] * 2 >= i[None, :], -math.inf),       # not of the form row + c
    (lambda i: i[:, None] >= i[:, None], -math.inf),           # no column index
    (lambda i: i[:, None] + i[None, :] <= 5, -math.inf),       # col <= 5 - row: the anti-diagonal
    (lambda i: i[None, :] - i[None, :] <= 5, -math.inf),       # the column's coefficient 0
    (lambda i: 2 * i[None, :] - i[:, None] <= 5, -math.inf),   # ... or 2
    (lambda i: i[:, None] - i[None, :] < 100, 0.0),            # a finite fill
])
def test_no_bounds(mask, fill):
    assert bounds_of(mask, fill) == ColumnBounds(None, None)


def test_causal_kernel_loops_over_visible_blocks_only():
    """The KV loop of a causal kernel ends at a bound computed from the program id, not at S."""
    @tsr.function
    def causal(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
        i = tsr.arange(q.shape[-2])
        return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= i[None, :], s, -math.inf), dim=-1), v)
    specs = causal.arg_specs_for(dict(B=1, H=2, S=300, D=64), "fp16")
    compiled = causal.compile(specs)
    tile_ir = compiled.ir("tile")
    assert "arith.minsi" in tile_ir
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s.shape).astype(np.float16) for s in specs]
    out, ref = compiled.run(*xs)[0].astype(np.float64), compiled.reference(*xs)[0]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.parametrize("mask,expected", [
    (lambda i: (i[:, None] >= i[None, :]) & (i[None, :] >= i[:, None] - 4), ColumnBounds(-4, 0)),   # a window
    (lambda i: (i[:, None] + 2 >= i[None, :]) & (i[:, None] >= i[None, :]), ColumnBounds(None, 0)),  # the tighter
])
def test_conjunctions_intersect(mask, expected):
    assert bounds_of(mask) == expected


@pytest.mark.parametrize("mask,expected", [
    (lambda i: i[:, None] - i[None, :] < 100, ColumnBounds(None, 99)),      # queries < keys + 100
    (lambda i: i[:, None] - i[None, :] >= 0, ColumnBounds(0, None)),        # causal: queries >= keys
    (lambda i: i[:, None] >= i[None, :], ColumnBounds(0, None)),
])
def test_bounds_with_the_keys_as_rows(mask, expected):
    """The dK/dV kernel's view of a mask (its rows the keys, its columns the queries): a distance
    solved for the queries as a comparison is."""
    @tsr.function
    def f(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1))
        i = tsr.arange(q.shape[-2])
        return tsr.matmul(tsr.softmax(tsr.where(mask(i), s, -math.inf), dim=-1), v)
    (sm,) = [op for op in f.trace(f.arg_specs_for(dict(B=1, H=1, S=8, D=16), "fp32")).walk()
             if isinstance(op, g.SoftmaxOp)]
    assert column_bounds(sm.input, ("b0", "b1", "m", "n"), "n", "m", {"S": 8}) == expected


def test_a_window_written_as_distances_skips_blocks_on_both_sides():
    """`0 <= i - j < w` bounds the key loop on both sides as `j <= i` and `j > i - w` do: the same
    bounds, and the kernel against float64 on the interpreter."""
    def window(distance: bool):
        @tsr.function
        def f(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
            s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
            i = tsr.arange(q.shape[-2])
            keep = ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 50)) if distance else \
                ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 50))
            return tsr.matmul(tsr.softmax(tsr.where(keep, s, -math.inf), dim=-1), v)
        return f
    specs = window(True).arg_specs_for(dict(B=1, H=2, S=300, D=64), "fp32")
    for distance in (True, False):
        (sm,) = [op for op in window(distance).trace(specs).walk() if isinstance(op, g.SoftmaxOp)]
        assert column_bounds(sm.input, ("b0", "b1", "m", "n"), "m", "n", {"S": 300}) == ColumnBounds(-49, 0)
    compiled = window(True).compile(specs, space={"block_m": [32], "block_n": [16]})
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s.shape).astype(np.float32) for s in specs)
    i = np.arange(300)
    keep = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 50)
    x = np.where(keep, q.astype(np.float64) @ np.swapaxes(k, -1, -2) * 0.125, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(compiled.run(q, k, v)[0], p / p.sum(-1, keepdims=True) @ v, rtol=1e-5, atol=1e-5)


def test_a_conjunct_of_another_kind_leaves_no_bounds():
    assert bounds_of(lambda i: (i[:, None] >= i[None, :]) & (i[:, None] * 2 >= i[None, :])) == ColumnBounds(None, None)


@tsr.function
def by_length(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
              lengths: Tensor["B", tsr.int32]):
    """Each sequence's last M positions against its first lengths[b] keys (a cache partly filled)."""
    m, n = q.shape[-2], k.shape[-2]
    length = lengths[:, None, None, None]
    rows = tsr.arange(m)[:, None] + (length - m)
    cols = tsr.arange(n)[None, :]
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(tsr.where((cols <= rows) & (cols < length), s, -math.inf), dim=-1), v)


def test_limits_read_per_program_are_found():
    module = by_length.trace(by_length.arg_specs_for(dict(B=2, H=1, M=3, N=40, D=16), "fp32"))
    (sm,) = [op for op in module.walk() if isinstance(op, g.SoftmaxOp)]
    terms = attention_mask(sm.input, ("b0", "b1", "m", "n"), "m", "n", g.bindings_of(module.ops.first))
    assert terms.bounds == ColumnBounds(None, None)
    assert sorted((limit.const, limit.rows) for limit in terms.limits) == [(-2, "index"), (0, None)]
    assert all(isinstance(term.value.owner, Block) for limit in terms.limits for term in limit.terms)   # the argument
    assert not any(limit.lower or limit.per_row("m") for limit in terms.limits)
    assert column_bounds(sm.input, ("b0", "b1", "m", "n"), "m", "n", {}) == ColumnBounds(None, None)


@pytest.mark.parametrize("lengths", [[40, 1], [17, 33], [3, 0], [-5, 200]])
def test_a_kernel_stops_at_each_sequences_length(lengths):
    """The key loop ends at the length read per program, and blocks below it skip the mask; a length
    of 0 or below masks every key (NaN rows, as the reference's softmax of nothing), one past the
    keys reads them all."""
    specs = by_length.arg_specs_for(dict(B=2, H=2, M=3, N=40, D=16), "fp32")
    compiled = by_length.compile(specs, space={"block_n": [16]})
    assert "tile.load_index" in compiled.ir("tile")
    rng = np.random.default_rng(sum(lengths))
    xs = [rng.standard_normal(s.shape).astype(np.float32) for s in specs[:3]] + [np.array(lengths, np.int32)]
    out, ref = compiled.run(*xs)[0].astype(np.float64), compiled.reference(*xs)[0]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_allclose(np.nan_to_num(out), np.nan_to_num(ref), atol=2e-6)


@pytest.mark.parametrize("mask", [
    lambda c, length: c.to(tsr.bool_) < length,            # a cast to bool is no index
    lambda c, length: c < length.to(tsr.bool_),
    lambda c, length: c.to(tsr.fp32) < length.to(tsr.fp32),
])
def test_casts_that_change_the_value_are_no_limits(mask):
    @tsr.function
    def f(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"],
          lengths: Tensor["B", tsr.int32]):
        s = tsr.matmul(q, k.transpose(-2, -1))
        cond = mask(tsr.arange(k.shape[-2])[None, :], lengths[:, None, None, None])
        return tsr.matmul(tsr.softmax(tsr.where(cond, s, -math.inf), dim=-1), v)
    module = f.trace(f.arg_specs_for(dict(B=2, H=1, M=3, N=40, D=16), "fp32"))
    (sm,) = [op for op in module.walk() if isinstance(op, g.SoftmaxOp)]
    terms = attention_mask(sm.input, ("b0", "b1", "m", "n"), "m", "n", g.bindings_of(module.ops.first))
    assert terms is None or not terms.limits


def test_a_two_sided_window_skips_blocks_on_both_sides():
    """A causal sliding window (a conjunction): the key loop starts and ends at the window's blocks,
    and the blocks inside it skip the mask; the result matches the float64 reference."""
    @tsr.function
    def window(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * 0.125
        i = tsr.arange(q.shape[-2])
        keep = (i[:, None] >= i[None, :]) & (i[None, :] >= i[:, None] - 40)
        return tsr.matmul(tsr.softmax(tsr.where(keep, s, -math.inf), dim=-1), v)
    specs = window.arg_specs_for(dict(B=1, H=2, S=300, D=64), "fp16")
    compiled = window.compile(specs, space={"block_m": [32], "block_n": [16]})
    tile_ir = compiled.ir("tile")
    assert tile_ir.count("arith.minsi") >= 1 and "arith.divsi" in tile_ir and "scf.if" in tile_ir
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(s.shape).astype(np.float16) for s in specs]
    out, ref = compiled.run(*xs)[0].astype(np.float64), compiled.reference(*xs)[0]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_a_window_written_as_distances_differentiates_as_float64():
    """The backward of `0 <= i - j < w` (its dQ and dK/dV kernels bounded as the forward's key loop,
    `chain_bounds`) against float64 gradients derived by hand, on the interpreter."""
    def window(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * 0.25
        i = tsr.arange(q.shape[-2])
        keep = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 40)
        return tsr.matmul(tsr.softmax(tsr.where(keep, s, -math.inf), dim=-1), v)
    f = tsr.function(window, space={"backend": "ptx", "block_m": [32], "block_n": [32]})
    rng = np.random.default_rng(6)
    q, k, v, d_out = (rng.standard_normal((1, 2, 150, 16)).astype(np.float32) for _ in range(4))
    _, f_vjp = tsr.vjp(f, q, k, v)
    x = q.astype(np.float64) @ np.swapaxes(k, -1, -2) * 0.25
    i = np.arange(150)
    p = np.exp(np.where((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < 40), x, -np.inf)
               - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = d_out @ np.swapaxes(v.astype(np.float64), -1, -2)
    dx = p * (dp - (dp * p).sum(-1, keepdims=True)) * 0.25
    for grad, ref in zip(f_vjp(d_out), (dx @ k, np.swapaxes(dx, -1, -2) @ q, np.swapaxes(p, -1, -2) @ d_out)):
        np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
