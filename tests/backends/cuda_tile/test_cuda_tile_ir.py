"""The cuda_tile model, printer and encoder without NVIDIA's tools."""
import pytest

import cuda_tile_kernels
from tessera.backends.cuda_tile import bytecode, ir, text
from tessera.backends.cuda_tile.ir import (F16, F32, I1, I32, I64, Bounded, DivBy, Module, PartitionViewType,
                                           TensorViewType, ptr, tile)


@pytest.mark.parametrize("x, encoded", [(0, b"\x00"), (1, b"\x01"), (127, b"\x7f"), (128, b"\x80\x01"),
                                        (300, b"\xac\x02"), (1 << 63, b"\x80" * 9 + b"\x01")])
def test_varint(x, encoded):
    assert bytecode.varint(x) == encoded


@pytest.mark.parametrize("x, zigzag", [(0, 0), (-1, 1), (1, 2), (-2, 3), (63, 126), (-64, 127)])
def test_signed_varint_zigzags(x, zigzag):
    assert bytecode.signed_varint(x) == bytecode.varint(zigzag)


def test_int_list_is_count_then_fixed_width():
    assert bytecode.int_list([1, -1], 4) == b"\x02" + b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff"


def test_type_table_predefines_i1_i32_and_interns_children_first():
    ctx = bytecode._Context((13, 1))
    assert ctx.type_index(I1) == 0 and ctx.type_index(I32) == 1
    t = tile(ptr(F32), 4)
    idx = ctx.type_index(t)
    items = list(ctx.types.items)
    f32, p = items.index(bytes([bytecode.SCALAR_TAGS["f32"]])), items.index(b"\x0c" + bytecode.varint(2))
    assert f32 < p < idx
    assert items[idx] == b"\x0d" + bytecode.varint(p) + bytecode.int_list([4], 8)


def test_tensor_view_dynamic_dims_and_partition_padding_by_version():
    tv = TensorViewType(F16, (None, 64), (64, 1))
    pv = PartitionViewType((16, 64), tv, padding="neg_inf")
    old, new = bytecode._Context((13, 1)), bytecode._Context((13, 3))
    assert old._type_bytes(tv).startswith(b"\x0e" + bytecode.varint(old.type_index(F16)))
    assert bytecode.DYNAMIC.to_bytes(8, "little", signed=True) in old._type_bytes(tv)
    assert old._type_bytes(pv).endswith(b"\x01\x04")        # 13.1: has-padding varint, then the value
    assert new._type_bytes(pv)[1:2] == b"\x01" and new._type_bytes(pv).endswith(b"\x04")


def test_schema_table_is_consistent():
    opcodes = [s.opcode for s in ir.SCHEMAS.values()]
    assert len(opcodes) == len(set(opcodes))
    load = ir.SCHEMAS["load_view_tko"]
    assert load.segmented_operands and load.counted_results
    assert [f for f, _ in load.flag_fields()] == ["memory_scope", "optimization_hints", "token"]
    ptr_load = ir.SCHEMAS["load_ptr_tko"]
    assert not ptr_load.counted_results
    assert [f for f, _ in ptr_load.flag_fields()] == ["memory_scope", "optimization_hints", "mask", "paddingValue",
                                                      "token"]
    assert not ir.SCHEMAS["extract"].segmented_operands and ir.SCHEMAS["extract"].counted_results
    assert [f for f, _ in ir.SCHEMAS["maxf"].flag_fields()] == ["propagate_nan", "flush_to_zero"]


def test_header_and_sections():
    data = bytecode.encode(cuda_tile_kernels.elementwise_exp_scale())
    assert data[:8] == b"\x7fTileIR\x00" and data[8:12] == b"\x0d\x01\x00\x00"
    assert data[12] == 0x82              # the function section, aligned
    assert data[-1] == 0                 # end of bytecode
    assert b"exp_scale" in data and b"sm_90" in data and b"num_cta_in_cga" in data


def test_op_encoding_addf():
    m = Module()
    e, b = m.entry("k", [tile(F32)])
    b.addf(e.args[0], e.args[0], rounding="zero", ftz=True)
    ctx = bytecode._Context((13, 1))
    w = bytecode._FunctionWriter(ctx, e)
    # opcode 2, result type, flags (flush_to_zero), rounding "zero", operands 0 and 0
    assert w.op(e.body.ops[0]) == bytes([2, ctx.type_index(tile(F32)), 1, 1, 0, 0])


def test_region_values_are_scoped():
    m = Module()
    e, b = m.entry("k", [tile(I32)])
    n = e.args[0]
    with b.for_(n, n, n, [n]) as loop:
        b.continue_([b.addi(loop.iter_values[0], loop.iv)])
    after = b.addi(loop.results[0], n)
    ctx = bytecode._Context((13, 1))
    w = bytecode._FunctionWriter(ctx, e)
    w.ops(e.body.ops)
    # arg 0; the loop's iv (1), iter value (2) and addi (3) are given back, so the for's result is 1
    assert w.ids[loop.iv.uid] == 1 and w.ids[loop.iter_values[0].uid] == 2
    assert w.ids[loop.results[0].uid] == 1 and w.ids[after.uid] == 2


def test_newer_attribute_is_refused_at_older_version():
    m = Module()
    e, b = m.entry("k", [tile(F32)])
    b.exp(e.args[0], rounding="approx")
    b.return_()
    with pytest.raises(bytecode.EncodeError, match="13.3"):
        bytecode.encode(m, (13, 1))
    assert bytecode.encode(m, (13, 3))


def test_default_hint_target_needs_13_3():
    m = Module()
    e, b = m.entry("k", [tile(F32)], hints={"default": ir.EntryHints(occupancy=2)})
    b.return_()
    with pytest.raises(bytecode.EncodeError, match="default"):
        bytecode.encode(m, (13, 2))
    bytecode.encode(m, (13, 3))


def test_entry_arguments_must_be_scalars():
    with pytest.raises(TypeError, match="0-d tile"):
        Module().entry("k", [TensorViewType(F32, (None,), (1,))])


def test_builder_checks():
    m = Module()
    e, b = m.entry("k", [tile(F32), tile(I32)])
    with pytest.raises(TypeError, match="differ"):
        b.addf(e.args[0], e.args[1])
    with pytest.raises(ValueError, match="not one of"):
        b.cmpf("bigger", e.args[0], e.args[0])
    with pytest.raises(ValueError, match="dynamic"):
        b.make_tensor_view(b.constant(0, tile(I64)), TensorViewType(F32, (None,), (1,)))


def test_printer_text():
    m = Module("demo")
    e, b = m.entry("k", [tile(ptr(F32)), tile(I32)], ["x", "n"])
    x = b.assume(e.args[0], DivBy(16))
    n = b.assume(e.args[1], Bounded(0, None))
    v = b.make_tensor_view(x, TensorViewType(F32, (None,), (1,)), [n])
    p = b.make_partition_view(v, (128,), padding="zero")
    bid, _, _ = b.get_tile_block_id()
    t, _ = b.load_view_tko(p, [bid])
    with b.reduce(t, 0, [float("-inf")]) as r:
        b.yield_([b.maxf(*r.args)])
    b.return_()
    out = text.print_module(m)
    assert out.startswith("cuda_tile.module @demo {\n  entry @k(%x: tile<ptr<f32>>, %n: tile<i32>) {\n")
    for line in ("%0 = assume div_by<16>, %x : tile<ptr<f32>>",
                 "assume bounded<0, ?>, %n : tile<i32>",
                 "%2 = make_tensor_view %0, shape = [%1], strides = [1] : tile<i32> -> "
                 "tensor_view<?xf32, strides=[1]>",
                 "partition_view<tile=(128), padding_value = zero, tensor_view<?xf32, strides=[1]>>",
                 "%tile, %result_token = load_view_tko weak %",
                 "identities=[0xFF800000 : f32] : tile<128xf32> -> tile<f32>",
                 "(%reduce_lhs: tile<f32>, %reduce_rhs: tile<f32>) {",
                 "yield %"):
        assert line in out, line


@pytest.mark.parametrize("value, element, spelled", [(2.0, F32, "2.000000e+00"), (float("-inf"), F32, "0xFF800000"),
                                                     (0.1, F32, "1.000000e-01"), (0.0, F16, "0.000000e+00")])
def test_float_spelling(value, element, spelled):
    assert text.float_str(value, element) == spelled


def test_normalize_renames_definitions_and_floats():
    a = "entry @k(%arg0: tile<f32>) {\n  %c = constant <f16: 9.997550e-02> : tile<f16>\n  %0 = addf %arg0, %arg0 : tile<f32>\n}\n"
    b = "cuda_tile.module @m {\n  entry @k(%x: tile<f32>) {\n    %cst = constant <f16: 9.997559e-02> : tile<f16>\n" \
        "    %y = addf %x,   %x : tile<f32>\n  }\n}\n"
    assert text.normalize(a) == text.normalize(b)


@pytest.mark.parametrize("name", sorted(cuda_tile_kernels.ALL))
def test_kernels_print_and_encode(name):
    module = cuda_tile_kernels.ALL[name]()
    assert text.print_module(module).count("entry @") == 1
    for version in bytecode.SUPPORTED_VERSIONS:
        assert bytecode.encode(module, version)[:8] == bytecode.MAGIC
