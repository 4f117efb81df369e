"""Programmatic dependent launch (Target IR's `tessera_target.programmatic_launch`): on sm_90+ every
kernel of a call but the first waits for the kernel before it in griddepcontrol.wait, after its
setup and before any read or write of global memory, and its launch says so; the first kernel,
older targets and CUDA Tile IR kernels launch plainly and have no wait."""
import re
import shutil

import pytest

from tessera.ir import target as tgt
from tessera.runtime import artifact

from decode_attention import gqa_decode_attention

DIMS = dict(B=1, Hk=2, G=4, M=1, N=4096, D=64)
#: PTX that touches global memory (or a tensor map's), which must come after the wait
GLOBAL = re.compile(r"^\s*(@%p\d+ )?(ld\.global|st\.global|cp\.async|red\.|atom\.|cp\.reduce|prefetch\.global)")


def compile_decode(arch: str, **options):
    specs = gqa_decode_attention.arg_specs_for(DIMS, "bf16")
    return gqa_decode_attention.compile(specs, arch=arch, **options), specs


@pytest.mark.parametrize("path", ["native", "ampere"])
def test_hopper_kernels_wait_for_the_kernel_before_them_before_touching_memory(path):
    compiled, _ = compile_decode("sm_90a", path=path)
    first, combine = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)]
    assert first.sym_name.data.endswith("_partials")
    assert tgt.PROGRAMMATIC_LAUNCH not in first.attributes and tgt.PROGRAMMATIC_LAUNCH in combine.attributes
    assert "tessera_target.programmatic_launch" in compiled.ir("target")
    kernels = compiled.stage("ptx")
    assert "griddepcontrol" not in kernels[first.sym_name.data].ptx
    assert not compiled.launches[first.sym_name.data].programmatic
    for name in [combine.sym_name.data]:
        lines = kernels[name].ptx.splitlines()
        (wait,) = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
        first_access = min(i for i, line in enumerate(lines) if GLOBAL.match(line))
        assert wait < first_access, name
        assert "launch_dependents" not in kernels[name].ptx   # dependents launch as a kernel exits
        assert compiled.launches[name].programmatic


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
