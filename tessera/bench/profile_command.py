"""`tessera profile FILE.py:FUNC --shape ...`: the profile regions (as `tessera run --profile`), then per
kernel its time, achieved TFLOP/s and GB/s, its fraction of the device's roofline, its occupancy and
what limits it, and Nsight Compute's metrics where `ncu` is installed; `--plot` draws the roofline.

The GPU supplies three measurements (kernel times, copy bandwidth, ptxas resources); `kernel_perfs`
turns them into the report, and is what the CPU tests drive with recorded numbers.
"""
from __future__ import annotations

import argparse
from typing import Mapping, Sequence

from .. import platforms
from . import ncu, roofline


def occupancies(compiled, platform, names: Sequence[str], resources: Mapping) -> tuple:
    """(kernel, blocks per SM, limits) of each named kernel whose ptxas resources are known."""
    found = []
    for name in names:
        r = resources.get(name)
        if r is None or platform.vendor != "nvidia":
            continue
        launch = compiled.launches[name]
        found.append((name, *platforms.occupancy(platform, launch.threads, r.registers,
                                                  launch.dynamic_shared + r.shared_bytes)))
    return tuple(found)


def kernel_perfs(compiled, works, times: Mapping[str, Sequence[float]] | None, roof: roofline.Roof | None,
                 platform, resources: Mapping) -> list[roofline.KernelPerf]:
    """The report's rows: each fusion group's work, time (None without timings), roof and occupancy."""
    names = list(compiled.launches)
    group_ms = roofline.group_times(works, times) if times is not None else {}
    return [roofline.KernelPerf(w, group_ms.get(w.name), roof,
                                occupancies(compiled, platform, roofline.launched_by(w.name, names), resources))
            for w in works]


def ptxas_resources(compiled, arch: str) -> dict:
    """Each kernel's registers and shared memory from ptxas, or nothing where ptxas is missing."""
    from ..runtime import ptxas
    if not ptxas.available():
        return {}
    cubins = compiled.stage("cubin", arch)
    return {name: c.resources.get(name) for name, c in cubins.items()}


def run_args(args: argparse.Namespace) -> list[str]:
    """`tessera run` arguments that rerun this profile's function (for ncu)."""
    return [args.target, "--shape", args.shape, "--dtype", args.dtype, "--path", args.path, "--seed", str(args.seed),
            "--device", "gpu"]


def cmd_profile(args: argparse.Namespace) -> int:
    from .. import cli
    if args.plot:
        roofline.pyplot()                # a missing matplotlib fails before anything runs
    status = cli.cmd_run(args)           # compile with profile regions, run, check, print the regions
    fn = cli.load_function(args.target)
    device = cli.pick_device(args.device)
    plain = argparse.Namespace(**{**vars(args), "profile": False})
    compiled, specs = cli.compile_function(fn, plain, device)   # the kernels as a plain call runs them
    on_gpu = device.name == "gpu"
    platform = _gpu_platform() if on_gpu else platforms.get(compiled.arch)
    times, roof = (_gpu_measure(compiled, specs, args.seed, platform) if on_gpu else (None, None))
    perfs = kernel_perfs(compiled, roofline.kernel_work(compiled), times, roof, platform,
                         ptxas_resources(compiled, platform.arch))
    print("kernels" + ("" if on_gpu else " (no GPU: work and occupancy only)"))
    print(roofline.render(perfs))
    if on_gpu and ncu.available() and not args.no_ncu:
        metrics, why = ncu.collect(list(compiled.launches), run_args(args))
        print(ncu.render(metrics) if metrics else f"  ncu: {why}")
    if args.plot:
        if roof is None:
            from ..errors import TesseraError
            raise TesseraError("--plot draws measured kernels: it needs a GPU run (--device gpu)")
        roofline.plot(perfs, roof, args.plot)
        print(f"wrote {args.plot}")
    return status


def _gpu_platform():
    from ..runtime import driver
    return driver.Device(0).platform()


def _gpu_measure(compiled, specs, seed: int, platform):
    """(kernel times in ms by name, the roof): the only part that runs on the GPU."""
    import numpy as np

    from .. import cli
    from . import timing
    rng = np.random.default_rng(seed)
    inputs = [cli._to_torch(cli.random_input(rng, s)) for s in specs]
    program = compiled.gpu_program(0)
    times = timing.kernel_times(lambda: program(*inputs), list(compiled.launches))
    return times, roofline.roof_for(platform, timing.copy_bandwidth())
