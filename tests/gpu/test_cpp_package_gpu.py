"""The C/C++ side of an AOT package on a real GPU: `tessera package` writes the CMake project, it
builds against the installed CUDA driver, and each generated example runs its function through the
C API on the package's reference inputs and checks the outputs (exit 0), including the refusal of a
misaligned pointer. Two packages: one with a cubin for the device's own arch (plus sm_80), one with
sm_80 only (on a newer GPU the driver JIT-compiles its PTX)."""
import shutil
import subprocess
from pathlib import Path

import pytest

from tessera import cli
from tessera.runtime import ptxas

REPO = Path(__file__).resolve().parents[2]
from cpp_package_cases import FUNCS, KERNELS, ROWS, ROWS_FUNCS, cuda_root  # noqa: E402


@pytest.mark.skipif(shutil.which("cmake") is None or cuda_root() is None, reason="cmake or the CUDA toolkit missing")
@pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")
@pytest.mark.parametrize("own_arch", [True, False], ids=["own-arch-cubin", "sm_80-only"])
def test_the_generated_examples_build_run_and_match_the_reference(cuda_device, arch, tmp_path, own_arch):
    source = tmp_path / "kernels.py"
    source.write_text(KERNELS)
    pkg = tmp_path / "pkg"
    archs = ",".join(dict.fromkeys([arch, "sm_80"] if own_arch else ["sm_80"]))
    targets = [f"{source}:{f}" for f in FUNCS]
    assert cli.main(["package", *targets, "--arch", archs, "--shape", "N=128", "--shape", "N=64",
                     "-o", str(pkg)]) == 0
    flash = tmp_path / "flash"
    assert cli.main(["package", f"{REPO / 'examples' / 'flash_attention.py'}:flash_attention", "--arch", archs,
                     "--shape", "B=1,H=2,S=256,D=64", "-o", str(flash)]) == 0
    flash_generic = tmp_path / "flash_generic"   # S, not a leading dim: tensor maps of the run's S and strides
    assert cli.main(["package", f"{REPO / 'examples' / 'flash_attention.py'}:causal_flash_attention", "--arch", archs,
                     "--shape", "B=1,H=2,S=300,D=64", "--dynamic", "S", "-o", str(flash_generic)]) == 0
    (tmp_path / "rows.py").write_text(ROWS)
    rows = tmp_path / "rows"   # shape-generic: the example passes M (37) and sees M=1 refused
    assert cli.main(["package", *(f"{tmp_path / 'rows.py'}:{f}" for f in ROWS_FUNCS), "--arch", archs,
                     "--shape", "M=37,N=256,K=128", "--dynamic", "M", "-o", str(rows)]) == 0
    for directory in (pkg, flash, flash_generic, rows):
        build = directory / "build"
        for cmd in (["cmake", "-S", str(directory), "-B", str(build), f"-DCUDAToolkit_ROOT={cuda_root()}"],
                    ["cmake", "--build", str(build), "-j8"]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
        for example in sorted(build.glob("example_*")):
            if not example.is_file():
                continue
            ran = subprocess.run([str(example), str(directory)], capture_output=True, text=True, timeout=120)
            assert ran.returncode == 0, f"{example.name}:\n{ran.stdout}{ran.stderr}"
            assert "all outputs match the reference" in ran.stdout and "misaligned" in ran.stdout
