"""The public Python API, used the way the seeds write it.

`import tessera as tsr; from tessera import Tensor`, `@tsr.function` with symbolic
`Tensor["B", "H", "S", "D"]` annotations, calling with NumPy arrays, `@tsr.kernel`
destination passing, `@tsr.kernel.autotune`, `TargetIRCompiler`, `fn.compile` and
the `Compiled` object, IR dumps.
"""
import math

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor


def np_attention(q, k, v, scale=None, causal=False):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        i = np.arange(s.shape[-2])[:, None]
        j = np.arange(s.shape[-1])[None, :]
        s = np.where(i >= j, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def qkv(shape, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


# --- the seeds' flash attention, verbatim -------------------------------------------------------------------

@tsr.function
def flash_attention(q: Tensor["B", "H", "S", "D"],
                   k: Tensor["B", "H", "S", "D"],
                   v: Tensor["B", "H", "S", "D"]) -> Tensor["B", "H", "S", "D"]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = tsr.matmul(q, k.transpose(-2, -1)) * scale
    probs = tsr.softmax(scores, dim=-1)
    return tsr.matmul(probs, v)


@pytest.mark.parametrize("dtype,tol", [(np.float16, 1e-2), (np.float32, 1e-5)])
def test_seed_flash_attention_called_with_numpy(dtype, tol):
    q, k, v = qkv((2, 3, 77, 64), dtype)
    out = flash_attention(q, k, v)
    assert isinstance(out, np.ndarray)
    assert out.shape == q.shape and out.dtype == dtype
    assert not np.isnan(out).any()
    assert rel_err(out, np_attention(q, k, v)) < tol


def test_function_respecialises_per_shape_and_dtype():
    for shape, dtype in [((1, 1, 5, 64), np.float16), ((2, 2, 33, 128), np.float16), ((1, 2, 9, 64), np.float32)]:
        q, k, v = qkv(shape, dtype, seed=len(shape))
        out = flash_attention(q, k, v)
        assert out.shape == shape and out.dtype == dtype
        assert rel_err(out, np_attention(q, k, v)) < 1e-2
    # Same shapes again: served from the cache, same answer.
    q, k, v = qkv((1, 1, 5, 64), np.float16, seed=4)
    assert np.array_equal(flash_attention(q, k, v), flash_attention(q, k, v))


def test_the_seeds_readme_causal_attention():
    @tsr.function
    def causal_attention(q: Tensor["B", "H", "S", "D"],
                         k: Tensor["B", "H", "S", "D"],
                         v: Tensor["B", "H", "S", "D"]) -> Tensor["B", "H", "S", "D"]:
        scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        rows, cols = tsr.arange(q.shape[-2]), tsr.arange(k.shape[-2])
        scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
        return tsr.matmul(tsr.softmax(scores, dim=-1), v)

    q, k, v = qkv((2, 2, 100, 64))
    assert rel_err(causal_attention(q, k, v), np_attention(q, k, v, causal=True)) < 1e-2


def test_arg_specs_compile_and_the_compiled_object():
    specs = flash_attention.arg_specs_for({"B": 2, "H": 4, "S": 130, "D": 64}, "fp16")
    assert [s.name for s in specs] == ["q", "k", "v"]
    assert all(s.shape == (2, 4, 130, 64) and s.dtype == tsr.fp16 and s.dims == ("B", "H", "S", "D")
               for s in specs)
    c = flash_attention.compile(specs)
    assert set(c.modules) >= {"graph", "schedule", "tile", "target"}
    assert c.kernel_names == ["flash_attention_flash_attention_0"]
    assert c.arg_names == ["q", "k", "v"]
    assert "graph.matmul" in c.ir("graph") and "schedule.kernel" in c.ir("schedule")
    assert "[B, H, S, D]" in c.ir("graph")  # the IR keeps the symbolic names
    q, k, v = qkv((2, 4, 130, 64), seed=3)
    (out,) = c.run(q, k, v)
    (ref,) = c.reference(q, k, v)
    assert rel_err(out, ref) < 1e-2 and rel_err(out, np_attention(q, k, v)) < 1e-2


def test_a_numpy_call_builds_no_gpu_stage(monkeypatch):
    """The CPU interpreter runs the tile stage: target, ptx and cubin are never built for it."""
    from tessera import compiler

    made = []
    real = compiler.compile_module
    monkeypatch.setattr(compiler, "compile_module", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    q, k, v = qkv((1, 2, 20, 64), seed=5)
    assert rel_err(flash_attention(q, k, v), np_attention(q, k, v)) < 1e-2
    (compiled,) = made
    assert compiled.computed_stages == ("graph", "schedule", "tile")


def test_ir_dump_writes_every_stage(tmp_path):
    specs = flash_attention.arg_specs_for({"B": 1, "H": 1, "S": 16, "D": 64}, "fp16")
    flash_attention.compile(specs, dump=("all",), dump_dir=tmp_path)
    for stage in ("graph", "schedule", "tile", "target"):
        text = (tmp_path / f"{stage}.mlir").read_text()
        assert text.startswith("builtin.module")
    ptx = (tmp_path / "flash_attention_flash_attention_0.ptx").read_text()
    assert ptx.startswith(".version") and ".entry flash_attention_flash_attention_0(" in ptx


def test_ptx_dump_of_a_kernel_the_backend_cannot_emit_says_why(tmp_path, caplog):
    """fp32 matmuls have no PTX path yet: under the PTX backend (auto gives them to tileiras) the
    PTX dump is a logged warning naming the reason; the IR dumps and the CPU interpreter still work."""
    @tsr.function
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return tsr.matmul(a, b)

    compiled = mm.compile(mm.arg_specs_for(dict(M=16, K=16, N=16), "fp32"), dump=("all",), dump_dir=tmp_path,
                          backend="ptx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph.mlir", "schedule.mlir", "target.mlir", "tile.mlir"]
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "no PTX dumped for mm: " in record.message
    assert "matmul of fp32 operands" in record.message
    a = np.eye(16, dtype=np.float32)
    (out,) = compiled.run(a, a)
    np.testing.assert_array_equal(out, a)


def test_ir_dump_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DUMP_IR", "graph,tile,ptx")
    monkeypatch.setenv("TESSERA_DUMP_DIR", str(tmp_path))
    flash_attention.compile(flash_attention.arg_specs_for({"B": 1, "H": 1, "S": 16, "D": 64}, "fp16"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flash_attention_flash_attention_0.ptx", "graph.mlir",
                                                          "tile.mlir"]


def test_unknown_dump_stage_is_an_error():
    with pytest.raises(tsr.TesseraError, match=r"unknown IR stage\(s\) \['cubin'\] to dump; stages are "
                                               r"graph, schedule, tile, target, ptx, cuda_tile, or all"):
        flash_attention.compile(flash_attention.arg_specs_for({"B": 1, "H": 1, "S": 16, "D": 64}, "fp16"),
                                dump=("cubin",))


# --- TargetIRCompiler (seed 001's Python integration) ----------------------------------------------------------

def test_target_ir_compiler_as_in_the_seeds():
    from tessera.target import TargetIRCompiler

    class TesseraFlashAttention:
        """The seeds' torch.nn.Module, minus torch: same constructor, same compile call."""

        def __init__(self, head_dim, target_arch="sm_90"):
            self.head_dim = head_dim
            self.scale = 1.0 / math.sqrt(head_dim)
            self.compiled_kernel = self._compile_kernel(target_arch)

        def _compile_kernel(self, target_arch):
            @tsr.function
            def flash_attention_impl(q, k, v):
                scores = tsr.matmul(q, k.transpose(-2, -1)) * self.scale
                probs = tsr.softmax(scores, dim=-1)
                return tsr.matmul(probs, v)

            compiler = TargetIRCompiler(
                target_platform="cuda",
                target_architecture=target_arch,
                optimization_level=3,
                enable_tensor_cores=True,
                enable_autotuning=True
            )
            return compiler.compile(flash_attention_impl)

        def forward(self, q, k, v):
            return self.compiled_kernel(q, k, v)

    attention = TesseraFlashAttention(64, target_arch="sm_90")
    q, k, v = qkv((2, 3, 50, 64))
    out = attention.forward(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == np.float16
    assert np.max(np.abs(out - np_attention(q, k, v))) < 1e-2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100a"])
def test_target_ir_compiler_accepts_a_plain_python_function(arch):
    from tessera.target import TargetIRCompiler

    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1), v)

    run = TargetIRCompiler(target_platform="cuda", target_architecture=arch).compile(attention)
    q, k, v = qkv((1, 2, 40, 64), seed=7)
    assert rel_err(run(q, k, v), np_attention(q, k, v, scale=0.125)) < 1e-2


def test_target_ir_compiler_rejects_a_mismatched_platform():
    from tessera.target import TargetIRCompiler

    with pytest.raises(tsr.TesseraError, match="hip|amd|nvidia|cuda") as info:
        TargetIRCompiler(target_platform="hip", target_architecture="sm_90")
    assert "test_api.py" in info.value.location


# --- @tsr.kernel: destination passing ----------------------------------------------------------------------------

def test_kernel_destination_passing_unannotated():
    @tsr.kernel
    def k(A, B, C):
        C[:] = tsr.matmul(A, B)

    rng = np.random.default_rng(0)
    A = rng.standard_normal((33, 20)).astype(np.float32)
    B = rng.standard_normal((20, 17)).astype(np.float32)
    C = np.full((33, 17), np.nan, np.float32)
    assert k(A, B, C) is None
    np.testing.assert_allclose(C, A.astype(np.float64) @ B, rtol=1e-5, atol=1e-5)


def test_kernel_destination_passing_annotated_mixed_precision():
    @tsr.kernel
    def gemm(A: Tensor["M", "K", tsr.fp16], B: Tensor["K", "N", tsr.fp16], C: Tensor["M", "N", tsr.fp32]):
        C[:] = tsr.matmul(A, B)

    rng = np.random.default_rng(1)
    A = rng.standard_normal((70, 45)).astype(np.float16)
    B = rng.standard_normal((45, 30)).astype(np.float16)
    C = np.full((70, 30), np.nan, np.float32)
    gemm(A, B, C)
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-4, atol=1e-3)


def test_kernel_writes_several_outputs():
    @tsr.kernel
    def add_and_scale(a: Tensor["N"], b: Tensor["N"], total: Tensor["N"], scaled: Tensor["N"]):
        total[:] = a + b
        scaled[...] = a * 2.0

    a, b = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    total, scaled = np.zeros(5, np.float32), np.zeros(5, np.float32)
    add_and_scale(a, b, total, scaled)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(scaled, a * 2)


def test_kernel_autotune_decorator_as_in_the_seeds():
    @tsr.kernel.autotune(
        space=dict(
            BLOCK_M=[64, 128, 256],
            BLOCK_N=[64, 128, 256],
            BLOCK_K=[32, 64, 128],
            num_warps=[4, 8, 16],
            num_stages=[2, 3, 4]
        ),
        key=["M", "N", "K"],
        cache="~/.tessera/autotune_cache"
    )
    def optimized_kernel(A: Tensor["M", "K", tsr.fp16],
                         B: Tensor["K", "N", tsr.fp16],
                         C: Tensor["M", "N", tsr.fp32]):
        C[:] = tsr.matmul(A, B)

    assert optimized_kernel.autotune_key == ("M", "N", "K")
    rng = np.random.default_rng(2)
    A = rng.standard_normal((65, 40)).astype(np.float16)
    B = rng.standard_normal((40, 130)).astype(np.float16)
    C = np.full((65, 130), np.nan, np.float32)
    optimized_kernel(A, B, C)
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=1e-4, atol=1e-3)


def test_kernel_must_not_return_a_value():
    @tsr.kernel
    def bad(a: Tensor["N"], out: Tensor["N"]):
        out[:] = a
        return a

    with pytest.raises(tsr.TesseraError, match="must not return"):
        bad(np.zeros(3, np.float32), np.zeros(3, np.float32))


# --- calling conventions -----------------------------------------------------------------------------------------

def test_python_number_arguments_are_constants():
    @tsr.function
    def scaled(x: Tensor["N", "M"], alpha, shift):
        return x * alpha + shift

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(scaled(x, 2.5, 1), x * 2.5 + 1, rtol=1e-6)
    np.testing.assert_allclose(scaled(x, -1.0, 0), -x, rtol=1e-6)


def test_several_results_come_back_as_a_tuple():
    @tsr.function
    def two(x: Tensor["N", "M"]):
        return x + 1.0, tsr.softmax(x, dim=-1)

    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    a, b = two(x)
    np.testing.assert_allclose(a, x + 1, rtol=1e-6)
    np.testing.assert_allclose(b.sum(-1), np.ones(3), rtol=1e-5)


def test_wrong_number_of_arguments():
    with pytest.raises(tsr.TesseraError, match="takes 3 arguments") as info:
        flash_attention(np.zeros((1, 1, 4, 64), np.float16))
    assert "test_api.py" in info.value.location


def test_non_array_argument():
    with pytest.raises(tsr.TesseraError, match="'k'") as info:
        flash_attention(np.zeros((1, 1, 4, 64), np.float16), "k", np.zeros((1, 1, 4, 64), np.float16))
    assert "test_api.py" in info.value.location


def test_dtype_names_and_aliases():
    assert tsr.float16 is tsr.fp16 and tsr.half is tsr.fp16
    assert tsr.float32 is tsr.fp32 and tsr.bfloat16 is tsr.bf16
    spec = Tensor["M", "K", tsr.fp16]
    assert spec.dims == ("M", "K") and spec.dtype is tsr.fp16
    assert Tensor["M", "K", "bf16"].dtype is tsr.bf16
    assert Tensor["B", 1, "N"].dims == ("B", 1, "N") and Tensor["B", 1, "N"].dtype is None


def test_ops_outside_a_trace_are_an_error():
    with pytest.raises(tsr.TesseraError, match="inside a @tessera.function"):
        tsr.arange(4)


def test_importing_tessera_does_not_load_xdsl():
    import subprocess
    import sys

    code = "import sys, tessera; print(any(m == 'xdsl' or m.startswith('xdsl.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
