"""A GPU stand-in for warm-start and package tests (no GPU needed): `install()` makes the device an
sm_90a (or `arch`), loads "kernels" by recording their cubin's sha256, stops each call right before
its driver launch (recording the `GpuProgram` it would launch), and counts traces. `CudaArray` is a
CUDA array by its interface (shape, dtype, device) with no memory behind it."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import numpy as np

from tessera import platforms
from tessera.frontend import function as function_module
from tessera.runtime import driver, launcher

LOADED: dict[str, str] = {}          # kernel -> sha256 of the cubin it was loaded from
PROGRAMS: list = []                  # each GpuProgram a call would have launched
TRACES: list[str] = []               # each function traced


class FakeKernel:
    max_dynamic_shared = 48 * 1024

    def set_max_dynamic_shared(self, nbytes):
        self.max_dynamic_shared = nbytes


class FakeFunctions:
    def kernel(self, cubin, name, device):
        LOADED[name] = hashlib.sha256(cubin).hexdigest()
        return FakeKernel()


def _stop_before_launch(self, *inputs, out=None):
    PROGRAMS.append(self)
    return ["launched"]


_trace = function_module.trace


def _counting_trace(fn, name, *args, **kwargs):
    TRACES.append(name)
    return _trace(fn, name, *args, **kwargs)


def install(arch: str = "sm_90a", patch=setattr) -> None:
    """Puts the fakes in place, through `patch` (pytest's monkeypatch.setattr in a test's own process)."""
    patch(driver, "device_platform", lambda device: platforms.get(arch))
    patch(launcher, "functions", FakeFunctions())
    patch(launcher.GpuProgram, "__call__", _stop_before_launch)
    patch(function_module, "trace", _counting_trace)


class _Device:
    id = 0


class CudaArray:
    #: where the next array's (fake) device memory starts: arrays get disjoint, 16-byte aligned ranges
    next_address = 0x10000

    def __init__(self, *shape, dtype="float16"):
        self.shape, self.dtype, self.device = tuple(shape), np.dtype(dtype), _Device()
        self.address = CudaArray.next_address
        CudaArray.next_address += -(-int(np.prod(shape)) * self.dtype.itemsize // 256) * 256 + 256

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.address, False), "version": 3,
                "strides": None}


def describe(program) -> dict:
    """What the launcher would launch: the plan (buffers, and each step's KernelLaunch and
    buffers), the argument names and the cubin each kernel was loaded from."""
    plan = program.plan
    buffers = lambda bs: [[list(b.shape), b.dtype.name] for b in bs]   # noqa: E731
    return {"inputs": buffers(plan.inputs), "outputs": buffers(plan.outputs),
            "intermediates": buffers(plan.intermediates), "arg_names": list(program.arg_names),
            "steps": [[dataclasses.asdict(s.launch), list(s.buffers)] for s in plan.steps],
            "kernels": {name: LOADED[name] for name in program.kernels}}


def report(**extra) -> None:
    """Prints, as the last line of output, what this process did."""
    print(json.dumps({"xdsl": "xdsl" in sys.modules, "traces": TRACES,
                      "programs": [describe(p) for p in PROGRAMS], **extra}))
