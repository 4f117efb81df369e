"""The launch fast path's C module (runtime/fastcall.py, cpp/fastcall.c) on the CPU: built with the
machine's compiler and pointed at a fake driver library that records each launch, so what it checks
and what it passes to cuLaunchKernel are tested without a GPU (tests/gpu/test_fastcall_gpu.py runs
it on the real driver)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from tessera.runtime import fastcall

FAKE_DRIVER = r"""
#include <stdint.h>
#include <string.h>
typedef struct { int id; char pad[4]; union { char bytes[64]; int programmatic; } value; } Attr;
typedef struct { unsigned g[3], b[3], shared; void *stream; Attr *attrs; unsigned n_attrs; } Config;
int launches, fail_code, ctx_sets, programmatic, record[16];
void *function, *stream, *current;
unsigned grid[3], block[3], shared;
unsigned char params[16][128];
static void keep(void *f, void **p) {
    function = f;
    for (int i = 0; i < 16 && record[i]; i++) memcpy(params[i], p[i], record[i]);
    launches++;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sh, void *s, void **p, void **extra) {
    if (fail_code) return fail_code;
    grid[0] = gx; grid[1] = gy; grid[2] = gz; block[0] = bx; block[1] = by; block[2] = bz;
    shared = sh; stream = s; programmatic = 0;
    keep(f, p);
    return 0;
}
int cuLaunchKernelEx(const Config *c, void *f, void **p, void **extra) {
    memcpy(grid, c->g, sizeof grid); memcpy(block, c->b, sizeof block);
    shared = c->shared; stream = c->stream;
    programmatic = c->n_attrs == 1 && c->attrs[0].id == 6 && c->attrs[0].value.programmatic == 1;
    keep(f, p);
    return 0;
}
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSetCurrent(void *c) { current = c; ctx_sets++; return 0; }
"""

pytestmark = pytest.mark.skipif(fastcall.compiler() is None, reason="needs a C compiler")


class FakeDType:
    pass


F16, F32 = FakeDType(), FakeDType()


class FakeTensor:
    """What the fast path reads of a torch tensor."""

    def __init__(self, shape, dtype=F16, ptr=0x1000, device=0, strides=None, requires_grad=False):
        self.shape, self.dtype, self.ptr, self.device = tuple(shape), dtype, ptr, device
        self.strides, self.requires_grad = strides, requires_grad

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.device

    def is_contiguous(self):
        return self.strides is None

    def stride(self):
        return self.strides


class SubTensor(FakeTensor):
    pass


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fastcall")
    return fastcall.load(fastcall.build(directory))


@pytest.fixture
def fake(tmp_path, module):
    source = tmp_path / "fake.c"
    source.write_text(FAKE_DRIVER)
    library = tmp_path / "libfakecuda.so"
    subprocess.run([fastcall.compiler(), "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    errors = []

    def on_error(api, code, step):
        errors.append((api, code, step))
        raise RuntimeError(f"{api} -> {code} at step {step}")
    module.configure(str(library), on_error)
    lib = ctypes.CDLL(str(library))
    lib.errors = errors
    return lib


def ints(lib, name, n):
    return list((ctypes.c_uint * n).in_dll(lib, name))


def param(lib, i, nbytes):
    """The first `nbytes` of kernel param i of the last launch (as far as `record_sizes` copied)."""
    return ctypes.string_at(ctypes.addressof(ctypes.c_ubyte.in_dll(lib, "params")) + 128 * i, nbytes)


def record_sizes(lib, *sizes):
    """Make the fake driver copy the first len(sizes) params of each launch, this many bytes each."""
    (ctypes.c_int * 16).in_dll(lib, "record")[0:len(sizes)] = list(sizes)


def record(**kw) -> fastcall.Record:
    """A call of f(x, y, 3) -> one [4, 8] output, one launch over (x, y, out) and the size 4."""
    allocated = []

    def empty(shape, dtype=None):
        t = FakeTensor(shape, dtype, ptr=0x9000 + 0x100 * len(allocated))
        allocated.append(t)
        return t
    base = dict(
        args=((fastcall.ARG_TENSOR, FakeTensor, F16, (4, 8), 0, None, 64),
              (fastcall.ARG_TENSOR, FakeTensor, F16, (4, 8), 0, None, 64),
              (fastcall.ARG_VALUE, 3)),
        inputs=(0, 1),
        allocs=(fastcall.Alloc(empty, ((4, 8),), (("dtype", F32),)),),
        n_results=1, stream=lambda device: 0x5000 + device, stream_arg=0, context=0xC0,
        encode=lambda ptr, spec: ptr.to_bytes(8, "little") * 16,
        launches=(fastcall.Launch(0xF00, (2, 3, 1), (128, 1, 1), 1024, False,
                                  ((fastcall.POINTER, 0), (fastcall.POINTER, 1), (fastcall.POINTER, 2),
                                   (fastcall.U32, 4))),))
    base.update(kw)
    return fastcall.Record(**base), allocated


def test_a_matching_call_launches_with_its_pointers_sizes_grid_and_stream(module, fake):
    record_sizes(fake, 8, 8, 8, 4)
    rec, allocated = record()
    call = module.Call(rec.as_tuple())
    x, y = FakeTensor((4, 8), ptr=0x1000), FakeTensor((4, 8), ptr=0x2000)
    out = call(x, y, 3)
    assert out is allocated[0] and out.shape == (4, 8) and out.dtype is F32
    assert ctypes.c_int.in_dll(fake, "launches").value == 1
    assert ctypes.c_void_p.in_dll(fake, "function").value == 0xF00
    assert ints(fake, "grid", 3) == [2, 3, 1] and ints(fake, "block", 3) == [128, 1, 1]
    assert ctypes.c_uint.in_dll(fake, "shared").value == 1024
    assert ctypes.c_void_p.in_dll(fake, "stream").value == 0x5000
    assert [int.from_bytes(param(fake, i, 8), "little") for i in range(3)] == [0x1000, 0x2000, 0x9000]
    assert int.from_bytes(param(fake, 3, 4), "little") == 4
    # the record's context was made current once; a later call finds it current
    assert ctypes.c_void_p.in_dll(fake, "current").value == 0xC0
    call(FakeTensor((4, 8), ptr=0x3000), y, 3)
    assert ctypes.c_int.in_dll(fake, "ctx_sets").value == 1
    assert int.from_bytes(param(fake, 0, 8), "little") == 0x3000   # new pointers each call


@pytest.mark.parametrize("args", [
    lambda x, y: (x, y, 4),                                   # another value
    lambda x, y: (x, y, 3.0),                                 # another type of value
    lambda x, y: (x, y),                                      # too few arguments
    lambda x, y: (x, FakeTensor((4, 9)), 3),                  # another shape
    lambda x, y: (x, FakeTensor((4, 8), dtype=F32), 3),       # another dtype
    lambda x, y: (x, FakeTensor((4, 8), device=1), 3),        # another device
    lambda x, y: (x, FakeTensor((4, 8), strides=(1, 4)), 3),  # not contiguous
    lambda x, y: (x, FakeTensor((4, 8), ptr=0x2008), 3),      # not 16-byte aligned
    lambda x, y: (x, FakeTensor((4, 8), requires_grad=True), 3),   # autograd's path
    lambda x, y: (x, SubTensor((4, 8)), 3),                   # another type
])
def test_a_call_that_differs_in_anything_is_declined_before_any_launch(module, fake, args):
    rec, allocated = record()
    call = module.Call(rec.as_tuple())
    assert call(*args(FakeTensor((4, 8)), FakeTensor((4, 8), ptr=0x2000))) is None
    assert ctypes.c_int.in_dll(fake, "launches").value == 0 and not allocated


@pytest.mark.parametrize("kept,given,launches", [
    (0.0, 0.0, 1), (0.0, -0.0, 0), (-0.0, 0.0, 0), (float("nan"), float("nan"), 1), (2.5, 2.5, 1),
])
def test_float_arguments_match_by_their_bits(module, fake, kept, given, launches):
    """As the compile keys them (`captures.exact`): 0.0 and -0.0 are two programs, a NaN is itself."""
    tensor = (fastcall.ARG_TENSOR, FakeTensor, F16, (4, 8), 0, None, 64)
    rec, _ = record(args=(tensor, tensor, (fastcall.ARG_VALUE, kept)))
    call = module.Call(rec.as_tuple())
    result = call(FakeTensor((4, 8)), FakeTensor((4, 8), ptr=0x2000), given)
    assert (result is not None) == bool(launches)
    assert ctypes.c_int.in_dll(fake, "launches").value == launches


def test_strided_arguments_match_by_their_strides(module, fake):
    spec = (fastcall.ARG_TENSOR, FakeTensor, F16, (4, 8), 0, (1, 4), 64)
    rec, _ = record(args=(spec, spec, (fastcall.ARG_VALUE, 3)))
    call = module.Call(rec.as_tuple())
    assert call(FakeTensor((4, 8), strides=(1, 4)), FakeTensor((4, 8), strides=(1, 4)), 3) is not None
    assert call(FakeTensor((4, 8)), FakeTensor((4, 8), strides=(1, 4)), 3) is None


def test_tensor_maps_programmatic_launches_templates_and_several_results(module, fake):
    record_sizes(fake, 8, 128, 8)
    allocated = []

    def like(template, dtype=None):
        t = FakeTensor(template.shape, dtype or template.dtype, ptr=0xA000 + 0x100 * len(allocated))
        allocated.append(t)
        return t
    rec, _ = record(
        allocs=(fastcall.Alloc(like, template=1), fastcall.Alloc(like, (), (("dtype", F32),), template=0),
                fastcall.Alloc(like, template=0)),
        n_results=2,
        launches=(fastcall.Launch(0xF01, (1, 1, 1), (32, 1, 1), 0, False, ((fastcall.POINTER, 4),) * 3),
                  fastcall.Launch(0xF02, (5, 1, 1), (64, 1, 1), 0, True,
                                  ((fastcall.POINTER, 2), (fastcall.TENSOR_MAP, 0, "spec"), (fastcall.POINTER, 3)))))
    call = module.Call(rec.as_tuple())
    out = call(FakeTensor((4, 8), ptr=0x1000), FakeTensor((4, 8), ptr=0x2000), 3)
    assert out == (allocated[0], allocated[1]) and allocated[1].dtype is F32
    assert ctypes.c_int.in_dll(fake, "launches").value == 2
    assert ctypes.c_int.in_dll(fake, "programmatic").value == 1 and ints(fake, "grid", 3) == [5, 1, 1]
    assert int.from_bytes(param(fake, 0, 8), "little") == 0xA000                 # output 0 (first buffer past inputs)
    assert param(fake, 1, 128) == (0x1000).to_bytes(8, "little") * 16      # x's tensor map
    assert int.from_bytes(param(fake, 2, 8), "little") == 0xA100
    # a map over the same address is not encoded again; one over another address is
    encoded = []
    rec2, _ = record(allocs=rec.allocs, n_results=2, launches=rec.launches,
                     encode=lambda ptr, spec: encoded.append(ptr) or ptr.to_bytes(8, "little") * 16)
    call = module.Call(rec2.as_tuple())
    for ptr in (0x1000, 0x1000, 0x4000, 0x4000, 0x1000):
        call(FakeTensor((4, 8), ptr=ptr), FakeTensor((4, 8), ptr=0x2000), 3)
        assert param(fake, 1, 128) == ptr.to_bytes(8, "little") * 16
    assert encoded == [0x1000, 0x4000, 0x1000]


def test_a_failed_launch_raises_through_the_error_handler(module, fake):
    ctypes.c_int.in_dll(fake, "fail_code").value = 700
    call = module.Call(record()[0].as_tuple())
    with pytest.raises(RuntimeError, match="cuLaunchKernel -> 700 at step 0"):
        call(FakeTensor((4, 8)), FakeTensor((4, 8), ptr=0x2000), 3)


def test_a_kernels_outputs_may_overlap_no_other_argument(module, fake):
    """A @kernel's record (outputs written into its arguments, `disjoint`) declines a call whose
    output's bytes meet another argument's: the general path then writes through copies."""
    rec, _ = record(allocs=(fastcall.Alloc(lambda x: x, template=1),), n_results=0, disjoint=(1,))
    call = module.Call(rec.as_tuple())
    assert call(FakeTensor((4, 8), ptr=0x1000), FakeTensor((4, 8), ptr=0x1040), 3) == ()   # [0x1000, 0x1040) ends where y starts
    assert call(FakeTensor((4, 8), ptr=0x1000), FakeTensor((4, 8), ptr=0x1030), 3) is None
    y = FakeTensor((4, 8), ptr=0x1000)
    assert call(y, y, 3) is None
    assert ctypes.c_int.in_dll(fake, "launches").value == 1


LIMIT = 4


def test_guarded_globals_and_cells_must_hold_the_same_objects(module, fake):
    """A record holds for the globals and closure variables the trace read as long as each holds the
    same object (tessera.frontend.captures.Captures.identity_guards); a rebinding, a deletion or a
    first assignment declines the call."""
    from tessera.frontend.captures import MISSING

    def make_cell(value):
        return (lambda: value).__closure__[0]
    cell = make_cell(object())
    limit = LIMIT
    rec, _ = record(guards=(("global", globals(), "LIMIT", limit), ("cell", cell, cell.cell_contents)))
    call = module.Call(rec.as_tuple())
    args = (FakeTensor((4, 8)), FakeTensor((4, 8), ptr=0x2000), 3)
    assert call(*args) is not None
    globals()["LIMIT"] = 4.0    # equal, but another object: the trace could differ (4 vs 4.0)
    try:
        assert call(*args) is None
    finally:
        globals()["LIMIT"] = limit
    assert call(*args) is not None
    cell.cell_contents = object()
    assert call(*args) is None
    rec, _ = record(guards=(("global", globals(), "NOT_YET", MISSING),))
    call = module.Call(rec.as_tuple())
    assert call(*args) is not None
    globals()["NOT_YET"] = 1
    try:
        assert call(*args) is None
    finally:
        del globals()["NOT_YET"]


def test_bad_records_are_refused(module):
    rec, _ = record(inputs=(0, 5))
    with pytest.raises(ValueError, match="input position"):
        module.Call(rec.as_tuple())
    rec, _ = record(launches=(fastcall.Launch(1, (1, 1, 1), (1, 1, 1), 0, False, ((fastcall.POINTER, 9),)),))
    with pytest.raises(ValueError, match="bad parameter"):
        module.Call(rec.as_tuple())
    rec, _ = record(launches=(fastcall.Launch(1, (1, 1, 1), (1, 1, 1), 0, False, ((7, 0),)),))
    with pytest.raises(ValueError, match="bad parameter kind"):
        module.Call(rec.as_tuple())
    rec, _ = record(args=((fastcall.ARG_TENSOR, FakeTensor),))
    with pytest.raises(TypeError):
        module.Call(rec.as_tuple())
    rec, _ = record(args=((5, 3),))
    with pytest.raises(ValueError, match="a tensor or a value"):
        module.Call(rec.as_tuple())
    with pytest.raises(RuntimeError, match="no record"):
        module.Call.__new__(module.Call)(1, 2)


def _cuda_h() -> Path | None:
    """The CUDA driver API header: from NVIDIA's pip wheels (the test extras install
    nvidia-cuda-runtime, which carries it), a toolkit's nvcc on PATH, or /usr/local/cuda."""
    import nvidia

    nvcc = shutil.which("nvcc")
    candidates = [*(h for root in nvidia.__path__ for h in sorted(Path(root).glob("*/include/cuda.h"))),
                  *([Path(nvcc).resolve().parents[1] / "include" / "cuda.h"] if nvcc else []),
                  Path("/usr/local/cuda/include/cuda.h")]
    return next((h for h in candidates if h.exists()), None)


def test_the_launch_structs_match_cuda_h(module, tmp_path):
    """cpp/fastcall.c mirrors CUlaunchConfig and CUlaunchAttribute rather than including cuda.h
    (which a machine with only torch's wheels lacks): their layouts must agree."""
    header = _cuda_h()
    assert header is not None, "no cuda.h: the test extras' nvidia-cuda-runtime wheel or a CUDA toolkit carries it"
    probe = tmp_path / "probe.c"
    probe.write_text(f"""#include <stddef.h>
#include <stdio.h>
#include "{header}"
int main(void) {{
  printf("%zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
         sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
         offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}}""")
    subprocess.run([fastcall.compiler(), str(probe), "-o", str(tmp_path / "probe")], check=True)
    theirs = [int(v) for v in subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True,
                                             check=True).stdout.split()]
    ours = module.layout()
    assert theirs == [ours["attribute_size"], ours["attribute_value"], ours["config_size"], ours["config_shared"],
                      ours["config_stream"], ours["config_attrs"], ours["config_num_attrs"], ours["programmatic_id"]]


def test_the_build_is_cached_and_leaves_nothing_else(tmp_path, monkeypatch):
    first = fastcall.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert fastcall.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]   # no temporary left behind
    monkeypatch.setenv("CC", "false")   # a failing compiler: a clear error, no file published
    monkeypatch.setattr(fastcall, "SOURCE", tmp_path / "other.c")
    (tmp_path / "other.c").write_text("int x;")
    with pytest.raises(OSError, match="false failed"):
        fastcall.build(tmp_path / "second")
    assert not list((tmp_path / "second").iterdir())
