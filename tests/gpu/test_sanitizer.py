"""compute-sanitizer memcheck over a small attention and GEMMs: no out-of-bounds or misaligned access.

API-error reporting is off: cuda-bindings resolves driver entry points with cuGetProcAddress
and probes some the installed driver lacks, which memcheck would list. Tessera's own driver
calls check every result and raise, so a failing API call still fails this program.
"""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import math, torch, tessera as tsr
    from tessera import Tensor

    @tsr.function
    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        i = tsr.arange(q.shape[-2])
        s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)
        return tsr.matmul(tsr.softmax(s, dim=-1), v)

    @tsr.function
    def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"], bias: Tensor["N"]):
        return tsr.gelu(tsr.matmul(a, b) + bias)

    q, k, v = (torch.randn(1, 2, 77, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    attention(q, k, v)
    a, b, bias = (torch.randn(*s, device="cuda", dtype=torch.float16) for s in ((45, 70), (70, 33), (33,)))
    gemm(a, b, bias)   # mma.sync + cp.async (70-element rows are not 16-byte aligned)
    a, b, bias = (torch.randn(*s, device="cuda", dtype=torch.float16) for s in ((130, 264), (264, 200), (200,)))
    gemm(a, b, bias)   # on sm_90a: TMA + wgmma, partial tiles in M, N and K
    torch.cuda.synchronize()
    print("ran")
""")


def test_memcheck_attention_and_gemm(cuda_device):
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        pytest.skip("compute-sanitizer not installed")
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([tool, "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "3",
                             sys.executable, "-c", PROGRAM],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[:3000] + result.stderr[-2000:]
    assert "ran" in result.stdout and "ERROR SUMMARY: 0 errors" in result.stdout
