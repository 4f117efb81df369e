"""The elementwise table x every dtype, as cases shared by the CPU test (interpreter and PTX for
sm_80 and sm_90a) and the GPU test: a function per (op, dtype), inputs inside each op's domain,
and the float64 NumPy reference."""
import numpy as np

import tessera as tsr
from tessera import Tensor, dtypes
from tessera.errors import DTypeError
from tessera.frontend import ops
from tessera.ir import graph as g

DTYPES = list(dtypes.ALL)
#: ops whose operands (the first, for a float pow) must be positive
POSITIVE = {"log", "log2", "sqrt", "rsqrt", "pow"}
#: relative error allowed against float64, by result dtype (the result's own rounding dominates)
TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2}


def table_function(kind: str, dt) -> tsr.Function:
    """`kind` on operands of dtype `dt` that broadcast ([M, N] with [N]); where's condition is bool."""
    arity = g.ELEMENTWISE[kind].arity
    if arity == 1:
        def f(x: Tensor["M", "N", dt]):
            return ops.elementwise(kind, x)
    elif arity == 2:
        def f(x: Tensor["M", "N", dt], y: Tensor["N", dt]):
            return ops.elementwise(kind, x, y)
    else:
        def f(c: Tensor["M", "N", dtypes.bool_], x: Tensor["M", "N", dt], y: Tensor["N", dt]):
            return ops.elementwise(kind, c, x, y)
    f.__name__ = f"{kind}_{dt.name}"
    return tsr.function(f)


def accepted(kind: str, dt) -> bool:
    """Whether the frontend takes `kind` on `dt` (it refuses what torch refuses: fp8 arithmetic,
    neg and sub of bools), checked by tracing."""
    fn = table_function(kind, dt)
    try:
        fn.trace(fn.arg_specs_for({"M": 2, "N": 3}))
    except DTypeError:
        return False
    return True


CASES = [(kind, dt) for kind in g.ELEMENTWISE for dt in DTYPES if accepted(kind, dt)]


def inputs(kind: str, dt, fn: tsr.Function, dims: dict, rng: np.random.Generator) -> list[np.ndarray]:
    """Random operands in storage dtypes: ints in [-9, 9] (nonzero divisors), floats of both signs
    (positive where the op needs it), bools at random."""
    arrays = []
    for i, spec in enumerate(fn.arg_specs_for(dims)):
        if spec.dtype == dtypes.bool_:
            arrays.append(rng.random(spec.shape) < 0.5)
            continue
        if spec.dtype.is_float:
            x = rng.uniform(0.25, 3.0, spec.shape) * rng.choice([-1.0, 1.0], spec.shape)
        else:
            x = rng.integers(1, 10, spec.shape) * rng.choice([-1, 1], spec.shape)
        if kind == "pow" and not spec.dtype.is_float:
            x = x if i == 0 else np.abs(x) % 4     # negative bases, integral exponents 0..3
        elif kind in POSITIVE and (i == 0 or kind != "pow"):
            x = np.abs(x)
        arrays.append(np.asarray(x).astype(spec.dtype.np))
    return arrays


def reference(kind: str, arrays: list[np.ndarray]) -> np.ndarray:
    """The op's NumPy reference in float64 (int64 for ints and bools, which NumPy would otherwise
    take to float16 in `exp`; where's condition stays bool)."""
    wide = [a if kind == "where" and i == 0 else a.astype(np.float64 if a.dtype.kind == "f" or
                                                           a.dtype.kind == "V" else np.int64)
            for i, a in enumerate(arrays)]
    return np.asarray(g.ELEMENTWISE[kind].ref(*wide))


def check(out: np.ndarray, ref: np.ndarray, out_dt) -> None:
    """Exact for ints and bools; else relative error by the result dtype, with NaN where NaN."""
    out = np.asarray(out)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not out_dt.is_float:
        np.testing.assert_array_equal(out, ref.astype(out_dt.np))   # bool + bool is their or, as in torch
        return
    np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=TOL[out_dt.name],
                               atol=TOL[out_dt.name])


#: sigmoid's asymptotes and the edges of its approximate division (a denominator past 2^126 gives 0)
SIGMOID_EDGES = np.array([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 20.0, -20.0, 87.0, -87.0, 87.5, -87.5, 88.8, -88.8,
                          1e4, -1e4, 3e38, -3e38, np.inf, -np.inf, np.nan], np.float32)


#: the absolute error a result may have where it underflows: fp32 and bf16 flush values under 2^-126
#: (the approximate division's quotient past 2^126), fp16 rounds to its smallest subnormal (6e-8)
UNDERFLOW = {"fp32": 2e-38, "bf16": 2e-38, "fp16": 6e-8}


def check_sigmoid_edges(out: np.ndarray, x: np.ndarray, rtol: float, underflow: float = 2e-38) -> None:
    """Against float64: `rtol` where sigmoid is a normal float, at most `underflow` absolute where it
    underflows, NaN for NaN."""
    with np.errstate(invalid="ignore"):
        want = np.exp(-np.logaddexp(0.0, -x.astype(np.float64)))
    assert np.array_equal(np.isnan(out), np.isnan(x))
    ok = ~np.isnan(x)
    err = np.abs(out[ok].astype(np.float64) - want[ok])
    bad = err > np.maximum(rtol * want[ok], underflow)
    assert not bad.any(), (x[ok][bad], out[ok][bad], want[ok][bad])
