"""Shared test helpers, as session-scoped fixtures (so hypothesis tests can use them too).

- `random_inputs(specs, seed)`: fresh standard-normal arrays for a function's arg specs;
- `assert_close(out, ref, dtype=None, what=..., tolerance=None)`: compares in float64 with per-dtype
  tolerances (or an explicit `(relative, max-abs)` pair);
- `assert_matches_reference(compiled, arrays)`: tile interpreter vs the Graph IR oracle (exact, float64),
  with the oracle's tolerance for each output (`tessera.interpreter.reference.output_tolerances`).
"""
from __future__ import annotations

import os

# The tile interpreter runs many small matmuls, where OpenBLAS threads only add overhead; on a loaded
# 2-core machine their spin-waiting made single attention tests 20-50x slower (0.3 s -> 6-17 s).
# This has to happen before NumPy is first imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Every Target IR module a test builds goes through the async-hazard checker (tessera.passes.check_async):
# the target stage raises on a hazard.
os.environ.setdefault("TESSERA_CHECK_ASYNC", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tessera import dtypes  # noqa: E402

#: dtype name -> (relative error bound ||out - ref|| / ||ref||, max-abs bound as a fraction of max(1, max|ref|)).
#: For `assert_close` against references of the test's own; `assert_matches_reference` takes the
#: oracle's tolerance, from the output's dtype and reduction length.
TOLERANCES = {
    "fp32": (1e-5, 1e-4),
    "fp16": (1e-2, 2e-2),
    "bf16": (3e-2, 8e-2),
}


def _tolerance(*dts) -> tuple[float, float]:
    """The loosest tolerance among the float dtypes involved."""
    rel, mx = 0.0, 0.0
    for dt in dts:
        try:
            name = dtypes.lookup(dt).name
        except TypeError:  # float64 and other non-Tessera dtypes: no looser than fp32
            name = "fp32"
        if name in TOLERANCES:
            r, m = TOLERANCES[name]
            rel, mx = max(rel, r), max(mx, m)
    return (rel, mx) if rel else TOLERANCES["fp32"]


def _assert_close(out, ref, dtype=None, what: str = "output", tolerance: tuple[float, float] | None = None) -> None:
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    if out.dtype == np.bool_ or np.issubdtype(out.dtype, np.integer):
        np.testing.assert_array_equal(out, ref, err_msg=what)
        return
    o, r = out.astype(np.float64), ref.astype(np.float64)
    # Outputs start as NaN poison: a NaN where the reference has a number is an unwritten element.
    assert not np.isnan(o[~np.isnan(r)]).any(), (
        f"{what}: {int(np.isnan(o[~np.isnan(r)]).sum())} of {o.size} elements are NaN (never written?)")
    assert np.array_equal(np.isnan(o), np.isnan(r)), f"{what}: NaN pattern differs from the reference"
    assert np.array_equal(np.isinf(o), np.isinf(r)) and np.array_equal(o[np.isinf(o)], r[np.isinf(r)]), (
        f"{what}: infinities differ from the reference")
    finite = np.isfinite(r)
    o, r = o[finite], r[finite]
    if r.size == 0:
        return
    rel_tol, abs_tol = tolerance or _tolerance(*([dtype] if dtype is not None else [out.dtype]))
    diff = np.abs(o - r)
    norm = np.linalg.norm(r)
    rel = np.linalg.norm(o - r) / norm if norm > 0 else np.linalg.norm(o - r)
    scale = max(1.0, float(np.abs(r).max()))
    assert rel <= rel_tol, f"{what}: relative error {rel:.3e} > {rel_tol:.0e}"
    assert diff.max() <= abs_tol * scale, (
        f"{what}: max abs error {diff.max():.3e} > {abs_tol:.0e} * {scale:.3g} at index "
        f"{np.unravel_index(int(diff.argmax()), diff.shape)}")


@pytest.fixture(scope="session")
def random_inputs():
    def make(specs, seed: int, low: float | None = None, high: float | None = None) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        arrays = []
        for s in specs:
            if low is not None:
                x = rng.uniform(low, high, s.shape)
            else:
                x = rng.standard_normal(s.shape)
            arrays.append(np.asarray(x).astype(s.dtype.np))
        return arrays
    return make


@pytest.fixture(scope="session")
def assert_close():
    return _assert_close


@pytest.fixture(scope="session")
def assert_matches_reference():
    def check(compiled, arrays, dtype=None) -> list[np.ndarray]:
        """Runs the tile interpreter and the exact (float64) oracle; each output's tolerance is the
        oracle's `output_tolerances` (its least precise dtype and reduction length), or `dtype`'s."""
        from tessera.interpreter.reference import output_tolerances, tolerance

        outs = compiled.run(*arrays)
        refs = compiled.reference(*arrays)
        assert len(outs) == len(refs)
        tols = output_tolerances(next(iter(compiled.graph.ops)))
        for i, (o, r, tol) in enumerate(zip(outs, refs, tols)):
            if dtype is not None:
                tol = tolerance(dtype)
            _assert_close(o, r, what=f"{compiled.name} output {i}", tolerance=(tol.relative, tol.max_abs))
        return outs
    return check
