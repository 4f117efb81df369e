"""The platform registry: what each GPU target can do, as tables.

Lowering never branches on an architecture name. It asks this module which
instruction implements a matrix multiply for a dtype (`mma_instruction`), how a
tile travels from global to shared memory (`copy_mechanism`), what the limits
are (`Platform.max_shared_per_block`, ...), and which PTX header to write
(`ptx_target`, `ptx_version`). Adding a target is adding rows here.

The counts (SMs/CUs, shared memory, registers) are the defaults of one common
part per architecture (H100 SXM for sm_90, B200 for sm_100, MI300X for gfx942,
...). At run time `from_device_properties` overrides them with what the driver
reports, so the defaults only matter when compiling ahead of time.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera import dtypes

KB = 1024

# The feature vocabulary. `Platform.has` rejects names outside it so that a typo
# is an error instead of a silent "not supported".
FEATURES: dict[str, str] = {
    "tensor_cores": "NVIDIA tensor cores (any generation)",
    "wmma": "NVIDIA: PTX wmma (sm_70+); AMD: RDNA3 v_wmma_* matrix instructions",
    "mma_sync": "PTX mma.sync warp-level MMA (m16n8k8 on sm_75, m16n8k16 on sm_80+)",
    "ldmatrix": "ldmatrix shared->register fragment loads (sm_75+)",
    "tanh_approx": "tanh.approx.f32, tanh in one special-function-unit op (sm_75+)",
    "async_copy": "cp.async global->shared copies with commit/wait groups (sm_80+)",
    "nan_minmax": "min.NaN / max.NaN, a float min and max that return NaN when an operand is NaN (sm_80+)",
    "bf16": "bf16 arithmetic and bf16 matrix instructions",
    "fp8": "fp8 matrix instructions (NVIDIA sm_89+ e4m3/e5m2; AMD gfx94x, FNUZ encodings)",
    "tma": "Tensor Memory Accelerator: cp.async.bulk.tensor with tensor maps (sm_90+)",
    "clusters": "thread-block clusters and distributed shared memory (sm_90+)",
    "stmatrix": "stmatrix register->shared fragment stores (sm_90+)",
    "vector_red": "red.global.add.v2.f32 / .v4.f32, atomic adds of several fp32 elements at once (sm_90+)",
    "programmatic_launch": "programmatic dependent launch: a kernel is launched while the one before it in "
                           "its stream finishes, and waits for that one's results in griddepcontrol.wait (sm_90+)",
    "wgmma": "warpgroup MMA wgmma.mma_async (sm_90a only: arch-specific, not in sm_100a)",
    "setmaxnreg": "per-warpgroup register reallocation (sm_90a, sm_100a)",
    "tcgen05": "5th-generation tensor core instructions tcgen05.* (sm_100a)",
    "tmem": "tensor memory, the tcgen05 accumulator storage (sm_100a)",
    "cta_pairs": "tcgen05 cta_group::2, an MMA spanning a pair of CTAs (sm_100a)",
    "matrix_cores": "AMD matrix cores (MFMA on CDNA gfx908+, WMMA on RDNA3)",
    "mfma": "AMD CDNA v_mfma_* matrix instructions",
    "wave32": "32-lane wavefronts",
    "wave64": "64-lane wavefronts",
    "lds": "AMD local data share (the shared memory of a workgroup)",
}

# NVIDIA feature sets, each generation adding to the previous one.
_SM70 = frozenset({"tensor_cores", "wmma"})
_SM75 = _SM70 | {"mma_sync", "ldmatrix", "tanh_approx"}
_SM80 = _SM75 | {"async_copy", "bf16", "nan_minmax"}
_SM89 = _SM80 | {"fp8"}
_SM90 = _SM89 | {"tma", "clusters", "stmatrix", "programmatic_launch", "vector_red"}
_SM90A = _SM90 | {"wgmma", "setmaxnreg"}
_SM100 = _SM90
_SM100A = _SM100 | {"tcgen05", "tmem", "cta_pairs", "setmaxnreg"}

# AMD feature sets.
_GCN5 = frozenset({"lds", "wave64"})
_CDNA = _GCN5 | {"matrix_cores", "mfma", "bf16"}
_CDNA3 = _CDNA | {"fp8"}
_RDNA2 = frozenset({"lds", "wave32", "wave64"})
_RDNA3 = _RDNA2 | {"matrix_cores", "wmma", "bf16"}


@dataclass(frozen=True)
class Platform:
    """One GPU target and its default limits.

    `version` is the CUDA compute capability, (9, 0) for sm_90a, or the gfx
    version, (9, 0, 10) for gfx90a. `sm_count` counts SMs (NVIDIA) or compute
    units (AMD). `max_shared_per_block` is the opt-in maximum a kernel can ask
    for; `max_shared_per_sm` the SM's whole shared memory / the CU's LDS;
    `max_threads_per_sm` and `max_blocks_per_sm` the SM's resident limits.
    `warp_size` is the wavefront a kernel runs with; `wave_sizes` all it could.
    """

    vendor: str
    arch: str
    version: tuple[int, ...]
    sm_count: int
    warp_size: int
    wave_sizes: tuple[int, ...]
    max_threads_per_block: int
    max_shared_per_block: int
    max_shared_per_sm: int
    regs_per_sm: int
    max_regs_per_thread: int
    features: frozenset[str]
    min_ptx_isa: tuple[int, int] | None = None  # the PTX ISA that introduced the arch
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32

    def has(self, feature: str) -> bool:
        """Whether this target supports `feature` (a name from FEATURES)."""
        if feature not in FEATURES:
            raise ValueError(f"unknown platform feature {feature!r}; known: {', '.join(sorted(FEATURES))}")
        return feature in self.features

    @property
    def arch_specific(self) -> bool:
        """True for the "a" targets (sm_90a, sm_100a): their cubins run only on that exact arch."""
        return self.vendor == "nvidia" and self.arch.endswith("a")


def _nvidia(arch, cc, sms, smem_block_kb, smem_sm_kb, features, min_ptx, threads_per_sm=2048, blocks_per_sm=32):
    return Platform(
        vendor="nvidia", arch=arch, version=cc, sm_count=sms, warp_size=32, wave_sizes=(32,),
        max_threads_per_block=1024, max_shared_per_block=smem_block_kb * KB,
        max_shared_per_sm=smem_sm_kb * KB, regs_per_sm=65536, max_regs_per_thread=255,
        features=features, min_ptx_isa=min_ptx, max_threads_per_sm=threads_per_sm, max_blocks_per_sm=blocks_per_sm,
    )


def _amd(arch, version, cus, wave_sizes, regs_per_cu, max_vgprs, features):
    return Platform(
        vendor="amd", arch=arch, version=version, sm_count=cus, warp_size=wave_sizes[0],
        wave_sizes=wave_sizes, max_threads_per_block=1024, max_shared_per_block=64 * KB,
        max_shared_per_sm=64 * KB, regs_per_sm=regs_per_cu, max_regs_per_thread=max_vgprs,
        features=features,
    )


# Defaults per arch: SMs of the reference part, shared memory (opt-in per block /
# per SM, KB), features, the PTX ISA version that introduced the arch, and where they
# differ from 2048 and 32, the threads and blocks an SM holds.
_PLATFORMS: tuple[Platform, ...] = (
    _nvidia("sm_70", (7, 0), 80, 96, 96, _SM70, (6, 0)),          # V100
    _nvidia("sm_75", (7, 5), 40, 64, 64, _SM75, (6, 3), 1024, 16),  # T4
    _nvidia("sm_80", (8, 0), 108, 163, 164, _SM80, (7, 0)),       # A100
    _nvidia("sm_86", (8, 6), 84, 99, 100, _SM80, (7, 1), 1536, 16),  # RTX 3090 Ti / A40
    _nvidia("sm_89", (8, 9), 128, 99, 100, _SM89, (7, 8), 1536, 24),  # RTX 4090
    _nvidia("sm_90", (9, 0), 132, 227, 228, _SM90, (7, 8)),       # H100 SXM
    _nvidia("sm_90a", (9, 0), 132, 227, 228, _SM90A, (8, 0)),     # H100 SXM
    _nvidia("sm_100", (10, 0), 148, 227, 228, _SM100, (8, 6)),    # B200
    _nvidia("sm_100a", (10, 0), 148, 227, 228, _SM100A, (8, 6)),  # B200
    # AMD: wave sizes (default first), registers per CU (32-bit, all SIMDs),
    # VGPRs per lane (CDNA: architectural + accumulation registers).
    _amd("gfx906", (9, 0, 6), 60, (64,), 65536, 256, _GCN5),       # MI50
    _amd("gfx908", (9, 0, 8), 120, (64,), 131072, 512, _CDNA),     # MI100
    _amd("gfx90a", (9, 0, 10), 110, (64,), 131072, 512, _CDNA),    # MI250X (one GCD)
    _amd("gfx940", (9, 4, 0), 228, (64,), 131072, 512, _CDNA3),    # MI300A
    _amd("gfx941", (9, 4, 1), 304, (64,), 131072, 512, _CDNA3),    # MI300X (early)
    _amd("gfx942", (9, 4, 2), 304, (64,), 131072, 512, _CDNA3),    # MI300X
    _amd("gfx1030", (10, 3, 0), 80, (32, 64), 65536, 256, _RDNA2),  # RX 6900 XT
    _amd("gfx1100", (11, 0, 0), 96, (32, 64), 98304, 256, _RDNA3),  # RX 7900 XTX
    _amd("gfx1101", (11, 0, 1), 60, (32, 64), 98304, 256, _RDNA3),  # RX 7800 XT
    _amd("gfx1102", (11, 0, 2), 32, (32, 64), 65536, 256, _RDNA3),  # RX 7600
)
_BY_ARCH: dict[str, Platform] = {p.arch: p for p in _PLATFORMS}


class UnknownArchError(ValueError):
    """An architecture name the registry has no row for."""


def get(arch: str) -> Platform:
    """The registry's Platform for `arch` ("sm_90a", "gfx942")."""
    try:
        return _BY_ARCH[arch]
    except KeyError:
        raise UnknownArchError(f"unknown GPU architecture {arch!r}; known: {', '.join(_BY_ARCH)}") from None


def all_platforms() -> tuple[Platform, ...]:
    """Every registered target, NVIDIA first, oldest first."""
    return _PLATFORMS


def _platform(p: Platform | str) -> Platform:
    return p if isinstance(p, Platform) else get(p)


# ---------------------------------------------------------------------------
# Matrix instructions
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MmaInstr:
    """One matrix instruction: `acc[m x n] += a[m x k] @ b[k x n]`.

    `family` is the name Target IR uses (`tensor_core "mma.sync"`); on AMD it is
    the full mnemonic. Families whose N is chosen per use (wgmma, tcgen05.mma)
    set `n_step`: N may be any multiple of it up to `n`.
    """

    family: str
    m: int
    n: int
    k: int
    operand: str  # MLIR element type of a and b
    acc: str = "f32"
    n_step: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.m, self.n, self.k)

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether `shape` (m, n, k) is one legal use of this instruction."""
        return len(shape) == 3 and self.fit(tuple(shape)) == tuple(shape)

    def fit(self, tile: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """The instruction shape that covers an M x N x K tile in whole steps (for
        variable-N families the largest legal N dividing the tile's), or None."""
        tile_m, tile_n, tile_k = tile
        if tile_m % self.m or tile_k % self.k:
            return None
        ns = range(self.n, 0, -self.n_step) if self.n_step else (self.n,)
        return next(((self.m, n, self.k) for n in ns if tile_n % n == 0), None)


_E4M3, _E5M2 = dtypes.fp8_e4m3.mlir, dtypes.fp8_e5m2.mlir

_WMMA = {"f16": (MmaInstr("wmma", 16, 16, 16, "f16"),)}
_MMA_M16N8K8 = {"f16": (MmaInstr("mma.sync", 16, 8, 8, "f16"),)}
_MMA_M16N8K16 = {t: (MmaInstr("mma.sync", 16, 8, 16, t),) for t in ("f16", "bf16")}
_MMA_FP8 = {t: (MmaInstr("mma.sync", 16, 8, 32, t),) for t in (_E4M3, _E5M2)}
_WGMMA = {t: (MmaInstr("wgmma", 64, 256, k, t, n_step=8),)
          for t, k in (("f16", 16), ("bf16", 16), (_E4M3, 32), (_E5M2, 32))}
# tcgen05.mma (cta_group::1): M = 128 with N a multiple of 16, or M = 64 with N a multiple of 8.
_TCGEN05 = {t: (MmaInstr("tcgen05.mma", 128, 256, k, t, n_step=16), MmaInstr("tcgen05.mma", 64, 256, k, t, n_step=8))
            for t, k in (("f16", 16), ("bf16", 16), (_E4M3, 32), (_E5M2, 32))}


def _prefer(*tables: dict[str, tuple[MmaInstr, ...]]) -> dict[str, tuple[MmaInstr, ...]]:
    """Merge instruction tables, earlier tables' instructions preferred per dtype."""
    merged: dict[str, tuple[MmaInstr, ...]] = {}
    for table in tables:
        for dtype, instrs in table.items():
            merged[dtype] = merged.get(dtype, ()) + instrs
    return merged


_AMPERE = _prefer(_MMA_M16N8K16, _WMMA)
_ADA = _prefer(_AMPERE, _MMA_FP8)

_CDNA1_MFMA = {"f16": (MmaInstr("v_mfma_f32_32x32x8f16", 32, 32, 8, "f16"),),
               "bf16": (MmaInstr("v_mfma_f32_32x32x4bf16", 32, 32, 4, "bf16"),)}
_CDNA2_MFMA = {"f16": (MmaInstr("v_mfma_f32_32x32x8f16", 32, 32, 8, "f16"),),
               "bf16": (MmaInstr("v_mfma_f32_32x32x8bf16_1k", 32, 32, 8, "bf16"),)}
# gfx94x renamed the MFMA mnemonics. Its fp8 MFMAs take the FNUZ encodings,
# which Tessera's fp8 dtypes (OCP E4M3FN / E5M2) are not, so no fp8 rows here.
_CDNA3_MFMA = {"f16": (MmaInstr("v_mfma_f32_32x32x8_f16", 32, 32, 8, "f16"),),
               "bf16": (MmaInstr("v_mfma_f32_32x32x8_bf16", 32, 32, 8, "bf16"),)}
_RDNA3_WMMA = {t: (MmaInstr(f"v_wmma_f32_16x16x16_{t}", 16, 16, 16, t),) for t in ("f16", "bf16")}

# Candidates per arch and operand element type, best first. fp32 and int32 have
# no rows: fp32 on tensor cores would mean TF32, a precision the user opts into,
# not one lowering substitutes silently.
_MMA_TABLE: dict[str, dict[str, tuple[MmaInstr, ...]]] = {
    "sm_70": _WMMA,
    "sm_75": _prefer(_MMA_M16N8K8, _WMMA),
    "sm_80": _AMPERE,
    "sm_86": _AMPERE,
    "sm_89": _ADA,
    "sm_90": _ADA,
    "sm_90a": _prefer(_WGMMA, _ADA),
    "sm_100": _ADA,
    "sm_100a": _prefer(_TCGEN05, _ADA),
    "gfx906": {},
    "gfx908": _CDNA1_MFMA,
    "gfx90a": _CDNA2_MFMA,
    "gfx940": _CDNA3_MFMA,
    "gfx941": _CDNA3_MFMA,
    "gfx942": _CDNA3_MFMA,
    "gfx1030": {},
    "gfx1100": _RDNA3_WMMA,
    "gfx1101": _RDNA3_WMMA,
    "gfx1102": _RDNA3_WMMA,
}


def mma_instructions(platform: Platform | str, dtype_name=None) -> tuple[MmaInstr, ...]:
    """The matrix instructions of `platform` for operands of `dtype_name` (a
    Tessera dtype, its name, or an MLIR element type name), best first; all of
    them when `dtype_name` is None."""
    p = _platform(platform)
    table = _MMA_TABLE[p.arch]
    instrs = (tuple(i for instrs in table.values() for i in instrs) if dtype_name is None
              else table.get(dtypes.lookup(dtype_name).mlir, ()))
    return tuple(i for i in instrs if _FAMILY_FEATURE.get(i.family) is None or p.has(_FAMILY_FEATURE[i.family]))


#: NVIDIA instruction families and the feature each needs (a platform with the feature masked skips them).
_FAMILY_FEATURE = {"wmma": "wmma", "mma.sync": "mma_sync", "wgmma": "wgmma", "tcgen05.mma": "tcgen05"}


def mma_instruction(platform: Platform | str, dtype_name,
                    tile: tuple[int, int, int] | None = None) -> MmaInstr | None:
    """The instruction lowering uses for a `tile.mma` on `dtype_name` operands:
    the best one, or with `tile` = (M, N, K) the best one that covers that tile
    (a 32-row tile on sm_90a gets mma.sync, wgmma needing 64 rows). None when
    the platform has no matrix unit for that dtype (or tile)."""
    candidates = mma_instructions(platform, dtype_name)
    return next((i for i in candidates if tile is None or i.fit(tile) is not None), None)


def mma_families(platform: Platform | str) -> frozenset[str]:
    """The instruction families `tensor_core` ops may name on `platform`."""
    return frozenset(i.family for i in mma_instructions(platform))


# ---------------------------------------------------------------------------
# Copies and PTX headers
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CopyMechanism:
    """A way to move a tile global->shared. `zero_fill_only`: the hardware fills
    out-of-bounds elements with zeros (TMA's OOB fill, cp.async's src-size), so a
    copy padded with anything else (-inf for a max) must go through registers."""

    name: str
    feature: str | None  # None: every target can do it
    zero_fill_only: bool


# Best first; every target can copy through registers with plain loads.
_COPY_MECHANISMS = (
    CopyMechanism("tma", "tma", True),
    CopyMechanism("cp.async", "async_copy", True),
    CopyMechanism("ld.global", None, False),
)


def shared_reserved_per_block(platform: Platform | str) -> int:
    """Shared memory the CUDA driver keeps for itself in each resident block (sm_80 on)."""
    p = _platform(platform)
    return 1024 if p.vendor == "nvidia" and p.version >= (8, 0) else 0


def blocks_per_sm_by_shared(platform: Platform | str, shared_bytes: int) -> int:
    """Blocks using `shared_bytes` each (static and dynamic) that one SM's shared memory holds."""
    p = _platform(platform)
    per_block = shared_bytes + shared_reserved_per_block(p)
    return p.max_blocks_per_sm if per_block == 0 else p.max_shared_per_sm // per_block


def occupancy(platform: Platform | str, threads: int, regs: int, shared_bytes: int) -> tuple[int, tuple[str, ...]]:
    """(blocks of a kernel resident on one SM, what limits them to that: some of "blocks",
    "threads", "registers", "shared memory"), by the CUDA rules: registers go to warps in units of 256 and each of the
    SM's four schedulers holds a quarter of them; each block's shared memory carries the driver's
    reservation. NVIDIA targets only (`regs` per thread, as ptxas reports them)."""
    p = _platform(platform)
    if p.vendor != "nvidia":
        raise ValueError(f"occupancy follows NVIDIA's rules; {p.arch} is an {p.vendor} target")
    warps = -(-threads // p.warp_size)
    regs_per_warp = -(-regs * p.warp_size // 256) * 256
    limits = {
        "blocks": p.max_blocks_per_sm,
        "threads": p.max_threads_per_sm // (warps * p.warp_size),
        "registers": (p.regs_per_sm // 4 // regs_per_warp * 4 if regs_per_warp else 10 ** 9) // warps,
        "shared memory": blocks_per_sm_by_shared(p, shared_bytes),
    }
    blocks = min(limits.values())
    return blocks, tuple(name for name, n in limits.items() if n == blocks)


#: the most blocks of a thread-block cluster every GPU with clusters launches (the portable size)
MAX_CLUSTER = 8

#: Thread-block clusters resident at once, by (SMs, blocks a cluster, blocks an SM), as
#: cuOccupancyMaxActiveClusters reported them on an H200 (132 SMs; a 256-thread kernel held to 1-4
#: blocks an SM by its shared memory; `python3 bench/cluster_occupancy.py`, bench/RESULTS.md session 37). A
#: cluster's blocks share a GPC, whose SMs do not divide evenly: clusters of 4 leave 12 of 132 SMs
#: idle at one block an SM (30 clusters), clusters of 2 none.
RESIDENT_CLUSTERS = {
    (132, 2, 1): 66, (132, 2, 2): 132, (132, 2, 3): 198, (132, 2, 4): 264,
    (132, 3, 1): 39, (132, 3, 2): 79, (132, 3, 3): 124, (132, 3, 4): 163,
    (132, 4, 1): 30, (132, 4, 2): 62, (132, 4, 3): 92, (132, 4, 4): 124,
    (132, 6, 1): 17, (132, 6, 2): 39, (132, 6, 3): 62, (132, 6, 4): 79,
    (132, 8, 1): 15, (132, 8, 2): 30, (132, 8, 3): 45, (132, 8, 4): 62,
}
#: ... elsewhere, the share of the blocks' room that clusters of more than 2 fill at least above
RESIDENT_CLUSTER_SHARE = 0.88


def resident_clusters(platform: Platform | str, cluster: int, blocks_per_sm: int) -> int:
    """How many clusters of `cluster` blocks the GPU runs at once, each SM holding `blocks_per_sm`
    of the kernel's blocks: measured where known (`RESIDENT_CLUSTERS`), else all of them for
    clusters of 1 or 2 and RESIDENT_CLUSTER_SHARE of them for larger ones. A persistent kernel
    launches no more, or the clusters left over run after the others, doubling its time."""
    p = _platform(platform)
    room = p.sm_count * blocks_per_sm // cluster
    known = RESIDENT_CLUSTERS.get((p.sm_count, cluster, blocks_per_sm))
    if known is not None:
        return known
    return max(1, room if cluster <= 2 else int(room * RESIDENT_CLUSTER_SHARE))


def copy_mechanisms(platform: Platform | str, padding: float = 0.0) -> tuple[str, ...]:
    """Every way `platform` can copy a tile padded with `padding`, best first."""
    p = _platform(platform)
    return tuple(m.name for m in _COPY_MECHANISMS
                 if (m.feature is None or p.has(m.feature)) and not (m.zero_fill_only and padding != 0.0))


def copy_mechanism(platform: Platform | str, padding: float = 0.0) -> str:
    """How `tile.copy_async` moves a tile global->shared: "tma", "cp.async" or "ld.global"."""
    return copy_mechanisms(platform, padding)[0]


# The PTX ISA version each feature's instructions need (checked with ptxas 13.0).
_FEATURE_PTX_ISA: dict[str, tuple[int, int]] = {
    "wmma": (6, 0), "mma_sync": (6, 5), "ldmatrix": (6, 5), "tanh_approx": (7, 0), "async_copy": (7, 0),
    "nan_minmax": (7, 0),
    "bf16": (7, 0), "clusters": (7, 8), "stmatrix": (7, 8), "programmatic_launch": (7, 8), "tma": (8, 0),
    "vector_red": (8, 1),
    "wgmma": (8, 0), "setmaxnreg": (8, 0), "fp8": (8, 4), "tcgen05": (8, 6),
    "tmem": (8, 6), "cta_pairs": (8, 6),
}


def _nvidia_platform(arch: Platform | str) -> Platform:
    p = _platform(arch)
    if p.vendor != "nvidia":
        raise ValueError(f"{p.arch} is an {p.vendor} target; PTX is NVIDIA-only")
    return p


def ptx_isa(arch: Platform | str) -> tuple[int, int]:
    """The PTX ISA version to emit for `arch`: the lowest one that both knows the
    arch and has every instruction its features use (fp8 mma.sync needs 8.4)."""
    p = _nvidia_platform(arch)
    return max([p.min_ptx_isa, *(_FEATURE_PTX_ISA[f] for f in p.features if f in _FEATURE_PTX_ISA)])


def ptx_version(arch: Platform | str) -> str:
    """The `.version` directive for `arch`: ".version 8.4" for sm_90a."""
    major, minor = ptx_isa(arch)
    return f".version {major}.{minor}"


def ptx_target(arch: Platform | str) -> str:
    """The `.target` directive for `arch`: ".target sm_90a"."""
    return f".target {_nvidia_platform(arch).arch}"


# ---------------------------------------------------------------------------
# Run-time device properties
# ---------------------------------------------------------------------------

def _arch_for_cc(cc_major: int, cc_minor: int) -> Platform:
    """The registry row for a CUDA device. The "a" variant comes first because
    Tessera emits arch-specific PTX; a CC without a row falls back to the newest
    generic arch of the same major version (cubins are compatible within one)."""
    exact = [f"sm_{cc_major}{cc_minor}a", f"sm_{cc_major}{cc_minor}"]
    older = sorted((p for p in _PLATFORMS if p.vendor == "nvidia" and not p.arch_specific
                    and p.version[0] == cc_major and p.version[1] <= cc_minor), key=lambda p: p.version)
    found = [_BY_ARCH[a] for a in exact if a in _BY_ARCH] + older[::-1]
    if not found:
        known = ", ".join(p.arch for p in _PLATFORMS if p.vendor == "nvidia")
        raise UnknownArchError(f"no registered target for compute capability {cc_major}.{cc_minor}; known: {known}")
    return found[0]


def from_device_properties(cc_major: int, cc_minor: int, sm_count: int, smem_optin: int, *,
                           smem_per_sm: int | None = None, regs_per_sm: int | None = None,
                           max_threads_per_block: int | None = None, max_threads_per_sm: int | None = None,
                           max_blocks_per_sm: int | None = None) -> Platform:
    """The Platform of the CUDA device at hand: the arch picked from its compute
    capability, the registry's counts replaced by what the driver reports
    (`smem_optin` is cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
    reported = {
        "sm_count": sm_count, "max_shared_per_block": smem_optin, "max_shared_per_sm": smem_per_sm,
        "regs_per_sm": regs_per_sm, "max_threads_per_block": max_threads_per_block,
        "max_threads_per_sm": max_threads_per_sm, "max_blocks_per_sm": max_blocks_per_sm,
    }
    return dataclasses.replace(_arch_for_cc(cc_major, cc_minor),
                               **{k: v for k, v in reported.items() if v is not None})


# ---------------------------------------------------------------------------
# Peak arithmetic rates (the roofline's ceiling in `tessera profile`)
# ---------------------------------------------------------------------------

#: Dense peak TFLOP/s of each NVIDIA arch's reference part (the one its registry row's SM count is
#: of), at boost clock: tensor-core rates with fp32 accumulation for fp16/bf16 (without the 2:4
#: sparsity datasheets also quote), and plain fp32 (CUDA cores). Sources:
_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # V100 SXM2 datasheet: 125 tensor (fp16), 15.7 fp32
    "sm_70": {"fp16": 125.0, "fp32": 15.7},
    # T4 datasheet: 65 fp16 tensor (mixed precision), 8.1 fp32
    "sm_75": {"fp16": 65.0, "fp32": 8.1},
    # A100 SXM datasheet: 312 fp16/bf16 tensor (624 sparse), 19.5 fp32
    "sm_80": {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
    # A40 datasheet (84 SMs, as the row): 149.7 fp16/bf16 tensor (299.4 sparse), 37.4 fp32
    "sm_86": {"fp16": 149.7, "bf16": 149.7, "fp32": 37.4},
    # Ada whitepaper appendix, RTX 4090: 165.2 fp16/bf16 tensor with fp32 accumulate, 82.6 fp32
    "sm_89": {"fp16": 165.2, "bf16": 165.2, "fp32": 82.6},
    # H100 SXM5 datasheet / Hopper whitepaper: 989.4 fp16/bf16 tensor (1,979 sparse), 66.9 fp32
    "sm_90": {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9},
    "sm_90a": {"fp16": 989.4, "bf16": 989.4, "fp32": 66.9},
    # HGX B200 datasheet, per GPU: 2,250 fp16/bf16 tensor (4,500 sparse), 80 fp32
    "sm_100": {"fp16": 2250.0, "bf16": 2250.0, "fp32": 80.0},
    "sm_100a": {"fp16": 2250.0, "bf16": 2250.0, "fp32": 80.0},
}


def peak_tflops(platform: Platform | str, dtype_name: str) -> float | None:
    """The dense peak TFLOP/s of `platform` for arithmetic on `dtype_name` ("fp16", "bf16": tensor
    cores; "fp32": CUDA cores), scaled from the reference part by SM count (a device with fewer SMs,
    an H100 PCIe, gets fewer; its lower clocks are not modelled). None where the registry has no rate."""
    p = _platform(platform)
    rate = _PEAK_TFLOPS.get(p.arch, {}).get(dtype_name)
    return None if rate is None else rate * p.sm_count / get(p.arch).sm_count


#: The Hopper-native kernel path: TMA copies feeding wgmma (a kernel takes both or neither).
HOPPER_NATIVE = frozenset({"tma", "wgmma"})

#: Hopper-and-later features the Ampere-class code path does without.
BEYOND_AMPERE = frozenset({"tma", "wgmma", "setmaxnreg", "clusters", "stmatrix", "tcgen05", "tmem", "cta_pairs"})


def without(platform: Platform | str, features) -> Platform:
    """`platform` with `features` masked: the lowering then selects instructions as if they were absent
    (e.g. the mma.sync + cp.async path on an sm_90a device)."""
    p = _platform(platform)
    return dataclasses.replace(p, features=p.features - frozenset(features))
