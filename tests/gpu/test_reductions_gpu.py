"""Column reductions (a sum, mean, max or min over a leading axis: the column_reduction template,
split or not) and row statistics with an epilogue over the rows they reduced (the row template's
merged broadcast), on the GPU into NaN-poisoned outputs, against float64; then the norm backwards
that use both, against torch autograd in float64 at awkward shapes."""
import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor

from tessera.bench.cases import layer_norm, rms_norm, softmax   # (eps 1e-5 and 1e-6)
from test_kernels import TOL, check, run
from exact_reduction_cases import IDS, PARAMS, function, specs
from exact_reduction_cases import check as check_exact
from numpy_on_gpu import run_on_gpu
import row_chain_cases


@tsr.function
def column_sum(x: Tensor["M", "N"]):
    return tsr.sum(x.to(tsr.fp32) * 2.0, 0)


@tsr.function
def middle_stats(x: Tensor["B", "M", "N"]):
    return tsr.mean(x, 1, keepdim=True), tsr.amax(x, 1), tsr.amin(x, 1)


@tsr.function
def centered(x: Tensor["M", "N"]):
    """A row statistic read broadcast over its rows: one kernel."""
    return x - tsr.mean(x, -1, keepdim=True)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("split_rows", [None, 1, 7])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 3), (1000, 33), (4097, 1000), (16384, 64), (3, 4097)])
def test_column_sum(torch_cuda, dtype, split_rows, m, n):
    torch = torch_cuda
    space = {"split_rows": [split_rows]} if split_rows else None
    (x,), (out,) = run(column_sum, dict(M=m, N=n), dtype, torch, space=space)
    check(out, 2.0 * x.double().sum(0), "fp32", torch)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("dims", [dict(B=1, M=1, N=1), dict(B=3, M=301, N=130), dict(B=2, M=4097, N=17)])
def test_mean_max_min_over_a_middle_axis(torch_cuda, dtype, dims):
    torch = torch_cuda
    (x,), (mean, hi, lo) = run(middle_stats, dims, dtype, torch)
    x64 = x.double()
    check(mean, x64.mean(1, keepdim=True), dtype, torch)
    assert torch.equal(hi, x.amax(1)) and torch.equal(lo, x.amin(1))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 1000), (1000, 33), (64, 8192), (3, 20000)])
def test_row_statistic_broadcast_over_its_rows(torch_cuda, dtype, m, n):
    torch = torch_cuda
    compiled = centered.compile(centered.arg_specs_for(dict(M=m, N=n), dtype), arch=_arch())
    assert compiled.kernel_names == ["centered_row_reduction_0"]
    (x,), (out,) = run(centered, dict(M=m, N=n), dtype, torch)
    x64 = x.double()
    ref = x64 - x64.mean(-1, keepdim=True)
    assert not torch.isnan(out.double()).any()
    # the result is rounded to the dtype: compare to its rounding of the float64 result
    assert (out.double() - ref).abs().max() <= TOL[dtype] * (1 + x64.abs().max())


def _arch():
    from tessera.runtime import driver
    return driver.Device(0).platform().arch


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("m,n", [(1, 64), (7, 1000), (1000, 33), (4097, 128), (3, 4097), (2048, 8192),
                                 (1, 8193), (1000, 20000), (4, 24577), (300, 32768), (3, 65536), (2, 70001)])
def test_norm_backward_matches_float64(torch_cuda, dtype, norm, m, n):
    """Rows of 8193-65536 are split across a cluster of 2-8 blocks (`schedule.row_split`), each
    carrying its share's weight gradients; 70001 takes separate column sums."""
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(m * n)
    dt = getattr(torch, dtype)
    x = torch.randn(m, n, device="cuda", generator=gen).to(dt)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(dt)
    params = [(1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dt)]
    if norm == "layer_norm":
        params.append((0.1 * torch.randn(n, device="cuda", generator=gen)).to(dt))
    fn = rms_norm if norm == "rms_norm" else layer_norm
    _, f_vjp = tsr.vjp(fn, x, *params)
    grads = f_vjp(dy)
    exact = [a.double().requires_grad_() for a in (x, *params)]
    if norm == "rms_norm":
        out = torch.nn.functional.rms_norm(exact[0], (n,), exact[1], 1e-6)
    else:
        out = torch.nn.functional.layer_norm(exact[0], (n,), exact[1], exact[2], 1e-5)
    want = torch.autograd.grad(out, exact, dy.double())
    for got, w in zip(grads, want):
        assert got.dtype == dt and got.shape == w.shape
        check(got, w, "bf16" if dtype == "bfloat16" else "fp16", torch)


#: space pins of test_long_rows: the defaults; rows split across a cluster of 4 blocks; blocks
#: walking the rows, the next one or two staged in shared memory (7 blocks, or as the SMs hold)
LONG_ROW_PINS = {"default": None, "cluster-4": {"cluster": [4], "block_n": [8192], "num_warps": [4]},
                 "walk-7-blocks": {"num_stages": [3], "programs": [7], "cluster": [1]},
                 "walk": {"num_stages": [2], "cluster": [1]}}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("op", ["softmax", "layer_norm", "rms_norm"])
@pytest.mark.parametrize("m,n", [(1, 8193), (5, 32768), (3, 40000), (7, 65537), (133, 16385), (300, 20000),
                                 (1000, 32768)])
@pytest.mark.parametrize("pins", list(LONG_ROW_PINS))
def test_long_rows(torch_cuda, dtype, op, m, n, pins):
    """Rows past one 8192-element chunk take 16 warps and 16384- or 32768-element chunks (a row of
    40000 or 65537 is still two or more), or, pinned, split across a cluster of 4 blocks (the
    softmax's max and sum combined across it), or walked by blocks that stage the next rows in
    shared memory (a layer_norm's default over rows of 16385-32768), against float64."""
    torch = torch_cuda
    dims = dict(M=m, N=n)
    space = LONG_ROW_PINS[pins]
    if op == "softmax":
        (x,), (out,) = run(softmax, dims, dtype, torch, space=space)
        ref = torch.softmax(x.double(), -1)
    elif op == "layer_norm":
        (x, w, b), (out,) = run(layer_norm, dims, dtype, torch, space=space)
        ref = torch.nn.functional.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    else:
        (x, w), (out,) = run(rms_norm, dims, dtype, torch, space=space)
        ref = torch.nn.functional.rms_norm(x.double(), (n,), w.double(), 1e-6)
    check(out, ref, dtype, torch)


@pytest.mark.parametrize("case,dims,dtype", PARAMS, ids=IDS)
def test_exact_reductions(torch_cuda, case, dims, dtype):
    """int32 reductions past 2^24 through every reducing template, and argmax over values their
    dtype rounds: exact, into poisoned outputs (tests/exact_reduction_cases.py)."""
    arrays = case.inputs(np.random.default_rng(sum(dims.values())), dims, dtype)
    fn = function(case)
    check_exact(run_on_gpu(fn, dims, arrays, torch_cuda, specs=specs(fn, dims, arrays)), case.reference(*arrays))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("m,n", [(1, 1), (7, 1000), (1000, 33), (3, 20000), (4097, 128)])
@pytest.mark.parametrize("fn", list(row_chain_cases.CASES), ids=lambda f: f.name)
def test_statistics_in_a_chain_share_a_kernel(torch_cuda, fn, dtype, m, n):
    """A variance's mean, a written-out softmax's max, computed first in the kernel of the
    reduction that reads them (`fusion.merge_row_chains`), into NaN-poisoned outputs."""
    torch = torch_cuda
    references, row_kernels = row_chain_cases.CASES[fn]
    (x,), outs = run(fn, dict(M=m, N=n), dtype, torch)
    names = fn.compile(fn.arg_specs_for(dict(M=m, N=n), dtype), arch=_arch()).kernel_names
    assert sum("row_reduction" in k and not k.endswith("combine") for k in names) == row_kernels, names
    for out, want in zip(outs, references(x.double().cpu().numpy())):
        want, got = torch.from_numpy(want).reshape(out.shape), out.double().cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN where the reference has none (or not where it has)"
        error = (got - want).nan_to_num().abs().max()
        assert error <= TOL[dtype] * (1 + want.nan_to_num().abs().max()), error
