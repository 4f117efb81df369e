"""The benchmark cases: Tessera's kernels and the peers each is timed against, by suite.

A `Case` is declared without touching a GPU (its name, suite, unit and work are plain numbers), so
`tessera bench --list` and `--filter` work anywhere; its `build` makes the CUDA inputs and returns the
callables to check and time (`Prepared`). Suites:

- rows: layer_norm and softmax over fp16 rows (GB/s of one read and one write; rows of 8192 and of
  32768), log_softmax, a layer_norm written out in ops (its two statistics in one kernel), an RMSNorm backward (GB/s of the bytes it must move: x and dy read, dx written, the weight
  and its gradient; checked on dx), and the host cost of a small call (us/call, wall clock);
- gemm: fp16/bf16 square GEMMs on both code paths ("(native)": what a plain call runs, TMA + wgmma on an
  H100; "(ampere)": mma.sync + cp.async) against cuBLAS, the mma.sync one also against Triton's matmul
  compiled to mma.sync at its fastest tiling;
- attention: flash attention, plain and causal, B * S = 32 * 2048 tokens, both paths, against torch
  SDPA's flash backend (and cuDNN's for the native path);
- training: the attention backward (`tsr.vjp`: dQ, dK and dV, all checked), plain and causal at
  8 x 16 x 4096 x 128 and grouped-query causal at 2 x 32/8 x 4096 x 128, bf16, against SDPA's
  flash and cuDNN backwards (TFLOP/s of 2.5 forwards);
- variants: the schedule switches that change a GEMM's kernel: `persistent` on and off, and `split_k`
  as derived against none on GEMMs with too few output tiles to fill the GPU.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import tessera as tsr
from tessera import Tensor

SUITES = ("rows", "gemm", "attention", "training", "variants")


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * scale, dim=-1), v)


@tsr.function
def causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def gqa_causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "Hk", "S", "D"], v: Tensor["B", "Hk", "S", "D"]):
    """Causal attention where each KV head serves H / Hk query heads."""
    b, h, s, d = q.shape
    hk = k.shape[1]
    scores = tsr.matmul(q.reshape(b, hk, h // hk, s, d), k[:, :, None].transpose(-2, -1)) * (1.0 / math.sqrt(d))
    i = tsr.arange(s)
    scores = tsr.where(i[:, None] >= i[None, :], scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v[:, :, None]).reshape(b, h, s, d)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)


@tsr.function
def written_layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    """layer_norm written out in ops, as users write their own norms: the mean and the variance
    about it are two statistics of the rows, computed in one kernel (`fusion.merge_row_chains`)."""
    d = x - x.mean(-1, keepdim=True)
    return d * tsr.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


@tsr.function
def log_softmax(x: Tensor["M", "N"]):
    return tsr.log_softmax(x, -1)


@dataclass
class Prepared:
    """A case on the GPU: Tessera's call and its peers', each a no-argument callable returning its output.
    Tessera's output is checked against the first peer that runs (`reference` names another)."""

    ours: Callable[[], object]
    peers: dict[str, Callable[[], object]]
    reference: str | None = None
    notes: dict[str, str] = field(default_factory=dict)   # peers that could not be built, and why


#: ||out - ref|| / ||ref|| above which Tessera's output is wrong and goes untimed (fp16 outputs
#: against peers that round differently stay two orders of magnitude below it)
TOLERANCE = 1e-2


@dataclass(frozen=True)
class Case:
    """One benchmark: how it is reported (unit, work: FLOPs or bytes) and how it is built on a GPU;
    `tolerance`: the relative error against the reference peer past which the output is wrong."""

    name: str
    suite: str
    unit: str                     # TFLOP/s, GB/s or us/call
    work: float | None
    build: Callable[[], Prepared] = field(compare=False, repr=False)
    timer: str = "device"         # "device": do_bench-style rounds; "host": wall clock per call
    tolerance: float = TOLERANCE


def on_path(fn, path: str, dims: dict[str, int], dtype: str, space: dict | None = None):
    """`fn` compiled for `dims` on one code path ("native": what a plain call runs; "ampere": the
    mma.sync + cp.async path), with the schedule `space` pins if given, as a callable returning its
    one output."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=platform.arch, sm_count=platform.sm_count, path=path,
                          **({"space": space} if space else {}))
    program = compiled.gpu_program(0)
    return lambda *xs: program(*xs)[0]


def _randn(*shape, dtype="float16"):
    import torch
    return torch.randn(*shape, device="cuda", dtype=getattr(torch, dtype))


# --- rows ----------------------------------------------------------------------------------------

def _row_case(name: str, m: int, n: int) -> Case:
    def build() -> Prepared:
        import torch
        x, w, b = _randn(m, n), _randn(n), _randn(n)
        if name == "layer_norm":
            return Prepared(lambda: layer_norm(x, w, b),
                            {"torch.layer_norm": lambda: torch.nn.functional.layer_norm(x, (n,), w, b)})
        if name == "written layer_norm":
            return Prepared(lambda: written_layer_norm(x, w, b),
                            {"torch.layer_norm": lambda: torch.nn.functional.layer_norm(x, (n,), w, b)})
        if name == "log_softmax":
            return Prepared(lambda: log_softmax(x), {"torch.log_softmax": lambda: torch.log_softmax(x, dim=-1)})
        return Prepared(lambda: softmax(x), {"torch.softmax": lambda: torch.softmax(x, dim=-1)})
    return Case(f"{name} {m}x{n} fp16", "rows", "GB/s", 2 * m * n * 2, build)


def _norm_backward_case(m: int, n: int) -> Case:
    def build() -> Prepared:
        import torch
        x, w, dy = _randn(m, n, dtype="bfloat16"), _randn(n, dtype="bfloat16"), _randn(m, n, dtype="bfloat16")
        _, f_vjp = tsr.vjp(rms_norm, x, w)
        leaves = [x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
        out = torch.nn.functional.rms_norm(leaves[0], (n,), leaves[1], 1e-6)
        return Prepared(lambda: f_vjp(dy)[0],
                        {"torch autograd": lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)[0]})
    return Case(f"rms_norm backward {m}x{n} bf16", "rows", "GB/s", (3 * m * n + 2 * n) * 2, build)


def _overhead_case() -> Case:
    def build() -> Prepared:
        import torch
        x, w, b = _randn(64, 256), _randn(256), _randn(256)
        return Prepared(lambda: layer_norm(x, w, b),
                        {"torch.layer_norm": lambda: torch.nn.functional.layer_norm(x, (256,), w, b)})
    return Case("call overhead: layer_norm 64x256 fp16", "rows", "us/call", None, build, timer="host")


def rows_cases(quick: bool) -> list[Case]:
    m, n = (4096, 8192) if quick else (16384, 8192)
    return [_row_case("layer_norm", m, n), _row_case("softmax", m, n), _row_case("layer_norm", m // 4, 4 * n),
            _row_case("written layer_norm", m, n), _row_case("log_softmax", m, n),
            _norm_backward_case(m, n), _overhead_case()]


# --- gemm ------------------------------------------------------------------------------------------

def _triton_peer(a, b, ref):
    """Triton's mma.sync matmul at its fastest tiling here (a peer for the mma.sync path)."""
    from .timing import median_ms, rel_err
    from .triton_mma_sync import best_triton_matmul
    return best_triton_matmul(a, b, ref, rel_err, median_ms)[2]


def _gemm_case(m: int, k: int, n: int, dtype: str, path: str, label: str, space: dict | None = None,
               suite: str = "gemm") -> Case:
    def build() -> Prepared:
        import torch
        a, b = _randn(m, k, dtype=dtype), _randn(k, n, dtype=dtype)
        ours = on_path(gemm, path, dict(M=m, K=k, N=n), _TESSERA_DTYPES[dtype], space)
        peers = {"torch.matmul": lambda: torch.matmul(a, b)}
        if path == "ampere" and suite == "gemm":
            peers["triton mma.sync"] = _triton_peer(a, b, torch.matmul(a, b))
        return Prepared(lambda: ours(a, b), peers)
    return Case(label, suite, "TFLOP/s", 2 * m * n * k, build)


_TESSERA_DTYPES = {"float16": "fp16", "bfloat16": "bf16"}


@tsr.function
def scaled_fp8_gemm(a, b, sa, sb):
    """torch._scaled_mm's math: e4m3 operands (B stored [N, K]), per-tensor scales, a bf16 result."""
    return (tsr.matmul(a, b.transpose(0, 1)) * (sa * sb)).to(tsr.bf16)


def _fp8_gemm_case(n: int) -> Case:
    def build() -> Prepared:
        import torch
        a, b = (_randn(n, n, dtype="float32").to(torch.float8_e4m3fn) for _ in range(2))
        sa, sb = torch.tensor([0.5], device="cuda"), torch.tensor([1.25], device="cuda")
        return Prepared(lambda: scaled_fp8_gemm(a, b, sa, sb),
                        {"torch._scaled_mm": lambda: torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb,
                                                                      out_dtype=torch.bfloat16)})
    return Case(f"fp8 e4m3 scaled gemm {n}^3 -> bf16", "gemm", "TFLOP/s", 2 * n ** 3, build)


def gemm_cases(quick: bool) -> list[Case]:
    return [*(_gemm_case(n, n, n, dt, path, f"gemm {n}^3 {_TESSERA_DTYPES[dt]} ({path})")
              for n in ([4096] if quick else [4096, 8192]) for dt in _TESSERA_DTYPES for path in ("native", "ampere")),
            *(_fp8_gemm_case(n) for n in ([4096] if quick else [4096, 8192]))]


# --- attention ---------------------------------------------------------------------------------------

def _sdpa(backend_name: str, q, k, v, causal: bool):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _attention_case(s: int, causal: bool, path: str) -> Case:
    b, h, d = max(1, 32 * 2048 // s), 12, 128

    def build() -> Prepared:
        q, k, v = (_randn(b, h, s, d) for _ in range(3))
        ours = on_path(causal_attention if causal else attention, path, dict(B=b, H=h, S=s, D=d), "fp16")
        backends = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
        if path == "ampere":   # against flash (FA2), itself an mma.sync kernel
            del backends["sdpa-cudnn"]
        return Prepared(lambda: ours(q, k, v), {name: _sdpa(be, q, k, v, causal) for name, be in backends.items()})
    name = f"attention B={b} H={h} S={s} D={d} fp16{' causal' if causal else ''} ({path})"
    return Case(name, "attention", "TFLOP/s", attention_flops(b, h, s, s, d, causal), build)


def attention_flops(b: int, h: int, s_q: int, s_k: int, d: int, causal: bool) -> float:
    """4 B H Sq Sk D: two matmuls of 2 B H Sq Sk D each; a causal mask skips half of them."""
    return 4 * b * h * s_q * s_k * d * (0.5 if causal else 1.0)


def _strided_attention_case(s: int) -> Case:
    """Q, K and V as [B, H, S, D] views of one packed [B, S, 3, H, D] projection, read in place."""
    b, h, d = max(1, 32 * 2048 // s), 12, 128

    def build() -> Prepared:
        qkv = _randn(b, s, 3, h, d)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        return Prepared(lambda: attention(q, k, v), {"sdpa-cudnn": _sdpa("CUDNN_ATTENTION", q, k, v, False),
                                                     "sdpa-flash": _sdpa("FLASH_ATTENTION", q, k, v, False)})
    return Case(f"attention B={b} H={h} S={s} D={d} fp16, packed QKV views (native)", "attention", "TFLOP/s",
                attention_flops(b, h, s, s, d, False), build)


@tsr.function
def fp8_attention(q, k, v, sq, sk, sv):
    """Attention on e4m3 Q, K, V with per-tensor scales, the probabilities cast to e4m3 for P @ V
    (examples/fp8_attention.py), bf16 out."""
    s = tsr.matmul(q, k.transpose(-2, -1)) * (sq * sk * (1.0 / math.sqrt(q.shape[-1])))
    return (tsr.matmul(tsr.softmax(s, dim=-1).to(tsr.fp8_e4m3), v) * sv).to(tsr.bf16)


#: fp8 attention against bf16 attention on the same values: the e4m3 probabilities' rounding (3
#: mantissa bits) gives 2.1-2.6e-2 (bench/RESULTS.md, session 25)
FP8_ATTENTION_TOLERANCE = 5e-2


def _fp8_attention_case(b: int, h: int, s: int, d: int) -> Case:
    """Against Tessera's own bf16 attention (the issue's measure) and cuDNN's, on the bf16 values of
    the same inputs (scales folded into Q and V)."""
    def build() -> Prepared:
        import torch
        q, k, v = (_randn(b, h, s, d, dtype="float32").to(torch.float8_e4m3fn) for _ in range(3))
        sq, sk, sv = (torch.tensor([x], device="cuda") for x in (0.5, 1.5, 0.75))
        q16 = (q.float() * 0.75).to(torch.bfloat16)
        k16, v16 = k.to(torch.bfloat16), (v.float() * 0.75).to(torch.bfloat16)
        bf16 = on_path(attention, "native", dict(B=b, H=h, S=s, D=d), "bf16")
        return Prepared(lambda: fp8_attention(q, k, v, sq, sk, sv),
                        {"tessera bf16": lambda: bf16(q16, k16, v16),
                         "sdpa-cudnn bf16": _sdpa("CUDNN_ATTENTION", q16, k16, v16, False)})
    return Case(f"fp8 e4m3 attention B={b} H={h} S={s} D={d} -> bf16 (native)", "attention", "TFLOP/s",
                attention_flops(b, h, s, s, d, False), build, tolerance=FP8_ATTENTION_TOLERANCE)


def attention_cases(quick: bool) -> list[Case]:
    return [*(_attention_case(s, causal, path) for s in ([2048] if quick else [2048, 4096, 8192])
              for causal in (False, True) for path in ("native", "ampere")),
            _strided_attention_case(4096 if not quick else 2048),
            _fp8_attention_case(8, 16, 4096, 128)]


# --- training ----------------------------------------------------------------------------------------

def sdpa_backward(backend_name: str, q, k, v, d_out, causal: bool):
    """SDPA's backward on `backend_name` as a no-argument callable returning (dQ, dK, dV): its forward
    runs once, on the first call (a backend this machine lacks raises there, which the runner notes)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    forward = []

    def run():
        if not forward:
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                forward.append(torch.nn.functional.scaled_dot_product_attention(
                    *leaves, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]))
        return torch.autograd.grad(forward[0], leaves, d_out, retain_graph=True)
    return run


def _attention_backward_case(b: int, h: int, hk: int, s: int, d: int, causal: bool) -> Case:
    """The backward alone (`tsr.vjp`'s forward ran once at build), its three gradients checked."""
    def build() -> Prepared:
        q, d_out = (_randn(b, h, s, d, dtype="bfloat16") for _ in range(2))
        k, v = (_randn(b, hk, s, d, dtype="bfloat16") for _ in range(2))
        fn = gqa_causal_attention if hk != h else causal_attention if causal else attention
        _, f_vjp = tsr.vjp(fn, q, k, v)
        return Prepared(lambda: f_vjp(d_out), {name: sdpa_backward(be, q, k, v, d_out, causal) for name, be in
                                               (("sdpa-flash", "FLASH_ATTENTION"), ("sdpa-cudnn", "CUDNN_ATTENTION"))})
    heads = f"H={h}/{hk}" if hk != h else f"H={h}"
    name = f"attention backward B={b} {heads} S={s} D={d} bf16{' causal' if causal else ''}"
    return Case(name, "training", "TFLOP/s", 2.5 * attention_flops(b, h, s, s, d, causal), build,
                tolerance=BACKWARD_TOLERANCE)


#: bf16 gradients against another kernel's bf16 gradients (bench/attention_backward.py: 3-8e-3)
BACKWARD_TOLERANCE = 2e-2


def training_cases(quick: bool) -> list[Case]:
    s = 2048 if quick else 4096
    return [_attention_backward_case(8, 16, 16, s, 128, False), _attention_backward_case(8, 16, 16, s, 128, True),
            _attention_backward_case(2, 32, 8, s, 128, True)]


# --- variants ----------------------------------------------------------------------------------------

#: GEMMs with too few output tiles to fill the GPU (M, K, N), where the derived split_k matters
FEW_TILE_GEMMS = ((128, 4096, 4096), (64, 8192, 8192))


def variant_cases(quick: bool) -> list[Case]:
    n = 4096
    cases = [_gemm_case(n, n, n, "float16", path, f"gemm {n}^3 fp16 ({path}, persistent={p})",
                        {"persistent": [p]}, "variants")
             for path in ("native", "ampere") for p in (0, 1)]
    for m, k, n in FEW_TILE_GEMMS[:1] if quick else FEW_TILE_GEMMS:
        cases += [_gemm_case(m, k, n, "float16", "native", f"gemm {m}x{k}x{n} fp16 (native, split_k={label})",
                             space, "variants")
                  for label, space in (("derived", None), ("1", {"split_k": [1]}))]
    return cases


SUITE_CASES: dict[str, Callable[[bool], list[Case]]] = {
    "rows": rows_cases, "gemm": gemm_cases, "attention": attention_cases, "training": training_cases,
    "variants": variant_cases}


def all_cases(quick: bool = False, suites: tuple[str, ...] = SUITES) -> list[Case]:
    """Every case of the named suites, in suite order."""
    return [c for s in suites for c in SUITE_CASES[s](quick)]


def select(cases: list[Case], pattern: str | None) -> list[Case]:
    """The cases whose name or suite `pattern` (a regular expression) matches somewhere."""
    if not pattern:
        return list(cases)
    regex = re.compile(pattern)
    return [c for c in cases if regex.search(c.name) or regex.search(c.suite)]
