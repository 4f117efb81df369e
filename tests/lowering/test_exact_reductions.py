"""Exact reductions (tests/exact_reduction_cases.py) on the CPU interpreter: int32 reductions past
2^24 through every template that reduces, argmax over values rounded by their dtype, and which
templates the cases take (so each path stays covered)."""
import numpy as np
import pytest

from exact_reduction_cases import CASES, IDS, PARAMS, check, function, specs


@pytest.mark.parametrize("case,dims,dtype", PARAMS, ids=IDS)
def test_reduction_is_exact(case, dims, dtype):
    rng = np.random.default_rng(sum(dims.values()))
    arrays = case.inputs(rng, dims, dtype)
    check(function(case)(*arrays), case.reference(*arrays))


@pytest.mark.parametrize("name,dims,kernel", [
    ("row", dict(M=5, N=1000), "row_reduction"), ("column", dict(M=1000, N=33), "column_reduction"),
    ("column_split", dict(M=1000, N=33), "column_reduction_0_partials"),
    ("rider", dict(M=1000, N=33), "row_reduction_0_combine"), ("chain", dict(M=300, N=1000, K=64), "flash_chain")])
def test_cases_take_their_template(name, dims, kernel):
    case = next(c for c in CASES if c.name == name)
    fn = function(case)
    arrays = case.inputs(np.random.default_rng(0), dims, case.dtypes[0])
    names = fn.compile(specs(fn, dims, arrays), arch="sm_90a").kernel_names
    assert any(kernel in n for n in names), names
