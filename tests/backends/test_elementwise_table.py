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


@needs_ptxas
def test_a_bf16_tanh_takes_the_hardware_tanh(tmp_path):
    """A tanh whose result is bf16 approximates (Tile IR `afn`): PTX's tanh.approx.f32 errs by
    2^-10.987 of it, a quarter of bf16's own rounding. A soft-capped attention's forward kernel and
    its backward's chains take it. An fp16 tanh (whose rounding is no coarser than the
    approximation's error: tanh's gradient 1 - y^2 would lose more than fp16 itself loses) and an
    fp32 one (a gelu's computes in fp32) keep the accurate one, and so does sm_75 (no bf16: fp16)."""
    import tessera as tsr
    from tessera import dtypes
    from tessera.autodiff.api import Derivative
    from tessera.frontend.trace import ArgSpec
    from tessera.lowering.emit import approximate
    from attention_cases import FUNCTIONS

    assert approximate("tanh", dtypes.bf16) and not approximate("tanh", dtypes.fp16)
    assert not approximate("tanh", dtypes.fp32) and not approximate("exp", dtypes.bf16)

    fn = FUNCTIONS["softcap_causal"]
    specs = [ArgSpec(n, (1, 2, 200, 64), tsr.bf16, ("B", "H", "S", "D")) for n in ("q", "k", "v", "d_out")]
    for compiled in (fn.compile(specs[:3], arch="sm_90a"),
                     Derivative(fn, cotangent_names=["d_out"]).compile(specs, arch="sm_90a")):
        tanhs = [line for line in compiled.ir("tile").splitlines() if "math.tanh" in line]
        assert tanhs and all("fastmath<afn>" in line for line in tanhs)
        soft_capped = [k.ptx for k in compiled.stage("ptx").values() if "tanh" in k.ptx]
        assert soft_capped   # (the forward's kernel; the backward's dQ and dK/dV chains)
        for ptx in soft_capped:
            assert "tanh.approx.f32" in ptx and "rcp.approx" not in ptx
            assemble(ptx, "sm_90a", tmp_path)

    @tsr.function
    def bias_tanh(x: tsr.Tensor["M", "N"], b: tsr.Tensor["N"]):
        return tsr.tanh(x + b), tsr.gelu(x + b, approximate="tanh")

    for dt, arch in [("bf16", "sm_80"), ("bf16", "sm_90a"), ("fp16", "sm_75"), ("fp16", "sm_90a"),
                     ("fp32", "sm_90a")]:
        compiled = bias_tanh.compile(bias_tanh.arg_specs_for(dict(M=5, N=9), dt), arch=arch)
        tanhs = [line for line in compiled.ir("tile").splitlines() if "math.tanh" in line]
        assert [("fastmath<afn>" in line) for line in tanhs] == [dt == "bf16", False]
        kernels = [k.ptx for k in compiled.stage("ptx").values()]
        assert sum(ptx.count("tanh.approx.f32") for ptx in kernels) == (8 if dt == "bf16" else 0)
        for ptx in kernels:
            assemble(ptx, arch, tmp_path)


def test_bf16_is_refused_before_sm80_with_the_reason():
    """sm_75 has no bf16 conversions: a bf16 result is an early, named error, not PTX that ptxas
    rejects; sm_80 compiles it."""
    import tessera as tsr
    from tessera.backends.ptx.types import UnsupportedByBackend

    @tsr.function
    def doubled(x: tsr.Tensor["N", tsr.bf16]):
        return x * 2.0

    with pytest.raises(UnsupportedByBackend, match="bf16 conversions .* need sm_80 or later; sm_75 has no bf16"):
        doubled.compile(doubled.arg_specs_for({"N": 8}), arch="sm_75").stage("ptx")
    assert doubled.compile(doubled.arg_specs_for({"N": 8}), arch="sm_80").stage("ptx")


@needs_ptxas
def test_maximum_and_row_max_propagate_nan_on_sm75_without_max_nan(tmp_path):
    """max.NaN / min.NaN need sm_80: on sm_75 a float maximum (elementwise, and a row reduction's
    combines, softmax's max among them) is max.f32 plus the sum of its operands where either is NaN,
    which ptxas assembles for sm_75; sm_80 keeps the single instruction."""
    import tessera as tsr

    @tsr.function
    def maxima(x: tsr.Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1), tsr.maximum(x, 0.5), tsr.amax(x, 1)

    for arch, nan_ops in (("sm_75", False), ("sm_80", True)):
        kernels = maxima.compile(maxima.arg_specs_for({"M": 33, "N": 1000}, "fp16"), arch=arch).stage("ptx")
        assert len(kernels) == 3
        for kernel in kernels.values():
            assert (".NaN.f32" in kernel.ptx) == nan_ops and ("setp.nan.f32" in kernel.ptx) != nan_ops
            assemble(kernel.ptx, arch, tmp_path)
