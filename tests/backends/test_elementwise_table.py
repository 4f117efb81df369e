"""Item: every op of the elementwise table, on every dtype the frontend accepts for it, runs on
the CPU interpreter against NumPy in float64 and emits PTX that ptxas assembles on both code
paths (sm_80: mma.sync/cp.async; sm_90a: the Hopper path)."""
import shutil

import numpy as np
import pytest

from tessera.backends.ptx import emit_module
from tessera.ir import graph as g

from elementwise_cases import CASES, DTYPES, accepted, check, inputs, reference, table_function
from test_ptx_emitter import assemble

needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
IDS = [f"{k}-{dt.name}" for k, dt in CASES]


def _result_dtype(kind, fn, dims):
    return g.elementwise_result_dtype(g.ELEMENTWISE[kind], [s.dtype for s in fn.arg_specs_for(dims)][-2:]
                                      if kind == "where" else [s.dtype for s in fn.arg_specs_for(dims)])


def test_the_table_walk_covers_ints_and_bools():
    """Integer and bool cases are in the walk (abs of int32 among them), fp8 arithmetic is not."""
    names = {(k, dt.name) for k, dt in CASES}
    assert {("abs", "int32"), ("neg", "int32"), ("maximum", "bool"), ("lt", "bool"), ("where", "int32")} <= names
    assert not accepted("add", DTYPES[3]) and not accepted("neg", DTYPES[-1])


@pytest.mark.parametrize("dims", [dict(M=1, N=1), dict(M=7, N=13), dict(M=3, N=1000)], ids=str)
@pytest.mark.parametrize("kind,dt", CASES, ids=IDS)
def test_elementwise_on_the_interpreter(kind, dt, dims):
    fn = table_function(kind, dt)
    arrays = inputs(kind, dt, fn, dims, np.random.default_rng(7))
    check(fn(*arrays), reference(kind, arrays), _result_dtype(kind, fn, dims))


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("kind,dt", CASES, ids=IDS)
def test_elementwise_ptx_assembles(kind, dt, arch, tmp_path):
    fn = table_function(kind, dt)
    compiled = fn.compile(fn.arg_specs_for(dict(M=7, N=13)), arch=arch)
    kernels = emit_module(compiled.modules["target"])
    assert kernels
    for kernel in kernels.values():
        assemble(kernel.ptx, arch, tmp_path)
