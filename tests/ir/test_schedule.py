"""Schedule IR as text: print -> parse -> print is the identity, a parsed schedule lowers to the
same tile program, and the verifier rejects hand-edited kernels with clear messages."""
import re

import numpy as np
import pytest
from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException

import tessera as tsr
from tessera import Tensor
from tessera.interpreter.tile_interp import TileProgram, np_dtype, poison
from tessera.ir import parse_ir, print_ir
from tessera.lowering.schedule_to_tile import lower_schedule_to_tile
from tessera.passes.fusion import fuse

from seed_kernels import causal_attention, flash_attention

IR_ERRORS = (VerifyException, DiagnosticException, ParseError)


@tsr.function
def transformer_mlp(x: Tensor["T", "E"], w1: Tensor["E", "F"], b1: Tensor["F"], w2: Tensor["F", "E"],
                    g: Tensor["E"]):
    h = tsr.gelu(x @ w1 + b1)
    return tsr.layer_norm(h @ w2 + x, x.shape[-1], g), tsr.amax(h, dim=-1, keepdim=True)


@tsr.function
def elementwise_and_reductions(x: Tensor["M", "N"], y: Tensor["N"]):
    z = tsr.exp(x - y) * 0.5
    return tsr.softmax(z, dim=0), tsr.sum(z, dim=-1), tsr.where(x > y, z, -z).to(tsr.fp16), x.T * 1.0


DIMS = {"B": 2, "H": 2, "S": 40, "D": 64, "T": 9, "E": 16, "F": 24, "M": 5, "N": 70}
FUNCTIONS = [flash_attention, causal_attention, transformer_mlp, elementwise_and_reductions]


def schedule_module(fn, dtype="fp16"):
    return fuse(fn.trace(fn.arg_specs_for(DIMS, dtype)))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.name)
def test_round_trip_is_identity(fn, dtype):
    module = schedule_module(fn, dtype)
    module.verify()
    text = print_ir(module)
    parsed = parse_ir(text)
    parsed.verify()
    assert print_ir(parsed) == text
    assert print_ir(parse_ir(print_ir(parsed))) == text


def test_kernel_text_shows_kind_params_and_space():
    text = print_ir(schedule_module(flash_attention))
    assert text.count("schedule.kernel") == 1
    assert '"flash_attention"' in text and "schedule.yield" in text
    for key in ("block_m", "block_n", "num_warps", "num_stages"):
        assert key in text


def run_tile_module(tile_module, name, arrays):
    host = next(op for op in tile_module.ops if op.name == "func.func")
    out_types = host.function_type.inputs.data[len(arrays):]
    outs = [poison(t.get_shape(), np_dtype(t)) for t in out_types]
    TileProgram(tile_module).run(name, *arrays, *outs)
    return outs


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.name)
def test_parsed_schedule_lowers_to_the_same_tile_program(fn, random_inputs):
    module = schedule_module(fn, "fp32")
    tile_direct = lower_schedule_to_tile(module)
    tile_parsed = lower_schedule_to_tile(parse_ir(print_ir(module)))
    assert print_ir(tile_parsed) == print_ir(tile_direct)
    arrays = random_inputs(fn.arg_specs_for(DIMS, "fp32"), seed=5)
    compiled = fn.compile(fn.arg_specs_for(DIMS, "fp32"))
    for out, ref in zip(run_tile_module(tile_parsed, fn.name, arrays), compiled.reference(*arrays)):
        assert not np.isnan(out.astype(np.float64)).any()
        np.testing.assert_allclose(out.astype(np.float64), ref.astype(np.float64), rtol=1e-4, atol=1e-4)


# --- the verifier, on hand-edited text ---------------------------------------------------------------------

@tsr.function
def add(x: Tensor["M", "N"], y: Tensor["M", 1]):
    return x + y


def add_schedule_text() -> str:
    return print_ir(fuse(add.trace(add.arg_specs_for({"M": 3, "N": 5}, "fp32"))))


def verify_text(text: str):
    module = parse_ir(text)
    module.verify()
    return module


def test_unedited_text_verifies():
    verify_text(add_schedule_text())
    verify_text(print_ir(schedule_module(causal_attention)))


def test_unknown_kernel_kind():
    text = add_schedule_text()
    assert text.count('"elementwise"') == 1
    with pytest.raises(IR_ERRORS, match=r"schedule\.kernel add_elementwise_0: unknown kind 'elementwize'; "
                                        r"expected one of \['column_reduction', 'elementwise', 'flash_attention', "
                                        r"'flash_chain', 'gemm', 'row_reduction'\]"):
        verify_text(text.replace('"elementwise"', '"elementwize"'))


def test_unknown_kind_in_a_flash_attention_module():
    text = print_ir(schedule_module(flash_attention))
    with pytest.raises(IR_ERRORS, match=r"unknown kind 'flash_attn'"):
        verify_text(text.replace('"flash_attention"', '"flash_attn"'))


def test_kernel_not_ending_in_yield():
    text = re.sub(r"\n *\"?schedule\.yield\"?[^\n]*", "", add_schedule_text())
    assert "schedule.yield" not in text
    with pytest.raises(IR_ERRORS) as info:
        verify_text(text)
    # xDSL's region check fires first: it names the op left without a terminator.
    assert re.search(r"graph\.add terminates block .* not a terminator", str(info.value)), \
        str(info.value).splitlines()[0]


@pytest.mark.parametrize("value", [12, 48, 100])
def test_block_size_not_a_power_of_two(value):
    text = add_schedule_text()
    edited = re.sub(r"(params = \{block_m = (?:#builtin\.int<)?)16", rf"\g<1>{value}", text, count=1)
    assert edited != text
    with pytest.raises(IR_ERRORS, match=rf"schedule\.kernel add_elementwise_0: block_m={value} is not a power of two"):
        verify_text(edited)


def test_block_size_must_be_positive():
    text = add_schedule_text()
    edited = re.sub(r"(params = \{block_m = (?:#builtin\.int<)?)16", r"\g<1>0", text, count=1)
    with pytest.raises(IR_ERRORS, match=r"param block_m must be a positive int"):
        verify_text(edited)


def test_yield_type_must_match_the_kernel_result():
    text = add_schedule_text()
    # The kernel now claims an f16 result (and the function returns it), but its region yields f32.
    text = re.sub(r"(\) -> )!graph\.tensor<\[M, N\], f32>( \{)", r"\1!graph.tensor<[M, N], f16>\2", text)
    text = re.sub(r"(func\.return\b[^\n]*)f32>", r"\1f16>", text)
    text = text.replace(") -> !graph.tensor<[M, N], f32> attributes", ") -> !graph.tensor<[M, N], f16> attributes")
    with pytest.raises(IR_ERRORS, match=r"yielded types do not match its results"):
        verify_text(text)


@pytest.mark.parametrize("params,rows,columns,width,fits", [
    ({"block_m": 128, "block_n": 64, "num_warps": 8}, 4096, 4096, 128, True),    # [128 dQ cols, 64] on 8 warps
    ({"block_m": 128, "block_n": 64, "num_warps": 8}, 4096, 4096, 96, True),     # 96 padded to 128
    ({"block_m": 128, "block_n": 64, "num_warps": 4}, 4096, 4096, 128, True),    # 64 queries on 4 warps
    ({"block_m": 128, "block_n": 32, "num_warps": 4}, 4096, 4096, 128, False),
    ({"block_m": 32, "block_n": 64, "num_warps": 8}, 4096, 4096, 128, False),    # 32 keys: 2 warps
    ({"block_m": 128, "block_n": 64, "num_warps": 8}, 40, 4096, 128, True),      # 64-key tile: 4 warps, 64 queries
    ({"block_m": 128, "block_n": 64, "num_warps": 8}, 20, 4096, 128, False),     # 32-key tile: 2 warps
])
def test_an_across_sum_needs_a_side_of_16_rows_a_warp(params, rows, columns, width, fits):
    from tessera.ir import schedule as s
    assert s.across_fits(params, rows, columns, width) is fits
    assert s.across_transposed(64, 128, 8) is True and s.across_transposed(64, 128, 4) is False
    assert s.across_transposed(32, 128, 4) is None


@pytest.mark.parametrize("params, n, split", [
    ({"block_n": 8192, "cluster": 8}, 8192, 1), ({"block_n": 8192, "cluster": 8}, 8193, 2),
    ({"block_n": 8192, "cluster": 8}, 20000, 3), ({"block_n": 8192, "cluster": 8}, 100000, 8),
    ({"block_n": 8192, "cluster": 1}, 100000, 1), ({"block_n": 64}, 1000, 1),
])
def test_a_row_splits_across_as_many_blocks_of_a_cluster_as_have_a_chunk(params, n, split):
    from tessera.ir.schedule import row_split
    assert row_split(params, n) == split


@pytest.mark.parametrize("bytes_, n, stages, staged", [(2, 32768, 2, 131072), (4, 32768, 1, 0), (2, 20000, 2, 131072),
                                                       (4, 20000, 1, 0), (2, 65536, 1, 0)])
def test_a_row_walk_stages_its_rows_only_where_they_fit(bytes_, n, stages, staged):
    """A layer_norm over rows of 16385-32768 walks them two stages deep (schedule.SHAPE_DEFAULTS),
    a 32768-element chunk a stage, 64 KB in bf16; in fp32 two such stages would pass sm_90a's 227 KB,
    so it takes one (no walk). Longer rows are two chunks and stage nothing."""
    from tessera.ir.schedule import default_params, shared_bytes
    features = {"norm": 1, "layer_norm": 1, "row_elements": n, "rows": 4096, "staged_row_bytes": bytes_}
    params = default_params("row_reduction", features, max_shared=232448)
    assert params["num_stages"] == stages
    assert shared_bytes("row_reduction", params, features) == staged
