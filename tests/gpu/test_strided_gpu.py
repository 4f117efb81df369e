"""Strided inputs on the GPU: tensors whose innermost dim is contiguous run without a copy.

The layouts models hand over: attention's Q, K and V as [B, S, H, D] (or one packed
[B, S, 3, H, D] projection) seen as [B, H, S, D]; a GEMM operand sliced out of a wider matrix;
rows of a wider buffer; a broadcast (stride-0) input; a decode step's key and value prefix of a
longer cache. Every case runs on both code paths (TMA + wgmma where it applies, and mma.sync +
cp.async), into NaN-poisoned outputs, against float64; the compile keeps the strides (no copy:
`copied_args` is empty) and, on the native path, its tensor maps carry them. An innermost dim
that is not contiguous is copied, and the compile names why.
"""
import math

import pytest

import tessera as tsr
from attention_cases import FUNCTIONS, plain, torch_reference
from tessera.bench.cases import rms_norm
from test_kernels import PATHS, TOL, _arch

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def compile_for(fn, inputs, path, **options):
    """`fn` compiled for these tensors as they are laid out, on `path`."""
    names = list(fn.signature.parameters)
    _, specs = fn.arg_specs(list(zip(names, inputs)))
    return fn.compile(specs, arch=_arch(), path=path, **options)


def run(torch, compiled, inputs):
    """The program on `inputs` (as they are), into NaN-poisoned outputs."""
    program = compiled.gpu_program(0)
    outs = [torch.full(b.shape, float("nan"), device="cuda", dtype=getattr(torch, DTYPES[b.dtype.name]))
            for b in program.outputs]
    program(*inputs, out=outs)
    torch.cuda.synchronize()
    return outs


def check64(torch, out, ref, dtype):
    out64 = out.double()
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = float((out64 - ref).norm() / max(float(ref.norm()), 1e-30))
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"


def assert_in_place(compiled, inputs):
    """Every input passed strided is read through its strides: no copy, a strided memref each."""
    from tessera.ir import tile
    from tessera.runtime import interop

    assert compiled.copied_args == {}
    types = compiled.host_function().function_type.inputs.data
    assert [tile.is_strided(t) for t in types[:len(inputs)]] == [interop.layout_of(x) is not None for x in inputs]


def attention64(torch, q, k, v, kind="plain"):
    return torch_reference(torch, kind, q.double(), k.double(), v.double())


ATTENTION = [(2, 3, 1000, 64, "fp16", "plain"), (1, 4, 4097, 128, "bf16", "causal"),
             (2, 2, 17, 128, "fp16", "softcap_causal"), (1, 1, 1, 64, "bf16", "plain")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("b,h,s,d,dtype,kind", ATTENTION)
def test_attention_on_bshd_views(torch_cuda, b, h, s, d, dtype, kind, path):
    """Q, K, V as models make them: [B, S, H, D] seen as [B, H, S, D] (Q on its own, K and V out of
    one packed projection), read in place."""
    torch = torch_cuda
    dt = getattr(torch, DTYPES[dtype])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, generator=gen, device="cuda").to(dt).transpose(1, 2)
    kv = torch.randn(b, s, 2, h, d, generator=gen, device="cuda").to(dt)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    compiled = compile_for(FUNCTIONS[kind], [q, k, v], path)
    assert_in_place(compiled, [q, k, v])
    maps = [m for launch in compiled.launches.values() for m in launch.tensor_maps]
    assert all(m.strides is not None for m in maps)
    if path == "native" and _arch() == "sm_90a" and s >= 1000:   # (17 keys: a small tile's mma.sync kernel)
        assert maps
    (out,) = run(torch, compiled, [q, k, v])
    check64(torch, out, attention64(torch, q, k, v, kind), dtype)


def test_attention_call_with_views_matches_the_contiguous_call(torch_cuda):
    """The plain call: strided and contiguous tensors compile separately (the layout is part of
    the call's key) and give the same result; a second strided call takes the fast path."""
    torch = torch_cuda
    x = torch.randn(2, 300, 3, 3, 64, device="cuda", dtype=torch.float16)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    strided = plain(q, k, v)
    again = plain(q, k, v)
    dense = plain(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(strided, again)
    check64(torch, strided, attention64(torch, q, k, v), "fp16")
    assert (strided.double() - dense.double()).abs().max() < 1e-2


@tsr.function
def gemm_bias(a, b, bias):
    return tsr.gelu(tsr.matmul(a, b) + bias, approximate="tanh")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m,n,k,pad,dtype", [(1000, 768, 512, 64, "bf16"), (37, 130, 96, 8, "fp16"),
                                             (4097, 256, 128, 128, "fp16")])
def test_gemm_on_slices_of_wider_matrices(torch_cuda, m, n, k, pad, dtype, path):
    """A and B sliced out of wider row-major matrices (row strides K + pad and N + pad)."""
    torch = torch_cuda
    dt = getattr(torch, DTYPES[dtype])
    skip = pad // 2 // 8 * 8   # (a 16-byte aligned start)
    a = torch.randn(m, k + pad, device="cuda").to(dt)[:, skip:skip + k]
    b = torch.randn(k, n + pad, device="cuda").to(dt)[:, :n]
    bias = torch.randn(n, device="cuda").to(dt)
    compiled = compile_for(gemm_bias, [a, b, bias], path)
    assert_in_place(compiled, [a, b, bias])
    (out,) = run(torch, compiled, [a, b, bias])
    ref = torch.nn.functional.gelu(a.double() @ b.double() + bias.double(), approximate="tanh")
    check64(torch, out, ref, dtype)


def test_a_misaligned_row_stride_takes_the_mma_sync_path(torch_cuda):
    """Rows 1034 bytes apart cannot be TMA boxes: the kernel says why and copies by threads."""
    torch = torch_cuda
    from tessera.lowering.tile_to_target import native_blockers
    from tessera.ir import tile
    from tessera.runtime import driver

    a = torch.randn(300, 517, device="cuda").to(torch.float16)[:, :512]
    b = torch.randn(512, 256, device="cuda").to(torch.float16)
    bias = torch.zeros(256, device="cuda", dtype=torch.float16)
    compiled = compile_for(gemm_bias, [a, b, bias], "native")
    kernels = [op for op in compiled.stage("tile").ops if isinstance(op, tile.KernelOp)]
    if _arch() == "sm_90a":
        assert any("dim 0 steps 1034 bytes" in why for why in native_blockers(kernels[0], driver.Device(0).platform()))
    (out,) = run(torch, compiled, [a, b, bias])
    check64(torch, out, torch.nn.functional.gelu(a.double() @ b.double() + bias.double(), approximate="tanh"),
            "fp16")


@tsr.function
def softmax_plus(x, y):
    return tsr.softmax(x, dim=-1) + y


@pytest.mark.parametrize("m,n,dtype", [(1, 4096, "bf16"), (257, 1000, "fp16"), (64, 8191, "bf16")])
def test_row_kernels_on_strided_rows(torch_cuda, m, n, dtype):
    """Rows of a wider buffer (stride n + 24) normed, and a softmax plus a broadcast (stride-0) row."""
    torch = torch_cuda
    dt = getattr(torch, DTYPES[dtype])
    x = torch.randn(m, n + 24, device="cuda").to(dt)[:, :n]
    w = torch.randn(n, device="cuda").to(dt)
    compiled = compile_for(rms_norm, [x, w], "native")
    assert_in_place(compiled, [x, w])
    (out,) = run(torch, compiled, [x, w])
    x64 = x.double()
    check64(torch, out, x64 * torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w.double(), dtype)

    y = torch.randn(1, n, device="cuda").to(dt).expand(m, n)
    compiled = compile_for(softmax_plus, [x, y], "native")
    assert_in_place(compiled, [x, y])
    (out,) = run(torch, compiled, [x, y])
    check64(torch, out, torch.softmax(x64, dim=-1) + y.double(), dtype)


@tsr.function
def add_scaled(x, y):
    return x * 2.0 + y


def test_an_innermost_stride_is_copied_and_named(torch_cuda):
    """x.T's innermost dim is strided: the call copies it first, the compile says so, the result is right."""
    torch = torch_cuda
    x = torch.randn(97, 130, device="cuda", dtype=torch.float16)
    y = torch.randn(130, 97, device="cuda", dtype=torch.float16)
    compiled = compile_for(add_scaled, [x.T, y], "native")
    assert compiled.copied_args == {"x": "its innermost dim has stride 130, not 1"}
    (out,) = run(torch, compiled, [x.T, y])
    check64(torch, out, x.T.double() * 2 + y.double(), "fp16")
    check64(torch, add_scaled(x.T, y), x.T.double() * 2 + y.double(), "fp16")


def test_a_program_refuses_other_strides_naming_the_argument(torch_cuda):
    torch = torch_cuda
    x = torch.randn(64, 200, device="cuda", dtype=torch.float16)
    compiled = compile_for(add_scaled, [x[:, :128], x[:, :128]], "native")
    with pytest.raises(tsr.TesseraError, match=r"argument 'x' has strides \(130, 1\), compiled for \(200, 1\)"):
        compiled.gpu_program(0)(torch.randn(64, 130, device="cuda", dtype=torch.float16)[:, :128], x[:, :128])


@pytest.mark.parametrize("n", [1, 4097, 100003])
def test_decode_reads_a_prefix_of_a_longer_cache(torch_cuda, n):
    """One query against the first n positions of a [B, S_max, H, D] cache, split across the grid."""
    torch = torch_cuda
    b, h, d, s_max = 2, 4, 128, n + 61
    cache = torch.randn(2, b, s_max, h, d, device="cuda").to(torch.bfloat16)
    k, v = (cache[i, :, :n].transpose(1, 2) for i in range(2))
    q = torch.randn(b, h, 1, d, device="cuda").to(torch.bfloat16)
    compiled = compile_for(plain, [q, k, v], "native", sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    assert_in_place(compiled, [q, k, v])
    (out,) = run(torch, compiled, [q, k, v])
    check64(torch, out, attention64(torch, q, k, v), "bf16")


def test_attention_backward_through_views(torch_cuda):
    """torch autograd through a Tessera attention called on [B, S, H, D] views: the gradients
    (Tessera's backward kernels, reading the saved views in place) match float64."""
    torch = torch_cuda
    b, s, h, d = 2, 333, 2, 64
    x = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.float16, requires_grad=True)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    out = plain(q, k, v)
    grad = torch.randn_like(out)
    out.backward(grad)
    x64 = x.detach().double().requires_grad_()
    ref = attention64(torch, *(x64[:, :, i].transpose(1, 2) for i in range(3)))
    ref.backward(grad.double())
    check64(torch, out, ref.detach(), "fp16")
    check64(torch, x.grad, x64.grad, "fp16")


def test_a_kernel_refuses_a_strided_output_naming_it(torch_cuda):
    """A @kernel's outputs are stored contiguous: a strided one is an error that names it."""
    torch = torch_cuda

    @tsr.kernel
    def double(x, out):
        out[:] = x * 2.0

    x = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    out = torch.empty(64, 256, device="cuda", dtype=torch.float16)[:, :128]
    with pytest.raises(tsr.TesseraError, match=r"double: output 'out' has strides \(256, 1\) for shape \(64, 128\)"):
        double(x, out)
    wide = torch.randn(64, 200, device="cuda", dtype=torch.float16)
    dense = torch.empty(64, 128, device="cuda", dtype=torch.float16)
    double(wide[:, :128], dense)   # a strided input is fine
    assert torch.equal(dense, wide[:, :128] * 2)


def test_cli_run_on_the_gpu_with_a_layout(torch_cuda, capsys):
    """`tessera run --layout`: the random inputs cross to the GPU in their layout, read in place."""
    from pathlib import Path

    from tessera import cli

    example = str(Path(__file__).resolve().parents[2] / "examples" / "flash_attention.py")
    assert cli.main(["run", f"{example}:flash_attention", "--shape", "B=2,H=3,S=300,D=64", "--layout", "q=B,S,H,D",
                     "--layout", "v=2,1,0,3", "--device", "gpu"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_a_kernel_writing_memory_an_input_views_is_right(torch_cuda):
    """`k(C.transpose(0, 1), C)`: the input read in place is the output's memory; the kernel writes
    fresh memory then copies (24% of elements came out wrong before)."""
    torch = torch_cuda

    @tsr.kernel
    def double(x, out):
        out[:] = x * 2.0

    c = torch.randn(256, 256, 64, device="cuda")
    want = c.transpose(0, 1) * 2.0
    double(c.transpose(0, 1), c)
    assert torch.equal(c, want)
    double(c.transpose(0, 1), c)          # the remembered program checks too
    assert torch.equal(c, want.transpose(0, 1) * 2.0)


def test_vjp_with_a_strided_cotangent(torch_cuda):
    torch = torch_cuda
    q, k, v = (torch.randn(2, 3, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, vjp_fn = tsr.vjp(plain, q, k, v)
    d_out = torch.randn(2, 300, 3, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention64(torch, *leaves), leaves, d_out.double())
    for got, w in zip(vjp_fn(d_out), want):
        check64(torch, got, w, "fp16")


@pytest.mark.parametrize("dtype", ["fp8_e5m2", "fp8_e4m3", "bf16", "fp16"])
def test_cli_inputs_cross_to_the_gpu_in_their_layout(torch_cuda, dtype):
    """`tessera run`'s random inputs (NumPy, bf16 and fp8 through bit views) reach the GPU with
    their values and strides."""
    import numpy as np

    from tessera import cli
    from tessera.frontend.trace import ArgSpec

    spec = ArgSpec("q", (2, 3, 5, 4), getattr(tsr, dtype), ("B", "H", "S", "D"), (60, 4, 12, 1))
    x = cli.random_input(np.random.default_rng(0), spec)
    t = cli._to_torch(x)
    assert t.stride() == (60, 4, 12, 1)
    np.testing.assert_array_equal(cli._to_numpy(t).astype(np.float32), x.astype(np.float32))
    dense = cli._to_torch(np.ascontiguousarray(x))
    assert dense.is_contiguous() and torch_cuda.equal(dense, t)


def test_one_tensor_passed_as_an_input_and_the_output(torch_cuda):
    """`mm(C, B, C)`: the output is also the first operand (a different argument): fresh memory, then a copy."""
    torch = torch_cuda

    @tsr.kernel
    def mm(a, b, c):
        c[:] = tsr.matmul(a, b)

    c = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    want = (c.double() @ b.double())
    mm(c, b, c)
    check64(torch, c, want, "fp16")
