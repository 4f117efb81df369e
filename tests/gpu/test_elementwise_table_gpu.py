"""Every op of the elementwise table on every dtype the frontend accepts for it, on the GPU on
both code paths, against NumPy in float64 (the cases of tests/elementwise_cases.py)."""
import numpy as np
import pytest

from tessera.ir import graph as g

from elementwise_cases import CASES, check, inputs, reference, table_function
from numpy_on_gpu import run_on_gpu


@pytest.mark.parametrize("path", ["native", "ampere"])
@pytest.mark.parametrize("dims", [dict(M=1, N=1), dict(M=7, N=13), dict(M=33, N=1000)], ids=str)
@pytest.mark.parametrize("kind,dt", CASES, ids=[f"{k}-{dt.name}" for k, dt in CASES])
def test_elementwise_table_on_gpu(torch_cuda, kind, dt, dims, path):
    fn = table_function(kind, dt)
    arrays = inputs(kind, dt, fn, dims, np.random.default_rng(3))
    (out,) = run_on_gpu(fn, dims, arrays, torch_cuda, path)
    specs = fn.arg_specs_for(dims)
    operand_dts = [s.dtype for s in specs][-2:] if kind == "where" else [s.dtype for s in specs]
    check(out, reference(kind, arrays), g.elementwise_result_dtype(g.ELEMENTWISE[kind], operand_dts))


@pytest.mark.parametrize("path", ["native", "ampere"])
@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
def test_sigmoid_and_silu_at_their_edges_on_gpu(torch_cuda, dt, path):
    """The approximate division at sigmoid's asymptotes and past 2^126 (-87.5, -88.8: quotient 0),
    against float64 and against torch's own sigmoid and silu on the same inputs."""
    import tessera as tsr
    from tessera import Tensor, dtypes

    from elementwise_cases import SIGMOID_EDGES, TOL, UNDERFLOW, check_sigmoid_edges
    from numpy_on_gpu import to_torch

    d = getattr(dtypes, dt)

    @tsr.function
    def f(x: Tensor["N", d]):
        return tsr.sigmoid(x), tsr.silu(x)

    x = np.concatenate([SIGMOID_EDGES, np.linspace(-30, 30, 1000, dtype=np.float32)]).astype(d.np)
    sig, silu = run_on_gpu(f, dict(N=x.size), [x], torch_cuda, path)
    check_sigmoid_edges(sig.astype(np.float32), x.astype(np.float32), TOL[dt], UNDERFLOW[dt])
    xt = to_torch(x, torch_cuda)
    for ours, theirs in ((sig, torch_cuda.sigmoid(xt)), (silu, torch_cuda.nn.functional.silu(xt))):
        theirs = theirs.float().cpu().numpy()
        ours = ours.astype(np.float32)
        assert np.array_equal(np.isnan(ours), np.isnan(theirs))
        ok = ~np.isnan(theirs)
        # silu(-87.5) is -8.7e-37 in torch and -0.0 here: the approximate division's quotient past 2^126
        np.testing.assert_allclose(ours[ok], theirs[ok], rtol=TOL[dt], atol=1e-35)
