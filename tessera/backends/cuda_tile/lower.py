"""Tile IR -> CUDA Tile IR: each `tile.kernel` becomes one `cuda_tile` entry (docs/CUDA_TILE.md).

Why Tile IR: a Target IR kernel says how one platform runs the block (mma.sync or wgmma fragments,
TMA descriptors, mbarriers, warp roles, shared memory addresses); a cuda_tile entry sits where a
Tile IR kernel does, a block program over register tiles whose thread mapping, staging and
tensor-core instructions NVIDIA's tileiras decides. So this backend reads Tile IR built with
`stage_operands` off: every matmul operand is a plain `tile.load` and tileiras pipelines it.

The mapping:
- each memref parameter: a `tile<ptr<T>>` entry argument, 16-byte aligned (the runtime checks
  every argument's alignment before a launch), viewed as a static tensor_view (the memref's shape
  and strides: row-major, or an argument's own where it was passed strided);
- index values (program ids, offsets, loop counters) and i32 tiles: `tile<i32>` (a dim stays under
  2^31, `compiler.MAX_DIM`);
- `tile.load`/`tile.store` whose offsets are known multiples of the tile (index_facts): a load or
  store of a partition view, which tileiras may turn into TMA; others: a tile of pointers with an
  in-bounds mask (gather/scatter). Out-of-bounds elements read the op's padding and are not written;
- `tile.mma`: `mmaf` (transposed operands through `permute`); `tile.reduce`: `reduce` with a
  combiner region; `tile.broadcast`: `reshape` + `broadcast`; `tile.mma_wait`: nothing (tileiras
  orders its own tensor-core work);
- `scf.for`/`scf.if`: `for`/`if`; arith/math: the dialect's ops (erf, which it lacks, as the
  polynomial the PTX backend uses: backends/approximations.py).

A memref that one kernel both reads and writes orders its accesses with tokens; other accesses are
left unordered, as tile programs' dataflow already orders them.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from xdsl.dialects import arith, scf
from xdsl.dialects import math as mathd
from xdsl.dialects.builtin import DenseIntOrFPElementsAttr, FloatAttr, IndexType, IntegerAttr, MemRefType
from xdsl.ir import Block, Operation, SSAValue

from ...ir import tile as t
from ...ir.index_facts import is_non_negative, known_multiple
from .. import UnsupportedByBackend
from ..approximations import ERF_A_S_7_1_26
from . import ir as ct

#: a padding value of tile.load -> the partition view padding that reads it (others gather)
VIEW_PADDING = {0.0: "zero", -math.inf: "neg_inf", math.inf: "pos_inf"}

#: arith.cmpi predicate numbers (MLIR's) -> (cuda_tile predicate, signed)
CMPI = {0: ("equal", True), 1: ("not_equal", True), 2: ("less_than", True), 3: ("less_than_or_equal", True),
        4: ("greater_than", True), 5: ("greater_than_or_equal", True), 6: ("less_than", False),
        7: ("less_than_or_equal", False), 8: ("greater_than", False), 9: ("greater_than_or_equal", False)}
#: arith.cmpf predicate numbers -> (cuda_tile predicate, ordered)
CMPF = {1: ("equal", True), 2: ("greater_than", True), 3: ("greater_than_or_equal", True), 4: ("less_than", True),
        5: ("less_than_or_equal", True), 6: ("not_equal", True), 8: ("equal", False), 9: ("greater_than", False),
        10: ("greater_than_or_equal", False), 11: ("less_than", False), 12: ("less_than_or_equal", False),
        13: ("not_equal", False)}


def unsupported(what: str) -> UnsupportedByBackend:
    return UnsupportedByBackend(f"CUDA Tile IR backend: {what}")


def element(ty) -> ct.ScalarType:
    """The cuda_tile element type of an xDSL scalar type (index is i32)."""
    if isinstance(ty, IndexType):
        return ct.I32
    name = str(ty)
    if name not in ct.SCALAR_TYPES:
        raise unsupported(f"element type {name} has no cuda_tile counterpart")
    return ct.SCALAR_TYPES[name]


def tile_type(ty) -> ct.TileType:
    """The cuda_tile tile type of a Tile IR value's type: a tensor, or a scalar as a 0-d tile."""
    if isinstance(ty, MemRefType):
        raise unsupported(f"a memref value ({ty}) where a tile is expected")
    shape = tuple(ty.get_shape()) if hasattr(ty, "get_shape") else ()
    elem = ty.get_element_type() if hasattr(ty, "get_element_type") else ty
    if any(d & (d - 1) for d in shape):
        raise unsupported(f"tile shape {list(shape)} is not all powers of two, as cuda_tile tiles must be")
    return ct.TileType(element(elem), shape)


class _KernelLowering:
    """One tile.kernel as one cuda_tile entry of `module`."""

    def __init__(self, kernel: t.KernelOp, module: ct.Module, arch: str):
        self.kernel = kernel
        self.values: dict[SSAValue, ct.Value] = {}
        params = list(kernel.body.block.args)
        arg_types = [ct.tile(ct.ptr(element(p.type.get_element_type()))) for p in params]
        occupancy = kernel.attributes.get(t.OCCUPANCY)
        hints = {arch: ct.EntryHints(occupancy=occupancy.value.data)} if occupancy is not None else {}
        self.entry, self.b = module.entry(kernel.sym_name.data, arg_types, [f"arg{i}" for i in range(len(params))],
                                          hints=hints)
        self.top = ct.Builder(ct.Block())   # views, built once before the body (prepended at the end)
        self.pointers: dict[SSAValue, ct.Value] = {}
        self.views: dict[SSAValue, ct.Value] = {}
        self.partitions: dict[tuple, ct.Value] = {}
        for p, arg in zip(params, self.entry.args):
            shape = tuple(p.type.get_shape())
            self.pointers[p] = self.top.assume(arg, ct.DivBy(16))
            self.views[p] = self.top.make_tensor_view(
                self.pointers[p], ct.TensorViewType(element(p.type.get_element_type()), shape,
                                                    t.element_strides(p.type)))
        self.block_ids: tuple | None = None
        self.ordered = self._read_and_written(kernel)
        self.tokens: dict[SSAValue, ct.Value] = {}

    # -- driver -------------------------------------------------------------------------------------

    def lower(self) -> ct.Entry:
        self.block(self.kernel.body.block)
        self.entry.body.ops[:0] = self.top.block.ops
        return self.entry

    def block(self, block: Block, terminator: Callable | None = None) -> None:
        for op in block.ops:
            if isinstance(op, (scf.YieldOp, t.ReturnOp)):
                if isinstance(op, scf.YieldOp):
                    terminator([self.v(x) for x in op.operands])
                else:
                    self.b.return_()
                continue
            rule = RULES.get(type(op))
            if rule is None:
                raise unsupported(f"{op.name} in kernel {self.kernel.sym_name.data}")
            results = rule(self, op)
            if results is None:
                continue
            results = results if isinstance(results, (list, tuple)) else [results]
            for r, v in zip(op.results, results, strict=True):
                self.values[r] = v

    def v(self, x: SSAValue) -> ct.Value:
        return self.values[x]

    def index(self, n: int) -> ct.Value:
        return self.b.constant(n, ct.I32)

    def scalar_to(self, x: ct.Value, shape) -> ct.Value:
        """A 0-d tile (or one of `shape`) as a tile of `shape`."""
        if x.type.shape == tuple(shape):
            return x
        return self.b.broadcast(self.b.reshape(x, [1] * len(shape)), shape)

    # -- memory -------------------------------------------------------------------------------------

    @staticmethod
    def _read_and_written(kernel: t.KernelOp) -> set:
        """Params some op of the kernel loads and some op stores: their accesses keep program order
        (tokens). Refused where one of those accesses is inside a loop or branch."""
        loaded, stored, nested = set(), set(), set()
        for op in kernel.walk():
            if isinstance(op, (t.LoadOp, t.StoreOp)):
                mem = op.src if isinstance(op, t.LoadOp) else op.dst
                (loaded if isinstance(op, t.LoadOp) else stored).add(mem)
                if op.parent_block() is not kernel.body.block:
                    nested.add(mem)
        both = loaded & stored
        if both & nested:
            raise unsupported(f"kernel {kernel.sym_name.data} reads and writes one buffer inside a loop or branch")
        return both

    def _token(self, mem: SSAValue) -> ct.Value | None:
        return self.tokens.get(mem) if mem in self.ordered else None

    def _keep_token(self, mem: SSAValue, token: ct.Value) -> None:
        if mem in self.ordered:
            self.tokens[mem] = token

    def _access(self, op, mem: SSAValue, shape: tuple[int, ...]):
        """(sizes per memref dim, offsets, tile dims) of a load/store of a `shape` tile."""
        tile_dims = [int(d) for d in op.tile_dims.get_values()]
        sizes = [1] * len(mem.type.get_shape())
        for i, d in enumerate(tile_dims):
            sizes[d] = shape[i]
        return sizes, list(op.offsets), tile_dims

    @staticmethod
    def _whole_tiles(offsets, sizes) -> bool:
        """Whether every offset is a known non-negative multiple of its tile size: a partition
        view's tile (a negative tile index would be outside the view, which the dialect leaves
        undefined)."""
        return all(known_multiple(o) % s == 0 and is_non_negative(o) for o, s in zip(offsets, sizes))

    def _partition(self, mem: SSAValue, sizes, padding: str | None) -> ct.Value:
        key = (mem, tuple(sizes), padding)
        if key not in self.partitions:
            self.partitions[key] = self.top.make_partition_view(self.views[mem], sizes, padding)
        return self.partitions[key]

    def _tile_index(self, offset: SSAValue, size: int) -> ct.Value:
        off = self.v(offset)
        return off if size == 1 else self.b.divi(off, self.index(size))

    def _to_tile_order(self, x: ct.Value, sizes, tile_dims) -> ct.Value:
        """A tile loaded in memref dim order (every dim, size 1 where untiled) as the op's tile:
        its dims in `tile_dims` order."""
        ordered = sorted(tile_dims)
        x = self.b.reshape(x, [sizes[d] for d in ordered])
        perm = [ordered.index(d) for d in tile_dims]
        return x if perm == sorted(perm) else self.b.permute(x, perm)

    def _from_tile_order(self, x: ct.Value, sizes, tile_dims) -> ct.Value:
        ordered = sorted(tile_dims)
        perm = [tile_dims.index(d) for d in ordered]
        if perm != sorted(perm):
            x = self.b.permute(x, perm)
        return self.b.reshape(x, sizes)

    def _pointers(self, mem: SSAValue, offsets, tile_dims, shape) -> tuple[ct.Value, ct.Value]:
        """The address of every element of a `shape` tile at `offsets`, and which lie inside `mem`
        (below its end, and at or after its start where an offset may be negative, as the PTX
        backend checks)."""
        b, mem_shape = self.b, mem.type.get_shape()
        strides = t.element_strides(mem.type)
        wide = t.reach(mem.type) >= 2 ** 31
        idx = ct.I64 if wide else ct.I32
        linear = mask = None
        for i, d in enumerate(tile_dims):
            along = [1] * len(shape)
            along[i] = shape[i]
            pos = b.addi(b.iota(shape[i]), self.scalar_to(self.v(offsets[d]), [shape[i]]))
            inside = b.cmpi("less_than", pos, b.constant(mem_shape[d], ct.tile(ct.I32, shape[i])))
            if not is_non_negative(offsets[d]):   # a slice's tile may start before the tensor
                inside = b.andi(inside, b.cmpi("greater_than_or_equal", pos, b.constant(0, ct.tile(ct.I32, shape[i]))))
            inside = b.broadcast(b.reshape(inside, along), shape)
            mask = inside if mask is None else b.andi(mask, inside)
            if wide:
                pos = b.exti(pos, ct.I64)
            term = b.muli(pos, b.constant(strides[d], ct.tile(idx, shape[i])))
            term = b.broadcast(b.reshape(term, along), shape)
            linear = term if linear is None else b.addi(linear, term)
        base = None
        for d, o in enumerate(offsets):
            if d in tile_dims:
                continue
            off = self.v(o)
            if wide:
                off = b.exti(off, ct.I64)
            term = b.muli(off, b.constant(strides[d], idx))
            base = term if base is None else b.addi(base, term)
        if base is not None:
            linear = b.addi(linear, self.scalar_to(base, shape))
        pointers = self.scalar_to(self.pointers[mem], shape)
        return b.offset(pointers, linear), mask

    def load(self, op: t.LoadOp) -> ct.Value:
        result = tile_type(op.result.type)
        sizes, offsets, tile_dims = self._access(op, op.src, result.shape)
        padding = op.padding.value.data
        view_padding = VIEW_PADDING.get(padding)
        token = self._token(op.src)
        if view_padding is not None and self._whole_tiles(offsets, sizes) and not any(s & (s - 1) for s in sizes):
            view = self._partition(op.src, sizes, view_padding)
            x, out = self.b.load_view_tko(view, [self._tile_index(o, s) for o, s in zip(offsets, sizes)], token)
            x = self._to_tile_order(x, sizes, tile_dims)
        else:
            pointers, mask = self._pointers(op.src, offsets, tile_dims, result.shape)
            fill = self.b.constant(padding, result)
            x, out = self.b.load_ptr_tko(pointers, mask, fill, token)
        self._keep_token(op.src, out)
        return x

    def store(self, op: t.StoreOp) -> None:
        value = self.v(op.value)
        sizes, offsets, tile_dims = self._access(op, op.dst, value.type.shape)
        token = self._token(op.dst)
        if self._whole_tiles(offsets, sizes) and not any(s & (s - 1) for s in sizes):
            view = self._partition(op.dst, sizes, None)
            out = self.b.store_view_tko(self._from_tile_order(value, sizes, tile_dims), view,
                                        [self._tile_index(o, s) for o, s in zip(offsets, sizes)], token)
        else:
            pointers, mask = self._pointers(op.dst, offsets, tile_dims, value.type.shape)
            out = self.b.store_ptr_tko(pointers, value, mask, token)
        self._keep_token(op.dst, out)

    # -- tiles --------------------------------------------------------------------------------------

    def program_id(self, op: t.ProgramIdOp) -> ct.Value:
        if self.block_ids is None:
            self.block_ids = self.top.get_tile_block_id()
        return self.block_ids[op.axis.value.data]

    def constant(self, op: arith.ConstantOp) -> ct.Value:
        ty = tile_type(op.result.type)
        value = op.value
        if isinstance(value, (IntegerAttr, FloatAttr)):
            return self.b.constant(value.value.data, ty)
        if isinstance(value, DenseIntOrFPElementsAttr):
            return self.b.constant(list(value.get_values()), ty)
        raise unsupported(f"constant {value}")

    def broadcast(self, op: t.BroadcastOp) -> ct.Value:
        x, out = self.v(op.x), tile_type(op.result.type)
        dims = [int(d) for d in op.dims.get_values()]
        shape = [1] * out.rank
        for i, d in enumerate(dims):
            shape[d] = x.type.shape[i]
        if tuple(shape) != x.type.shape:
            x = self.b.reshape(x, shape)
        return self.b.broadcast(x, out.shape)

    def arange(self, op: t.ArangeOp) -> ct.Value:
        n = tile_type(op.result.type).shape[0]
        return self.b.addi(self.b.iota(n), self.scalar_to(self.v(op.start), [n]))

    def reduce(self, op: t.ReduceOp) -> ct.Value:
        x = self.v(op.x)
        kind, is_float = op.kind.data, x.type.element.is_float
        if is_float:
            identity = {"sum": 0.0, "max": -math.inf, "min": math.inf}[kind]
            combine = {"sum": self.b.addf, "max": lambda a, c: self.b.maxf(a, c, propagate_nan=True),
                       "min": lambda a, c: self.b.minf(a, c, propagate_nan=True)}[kind]
        else:
            bits = x.type.element.bits
            identity = {"sum": 0, "max": -(2 ** (bits - 1)), "min": 2 ** (bits - 1) - 1}[kind]
            combine = {"sum": self.b.addi, "max": self.b.maxi, "min": self.b.mini}[kind]
        with self.b.reduce(x, op.axis.value.data, [identity]) as r:
            acc, elem = r.args
            self.b.yield_([combine(acc, elem)])
        return r.results[0]

    def mma(self, op: t.MmaOp) -> ct.Value:
        a, b, acc = self.v(op.a), self.v(op.b), self.v(op.acc)
        if op.transpose_a is not None:
            a = self.b.permute(a, [1, 0])
        if op.transpose_b is not None:
            b = self.b.permute(b, [1, 0])
        return self.b.mmaf(a, b, acc)

    # -- elementwise --------------------------------------------------------------------------------

    def select(self, op) -> ct.Value:
        cond, x, y = (self.v(v) for v in op.operands)
        return self.b.select(self.scalar_to(cond, x.type.shape), x, y)

    def cmpi(self, op) -> ct.Value:
        predicate, signed = CMPI[op.predicate.value.data]
        return self.b.cmpi(predicate, self.v(op.lhs), self.v(op.rhs), signed=signed)

    def cmpf(self, op) -> ct.Value:
        number = op.predicate.value.data
        if number not in CMPF:
            raise unsupported(f"arith.cmpf predicate {number}")
        predicate, ordered = CMPF[number]
        return self.b.cmpf(predicate, self.v(op.lhs), self.v(op.rhs), ordered=ordered)

    def convert(self, op) -> ct.Value:
        """Casts between element types (index and i32 are one type here)."""
        x, to = self.v(op.operands[0]), tile_type(op.results[0].type).element
        src = x.type.element
        if src == to:
            return x
        if src.is_float and to.is_float:
            return self.b.ftof(x, to)
        if not src.is_float and to.is_float:
            return self.b.itof(x, to, signed=src != ct.I1)
        if src.is_float:
            return self.b.ftoi(x, to)
        unsigned = isinstance(op, arith.ExtUIOp) or src == ct.I1
        return self.b.exti(x, to, signed=not unsigned) if to.bits > src.bits else self.b.trunci(x, to)

    def floor_div(self, op) -> ct.Value:
        return self.b.divi(self.v(op.lhs), self.v(op.rhs), rounding="negative_inf")

    def erf(self, op) -> ct.Value:
        """Abramowitz & Stegun 7.1.26, as the PTX backend computes it (|error| < 1.5e-7)."""
        b, x = self.b, self.v(op.operand)
        a1, a2, a3, a4, a5, p = ERF_A_S_7_1_26
        c = lambda v: b.constant(v, x.type)  # noqa: E731
        ax = b.absf(x)
        tt = b.divf(c(1.0), b.fma(ax, c(p), c(1.0)))
        poly = c(a5)
        for coefficient in (a4, a3, a2, a1):
            poly = b.fma(poly, tt, c(coefficient))
        poly = b.mulf(poly, tt)
        poly = b.mulf(poly, b.exp2(b.mulf(b.mulf(ax, ax), c(-1.4426950408889634))))
        magnitude = b.subf(c(1.0), poly)
        return b.select(b.cmpf("less_than", x, c(0.0)), b.negf(magnitude), magnitude)

    # -- control flow -------------------------------------------------------------------------------

    def for_(self, op: scf.ForOp) -> list[ct.Value]:
        inits = [self.v(x) for x in op.iter_args]
        with self.b.for_(self.v(op.lb), self.v(op.ub), self.v(op.step), inits) as loop:
            body = op.body.block
            self.values[body.args[0]] = loop.iv
            for arg, value in zip(body.args[1:], loop.iter_values):
                self.values[arg] = value
            self.block(body, self.b.continue_)
        return loop.results

    def if_(self, op: scf.IfOp) -> list[ct.Value]:
        types = [tile_type(r.type) for r in op.results]
        with self.b.if_(self.v(op.cond), types) as branch:
            with branch.then():
                self.block(op.true_region.block, self.b.yield_)
            if op.false_region.blocks:
                with branch.else_():
                    self.block(op.false_region.block, self.b.yield_)
        return branch.results


def _binary(method: str, **attrs) -> Callable:
    def rule(lowering: _KernelLowering, op: Operation) -> ct.Value:
        a, b = (lowering.v(x) for x in op.operands)
        return getattr(lowering.b, method)(a, b, **attrs)
    return rule


def _unary(method: str, **attrs) -> Callable:
    def rule(lowering: _KernelLowering, op: Operation) -> ct.Value:
        return getattr(lowering.b, method)(lowering.v(op.operands[0]), **attrs)
    return rule


def _divf(lowering: _KernelLowering, op: Operation) -> ct.Value:
    """IEEE division, or tileiras's approximate one where the Tile IR marks the division `afn`."""
    a, b = (lowering.v(x) for x in op.operands)
    if "afn" in op.fastmath.data:
        return lowering.b.divf(a, b, rounding="approx", ftz=True)
    return lowering.b.divf(a, b)


def _nothing(lowering: _KernelLowering, op: Operation) -> None:
    return None


def _same(lowering: _KernelLowering, op: Operation) -> ct.Value:
    """An op whose value is its operand's here (a rank-0 tile is CUDA Tile IR's scalar)."""
    return lowering.v(op.operands[0])


#: Tile IR op class -> how it lowers (a method of _KernelLowering, or a small rule)
RULES: dict[type, Callable] = {
    t.LoadOp: _KernelLowering.load,
    t.StoreOp: _KernelLowering.store,
    t.ProgramIdOp: _KernelLowering.program_id,
    t.BroadcastOp: _KernelLowering.broadcast,
    t.ArangeOp: _KernelLowering.arange,
    t.ReduceOp: _KernelLowering.reduce,
    t.MmaOp: _KernelLowering.mma,
    t.MmaWaitOp: _nothing,
    t.MmaTurnOp: _nothing,
    t.ExtractOp: _same,
    arith.ConstantOp: _KernelLowering.constant,
    scf.ForOp: _KernelLowering.for_,
    scf.IfOp: _KernelLowering.if_,
    t.SelectOp: _KernelLowering.select,
    t.CmpiOp: _KernelLowering.cmpi,
    t.CmpfOp: _KernelLowering.cmpf,
    arith.AddfOp: _binary("addf"),
    arith.SubfOp: _binary("subf"),
    arith.MulfOp: _binary("mulf"),
    arith.DivfOp: _divf,
    arith.MaximumfOp: _binary("maxf", propagate_nan=True),
    arith.MinimumfOp: _binary("minf", propagate_nan=True),
    arith.NegfOp: _unary("negf"),
    arith.AddiOp: _binary("addi"),
    arith.SubiOp: _binary("subi"),
    arith.MuliOp: _binary("muli"),
    arith.DivSIOp: _binary("divi"),
    arith.RemSIOp: _binary("remi"),
    arith.MaxSIOp: _binary("maxi"),
    arith.MinSIOp: _binary("mini"),
    arith.AndIOp: _binary("andi"),
    arith.OrIOp: _binary("ori"),
    arith.XOrIOp: _binary("xori"),
    arith.ShLIOp: _binary("shli"),
    arith.ShRUIOp: _binary("shri", signed=False),
    arith.FloorDivSIOp: _KernelLowering.floor_div,
    arith.IndexCastOp: _KernelLowering.convert,
    arith.ExtFOp: _KernelLowering.convert,
    arith.TruncFOp: _KernelLowering.convert,
    arith.ExtSIOp: _KernelLowering.convert,
    arith.ExtUIOp: _KernelLowering.convert,
    arith.TruncIOp: _KernelLowering.convert,
    t.SIToFPOp: _KernelLowering.convert,
    t.FPToSIOp: _KernelLowering.convert,
    mathd.ExpOp: _unary("exp"),
    mathd.Exp2Op: _unary("exp2", ftz=True),   # as the PTX backend's ex2.approx.ftz
    mathd.LogOp: _unary("log"),
    mathd.Log2Op: _unary("log2"),
    mathd.TanhOp: _unary("tanh"),   # (an `afn` tanh too: its approximate rounding needs bytecode 13.2)
    mathd.SqrtOp: _unary("sqrt"),
    mathd.RsqrtOp: _unary("rsqrt"),
    mathd.SinOp: _unary("sin"),
    mathd.CosOp: _unary("cos"),
    mathd.AbsFOp: _unary("absf"),
    mathd.AbsIOp: _unary("absi"),
    mathd.FloorOp: _unary("floor"),
    mathd.FmaOp: lambda lowering, op: lowering.b.fma(*(lowering.v(x) for x in op.operands)),
    t.RemFOp: _binary("remf"),
    mathd.PowFOp: _binary("pow"),
    mathd.ErfOp: _KernelLowering.erf,
}


def lower_kernel(kernel: t.KernelOp, arch: str = "sm_90") -> ct.Module:
    """`kernel` as a cuda_tile module of one entry, its hints for tileiras's `arch` (sm_90)."""
    module = ct.Module(kernel.sym_name.data)
    _KernelLowering(kernel, module, arch).lower()
    return module
