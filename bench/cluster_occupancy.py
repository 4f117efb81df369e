"""How many thread-block clusters a GPU runs at once, by cluster size and blocks an SM: the
driver's cuOccupancyMaxActiveClusters for an empty 256-thread kernel whose dynamic shared memory
holds each SM to 1-4 blocks. `platforms.RESIDENT_CLUSTERS` keeps these counts (a row walk split
across clusters launches no more than run at once).

    python3 bench/cluster_occupancy.py
"""
from __future__ import annotations

from cuda.bindings import driver as d

PTX = b""".version 8.0
.target sm_90a
.address_size 64
.extern .shared .align 16 .b8 smem[];
.visible .entry k() .maxntid 256, 1, 1
{ ret; }
\0"""

#: (blocks an SM, dynamic shared memory a block that allows just that many)
PER_SM = ((1, 200 * 1024), (2, 100 * 1024), (3, 70 * 1024), (4, 50 * 1024))
SIZES = (1, 2, 3, 4, 6, 8)


def _check(result):
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver error {err}")
    return values[0] if len(values) == 1 else values


def main() -> int:
    _check(d.cuInit(0))
    device = _check(d.cuDeviceGet(0))
    _check(d.cuCtxSetCurrent(_check(d.cuDevicePrimaryCtxRetain(device))))
    sms = _check(d.cuDeviceGetAttribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device))
    name = _check(d.cuDeviceGetName(64, device)).split(b"\0")[0].decode()
    fn = _check(d.cuModuleGetFunction(_check(d.cuModuleLoadData(PTX)), b"k"))
    _check(d.cuFuncSetAttribute(fn, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 227 * 1024))
    print(f"# {name}, {sms} SMs: clusters resident at once (blocks they hold)")
    print("| blocks an SM | " + " | ".join(f"clusters of {size}" for size in SIZES) + " |")
    print("|---" * (len(SIZES) + 1) + "|")
    for per_sm, shared in PER_SM:
        row = []
        for size in SIZES:
            config = d.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = size * 1000, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = 256, 1, 1
            config.sharedMemBytes = shared
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = size, 1, 1
            config.attrs, config.numAttrs = [attr], 1
            clusters = _check(d.cuOccupancyMaxActiveClusters(fn, config))
            row.append(f"{clusters} ({clusters * size})")
        print(f"| {per_sm} | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
