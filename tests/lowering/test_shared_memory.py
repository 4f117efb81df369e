"""The shared-memory allocation pass: every shared byte a kernel uses is placed in Target IR, the
scratch of reductions and staged stores included, and the PTX backend follows what it wrote."""
import re

import pytest

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import emit_module
from tessera.ir import target as tgt
from tessera.ir import tile
from tessera.lowering.assign_layouts import kernel_layouts
from tessera.lowering.shared_memory import Staging


@tsr.function
def softmax(x: Tensor["R", "C"]):
    return tsr.softmax(x, dim=-1)


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def target_of(fn, dims, dtype="fp16", **options):
    return fn.compile(fn.arg_specs_for(dims, dtype), arch="sm_90a", **options).modules["target"]


def kernels(module):
    return [op for op in module.ops if isinstance(op, tgt.KernelOp)]


def claims(kernel) -> list[tuple[int, int]]:
    """(offset, bytes) of every placed claim on the kernel's shared memory."""
    out = []
    for op in kernel.walk():
        if isinstance(op, tgt.AllocateOp) and op.offset is not None:
            out.append((op.offset.value.data, op.size.value.data))
        elif isinstance(op, tgt.MBarrierAllocOp):
            out.append((op.offset.value.data, 8 * op.result.type.count.data))
        if tgt.SCRATCH in op.attributes:
            s = op.attributes[tgt.SCRATCH]
            out.append((s.offset.data, s.size.data))
    return sorted(out)


@pytest.mark.parametrize("fn,dims,path", [(softmax, dict(R=100, C=4096), "native"),
                                          (softmax, dict(R=7, C=1000), "ampere"),
                                          (gemm, dict(M=512, K=256, N=512), "native"),
                                          (gemm, dict(M=300, K=200, N=1000), "ampere")])
def test_claims_do_not_overlap_and_the_config_holds_their_end(fn, dims, path):
    for kernel in kernels(target_of(fn, dims, path=path)):
        placed = claims(kernel)
        for (a, size), (b, _) in zip(placed, placed[1:]):
            assert a + size <= b
        assert kernel.config.shared.data == (placed[-1][0] + placed[-1][1] if placed else 0)


def test_a_row_reduction_across_warps_gets_scratch_for_each_warps_partials():
    (kernel,) = kernels(target_of(softmax, dict(R=100, C=4096)))
    layouts = kernel_layouts(kernel)
    reduces = [op for op in kernel.walk() if isinstance(op, tile.ReduceOp)]
    assert len(reduces) == 2    # the row max, then the row sum
    for op in reduces:
        src = layouts[op.x]
        assert src.warps_along(1) > 1
        assert op.attributes[tgt.SCRATCH].size.data == 4 * src.cover[0] * src.reps[0] * src.wc
    (ptx,) = emit_module(kernel.parent_op()).values()
    assert not re.search(r"^\s+\.shared", ptx.ptx, re.M)      # no shared array the IR does not show
    assert ptx.dynamic_shared == kernel.config.shared.data


def test_the_backend_follows_the_staging_written_in_the_ir():
    """The same kernel with its store's staging removed from the IR stores fragments directly."""
    module = target_of(gemm, dict(M=512, K=256, N=512))
    (store,) = [op for op in module.walk() if tgt.STAGING in op.attributes]
    staging = store.attributes[tgt.STAGING]
    assert Staging.of_attr(staging, 2) == Staging.of(2, staging.cols.data)
    (staged,) = emit_module(module).values()
    del store.attributes[tgt.STAGING]
    (direct,) = emit_module(module).values()
    assert "staged store" in staged.ptx and "st.shared" in staged.ptx
    assert "staged store" not in direct.ptx and "st.shared" not in direct.ptx


def test_a_reduction_without_its_scratch_is_refused_not_miscompiled():
    module = target_of(softmax, dict(R=100, C=4096))
    for op in module.walk():
        op.attributes.pop(tgt.SCRATCH, None)
    with pytest.raises(Exception, match="needs .* bytes of tessera_target.scratch"):
        emit_module(module)


def test_scratch_and_staging_print_and_parse_back():
    module = target_of(gemm, dict(M=512, K=256, N=512))
    text = tgt.print_module(module)
    assert re.search(r"#tessera_target.staging<cols = 64, pitch = 144>", text)
    assert re.search(r"#tessera_target.scratch<offset = \d+, size = \d+>", text)
    assert tgt.print_module(tgt.parse_target_module(text)) == text
