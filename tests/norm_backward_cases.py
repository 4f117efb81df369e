"""The compiled vjps of rms_norm and layer_norm (their saved statistics among the inputs) for a
shape and an arch: tests/passes/test_fusion.py checks their kernels and runs them on the CPU
interpreter, tests/backends/test_ptx_emitter.py assembles them."""
import numpy as np

import tessera as tsr
from tessera import Tensor


@tsr.function
def rms_norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def compile(norm: str, m: int, n: int, arch: str = "sm_90a", dtype=tsr.bf16, space: dict | None = None):
    """(the compiled vjp of `norm` over [m, n] for `arch` (its schedules pinned by `space`), its
    argument specs)."""
    from tessera.autodiff.api import _vjp_function, saving
    from tessera.frontend.trace import ArgSpec
    fn = {"rms_norm": rms_norm, "layer_norm": layer_norm}[norm]
    fn = tsr.function(fn.fn, space=space) if space else fn
    names = ("w", "b")[:2 if norm == "layer_norm" else 1]
    tensors, constants = fn._split_args([np.empty((m, n), dtype.np), *(np.empty(n, dtype.np) for _ in names)])
    layout = saving(fn).layout(tensors, constants)   # (the statistics the forward saves: the backward's inputs)
    saved = [ArgSpec(f"saved{i}", (m, 1), tsr.float32, ("M", 1)) for i in range(len(layout.saved))]
    specs = [ArgSpec("x", (m, n), dtype, ("M", "N")), *(ArgSpec(p, (n,), dtype, ("N",)) for p in names),
             *saved, ArgSpec("d_out0", (m, n), dtype, ("M", "N"))]
    return _vjp_function(fn, (0,), len(saved), layout).compile(specs, arch=arch), specs
