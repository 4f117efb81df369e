"""Graph IR -> Graph IR, before fusion: an 8-bit attention reads V from a transposed copy.

8-bit tensor cores (fp8 mma.sync m16n8k32, wgmma m64nNk32) read both operands K-contiguous: neither
ldmatrix nor wgmma transposes 8-bit elements. Attention's P @ V contracts over the keys, and V as
models store it ([..., N, D]) has the head dim contiguous, so an fp8 attention's P @ V has no
matrix instruction as written. A user may pass V transposed (`p @ vt.transpose(-2, -1)` with
`vt` [..., D, N]); otherwise this pass has the kernel read it so: `v` becomes
`transpose(transpose(v) {tessera.layout_copy})`, and fusion gives the tagged transpose a kernel of
its own that writes V^T to memory (one read and one write of V, 2-5% of an fp8 attention at
8x16x4096x128; FlashAttention-3 transposes V tiles in shared memory instead, not done yet). The
copy is in the Graph and Schedule IR dumps as that transpose and its kernel.

Only attention's P @ V is rewritten: its A operand (the probabilities cast to 8 bits) is computed
in the kernel, so no layout of the user's can make it K-contiguous. A GEMM of two 8-bit tensors
in memory keeps the clear error asking for `a @ b.T` (a weight is stored once; a copy per call
would hide a cost the user can remove).
"""
from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, UnitAttr
from xdsl.ir import SSAValue

from ..ir import graph as g

#: the attribute of a transpose that fusion writes to memory in a kernel of its own (not a view
#: that its reader's loads take): a layout an operand must have in memory
LAYOUT_COPY = "tessera.layout_copy"


def is_layout_copy(op) -> bool:
    return isinstance(op, g.TransposeOp) and LAYOUT_COPY in op.attributes


def transpose_byte_values(module: ModuleOp) -> ModuleOp:
    """`module` with each 8-bit attention's V read through a transposed copy (module doc): a copy
    of the module where one is found, else `module` itself (which is never changed)."""
    if not any(_byte_attention_values(f) for f in g.functions(module)):
        return module
    module = module.clone()
    for f in g.functions(module):
        transposed: dict[SSAValue, SSAValue] = {}   # V -> its copy transposed back (one copy per V)
        for mm in _byte_attention_values(f):
            if mm.rhs not in transposed:
                transposed[mm.rhs] = _transposed_copy(mm)
            mm.operands[1] = transposed[mm.rhs]
    return module


def _byte_attention_values(f: func.FuncOp) -> list[g.MatmulOp]:
    """The P @ V matmuls of `f` whose operands are 8-bit, P a softmax's probabilities (through
    casts) and V not already the transpose of a K-contiguous tensor."""
    return [op for op in f.body.block.ops if isinstance(op, g.MatmulOp)
            and g.tensor_type(op.lhs).dtype.bits == 8 and g.tensor_type(op.rhs).dtype.bits == 8
            and _probabilities(op.lhs) and not g.swaps_last_dims(op.rhs)]


def _probabilities(v: SSAValue) -> bool:
    op = v.owner
    while isinstance(op, g.CastOp):
        op = op.input.owner
    return isinstance(op, g.SoftmaxOp)


def _transposed_copy(mm: g.MatmulOp) -> SSAValue:
    """`transpose(transpose(v) {layout_copy})` of `mm`'s V, inserted before `mm`."""
    v = mm.rhs
    src = g.tensor_type(v)
    perm = (*range(src.rank - 2), src.rank - 1, src.rank - 2)
    swapped = g.TensorType.of([src.shape[p] for p in perm], src.dtype)
    copy = g.TransposeOp(v, perm, swapped)
    copy.attributes[LAYOUT_COPY] = UnitAttr()
    back = g.TransposeOp(copy.res, perm, src)
    for op in (copy, back):
        if "tessera.loc" in mm.attributes:
            op.attributes["tessera.loc"] = mm.attributes["tessera.loc"]
        mm.parent_block().insert_op_before(op, mm)
    return back.res
