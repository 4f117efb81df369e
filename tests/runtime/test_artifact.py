"""The artifact (runtime/artifact.py): a compile serialized and read back gives the launcher the plan,
launches and profiled kernels the compile gives it; the single-file container refuses what it did
not write whole."""
import json
import struct

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.runtime import artifact, launcher, profile, ptxas

pytestmark = pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")


@tsr.function
def split_gemm_softmax(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    with tsr.profile_region("gemm"):
        c = tsr.matmul(a, b)
    return tsr.softmax(c, dim=-1)


def compile_for(dims, **options):
    specs = split_gemm_softmax.arg_specs_for(dims, "fp16")
    return split_gemm_softmax.compile(specs, arch="sm_80", **options), specs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A split-K GEMM (an intermediate buffer, three kernels) with profiling on, and its artifact."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))
        dims = dict(M=128, K=4096, N=4096)
        c, specs = compile_for(dims, profile=True)
        return c, artifact.Artifact.from_compiled(c, specs, dims=dims, cubin_archs=("sm_86",))


def test_read_back_it_is_the_compiles_plan(compiled):
    c, a = compiled
    _, back = artifact.unpack(artifact.pack({}, a))
    assert back.files == a.files and back.record == json.loads(json.dumps(a.record))
    assert back.plan() == launcher.plan(c)
    assert back.launches == c.launches
    assert back.profiled() == profile.profiled_launches(c) and back.profiled()
    assert back.plan().intermediates and len(back.plan().steps) == 3
    assert back.arg_names == c.arg_names and back.result_names == c.result_names


def test_each_kernel_has_its_ptx_and_a_cubin_per_arch(compiled):
    c, a = compiled
    for name, kernel in a.record["kernels"].items():
        assert set(kernel["images"]) == {"ptx", "sm_80", "sm_86"}
        assert a.files[kernel["images"]["ptx"]["file"]].decode() == c.stage("ptx")[name].ptx
        assert a.files[kernel["images"]["sm_86"]["file"]] == c.stage("cubin", arch="sm_86")[name].cubin
        images = {arch: ("cubin", kernel["images"][arch]["file"]) for arch in ("sm_80", "sm_86")}
        assert [a.image_for(name, d) for d in ("sm_80", "sm_86", "sm_89")] == [
            images["sm_80"], images["sm_86"], images["sm_86"]]
        assert a.image_for(name, "sm_90a") == ("ptx", kernel["images"]["ptx"]["file"])


def test_a_container_of_another_format_is_refused(compiled):
    _, a = compiled
    data = artifact.pack({}, a)
    body_at = len(artifact.MAGIC) + 40
    (length,) = struct.unpack_from("<Q", data, body_at - 8)
    header = json.loads(data[body_at:body_at + length])
    header["format"] = artifact.FORMAT_VERSION + 1
    body = json.dumps(header).encode()
    import hashlib
    forged = artifact.MAGIC + hashlib.sha256(body).digest() + struct.pack("<Q", len(body)) + body + \
        data[body_at + length:]
    with pytest.raises(artifact.ArtifactError, match=f"artifact format {artifact.FORMAT_VERSION + 1}, this Tessera reads {artifact.FORMAT_VERSION}"):
        artifact.unpack(forged)
    with pytest.raises(artifact.ArtifactError, match="bad magic"):
        artifact.unpack(b"PK" + data)


def test_arguments_must_be_the_compiles():
    c, specs = compile_for(dict(M=64, K=64, N=64))
    with pytest.raises(artifact.ArtifactError, match="are not the compile's"):
        artifact.Artifact.from_compiled(c, specs[::-1], dims={})


@pytest.mark.parametrize("image, device, fits", [
    ("sm_80", "sm_80", True), ("sm_80", "sm_86", True), ("sm_86", "sm_80", False), ("sm_80", "sm_90", False),
    ("sm_90a", "sm_90a", True), ("sm_90a", "sm_100a", False), ("sm_90", "sm_90a", True)])
def test_cubin_compatibility(image, device, fits):
    assert artifact.runs_on(image, device, "cubin") == fits


def test_a_compile_for_multiples_of_128_keeps_its_promise_in_the_record(tmp_path, monkeypatch):
    """A dim compiled as a multiple of 128 (`tessera.dims.ALIGNMENT`, a function call's class):
    the record says so, the plan read back checks it, and the C package refuses it (its entry
    points take every value)."""
    from tessera.dims import bind_shapes
    from tessera.errors import ShapeError
    from tessera.runtime import cpp_package

    from flash_attention import flash_attention

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    dims = dict(B=1, H=2, S=256, D=64)
    specs = flash_attention.arg_specs_for(dims, "fp16")
    c = flash_attention.compile(specs, dynamic=frozenset({"S"}), aligned=frozenset({"S"}), arch="sm_80")
    a = artifact.Artifact.from_compiled(c, specs, dims=dims, cubin_archs=())
    _, back = artifact.unpack(artifact.pack({}, a))
    assert back.record["dim_multiples"] == {"S": 128} and back.plan() == launcher.plan(c)
    shapes = [tuple(x["shape"]) for x in back.record["arguments"]]
    given = [(1, 2, 384, 64)] * 3
    assert bind_shapes("f", shapes, given, ["q", "k", "v"], 64, back.plan().dim_multiples)
    with pytest.raises(ShapeError, match="argument 'q' has S=300; this compile takes S a multiple of 128"):
        bind_shapes("f", shapes, [(1, 2, 300, 64)] * 3, ["q", "k", "v"], 64, back.plan().dim_multiples)
    with pytest.raises(ValueError, match="take every value of a dynamic dim"):
        cpp_package.function_sources("flash_attention", {(): [back]}, {})


def test_a_compile_for_every_value_records_the_dims_its_kernels_would_align():
    """The same attention compiled for every value of S: its record names S with multiple 1 (its
    key loop would be whole for multiples of 128), any S binds, and the C package takes it."""
    from flash_attention import flash_attention
    from tessera.dims import bind_shapes
    from tessera.runtime import cpp_package

    dims = dict(B=1, H=2, S=256, D=64)
    specs = flash_attention.arg_specs_for(dims, "fp16")
    c = flash_attention.compile(specs, dynamic=frozenset({"S"}), arch="sm_80")
    a = artifact.Artifact.from_compiled(c, specs, dims={**dims, "S": "dynamic"}, cubin_archs=())
    assert a.record["dim_multiples"] == {"S": 1} == c.dim_multiples
    shapes = [tuple(x["shape"]) for x in a.record["arguments"]]
    assert bind_shapes("f", shapes, [(1, 2, 300, 64)] * 3, ["q", "k", "v"], 64, a.plan().dim_multiples)
    header, source = cpp_package.function_sources("flash_attention", {(): [a]}, a.files)
    assert "flash_attention" in header and source
