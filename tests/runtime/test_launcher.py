"""GpuProgram's plan and the argument list it launches each step with (no GPU needed: encoding
and loading are faked)."""
import re

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import TensorMapSpec
from tessera.compiler import KernelLaunch
from tessera.runtime import driver, launcher, ptxas
from tessera.runtime.launcher import Step, launch_args

POINTERS = [0x1000, 0x2000, 0x3000, 0x4000]


def fake_encode(ptr, spec):
    return ("encoded", ptr, spec.shape)


def step(buffers, tensor_maps=()):
    launch = KernelLaunch("k", grid=(1, 1, 1), threads=128, dynamic_shared=0, pointers=len(buffers),
                          tensor_maps=tensor_maps, arch="sm_90a")
    return Step(launch, buffers)


def test_without_tensor_maps_each_buffer_is_a_pointer():
    assert launch_args(step((2, 0)), POINTERS, fake_encode) == [0x3000, 0x1000]
    assert step((2, 0)).launch.param_types == ("u64", "u64")


def test_tensor_maps_follow_the_pointers_over_the_buffers_they_name():
    a = TensorMapSpec(arg=1, dtype="f16", shape=(64, 64), box=(64, 64))
    b = TensorMapSpec(arg=0, dtype="f16", shape=(32, 64), box=(32, 64))
    assert launch_args(step((3, 1, 2), (a, b)), POINTERS, fake_encode) == [
        0x4000, 0x2000, 0x3000, ("encoded", 0x2000, (64, 64)), ("encoded", 0x4000, (32, 64))]
    assert step((3, 1, 2), (a, b)).launch.param_types == ("u64",) * 3 + ("tmap",) * 2


def test_a_map_over_a_dynamic_leading_dim_is_encoded_with_the_calls_size():
    """A shape-generic GEMM's A operand [M, K]: the spec leaves M to the call (`DYNAMIC`), and each
    call's map takes the size of the buffer it describes (the strides do not depend on it)."""
    a = TensorMapSpec(arg=0, dtype="f16", shape=(-1, 256), box=(128, 64))
    assert a.dynamic and a.bound((37, 256)) == TensorMapSpec(0, "f16", (37, 256), (128, 64))
    shapes = [(5, 5), (37, 256), (1000, 256)]
    assert launch_args(step((1,), (a,)), POINTERS, fake_encode, shapes) == [0x2000, ("encoded", 0x2000, (37, 256))]
    assert launch_args(step((2,), (a,)), POINTERS, fake_encode, shapes) == [0x3000, ("encoded", 0x3000, (1000, 256))]
    # a kernel reading a view of another rank (query groups split a head dim): the dim at its axis
    view = TensorMapSpec(arg=0, dtype="f16", shape=(-1, 2, 2, 64, 64), box=(1, 1, 1, 64, 64))
    assert view.bound((3, 2, 128, 64)).shape == (3, 2, 2, 64, 64)


@tsr.function
def gemm_softmax(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.softmax(tsr.matmul(a, b), dim=-1)


def compile_gemm_softmax(dims: dict[str, int], arch: str = "sm_90a", path: str = "native"):
    return gemm_softmax.compile(gemm_softmax.arg_specs_for(dims, "fp16"), arch=arch, path=path)


def ptx_params(ptx: str) -> tuple[str, ...]:
    """The `.entry`'s params as launch param types: `.param .u64` a pointer, a 128-byte
    `.param .align 64 .b8` a tensor map."""
    params = re.search(r"\.entry \w+\(([^)]*)\)", ptx).group(1)
    return tuple("u64" if ".u64" in p else "tmap" for p in params.split(",") if p.strip())


def ptx_threads(ptx: str) -> int:
    x, y, z = map(int, re.search(r"\.maxntid (\d+), (\d+), (\d+)", ptx).groups())
    return x * y * z


@pytest.mark.parametrize("dims, kernels", [
    (dict(M=256, K=128, N=256), 2),       # TMA + wgmma GEMM (tensor map params), then a softmax kernel
    (dict(M=128, K=4096, N=4096), 3),     # split-K: partial products into an intermediate, their sum, softmax
])
def test_plan_launches_each_kernel_as_the_compile_says(dims, kernels):
    """Every step launches its kernel with the compile's KernelLaunch, which agrees with the
    kernel's PTX (params, threads, dynamic shared memory) and the host code (grid, one buffer per
    pointer param)."""
    from tessera.ir import tile

    compiled = compile_gemm_softmax(dims)
    plan = launcher.plan(compiled)
    ptx = compiled.stage("ptx")
    host_grids = [tile.int_values(op.grid) for op in compiled.host_function().body.block.ops
                  if isinstance(op, tile.LaunchOp)]
    assert len(plan.steps) == kernels == len(host_grids)
    for step, grid in zip(plan.steps, host_grids, strict=True):
        launch = step.launch
        assert launch is compiled.launches[launch.name]
        assert launch.grid == grid and len(step.buffers) == launch.pointers
        kernel = ptx[launch.name]
        assert launch.param_types == ptx_params(kernel.ptx)
        assert launch.threads == ptx_threads(kernel.ptx)
        assert (launch.dynamic_shared, launch.tensor_maps, launch.arch) == (
            kernel.dynamic_shared, kernel.tensor_maps, "sm_90a")
    assert any(s.launch.tensor_maps for s in plan.steps)
    n_buffers = len(plan.inputs) + len(plan.outputs) + len(plan.intermediates)
    assert {i for s in plan.steps for i in s.buffers} == set(range(n_buffers))


@pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")
def test_program_loads_the_cubin_stage_for_the_devices_arch(monkeypatch, tmp_path):
    """An sm_80 compile on an sm_86 device: the program loads the cubin stage built for sm_86
    (memoised beside the compile's own arch), raising each kernel's dynamic shared memory limit
    to what its launch needs."""
    from tessera import platforms

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(driver, "device_platform", lambda device: platforms.get("sm_86"))
    loaded = {}

    class FakeKernel:
        max_dynamic_shared = 48 * 1024

        def set_max_dynamic_shared(self, size):
            self.max_dynamic_shared = size

    class FakeFunctions:
        def kernel(self, cubin, name, device):
            loaded[name] = (cubin, device)
            return FakeKernel()

    monkeypatch.setattr(launcher, "functions", FakeFunctions())
    compiled = compile_gemm_softmax(dict(M=256, K=128, N=256), arch="sm_80")
    program = compiled.gpu_program(1)
    assert compiled.gpu_program(1) is program
    cubins = compiled.stage("cubin", arch="sm_86")
    assert all(c.arch == "sm_86" for c in cubins.values())
    assert loaded == {name: (cubins[name].cubin, 1) for name in compiled.launches}
    for name, kernel in program.kernels.items():
        assert kernel.max_dynamic_shared == max(48 * 1024, compiled.launches[name].dynamic_shared)
    assert len(list(tmp_path.glob("*.cubin"))) == len(compiled.launches)   # nothing assembled for sm_80


def test_encoded_tensor_maps_are_reused_per_pointer_and_spec(monkeypatch):
    """A steady-state call re-launches on the same buffers: their maps are encoded once; another
    pointer or another box is encoded anew, and the cache starts over past its size."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(driver, "encode_tensor_map", lambda ptr, spec: calls.append((ptr, spec)) or bytes(128))
    program = SimpleNamespace(_tensor_maps={})
    a = TensorMapSpec(arg=0, dtype="f16", shape=(64, 64), box=(64, 64))
    b = TensorMapSpec(arg=0, dtype="f16", shape=(64, 64), box=(32, 64))
    for ptr, spec in [(0x1000, a), (0x1000, a), (0x2000, a), (0x1000, b), (0x1000, a)]:
        launcher.GpuProgram._tensor_map(program, ptr, spec)
    assert calls == [(0x1000, a), (0x2000, a), (0x1000, b)]
    monkeypatch.setattr(launcher, "TENSOR_MAP_CACHE_SIZE", 3)
    launcher.GpuProgram._tensor_map(program, 0x3000, a)
    assert len(program._tensor_maps) == 1 and calls[-1] == (0x3000, a)
