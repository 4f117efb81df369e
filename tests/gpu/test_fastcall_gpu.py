"""The launch fast path (runtime/fastcall.py) on the GPU: a repeated call is checked and launched in
C, gives the results the general path gives on fresh inputs, and hands anything that differs from
its record (a shape, a dtype, a layout, a value, a captured global, grad) back to the general path."""
import math

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.runtime import fastcall

SCALE = 2.0


@pytest.fixture
def torch(torch_cuda):
    if fastcall.wait(timeout=120) is None:
        pytest.fail(f"the fast path did not load: {fastcall.unavailable()}")
    return torch_cuda


def close(got, want, tol=2e-2):
    got = got.double()
    assert not got.isnan().any()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.2e}"


def fast_calls(fn) -> bool:
    """Whether `fn`'s next call tries a C call first."""
    return bool(fn._fast) and type(fn._fast[0]).__module__ == fastcall.MODULE_NAME


def served_in_c(fn, *args) -> bool:
    """Whether one of `fn`'s C calls takes `args` (and runs them)."""
    return any(call(*args) is not None for call in fn._fast)


def test_repeated_calls_run_in_c_on_fresh_values_and_pointers(torch):
    @tsr.function
    def scale_add(x: Tensor["M", "N"], y: Tensor["M", "N"], c: float):
        return x * c + y * SCALE

    for i in range(4):
        x, y = (torch.randn(997, 129, device="cuda", dtype=torch.float16) for _ in range(2))
        close(scale_add(x, y, 0.5), x.double() * 0.5 + y.double() * SCALE)
    assert fast_calls(scale_add) and served_in_c(scale_add, x, y, 0.5)
    close(scale_add._fast[0](x, y, 0.5), x.double() * 0.5 + y.double() * SCALE)


@pytest.mark.parametrize("change", ["shape", "dtype", "strides", "value", "misaligned", "grad"])
def test_a_call_unlike_the_record_takes_the_general_path(torch, change):
    @tsr.function
    def scale_add(x: Tensor["M", "N"], y: Tensor["M", "N"], c: float):
        return x * c + y

    x, y = (torch.randn(64, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    scale_add(x, y, 2.0)
    scale_add(x, y, 2.0)
    assert fast_calls(scale_add)
    c = 2.0
    if change == "shape":
        x, y = x[:33], y[:33]
    elif change == "dtype":
        x, y = x.bfloat16(), y.bfloat16()
    elif change == "strides":
        y = torch.randn(128, 64, device="cuda", dtype=torch.float16).t()
    elif change == "value":
        c = 3.0
    elif change == "misaligned":
        with pytest.raises(Exception, match="16-byte aligned"):
            scale_add(x, torch.empty(64 * 128 + 8, device="cuda", dtype=torch.float16)[1:1 + 64 * 128].view(64, 128), c)
        return
    elif change == "grad":
        x = x.clone().requires_grad_()
    assert not served_in_c(scale_add, x, y, c)
    out = scale_add(x, y, c)
    close(out, x.detach().double() * c + y.double())
    if change == "grad":
        assert out.requires_grad


def test_a_changed_global_recompiles(torch):
    global SCALE

    @tsr.function
    def scaled(x: Tensor["M", "N"]):
        return x * SCALE

    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    scaled(x)
    scaled(x)
    assert fast_calls(scaled)
    old = SCALE
    try:
        SCALE = 3.0
        close(scaled(x), x.double() * 3.0)
    finally:
        SCALE = old
    close(scaled(x), x.double() * old)
    # another object of the same value: the same program, its record made again with the new object
    SCALE = old + 0.0
    assert SCALE is not old
    scaled(x)
    assert fast_calls(scaled) and scaled._fast[0](x) is not None


def test_several_kernels_tensor_maps_and_dynamic_dims(torch):
    """A GEMM + gelu + GEMM chain (several launches), an attention (tensor maps on sm_90a) and a
    shape-generic layer_norm alternating row counts (a record per shape) through the fast path."""
    @tsr.function
    def mlp(x: Tensor["M", "K"], w1: Tensor["K", "F"], w2: Tensor["F", "K"]):
        return tsr.matmul(tsr.gelu(tsr.matmul(x, w1)), w2)

    @tsr.function
    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        return tsr.softmax(tsr.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5), dim=-1) @ v

    @tsr.function(dynamic=["M"])
    def norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b)

    F = torch.nn.functional
    w1, w2 = (torch.randn(256, 256, device="cuda", dtype=torch.bfloat16) / 16 for _ in range(2))
    w, b = torch.randn(320, device="cuda", dtype=torch.bfloat16), torch.randn(320, device="cuda", dtype=torch.bfloat16)
    for i in range(3):
        x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
        close(mlp(x, w1, w2), F.gelu(x.double() @ w1.double()) @ w2.double())
        q, k, v = (torch.randn(1, 3, 131, 64, device="cuda", dtype=torch.float16) for _ in range(3))
        close(attention(q, k, v), F.scaled_dot_product_attention(q.double(), k.double(), v.double()))
        for m in (5, 1000):
            xn = torch.randn(m, 320, device="cuda", dtype=torch.bfloat16)
            close(norm(xn, w, b), F.layer_norm(xn.double(), (320,), w.double(), b.double()))
    assert all(fast_calls(f) for f in (mlp, attention, norm))
    assert served_in_c(mlp, x, w1, w2) and served_in_c(attention, q, k, v) and served_in_c(norm, xn, w, b)
    assert norm.cache_info().compiles == 2   # (5 and 1000 rows: two classes of a dynamic dim, `dims.CLASSES`)


def test_a_function_called_at_a_few_shapes_in_turn_finds_each_record(torch):
    @tsr.function
    def proj(x: Tensor["M", "K"], w: Tensor["K", "N"]):
        return tsr.matmul(x, w)

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(256, n, device="cuda", dtype=torch.bfloat16) / 16 for n in (256, 512, 768)]
    for _ in range(3):
        for w in ws:
            close(proj(x, w), x.double() @ w.double())
    assert len(proj._fast) == 3
    for w in ws:   # each is now served by one of the C calls, none by the general path
        assert any(call(x, w) is not None for call in proj._fast)


def test_a_programmatic_launch_through_c(torch):
    """A decode step (split-KV: a partials kernel, then a combining kernel launched as its
    programmatic dependent, cuLaunchKernelEx) replayed in C on fresh values."""
    from decode_attention import decode_attention

    F = torch.nn.functional
    for _ in range(3):
        q = torch.randn(1, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        close(decode_attention(q, k, v), F.scaled_dot_product_attention(q.double(), k.double(), v.double()))
    program = next(iter(decode_attention._programs.values())).program
    assert any(step.launch.programmatic for step in program.plan.steps)
    assert served_in_c(decode_attention, q, k, v)
    close(decode_attention._fast[0](q, k, v), F.scaled_dot_product_attention(q.double(), k.double(), v.double()))


def test_side_streams_and_graph_capture(torch):
    """A fast call launches on torch's current stream: work queued on a side stream before it is
    ordered before it, and a CUDA graph captures it (replayed on new values)."""
    @tsr.function
    def gelu(x: Tensor["M", "N"]):
        return tsr.gelu(x) * 2.0

    x = torch.randn(512, 512, device="cuda", dtype=torch.float16)
    gelu(x)
    gelu(x)
    assert fast_calls(gelu)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 3            # queued on the side stream ...
        out = gelu(y)        # ... and the kernel after it, on the same stream
    side.synchronize()
    close(out, torch.nn.functional.gelu(x.double() * 3) * 2)
    with torch.cuda.stream(side):
        gelu(x)              # allocations from the side stream's pool, before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gelu(x)
    for seed in (1, 2):
        x.copy_(torch.randn(512, 512, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        captured.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        close(captured, torch.nn.functional.gelu(x.double()) * 2)


def test_kernels_write_their_outputs_in_c_unless_an_output_overlaps_an_argument(torch):
    @tsr.kernel
    def axpy(x: Tensor["N"], y: Tensor["N"], out: Tensor["N"]):
        out[:] = x * 2.0 + y

    n = 4097
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.full((n,), math.nan, device="cuda")
    for _ in range(3):
        x.normal_()
        axpy(x, y, out)
        close(out, x.double() * 2 + y.double())
    assert fast_calls(axpy) and served_in_c(axpy, x, y, out)
    # the output is an input, or a view of an input's memory shifted by a few elements: the C calls
    # decline, and the general path runs it through a copy
    assert not served_in_c(axpy, x, y, y)
    want = x.double() * 2 + y.double()
    axpy(x, y, y)
    close(y, want)
    buf = torch.randn(n + 8, device="cuda")
    a = buf[8:].clone()
    assert not served_in_c(axpy, a, buf[:n], buf[8:])
    want = a.double() * 2 + buf[:n].double()
    axpy(a, buf[:n], buf[8:])
    close(buf[8:], want)


PACKAGED = '''
import tessera as tsr
from tessera import Tensor


@tsr.function
def bias_gelu(x: Tensor["M", "N"], b: Tensor["N"]):
    return tsr.gelu(x + b)


@tsr.kernel
def scale_into(x: Tensor["M", "N"], out: Tensor["M", "N"]):
    out[:] = x * 3.0
'''


def test_packaged_functions_and_kernels_take_the_fast_path(torch, arch, tmp_path):
    """`tessera.load`'s callables (runtime/package.py) replay a repeated call in C too."""
    from tessera import cli

    (tmp_path / "prog.py").write_text(PACKAGED)
    out = tmp_path / "pkg"
    assert cli.main(["package", f"{tmp_path / 'prog.py'}:bias_gelu", f"{tmp_path / 'prog.py'}:scale_into",
                     "--arch", arch, "--shape", "M=97,N=256", "-o", str(out)]) == 0
    prog = tsr.load(str(out))
    b = torch.randn(256, device="cuda", dtype=torch.float16)
    y = torch.full((97, 256), math.nan, device="cuda", dtype=torch.float16)
    for _ in range(3):
        x = torch.randn(97, 256, device="cuda", dtype=torch.float16)
        close(prog.bias_gelu(x, b), torch.nn.functional.gelu(x.double() + b.double()))
        assert prog.scale_into(x, y) is None
        close(y, x.double() * 3)
    assert served_in_c(prog.bias_gelu, x, b) and served_in_c(prog.scale_into, x, y)
    assert not served_in_c(prog.scale_into, x, x)   # an output that is an input: the general path
