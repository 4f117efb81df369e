"""Shape-generic kernels on the GPU: one compile serves every row count of a class (`tessera.dims`).

Each function is marked dynamic in a dim and called with awkward row counts (2, 3, primes, 1000, 4097)
in one process: every result is checked against float64, outputs written into NaN-poisoned buffers
(a @kernel) show any row left unwritten, and the function compiled once per class of the counts
(powers of two up to 1024, then one: `tessera.dims.CLASSES`).
"""
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from seed_kernels import causal_attention, flash_attention
from tessera.dims import class_of
from tessera.errors import ShapeError

TOL = {"fp32": 2e-5, "fp16": 1e-2, "bf16": 3e-2}
ROWS = [2, 3, 17, 127, 256, 1000, 2048, 4097]   # (256 and 2048: multiples of 128, a class of their own in attention)


def classes(values, aligned: bool = False) -> int:
    """How many compiles a generic function makes over these values: one per class (`dims.class_of`;
    `aligned`: a function whose kernels depend on a multiple of 128, which compiles apart, as an
    attention's key loop does)."""
    return len({class_of(v, aligned) for v in values})


def torch_dtype(torch, name):
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def check(out, ref, dtype, torch):
    out64 = out.double()
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = float((out64 - ref).norm() / ref.norm())
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"


def make_functions():
    """Fresh functions per test (the compile counts are per function)."""
    @tsr.function(dynamic=["M"])
    def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b) * 0.5

    @tsr.function(dynamic=["M"])
    def bias_gelu(x: Tensor["M", "N"], b: Tensor["N"]):
        return tsr.gelu(x + b)

    @tsr.function(dynamic=["B"])
    def softmax3(x: Tensor["B", "S", "N"]):
        return tsr.softmax(x, dim=-1)
    return layer_norm, bias_gelu, softmax3


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_one_compile_serves_every_row_count(torch_cuda, dtype):
    torch = torch_cuda
    dt = torch_dtype(torch, dtype)
    layer_norm, bias_gelu, softmax3 = make_functions()
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, 768, device="cuda", generator=g).to(dt)
        w = torch.randn(768, device="cuda", generator=g).to(dt)
        b = torch.randn(768, device="cuda", generator=g).to(dt)
        ref = torch.nn.functional.layer_norm(x.double(), (768,), w.double(), b.double()) * 0.5
        check(layer_norm(x, w, b), ref, dtype, torch)
        ref = torch.nn.functional.gelu(x.double() + b.double())
        check(bias_gelu(x, b), ref, dtype, torch)
        x3 = torch.randn(m, 3, 1000, device="cuda", generator=g).to(dt)
        check(softmax3(x3), torch.softmax(x3.double(), dim=-1), dtype, torch)
    for fn in (layer_norm, bias_gelu, softmax3):
        info = fn.cache_info()
        assert info.compiles == classes(ROWS) and info.hits == len(ROWS) - classes(ROWS), info   # a class: one compile
        assert list(info.keys[0].values())[0] == "dynamic<=16"


def test_a_kernel_writes_every_row_of_a_poisoned_output(torch_cuda):
    torch = torch_cuda

    @tsr.kernel(dynamic=["M"])
    def rms(x: Tensor["M", "N"], w: Tensor["N"], out: Tensor["M", "N"]):
        out[:] = tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)

    for m in ROWS:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(x, float("nan"))
        rms(x, w, out)
        ref = torch.nn.functional.rms_norm(x.double(), (4096,), w.double(), 1e-6)
        check(out, ref, "bf16", torch)
    assert rms.cache_info().compiles == classes(ROWS)


def test_a_dim_varying_between_calls_becomes_dynamic(torch_cuda):
    """Without `dynamic=`: the first row count compiles a constant, the second a generic kernel,
    every later one reuses it."""
    torch = torch_cuda

    @tsr.function
    def softmax(x: Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    for m in [100, 37, 4097, 5, 100]:
        x = torch.randn(m, 333, device="cuda", dtype=torch.float16)
        check(softmax(x), torch.softmax(x.double(), dim=-1), "fp16", torch)
    info = softmax.cache_info()
    assert info.compiles == 1 + classes((37, 4097, 5)) and info.dynamic == ("M",), info   # 100; then a class each


def test_a_generic_program_refuses_a_wrong_static_dim(torch_cuda):
    torch = torch_cuda
    layer_norm, _, _ = make_functions()
    x = torch.randn(5, 64, device="cuda", dtype=torch.float16)
    w = torch.randn(64, device="cuda", dtype=torch.float16)
    layer_norm(x, w, w)
    program = next(iter(layer_norm._programs.values())).program
    with pytest.raises(ShapeError, match="argument 'w'"):
        program(torch.randn(9, 64, device="cuda", dtype=torch.float16), w[:32].contiguous(), w)


def test_cuda_graph_replays_a_generic_kernel(torch_cuda):
    torch = torch_cuda
    _, bias_gelu, _ = make_functions()
    x = torch.randn(300, 512, device="cuda", dtype=torch.float16)
    b = torch.randn(512, device="cuda", dtype=torch.float16)
    bias_gelu(x, b)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bias_gelu(x, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    check(y, torch.nn.functional.gelu(x.double() + b.double()), "fp16", torch)


def test_numpy_rows_on_the_gpu_match_the_interpreter(torch_cuda):
    """The same generic function on CUDA tensors and on NumPy arrays (the CPU interpreter)."""
    torch = torch_cuda
    _, bias_gelu, _ = make_functions()
    rng = np.random.default_rng(1)
    for m in (3, 61):
        x = rng.standard_normal((m, 40)).astype(np.float32)
        b = rng.standard_normal(40).astype(np.float32)
        on_gpu = bias_gelu(torch.from_numpy(x).cuda(), torch.from_numpy(b).cuda()).cpu().numpy()
        np.testing.assert_allclose(on_gpu, bias_gelu(x, b), rtol=2e-5, atol=2e-6)


def test_a_dynamic_length_writes_nothing_past_its_end(torch_cuda):
    """A rank-1 tensor of dynamic length, written into the front of a sentinel-filled buffer: every
    element up to the length is right and nothing after it changed (no vector store runs past the
    end)."""
    torch = torch_cuda

    @tsr.kernel(dynamic=["M"])
    def double(x: Tensor["M"], out: Tensor["M"]):
        out[:] = x * 2.0

    for m in (2, 7, 1001, 4097):
        x = torch.randn(m, device="cuda", dtype=torch.float16)
        buffer = torch.full((m + 64,), 7.0, device="cuda", dtype=torch.float16)
        double(x, buffer[:m])
        torch.testing.assert_close(buffer[:m], x * 2, rtol=0, atol=0)
        assert bool((buffer[m:] == 7.0).all()), f"M={m}: elements past the end were written"
    assert double.cache_info().compiles == classes((2, 7, 1001, 4097))


def test_a_row_mean_without_keepdim_and_an_inserted_unit_dim(torch_cuda):
    """A reduction to [M] (its kernel writes a [M, 1] view of the result) and a [M, 1, N] result."""
    torch = torch_cuda

    @tsr.function(dynamic=["M"])
    def means(x: Tensor["M", "N"]):
        return tsr.mean(x, dim=-1)

    @tsr.function(dynamic=["M"])
    def widen(x: Tensor["M", "N"]):
        return tsr.exp(x[:, None, :])

    for m in ROWS:
        x = torch.randn(m, 333, device="cuda", dtype=torch.float32)
        check(means(x), x.double().mean(-1), "fp32", torch)
        check(widen(x), x.double().exp()[:, None, :], "fp32", torch)
    assert means.cache_info().compiles == widen.cache_info().compiles == classes(ROWS)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("k, n", [(4096, 1024), (512, 768), (72, 136)])
def test_one_gemm_compile_serves_every_row_count(torch_cuda, dtype, k, n):
    """A GEMM with a bias + gelu epilogue over a dynamic M (on sm_90a: wgmma, A's tensor map encoded
    per call with the call's M), one compile for every row count."""
    torch = torch_cuda
    dt = torch_dtype(torch, dtype)

    @tsr.function(dynamic=["M"])
    def linear_gelu(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
        return tsr.gelu(tsr.matmul(x, w) + b)

    g = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(k, n, device="cuda", generator=g) / k ** 0.5).to(dt)
    b = torch.randn(n, device="cuda", generator=g).to(dt)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", generator=g).to(dt)
        ref = torch.nn.functional.gelu(x.double() @ w.double() + b.double())
        check(linear_gelu(x, w, b), ref, dtype, torch)
    info = linear_gelu.cache_info()
    assert info.compiles == classes(ROWS) and info.fixed == {} and info.keys[0]["M"] == "dynamic<=16", info


def test_a_clustered_gemm_serves_every_row_count(torch_cuda, hopper):
    """Blocks in clusters of two sharing B's tiles, walking tile rows counted at run time: an odd
    count leaves the last cluster's second row past M (its copies read padding, its stores are
    masked). One compile, every row count against float64, into NaN-poisoned outputs."""
    torch = torch_cuda
    from tessera.runtime import driver

    @tsr.function(space={"cluster": [2], "persistent": [1], "programs": [8]})
    def linear(x: Tensor["M", "K"], w: Tensor["K", "N"]):
        return tsr.matmul(x, w) * 0.5

    platform = driver.Device(0).platform()
    compiled = linear.compile(linear.arg_specs_for(dict(M=3000, K=512, N=1000), "bf16"), dynamic=frozenset({"M"}),
                              arch=platform.arch)
    assert "tessera.cluster = 2" in compiled.ir("tile")
    program = compiled.gpu_program(0)
    w = torch.randn(512, 1000, device="cuda", dtype=torch.bfloat16) / 16
    for m in [*ROWS, 2900, 3000]:
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, 1000), float("nan"), device="cuda", dtype=torch.bfloat16)
        program(x, w, out=[out])
        check(out, 0.5 * (x.double() @ w.double()), "bf16", torch)


def test_a_gemm_kernel_writes_every_row_of_a_poisoned_output(torch_cuda):
    """`x @ w.T` (B read K-major) into NaN-filled outputs of every row count."""
    torch = torch_cuda

    @tsr.kernel(dynamic=["M"])
    def project(x: Tensor["M", "K"], w: Tensor["N", "K"], out: Tensor["M", "N"]):
        out[:] = tsr.matmul(x, w.T) * 0.5

    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 32
    for m in ROWS:
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
        project(x, w, out)
        check(out, 0.5 * (x.double() @ w.double().T), "bf16", torch)
    assert project.cache_info().compiles == classes(ROWS)


def attention_fn(causal: bool, **kw):
    """seed_kernels' attention (or its causal one), compiled as `kw` says."""
    return tsr.function((causal_attention if causal else flash_attention).fn, **kw)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_one_attention_compile_serves_every_sequence_length(torch_cuda, dtype, d, causal):
    """S of [B, H, S, D] at run time (on sm_90a Q, K and V through tensor maps encoded per call):
    every length against float64, one compile."""
    torch = torch_cuda
    dt = torch_dtype(torch, dtype)
    fn = attention_fn(causal, dynamic=["S"])
    g = torch.Generator(device="cuda").manual_seed(5)
    for s in ROWS:
        q, k, v = (torch.randn(2, 3, s, d, device="cuda", generator=g).to(dt) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
        check(fn(q, k, v), ref, dtype, torch)
    info = fn.cache_info()
    assert info.compiles == classes(ROWS, aligned=True) and info.fixed == {} and info.keys[0]["S"] == "dynamic<=16", info


def test_a_decode_step_over_a_growing_cache(torch_cuda):
    """One query a head against a KV cache of a different length every step: one compile."""
    torch = torch_cuda

    @tsr.function(dynamic=["N"])
    def decode(q: Tensor["B", "H", "Q", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.125, dim=-1), v)

    q = torch.randn(4, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    for n in (2, 3, 100, 1000, 4097, 33000):   # (past 1024: split across the grid, flash-decoding)
        k, v = (torch.randn(4, 8, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.125)
        check(decode(q, k, v), ref, "bf16", torch)
    assert decode.cache_info().compiles == classes((2, 3, 100, 1000, 4097, 33000))


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("m", [1, 4])
def test_a_causal_decode_step_over_a_growing_cache(torch_cuda, monkeypatch, gqa, m):
    """examples/decode_attention.py's causal decode (`row + (N - M) >= col`, N - M read at run
    time) over caches of lengths 17 to 100003: one compile per class of N (counted with the
    on-disk cache of an earlier run out of the way), against float64."""
    from decode_attention import decode_attention, gqa_decode_attention
    torch = torch_cuda
    monkeypatch.setenv("TESSERA_WARM_CACHE", "0")
    fn = tsr.function((gqa_decode_attention if gqa else decode_attention).fn, dynamic=["N"])
    g = torch.Generator(device="cuda").manual_seed(9)
    lengths = (17, 1000, 4097, 100003)
    q = torch.randn(*((2, 2, 4) if gqa else (2, 8)), m, 128, device="cuda", generator=g).to(torch.bfloat16)
    for n in lengths:
        k, v = (torch.randn(*((2, 2, 1) if gqa else (2, 8)), n, 128, device="cuda", generator=g).to(torch.bfloat16)
                for _ in range(2))
        keep = torch.arange(m, device="cuda")[:, None] + (n - m) >= torch.arange(n, device="cuda")[None, :]
        scores = (q.double() @ k.double().transpose(-2, -1) / 128 ** 0.5).masked_fill(~keep, float("-inf"))
        check(fn(q, k, v), torch.softmax(scores, dim=-1) @ v.double(), "bf16", torch)
    info = fn.cache_info()
    assert info.compiles == classes(lengths) and not info.fixed, info


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_column_sum_over_any_row_count(torch_cuda, monkeypatch, dtype):
    """Column sums and means with their reduced rows taken at run time (split across the grid past
    a few thousand rows), every count against float64, one compile per class."""
    torch = torch_cuda
    monkeypatch.setenv("TESSERA_WARM_CACHE", "0")

    @tsr.function(dynamic=["M"])
    def column_stats(x: Tensor["M", "N"]):
        return tsr.sum(x, dim=0), tsr.mean(x, dim=0)

    rows = (2, 17, 1000, 4097, 70001)
    g = torch.Generator(device="cuda").manual_seed(13)
    for m in rows:
        x = torch.randn(m, 1000, device="cuda", generator=g).to(torch_dtype(torch, dtype))
        total, mean = column_stats(x)
        check(total, x.double().sum(0), dtype, torch)
        check(mean, x.double().mean(0), dtype, torch)
    assert column_stats.cache_info().compiles == classes(rows) and not column_stats.cache_info().fixed


def test_row_slices_of_one_buffer_get_their_own_tensor_maps(torch_cuda):
    """x[:m] of one buffer has the same address for every m: the tensor map of a GEMM's A (TMA on
    sm_90a) must still be encoded with each call's M (a map of the previous M would read zeros past
    it), through the general path and the C fast path alike (calls repeat to reach the latter)."""
    torch = torch_cuda

    @tsr.function(dynamic=["M"])
    def project(x: Tensor["M", "K"], w: Tensor["K", "N"]):
        return tsr.matmul(x, w)

    buffer = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) / 23
    for m in (1500, 4096, 1025, 3000, 4096, 1500) * 3:
        x = buffer[:m]
        check(project(x, w), x.double() @ w.double(), "bf16", torch)
