"""Item: every op of the elementwise table, on every dtype the frontend accepts for it, runs on
the CPU interpreter against NumPy in float64 and emits PTX that ptxas assembles on both code
paths (sm_80: mma.sync/cp.async; sm_90a: the Hopper path)."""
import shutil

import numpy as np
import pytest

from tessera.backends.ptx import emit_module
from tessera.ir import graph as g

from elementwise_cases import (CASES, DTYPES, SIGMOID_EDGES, TOL, UNDERFLOW, accepted, check, check_sigmoid_edges, inputs,
                               reference, table_function)
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


def test_sigmoid_is_one_op_whose_division_the_tile_ir_marks_approximate():
    """tsr.sigmoid traces to graph.sigmoid; its Tile IR division carries `afn`, which PTX emits as
    div.approx (no IEEE division) and CUDA Tile IR as an approximate divf; a user's `/` stays IEEE."""
    import tessera as tsr
    from tessera import Tensor

    @tsr.function
    def f(x: Tensor["M", "N", tsr.fp32], y: Tensor["M", "N", tsr.fp32]):
        return tsr.sigmoid(x), x / y

    compiled = f.compile(f.arg_specs_for(dict(M=5, N=9)))
    assert "graph.sigmoid" in compiled.ir("graph")
    divisions = [line for line in compiled.ir("tile").splitlines() if "arith.divf" in line]
    assert len(divisions) == 2 and sum("fastmath<afn>" in line for line in divisions) == 1
    ptx = "\n".join(k.ptx for k in compiled.stage("ptx").values())
    assert "div.approx.ftz.f32" in ptx and "div.rn.f32" in ptx


@pytest.mark.parametrize("dt", ["fp32", "fp16", "bf16"])
def test_sigmoid_and_silu_at_their_edges_on_the_interpreter(dt):
    import tessera as tsr
    from tessera import Tensor, dtypes

    d = getattr(dtypes, dt)

    @tsr.function
    def f(x: Tensor["N", d]):
        return tsr.sigmoid(x), tsr.silu(x)

    x = SIGMOID_EDGES.astype(d.np)
    sig, silu = f(x)
    check_sigmoid_edges(sig.astype(np.float32), x.astype(np.float32), TOL[dt], UNDERFLOW[dt])
    # torch's silu: x * sigmoid(x), so -inf * 0 is NaN
    assert silu[0] == 0 and silu[-3] == np.inf and np.isnan(silu[-2]) and np.isnan(silu[-1])


@needs_ptxas
def test_a_gemm_with_a_silu_epilogue_keeps_256_columns_without_spilling():
    """sigmoid's approximate division leaves a 128 x 256 Hopper GEMM's epilogue room in registers (its
    IEEE division spilled 56 bytes, which is why a dividing epilogue takes 128 columns)."""
    import tessera as tsr
    from tessera import Tensor

    @tsr.function
    def mlp(a: Tensor["M", "K", tsr.bf16], b: Tensor["K", "N", tsr.bf16], bias: Tensor["N", tsr.bf16]):
        return tsr.silu(tsr.matmul(a, b) + bias).to(tsr.bf16)

    compiled = mlp.compile(mlp.arg_specs_for(dict(M=4096, K=4096, N=4096)), arch="sm_90a")
    (kernel,) = [op for op in compiled.modules["schedule"].walk() if op.name == "schedule.kernel"]
    assert kernel.param_values["block_n"] == 256
    for assembled in compiled.stage("cubin").values():
        for resources in assembled.resources.values():
            assert resources.spill_store_bytes == 0 and resources.spill_load_bytes == 0
