"""The CUDA Tile IR backend on the GPU (issue 18): every kernel kind of tests/cuda_tile_cases.py
compiled through cuda_tile and tileiras and launched by Tessera's runtime, against the float64
oracle, outputs NaN-poisoned first. tileiras must be installed, or the cubins already in the cubin
cache (TESSERA_CACHE_DIR: tests/backends/cuda_tile/test_cuda_tile_compile.py fills it on a machine
that has tileiras); otherwise each case skips, saying so."""
import numpy as np
import pytest

import cuda_tile_cases as cases


def _compiled(case):
    return cases.assembled(case.fn.compile(case.specs(), backend="cuda-tile"))


def on_gpu(torch, x: np.ndarray, dtype):
    """`x` on the GPU in its own layout: its strides over the storage they reach (a strided case's
    NaN-filled gaps included)."""
    strides = [st // x.itemsize for st in x.strides]
    reach = 1 + sum((n - 1) * st for n, st in zip(x.shape, strides))
    storage = np.lib.stride_tricks.as_strided(x, (reach,), (x.itemsize,)).astype(np.float32)
    return torch.from_numpy(storage).to("cuda", dtype).as_strided(x.shape, strides)


@pytest.mark.parametrize("case_id", sorted(cases.CASES))
def test_cuda_tile_kernel_matches_float64(torch_cuda, case_id):
    torch = torch_cuda
    case = cases.CASES[case_id]
    compiled = _compiled(case)
    inputs = [cases.as_dtype(x, case.dtype) for x in case.inputs(seed=1)]
    program = compiled.gpu_program(0)
    dtype = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[case.dtype])
    tensors = [on_gpu(torch, x, dtype) for x in cases.laid_out(case, inputs)]
    outs = program(*tensors)
    want = compiled.reference(*inputs)
    for got, w in zip(outs, want):
        got = got.float().cpu().numpy()
        assert not np.isnan(got).any(), "an output element was not written (or is NaN)"
        assert cases.relative_error(got, w) < cases.tolerance(case.dtype)


def test_function_call_runs_cuda_tile_backend(torch_cuda):
    """`fn(..., backend="cuda-tile")` on CUDA tensors runs the cuda_tile kernels (and keeps them
    apart from the PTX backend's compile of the same call)."""
    torch = torch_cuda
    case = cases.CASES["gemm-fp16"]
    _compiled(case)
    a, b, bias = (torch.randn(s, device="cuda", dtype=torch.float16) for s in case.shapes.values())
    got = case.fn(a, b, bias, backend="cuda-tile")
    ptx = case.fn(a, b, bias)
    want = torch.nn.functional.gelu(a.float() @ b.float() + bias.float())
    assert (got.float() - want).norm() / want.norm() < 5e-3
    assert (ptx.float() - want).norm() / want.norm() < 5e-3
