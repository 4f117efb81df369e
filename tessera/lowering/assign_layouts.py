"""The `assign-layouts` pass: every register tile of a Target IR kernel gets its layout.

A layout (`tessera.ir.layouts`) says which thread holds which elements of a tile.
Rank-2 tiles share one `Blocked` layout chosen from the kernel's tile shape and
warp count, or, in a kernel with tensor-core ops, an `Mma` layout per shape (the
accumulators'); rank-1 tiles are `Slice`s of it, along the dim their reductions and
broadcasts say, spread through elementwise ops and loops. The result is written on
the IR (`tessera_target.layouts` on each op that makes tiles, `tessera_target.arg_layouts` on each
scf.for), where `--dump-ir=target` shows it and the PTX backend reads it.
"""
from __future__ import annotations

from xdsl.dialects import scf
from xdsl.dialects.builtin import ArrayAttr, MemRefType, TensorType, UnitAttr
from xdsl.ir import SSAValue

from ..errors import TesseraError
from ..ir import target as tgt
from ..ir import tile as t
from ..ir.layouts import Blocked, Layout, Mma, Slice
from .byte_fragments import byte_a_shapes


class UnsupportedLayout(TesseraError):
    """A kernel whose tiles no register layout here can hold (it has no PTX yet)."""


def is_tile(v: SSAValue) -> bool:
    """A distributed register tile; rank-0 tensors are uniform per program, held like scalars."""
    return isinstance(v.type, TensorType) and v.type.get_num_dims() > 0


def _held(v: SSAValue) -> bool:
    """A tile held in registers: all but a shared stage only mmas read (`LoadSharedOp.into_registers`)."""
    return not isinstance(v.owner, t.LoadSharedOp) or v.owner.into_registers


def _tensor_values(kernel) -> list[SSAValue]:
    out = []
    for op in kernel.walk():
        for v in (*op.results, *[a for r in op.regions for b in r.blocks for a in b.args]):
            if is_tile(v):
                out.append(v)
    return out


def _in_registers(v: SSAValue) -> bool:
    """A register tile computed in the kernel, not one read from shared memory for an mma."""
    return is_tile(v) and not isinstance(v.owner, t.LoadSharedOp)


def _mma_warps(kernel, num_warps: int, shapes2) -> tuple[int, int]:
    """Warp grid for accumulator tiles: all warps along M when rows are reduced
    (attention's softmax keeps each row inside one warp), when wgmma computes
    them (warp w of a warpgroup holds rows 16w..16w+15 of its 64), or when an mma
    takes a tile computed in registers as its A operand (a warp repacks its own
    accumulator rows: attention's P @ V, a flash_chain's dS @ K), else as square as fits."""
    whole_rows = any(isinstance(op, t.ReduceOp) or (isinstance(op, tgt.TensorCoreOp) and (
        op.family.data == "wgmma" or _in_registers(op.a))) for op in kernel.walk())
    options = [(num_warps // wn, wn) for wn in (1, 2, 4, 8, 16) if wn <= num_warps]
    if not whole_rows:
        options.sort(key=lambda w: abs(w[0] - w[1]))
    for wm, wn in options:
        if whole_rows and wn != 1:
            continue
        if all(Mma.fits(shape, wm, wn) for shape in shapes2):
            return wm, wn
    raise UnsupportedLayout(f"{num_warps} warps cannot tile {sorted(shapes2)} with mma.sync "
                               f"fragments; not supported yet")


def assign_layouts(kernel, num_warps: int) -> dict[SSAValue, Layout]:
    """Every register tile's layout (see the module docstring).

    Kernels with tensor-core ops put every rank-2 tile in accumulator (`Mma`) layout, in 8-bit
    A order where a product computes it over permuted keys (`byte_fragments.byte_a_shapes`);
    others use one `Blocked` layout. Rank-1 tiles become `Slice`s of the layout their
    reductions and broadcasts touch, spread through elementwise ops and loops.
    """
    values = [v for v in _tensor_values(kernel) if _held(v)]
    shapes2 = {tuple(v.type.get_shape()) for v in values if v.type.get_num_dims() == 2}
    shapes1 = {tuple(v.type.get_shape()) for v in values if v.type.get_num_dims() == 1}
    if any(v.type.get_num_dims() > 2 for v in values):
        raise UnsupportedLayout("tiles of rank above 2 are not supported yet")
    if any(isinstance(op, tgt.TensorCoreOp) for op in kernel.walk()):
        wm, wn = _mma_warps(kernel, num_warps, shapes2)
        permuted = byte_a_shapes(kernel)
        rank2 = {shape: Mma(shape, wm, wn, byte_a=shape in permuted) for shape in shapes2}
    elif len(shapes2) == 1:
        rank2 = {next(iter(shapes2)): Blocked.choose(next(iter(shapes2)), num_warps, _vector_width(kernel))}
    elif not shapes2 and len(shapes1) == 1:
        rank2 = {}
        only = Blocked.choose((1, next(iter(shapes1))[0]), num_warps, _vector_width(kernel))
    else:
        raise UnsupportedLayout(f"kernels with several 2-D tile shapes ({sorted(shapes2)}) "
                                   f"are not supported yet")
    layouts: dict[SSAValue, Layout] = {v: rank2[tuple(v.type.get_shape())] for v in values
                                       if v.type.get_num_dims() == 2}
    slices: dict[SSAValue, Slice] = {}
    for op in kernel.walk():
        if isinstance(op, t.ReduceOp) and op.x in layouts:
            slices[op.result] = Slice(layouts[op.x], 1 - op.axis.value.data)
        if isinstance(op, t.BroadcastOp) and is_tile(op.x) and op.result in layouts:  # (not 1-D to 1-D)
            (d,) = t.int_values(op.dims)
            slices[op.x] = Slice(layouts[op.result], d)
    _propagate(kernel, slices)
    for v in values:
        if v.type.get_num_dims() == 1:
            if v in slices:
                layouts[v] = slices[v]
            elif rank2:
                raise UnsupportedLayout("a 1-D tile that is neither reduced nor broadcast")
            else:
                layouts[v] = Slice(only, 1)
    return layouts


def _vector_width(kernel) -> int:
    """Elements per thread along a row: one 16-byte access of the narrowest element the kernel moves."""
    sizes = [max(1, a.type.get_element_type().bitwidth // 8) for a in kernel.body.block.args
             if isinstance(a.type, MemRefType)]
    return 16 // min(sizes, default=4)


def _propagate(kernel, keep: dict[SSAValue, Slice]) -> None:
    """Spreads rank-1 slice layouts through elementwise ops and loop-carried values until stable."""
    links: list[tuple[SSAValue, SSAValue]] = []
    for op in kernel.walk():
        tensors = [v for v in (*op.operands, *op.results) if is_tile(v)
                   and v.type.get_num_dims() == 1]
        if isinstance(op, (t.ReduceOp, t.BroadcastOp, t.LoadOp, t.StoreOp)):
            continue
        links.extend(zip(tensors, tensors[1:]))
        if isinstance(op, scf.ForOp):
            body = op.body.block
            for init, arg, res, yv in zip(op.iter_args, body.args[1:], op.results, body.last_op.operands):
                links.extend([(init, arg), (arg, res), (res, yv)])
        if isinstance(op, scf.IfOp):
            for region in op.regions:
                if region.blocks:
                    links.extend(zip(op.results, region.block.last_op.operands))
    changed = True
    while changed:
        changed = False
        for a, b in links:
            for x, y in ((a, b), (b, a)):
                if x in keep and y not in keep:
                    keep[y] = keep[x]
                    changed = True
                elif x in keep and y in keep and keep[x] != keep[y]:
                    raise UnsupportedLayout("a 1-D tile is used both as a row and a column vector")


def computing_warps(kernel: tgt.KernelOp) -> int:
    """The warps that hold tiles: all of the block's but a warp-specialized kernel's producers."""
    producers = kernel.producer_warps.value.data if kernel.producer_warps else 0
    return kernel.config.threads // 32 - producers


def annotate_layouts(kernel, num_warps: int | None = None) -> dict[SSAValue, Layout] | None:
    """The pass: writes every tile value's layout on the op or loop that makes it, for `num_warps`
    warps holding tiles (by default a Target IR kernel's `computing_warps`), and returns them. A
    kernel no layout can hold is left without them (`kernel_layouts` then says why): None."""
    try:
        layouts = assign_layouts(kernel, computing_warps(kernel) if num_warps is None else num_warps)
    except UnsupportedLayout:
        return None
    unit = UnitAttr()
    for op in kernel.walk():
        if any(is_tile(r) for r in op.results):
            op.attributes[tgt.RESULT_LAYOUTS] = ArrayAttr([tgt.layout_attr(layouts[r]) if r in layouts else unit
                                                    for r in op.results])
        if isinstance(op, scf.ForOp) and any(is_tile(a) for a in op.body.block.args):
            op.attributes[tgt.ARG_LAYOUTS] = ArrayAttr([tgt.layout_attr(layouts[a]) if a in layouts else unit
                                                        for a in op.body.block.args])
    return layouts


def kernel_layouts(kernel: tgt.KernelOp) -> dict[SSAValue, Layout]:
    """The layouts the pass wrote, per tile value; raises `UnsupportedLayout` with the reason where
    it wrote none."""
    out: dict[SSAValue, Layout] = {}
    for op in kernel.walk():
        if tgt.RESULT_LAYOUTS in op.attributes:
            for r, a in zip(op.results, op.attributes[tgt.RESULT_LAYOUTS].data):
                if not isinstance(a, UnitAttr):
                    out[r] = tgt.layout_of(a)
        if tgt.ARG_LAYOUTS in op.attributes:
            for arg, a in zip(op.body.block.args, op.attributes[tgt.ARG_LAYOUTS].data):
                if not isinstance(a, UnitAttr):
                    out[arg] = tgt.layout_of(a)
    missing = [v for v in _tensor_values(kernel) if v not in out and _held(v)]
    if missing:
        assign_layouts(kernel, computing_warps(kernel))   # raises the reason
        raise UnsupportedLayout(f"{len(missing)} tile values of kernel {kernel.sym_name.data} have no layout; "
                                f"run the assign-layouts pass")
    return out
