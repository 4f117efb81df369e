"""The stage list and `Compiled`: stages run on first request, once, verified; launch metadata."""
import hashlib

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.compiler import DUMP_STAGES, IR_STAGES, STAGE_NAMES, STAGES
from tessera.errors import TesseraError
from tessera.runtime import ptxas


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def compile_gemm(dtype: str = "fp16", **options):
    return gemm.compile(gemm.arg_specs_for(dict(M=256, K=128, N=256), dtype), **options)


def test_the_stage_list_is_the_compiler_in_order():
    assert [stage.name for stage in STAGES] == ["schedule", "tile", "target", "ptx", "cuda_tile", "cubin"]
    assert {stage.name: stage.reads for stage in STAGES}["cubin"] == ("ptx", "cuda_tile")
    assert STAGE_NAMES == ("graph", "schedule", "tile", "target", "ptx", "cuda_tile", "cubin")
    assert IR_STAGES == STAGE_NAMES[:4] and DUMP_STAGES == (*IR_STAGES, "ptx", "cuda_tile")


def test_each_backends_stages_hold_its_kernels_only():
    """A compile for the CUDA Tile IR backend has no Target IR kernel and no PTX; one for the PTX
    backend no cuda_tile module (and imports nothing of that backend); an unknown backend or stage
    is an error naming the known ones."""
    from tessera.ir import target

    compiled = compile_gemm(backend="cuda-tile")
    assert compiled.kernel_backends == {"gemm_gemm_0": ("cuda-tile", "the backend option")}
    assert compiled.stage("ptx") == {} and list(compiled.stage("cuda_tile")) == ["gemm_gemm_0"]
    assert not any(isinstance(op, target.KernelOp) for op in compiled.stage("target").ops)
    ptx = compile_gemm(backend="ptx")
    assert ptx.stage("cuda_tile") == {} and list(ptx.stage("ptx")) == ["gemm_gemm_0"]
    with pytest.raises(TesseraError, match="unknown stage 'sass'; stages are graph, schedule"):
        ptx.stage("sass")
    with pytest.raises(TesseraError, match="unknown backend 'triton'; backends are auto, ptx, cuda-tile"):
        compile_gemm(backend="triton")


def test_compile_runs_through_tile_and_later_stages_run_once_when_asked():
    compiled = compile_gemm()
    assert compiled.computed_stages == ("graph", "schedule", "tile")
    assert list(compiled.modules) == list(IR_STAGES)     # listing the modules builds none
    assert compiled.computed_stages == ("graph", "schedule", "tile")
    target = compiled.stage("target")
    assert compiled.stage("target") is target and compiled.modules["target"] is target
    assert compiled.computed_stages == ("graph", "schedule", "tile", "target")
    (kernel,) = compiled.stage("ptx").values()
    assert kernel.name == "gemm_gemm_0" and ".entry gemm_gemm_0" in kernel.ptx
    assert compiled.computed_stages == ("graph", "schedule", "tile", "target", "ptx")


def test_launches_come_from_the_target_config_and_the_ptx():
    compiled = compile_gemm()
    (launch,) = compiled.launches.values()
    kernel = compiled.stage("ptx")[launch.name]
    config = next(op.config for op in compiled.stage("target").ops if op.name == "tessera_target.kernel")
    assert launch.grid == config.grid_dims and launch.threads == config.threads == kernel.threads
    assert (launch.dynamic_shared, launch.tensor_maps, launch.arch) == (kernel.dynamic_shared, kernel.tensor_maps,
                                                                        "sm_90a")
    assert launch.param_types == ("u64",) * 3 + ("tmap",) * len(kernel.tensor_maps)


def test_only_the_cubin_stage_takes_another_arch():
    compiled = compile_gemm()
    with pytest.raises(tsr.TesseraError, match="only the cubin stage"):
        compiled.stage("ptx", arch="sm_80")
    with pytest.raises(tsr.TesseraError, match="unknown stage 'llvm'"):
        compiled.stage("llvm")


@pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")
def test_cubin_stage_assembles_through_the_cache(tmp_path, monkeypatch):
    """The first compile assembles into the cache with ptxas's report; a later compile of the
    same PTX takes the cached cubin (marked here to tell it apart) and the same report."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    first = compile_gemm().stage("cubin")["gemm_gemm_0"]
    assert first.arch == "sm_90a" and first.resources["gemm_gemm_0"].registers > 0
    (entry,) = tmp_path.glob("*.cubin")
    assert entry.read_bytes() == first.cubin and entry.with_suffix(".log").exists()
    entry.write_bytes(first.cubin + b"marked")     # still a complete ELF file, and its digest with it
    entry.with_suffix(".sha256").write_text(hashlib.sha256(first.cubin + b"marked").hexdigest())
    again = compile_gemm().stage("cubin")["gemm_gemm_0"]
    assert again.cubin == first.cubin + b"marked"
    assert again.resources == first.resources


def test_cubin_stage_is_kept_per_arch(monkeypatch):
    """A GPU of another arch asks for its own cubins; each arch's are assembled once."""
    from tessera.runtime import cache

    assembled = []

    def fake(self, ptx, arch, opt_level=3):
        assembled.append(arch)
        return ptxas.Assembled(b"", arch, opt_level, {}, "")
    monkeypatch.setattr(cache.CubinCache, "assembled", fake)
    compiled = compile_gemm(arch="sm_80")
    for arch in (None, "sm_86", "sm_86", "sm_80"):
        compiled.stage("cubin", arch=arch)
    assert assembled == ["sm_80", "sm_86"]
