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
