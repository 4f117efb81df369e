"""Every PyTorch op case (tests/torch_op_cases.py) emits PTX that ptxas assembles on both code
paths: sm_80 (mma.sync, cp.async) and sm_90a (TMA, wgmma where the kernel takes them)."""
import shutil

import pytest

from tessera.backends.ptx import emit_module

from test_ptx_emitter import assemble
from torch_op_cases import DTYPE_CASES, IDS, SHAPES, function

needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not installed")


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("case,dt", DTYPE_CASES, ids=IDS)
def test_op_ptx_assembles(case, dt, arch, tmp_path):
    fn = function(case, dt)
    compiled = fn.compile(fn.arg_specs_for(SHAPES[2]), arch=arch)
    kernels = emit_module(compiled.modules["target"])
    assert set(kernels) == set(compiled.kernel_names)
    for kernel in kernels.values():
        assemble(kernel.ptx, arch, tmp_path)
