"""Warm start (runtime/warm.py): a GPU call's compile, written as an artifact, serves the same call in
a fresh process without xDSL and without tracing. No GPU needed: each process runs under
`warm_fakes` (an sm_90a device, kernels loaded by recording their cubin, calls stopped right before
the driver launch), and ptxas assembles the real cubins."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.runtime import artifact, ptxas, warm

pytestmark = pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")

REPO = Path(__file__).resolve().parents[2]

PROGRAM = '''
import tessera as tsr
from tessera import Tensor

SCALE = 0.5


@tsr.function
def gemm_softmax(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.softmax(tsr.matmul(a, b) * SCALE, dim=-1)


@tsr.kernel
def add_into(a: Tensor["N"], b: Tensor["N"], c: Tensor["N"]):
    c[:] = a + b
'''

#: One call on a 256 x 128 x 256 GEMM (TMA tensor maps on sm_90a), then the process's report.
CALL = '''
import warm_fakes as fakes
fakes.install()
import prog
prog.gemm_softmax(fakes.CudaArray(256, 128), fakes.CudaArray(128, 256))
'''


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "prog.py").write_text(PROGRAM)
    return tmp_path


def run(workdir: Path, script: str) -> dict:
    """Runs `script` in a fresh Python with the fakes and the test's caches; returns its report."""
    env = {**os.environ, "TESSERA_CACHE_DIR": str(workdir / "cubin"),
           "TESSERA_FUNCTION_CACHE_DIR": str(workdir / "functions"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(workdir), str(REPO)])}
    env.pop("TESSERA_WARM_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script + "\nfakes.report()\n"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def entries(workdir: Path) -> list[Path]:
    return sorted((workdir / "functions").glob("*.tsra"))


def test_a_fresh_process_launches_the_stored_artifact_without_xdsl_or_a_trace(workdir):
    cold = run(workdir, CALL)
    assert cold["traces"] == ["gemm_softmax"] and cold["xdsl"]
    assert len(entries(workdir)) == 1
    warm_run = run(workdir, CALL)
    assert warm_run["traces"] == [] and not warm_run["xdsl"]
    # The same plan, launches (tensor maps included) and cubins the compile gave the cold process.
    assert warm_run["programs"] == cold["programs"]
    assert any(step[0]["tensor_maps"] for step in warm_run["programs"][0]["steps"])


def test_a_kernel_takes_the_warm_path_too(workdir):
    """A @kernel's artifact says which arguments it writes: the warm process passes them as out=."""
    call = CALL.replace("prog.gemm_softmax(fakes.CudaArray(256, 128), fakes.CudaArray(128, 256))",
                        "prog.add_into(*(fakes.CudaArray(1000) for _ in range(3)))")
    cold = run(workdir, call)
    warm_run = run(workdir, call)
    assert cold["traces"] == ["add_into"] and warm_run["traces"] == [] and not warm_run["xdsl"]
    assert warm_run["programs"] == cold["programs"] and warm_run["programs"][0]["arg_names"] == ["a", "b", "c"]


def test_a_changed_captured_value_or_source_misses(workdir):
    run(workdir, CALL)
    changed = run(workdir, CALL + "prog.SCALE = 0.25\n" + CALL.split("\n", 4)[4])
    assert changed["traces"] == ["gemm_softmax"]     # the first call warm, the second (SCALE 0.25) traced
    assert len(entries(workdir)) == 2
    (workdir / "prog.py").write_text(PROGRAM.replace("* SCALE", "* SCALE * 2.0"))
    edited = run(workdir, CALL)
    assert edited["traces"] == ["gemm_softmax"] and len(entries(workdir)) == 3


def test_an_edited_module_the_function_reads_misses(workdir):
    """`settings.SCALE` is read through a captured module, not keyed by value: editing the module's
    file must miss all the same."""
    (workdir / "settings.py").write_text("SCALE = 0.5\n")
    (workdir / "prog.py").write_text(PROGRAM.replace("SCALE = 0.5", "import settings").replace(
        "* SCALE", "* settings.SCALE"))
    assert run(workdir, CALL)["traces"] == ["gemm_softmax"]
    assert run(workdir, CALL)["traces"] == []
    (workdir / "settings.py").write_text("SCALE = 0.25\n")
    assert run(workdir, CALL)["traces"] == ["gemm_softmax"]


def test_another_shape_misses(workdir):
    run(workdir, CALL)
    other = run(workdir, CALL.replace("CudaArray(256, 128)", "CudaArray(128, 128)"))
    assert other["traces"] == ["gemm_softmax"]


@pytest.mark.parametrize("damage", ["flip a cubin byte", "truncate", "flip a header byte", "empty"])
def test_a_corrupt_entry_is_discarded_and_rebuilt(workdir, damage):
    cold = run(workdir, CALL)
    (entry,) = entries(workdir)
    data = bytearray(entry.read_bytes())
    if damage == "flip a cubin byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip a header byte":
        data[len(artifact.MAGIC) + 32 + 8 + 10] ^= 0x01
    else:
        data = b""
    entry.write_bytes(bytes(data))
    rebuilt = run(workdir, CALL)
    assert rebuilt["traces"] == ["gemm_softmax"] and rebuilt["programs"] == cold["programs"]
    again = run(workdir, CALL)
    assert again["traces"] == [] and not again["xdsl"]


def test_two_processes_writing_one_entry_at_once_both_succeed(workdir):
    """Both compile the same call and then rewrite its entry over and over, concurrently: neither
    fails, no temp file is left, and the entry reads back valid."""
    script = CALL + '''
from tessera.runtime import warm
(entry,) = warm.directory().glob("*.tsra")
key = entry.stem
artifact = warm.load(key)
for _ in range(40):
    warm.store(key, artifact)
    assert warm.load(key) is not None
'''
    env = {**os.environ, "TESSERA_CACHE_DIR": str(workdir / "cubin"),
           "TESSERA_FUNCTION_CACHE_DIR": str(workdir / "functions"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(workdir), str(REPO)])}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=workdir, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    (entry,) = entries(workdir)
    assert not list((workdir / "functions").glob("*.tmp"))
    assert run(workdir, CALL)["traces"] == []


def test_an_entry_of_another_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_FUNCTION_CACHE_DIR", str(tmp_path))
    record = {"function": "f", "arch": "sm_90a", "kernels": {}, "arguments": [], "results": [],
              "intermediates": [], "steps": [], "profiled": [], "reads_outputs": False}
    warm.store("a" * 64, artifact.Artifact(record, {}))
    assert warm.load("a" * 64) is not None
    os.replace(warm.path("a" * 64), warm.path("b" * 64))
    assert warm.load("b" * 64) is None and not warm.path("b" * 64).exists()


def test_captured_values_have_stable_forms_or_none():
    """Values and names are stable; a config object's identity is left out (its attributes are
    kept); an object known only by identity keeps the function off the disk cache."""
    import math

    from tessera.frontend.captures import freeze

    class Config:
        def __init__(self, scale):
            self.scale = scale

    def helper(x):
        return x + 1

    a, b = warm.stable(freeze(Config(0.5), "c")), warm.stable(freeze(Config(0.5), "c"))
    assert a == b != warm.stable(freeze(Config(0.25), "c"))
    assert warm.stable(freeze(math, "m"))[:2] == ["module", "math"]
    assert warm.stable(freeze(helper, "h"))[3] == warm.code_digest(helper.__code__)
    assert warm.stable(freeze((1, 2.5, "x", None), "t")) != warm.stable(freeze((1, 2.5, "y", None), "t"))
    with pytest.raises(warm.NotStable):
        warm.stable(freeze([object()], "o"))


def test_code_digest_follows_the_code():
    def f(x):
        return x * 2

    def g(x):
        return x * 3

    assert warm.code_digest(f.__code__) != warm.code_digest(g.__code__)
    assert warm.code_digest(f.__code__) == warm.code_digest(f.__code__)


def test_only_plain_functions_and_kernels_are_keyed():
    """A derivative shares its forward's code and captures, but traces by `argnums` besides: it
    stays off the disk cache rather than share a key with another derivative of the same function."""
    import numpy as np

    import tessera as tsr
    from tessera import Tensor

    @tsr.function
    def loss(x: Tensor["N"], y: Tensor["N"]):
        return (x * y).sum()

    tensors = [("x", np.zeros(4, np.float32)), ("y", np.zeros(4, np.float32))]
    assert warm.function_key(loss, tensors, {}, {"arch": "sm_90a"}) is not None
    assert warm.function_key(tsr.grad(loss, argnums=0), tensors, {}, {"arch": "sm_90a"}) is None


def test_a_failed_write_costs_only_the_entry(tmp_path, monkeypatch, caplog):
    """Serializing or writing may fail (a full disk, a bug): the call's result stands, and it is logged."""
    monkeypatch.setenv("TESSERA_FUNCTION_CACHE_DIR", str(tmp_path))

    def broken():
        raise KeyError("a bug")

    warm.store_quietly("c" * 64, broken)
    (tmp_path / "blocked").write_text("")
    monkeypatch.setenv("TESSERA_FUNCTION_CACHE_DIR", str(tmp_path / "blocked"))   # a file, not a folder
    warm.store_quietly("d" * 64, lambda: artifact.Artifact({"function": "f"}, {}))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("could not write the warm-start entry" in m for m in messages)
    assert caplog.records[0].exc_info is not None


GENERIC = '''
import tessera as tsr
from tessera import Tensor


@tsr.function(dynamic=["M"])
def norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)
'''


def test_a_shape_generic_compile_serves_other_values_in_a_fresh_process(workdir):
    """The entry is keyed by the dynamic dim's class: a later process with another row count (in
    the same class) launches it without a trace; a dim of 1 is its own class."""
    (workdir / "gen.py").write_text(GENERIC)
    call = "import warm_fakes as fakes\nfakes.install()\nimport gen\ngen.norm(fakes.CudaArray({m}, 256), fakes.CudaArray(256))\n"
    cold = run(workdir, call.format(m=100))
    assert cold["traces"] == ["norm"] and len(entries(workdir)) == 1
    warm_run = run(workdir, call.format(m=127))   # (100 and 127: one class, `dims.CLASSES`)
    assert warm_run["traces"] == [] and not warm_run["xdsl"]
    assert run(workdir, call.format(m=1))["traces"] == ["norm"]
