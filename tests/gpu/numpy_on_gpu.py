"""Runs a Tessera function on the GPU with NumPy inputs (bf16 through ml_dtypes), so the GPU op
tests share their inputs, float64 references and checks with the CPU tests."""
import math

import numpy as np

_TORCH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32", "bool": "bool"}
#: what outputs hold before the launch, so an element no thread writes fails the check (bools can't tell)
_POISON = {"fp32": math.nan, "fp16": math.nan, "bf16": math.nan, "int32": -2**31 + 7, "bool": False}


def _arch():
    from tessera.runtime import driver
    return driver.Device(0).platform().arch


def to_torch(a: np.ndarray, torch):
    """A NumPy array as a CUDA tensor; bf16 (ml_dtypes) travels as its 16 bits."""
    if a.dtype.kind == "V" or a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def to_numpy(x, dt, torch) -> np.ndarray:
    """A CUDA tensor back in Tessera's NumPy storage type for `dt`."""
    if dt.name == "bf16":
        return x.cpu().view(torch.int16).numpy().view(dt.np)
    return x.cpu().numpy()


def run_on_gpu(fn, dims: dict, arrays: list, torch, path: str = "native", specs=None) -> list[np.ndarray]:
    """`fn` compiled for this GPU on `path` ("native" or "ampere") for `specs` (by default those of
    its annotations at `dims`), run on `arrays` into poisoned outputs; returns the outputs as NumPy
    arrays."""
    compiled = fn.compile(specs or fn.arg_specs_for(dims), arch=_arch(), path=path)
    program = compiled.gpu_program(0)
    outs = [torch.full(b.shape, _POISON[b.dtype.name], device="cuda", dtype=getattr(torch, _TORCH[b.dtype.name]))
            for b in program.outputs]
    program(*[to_torch(a, torch) for a in arrays], out=outs)
    torch.cuda.synchronize()
    return [to_numpy(o, b.dtype, torch) for o, b in zip(outs, program.outputs)]
