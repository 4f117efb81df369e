"""Tile IR dialect: text round-trips exactly, builders produce what the text says, and
each verifier rejects bad IR with a message naming the offending dims."""
import re

import pytest
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import (
    DenseIntOrFPElementsAttr,
    FunctionType,
    IndexType,
    IntegerAttr,
    MemRefType,
    ModuleOp,
    TensorType,
    f16,
    f32,
    i1,
    i32,
)
from xdsl.ir import Block, Region
from xdsl.utils.exceptions import ParseError, VerifyException

from tessera.ir import tile

EVERY_OP = """\
builtin.module {
  tile.kernel @every_op(%a: memref<77x100xf16>, %b: memref<45x100xf16>, %c: memref<77x45xf32>, %n: i32, \
%stamps: memref<1x2x3x2x4xi32>) attributes {num_warps = 4 : i64, num_stages = 2 : i64, \
tessera.profile = ["every_op", "mainloop"]} {
    tile.profile_begin %stamps {label = "every_op", slot = 0 : i64} : memref<1x2x3x2x4xi32>
    %pm = tile.program_id {axis = 0 : i64}
    %pn = tile.program_id {axis = 1 : i64}
    %c0 = arith.constant 0 : index
    %c1 = arith.constant 1 : index
    %c2 = arith.constant 2 : index
    %c32 = arith.constant 32 : index
    %first = tile.load %c[%c0, %c0] {tile_dims = array<i64>} : memref<77x45xf32> -> tensor<f32>
    %scale = tile.extract %first : tensor<f32> -> f32
    %om = arith.muli %pm, %c32 : index
    %row = tile.load_index %stamps[%c0, %c0, %c1, %c0, %c2] : memref<1x2x3x2x4xi32>
    %least = tile.load_index_reduce %stamps[%c0, %c0, %c1, %c0, %c0] {kind = "min", axis = 4 : i64, count = 4 : i64} : memref<1x2x3x2x4xi32>
    %on = arith.muli %pn, %c32 : index
    %sa = tile.alloc_shared : memref<2x32x16xf16, 3 : i64>
    %zero = arith.constant dense<0.000000e+00> : tensor<32x32xf32>
    tile.profile_begin %stamps {label = "mainloop", slot = 1 : i64} : memref<1x2x3x2x4xi32>
    %acc = scf.for %k = %c0 to %c2 step %c1 iter_args(%acc_1 = %zero) -> (tensor<32x32xf32>) {
      %ko = arith.muli %k, %c32 : index
      tile.copy_async %a[%om, %ko], %sa[%k] {tile_dims = array<i64: 0, 1>, cluster_shared} : memref<77x100xf16>, memref<2x32x16xf16, 3 : i64>
      tile.copy_async %a[%om, %ko], %sa[%k] {tile_dims = array<i64: 0, 1>, dst_rows = array<i64: 16, 16>} : memref<77x100xf16>, memref<2x32x16xf16, 3 : i64>
      tile.async_commit
      tile.async_wait {pending = 0 : i64}
      tile.barrier
      %ta = tile.load_shared %sa[%k] : memref<2x32x16xf16, 3 : i64> -> tensor<32x16xf16>
      tile.store_shared %ta, %sa[%k] : tensor<32x16xf16>, memref<2x32x16xf16, 3 : i64>
      %tb = tile.load %b[%on, %ko] {tile_dims = array<i64: 0, 1>, padding = 0xfff0000000000000 : f64} : memref<45x100xf16> -> tensor<32x16xf16>
      %tbt = tile.load %b[%on, %ko] {tile_dims = array<i64: 1, 0>} : memref<45x100xf16> -> tensor<16x32xf16>
      %p = tile.mma %ta, %tb, %acc_1 {transpose_b} : tensor<32x16xf16>, tensor<32x16xf16>, tensor<32x32xf32>
      %q = tile.mma %ta, %tbt, %p : tensor<32x16xf16>, tensor<16x32xf16>, tensor<32x32xf32>
      tile.mma_turn "give"
      tile.mma_wait {pending = 1 : i64}
      tile.mma_turn "take"
      tile.release_stage %sa[%k] : memref<2x32x16xf16, 3 : i64>
      scf.yield %q : tensor<32x32xf32>
    }
    tile.mma_wait {pending = 0 : i64}
    tile.mma_turn "give" warpgroup = 0
    tile.profile_end %stamps {label = "mainloop", slot = 1 : i64} : memref<1x2x3x2x4xi32>
    %rmax = tile.reduce %acc {kind = "max", axis = 1 : i64} : tensor<32x32xf32> -> tensor<32xf32>
    %bmax = tile.broadcast %rmax {dims = array<i64: 0>} : tensor<32xf32> -> tensor<32x32xf32>
    %idx = tile.arange %on : tensor<32xi32>
    %picked = tile.load_gather %stamps[%c0, %c0, %c1, %c0, %c0] rows %idx {axis = 4 : i64} : \
memref<1x2x3x2x4xi32>, tensor<32xi32> -> tensor<32xi32>
    %nv = tile.broadcast %n {dims = array<i64>} : i32 -> tensor<32xi32>
    %in = arith.cmpi slt, %idx, %nv : tensor<32xi32>
    %inb = tile.broadcast %in {dims = array<i64: 1>} : tensor<32xi1> -> tensor<32x32xi1>
    %pos = arith.cmpf ogt, %acc, %bmax {tessera.loc = "/src/model.py:12"} : tensor<32x32xf32>
    %both = arith.andi %inb, %pos : tensor<32x32xi1>
    tile.assert %both {tessera.loc = "/src/model.py:12", tessera.regions = ["epilogue"], message = "in range"} \
: tensor<32x32xi1>
    %sel = arith.select %both, %acc, %bmax : tensor<32x32xi1>, tensor<32x32xf32>
    %fi = arith.fptosi %sel : tensor<32x32xf32> to tensor<32x32xi32>
    %fb = arith.sitofp %fi : tensor<32x32xi32> to tensor<32x32xf32>
    %true = arith.constant true
    %any = arith.select %true, %fb, %sel : tensor<32x32xf32>
    tile.store %any, %c[%om, %on] {tile_dims = array<i64: 0, 1>} : tensor<32x32xf32>, memref<77x45xf32>
    tile.atomic_add %any, %c[%om, %on] {tile_dims = array<i64: 0, 1>} : tensor<32x32xf32>, memref<77x45xf32>
    tile.profile_end %stamps {label = "every_op", slot = 0 : i64} : memref<1x2x3x2x4xi32>
    tile.return
  }
  tile.kernel @dynamic_rows(%x: memref<?x100xf16>, %y: memref<?x100xf16>) attributes {num_warps = 4 : i64, \
num_stages = 1 : i64} {
    %p = tile.program_id {axis = 0 : i64}
    %c16 = arith.constant 16 : index
    %r = arith.muli %p, %c16 : index
    %c0 = arith.constant 0 : index
    %rows = tile.dim %x {axis = 0 : i64} : memref<?x100xf16>
    %t = tile.load %x[%r, %c0] {tile_dims = array<i64: 0, 1>} : memref<?x100xf16> -> tensor<16x128xf16>
    tile.store %t, %y[%r, %c0] {tile_dims = array<i64: 0, 1>} : tensor<16x128xf16>, memref<?x100xf16>
    tile.return
  }
  tile.kernel @cluster_rows(%x: memref<4x100xf32>) attributes {num_warps = 4 : i64, num_stages = 1 : i64, \
tessera.cluster = 2 : i64} {
    %c0 = arith.constant 0 : index
    %t = tile.load %x[%c0, %c0] {tile_dims = array<i64: 0, 1>} : memref<4x100xf32> -> tensor<4x64xf32>
    %r = tile.reduce %t {kind = "sum", axis = 1 : i64} : tensor<4x64xf32> -> tensor<4xf32>
    %r0, %r1, %m0, %m1 = tile.cluster_gather %r, %r : tensor<4xf32>, tensor<4xf32> -> tensor<4xf32>, tensor<4xf32>, \
tensor<4xf32>, tensor<4xf32>
    tile.return
  }
  func.func @rows(%x: memref<?x100xf16>) attributes {tessera.buffer_dims = ["M"]} {
    %y = tile.alloc_global {tessera.buffer_dims = "M"} : memref<?x100xf16>
    tile.launch @dynamic_rows(%x, %y) {grid = array<i64: 1, 1, 1>, grid_dims = array<i64: 0, 0, 0, 16>} : \
memref<?x100xf16>, memref<?x100xf16>
    func.return
  }
  func.func @main(%a: memref<77x100xf16>, %b: memref<45x100xf16>, %c: memref<77x45xf32>) {
    %n = arith.constant 45 : i32
    %tmp = tile.alloc_global : memref<77x45xf32>
    %flat = tile.view %tmp : memref<77x45xf32> -> memref<3465xf32>
    %stamps = tile.alloc_global : memref<1x2x3x2x4xi32>
    tile.launch @every_op(%a, %b, %tmp, %n, %stamps) {grid = array<i64: 3, 2, 1>} : memref<77x100xf16>, \
memref<45x100xf16>, memref<77x45xf32>, i32, memref<1x2x3x2x4xi32>
    func.return
  }
}
"""


def test_every_op_round_trips_exactly():
    module = tile.parse_tile_module(EVERY_OP)
    module.verify()
    text = tile.print_module(module)
    assert text == EVERY_OP
    names = {op.name for op in module.walk()}
    assert {op.name for op in tile.Tile.operations} <= names


def test_builders_match_the_text_format():
    a_t, c_t = MemRefType(f16, [77, 100]), MemRefType(f32, [77, 45])
    kernel = tile.KernelOp.build_kernel("k", [a_t, c_t], num_warps=8, num_stages=3)
    block = kernel.body.block
    a, c = block.args

    def emit(op):
        block.add_op(op)
        return op.results[0] if op.results else op

    zero = emit(arith.ConstantOp(IntegerAttr(0, IndexType())))
    pid = emit(tile.ProgramIdOp(2))
    buf = emit(tile.AllocSharedOp((2, 16, 32), f16))
    emit(tile.CopyAsyncOp(a, buf, zero, [pid, zero], (0, 1), padding=float("nan")))
    emit(tile.AsyncCommitOp())
    emit(tile.AsyncWaitOp(1))
    x = emit(tile.LoadSharedOp(buf, zero))
    y = emit(tile.LoadOp(a, [zero, pid], (1, 0), (16, 32), padding=-1.5))
    acc = emit(arith.ConstantOp(DenseIntOrFPElementsAttr.from_list(TensorType(f32, [16, 16]), [0.0])))
    m = emit(tile.MmaOp(x, y, acc, transpose_b=True))
    r = emit(tile.ReduceOp(m, kind="sum", axis=0))
    b = emit(tile.BroadcastOp(r, dims=(1,), shape=(16, 16)))
    emit(tile.ArangeOp(pid, 16))
    emit(tile.StoreOp(b, c, [pid, zero], (0, 1)))
    emit(tile.ReturnOp())
    host = func.FuncOp("main", ([a_t], []))
    hb = host.body.block
    g = tile.AllocGlobalOp((77, 45), f32)
    hb.add_ops([g, tile.LaunchOp("k", (1, 2, 3), [hb.args[0], g.result]), func.ReturnOp()])
    module = ModuleOp([kernel, host])
    module.verify()

    text = tile.print_module(module)
    assert tile.print_module(tile.parse_tile_module(text)) == text
    for expected in (
        "tile.kernel @k(%0: memref<77x100xf16>, %1: memref<77x45xf32>) attributes {num_warps = 8 : i64, num_stages = 3 : i64}",
        "tile.program_id {axis = 2 : i64}",
        "tile.alloc_shared : memref<2x16x32xf16, 3 : i64>",
        "padding = 0x7ff8000000000000 : f64",
        "tile.async_wait {pending = 1 : i64}",
        "{tile_dims = array<i64: 1, 0>, padding = -1.500000e+00 : f64} : memref<77x100xf16> -> tensor<16x32xf16>",
        "{transpose_b} : tensor<16x32xf16>, tensor<16x32xf16>, tensor<16x16xf32>",
        "tile.reduce %", "{kind = \"sum\", axis = 0 : i64} : tensor<16x16xf32> -> tensor<16xf32>",
        "{dims = array<i64: 1>} : tensor<16xf32> -> tensor<16x16xf32>",
        ": tensor<16xi32>",
        "tile.launch @k(%0, %1) {grid = array<i64: 1, 2, 3>} : memref<77x100xf16>, memref<77x45xf32>",
    ):
        assert expected in text
    assert m.type == TensorType(f32, [16, 16]) and b.type == TensorType(f32, [16, 16])


def test_shared_memory_space_may_be_written_as_a_bare_integer():
    text = EVERY_OP.replace("3 : i64>", "3>")
    assert tile.print_module(tile.parse_tile_module(text)) == EVERY_OP


def test_kernel_needs_its_launch_parameters():
    with pytest.raises(ParseError, match="needs num_stages"):
        tile.parse_tile_module("tile.kernel @k() attributes {num_warps = 4} {\n tile.return\n}")


# ---------------------------------------------------------------- verifiers


def values(*types):
    """SSA values of the given types (arguments of a detached block)."""
    return Block(arg_types=types).args


def shared(*shape, el=f16):
    return tile.shared_memref(shape, el)


def t(*shape, el=f16):
    return TensorType(el, shape)


def bad_mma_k():
    a, b, acc = values(t(64, 32), t(16, 64), t(64, 64, el=f32))
    return tile.MmaOp(a, b, acc)


def bad_mma_k_transposed():
    a, b, acc = values(t(64, 32), t(64, 16), t(64, 64, el=f32))
    return tile.MmaOp(a, b, acc, transpose_b=True)


def bad_mma_acc():
    a, b, acc = values(t(64, 32), t(32, 64), t(64, 32, el=f32))
    return tile.MmaOp(a, b, acc)


def bad_mma_rank():
    a, b, acc = values(t(64), t(32, 64), t(64, 64, el=f32))
    return tile.MmaOp(a, b, acc)


def load(tile_dims, shape, n_offsets=2):
    src, *offsets = values(MemRefType(f16, [77, 100]), *[IndexType()] * n_offsets)
    return tile.LoadOp(src, offsets, tile_dims, shape)


def load_index_reduce(kind="min", axis=0, count=4, el=i32):
    src, offset = values(MemRefType(el, [77]), IndexType())
    return tile.LoadIndexReduceOp(src, [offset], kind, axis, count)


def load_gather(index_type):
    src, index, offset = values(MemRefType(f16, [77]), index_type, IndexType())
    return tile.LoadGatherOp(src, index, [offset], 0)


def store(tile_dims, shape, n_offsets=2):
    val, dst, *offsets = values(t(*shape), MemRefType(f16, [77, 100]), *[IndexType()] * n_offsets)
    return tile.StoreOp(val, dst, offsets, tile_dims)


def atomic_add(element, dst_element=f32):
    val, dst, i, j = values(t(64, 64, el=element), MemRefType(dst_element, [77, 100]), IndexType(), IndexType())
    return tile.AtomicAddOp(val, dst, [i, j], (0, 1))


def store_shared(shape, element=f16):
    val, buf, stage = values(t(*shape, el=element), shared(2, 64, 32), IndexType())
    return tile.StoreSharedOp(val, buf, stage)


def reduce(kind, axis):
    (x,) = values(t(64, 32))
    return tile.ReduceOp(x, kind, axis)


def broadcast(in_shape, dims, shape):
    (x,) = values(t(*in_shape))
    return tile.BroadcastOp(x, dims, shape)


def copy_async(dst_type, tile_dims=(0, 1), dst_rows=None):
    src, dst, stage, i, j = values(MemRefType(f16, [77, 100]), dst_type, IndexType(), IndexType(), IndexType())
    return tile.CopyAsyncOp(src, dst, stage, [i, j], tile_dims, dst_rows=dst_rows)


def load_shared_wrong_shape():
    buf, stage = values(shared(2, 64, 32), IndexType())
    return tile.LoadSharedOp.create(operands=[buf, stage], result_types=[t(64, 64)])


def select_mask_shape():
    cond, a, b = values(t(4, el=i1), t(8, el=f32), t(8, el=f32))
    return tile.SelectOp(cond, a, b)


def kernel_with_bad_args():
    body = Region(Block([tile.ReturnOp()], arg_types=[f32]))
    return tile.KernelOp("k", FunctionType.from_lists([i32], []), body, num_warps=4, num_stages=2)


VERIFIER_CASES = {
    "mma K": (bad_mma_k, "'tile.mma': a is 64x32 (MxK, K=32) but b is 16x64 (KxN, K=16)"),
    "mma K transposed": (bad_mma_k_transposed, "a is 64x32 (MxK, K=32) but b is 64x16 (NxK, K=16)"),
    "mma acc": (bad_mma_acc, "acc is 64x32 but a @ b is 64x64 (MxN)"),
    "mma rank": (bad_mma_rank, "a, b and acc must be 2-D tiles, got 64, 32x64 and 64x64"),
    "load offsets": (lambda: load((0,), (64,), n_offsets=1), "1 offsets given for rank-2 memref"),
    "load tile_dims count": (lambda: load((0,), (64, 64)), "tile_dims [0] has 1 entries but result tile"),
    "load tile_dims distinct": (lambda: load((1, 1), (64, 64)), "tile_dims [1, 1] are not distinct"),
    "load tile_dims range": (lambda: load((0, 2), (64, 64)), "tile_dims [0, 2]: [2] out of range for a rank-2 memref"),
    "load_index_reduce kind": (lambda: load_index_reduce(kind="sum"), "kind must be min or max, got 'sum'"),
    "load_index_reduce axis": (lambda: load_index_reduce(axis=1), "axis 1 out of range for memref<77xi32>"),
    "load_index_reduce count": (lambda: load_index_reduce(count=0), "count must be positive, got 0"),
    "load_index_reduce element": (lambda: load_index_reduce(el=f32), "source must hold i32 indices, got memref<77xf32>"),
    "load_gather shape": (lambda: tile.LoadGatherOp.create(
        operands=list(values(MemRefType(f16, [77]), t(8, el=i32), IndexType())), properties={"axis": tile._i64(0)},
        result_types=[t(4)]), "result tensor<4xf16> must have the index's shape 8"),
    "load_gather index": (lambda: load_gather(t(8, el=f32)),
                          "index must be an i32 tile, got tensor<8xf32>"),
    "store offsets": (lambda: store((0, 1), (64, 64), n_offsets=3), "'tile.store': 3 offsets given for rank-2"),
    "store tile_dims": (lambda: store((0, 1, 2), (4, 4, 4), n_offsets=2), "tile_dims [0, 1, 2]: [2] out of range"),
    "atomic_add element": (lambda: atomic_add(f16, f16), "destination memref<77x100xf16> must hold f32 (atomic sums)"),
    "atomic_add tile": (lambda: atomic_add(f16), "added tile element type f16 differs from destination element type f32"),
    "store_shared shape": (lambda: store_shared((64, 64)), "stored tile 64x64 differs from one stage of "
                                                           "memref<2x64x32xf16, 3 : i64> (64x32)"),
    "store_shared element": (lambda: store_shared((64, 32), f32), "stored tile element type f32 differs from destination element type f16"),
    "reduce axis": (lambda: reduce("max", 2), "'tile.reduce': axis 2 out of range for a 64x32 tile"),
    "reduce kind": (lambda: reduce("mean", 0), "kind must be one of sum, max, min, got 'mean'"),
    "broadcast rank": (lambda: broadcast((64,), (0, 1), (64, 64)), "dims [0, 1] has 2 entries for a rank-1 input"),
    "broadcast order": (lambda: broadcast((4, 8), (1, 0), (8, 4)), "dims [1, 0] must be strictly increasing"),
    "broadcast range": (lambda: broadcast((4, 8), (0, 2), (4, 8)), "dims [0, 2] out of range for rank-2 result"),
    "broadcast size": (lambda: broadcast((32,), (0,), (64, 64)),
                       "input dim 0 (size 32) cannot broadcast to result dim 0 (size 64)"),
    "copy_async stage shape": (lambda: copy_async(shared(2, 64, 32), tile_dims=(0,)),
                               "tile_dims [0] has 1 entries but the copied part of a stage of "
                               "memref<2x64x32xf16, 3 : i64> (64x32) has rank 2"),
    "copy_async rows": (lambda: copy_async(shared(2, 64, 32), dst_rows=(48, 32)),
                        "dst_rows [48, 32] must be [start, count] inside a stage of memref<2x64x32xf16, 3 : i64>"),
    "copy_async space": (lambda: copy_async(MemRefType(f16, [2, 64, 32])), "destination memref<2x64x32xf16> must be in shared memory space 3"),
    "load_shared shape": (load_shared_wrong_shape, "result shape 64x64 differs from one stage of memref<2x64x32xf16, 3 : i64> (64x32)"),
    "alloc_shared space": (lambda: tile.AllocSharedOp.create(result_types=[MemRefType(f16, [2, 64, 32])]),
                           "result memref<2x64x32xf16> must be in shared memory space 3"),
    "program_id axis": (lambda: tile.ProgramIdOp(3), "axis must be 0, 1 or 2, got 3"),
    "extract rank": (lambda: tile.ExtractOp(*values(t(8))), "input must be a rank-0 tile, got tensor<8xf16>"),
    "extract element": (lambda: tile.ExtractOp.create(operands=list(values(t(el=f32))), result_types=[f16]),
                        "input element type f32 differs from result element type f16"),
    "arange type": (lambda: tile.ArangeOp.create(operands=list(values(IndexType())), result_types=[t(8, el=f32)]),
                    "result must be a 1-D i32 tile, got tensor<8xf32>"),
    "select mask": (select_mask_shape, "condition type tensor<4xi1> must be i1 or tensor<8xi1>"),
    "cluster_gather results": (lambda: tile.ClusterGatherOp.create(operands=list(values(t(8), t(8))),
                                                                  result_types=[t(8)] * 3),
                               "3 results for 2 operands: not a whole cluster's each"),
    "cluster_gather rank": (lambda: tile.ClusterGatherOp(values(t(8, 8)), 2),
                            "a cluster gathers 1-D tiles (row statistics), got 8x8"),
    "cluster_gather types": (lambda: tile.ClusterGatherOp.create(operands=list(values(t(8))), result_types=[t(8), t(4)]),
                             "operand 0's results differ from tensor<8xf16>"),
    "kernel args": (kernel_with_bad_args, "kernel @k: block arguments ['f32'] differ from function_type inputs ['i32']"),
}


@pytest.mark.parametrize("case", VERIFIER_CASES)
def test_verifier_message(case):
    build, message = VERIFIER_CASES[case]
    with pytest.raises(VerifyException, match=re.escape(message)):
        build().verify()


def launch_module(kernel_params, launch_args, grid=(1, 1, 1), kernel_name="k"):
    kernel = tile.KernelOp.build_kernel("k", kernel_params)
    kernel.body.block.add_op(tile.ReturnOp())
    host = func.FuncOp("main", (launch_args, []))
    hb = host.body.block
    hb.add_ops([tile.LaunchOp(kernel_name, grid, hb.args), func.ReturnOp()])
    return ModuleOp([kernel, host])


@pytest.mark.parametrize("module, message", [
    (launch_module([f32], [f32], kernel_name="nope"), "@nope is not a tile.kernel in this module"),
    (launch_module([f32], [i32]), "@k takes (f32) but is launched with (i32)"),
    (launch_module([f32], [f32], grid=(4, 0, 1)), "grid must be 3 positive sizes, got [4, 0, 1]"),
    (launch_module([f32], [f32], grid=(4, 1)), "grid must be 3 positive sizes, got [4, 1]"),
])
def test_launch_verifier(module, message):
    with pytest.raises(VerifyException, match=re.escape(message)):
        module.verify()


def test_tile_capable_arith_ops_replace_xdsl_scalar_only_ones():
    """Comparisons of tiles give tiles of i1, and parsing picks the tile-capable classes."""
    x, y = values(t(8, el=f32), t(8, el=f32))
    assert tile.CmpfOp(x, y, "olt").result.type == t(8, el=i1)
    assert tile.SIToFPOp(tile.FPToSIOp(x, i32), f16).result.type == t(8, el=f16)
    ctx = tile.tile_context()
    for op in tile.TILE_ARITH_OPS:
        assert ctx.get_optional_op(op.name) is op
    assert ctx.get_optional_op("scf.for") is scf.ForOp
