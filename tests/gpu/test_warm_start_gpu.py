"""Warm start and AOT packages on the GPU: fresh processes run an attention and a @kernel that reads
the output it writes, first compiled, then from the warm-start cache (no xDSL, no trace), and from a
`tessera package` through `tessera.load`; every result is checked against torch."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROGRAM = '''
import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.kernel
def accumulate(a: Tensor["N", "N"], c: Tensor["N", "N"]):
    c[:] = tsr.matmul(c, a)
'''

#: Runs both functions (or the package's) on seeded inputs; prints the errors against torch,
#: whether xDSL was imported and which functions were traced.
SCRIPT = '''
import json, sys
import torch
import tessera as tsr
from tessera.frontend import function as function_module

traced = []
trace = function_module.trace
function_module.trace = lambda fn, name, *a, **k: traced.append(name) or trace(fn, name, *a, **k)
if len(sys.argv) > 1:
    prog = tsr.load(sys.argv[1])
else:
    import prog
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
out = prog.attention(q, k, v)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
a, c = (torch.randn(256, 256, device="cuda", dtype=torch.float16) / 16 for _ in range(2))
expected = c.float() @ a.float()
prog.accumulate(a, c)
torch.cuda.synchronize()
err = lambda x, r: float((x.float() - r).norm() / r.norm())
print(json.dumps({"attention": err(out, ref), "accumulate": err(c, expected), "xdsl": "xdsl" in sys.modules,
                  "traced": traced}))
'''


def run(tmp_path: Path, *argv: str) -> dict:
    env = {**os.environ, "TESSERA_CACHE_DIR": str(tmp_path / "cubin"),
           "TESSERA_FUNCTION_CACHE_DIR": str(tmp_path / "functions"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TESSERA_WARM_CACHE", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["attention"] < 1e-2 and result["accumulate"] < 1e-2, result
    return result


def test_a_fresh_process_runs_the_warm_start_cache(torch_cuda, tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    cold = run(tmp_path)
    assert cold["traced"] == ["attention", "accumulate"] and cold["xdsl"]
    warm = run(tmp_path)
    assert warm["traced"] == [] and not warm["xdsl"]


def test_a_package_runs_through_tessera_load(torch_cuda, arch, tmp_path):
    from tessera import cli

    (tmp_path / "prog.py").write_text(PROGRAM)
    out = tmp_path / "pkg"
    assert cli.main(["package", f"{tmp_path / 'prog.py'}:attention", f"{tmp_path / 'prog.py'}:accumulate",
                     "--arch", ",".join(dict.fromkeys(["sm_80", arch])), "--shape", "B=2,H=4,S=256,D=64,N=256", "-o", str(out)]) == 0
    loaded = run(tmp_path, str(out))
    assert loaded["traced"] == [] and not loaded["xdsl"]
