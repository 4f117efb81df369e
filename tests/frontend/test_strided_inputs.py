"""Strided inputs: a call specializes on each argument's layout, and kernels read an argument whose
innermost dim is contiguous through its strides (a `strided<[...]>` memref), without a copy.

On the CPU tile interpreter against float64 (the interpreter takes the strided arrays as they
are, checked against the layout compiled for); the compile decisions (which arguments stay in
place, which are copied and why); the layout in the call's key; the PTX's addressing (strides,
vector widths, 64-bit offsets where the layout reaches past 2^31 elements) and TMA tensor maps,
assembled by ptxas; the CUDA Tile IR backend's tensor views.
"""
import math
import re

import numpy as np
import pytest

import tessera as tsr
from tessera.frontend.trace import ArgSpec
from tessera.ir import parse_ir, print_ir, tile
from tessera.runtime import interop

from attention_cases import FUNCTIONS, plain

rng = np.random.default_rng(7)


def normal(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def compiled_for(fn, *arrays, **options):
    _, specs = fn.arg_specs(list(zip(fn.signature.parameters, arrays)))
    return fn.compile(specs, **options)


def host_types(compiled) -> list:
    return list(compiled.host_function().function_type.inputs.data)


def attention64(q, k, v, kind="plain"):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    i, j = np.arange(s.shape[-2])[:, None], np.arange(s.shape[-1])[None, :]
    if kind == "softcap_causal":
        s = 20.0 * np.tanh(s / 20.0)
    if kind in ("causal", "softcap_causal"):
        s = np.where(i >= j, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True) @ v


# --- layouts ----------------------------------------------------------------------------------

def test_canonical_strides_ignore_size_one_dims_and_contiguity():
    assert interop.canonical_strides((4, 8), (8, 1)) is None
    assert interop.canonical_strides((4, 1, 8), (8, 999, 1)) is None          # torch's rule
    assert interop.canonical_strides((4, 1, 8), (16, 3, 1)) == (16, 8, 1)
    assert interop.canonical_strides((4, 1, 8), (16, 77, 1)) == (16, 8, 1)
    assert interop.canonical_strides((5, 1), (3, 7)) == (3, 1)
    x = normal(6, 5, 32)
    assert interop.layout_of(x) is None
    assert interop.layout_of(x.transpose(1, 0, 2)) == (32, 160, 1)
    assert interop.layout_of(np.broadcast_to(normal(1, 9), (4, 9))) == (0, 1)


@tsr.function
def softmax_plus(x, y):
    return tsr.softmax(x * 2.0, dim=-1) + y


def test_a_strided_argument_is_read_in_place():
    base = normal(6, 5, 32)
    x, y = base.transpose(1, 0, 2), normal(5, 6, 32)
    compiled = compiled_for(softmax_plus, x, y)
    assert compiled.copied_args == {}
    assert str(host_types(compiled)[0]) == "memref<5x6x32xf32, strided<[32, 160, 1]>>"
    assert not tile.is_strided(host_types(compiled)[1])
    assert "tessera.arg_strides = {x = array<i64: 32, 160, 1>}" in compiled.ir("graph")
    x64 = x.astype(np.float64) * 2
    ref = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(softmax_plus(x, y), ref / ref.sum(-1, keepdims=True) + y, rtol=1e-5, atol=1e-6)


def test_the_layout_is_part_of_the_call_key():
    """Contiguous, strided and differently strided calls compile apart; a size-1 dim's stride,
    which no index moves along, does not split them."""
    @tsr.function
    def double(x):
        return x * 2.0

    wide = normal(8, 48)
    for x in (wide[:, :16], wide[:, :16].copy(), wide[:, 8:24], normal(8, 40)[:, :16]):
        np.testing.assert_array_equal(double(x), x * 2.0)
    assert len({k[0] for k in double._cache}) == 3       # contiguous, row stride 48, row stride 40
    one = normal(1, 48)
    a, b = np.lib.stride_tricks.as_strided(one, (1, 16), (4 * 48, 4)), np.lib.stride_tricks.as_strided(one, (1, 16), (4 * 7, 4))
    double(a), double(b)
    assert len({k[0] for k in double._cache}) == 4       # both C-contiguous as torch defines it: one more


@pytest.mark.parametrize("x, why", [
    (normal(7, 5).T, "its innermost dim has stride 5, not 1"),
    (normal(5, 7)[::-1], "dim 0 has a negative stride"),
])
def test_layouts_kernels_cannot_take_are_copied_and_named(x, why):
    @tsr.function
    def add(x, y):
        return x + y

    y = normal(*x.shape)
    compiled = compiled_for(add, x, y)
    assert compiled.copied_args == {"x": why}
    assert not tile.is_strided(host_types(compiled)[0])
    np.testing.assert_allclose(add(x, y), x + y, rtol=1e-6)


def test_a_copy_is_logged_when_compiled(caplog):
    @tsr.function
    def add(x, y):
        return x + y

    with caplog.at_level("WARNING", logger="tessera.compiler"):
        add(normal(7, 5).T, normal(5, 7))
    assert "add: argument 'x' is copied to a contiguous buffer before every call: its innermost dim has stride 5" \
        in caplog.text


def test_an_argument_a_host_view_reshapes_is_copied():
    @tsr.function
    def flat(x):
        return x.reshape(-1) * 2.0

    x = normal(9, 40)[:, :16]
    assert compiled_for(flat, x).copied_args == {"x": "a reshape no kernel took views it, which needs contiguous memory"}
    np.testing.assert_array_equal(flat(x), (x * 2.0).reshape(-1))


def test_a_broadcast_input_is_read_with_stride_zero():
    y = np.broadcast_to(normal(1, 40), (6, 40))
    x = normal(6, 40)
    compiled = compiled_for(softmax_plus, x, y)
    assert "strided<[0, 1]>" in str(host_types(compiled)[1]) and compiled.copied_args == {}
    x64 = x.astype(np.float64) * 2
    ref = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(softmax_plus(x, y), ref / ref.sum(-1, keepdims=True) + y, rtol=1e-5, atol=1e-6)


def test_the_interpreter_checks_the_strides_compiled_for():
    x = normal(8, 48)
    compiled = compiled_for(softmax_plus, x[:, :16], x[:, :16])
    with pytest.raises(tsr.TesseraError, match=r"argument 'x' has strides \(40, 1\), compiled for \(48, 1\)"):
        compiled.run(normal(8, 40)[:, :16], x[:, :16])


# --- kernels on the interpreter, against float64 -----------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "causal", "softcap_causal"])
@pytest.mark.parametrize("b,h,s,d", [(2, 3, 17, 64), (1, 2, 33, 128)])
def test_attention_on_bshd_views(kind, b, h, s, d):
    """Q on its own [B, S, H, D] buffer, K and V out of one packed [B, S, 2, H, D] projection."""
    q = normal(b, s, h, d).transpose(0, 2, 1, 3)
    kv = normal(b, s, 2, h, d)
    k, v = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    fn = FUNCTIONS[kind]
    compiled = compiled_for(fn, q, k, v)
    assert compiled.copied_args == {} and all(tile.is_strided(t) for t in host_types(compiled)[:3])
    np.testing.assert_allclose(fn(q, k, v), attention64(q, k, v, kind), rtol=2e-4, atol=2e-5)


def test_decode_over_a_prefix_of_a_cache_splits_and_reads_in_place():
    cache = normal(2, 1, 301, 2, 64)
    k, v = (cache[i, :, :257].transpose(0, 2, 1, 3) for i in range(2))
    q = normal(1, 2, 1, 64)
    compiled = compiled_for(plain, q, k, v, space={"split_kv": [3]})
    assert compiled.kernel_names[0].endswith("_partials") and compiled.copied_args == {}
    np.testing.assert_allclose(compiled.run(q, k, v)[0], attention64(q, k, v), rtol=2e-4, atol=2e-5)


@tsr.function
def gemm_bias(a, b, bias):
    return tsr.gelu(tsr.matmul(a, b) + bias, approximate="tanh")


@pytest.mark.parametrize("m,n,k", [(37, 40, 48), (1, 13, 64)])
def test_gemm_on_slices(m, n, k):
    a = normal(m, k + 16)[:, 8:8 + k]
    b = normal(k, n + 3)[:, :n]
    bias = normal(n)
    types = host_types(compiled_for(gemm_bias, a, b, bias))
    assert tile.is_strided(types[1]) and tile.is_strided(types[0]) == (m > 1)   # one row: contiguous
    x = a.astype(np.float64) @ b + bias
    ref = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(gemm_bias(a, b, bias), ref, rtol=1e-4, atol=1e-5)


def test_vjp_through_strided_inputs():
    """The backward's functions take the forward's arguments in their layouts too."""
    q = normal(1, 9, 2, 16).transpose(0, 2, 1, 3)
    kv = normal(1, 9, 2, 2, 16)
    k, v = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    out, vjp_fn = tsr.vjp(plain, q, k, v)
    d_out = normal(*out.shape)
    from attention_cases import reference_grads
    for got, want in zip(vjp_fn(d_out), reference_grads("plain", q, k, v, d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


# --- the GPU code, assembled ------------------------------------------------------------------

def bshd(name, b, h, s, d, dtype, heads_apart=1):
    """A [B, H, S, D] spec of a [B, S, H * heads_apart, D] buffer's view."""
    return ArgSpec(name, (b, h, s, d), dtype, ("B", "H", "S", "D"),
                   (s * h * heads_apart * d, heads_apart * d, h * heads_apart * d, 1))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_strided_attention_assembles_with_strided_tensor_maps(arch):
    specs = [bshd("q", 2, 4, 1000, 128, tsr.fp16), bshd("k", 2, 4, 1000, 128, tsr.fp16, 3),
             bshd("v", 2, 4, 1000, 128, tsr.fp16, 3)]
    compiled = plain.compile(specs, arch=arch, sm_count=132)
    compiled.stage("cubin")
    maps = [m for launch in compiled.launches.values() for m in launch.tensor_maps]
    if arch == "sm_90a":
        assert {m.strides for m in maps} == {(512000, 128, 512, 1), (1536000, 384, 1536, 1)}
        text = compiled.ir("target")
        assert "strides = [512000, 128, 512, 1]" in text
        assert print_ir(parse_ir(text)) == text
    else:
        assert maps == []


def test_a_tensor_map_type_with_strides_round_trips():
    from tessera.ir import target
    from xdsl.dialects.builtin import f16
    t = target.TensorMapType.of(f16, (2, 8, 64), (1, 8, 64), strides=(8192, 64, 1))
    assert str(t) == "!tessera_target.tensor_map<f16, [2, 8, 64], strides = [8192, 64, 1], box = [1, 8, 64], swizzle = 128>"
    assert target.TensorMapType.of(f16, (2, 8, 64), (1, 8, 64), strides=(512, 64, 1)).strides.data == ()


def _ptx(fn, specs, arch="sm_90a"):
    compiled = fn.compile(specs, arch=arch)
    return "\n".join(k.ptx for k in compiled.stage("ptx").values())


def test_vector_loads_need_aligned_rows():
    """A row stride of 4100 fp16 elements leaves rows 8 bytes off 16-byte alignment: no 16-byte loads."""
    @tsr.function
    def rows(x):
        return tsr.softmax(x, dim=-1)

    aligned = _ptx(rows, [ArgSpec("x", (64, 4096), tsr.fp16, ("M", "N"), (4104, 1))])
    off = _ptx(rows, [ArgSpec("x", (64, 4096), tsr.fp16, ("M", "N"), (4100, 1))])
    assert "ld.global.v4.b32" in aligned and "ld.global.v4.b32" not in off
    assert "ld.global.v2.b32" in off


def test_a_layout_reaching_past_2_31_elements_addresses_in_64_bits():
    """Few elements, far apart: offsets are summed in 64 bits, where 32 would wrap."""
    @tsr.function
    def double(x):
        return x * 2.0

    far = ArgSpec("x", (2, 64), tsr.fp16, ("M", "N"), (2 ** 31, 1))
    near = ArgSpec("x", (2, 64), tsr.fp16, ("M", "N"), (128, 1))
    assert tile.reach(double.compile([far]).host_function().function_type.inputs.data[0]) == 2 ** 31 + 64
    assert "mad.lo.s64" in _ptx(double, [far]) and "mad.lo.s64" not in _ptx(double, [near])


def test_cuda_tile_views_take_the_strides():
    """The CUDA Tile IR backend's tensor views carry the strides; its NumPy interpreter, running the
    kernels on the flat storage a GPU pointer would address, matches float64."""
    from tessera.backends.cuda_tile.interp import run_kernels

    q = normal(1, 17, 2, 64).astype(np.float16).transpose(0, 2, 1, 3)
    kv = normal(1, 17, 2, 2, 64).astype(np.float16)
    k, v = kv[:, :, 0].transpose(0, 2, 1, 3), kv[:, :, 1].transpose(0, 2, 1, 3)
    compiled = compiled_for(plain, q, k, v, backend="cuda-tile")
    text = "\n".join(kernel.text for kernel in compiled.stage("cuda_tile").values())
    assert "strides=[128,64,128,1]" in text.replace(" ", "")   # (B = 1: dim 0's stride is canonical)
    (out,) = run_kernels(compiled.stage("cuda_tile"), compiled.stage("tile"), q, k, v)
    np.testing.assert_allclose(out.astype(np.float64), attention64(q, k, v), rtol=2e-2, atol=2e-3)


def test_the_launch_plan_and_its_record_keep_layouts_and_copies():
    """What the GPU runtime and a serialized artifact (warm start) read: each input's strides where
    the kernels read it in place, and whether the call copies it first."""
    from tessera.runtime import artifact, launcher

    @tsr.function
    def add(x, y):
        return x + y

    wide = normal(9, 48)
    compiled = compiled_for(add, wide[:, :16], normal(16, 9).T)
    inputs = launcher.plan(compiled).inputs
    assert [(b.strides, b.copied) for b in inputs] == [((48, 1), False), (None, True)]
    assert [artifact._buffer_from_record(artifact._buffer_record(b)) for b in inputs] == inputs


# --- review fixes -------------------------------------------------------------------------------

def test_a_spec_spells_its_layout_one_way():
    """An ArgSpec's strides are canonical: row-major's are none, a size-1 dim's stride is its own."""
    assert ArgSpec("x", (4, 8), tsr.fp32, ("a", "b"), (8, 1)).strides is None
    assert ArgSpec("x", (1, 4, 8), tsr.fp32, ("a", "b", "c"), (1000, 8, 1)).strides is None
    assert ArgSpec("x", (4, 1, 8), tsr.fp32, ("a", "b", "c"), (16, 3, 1)).strides == (16, 8, 1)
    compiled = softmax_plus.compile([ArgSpec("x", (4, 8), tsr.fp32, ("M", "N"), (8, 1)),
                                     ArgSpec("y", (4, 8), tsr.fp32, ("M", "N"))])
    x = normal(4, 8)
    np.testing.assert_allclose(compiled.run(x, x)[0], softmax_plus(x, x), rtol=1e-6)


def test_a_record_field_is_copied_on_the_cpu():
    """Byte strides between whole elements (a structured array's field) have no element layout."""
    rec = np.zeros(16, dtype=[("a", "<f4"), ("b", "u1")])
    rec["a"] = np.arange(16)

    @tsr.function
    def double(x):
        return x * 2.0

    np.testing.assert_array_equal(double(rec["a"]), np.arange(16) * 2.0)


def test_byte_spans_cover_what_strides_reach():
    from tessera.runtime import interop

    c = np.zeros((4, 6), np.float32)
    base = c.__array_interface__["data"][0]
    assert interop.byte_span(c) == interop.byte_span(c.T) == (base, base + 96)
    assert interop.byte_span(c[1:, ::-1]) == (base + 24, base + 96)     # a negative stride reaches back
    assert interop.byte_span(c[:, :2]) == (base, base + 4 * (3 * 6 + 2))
    assert interop.byte_span(c[:0])[0] == interop.byte_span(c[:0])[1]


def test_a_kernel_writing_memory_it_reads_elsewhere_goes_through_copies():
    from tessera.frontend.function import _OutputsThroughCopies, _through_copies_if_aliased

    c, b = np.zeros((4, 6), np.float32), np.zeros((6, 6), np.float32)
    program = object()
    assert isinstance(_through_copies_if_aliased(program, [c.T[:, :4], c], [1]), _OutputsThroughCopies)
    assert isinstance(_through_copies_if_aliased(program, [c, b, c], [2]), _OutputsThroughCopies)  # mm(C, B, C)
    assert _through_copies_if_aliased(program, [c], [0]) is program        # itself: the graph says
    assert _through_copies_if_aliased(program, [np.zeros(3), c], [1]) is program


def test_a_strided_cotangent_compiles_for_its_layout():
    q = normal(1, 2, 9, 16)
    out, vjp_fn = tsr.vjp(plain, q, q.copy(), q.copy())
    d_out = normal(1, 9, 2, 16).transpose(0, 2, 1, 3)
    from attention_cases import reference_grads
    for got, want in zip(vjp_fn(d_out), reference_grads("plain", q, q, q, d_out)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    graphs = [c.ir("graph") for d in plain._vjp_derivatives.values() for c in d._cache.values()]
    assert any(re.search(r"tessera.arg_strides = \{d_out\w* = array<i64: 32, 16, 32, 1>\}", g) for g in graphs)


def test_a_sharded_segment_keeps_its_arguments_layout():
    """A sharded function's segments compile for the layout their arguments come in (a strided
    call compiled for a contiguous one was refused on the GPU)."""
    from tessera import Tensor
    from tessera.distributed import shard
    from tessera.runtime import launcher

    class OneRankMesh:
        names = ("tp",)

        def size(self, axis):
            return 2

        def rank(self, axis):
            return 0

    @tsr.function
    def mlp(x: Tensor["B", "D"], w1: Tensor["D", "F"], w2: Tensor["F", "D"]):
        return tsr.matmul(tsr.relu(tsr.matmul(x, w1)), w2)

    f = shard(mlp, OneRankMesh(), {"F": "tp"})
    x, w1, w2 = normal(16, 80, dtype=np.float16)[:, :64], normal(64, 32, dtype=np.float16), normal(32, 64, dtype=np.float16)
    tensors, constants = f.fn._split_args((x, w1, w2))
    plan = f._plan(tensors, constants, False)
    seg = next(s.function for s in plan.steps if s.segment is not None)
    _, specs = seg.arg_specs(list(zip(seg.signature.parameters, (x, w1, w2))))
    compiled = seg.compile(specs)
    assert "tessera.arg_strides = {x = array<i64: 80, 1>}" in compiled.ir("graph")
    assert launcher.plan(compiled).inputs[0].strides == (80, 1)
