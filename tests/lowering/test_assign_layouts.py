"""The assign-layouts pass: every register tile's layout is on the Target IR, and the PTX backend reads it there."""
import pytest
from xdsl.dialects import scf
from xdsl.dialects.builtin import ArrayAttr, UnitAttr

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx import UnsupportedByBackend, emit_module
from tessera.ir import parse_ir, print_ir
from tessera.ir import target as tgt
from tessera.ir import tile
from tessera.ir.layouts import Blocked, Mma, Slice
from tessera.lowering.assign_layouts import is_tile, kernel_layouts
from seed_kernels import flash_attention


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    return tsr.softmax(x, dim=-1)


def target_kernel(fn, dims, arch="sm_90a", dtype="fp16"):
    compiled = fn.compile(fn.arg_specs_for(dims, dtype), arch=arch)
    (kernel,) = [op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp)]
    return compiled.modules["target"], kernel


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_every_register_tile_has_its_layout_on_the_ir(arch):
    """Attention: the accumulators are mma fragments with every warp along M (rows stay in a warp
    for the softmax), the row statistics slices of them; shared tiles have none."""
    _, kernel = target_kernel(flash_attention, dict(B=1, H=2, S=256, D=64), arch)
    layouts = kernel_layouts(kernel)
    values = [v for op in kernel.walk() for v in (*op.results, *[a for r in op.regions for b in r.blocks
                                                                  for a in b.args]) if is_tile(v)]
    assert all(v in layouts or isinstance(v.owner, tile.LoadSharedOp) for v in values)
    acc = next(op for op in kernel.walk() if isinstance(op, tgt.TensorCoreOp)).result
    assert isinstance(layouts[acc], Mma) and layouts[acc].wn == 1
    row_max = next(op for op in kernel.walk() if isinstance(op, tile.ReduceOp)).result
    assert isinstance(layouts[row_max], Slice) and layouts[row_max].keep == 0
    loop = next(op for op in kernel.walk() if isinstance(op, scf.ForOp) and tgt.ARG_LAYOUTS in op.attributes)
    assert isinstance(loop.attributes[tgt.ARG_LAYOUTS].data[0], UnitAttr)   # the induction variable


def test_layouts_print_and_parse_back():
    module, _ = target_kernel(softmax, dict(M=64, N=256), "sm_80")
    text = print_ir(module)
    assert "#tessera_target.blocked<[" in text and "#tessera_target.slice<0, #tessera_target.blocked" in text
    assert print_ir(parse_ir(text)) == text
    for layout in (Blocked((64, 256), 8, 32, 1, 1, 4), Mma((128, 64), 4, 1), Slice(Mma((128, 64), 4, 1), 0)):
        assert tgt.layout_of(tgt.layout_attr(layout)) == layout


def test_the_backend_emits_the_layouts_the_ir_holds():
    """Changing a tile's layout in the IR changes the PTX: the backend reads the decision, it does
    not remake it."""
    module, kernel = target_kernel(softmax, dict(M=64, N=256), "sm_80")
    before = emit_module(module)
    for op in kernel.walk():
        attr = op.attributes.get(tgt.RESULT_LAYOUTS)
        if attr is not None:
            op.attributes[tgt.RESULT_LAYOUTS] = ArrayAttr([_vec2(a) for a in attr.data])
        attr = op.attributes.get(tgt.ARG_LAYOUTS)
        if attr is not None:
            op.attributes[tgt.ARG_LAYOUTS] = ArrayAttr([_vec2(a) for a in attr.data])
    after = emit_module(module)
    assert before.keys() == after.keys() and all(before[k].ptx != after[k].ptx for k in before)
    assert "ld.global.v4" in next(iter(before.values())).ptx
    assert "ld.global.v4" not in next(iter(after.values())).ptx and "ld.global.b32" in next(iter(after.values())).ptx


def _vec2(attr):
    """The same layout with 2 elements a thread along a row instead of 8 (the lanes cover 4x the columns)."""
    if isinstance(attr, UnitAttr):
        return attr
    layout = tgt.layout_of(attr)
    parent = layout.parent if isinstance(layout, Slice) else layout
    narrower = Blocked(parent.shape, 2, parent.tc, parent.tr, parent.wc, parent.wr)
    return tgt.layout_attr(Slice(narrower, layout.keep) if isinstance(layout, Slice) else narrower)


def test_a_kernel_without_layouts_says_why_at_emission():
    """The Target IR of a kernel no layout holds still verifies (its stage succeeds); the PTX backend
    then names what it cannot do."""
    module, kernel = target_kernel(gemm, dict(M=64, K=64, N=64), "sm_80")
    for op in kernel.walk():
        op.attributes.pop(tgt.RESULT_LAYOUTS, None)
        op.attributes.pop(tgt.ARG_LAYOUTS, None)
    module.verify()
    with pytest.raises(UnsupportedByBackend, match="have no layout; run the assign-layouts pass"):
        emit_module(module)


def test_tessera_opt_runs_the_pass_on_target_ir(tmp_path, capsys):
    """`tessera opt FILE --passes=assign-layouts` writes the layouts the target stage writes."""
    from tessera.cli import main
    module, kernel = target_kernel(softmax, dict(M=64, N=256), "sm_80")
    expected = print_ir(module)
    for op in kernel.walk():
        op.attributes.pop(tgt.RESULT_LAYOUTS, None)
        op.attributes.pop(tgt.ARG_LAYOUTS, None)
    path = tmp_path / "target.mlir"
    path.write_text(print_ir(module))
    assert "tessera_target.layouts" not in path.read_text()
    assert main(["opt", str(path), "--passes=assign-layouts"]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
