"""Which key copies load permuted (`lowering.byte_fragments`): fp8 attention's keys, where the
scores' tile is theirs alone, the copies whole 16-aligned TMA boxes of one run of rows and the
warpgroups take no turns; the layout pass then holds the scores in `Mma.byte_a` order."""
import ml_dtypes
import numpy as np
import pytest

from fp8_attention import causal_fp8_attention, fp8_attention, fp8_attention_vt
from tessera.ir import target as tgt
from tessera.ir.layouts import Mma
from tessera.lowering.assign_layouts import kernel_layouts

F8 = ml_dtypes.float8_e4m3fn


def compile_fp8(fn, b, h, s, n, d, k=None, space=None):
    q = np.zeros((b, h, s, d), F8)
    k = np.zeros((b, h, n, d), F8) if k is None else k
    v = np.zeros((b, h, d, n), F8) if fn is fp8_attention_vt else np.zeros((b, h, n, d), F8)
    scale = np.ones(1, np.float32)
    _, specs = fn.arg_specs(list(zip(fn.signature.parameters, [q, k, v, scale, scale, scale])))
    return fn.compile(specs, arch="sm_90a", sm_count=132, **({"space": space} if space else {}))


def attention_kernel(compiled) -> tgt.KernelOp:
    """The kernel computing the scores (of a split-KV schedule, its partials)."""
    (kernel,) = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)
                 and any(isinstance(inner, tgt.TensorCoreOp) for inner in op.walk())]
    return kernel


def permuted_maps(kernel) -> list[tgt.TensorMapOp]:
    return [op for op in kernel.walk() if isinstance(op, tgt.TensorMapOp) and op.byte_a_rows is not None]


@pytest.mark.parametrize("fn,b,h,s,n,d", [(causal_fp8_attention, 2, 2, 512, 512, 64),
                                          (causal_fp8_attention, 8, 16, 4096, 4096, 128),
                                          (causal_fp8_attention, 1, 1, 300, 272, 64)])
def test_causal_fp8_attention_reads_its_keys_permuted(fn, b, h, s, n, d):
    """K's map (and only K's) reads its rows permuted; the scores' tile, and the probabilities, are
    in byte_a order; the PTX moves them into the second product without a shuffle."""
    compiled = compile_fp8(fn, b, h, s, n, d)
    kernel = attention_kernel(compiled)
    (kmap,) = permuted_maps(kernel)
    assert kmap.tensor.index == 1   # (k)
    shape = kmap.result.type.shape_dims
    assert shape == (b * h * n // 16, 2, 4, 2, d)
    layouts = kernel_layouts(kernel)
    scores = [op for op in kernel.walk() if isinstance(op, tgt.TensorCoreOp) and op.result.type.get_shape()[1] != d]
    assert scores and all(layouts[op.result].byte_a for op in scores)
    outputs = [op for op in kernel.walk() if isinstance(op, tgt.TensorCoreOp) and op.result.type.get_shape()[1] == d]
    assert outputs and not any(layouts[op.result].byte_a for op in outputs)
    (ptx,) = [p.ptx for name, p in compiled.stage("ptx").items() if name == kernel.sym_name.data]
    assert "shfl.sync.idx" not in ptx and "cp.async.bulk.tensor.5d" in ptx


def test_warpgroups_taking_turns_keep_the_exchanges():
    """Measured slower with turns (the module docstring): the non-causal default takes them."""
    compiled = compile_fp8(fp8_attention_vt, 8, 16, 4096, 4096, 128)
    kernel = attention_kernel(compiled)
    assert any(isinstance(op, tgt.WarpgroupTurnOp) for op in kernel.walk())
    assert not permuted_maps(kernel)
    assert not any(isinstance(layout, Mma) and layout.byte_a for layout in kernel_layouts(kernel).values())


@pytest.mark.parametrize("case", ["keys not a multiple of 16", "scores shaped like the output",
                                  "keys not one run of rows"])
def test_keys_stay_in_order_where_a_piece_is_missing(case):
    """Keys not a multiple of 16 (a 16-row group would straddle heads); a [128, 128] score tile over
    D = 128 (the output's tile has its shape, so its layout); K strided as models lay it out
    ([B, N, H, D] viewed as [B, H, N, D]: its rows are no single run, which five box dims cannot
    read). Each compiles with the exchanges, unpermuted."""
    if case == "keys not a multiple of 16":
        compiled = compile_fp8(causal_fp8_attention, 2, 2, 500, 1000, 64)
    elif case == "scores shaped like the output":
        compiled = compile_fp8(causal_fp8_attention, 4, 16, 1024, 1024, 128)
        assert "block_n = 128" in compiled.ir("schedule")
    else:
        k = np.zeros((2, 512, 2, 64), F8).transpose(0, 2, 1, 3)
        compiled = compile_fp8(causal_fp8_attention, 2, 2, 512, 512, 64, k=k)
    kernel = attention_kernel(compiled)
    assert not permuted_maps(kernel)
    assert "shfl.sync.idx" in compiled.stage("ptx")[kernel.sym_name.data].ptx


def test_bf16_attention_is_untouched():
    """No 8-bit product reads the probabilities: nothing is permuted."""
    compiled = fp8_attention.compile(fp8_attention.arg_specs_for(dict(B=2, H=2, S=512, N=512, D=64), "fp8_e4m3"),
                                     arch="sm_80")
    assert "byte_a" not in compiled.ir("target")
