"""The C/C++ side of AOT packages (runtime/cpp_package.py): `tessera package` writes a C header and
C++ source per function, a CMake project and an example checked against CPU-interpreter reference
data. No GPU: the CMake project is configured and built here against the CUDA toolkit's headers,
and the examples link against a stub libcuda (the driver is not installed on a CPU machine)."""
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tessera import cli, dtypes
from tessera.runtime import ptxas

pytestmark = pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")

from cpp_package_cases import FUNCS, KERNELS, ROWS, ROWS_FUNCS, cuda_root


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpp")
    source = root / "kernels.py"
    source.write_text(KERNELS)
    out = root / "pkg"
    argv = ["package", *(f"{source}:{f}" for f in FUNCS), "--arch", "sm_80,sm_90a", "--shape", "N=128",
            "--shape", "N=64", "-o", str(out)]
    assert cli.main(argv) == 0
    return out


def manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def test_the_sources_exist_and_name_every_kernel_and_entry_point(pkg):
    m = manifest(pkg)
    assert (pkg / "CMakeLists.txt").is_file()
    cmake = (pkg / "CMakeLists.txt").read_text()
    assert "find_package(CUDAToolkit" in cmake and "CUDA::cuda_driver" in cmake
    for name, entry in m["functions"].items():
        header = (pkg / f"tessera_{name}.h").read_text()
        source = (pkg / f"tessera_{name}.cpp").read_text()
        assert (pkg / f"example_{name}.cpp").is_file() and f"example_{name}" in cmake
        for spec in entry["specializations"]:
            suffix = "_".join(f"{d}{v}" for d, v in spec["dims"].items())
            c_params = [a["name"] for a in spec["arguments"]]
            if entry["kind"] == "function":
                c_params += entry["results"]
            signature = (f"int tessera_{name}_{suffix}(" + ", ".join(f"CUdeviceptr {p}" for p in c_params)
                         + ", CUstream stream, char* error, size_t error_len);")
            assert signature in header
            for kernel, k in spec["kernels"].items():
                assert f'"{k["launch"]["name"]}"' in source
                # every image embedded, byte for byte
                for ref in k["images"].values():
                    assert f"// {ref['file']}" in source


def test_the_reference_data_is_the_cpu_interpreters(pkg):
    refs = json.loads((pkg / "reference" / "scaled.json").read_text())
    ref = refs["tessera_scaled_N64"]
    a, b = (np.frombuffer((pkg / ref["inputs"][n]["file"]).read_bytes(), np.float16).reshape(64, 64)
            for n in ("a", "b"))
    (out,) = ref["outputs"]
    got = np.frombuffer((pkg / out["file"]).read_bytes(), dtypes.lookup(out["dtype"]).np).reshape(out["shape"])
    want = (a.astype(np.float64) @ b.astype(np.float64)) * 0.5
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= out["tolerance"] and out["tolerance"] > 0
    kernel_refs = json.loads((pkg / "reference" / "accumulate.json").read_text())["tessera_accumulate_N128"]
    assert set(kernel_refs["inputs"]) == {"a", "c"} and [o["name"] for o in kernel_refs["outputs"]] == ["c"]


def build(pkg: Path, build_dir: Path, stub_dir: Path) -> subprocess.CompletedProcess:
    """Configures and builds the package's CMake project; the examples link against a stub
    libcuda.so holding every cu* symbol the objects use (each returning an error)."""
    stub_dir.mkdir()
    stub = stub_dir / "libcuda.so"
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # noqa: E731
    done = run("cmake", "-S", str(pkg), "-B", str(build_dir), f"-DCUDAToolkit_ROOT={cuda_root()}",
               f"-DCUDA_cuda_driver_LIBRARY={stub}")
    assert done.returncode == 0, done.stdout + done.stderr
    done = run("cmake", "--build", str(build_dir), "-j8", "--target", "tessera_package")
    assert done.returncode == 0, done.stdout + done.stderr
    objects = [str(p) for p in build_dir.rglob("*.o")]
    for example in pkg.glob("example_*.cpp"):   # the examples' own driver calls
        obj = stub_dir / f"{example.stem}.o"
        done = run("g++", "-std=c++17", "-c", str(example), "-I", str(pkg), "-I", str(cuda_root() / "include"),
                   "-o", str(obj))
        assert done.returncode == 0, done.stderr
        objects.append(str(obj))
    symbols = sorted({line.split()[-1] for line in run("nm", "-u", *objects).stdout.splitlines()
                      if line.split() and line.split()[-1].startswith("cu")})
    (stub_dir / "stub.cpp").write_text("".join(f'extern "C" int {s}() {{ return 999; }}\n' for s in symbols))
    done = run("g++", "-shared", "-fPIC", str(stub_dir / "stub.cpp"), "-o", str(stub))
    assert done.returncode == 0, done.stderr
    return run("cmake", "--build", str(build_dir), "-j8")


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
@pytest.mark.skipif(cuda_root() is None, reason="CUDA toolkit headers not installed")
def test_the_cmake_project_builds_and_the_examples_link(pkg, tmp_path):
    done = build(pkg, tmp_path / "build", tmp_path / "stub")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in FUNCS:
        assert (tmp_path / "build" / f"example_{name}").is_file()
    assert list((tmp_path / "build").glob("libtessera_package.*"))
    # with no driver (the stub fails cuInit) the example says so and fails
    ran = subprocess.run([str(tmp_path / "build" / "example_add_into"), str(pkg)], capture_output=True, text=True,
                         timeout=30, env={"LD_LIBRARY_PATH": str(tmp_path / "stub")})
    assert ran.returncode == 2 and "cuInit(0) failed" in ran.stderr


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
@pytest.mark.skipif(cuda_root() is None, reason="CUDA toolkit headers not installed")
def test_a_shape_generic_package_builds_with_its_dims_as_parameters(tmp_path):
    """`--dynamic M`: the entry point takes `int64_t M`, the tables size each buffer per unit of M
    and grow the grids with it; the example passes the reference run's M and checks M=1 is refused.
    A GEMM's tensor map of an [M, K] operand leaves M to the run (0 in its dims, innermost first)."""
    source = tmp_path / "rows.py"
    source.write_text(ROWS)
    out = tmp_path / "pkg"
    assert cli.main(["package", *(f"{source}:{f}" for f in ROWS_FUNCS), "--arch", "sm_90a",
                     "--shape", "M=37,N=256,K=128", "--dynamic", "M", "-o", str(out)]) == 0
    header = (out / "tessera_norm_gelu.h").read_text()
    assert "int64_t M, CUstream stream" in header and "x: fp16[M, 256]" in header
    source_text = (out / "tessera_norm_gelu.cpp").read_text()
    assert "_grid_terms[] = {" in source_text and "_dim_params[] = {" in source_text
    assert "(int64_t)37" in (out / "example_norm_gelu.cpp").read_text()
    assert "int64_t M, CUstream stream" in (out / "tessera_project.h").read_text()
    assert "CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, {128, 0}, {256}" in (out / "tessera_project.cpp").read_text()
    done = build(out, tmp_path / "build", tmp_path / "stub")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "build" / "example_norm_gelu").is_file() and (tmp_path / "build" / "example_project").is_file()
