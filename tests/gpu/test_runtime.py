"""tessera.runtime on a real GPU: device properties, loading, launching, errors, streams.

Tests taking the `cuda_device` fixture skip without a GPU; the argument-packing
tests at the top need none and run everywhere.
"""
import ctypes
import re
import struct

import ml_dtypes
import numpy as np
import pytest

from tessera import platforms
from tessera.runtime import cache, driver, interop, ptxas
from tessera.runtime.driver import ArgumentError, CudaError, Module, PackedArgs

HEADER = ".version 8.0\n.target {arch}\n.address_size 64\n"

# out[i] = i for i < n, over a 1-D grid.
IOTA = """
.visible .entry iota(.param .u64 out, .param .u32 n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.u64 %rd2, %rd2, %rd3;
    st.global.u32 [%rd2], %r5;
DONE:
    ret;
}
"""

# Every scalar parameter stored to `out` at a fixed offset (see RECORD): mixed
# sizes put the parameters at offsets that only correct packing gets right.
STORE_ALL = """
.visible .entry store_all(.param .u64 out, .param .s32 a, .param .f32 b, .param .u16 c, .param .f64 d,
                          .param .s64 e, .param .u8 f, .param .b16 h, .param .b16 g)
{
    .reg .b16 %rs<4>;
    .reg .b32 %r<2>;
    .reg .f32 %f<2>;
    .reg .f64 %fd<2>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd2, %rd1;
    ld.param.s32 %r1, [a];
    st.global.s32 [%rd2], %r1;
    ld.param.f32 %f1, [b];
    st.global.f32 [%rd2+4], %f1;
    ld.param.u16 %rs1, [c];
    st.global.u16 [%rd2+8], %rs1;
    ld.param.u8 %rs2, [f];
    st.global.u8 [%rd2+10], %rs2;
    ld.param.b16 %rs3, [h];
    st.global.b16 [%rd2+12], %rs3;
    ld.param.b16 %rs3, [g];
    st.global.b16 [%rd2+14], %rs3;
    ld.param.f64 %fd1, [d];
    st.global.f64 [%rd2+16], %fd1;
    ld.param.s64 %rd3, [e];
    st.global.s64 [%rd2+24], %rd3;
    ret;
}
"""
RECORD = np.dtype({"names": ["a", "b", "c", "f", "h", "g", "d", "e"],
                   "formats": ["<i4", "<f4", "<u2", "u1", "<f2", ml_dtypes.bfloat16, "<f8", "<i8"],
                   "offsets": [0, 4, 8, 10, 12, 14, 16, 24], "itemsize": 32})
STORE_ALL_ARGS = [("s32", -123456), ("f32", 3.25), ("u16", 65535), ("f64", 1e300),
                  ("s64", -(2**40) - 3), ("u8", 200), ("f16", 1.5), ("bf16", -2.0)]

def smem_roundtrip(name: str, static_bytes: int = 0) -> str:
    """Thread t writes t + 1000 to the t-th word from the END of dynamic shared memory and reads it
    back: it faults unless all `words` words were granted. With `static_bytes`, the value first
    passes through word t of a static .shared array of that size."""
    static, through_static = "", ""
    if static_bytes:
        static = f"    .shared .align 16 .b8 fixed[{static_bytes}];\n"
        through_static = ("    shl.b32 %r8, %r2, 2;\n    mov.u32 %r9, fixed;\n    add.u32 %r9, %r9, %r8;\n"
                          "    st.shared.u32 [%r9], %r6;\n    bar.sync 0;\n    ld.shared.u32 %r6, [%r9];\n")
    return (f"""
.extern .shared .align 16 .b8 dsmem[];
.visible .entry {name}(.param .u64 out, .param .u32 words)
{{
{static}    .reg .b32 %r<10>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [words];
    mov.u32 %r2, %tid.x;
    sub.u32 %r3, %r1, 1;
    sub.u32 %r3, %r3, %r2;
    shl.b32 %r4, %r3, 2;
    mov.u32 %r5, dsmem;
    add.u32 %r5, %r5, %r4;
    add.u32 %r6, %r2, 1000;
{through_static}    st.shared.u32 [%r5], %r6;
    bar.sync 0;
    ld.shared.u32 %r7, [%r5];
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r2, 4;
    add.u64 %rd2, %rd2, %rd3;
    st.global.u32 [%rd2], %r7;
    ret;
}}
""")


DYN_SMEM = smem_roundtrip("dyn_smem")
STATIC_AND_DYN_SMEM = smem_roundtrip("static_and_dyn_smem", static_bytes=16384)


def ptx(arch, *bodies):
    return HEADER.format(arch=arch) + "".join(bodies)


# --- argument packing (no GPU needed) ---------------------------------------------------------

def packed_bytes(args):
    packed = PackedArgs(args)
    pointers = ctypes.cast(packed.address, ctypes.POINTER(ctypes.c_void_p))
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(packed.sizes)]


def test_each_argument_is_packed_at_its_exact_size():
    got = packed_bytes([("u64", 0x1122334455667788), ("s32", -2), ("f32", 1.5), ("u8", 255), ("f64", 0.25),
                        ("f16", 1.5), ("bf16", -2.0), ("s16", -1), ("b32", 7)])
    assert got == [struct.pack("<Q", 0x1122334455667788), struct.pack("<i", -2), struct.pack("<f", 1.5),
                   b"\xff", struct.pack("<d", 0.25), struct.pack("<e", 1.5), b"\x00\xc0", b"\xff\xff",
                   struct.pack("<I", 7)]


def test_numpy_scalars_are_accepted():
    assert packed_bytes([("s32", np.int64(5)), ("f32", np.float32(0.5))]) == [
        struct.pack("<i", 5), struct.pack("<f", 0.5)]


@pytest.mark.parametrize("arg, message", [
    (("s32", 2**31), r"2147483648 does not fit in s32"),
    (("u32", -1), r"-1 does not fit in u32"),
    (("u64", 2**64), r"does not fit in u64"),
    (("s32", 1.5), r"'float' object cannot be interpreted as an integer"),
    (("f32", 1e39), r"overflows f32"),
    (("i32", 1), r"unknown PTX param type 'i32'"),
    (("u64",), r"argument 0"),
])
def test_values_that_would_be_corrupted_are_refused(arg, message):
    with pytest.raises(ArgumentError, match=message):
        PackedArgs([arg])


def test_no_arguments_is_a_valid_pointer_array():
    assert PackedArgs([]).address != 0 and PackedArgs([]).sizes == ()


# --- devices ----------------------------------------------------------------------------------

def test_device_properties_look_sane(cuda_device):
    d = cuda_device
    assert d.sm_count > 0 and d.compute_capability >= (8, 0) and d.warp_size == 32
    assert d.max_shared_per_block_optin > 48 * 1024 and d.max_shared_per_sm >= d.max_shared_per_block_optin
    assert d.l2_bytes > 1 << 20 and d.regs_per_sm >= 65536 and d.name
    platform = d.platform()
    assert platform.sm_count == d.sm_count and platform.max_shared_per_block == d.max_shared_per_block_optin
    assert platform.version == d.compute_capability
    assert platform.max_threads_per_sm == d.max_threads_per_sm and platform.max_blocks_per_sm == d.max_blocks_per_sm
    registry = platforms.get(platform.arch)   # the registry's limits are the device's
    assert (registry.max_threads_per_sm, registry.max_blocks_per_sm) == (d.max_threads_per_sm, d.max_blocks_per_sm)


def test_bad_ordinal_is_refused(cuda_device):
    with pytest.raises(ValueError, match="no CUDA device 999"):
        driver.Device(999)


# --- loading and launching --------------------------------------------------------------------

@pytest.fixture
def buffer(cuda_device):
    """Allocate raw device memory; freed after the test."""
    pointers = []

    def alloc(nbytes):
        pointers.append(driver.mem_alloc(nbytes))
        return pointers[-1]
    yield alloc
    for p in pointers:
        driver.mem_free(p)


def read(ptr, count, dtype):
    out = np.empty(count, dtype=dtype)
    driver.synchronize()
    driver.memcpy_dtoh(out, ptr)
    return out


@pytest.mark.parametrize("load", ["cubin", "ptx"])
def test_iota_through_cubin_and_jit(cuda_device, arch, buffer, load):
    source = ptx(arch, IOTA)
    module = Module.from_cubin(ptxas.assemble(source, arch).cubin) if load == "cubin" else Module.from_ptx(source)
    kernel = module.function("iota")
    n = 1000
    out = buffer(4096 * 4)
    driver.memcpy_htod(out, np.full(4096, -1, dtype=np.int32))
    driver.launch(kernel, grid=(n + 255) // 256, block=256, args=[("u64", out), ("u32", n)])
    got = read(out, 4096, np.int32)
    assert (got[:n] == np.arange(n)).all() and (got[n:] == -1).all()


def test_every_scalar_type_arrives_intact(arch, buffer):
    kernel = Module.from_cubin(ptxas.assemble(ptx(arch, STORE_ALL), arch).cubin).function("store_all")
    assert kernel.param_sizes in (None, (8, 4, 4, 2, 8, 8, 1, 2, 2))
    out = buffer(RECORD.itemsize)
    driver.launch(kernel, 1, 1, args=[("u64", out), *STORE_ALL_ARGS])
    got = read(out, RECORD.itemsize, np.uint8).view(RECORD)[0]
    assert (got["a"], got["b"], got["c"], got["d"], got["e"], got["f"]) == (-123456, 3.25, 65535, 1e300,
                                                                             -(2**40) - 3, 200)
    assert float(got["h"]) == 1.5 and float(got["g"]) == -2.0


def test_argument_mismatches_are_caught_before_launch(arch, buffer):
    kernel = Module.from_ptx(ptx(arch, IOTA)).function("iota")
    if kernel.param_sizes is None:
        pytest.skip("this driver or cuda-bindings cannot report parameter sizes (cuFuncGetParamCount, CUDA 13.1+)")
    out = buffer(16)
    with pytest.raises(ArgumentError, match="kernel 'iota' parameter 1 is 4 bytes, but argument 1 packs to 8"):
        driver.launch(kernel, 1, 1, args=[("u64", out), ("u64", 4)])
    with pytest.raises(ArgumentError, match="kernel 'iota' takes 2 parameters, got 1 arguments"):
        driver.launch(kernel, 1, 1, args=[("u64", out)])


def test_too_many_threads_names_the_kernel_and_configuration(arch, buffer):
    kernel = Module.from_ptx(ptx(arch, IOTA)).function("iota")
    with pytest.raises(CudaError, match=r"cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE .*kernel 'iota' "
                                        r"with grid \(3, 1, 1\), block \(2048, 1, 1\), 0 bytes dynamic shared"):
        driver.launch(kernel, 3, 2048, args=[("u64", buffer(16)), ("u32", 1)])


def test_missing_kernel_is_named(arch):
    module = Module.from_ptx(ptx(arch, IOTA))
    with pytest.raises(CudaError, match="cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND.*'nope'"):
        module.function("nope")


def test_jit_errors_carry_the_jit_log(arch):
    bad = ptx(arch, IOTA.replace("st.global.u32 [%rd2], %r5;", "st.global.u32 [%rd2], %r5 oops;"))
    with pytest.raises(CudaError, match=r"(?s)cuModuleLoadDataEx failed: .*loading PTX on cuda:0:\n"
                                        r"  line \d+: Parsing error near 'oops'.*\| st.global.u32 \[%rd2\], %r5 oops;"):
        Module.from_ptx(bad)


def test_kernel_attributes(arch):
    kernel = Module.from_cubin(ptxas.assemble(ptx(arch, IOTA), arch).cubin).function("iota")
    attrs = kernel.attributes()
    assert 0 < attrs.num_regs <= 32 and attrs.static_shared_bytes == 0 and attrs.local_bytes == 0
    assert attrs.max_threads_per_block == 1024 and attrs.max_dynamic_shared_bytes == 48 * 1024


def test_dynamic_shared_memory_above_48kb(cuda_device, arch, buffer):
    kernel = Module.from_cubin(ptxas.assemble(ptx(arch, DYN_SMEM), arch).cubin).function("dyn_smem")
    nbytes = min(cuda_device.max_shared_per_block_optin, 200 * 1024) // 16 * 16
    assert nbytes > 48 * 1024
    out = buffer(256 * 4)
    args = [("u64", out), ("u32", nbytes // 4)]
    with pytest.raises(CudaError, match="call set_max_dynamic_shared first"):
        driver.launch(kernel, 1, 256, shared_bytes=nbytes, args=args)
    kernel.set_max_dynamic_shared(nbytes)
    assert kernel.attributes().max_dynamic_shared_bytes == nbytes
    driver.launch(kernel, 1, 256, shared_bytes=nbytes, args=args)
    assert (read(out, 256, np.uint32) == np.arange(256) + 1000).all()


def test_static_shared_memory_counts_against_the_default_limit(arch, buffer):
    """48 KB is static and dynamic together: with 16 KB of .shared arrays, 40 KB of dynamic
    shared memory needs the opt-in (the launch fails otherwise, and says so)."""
    kernel = Module.from_cubin(ptxas.assemble(ptx(arch, STATIC_AND_DYN_SMEM), arch).cubin).function(
        "static_and_dyn_smem")
    assert kernel.static_shared == 16384 and kernel.max_dynamic_shared == 32 * 1024
    nbytes = 40 * 1024
    out = buffer(256 * 4)
    args = [("u64", out), ("u32", nbytes // 4)]
    with pytest.raises(CudaError, match="above its 32768-byte limit: call set_max_dynamic_shared first"):
        driver.launch(kernel, 1, 256, shared_bytes=nbytes, args=args)
    kernel.set_max_dynamic_shared(nbytes)
    driver.launch(kernel, 1, 256, shared_bytes=nbytes, args=args)
    assert (read(out, 256, np.uint32) == np.arange(256) + 1000).all()


def test_kernel_from_ptx_caches_cubin_and_kernel(arch, buffer, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    source = ptx(arch, IOTA, "// kernel_from_ptx test\n")
    kernel = cache.kernel_from_ptx(source, "iota", arch)
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert cache.kernel_from_ptx(source, "iota", arch) is kernel
    out = buffer(64 * 4)
    driver.launch(kernel, 1, 64, args=[("u64", out), ("u32", 64)])
    assert (read(out, 64, np.int32) == np.arange(64)).all()


# --- frameworks and streams -------------------------------------------------------------------

def test_launch_on_torch_current_stream(torch_cuda, arch):
    torch = torch_cuda
    kernel = Module.from_ptx(ptx(arch, IOTA)).function("iota")
    x = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        handle = driver.current_torch_stream()
        assert handle == side.cuda_stream != torch.cuda.default_stream().cuda_stream
        driver.launch(kernel, 16, 256, stream=handle, args=[("u64", x.data_ptr()), ("u32", 4000)])
    driver.synchronize(side)
    expected = torch.arange(4096, dtype=torch.int32, device="cuda")
    expected[4000:] = -1
    assert torch.equal(x, expected)


def test_torch_tensors_validate_and_allocate(torch_cuda):
    torch = torch_cuda
    q = torch.zeros((2, 8, 64), dtype=torch.float16, device="cuda")
    info = interop.validate({"q": q})["q"]
    assert (info.data_ptr, info.shape, info.strides, info.device, info.framework) == (
        q.data_ptr(), (2, 8, 64), (512, 64, 1), 0, "torch")
    assert info.dtype.name == "fp16"
    with pytest.raises(interop.LayoutError, match=re.escape(
            "argument 'q' must be contiguous (strides (512, 1, 64) for shape (2, 64, 8))")):
        interop.validate({"q": q.transpose(1, 2)})
    with pytest.raises(interop.LayoutError, match="argument 'q' data pointer is not 16-byte aligned"):
        interop.validate({"q": q.view(-1)[1:]})
    with pytest.raises(interop.DeviceError, match="argument 'k' must be on a CUDA device, but is a torch array"):
        interop.validate({"q": q, "k": q.cpu()})
    out = interop.empty_like_framework(q, (3, 4), "bf16")
    assert out.dtype == torch.bfloat16 and out.device == q.device and out.shape == (3, 4)


def test_cupy_arrays_are_described(cuda_device):
    cupy = pytest.importorskip("cupy")
    a = cupy.zeros((4, 32), dtype=cupy.float32)
    info = interop.describe(a)
    assert (info.data_ptr, info.shape, info.strides, info.device, info.framework) == (
        a.data.ptr, (4, 32), (32, 1), 0, "cupy")
    out = interop.empty_like_framework(a, (5,), "fp16")
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16


def test_a_program_checks_every_call_after_its_first(torch_cuda, arch, monkeypatch):
    """Once a call validated, later calls of the same program take the fast path; each check it
    skips must still hold: a tensor that differs in layout, alignment, dtype or device falls back
    to full validation and its error, and the results stay right."""
    import tessera as tsr
    from tessera import Tensor

    torch = torch_cuda

    def scale_add(x: Tensor["M", "N"], y: Tensor["M", "N"]):
        return x * 2.0 + y

    fn = tsr.function(scale_add)
    program = fn.compile(fn.arg_specs_for(dict(M=64, N=128), "fp16"), arch=arch).gpu_program(0)
    x, y = (torch.randn(64, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    (out,) = program(x, y)   # validated: the program learns the call's signature
    torch.testing.assert_close(out, x * 2 + y)
    with monkeypatch.context() as m:   # the next calls take the fast path: full validation is not reached
        m.setattr(interop, "validate", lambda *a, **k: pytest.fail("fast path not taken"))
        for _ in range(2):
            (out,) = program(x, y)
            torch.testing.assert_close(out, x * 2 + y)
    wide = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(interop.LayoutError, match=r"argument 'y' has strides \(1, 64\), compiled for a contiguous"):
        program(x, wide.t())
    with pytest.raises(interop.LayoutError, match="argument 'x' data pointer is not 16-byte aligned"):
        program(torch.empty(64 * 128 + 1, device="cuda", dtype=torch.float16)[1:].view(64, 128), y)
    with pytest.raises(tsr.TesseraError, match="argument 'y'.*float32"):
        program(x, y.float())
    with pytest.raises(tsr.ShapeError, match="argument 'x' has shape"):
        program(x[:32], y)
    with pytest.raises(tsr.TesseraError, match="argument 'y'"):
        program(x, y.cpu())
    out = torch.full_like(x, float("nan"))
    program(x, y, out=[out])
    torch.testing.assert_close(out, x * 2 + y)
    with pytest.raises(tsr.TesseraError, match="out= takes 1 array"):
        program(x, y, out=[])
    with pytest.raises(tsr.TesseraError, match="argument 'out0'.*float32"):
        program(x, y, out=[out.float()])


def test_a_function_reruns_the_program_of_an_earlier_identical_call(torch_cuda, arch, monkeypatch):
    """A @function called again with CUDA tensors of the same shapes, dtypes and device, the same
    numbers and options, launches the program the first call compiled without splitting arguments
    or building the compile key; anything else (a new shape, a new constant) takes the full path,
    and a tensor the program cannot take still gets the program's named error."""
    import tessera as tsr
    from tessera import Tensor
    from tessera.frontend import function as function_module

    torch = torch_cuda

    def scale_add(x: Tensor["M", "N"], y: Tensor["M", "N"], c: float):
        return x * c + y

    fn = tsr.function(scale_add)
    x, y = (torch.randn(64, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    torch.testing.assert_close(fn(x, y, 2.0), x * 2 + y)
    with monkeypatch.context() as m:
        m.setattr(function_module, "_gpu_options", lambda *a: pytest.fail("the remembered program was not used"))
        torch.testing.assert_close(fn(x, y, 2.0), x * 2 + y)
        with pytest.raises(interop.LayoutError, match="argument 'y' data pointer is not 16-byte aligned"):
            fn(x, torch.empty(64 * 128 + 8, device="cuda", dtype=torch.float16)[1:1 + 64 * 128].view(64, 128), 2.0)
    torch.testing.assert_close(fn(x, y, 0.5), x * 0.5 + y)          # another constant: another program
    torch.testing.assert_close(fn(x[:32], y[:32], 2.0), x[:32] * 2 + y[:32])
    t = torch.randn(128, 64, device="cuda", dtype=torch.float16).t()
    torch.testing.assert_close(fn(x, t, 2.0), x * 2 + t)              # another layout: another program
    assert len(fn._programs) == 4


def test_tma_kernels_run_on_a_second_gpu(torch_cuda):
    """A GEMM on the TMA path with its tensors on cuda:1: encoding its tensor maps once made
    device 0's context current, and the launch then failed (CUDA_ERROR_INVALID_HANDLE)."""
    import tessera as tsr
    from tessera import Tensor

    torch = torch_cuda
    if torch.cuda.device_count() < 2:
        pytest.skip(f"2 GPUs needed, {torch.cuda.device_count()} visible")

    @tsr.function
    def mm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
        return tsr.matmul(a, b)
    a, b = (torch.randn(s, device="cuda:1").to(torch.bfloat16) for s in ((1000, 512), (512, 768)))
    got = mm(a, b)
    assert got.device == a.device
    want = a.double() @ b.double()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def test_cuda_graph_capture_and_replay_of_tessera_calls(torch_cuda):
    """A sequence of Tessera calls (a norm, a GEMM through the TMA path, a causal attention) captured
    in a torch CUDA graph and replayed on new input values matches the same calls run eagerly:
    the launches go to torch's capturing stream, the outputs come from the graph's memory pool and
    nothing in the call path synchronizes."""
    import math

    import tessera as tsr
    from tessera import Tensor

    torch = torch_cuda

    @tsr.function
    def norm(x: Tensor["N", "C"], w: Tensor["C"]):
        return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)

    @tsr.function
    def project(x: Tensor["N", "C"], w: Tensor["C", "F"]):
        return tsr.matmul(x, w)

    @tsr.function
    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        i, j = tsr.arange(s.shape[-2]), tsr.arange(s.shape[-1])
        return tsr.matmul(tsr.softmax(tsr.where(i[:, None] >= j[None, :], s, -math.inf), dim=-1), v)

    def step(x, w_norm, w_proj):
        h = project(norm(x, w_norm), w_proj)                        # [2 * 100, 3 * 64]
        q = h.view(2, 100, 3, 64).transpose(1, 2).contiguous()
        return attention(q, q, q)

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(200, 256, device="cuda", generator=gen).to(torch.bfloat16)
    w_norm = torch.randn(256, device="cuda", generator=gen).to(torch.bfloat16)
    w_proj = (torch.randn(256, 192, device="cuda", generator=gen) / 16).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(x, w_norm, w_proj)          # compiles and loads every kernel before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x, w_norm, w_proj)
    for seed in (1, 2):
        x.copy_(torch.randn(200, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = step(x, w_norm, w_proj)
        assert not torch.isnan(out).any()
        assert torch.equal(out, want), f"replay {seed} differs from the eager calls"
