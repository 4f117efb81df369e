"""PTX of the debugging features: line info pointing at the user's Python lines, device asserts
through CUDA's __assertfail, profile stamps of %clock64; all assembled by ptxas. Without them,
the PTX is what it was: source locations in the IR change nothing."""
import os
import re
import subprocess
import tempfile

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import emit_module
from tessera.backends.ptx.debug import KernelDebug
from tessera.ir import provenance
from tessera.ir import target as tgt
from tessera.runtime import ptxas

from seed_kernels import causal_attention

needs_ptxas = pytest.mark.skipif(not ptxas.available(), reason="ptxas (CUDA toolkit) not installed")
needs_nvdisasm = pytest.mark.skipif(not ptxas.available("nvdisasm"), reason="nvdisasm not installed")


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))


@tsr.function
def softmax_of_exp(x: Tensor["M", "N"]):
    y = tsr.exp(x) * 2.0  # exp
    return tsr.softmax(y, dim=-1)  # softmax


@tsr.function
def gemm_checked(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    c = tsr.matmul(a, b)
    tsr.device_assert(c == c, "product has no NaN")  # gemm assert
    return tsr.relu(c)


@tsr.function
def elementwise_checked(x: Tensor["M", "N"]):
    tsr.device_assert(x > -1.0, "x above -1")
    return x * 2.0


@tsr.function
def norm_checked(x: Tensor["M", "N"], w: Tensor["N"]):
    y = tsr.rms_norm(x, (x.shape[-1],), w)
    tsr.device_assert(y < 1e4, "normalized")
    return y


@tsr.function
def profiled(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    with tsr.profile_region("mainloop"):
        c = tsr.matmul(a, b)
    with tsr.profile_region("epilogue"):
        return tsr.gelu(c)


def ptx_of(fn, dims, arch, dtype="fp16", **options) -> dict:
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=arch, **options)
    return {name: k.ptx for name, k in compiled.stage("ptx").items()}


def test_line_info_names_the_file_and_the_lines_of_each_op():
    (ptx,) = ptx_of(softmax_of_exp, {"M": 64, "N": 256}, "sm_80", "fp32", line_info=True).values()
    (number,) = re.findall(rf'^\.file (\d+) "{re.escape(__file__)}"$', ptx, re.MULTILINE)
    lines = {int(n) for n in re.findall(rf"^\s*\.loc {number} (\d+) 0$", ptx, re.MULTILINE)}
    assert lines == {line_of("exp"), line_of("softmax")}


def test_without_line_info_nothing_is_written():
    (ptx,) = ptx_of(softmax_of_exp, {"M": 64, "N": 256}, "sm_80", "fp32").values()
    assert ".file" not in ptx and ".loc" not in ptx and not ptxas.has_line_info(ptx)


def _without_provenance(module):
    stripped = module.clone()
    for op in stripped.walk():
        for key in [k for k in op.attributes if k.startswith(provenance.PREFIX)]:
            del op.attributes[key]
    return stripped


@pytest.mark.parametrize("fn, dims, arch", [
    (softmax_of_exp, {"M": 64, "N": 256}, "sm_80"),
    (profiled, {"M": 128, "K": 64, "N": 128}, "sm_90a"),
    (causal_attention, {"B": 1, "H": 2, "S": 100, "D": 64}, "sm_90a"),
])
def test_source_locations_alone_leave_the_ptx_byte_identical(fn, dims, arch):
    compiled = fn.compile(fn.arg_specs_for(dims, "fp16"), arch=arch)
    target = compiled.modules["target"]
    assert all(KernelDebug.of(k) is None for k in target.ops if isinstance(k, tgt.KernelOp))
    ptx = {n: k.ptx for n, k in emit_module(target).items()}
    assert ptx == {n: k.ptx for n, k in emit_module(_without_provenance(target)).items()}


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_line_info_assembles_with_lineinfo(arch):
    for ptx in ptx_of(causal_attention, {"B": 1, "H": 2, "S": 100, "D": 64}, arch, line_info=True).values():
        assert ptxas.has_line_info(ptx)
        ptxas.assemble(ptx, arch)


def _line_table(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([ptxas.find_tool("nvdisasm"), "--print-line-info", path], capture_output=True,
                              text=True, check=True).stdout


@needs_ptxas
@needs_nvdisasm
def test_the_cubin_maps_sass_back_to_the_python_lines():
    (ptx,) = ptx_of(softmax_of_exp, {"M": 64, "N": 256}, "sm_80", "fp32", line_info=True).values()
    table = _line_table(ptxas.assemble(ptx, "sm_80").cubin)
    for marker in ("exp", "softmax"):
        assert f'File "{__file__}", line {line_of(marker)}' in table


@pytest.mark.parametrize("fn, dims", [
    (gemm_checked, {"M": 100, "K": 64, "N": 72}),
    (elementwise_checked, {"M": 40, "N": 300}),
    (norm_checked, {"M": 10, "N": 300}),
])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_asserts_call_assertfail_with_message_and_line(fn, dims, arch):
    ptx = "\n".join(ptx_of(fn, dims, arch).values())
    assert ".extern .func __assertfail" in ptx
    assert re.search(r"^\s*call __assertfail, \(", ptx, re.MULTILINE)
    strings = {bytes(int(b) for b in body.split(", ")[:-1]).decode()
               for body in re.findall(r"^\.global \.align 1 \.b8 \w+\[\d+\] = \{([^}]*)\};$", ptx, re.MULTILINE)}
    assert __file__ in strings
    if fn is gemm_checked:
        assert "product has no NaN" in strings
        assert f"st.param.b32 [assert_param2], {line_of('gemm assert')};" in ptx
    if ptxas.available():
        for kernel_ptx in ptx_of(fn, dims, arch).values():
            ptxas.assemble(kernel_ptx, arch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_profile_stamps_read_clock64_in_thread_0(arch):
    (ptx,) = ptx_of(profiled, {"M": 256, "K": 128, "N": 256}, arch, profile=True).values()
    slots = 3   # the kernel, mainloop, epilogue
    assert len(re.findall(r"mov\.u64 %rd\d+, %clock64;", ptx)) == 2 * slots
    offsets = sorted(int(o) for o in re.findall(r"st\.global\.u64 \[%rd\d+\+(\d+)\], %rd\d+;", ptx))
    assert offsets == [8 * i for i in range(2 * slots)]
    assert "%tid.x" in ptx and "%ctaid.z" in ptx
    if ptxas.available():
        ptxas.assemble(ptx, arch)
