"""AOT packages (runtime/package.py, `tessera package`, `tessera.load`): the layout and manifest, the
checksums, the loader's refusals, and a call's choice of specialization and image per device arch.
No GPU needed: calls run under `warm_fakes` (a fake device arch, kernels loaded by recording their
cubin, calls stopped right before the driver launch); ptxas assembles the real cubins."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tessera as tsr
from tessera import cli
from tessera.runtime import artifact, interop, ptxas

import warm_fakes as fakes
from cpp_package_cases import KERNELS

pytestmark = pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "flash_attention.py"
SHAPES = ["B=1,H=2,S=256,D=64", "B=2,H=2,S=128,D=64"]
ARCHS = ["sm_80", "sm_90a"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A package of examples/flash_attention.py's flash_attention for both shapes and both arches,
    written by the command line."""
    out = tmp_path_factory.mktemp("package")
    argv = ["package", f"{EXAMPLE}:flash_attention", "--arch", ",".join(ARCHS), "-o", str(out)]
    for shape in SHAPES:
        argv += ["--shape", shape]
    assert cli.main(argv) == 0
    return out


@pytest.fixture
def pkg(built, tmp_path):
    """A copy of the package a test may damage."""
    copy = tmp_path / "pkg"
    shutil.copytree(built, copy)
    return copy


def manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def test_the_package_holds_the_manifest_and_every_file_it_lists_with_its_checksum(built):
    m = manifest(built)
    assert m["format"] == artifact.FORMAT_VERSION and m["tessera"] == tsr.__version__
    cpp = {"CMakeLists.txt", "reference", "tessera_package_runtime.h", "tessera_package_runtime.cpp",
           "tessera_package_runtime_internal.h", "tessera_flash_attention.h", "tessera_flash_attention.cpp",
           "example_flash_attention.cpp"}   # the C/C++ side: tests/runtime/test_cpp_package.py
    assert {p.name for p in built.iterdir()} == {"manifest.json", *m["files"], *cpp}
    for name, ref in m["files"].items():
        data = (built / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == ref["sha256"] and len(data) == ref["size"]
    entry = m["functions"]["flash_attention"]
    assert entry["kind"] == "function" and len(entry["results"]) == 1
    assert [a["name"] for a in entry["arguments"]] == ["q", "k", "v"]
    assert all(a["dims"] == ["B", "H", "S", "D"] for a in entry["arguments"])
    specs = entry["specializations"]
    assert sorted((s["arch"], tuple(s["arguments"][0]["shape"])) for s in specs) == sorted(
        (arch, shape) for arch in ARCHS for shape in [(1, 2, 256, 64), (2, 2, 128, 64)])
    for s in specs:
        assert s["dims"] == dict(zip("BHSD", s["arguments"][0]["shape"]))
        assert all(a["dtype"] == "fp16" for a in s["arguments"])
        for kernel in s["kernels"].values():
            assert set(kernel["images"]) == {"ptx", s["arch"]}
            assert kernel["images"][s["arch"]]["file"].endswith(f".{s['arch']}.cubin")
            assert all(ref["file"] in m["files"] for ref in kernel["images"].values())


def test_the_manifest_launches_are_the_compiles(built):
    """Each specialization's kernels launch as the compile's `KernelLaunch` says, field for field."""
    fn = cli.load_function(f"{EXAMPLE}:flash_attention")
    compiled = fn.compile(fn.arg_specs_for(cli.parse_shape(SHAPES[0]), "fp16"), arch="sm_90a")
    (spec,) = [s for s in manifest(built)["functions"]["flash_attention"]["specializations"]
               if s["arch"] == "sm_90a" and s["arguments"][0]["shape"] == [1, 2, 256, 64]]
    assert {n: k["launch"] for n, k in spec["kernels"].items()} == json.loads(json.dumps(
        {n: dataclasses.asdict(launch) for n, launch in compiled.launches.items()}))
    assert artifact.Artifact(spec, {}).launches == compiled.launches


def test_load_imports_no_compiler(built):
    """tessera.load, and a call through to the launch, in a fresh process: no xDSL, and each kernel
    loaded from the package's cubin for the device's arch."""
    script = f"""
import sys, json
import warm_fakes as fakes
fakes.install()
import tessera
pkg = tessera.load({str(built)!r})
q = fakes.CudaArray(1, 2, 256, 64)
pkg.flash_attention(q, q, q)
fakes.report()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["xdsl"] and report["traces"] == []
    (program,) = report["programs"]
    (spec,) = [s for s in manifest(built)["functions"]["flash_attention"]["specializations"]
               if s["arch"] == "sm_90a" and s["arguments"][0]["shape"] == [1, 2, 256, 64]]
    cubins = {n: k["images"]["sm_90a"]["sha256"] for n, k in spec["kernels"].items()}
    assert program["kernels"] == cubins
    assert [step[0] for step in program["steps"]] == [k["launch"] for k in spec["kernels"].values()]


@pytest.mark.parametrize("device, used", [("sm_90a", "sm_90a"), ("sm_80", "sm_80"), ("sm_86", "sm_80"),
                                          ("sm_89", "sm_80")])
def test_a_call_runs_the_cubin_that_fits_the_device(built, monkeypatch, device, used):
    fakes.install(device, monkeypatch.setattr)
    fakes.LOADED.clear()
    pkg = tsr.load(built)
    q = fakes.CudaArray(2, 2, 128, 64)
    assert pkg.flash_attention(q, q, q) == "launched"
    (spec,) = [s for s in manifest(built)["functions"]["flash_attention"]["specializations"]
               if s["arch"] == used and s["arguments"][0]["shape"] == [2, 2, 128, 64]]
    assert fakes.LOADED == {n: k["images"][used]["sha256"] for n, k in spec["kernels"].items()}


def test_an_older_gpu_than_every_image_is_refused_on_the_first_call(built, monkeypatch):
    fakes.install("sm_75", monkeypatch.setattr)
    pkg = tsr.load(built)   # loading never asks the GPU
    q = fakes.CudaArray(2, 2, 128, 64)
    with pytest.raises(artifact.ArtifactError, match=r"no cubin or PTX for this GPU \(sm_75\); it was built "
                                                     r"for sm_80"):
        pkg.flash_attention(q, q, q)


def test_a_newer_gpu_gets_the_ptx_without_an_arch_suffix():
    """Past every cubin, the driver JIT-compiles PTX: sm_80's runs on a later GPU, sm_90a's only on sm_90."""
    record = {"arch": "sm_80", "kernels": {"k": {"images": {"ptx": {"file": "a.ptx"}, "sm_80": {"file": "a.cubin"}}}}}
    a = artifact.Artifact(record, {})
    assert a.image_for("k", "sm_100a") == ("ptx", "a.ptx")
    assert a.image_for("k", "sm_86") == ("cubin", "a.cubin")
    hopper = artifact.Artifact({**record, "arch": "sm_90a", "kernels": {"k": {"images": {
        "ptx": {"file": "h.ptx"}, "sm_90a": {"file": "h.cubin"}}}}}, {})
    assert hopper.image_for("k", "sm_90a") == ("cubin", "h.cubin")
    assert hopper.image_for("k", "sm_100a") is None and not hopper.runs_on("sm_100a")


def test_wrong_arguments_get_clear_errors(built, monkeypatch):
    fakes.install("sm_90a", monkeypatch.setattr)
    f = tsr.load(built)["flash_attention"]
    q = fakes.CudaArray(2, 2, 128, 64)
    with pytest.raises(tsr.DTypeError, match=r"no packaged specialization for \(q: fp32\[2, 2, 128, 64\].*"
                                             r"holds \(q: fp16\[1, 2, 256, 64\]"):
        f(fakes.CudaArray(2, 2, 128, 64, dtype="float32"), q, q)
    with pytest.raises(tsr.ShapeError, match=r"no packaged specialization for \(q: fp16\[2, 2, 64, 64\]"):
        small = fakes.CudaArray(2, 2, 64, 64)
        f(small, small, small)
    with pytest.raises(tsr.TesseraError, match=r"takes 3 tensors \(q, k, v\), got 2"):
        f(q, q)
    import numpy as np
    with pytest.raises(interop.DeviceError, match="argument 'q' must be a CUDA tensor"):
        f(np.zeros((2, 2, 128, 64), np.float16), q, q)


def test_a_corrupt_or_missing_file_is_refused_at_load(pkg):
    m = manifest(pkg)
    cubin = next(n for n in m["files"] if n.endswith(".cubin"))
    data = bytearray((pkg / cubin).read_bytes())
    data[100] ^= 0xFF
    (pkg / cubin).write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactError, match=f"checksum mismatch in {cubin}") as raised:
        tsr.load(pkg)
    assert str(raised.value).count("[at ") <= 1   # (the location once)
    (pkg / cubin).unlink()
    with pytest.raises(artifact.ArtifactError, match=f"missing file {cubin}"):
        tsr.load(pkg)


def test_a_manifest_of_another_format_or_none_is_refused(pkg, tmp_path):
    m = manifest(pkg)
    (pkg / "manifest.json").write_text(json.dumps({**m, "format": 99}))
    with pytest.raises(artifact.ArtifactError, match=f"package format 99, this Tessera reads {artifact.FORMAT_VERSION}"):
        tsr.load(pkg)
    (pkg / "manifest.json").write_text("{not json")
    with pytest.raises(artifact.ArtifactError, match="not valid JSON"):
        tsr.load(pkg)
    with pytest.raises(artifact.ArtifactError, match="not a Tessera package: no manifest.json"):
        tsr.load(tmp_path / "nothing")


@pytest.mark.parametrize("name", ["../escape.cubin", "..", "", ".", "a\x00b", "/etc/passwd"])
def test_a_manifest_naming_a_file_outside_the_package_is_refused(pkg, name):
    m = manifest(pkg)
    m["files"][name] = {"sha256": "0" * 64, "size": 1}
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(artifact.ArtifactError, match="names a file that is not a plain file of the package"):
        tsr.load(pkg)


def test_a_manifest_naming_a_directory_is_refused(pkg):
    m = manifest(pkg)
    (pkg / "sub").mkdir()
    m["files"]["sub"] = {"sha256": "0" * 64, "size": 1}
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(artifact.ArtifactError, match="'sub' is a directory") as raised:
        tsr.load(pkg)
    assert str(raised.value).count("[at ") <= 1


@pytest.mark.parametrize("damage", [
    lambda spec: spec["steps"][0].update(buffers=[99] * len(spec["steps"][0]["buffers"])),
    lambda spec: spec["steps"][0].update(buffers=spec["steps"][0]["buffers"][:-1]),
    lambda spec: next(iter(spec["kernels"].values()))["launch"].update(grid="1,1,1"),
    lambda spec: next(iter(spec["kernels"].values()))["launch"].update(threads=0),
])
def test_a_record_whose_launches_do_not_add_up_is_refused_at_load(pkg, damage):
    m = manifest(pkg)
    damage(m["functions"]["flash_attention"]["specializations"][0])
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(artifact.ArtifactError, match="malformed"):
        tsr.load(pkg)


def test_a_malformed_record_is_refused(pkg):
    m = manifest(pkg)
    del m["functions"]["flash_attention"]["specializations"][0]["steps"]
    (pkg / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(artifact.ArtifactError, match="malformed"):
        tsr.load(pkg)


def test_package_needs_a_known_nvidia_arch(tmp_path, capsys):
    assert cli.main(["package", f"{EXAMPLE}:flash_attention", "--arch", "gfx942", "--shape", SHAPES[0],
                     "-o", str(tmp_path)]) == 1
    assert "no backend for gfx942" in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists()


def test_a_packaged_kernel_writes_into_its_output_arguments(tmp_path, monkeypatch):
    """A @kernel's specialization says which arguments it writes and whether it reads one of them
    first (then it runs into fresh arrays copied over them); a call passes the outputs as out=."""
    source = tmp_path / "kernels.py"
    source.write_text(KERNELS)   # tests/cpp_package_cases.py
    out = tmp_path / "pkg"
    assert cli.main(["package", f"{source}:add_into", f"{source}:accumulate", "--arch", "sm_90a",
                     "--shape", "N=128", "-o", str(out)]) == 0
    functions = manifest(out)["functions"]
    assert {name: (f["kind"], f["results"], [s["reads_outputs"] for s in f["specializations"]])
            for name, f in functions.items()} == {"add_into": ("kernel", ["c"], [False]),
                                                   "accumulate": ("kernel", ["c"], [True])}
    fakes.install("sm_90a", monkeypatch.setattr)
    calls = []
    monkeypatch.setattr(fakes.launcher.GpuProgram, "__call__",
                        lambda self, *inputs, out=None: calls.append((len(inputs), out)) or ["launched"])
    a, b, c = (fakes.CudaArray(128, 128) for _ in range(3))
    assert tsr.load(out).add_into(a, b, c) is None
    assert calls == [(3, [c])]


ROWS_SOURCE = '''
import tessera as tsr
from tessera import Tensor


@tsr.function
def norm(x: Tensor["M", "N"], w: Tensor["N"]):
    return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)
'''


def test_a_dynamic_dim_packages_one_specialization_for_every_value(tmp_path, monkeypatch, capsys):
    """`--dynamic M`: one artifact whose records name M, which a call of any M of 2 or more loads
    once; its C entry point takes M after the buffers."""
    source = tmp_path / "rows.py"
    source.write_text(ROWS_SOURCE)
    out = tmp_path / "pkg"
    assert cli.main(["package", f"{source}:norm", "--arch", "sm_90a", "--shape", "M=8,N=256", "--shape", "M=9,N=256",
                     "--dynamic", "M", "-o", str(out)]) == 0   # (two values of M: one specialization)
    (spec,) = manifest(out)["functions"]["norm"]["specializations"]
    assert spec["arguments"][0]["shape"] == ["M", 256] and spec["dims"] == {"M": "dynamic", "N": 256}
    assert "int tessera_norm(CUdeviceptr x, CUdeviceptr w, CUdeviceptr out0, int64_t M, CUstream stream" in \
        (out / "tessera_norm.h").read_text()
    fakes.install("sm_90a", monkeypatch.setattr)
    fakes.LOADED.clear()
    norm = tsr.load(out).norm
    for m in (2, 300, 8):
        assert norm(fakes.CudaArray(m, 256), fakes.CudaArray(256)) == "launched"
    assert len(norm._loaded) == 1
    with pytest.raises(tsr.ShapeError, match="no packaged specialization"):
        norm(fakes.CudaArray(1, 256), fakes.CudaArray(256))
    with pytest.raises(tsr.ShapeError, match="no packaged specialization"):
        norm(fakes.CudaArray(4, 128), fakes.CudaArray(128))
    with pytest.raises(tsr.DTypeError, match="no packaged specialization"):   # (shapes M takes; fp32)
        norm(fakes.CudaArray(7, 256, dtype="float32"), fakes.CudaArray(256, dtype="float32"))


def test_a_dim_a_function_cannot_take_at_run_time_is_a_clear_package_error(tmp_path, capsys):
    source = tmp_path / "sums.py"
    source.write_text("import tessera as tsr\nfrom tessera import Tensor\n\n\n@tsr.function\n"
                      "def column_sum(x: Tensor[\"M\", \"N\"]):\n    return tsr.sum(x, dim=0)\n")
    assert cli.main(["package", f"{source}:column_sum", "--arch", "sm_90a", "--shape", "M=128,N=64",
                     "--dynamic", "N", "-o", str(tmp_path / "pkg")]) == 1   # (its kept columns size its tiles)
    assert "column_sum cannot take dim 'N' at run time" in capsys.readouterr().err
    assert not (tmp_path / "pkg" / "manifest.json").exists()


def test_an_attention_packages_its_sequence_length_as_a_dynamic_dim(tmp_path):
    """S of [B, H, S, D] (not a leading dim): the manifest names it, and the C tables leave it and the
    strides of B and H to the run (a TensorMap's 0 dim and `scaled` bits)."""
    out = tmp_path / "pkg"
    assert cli.main(["package", f"{EXAMPLE}:flash_attention", "--arch", "sm_90a", "--shape", "B=1,H=2,S=2048,D=64",
                     "--dynamic", "S", "-o", str(out)]) == 0
    (spec,) = json.loads((out / "manifest.json").read_text())["functions"]["flash_attention"]["specializations"]
    assert spec["arguments"][0]["shape"] == [1, 2, "S", 64] and spec["dims"]["S"] == "dynamic"
    source = (out / "tessera_flash_attention.cpp").read_text()
    # q as the C table holds it, innermost first: D, S (the run's), H, B; strides of S, H, B: H's and
    # B's scale with S (bits 1 and 2)
    assert "CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4, {64, 0, 2, 1}, {128, 128, 256}, {64, 128, 1, 1}, " \
           "CU_TENSOR_MAP_SWIZZLE_128B, 6}" in source


def test_a_packaged_functions_fast_record_is_made_once_and_dropped_past_the_limits(monkeypatch):
    """`PackagedFunction._try_first`: the record is asked for once per signature; a record the C
    module refuses (past its limits) is dropped rather than built or refused on every call, and
    one made while the module loads becomes a call later."""
    from tessera.runtime import fastcall
    from tessera.runtime.package import PackagedFunction

    class Program:
        records = 0

        def fast_record(self, *a, **k):
            Program.records += 1
            return fastcall.Record((), (), (), 1, None, 0, 0, None, ())

    fn = PackagedFunction("f", "function", ["x"], [])
    monkeypatch.setattr(fastcall, "_why_not", None)
    monkeypatch.setattr(fastcall, "make", lambda record: (_ for _ in ()).throw(ValueError("too many")))
    for _ in range(3):
        fn._try_first(("sig", 0), Program(), (), ())
    assert Program.records == 1 and fn._records[("sig", 0)] is None and not fn._fast
    loaded = []
    monkeypatch.setattr(fastcall, "make", lambda record: loaded[0] if loaded else None)   # still loading
    fn._try_first(("other", 0), Program(), (), ())
    assert isinstance(fn._records[("other", 0)], fastcall.Record) and not fn._fast
    loaded.append(call := object())
    fn._try_first(("other", 0), Program(), (), ())
    assert Program.records == 2 and fn._records[("other", 0)] is call and fn._fast == (call,)


def test_a_package_schedules_each_dynamic_dim_for_its_largest_value():
    """Two dynamic dims, their largest values in different --shapes: each is compiled at its own
    largest (a cross-attention's 8192 keys must not take the schedule of 16)."""
    from tessera.runtime.package import _largest_dynamic
    shapes = [{"B": 1, "M": 16, "N": 8192}, {"B": 1, "M": 4096, "N": 16}, {"B": 2, "M": 3, "N": 5}]
    assert _largest_dynamic(shapes, ["M", "N"]) == [{"B": 1, "M": 4096, "N": 8192}] * 2 + [{"B": 2, "M": 3, "N": 5}]
    assert _largest_dynamic(shapes, []) == shapes
