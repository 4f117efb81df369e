"""The CUDA Tile IR backend's cases, shared by the CPU tests (lowering, bytecode, tileiras, the
NumPy run of the cuda_tile program) and the GPU test: every kernel kind (elementwise chains, row
reductions, column reductions, GEMMs with fused epilogues, split-K, flash attention
plain/causal/score-modified, split-KV decode, the norm and attention backwards' kernels) at
awkward shapes, fp16 and bf16; and strided inputs (`Case.strides`: [B, S, H, D] views, slices)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import tessera as tsr
from tessera import Tensor
from tessera.frontend.function import ArgSpec

import attention_cases


@tsr.function
def gelu_scale(x: Tensor["M", "N"], y: Tensor["N"]):
    return (tsr.gelu(x) * 2.0 + y).to(x.dtype)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, [x.shape[-1]], w, b)


@tsr.function
def rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, [x.shape[-1]], w)


@tsr.function
def gemm_bias_gelu(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
    return tsr.gelu(tsr.matmul(a, b) + bias)


@tsr.function
def gemm_tn(a: Tensor["K", "M"], b: Tensor["K", "N"]):
    return tsr.matmul(a.transpose(0, 1), b)


@tsr.function
def gemm_nt_silu(a: Tensor["M", "K"], b: Tensor["N", "K"]):
    return tsr.silu(tsr.matmul(a, b.transpose(0, 1)))


@dataclass(frozen=True)
class Case:
    name: str
    fn: object
    shapes: dict[str, tuple[int, ...]]    # argument name -> shape
    dtype: str = "fp16"
    strides: tuple[tuple[str, tuple[int, ...]], ...] = ()   # (argument, element strides) passed strided

    @property
    def id(self) -> str:
        return f"{self.name}-{self.dtype}"

    def specs(self) -> list[ArgSpec]:
        dt, strides = getattr(tsr, self.dtype), dict(self.strides)
        return [ArgSpec(name, shape, dt, shape, strides.get(name)) for name, shape in self.shapes.items()]

    def inputs(self, seed: int = 0) -> list[np.ndarray]:
        """Random inputs (float32 values rounded to the dtype, as NumPy arrays of float32)."""
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(shape).astype(np.float32) for shape in self.shapes.values()]


def _qkv(b, h, m, n, d, **extra):
    return {"q": (b, h, m, d), "k": (b, h, n, d), "v": (b, h, n, d), **extra}


def _bshd(b, h, s, d, apart: int = 1) -> tuple[int, ...]:
    """The strides of a [B, H, S, D] view of a [B, S, H * apart, D] buffer (apart 3: a packed QKV projection)."""
    return (s * h * apart * d, apart * d, h * apart * d, 1)


def _vjp(kind: str):
    """The backward of attention `kind` (recomputing the forward: no saved values), built apart from
    `tsr.vjp`'s own, which it keeps on the function (tests count those)."""
    from tessera.autodiff.api import Derivative
    return Derivative(attention_cases.FUNCTIONS[kind], cotangent_names=[_cotangent()])


@tsr.function
def column_sum(x: Tensor["M", "N"]):
    return tsr.sum(x, 0)


def _norm_vjp(fn):
    """A norm's backward recomputing its statistics (no saved values: one dtype for every argument),
    built apart from `tsr.vjp`'s own: a row kernel with the weight's (and bias's) column sums riding
    it, and the kernels combining their partials."""
    from tessera.autodiff.api import Derivative
    return Derivative(fn, cotangent_names=[_cotangent()])


def _cotangent() -> str:
    from tessera.autodiff.backward import cotangent_name
    return cotangent_name(0, {"q", "k", "v"})


def cases() -> list[Case]:
    out = []
    for dtype in ("fp16", "bf16"):
        out += [
            Case("elementwise", gelu_scale, {"x": (1000, 37), "y": (37,)}, dtype),
            Case("elementwise_1", gelu_scale, {"x": (1, 1), "y": (1,)}, dtype),
            Case("softmax", softmax, {"x": (17, 4097)}, dtype),
            Case("layer_norm", layer_norm, {"x": (1000, 256), "w": (256,), "b": (256,)}, dtype),
            Case("rms_norm", rms_norm, {"x": (31, 1000), "w": (1000,)}, dtype),
            Case("gemm", gemm_bias_gelu, {"a": (1000, 512), "b": (512, 384), "bias": (384,)}, dtype),
            Case("gemm_odd", gemm_bias_gelu, {"a": (17, 64), "b": (64, 200), "bias": (200,)}, dtype),
            Case("gemm_split_k", gemm_bias_gelu, {"a": (128, 4096), "b": (4096, 128), "bias": (128,)}, dtype),
            Case("gemm_tn", gemm_tn, {"a": (256, 300), "b": (256, 192)}, dtype),
            Case("gemm_nt", gemm_nt_silu, {"a": (300, 128), "b": (260, 128)}, dtype),
            Case("attention", attention_cases.FUNCTIONS["plain"], _qkv(2, 3, 1000, 1000, 64), dtype),
            Case("attention_d128", attention_cases.FUNCTIONS["plain"], _qkv(1, 2, 257, 257, 128), dtype),
            Case("causal", attention_cases.FUNCTIONS["causal"], _qkv(2, 2, 1000, 1000, 128), dtype),
            Case("softcap_causal", attention_cases.FUNCTIONS["softcap_causal"], _qkv(1, 2, 333, 333, 64), dtype),
            Case("alibi", attention_cases.FUNCTIONS["alibi"], _qkv(1, 2, 257, 257, 64), dtype),
            Case("decode", attention_cases.FUNCTIONS["plain"], _qkv(1, 2, 1, 4097, 128), dtype),
            Case("temperature", attention_cases.temperature, _qkv(1, 2, 257, 257, 64, t=(1,)), dtype),
            Case("causal_temperature", attention_cases.causal_temperature, _qkv(2, 2, 300, 300, 64, t=(1,)), dtype),
            Case("column_sum", column_sum, {"x": (4097, 300)}, dtype),
            Case("rms_norm_backward", _norm_vjp(rms_norm), {"x": (300, 1000), "w": (1000,), _cotangent(): (300, 1000)},
                 dtype),
            Case("layer_norm_backward", _norm_vjp(layer_norm),
                 {"x": (97, 256), "w": (256,), "b": (256,), _cotangent(): (97, 256)}, dtype),
            Case("causal_backward", _vjp("causal"), _qkv(1, 2, 300, 300, 64, **{_cotangent(): (1, 2, 300, 64)}),
                 dtype),
            Case("attention_strided", attention_cases.FUNCTIONS["causal"], _qkv(2, 3, 333, 333, 64), dtype,
                 (("q", _bshd(2, 3, 333, 64)), ("k", _bshd(2, 3, 333, 64, 3)), ("v", _bshd(2, 3, 333, 64, 3)))),
            Case("gemm_strided", gemm_bias_gelu, {"a": (1000, 512), "b": (512, 384), "bias": (384,)}, dtype,
                 (("a", (576, 1)), ("b", (448, 1)))),
            Case("rms_norm_strided", rms_norm, {"x": (31, 1000), "w": (1000,)}, dtype, (("x", (1024, 1)),)),
        ]
    return out


CASES = {c.id: c for c in cases()}


def reference(case: Case, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The Graph IR oracle in float64 on `inputs` rounded to the case's dtype."""
    compiled = case.fn.compile(case.specs(), backend="cuda-tile")
    return compiled.reference(*[as_dtype(x, case.dtype) for x in inputs])


def laid_out(case: Case, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """`arrays` (the case's inputs) each in the layout the case passes it in: copied into a
    NaN-filled buffer at its strides where it has some, else as they are."""
    strides = dict(case.strides)
    out = []
    for name, x in zip(case.shapes, arrays):
        if name in strides:
            reach = 1 + sum((n - 1) * st for n, st in zip(x.shape, strides[name]))
            storage = np.full(reach, np.nan, x.dtype)
            x_strided = np.lib.stride_tricks.as_strided(storage, x.shape, [st * x.itemsize for st in strides[name]])
            x_strided[...] = x
            x = x_strided
        out.append(x)
    return out


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    from tessera import dtypes
    return x.astype(dtypes.lookup(dtype).np)


def tolerance(dtype: str) -> float:
    """Relative error (of the norm) allowed against float64."""
    return {"fp16": 5e-3, "bf16": 3e-2}[dtype]


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assembled(compiled):
    """`compiled` with every kernel's cubin built. A GPU machine without tileiras takes CUDA Tile IR
    cubins from the cubin cache (TESSERA_CACHE_DIR, filled where tileiras is); where a cubin is in
    neither, the test skips, saying so."""
    import pytest

    from tessera.errors import TesseraError
    try:
        compiled.stage("cubin")
    except TesseraError as e:
        if "tileiras" in str(e) and "not found" in str(e):
            pytest.skip(f"no tileiras and no cached cubin: {e}")
        raise
    return compiled
