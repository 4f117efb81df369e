"""The differential fuzzer on the GPU: at least 2,000 random programs (tests/fuzz/programs.py) compiled to
PTX, run on CUDA tensors into NaN-poisoned outputs, and checked against their own float64 NumPy
evaluation, with 0 wrong results. A failure shrinks (hypothesis) to a minimal program, printed as DSL.

To fit a few minutes: the programs are drawn first (the same derandomized hypothesis run, collecting
only), compiled in parallel by a process pool so that their cubins land in the on-disk cubin cache,
then the hypothesis run checks each one, compiling in-process again from that cache (no ptxas) and
launching. TESSERA_FUZZ_GPU_EXAMPLES sets the number of examples hypothesis draws (default 3,700; some
repeat a program with other inputs), of which at least 2,000 must be distinct programs (source and shapes).
Needs hypothesis (the test extras; scripts/gpu_check.sh installs it from .whl/ where the machine lacks it).
"""
import collections
import concurrent.futures
import multiprocessing
import os
import time

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (pip install -e '.[test]', or .whl/)")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from fuzz import programs as P  # noqa: E402

EXAMPLES = int(os.environ.get("TESSERA_FUZZ_GPU_EXAMPLES", "3700"))
#: distinct programs (source and shapes) the run must check
MIN_PROGRAMS = 2000 if EXAMPLES >= 3700 else EXAMPLES // 2
#: compiled programs kept loaded (a repeated program is not compiled again)
KEEP_COMPILED = 512
#: code paths, drawn per program: the native one (TMA + wgmma on Hopper) more often than mma.sync + cp.async
PATHS = ("native", "native", "ampere")
_TORCH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class _Run:
    """What the hypothesis body does: "collect" programs, or "check" them on the GPU."""

    mode = "collect"
    collected: list = []
    checked: set = set()
    target: dict = {}
    compiled: collections.OrderedDict = collections.OrderedDict()
    torch = None


def _to_torch(a: np.ndarray, torch):
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _to_numpy(x, torch) -> np.ndarray:
    if x.dtype == torch.bfloat16:
        return x.cpu().view(torch.int16).numpy().view(P.NP_DTYPES["bf16"])
    return x.cpu().numpy()


def _compiled(program, path: str):
    key = (P.source(program), program.sizes, path)
    if key in _Run.compiled:
        _Run.compiled.move_to_end(key)
    else:
        while len(_Run.compiled) >= KEEP_COMPILED:   # loaded modules go with their programs
            _Run.compiled.popitem(last=False)
        _Run.compiled[key] = P.compile_for_gpu(program, _Run.target["arch"], _Run.target["sm_count"], path)
    return _Run.compiled[key]


def run_on_gpu(program, seed: int, path: str) -> None:
    torch = _Run.torch
    inputs = P.random_inputs(program, seed)
    try:
        if P.has_zero_size(program):   # the user's call: no kernel, results of the inputs' kind and device
            outs = P.function(program)(*[_to_torch(a, torch) for a in inputs], path=path)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            assert all(o.is_cuda for o in outs), "a zero-size call's results left the GPU"
        else:
            gpu = _compiled(program, path).gpu_program(0)
            outs = [torch.full(b.shape, float("nan"), device="cuda", dtype=getattr(torch, _TORCH[b.dtype.name]))
                    for b in gpu.outputs]
            gpu(*[_to_torch(a, torch) for a in inputs], out=outs)
        torch.cuda.synchronize()
    except Exception as e:   # a compiler or launch error on a valid program is a bug too: show the program
        raise AssertionError(f"{type(e).__name__}: {e}\n\nminimal program ({path} path):\n"
                             f"{P.describe(program)}") from e
    P.check(program, inputs, [_to_numpy(o, torch) for o in outs], what=f"{path} path: ")


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=list(HealthCheck))
@given(program=P.programs("gpu"), seed=st.integers(0, 2**16), path=st.sampled_from(PATHS))
def _fuzz(program, seed, path):
    if _Run.mode == "collect":
        _Run.collected.append((program, path))
        return
    _Run.checked.add((P.source(program), program.sizes))
    run_on_gpu(program, seed, path)


def _precompile(jobs: list) -> None:
    """Each distinct compile, in a pool of processes (spawned: the parent holds a CUDA context)."""
    workers = max(1, min(32, (os.cpu_count() or 2) - 1))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(P.precompile, jobs, chunksize=8))


def test_fuzz_gpu(torch_cuda, cuda_device, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", os.environ.get("TESSERA_FUZZ_CACHE_DIR")
                       or str(tmp_path_factory.mktemp("fuzz-cubins")))
    platform = cuda_device.platform()
    _Run.torch, _Run.target = torch_cuda, {"arch": platform.arch, "sm_count": platform.sm_count}
    _Run.mode, _Run.collected, _Run.checked, _Run.compiled = "collect", [], set(), collections.OrderedDict()
    start = time.perf_counter()
    _fuzz()
    jobs = list({(P.source(p), p.sizes, path): (p, platform.arch, platform.sm_count, path)
                 for p, path in _Run.collected if not P.has_zero_size(p)}.values())
    _precompile(jobs)
    compiled = time.perf_counter()
    _Run.mode = "check"
    try:
        _fuzz()
    finally:
        _Run.mode = "collect"
        _Run.compiled = collections.OrderedDict()
        print(f"\nGPU fuzzer: {len(_Run.collected)} examples, {len(_Run.checked)} distinct programs "
              f"({len(jobs)} compiles) on {platform.arch}: "
              f"{compiled - start:.0f} s drawing and compiling in parallel, "
              f"{time.perf_counter() - compiled:.0f} s checking")
    assert len(_Run.checked) >= MIN_PROGRAMS, f"only {len(_Run.checked)} distinct programs checked"
