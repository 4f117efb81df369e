"""The platform registry: features, limits, instruction selection, PTX headers."""
import dataclasses
import shutil
import subprocess

import pytest

from tessera import dtypes, platforms
from tessera.platforms import UnknownArchError

CUDA_ARCHS = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a"]
HIP_ARCHS = ["gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx1030", "gfx1100", "gfx1101", "gfx1102"]


def test_registry_lists_every_arch_once():
    archs = [p.arch for p in platforms.all_platforms()]
    assert archs == CUDA_ARCHS + HIP_ARCHS
    assert {p.vendor for p in platforms.all_platforms() if p.arch.startswith("sm_")} == {"nvidia"}
    assert {p.vendor for p in platforms.all_platforms() if p.arch.startswith("gfx")} == {"amd"}


def test_unknown_arch_names_the_known_ones():
    with pytest.raises(UnknownArchError, match="sm_91.*known: sm_70, sm_75.*gfx1102"):
        platforms.get("sm_91")


def test_unknown_feature_is_an_error_not_false():
    with pytest.raises(ValueError, match="unknown platform feature 'wgmmma'"):
        platforms.get("sm_90a").has("wgmmma")


@pytest.mark.parametrize("feature, archs", [
    ("tensor_cores", CUDA_ARCHS),
    ("wmma", CUDA_ARCHS + ["gfx1100", "gfx1101", "gfx1102"]),
    ("ldmatrix", CUDA_ARCHS[1:]),
    ("mma_sync", CUDA_ARCHS[1:]),
    ("async_copy", CUDA_ARCHS[2:]),
    ("bf16", CUDA_ARCHS[2:] + ["gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx1100", "gfx1101", "gfx1102"]),
    ("fp8", ["sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "gfx940", "gfx941", "gfx942"]),
    ("tma", ["sm_90", "sm_90a", "sm_100", "sm_100a"]),
    ("clusters", ["sm_90", "sm_90a", "sm_100", "sm_100a"]),
    ("stmatrix", ["sm_90", "sm_90a", "sm_100", "sm_100a"]),
    ("wgmma", ["sm_90a"]),
    ("setmaxnreg", ["sm_90a", "sm_100a"]),
    ("tcgen05", ["sm_100a"]),
    ("tmem", ["sm_100a"]),
    ("cta_pairs", ["sm_100a"]),
    ("mfma", ["gfx908", "gfx90a", "gfx940", "gfx941", "gfx942"]),
    ("matrix_cores", ["gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx1100", "gfx1101", "gfx1102"]),
    ("wave64", HIP_ARCHS),
    ("wave32", ["gfx1030", "gfx1100", "gfx1101", "gfx1102"]),
    ("lds", HIP_ARCHS),
])
def test_feature_matrix(feature, archs):
    assert [p.arch for p in platforms.all_platforms() if p.has(feature)] == archs


@pytest.mark.parametrize("arch, sms, per_block_kb, per_sm_kb", [
    ("sm_70", 80, 96, 96), ("sm_75", 40, 64, 64), ("sm_80", 108, 163, 164), ("sm_86", 84, 99, 100),
    ("sm_89", 128, 99, 100), ("sm_90a", 132, 227, 228), ("sm_100a", 148, 227, 228),
    ("gfx90a", 110, 64, 64), ("gfx942", 304, 64, 64), ("gfx1100", 96, 64, 64),
])
def test_default_limits(arch, sms, per_block_kb, per_sm_kb):
    p = platforms.get(arch)
    assert (p.sm_count, p.max_shared_per_block, p.max_shared_per_sm) == (sms, per_block_kb * 1024, per_sm_kb * 1024)
    assert p.max_threads_per_block == 1024


def test_warp_sizes():
    assert {platforms.get(a).warp_size for a in CUDA_ARCHS} == {32}
    assert [platforms.get(a).warp_size for a in ("gfx906", "gfx90a", "gfx942")] == [64, 64, 64]
    assert platforms.get("gfx1100").warp_size == 32 and platforms.get("gfx1100").wave_sizes == (32, 64)
    assert (platforms.get("sm_80").regs_per_sm, platforms.get("sm_80").max_regs_per_thread) == (65536, 255)


@pytest.mark.parametrize("arch, dtype, family, shape", [
    ("sm_70", "fp16", "wmma", (16, 16, 16)),
    ("sm_75", "fp16", "mma.sync", (16, 8, 8)),
    ("sm_80", "fp16", "mma.sync", (16, 8, 16)),
    ("sm_80", "bf16", "mma.sync", (16, 8, 16)),
    ("sm_89", "fp8_e4m3", "mma.sync", (16, 8, 32)),
    ("sm_90", "bf16", "mma.sync", (16, 8, 16)),
    ("sm_90a", "fp16", "wgmma", (64, 256, 16)),
    ("sm_90a", "f8E5M2", "wgmma", (64, 256, 32)),
    ("sm_100", "fp16", "mma.sync", (16, 8, 16)),
    ("sm_100a", "bf16", "tcgen05.mma", (128, 256, 16)),
    ("gfx908", "fp16", "v_mfma_f32_32x32x8f16", (32, 32, 8)),
    ("gfx90a", "bf16", "v_mfma_f32_32x32x8bf16_1k", (32, 32, 8)),
    ("gfx942", "fp16", "v_mfma_f32_32x32x8_f16", (32, 32, 8)),
    ("gfx1100", "fp16", "v_wmma_f32_16x16x16_f16", (16, 16, 16)),
])
def test_mma_instruction(arch, dtype, family, shape):
    instr = platforms.mma_instruction(platforms.get(arch), dtype)
    assert (instr.family, instr.shape, instr.acc) == (family, shape, "f32")


@pytest.mark.parametrize("arch, dtype", [
    ("sm_70", "bf16"), ("sm_75", "bf16"), ("sm_80", "fp8_e4m3"), ("sm_80", "fp32"), ("sm_90a", "int32"),
    ("gfx906", "fp16"), ("gfx1030", "fp16"), ("gfx942", "fp8_e4m3"),
])
def test_no_mma_instruction(arch, dtype):
    assert platforms.mma_instruction(arch, dtype) is None


def test_mma_instruction_fits_the_tile():
    # wgmma needs 64 rows; a 32-row tile falls back to mma.sync.
    assert platforms.mma_instruction("sm_90a", dtypes.fp16, (32, 64, 32)).family == "mma.sync"
    wgmma = platforms.mma_instruction("sm_90a", dtypes.fp16, (128, 96, 64))
    assert wgmma.family == "wgmma" and wgmma.fit((128, 96, 64)) == (64, 96, 16)
    assert platforms.mma_instruction("sm_100a", "fp16", (64, 64, 32)).fit((64, 64, 32)) == (64, 64, 16)
    assert platforms.mma_instruction("sm_80", "fp16", (64, 64, 24)) is None


def test_mma_families():
    assert platforms.mma_families("sm_80") == {"mma.sync", "wmma"}
    assert platforms.mma_families("sm_90a") == {"wgmma", "mma.sync", "wmma"}
    assert "wgmma" not in platforms.mma_families("sm_100a")
    assert platforms.mma_families("gfx906") == frozenset()


@pytest.mark.parametrize("arch, mechanism", [
    ("sm_75", "ld.global"), ("sm_80", "cp.async"), ("sm_89", "cp.async"), ("sm_90", "tma"),
    ("sm_90a", "tma"), ("sm_100a", "tma"), ("gfx90a", "ld.global"),
])
def test_copy_mechanism(arch, mechanism):
    assert platforms.copy_mechanism(arch) == mechanism


def test_nonzero_padding_copies_through_registers():
    assert platforms.copy_mechanism("sm_90a", padding=float("-inf")) == "ld.global"
    assert platforms.copy_mechanisms("sm_90a") == ("tma", "cp.async", "ld.global")


# (sm_75: 7.0, the version tanh.approx.f32 needs, its `tanh_approx` feature)
@pytest.mark.parametrize("arch, version", [
    ("sm_70", ".version 6.0"), ("sm_75", ".version 7.0"), ("sm_80", ".version 7.0"), ("sm_86", ".version 7.1"),
    ("sm_89", ".version 8.4"), ("sm_90a", ".version 8.4"), ("sm_100a", ".version 8.6"),
])
def test_ptx_version(arch, version):
    assert platforms.ptx_version(arch) == version
    assert platforms.ptx_target(arch) == f".target {arch}"


def test_ptx_header_is_nvidia_only():
    with pytest.raises(ValueError, match="gfx90a is an amd target"):
        platforms.ptx_version("gfx90a")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not installed")
@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_ptx_header_assembles(arch, tmp_path):
    src = tmp_path / "empty.ptx"
    src.write_text(f"{platforms.ptx_version(arch)}\n{platforms.ptx_target(arch)}\n.address_size 64\n\n"
                   ".visible .entry empty()\n{\n\tret;\n}\n")
    run = subprocess.run(["ptxas", f"-arch={arch}", str(src), "-o", str(tmp_path / "empty.cubin")],
                         capture_output=True, text=True)
    if "is not defined for option 'gpu-name'" in run.stderr:
        pytest.skip(f"this ptxas no longer targets {arch}")
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("cc, arch", [
    ((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80"), ((8, 9), "sm_89"),
    ((8, 7), "sm_86"), ((10, 3), "sm_100"),
])
def test_from_device_properties_picks_the_arch(cc, arch):
    assert platforms.from_device_properties(*cc, sm_count=10, smem_optin=1024).arch == arch


def test_from_device_properties_overrides_counts():
    p = platforms.from_device_properties(9, 0, sm_count=114, smem_optin=232448, regs_per_sm=65536)
    assert (p.arch, p.sm_count, p.max_shared_per_block, p.max_shared_per_sm) == ("sm_90a", 114, 232448, 233472)
    assert p.has("wgmma")
    assert platforms.get("sm_90a").sm_count == 132


def test_from_device_properties_unknown_cc():
    with pytest.raises(UnknownArchError, match="compute capability 12.0"):
        platforms.from_device_properties(12, 0, sm_count=170, smem_optin=101376)


@pytest.mark.parametrize("arch,threads,regs,shared,expected", [
    # the mma.sync GEMM's default on an H100: ncu reports 3 blocks, by registers and by shared memory
    ("sm_90a", 128, 168, 64 * 1024, (3, ("registers", "shared memory"))),
    # the native persistent GEMM: one block per SM
    ("sm_90a", 256, 157, 192 * 1024 + 32 + 18 * 1024, (1, ("registers", "shared memory"))),
    ("sm_86", 256, 32, 0, (6, ("threads",))),          # 1536 threads per SM on sm_86
    ("sm_90a", 32, 16, 0, (32, ("blocks",))),
    ("sm_90a", 128, 255, 0, (2, ("registers",))),       # 8 K registers a warp: two a scheduler
])
def test_occupancy(arch, threads, regs, shared, expected):
    assert platforms.occupancy(arch, threads, regs, shared) == expected


def test_each_block_carries_the_drivers_shared_memory_reservation():
    assert platforms.blocks_per_sm_by_shared("sm_90a", 113 * 1024) == 2
    assert platforms.blocks_per_sm_by_shared("sm_90a", 113 * 1024 + 512) == 1    # 2 x (113.5 + 1) > 228 KB
    assert platforms.blocks_per_sm_by_shared("sm_75", 32 * 1024) == 2             # no reservation before sm_80
    with pytest.raises(ValueError, match="NVIDIA's rules"):
        platforms.occupancy("gfx90a", 256, 64, 0)


def test_resident_clusters_are_those_measured_else_a_share_of_the_room():
    """Clusters of 4 on a 132-SM Hopper at one block an SM: 30, as cuOccupancyMaxActiveClusters
    reported on an H200 (a cluster's blocks share a GPC); clusters of 2 fill every SM."""
    assert platforms.resident_clusters("sm_90a", 4, 1) == 30
    assert platforms.resident_clusters("sm_90a", 2, 1) == 66
    other = dataclasses.replace(platforms.get("sm_90a"), sm_count=114)   # (an H100 PCIe: not measured)
    assert platforms.resident_clusters(other, 2, 1) == 57
    assert platforms.resident_clusters(other, 4, 2) == int(57 * platforms.RESIDENT_CLUSTER_SHARE)
