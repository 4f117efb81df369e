"""Reductions whose results are exact, as cases shared by the CPU interpreter's tests
(tests/lowering/test_exact_reductions.py) and the GPU's (tests/gpu/test_reductions_gpu.py):

- int32 maxima, minima, argmaxes and sums of values past 2^24 (accumulated in i32,
  `schedule_to_tile.accumulator`; in f32 they were rounded, and argmax returned the row's length)
  through every template that reduces: the row template, the column template split or not, a
  row kernel's column riders and a flash_chain kernel's sinks;
- argmax and amax's gradient over a value a kernel computes in f32 whose dtype rounds it (a
  product in fp16: `ops.equals_extreme`), as a NumPy reference on the rounded value computes them.

Each case: a function, its inputs for dims, and its exact NumPy reference."""
import dataclasses
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

import tessera as tsr
from tessera import Tensor, dtypes

INT_MAX = 2 ** 31 - 1


@tsr.function
def row_ints(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    return tsr.amax(x, 1), tsr.amin(x, 1), tsr.argmax(x, 1), tsr.argmin(x, 1), tsr.sum(y, 1)


@tsr.function
def column_ints(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    return tsr.amax(x, 0), tsr.amin(x, 0), tsr.argmax(x, 0), tsr.sum(y, 0)


@tsr.function
def rider_ints(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    """A row reduction with column reductions of the same rows riding in its kernel."""
    return tsr.amax(x, 1), tsr.sum(y, 0), tsr.amin(x, 0)


@tsr.function
def chain_ints(a: Tensor["M", "K"], b: Tensor["N", "K"], big: Tensor["N"]):
    """Int reductions over a matmul's scores (flash_chain sinks): the largest of `big` where the
    score is positive, and the index of each row's largest score (greedy decoding's argmax)."""
    s = a @ b.T
    return tsr.amax(tsr.where(s > 0, big[None, :], -7), -1), tsr.argmax(s, -1)


@tsr.function
def argmax_of_product(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    p = x * y
    return tsr.argmax(p, -1), tsr.argmin(p, 0), tsr.max(p, 1).indices


def _ints(rng, shape, low=-2 ** 30, high=2 ** 30):
    return rng.integers(low, high, shape).astype(np.int32)


def _summands(rng, shape, axis):
    """Ints whose sums along `axis` are past 2^24 and below 2^31."""
    per = INT_MAX // shape[axis]
    return _ints(rng, shape, per // 2, per)


def _pair(axis):
    return lambda rng, d, dtype: [_ints(rng, (d["M"], d["N"])), _summands(rng, (d["M"], d["N"]), axis)]


def _sum32(y, axis):
    return y.sum(axis, dtype=np.int64).astype(np.int32)


def _chain_inputs(rng, d, dtype):
    a = rng.standard_normal((d["M"], d["K"])).astype(dtype)
    b = rng.standard_normal((d["N"], d["K"])).astype(dtype)
    return [a, b, _ints(rng, (d["N"],), 2 ** 29, 2 ** 30)]


def _chain_reference(a, b, big):
    s = (a.astype(np.float64) @ b.astype(np.float64).T).astype(a.dtype)   # (s is a's dtype)
    return [np.where(s > 0, big[None, :], -7).max(-1), s.argmax(-1)]


def _product_reference(x, y):
    p = (x.astype(np.float64) * y).astype(x.dtype)   # (rounded as its dtype: ties as in torch's p)
    return [p.argmax(-1), p.argmin(0), p.argmax(1)]


@dataclass(frozen=True)
class ExactCase:
    name: str
    fn: object
    inputs: Callable            # (rng, dims, dtype) -> NumPy arrays
    reference: Callable         # arrays -> exact results
    dims: tuple                 # dims dicts
    dtypes: tuple = ("int32",)
    space: dict | None = None   # a schedule forced (the column template split)


ROW_DIMS = (dict(M=1, N=1), dict(M=7, N=13), dict(M=5, N=1000), dict(M=3, N=4097), dict(M=1000, N=33))
CASES = [
    ExactCase("row", row_ints, _pair(1),
              lambda x, y: [x.max(1), x.min(1), x.argmax(1), x.argmin(1), _sum32(y, 1)], ROW_DIMS),
    ExactCase("column", column_ints, _pair(0),
              lambda x, y: [x.max(0), x.min(0), x.argmax(0), _sum32(y, 0)], ROW_DIMS),
    ExactCase("column_split", column_ints, _pair(0),
              lambda x, y: [x.max(0), x.min(0), x.argmax(0), _sum32(y, 0)],
              (dict(M=1000, N=33), dict(M=4097, N=3)), space=dict(split_rows=[7])),
    ExactCase("rider", rider_ints, _pair(0),
              lambda x, y: [x.max(1), _sum32(y, 0), x.min(0)], (dict(M=7, N=13), dict(M=1000, N=33))),
    ExactCase("chain", chain_ints, _chain_inputs, _chain_reference,
              (dict(M=1, N=17, K=64), dict(M=300, N=1000, K=64), dict(M=67, N=4097, K=128)),
              dtypes=(np.float16,)),
    ExactCase("argmax_of_product", argmax_of_product,
              lambda rng, d, dtype: [rng.standard_normal((d["M"], d["N"])).astype(dtype) for _ in range(2)],
              _product_reference, (dict(M=7, N=13), dict(M=64, N=1000), dict(M=3, N=4097)),
              dtypes=(np.float16, ml_dtypes.bfloat16)),
]
IDS = [f"{c.name}-{'x'.join(map(str, d.values()))}-{np.dtype(dt).name}" for c in CASES for d in c.dims for dt in c.dtypes]
PARAMS = [(c, d, dt) for c in CASES for d in c.dims for dt in c.dtypes]


def specs(fn, dims: dict, arrays: list) -> list:
    """`fn`'s argument specs at `dims`, each of its array's dtype."""
    return [dataclasses.replace(spec, dtype=dtypes.lookup(a.dtype)) for spec, a in zip(fn.arg_specs_for(dims), arrays)]


def function(case: ExactCase):
    return tsr.function(case.fn.fn, space=case.space) if case.space else case.fn


def check(outs, refs) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        ref = ref.astype(np.int32) if ref.dtype == np.int64 else ref   # (indices are int32)
        assert out.dtype == ref.dtype, f"result {i}: {out.dtype}, expected {ref.dtype}"
        mismatched = np.flatnonzero(out.reshape(-1) != ref.reshape(-1))
        assert not mismatched.size, (f"result {i}: {mismatched.size} of {out.size} differ, first at "
                                     f"{mismatched[0]}: {out.reshape(-1)[mismatched[0]]} != {ref.reshape(-1)[mismatched[0]]}")
