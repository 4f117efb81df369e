"""Programmatic dependent launch (Target IR's `tessera_target.programmatic_launch`): on sm_90+ every
kernel of a call but the first waits for the kernel before it in griddepcontrol.wait, after its
setup and before any read or write of global memory, and its launch says so; the first kernel,
older targets and CUDA Tile IR kernels launch plainly and have no wait."""
import functools
import re
import shutil

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.ir import target as tgt
from tessera.runtime import artifact

from decode_attention import gqa_decode_attention

DIMS = dict(B=1, Hk=2, G=4, M=1, N=4096, D=64)
#: what may run before griddepcontrol.wait: instructions that touch no memory but the parameters
#: (`ld.param`) and no barrier; anything else (a load, store, copy, atomic, prefetch, fence, barrier
#: or mbarrier op, or a call) must follow it
BEFORE_WAIT = re.compile(r"^(@!?%p\d+ )?(ld\.param|cvta|mov|add|sub|mul|mad|and|or|xor|shl|shr|setp|selp|not|"
                         r"cvt|min|max|rem|div|neg|abs|trap|bra)\b")


@tsr.function
def softmax_then_gemm(x: Tensor["M", "K", tsr.bf16], b: Tensor["K", "N", tsr.bf16]):
    return tsr.matmul(tsr.softmax(x, -1).to(tsr.bf16), b)


def compile_decode(arch: str, **options):
    specs = gqa_decode_attention.arg_specs_for(DIMS, "bf16")
    return gqa_decode_attention.compile(specs, arch=arch, **options), specs


def lines_before_the_wait(ptx: str) -> list[str]:
    """The body's instructions before griddepcontrol.wait (labels, declarations and comments left out)."""
    body = ptx.split("{", 1)[1].splitlines()
    (wait,) = [i for i, line in enumerate(body) if "griddepcontrol.wait" in line]
    return [line.strip() for line in body[:wait]
            if line.strip() and not line.strip().startswith((".reg", "//", "$")) and not line.strip().endswith(":")]


@functools.cache
def compiled_cases():
    decode = [compile_decode("sm_90a", path=path)[0] for path in ("native", "ampere")]
    specs = softmax_then_gemm.arg_specs_for(dict(M=256, K=512, N=1024))
    gemm = [softmax_then_gemm.compile(specs, arch="sm_90a", **options) for options in ({}, {"profile": True})]
    return decode + gemm


@pytest.mark.parametrize("case", range(4), ids=["decode", "decode-ampere", "softmax-tma-gemm", "profiled"])
def test_a_calls_later_kernels_wait_for_the_kernel_before_them_before_touching_memory(case):
    compiled = compiled_cases()[case]
    first, *later = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)]
    assert later and tgt.PROGRAMMATIC_LAUNCH not in first.attributes
    assert all(tgt.PROGRAMMATIC_LAUNCH in k.attributes for k in later)
    assert "tessera_target.programmatic_launch" in compiled.ir("target")
    kernels = compiled.stage("ptx")
    assert "griddepcontrol" not in kernels[first.sym_name.data].ptx
    assert not compiled.launches[first.sym_name.data].programmatic
    for kernel in later:
        name = kernel.sym_name.data
        early = [line for line in lines_before_the_wait(kernels[name].ptx) if not BEFORE_WAIT.match(line)]
        assert not early, (name, early)
        assert "launch_dependents" not in kernels[name].ptx   # dependents launch as a kernel exits
        assert compiled.launches[name].programmatic


def test_the_gemm_case_is_a_tma_kernel_with_its_setup_before_the_wait():
    """The check above is not vacuous: the dependent GEMM copies with TMA, and its setup (shared
    memory addresses, the leader thread) comes before the wait while its mbarrier init follows."""
    compiled = compiled_cases()[2]
    ptx = compiled.stage("ptx")[compiled.kernel_names[1]].ptx
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.init" in ptx
    assert len(lines_before_the_wait(ptx)) > 10
    assert ptx.index("mbarrier.init") > ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_older_targets_launch_plainly(arch):
    compiled, _ = compile_decode(arch)
    assert "programmatic_launch" not in compiled.ir("target")
    assert not any(launch.programmatic for launch in compiled.launches.values())
    assert all("griddepcontrol" not in k.ptx for k in compiled.stage("ptx").values())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")
def test_the_wait_assembles_and_an_artifact_keeps_the_launch_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    compiled, specs = compile_decode("sm_90a")
    assert compiled.stage("cubin")
    a = artifact.Artifact.from_compiled(compiled, specs, dims=DIMS)
    _, back = artifact.unpack(artifact.pack({}, a))
    assert back.launches == compiled.launches
    assert {name.endswith("_partials"): x.programmatic for name, x in back.launches.items()} == {True: False,
                                                                                                  False: True}


def test_cuda_tile_kernels_launch_plainly():
    """tileiras's kernels have no wait, so the runtime must not let them start early."""
    from tessera.backends.cuda_tile import tools
    if not tools.available():
        pytest.skip("tileiras not installed")
    compiled, _ = compile_decode("sm_90a", backend="cuda-tile")
    assert not any(launch.programmatic for launch in compiled.launches.values())
