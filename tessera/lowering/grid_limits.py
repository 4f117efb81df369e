"""Grids past CUDA's limits: a kernel whose grid axis 1 or 2 may exceed 65,535 programs runs on a
grid of one axis instead, and finds its three coordinates from that one.

Templates lay their programs out as the work is shaped (an elementwise kernel's batch along grid
axis 2, a tall matrix's row blocks along axis 1); CUDA launches at most 65,535 blocks along axes 1
and 2 (2^31 - 1 along axis 0), and a launch past that fails (CUDA_ERROR_INVALID_VALUE: a
[131072, 8, 4, 128] transpose asks for 131,072 along axis 2). `fit_grid` rewrites such a kernel
in Tile IR, where a dump shows it: each `tile.program_id` becomes the linear program index's
quotient and remainder by the other axes' extents (x fastest, as CUDA orders a grid's blocks),
and the launch's grid is their product along axis 0. A dim taken at run time on axis 1 or 2 may
exceed the limit at any call, so such a grid is linearised too.
"""
from __future__ import annotations

from xdsl.dialects import arith
from xdsl.dialects.builtin import IndexType, IntegerAttr
from xdsl.ir import Block, SSAValue

from ..errors import TesseraError
from ..ir import tile as t

#: the most blocks a launch may have along grid axes 0, 1 and 2 (CUDA's maxGridDim on sm_70+)
MAX_GRID = (2 ** 31 - 1, 65535, 65535)


def fit_grid(kernel: t.KernelOp, grid: tuple) -> tuple:
    """`grid` (ints or `t.GridDim`s) as launched: unchanged where it fits CUDA's limits, else
    (linear extent, 1, 1) with `kernel` rewritten to decompose its program index."""
    if all(isinstance(g, int) and g <= most for g, most in zip(grid[1:], MAX_GRID[1:])):
        return grid
    dynamic = [g for g in grid if isinstance(g, t.GridDim)]
    if len(dynamic) > 1:
        raise TesseraError(f"kernel {kernel.sym_name.data}: a grid of several dims taken at run time "
                           f"({len(dynamic)}) cannot be laid along one axis yet; mark one of them static")
    constant = 1
    for g in grid:
        constant *= g.factor if isinstance(g, t.GridDim) else g
    if not dynamic and constant > MAX_GRID[0]:
        raise TesseraError(f"kernel {kernel.sym_name.data} needs {constant} programs, more than a launch can "
                           f"have ({MAX_GRID[0]}); its tensors are too large for one launch")
    _decompose_program_ids(kernel, grid)
    linear = t.GridDim(dynamic[0].arg, dynamic[0].dim, dynamic[0].block, constant) if dynamic else constant
    return linear, 1, 1


def _decompose_program_ids(kernel: t.KernelOp, grid: tuple) -> None:
    """Replaces every `tile.program_id` of `kernel` by its coordinate of the linear index along
    axis 0: x = i % X, y = (i / X) % Y, z = i / (X * Y); where Z is 1, y = i / X (no division
    by Y, which for an axis growing with a dynamic dim would be a division by a run-time value)."""
    block: Block = kernel.body.block
    first = block.first_op
    new: list = []

    def add(op):
        new.append(op)
        return op.results[0]

    def index(value: int) -> SSAValue:
        return add(arith.ConstantOp(IntegerAttr(value, IndexType())))

    def extent(g) -> SSAValue:   # a grid axis's programs: cdiv(dim, block) * factor for a dim taken at run time
        if isinstance(g, int):
            return index(g)
        padded = add(arith.AddiOp(add(t.DimOp(block.args[g.arg], g.dim)), index(g.block - 1)))
        return add(arith.MuliOp(add(arith.DivSIOp(padded, index(g.block))), index(g.factor)))
    linear = add(t.ProgramIdOp(0))
    x_extent = extent(grid[0])
    above_x = add(arith.DivSIOp(linear, x_extent))
    if grid[2] == 1:
        coordinates = [add(arith.RemSIOp(linear, x_extent)), above_x, index(0)]
    else:
        y_extent = extent(grid[1])
        coordinates = [add(arith.RemSIOp(linear, x_extent)), add(arith.RemSIOp(above_x, y_extent)),
                       add(arith.DivSIOp(above_x, y_extent))]
    for op in new:
        block.insert_op_before(op, first)
    for op in list(kernel.walk()):
        if isinstance(op, t.ProgramIdOp) and op is not linear.owner:
            op.result.replace_all_uses_with(coordinates[op.axis.value.data])
            op.detach()
            op.erase()
