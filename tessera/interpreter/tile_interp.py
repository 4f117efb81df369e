"""A NumPy interpreter for Tile IR modules (like Triton's interpreter mode).

It runs a tile module on the CPU with the GPU's storage formats, so the
compiler's Tile IR can be checked against NumPy references without a GPU:

- every value has the NumPy dtype of its MLIR element type (bf16/fp8 through
  ml_dtypes) and every op rounds to it: f16 math is computed in f32 and
  rounded, as GPU code does; `tile.mma` multiplies in f32 and accumulates in
  the accumulator's dtype;
- `tile.copy_async` really is asynchronous: the tile is read when the copy is
  issued but only lands in shared memory when `tile.async_wait` retires its
  group, so a kernel that reads a stage too early sees stale data;
- fresh shared and global buffers are filled with NaN (integers: their minimum)
  so reads of never-written memory show up in results;
- `tile.assert` raises `DeviceAssertError` (message, source line, program id, first failing
  element); profile stamps are host nanoseconds, reported like a GPU's cycles
  (`tessera.runtime.profile`);
- the blocks of a thread-block cluster (`tile.CLUSTER`) run together, each on a thread of its
  own, so that a `tile.cluster_gather` waits for all of them as the GPU's blocks do.

Speed: each function is compiled once into a list of closures over a frame (a
Python list indexed by value slot; the op -> builder table is consulted only
while compiling), so a grid of thousands of programs does not re-walk xDSL
structures.  Programs of a grid run one after another (a cluster's together), axis 0 fastest.

Entry points:
- `TileProgram(module)`: compiles lazily and caches per kernel/function;
  `program(*arrays)` runs the module's only host `func.func`,
  `program.run(name, *arrays)` a named one, `program.launch(kernel, grid, *args)`
  a kernel directly.  Arrays stand for memrefs and outputs are written in place
  (destination-passing style).  Build a new `TileProgram` after mutating the module.
- `run_host(module, func_name, args)`: one-shot form of `TileProgram.run`.
"""
from __future__ import annotations

import math as pymath
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
from xdsl.dialects import arith, func, math, scf
from xdsl.dialects.builtin import DenseIntOrFPElementsAttr, MemRefType, ModuleOp, TensorType
from xdsl.ir import Attribute, Block, Operation, SSAValue
from xdsl.traits import IsTerminator

from tessera import dtypes
from tessera.dims import launch_grid
from tessera.errors import DeviceAssertError, TesseraError
from tessera.ir import provenance, tile

Frame = list
Step = Callable[[Frame], None]

# ---------------------------------------------------------------- element types

NP_DTYPES: dict[str, np.dtype] = {d.mlir: d.np for d in dtypes.ALL} | {
    "f64": np.dtype(np.float64), "i64": np.dtype(np.int64), "i16": np.dtype(np.int16),
    "i8": np.dtype(np.int8), "index": np.dtype(np.int64)}
"""MLIR element type (as printed) -> NumPy storage dtype."""

FLOAT_DTYPES = frozenset({d.np for d in dtypes.ALL if d.is_float} | {np.dtype(np.float64)})


def np_dtype(t: Attribute) -> np.dtype:
    """NumPy dtype of a scalar type or of a tensor/memref's elements."""
    element = t.get_element_type() if isinstance(t, TensorType | MemRefType) else t
    try:
        return NP_DTYPES[str(element)]
    except KeyError:
        raise TypeError(f"tile interpreter: unsupported element type {element}") from None


def compute_dtype(dt: np.dtype) -> np.dtype:
    """Where math on `dt` happens before rounding back: f32 for narrow floats, int64 for ints."""
    if dt in FLOAT_DTYPES:
        return np.promote_types(dt, np.float32)
    return dt if dt == np.bool_ else np.dtype(np.int64)


def poison(shape: Sequence[int], dt: np.dtype) -> np.ndarray:
    """A fresh buffer whose unwritten elements are conspicuous: NaN, or the integer minimum."""
    fill = np.nan if dt in FLOAT_DTYPES else (True if dt == np.bool_ else np.iinfo(dt).min)
    return np.full(tuple(shape), fill, dt)


# ---------------------------------------------------------------- numeric kernels


def _erf(x):
    """erf in float64: Maclaurin series below 0.5, the Numerical Recipes erfc fit
    (relative error < 1.2e-7 of erfc) above; within 2 f32 ulps, like CUDA's erff."""
    x = np.asarray(x, np.float64)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = 0.17087277
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
              0.37409196, 1.00002368, -1.26551223):
        poly = c + t * poly
    large = np.sign(x) * (1.0 - t * np.exp(-a * a + poly))
    x2, term, series = x * x, x, x
    for n in range(1, 12):
        term = term * -x2 / n
        series = series + term / (2 * n + 1)
    return np.where(a < 0.5, series * (2.0 / pymath.sqrt(pymath.pi)), large)


def _divsi(a, b):
    """Signed division rounding toward zero (C semantics, unlike NumPy's floor division)."""
    return (a - np.fmod(a, b)) // b


def _ceildivsi(a, b):
    return -(np.negative(a) // b)


FLOAT_FNS: dict[type[Operation], Callable] = {
    arith.AddfOp: np.add, arith.SubfOp: np.subtract, arith.MulfOp: np.multiply,
    arith.DivfOp: np.divide, arith.NegfOp: np.negative,
    arith.MaximumfOp: np.maximum, arith.MinimumfOp: np.minimum,
    arith.MaxnumfOp: np.fmax, arith.MinnumfOp: np.fmin,
    math.ExpOp: np.exp, math.Exp2Op: np.exp2, math.ExpM1Op: np.expm1,
    math.LogOp: np.log, math.Log2Op: np.log2, math.Log10Op: np.log10, math.Log1pOp: np.log1p,
    math.TanhOp: np.tanh, math.SinOp: np.sin, math.CosOp: np.cos, math.TanOp: np.tan,
    math.AtanOp: np.arctan, math.Atan2Op: np.arctan2,
    math.SqrtOp: np.sqrt, math.RsqrtOp: lambda x: np.reciprocal(np.sqrt(x)),
    math.AbsFOp: np.abs, math.ErfOp: _erf, math.PowFOp: np.power, math.CopySignOp: np.copysign,
    math.FloorOp: np.floor, math.CeilOp: np.ceil, math.TruncOp: np.trunc, math.RoundEvenOp: np.rint,
    math.RoundOp: lambda x: np.copysign(np.floor(np.abs(x) + 0.5), x),
    math.FmaOp: lambda a, b, c: np.multiply(a, b, dtype=np.float64) + c,
    tile.RemFOp: np.fmod,
}
"""Float elementwise ops: computed in `compute_dtype`, rounded to the result dtype."""

INT_FNS: dict[type[Operation], Callable] = {
    arith.AddiOp: np.add, arith.SubiOp: np.subtract, arith.MuliOp: np.multiply,
    arith.DivSIOp: _divsi, arith.RemSIOp: np.fmod, arith.CeilDivSIOp: _ceildivsi,
    arith.FloorDivSIOp: np.floor_divide, arith.MinSIOp: np.minimum, arith.MaxSIOp: np.maximum,
    arith.AndIOp: np.bitwise_and, arith.OrIOp: np.bitwise_or, arith.XOrIOp: np.bitwise_xor,
    arith.ShLIOp: np.left_shift, arith.ShRSIOp: np.right_shift, math.AbsIOp: np.abs,
}
"""Integer elementwise ops: computed in the operands' dtype (wrapping like the hardware)."""

CASTS = (arith.ExtFOp, arith.TruncFOp, arith.SIToFPOp, arith.FPToSIOp, arith.IndexCastOp,
         arith.ExtSIOp, arith.TruncIOp, tile.SIToFPOp, tile.FPToSIOp)
"""Conversions: NumPy/ml_dtypes `astype` (round to nearest even; float -> int truncates)."""


def _ordered(cmp):
    return lambda a, b: cmp(a, b) & ~(np.isnan(a) | np.isnan(b))


def _unordered(cmp):
    return lambda a, b: cmp(a, b) | np.isnan(a) | np.isnan(b)


CMPF: dict[str, Callable] = {
    "false": lambda a, b: np.zeros(np.broadcast(a, b).shape, np.bool_),
    "oeq": np.equal, "ogt": np.greater, "oge": np.greater_equal, "olt": np.less, "ole": np.less_equal,
    "one": _ordered(np.not_equal), "ord": lambda a, b: ~(np.isnan(a) | np.isnan(b)),
    "ueq": _unordered(np.equal), "ugt": _unordered(np.greater), "uge": _unordered(np.greater_equal),
    "ult": _unordered(np.less), "ule": _unordered(np.less_equal), "une": np.not_equal,
    "uno": lambda a, b: np.isnan(a) | np.isnan(b),
    "true": lambda a, b: np.ones(np.broadcast(a, b).shape, np.bool_),
}
"""arith.cmpf predicates (NumPy's ordered comparisons are already false on NaN)."""

CMPI: dict[str, tuple[Callable, bool]] = {
    "eq": (np.equal, False), "ne": (np.not_equal, False),
    "slt": (np.less, False), "sle": (np.less_equal, False),
    "sgt": (np.greater, False), "sge": (np.greater_equal, False),
    "ult": (np.less, True), "ule": (np.less_equal, True),
    "ugt": (np.greater, True), "uge": (np.greater_equal, True),
}
"""arith.cmpi predicates: (comparison, compare as unsigned)."""

REDUCERS: dict[str, Callable] = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}


# ---------------------------------------------------------------- frames and compiled code

PID_SLOTS = (0, 1, 2)
ASYNC_SLOT = 3
CLUSTER_SLOT = 4
RESERVED_SLOTS = 5
"""Frame layout: program ids along axes 0..2, this program's async-copy queue, its cluster (a
`Cluster` and its rank there, or None), then SSA values."""


class Cluster:
    """The blocks of one thread-block cluster, each running on its own thread: a cluster gather's
    values meet here, and each block waits for all of them twice, once before reading them and
    once before any may overwrite its value with the next gather's."""

    #: seconds a block waits for the others at a gather before the launch is taken to be wrong
    #: (blocks of one cluster that gather different numbers of times: a miscompile), not hung
    PATIENCE = 600.0

    def __init__(self, size: int):
        self.values: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=self.PATIENCE)
        self.done = 0   # (blocks that ran to their end: none may still gather)

    def finished(self) -> None:
        """A block ran to its end: any other still waiting at a gather would wait for ever."""
        self.done += 1
        if self.barrier.n_waiting:
            self.barrier.abort()

    def exchange(self, rank: int, values: list) -> list[list]:
        """Every block's `values`, in rank order, once all gave them."""
        if self.done:
            raise TesseraError("a block of the cluster gathered after another had ended: the blocks of a "
                               "cluster must run every tile.cluster_gather alike")
        self.values[rank] = values
        self.barrier.wait()
        result = list(self.values)
        self.barrier.wait()
        return result


class AsyncCopies:
    """In-flight `tile.copy_async`s of one program: the open group and committed groups."""

    __slots__ = ("open", "committed")

    def __init__(self):
        self.open: list[tuple[np.ndarray, int, np.ndarray]] = []
        self.committed: deque[list[tuple[np.ndarray, int, np.ndarray]]] = deque()

    def commit(self) -> None:
        self.committed.append(self.open)
        self.open = []

    def wait(self, pending: int) -> None:
        while len(self.committed) > pending:
            for dst, stage, data in self.committed.popleft():
                dst[stage] = data


class CompiledBlock:
    """One xDSL block as straight-line closures; `results` are its terminator's operand slots."""

    __slots__ = ("steps", "ops", "results")

    def __init__(self, steps: list[Step], ops: list[Operation], results: list[int]):
        self.steps, self.ops, self.results = steps, ops, results

    def run(self, f: Frame) -> None:
        step = None
        try:
            for step in self.steps:
                step(f)
        except Exception as e:
            op = self.ops[self.steps.index(step)]
            e.add_note(f"  in {op.name} ({', '.join(str(r.type) for r in op.results) or 'no results'})")
            raise


class CompiledFunction:
    """A compiled `tile.kernel` or host `func.func`: its frame size, argument slots and body."""

    def __init__(self, name: str, arg_types: Sequence[Attribute], nslots: int, arg_slots: list[int],
                 body: CompiledBlock, cluster: int = 1):
        self.name, self.arg_types, self.nslots = name, tuple(arg_types), nslots
        self.arg_slots, self.body, self.cluster = arg_slots, body, cluster

    def frame(self, args: Sequence) -> Frame:
        """A frame holding the (checked and converted) arguments."""
        if len(args) != len(self.arg_types):
            raise TypeError(f"@{self.name} takes {len(self.arg_types)} arguments, got {len(args)}")
        f = [None] * self.nslots
        for i, (slot, value, t) in enumerate(zip(self.arg_slots, args, self.arg_types)):
            f[slot] = _argument(self.name, i, value, t)
        return f

    def run(self, args: Sequence, pid: tuple[int, int, int] = (0, 0, 0)) -> list:
        """Run once as program `pid`; returns the values of the final return."""
        with np.errstate(all="ignore"):  # inf/NaN/wrap-around are results on a GPU, not errors
            return self._run(self.frame(args), pid)

    def launch(self, args: Sequence, grid: Sequence[int]) -> None:
        """Run every program of `grid`, axis 0 fastest; a cluster's blocks together."""
        base = self.frame(args)
        gx, gy, gz = grid
        if gx % self.cluster:
            raise TesseraError(f"@{self.name}: a grid of {gx} blocks along axis 0 is not whole clusters of "
                               f"{self.cluster}")
        with np.errstate(all="ignore"):
            for z in range(gz):
                for y in range(gy):
                    for x in range(0, gx, self.cluster):
                        if self.cluster == 1:
                            self._run(base.copy(), (x, y, z))
                        else:
                            self._run_cluster(base, (x, y, z))

    def _run_cluster(self, base: Frame, first: tuple[int, int, int]) -> None:
        """The blocks of the cluster starting at program `first`, each on a thread; the first
        error raised in any of them (the others, left waiting at its barrier, are released)."""
        cluster, errors, broken = Cluster(self.cluster), [], []

        def block(rank: int) -> None:
            try:
                with np.errstate(all="ignore"):
                    self._run(base.copy(), (first[0] + rank, first[1], first[2]), (cluster, rank))
                cluster.finished()
            except threading.BrokenBarrierError:
                broken.append(rank)
            except BaseException as e:   # (re-raised on the launching thread)
                errors.append(e)
                cluster.barrier.abort()
        threads = [threading.Thread(target=block, args=(rank,)) for rank in range(self.cluster)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        if broken:
            raise TesseraError(f"@{self.name}: blocks {broken} of the cluster from program {first} waited at a "
                               f"tile.cluster_gather the others never reached: the blocks of a cluster must run "
                               f"every gather alike")

    def _run(self, f: Frame, pid: tuple[int, int, int], cluster: tuple[Cluster, int] | None = None) -> list:
        f[0], f[1], f[2] = (np.int64(p) for p in pid)
        f[ASYNC_SLOT] = AsyncCopies()
        f[CLUSTER_SLOT] = cluster
        try:
            self.body.run(f)
        except Exception as e:
            e.add_note(f"  in @{self.name}, program id {tuple(pid)}")
            raise
        return [f[s] for s in self.body.results]


def _argument(fn: str, i: int, value, t: Attribute):
    """Check an array argument against its memref type; convert a scalar to its NumPy type."""
    dt = np_dtype(t)
    if not isinstance(t, MemRefType):
        return dt.type(value)
    if not isinstance(value, np.ndarray) or not _fits(value.shape, t.get_shape()) or value.dtype != dt:
        got = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise TypeError(f"@{fn} argument {i}: expected a {dt}{list(t.get_shape())} array for {t}, got {got}")
    return value


def _fits(shape: Sequence[int], declared: Sequence[int]) -> bool:
    """An array's shape against a memref's, whose dynamic dims (`?`) take any size."""
    return len(shape) == len(declared) and all(d == tile.DYNAMIC or n == d for n, d in zip(shape, declared))


# ---------------------------------------------------------------- the compiler


class Compiler:
    """Assigns frame slots to SSA values and turns ops into closures via BUILDERS."""

    def __init__(self, program: TileProgram):
        self.program = program
        self.slots: dict[SSAValue, int] = {}
        self.nslots = RESERVED_SLOTS

    def slot(self, v: SSAValue) -> int:
        if v not in self.slots:
            self.slots[v] = self.nslots
            self.nslots += 1
        return self.slots[v]

    def ins(self, op: Operation) -> list[int]:
        return [self.slot(v) for v in op.operands]

    def out(self, op: Operation) -> int:
        return self.slot(op.results[0])

    def block(self, block: Block) -> CompiledBlock:
        steps, ops = [], []
        body = list(block.ops)
        terminator = body.pop() if body and body[-1].has_trait(IsTerminator) else None
        for op in body:
            builder = BUILDERS.get(type(op))
            if builder is None:
                raise TesseraError(f"tile interpreter: no handler for {op.name}")
            step = builder(self, op)
            if step is not None:
                steps.append(step)
                ops.append(op)
        results = self.ins(terminator) if terminator is not None else []
        return CompiledBlock(steps, ops, results)

    def function(self, name: str, block: Block, cluster: int = 1) -> CompiledFunction:
        arg_slots = [self.slot(a) for a in block.args]
        body = self.block(block)
        return CompiledFunction(name, block.arg_types, self.nslots, arg_slots, body, cluster)


def _apply(fn: Callable, ins: list[int], out: int) -> Step:
    """A step computing `f[out] = fn(*f[ins])`, specialised by arity to avoid per-call packing."""
    match ins:
        case [a]:
            def step(f): f[out] = fn(f[a])
        case [a, b]:
            def step(f): f[out] = fn(f[a], f[b])
        case [a, b, c]:
            def step(f): f[out] = fn(f[a], f[b], f[c])
        case _:
            def step(f): f[out] = fn(*[f[i] for i in ins])
    return step


def _float_builder(fn: Callable):
    def build(c: Compiler, op: Operation) -> Step:
        rd = np_dtype(op.results[0].type)
        cd = compute_dtype(rd)
        if cd == rd:
            return _apply(lambda *xs: fn(*xs).astype(rd, copy=False), c.ins(op), c.out(op))
        return _apply(lambda *xs: fn(*[x.astype(cd) for x in xs]).astype(rd), c.ins(op), c.out(op))
    return build


def _int_builder(fn: Callable):
    def build(c: Compiler, op: Operation) -> Step:
        rd = np_dtype(op.results[0].type)
        return _apply(lambda *xs: fn(*xs).astype(rd, copy=False), c.ins(op), c.out(op))
    return build


def _cast(c: Compiler, op: Operation) -> Step:
    rd = np_dtype(op.results[0].type)
    return _apply(lambda x: x.astype(rd), c.ins(op), c.out(op))


def _constant(c: Compiler, op: arith.ConstantOp) -> Step:
    t, attr = op.result.type, op.value
    dt = np_dtype(t)
    if isinstance(attr, DenseIntOrFPElementsAttr):
        value = np.array(attr.get_values()).astype(dt).reshape(t.get_shape())
        value.flags.writeable = False  # shared by every program: steps never write into tiles
    else:
        value = dt.type(attr.value.data)
    out = c.out(op)

    def step(f): f[out] = value
    return step


def _cmpf(c: Compiler, op: arith.CmpfOp) -> Step:
    cmp = CMPF[arith.CMPF_COMPARISON_OPERATIONS[op.predicate.value.data]]
    cd = compute_dtype(np_dtype(op.lhs.type))
    return _apply(lambda a, b: cmp(a.astype(cd, copy=False), b.astype(cd, copy=False)), c.ins(op), c.out(op))


def _cmpi(c: Compiler, op: arith.CmpiOp) -> Step:
    cmp, unsigned = CMPI[arith.CMPI_COMPARISON_OPERATIONS[op.predicate.value.data]]
    dt = np_dtype(op.lhs.type)
    if not unsigned or dt == np.bool_:
        return _apply(cmp, c.ins(op), c.out(op))
    ud = np.dtype(f"u{dt.itemsize}")
    return _apply(lambda a, b: cmp(a.astype(ud), b.astype(ud)), c.ins(op), c.out(op))


def _select(c: Compiler, op: arith.SelectOp) -> Step:
    if isinstance(op.result.type, TensorType):
        return _apply(np.where, c.ins(op), c.out(op))
    return _apply(lambda cond, a, b: a if cond else b, c.ins(op), c.out(op))


def _for(c: Compiler, op: scf.ForOp) -> Step:
    lb, ub, st = c.slot(op.lb), c.slot(op.ub), c.slot(op.step)
    iv_type = np_dtype(op.lb.type).type
    iv, *carried = [c.slot(a) for a in op.body.block.args]
    inits, outs = [c.slot(v) for v in op.iter_args], [c.slot(r) for r in op.results]
    body = c.block(op.body.block)
    run, yields = body.run, body.results

    def step(f):
        values = [f[i] for i in inits]
        for i in range(int(f[lb]), int(f[ub]), int(f[st])):
            f[iv] = iv_type(i)
            for s, v in zip(carried, values):
                f[s] = v
            run(f)
            values = [f[y] for y in yields]
        for s, v in zip(outs, values):
            f[s] = v
    return step


def _if(c: Compiler, op: scf.IfOp) -> Step:
    cond, outs = c.slot(op.cond), [c.slot(r) for r in op.results]
    then = c.block(op.true_region.block)
    other = c.block(op.false_region.block) if op.false_region.blocks else CompiledBlock([], [], [])

    def step(f):
        branch = then if f[cond] else other
        branch.run(f)
        for s, v in zip(outs, [f[y] for y in branch.results]):
            f[s] = v
    return step


# ---------------------------------------------------------------- tile ops


class Window:
    """Where a tile sits in a memref, precomputed per op so each execution only clips offsets.

    Tile axis p runs along memref dim `tile_dims[p]`; memref dims not in
    `tile_dims` are indexed by their offset alone.
    """

    def __init__(self, tile_dims: Sequence[int], tile_shape: Sequence[int], rank: int):
        self.tile_shape = tuple(tile_shape)
        self.axis_of = [tile_dims.index(d) if d in tile_dims else -1 for d in range(rank)]
        order = sorted(tile_dims)
        to_tile = [order.index(d) for d in tile_dims]
        identity = to_tile == sorted(to_tile)
        self.to_tile = None if identity else to_tile
        self.to_memref = None if identity else list(np.argsort(to_tile))

    def clip(self, shape: Sequence[int], offsets: Sequence) -> tuple[tuple, tuple, bool] | None:
        """(memref index, tile index, whole tile in bounds), or None when nothing is in bounds (along
        the tiled dims: an untiled dim's offset must be inside it, as the GPU never checks it)."""
        src, dst, whole = [], [slice(None)] * len(self.tile_shape), True
        offsets = [int(o) for o in offsets]
        for n, o, p in zip(shape, offsets, self.axis_of):
            if p < 0:
                src.append(o)
                continue
            size = self.tile_shape[p]
            lo, hi = max(o, 0), min(o + size, n)
            if lo >= hi:   # every element masked along a tiled dim: the GPU touches no address
                return None
            src.append(slice(lo, hi))
            dst[p] = slice(lo - o, hi - o)
            whole = whole and lo == o and hi == o + size
        for n, o, p in zip(shape, offsets, self.axis_of):
            if p < 0 and not 0 <= o < n:   # a dim the tile does not span: the PTX backend checks no bound
                raise IndexError(f"offset {o} of a dim of size {n} that the tile does not span: only "
                                 f"tiled dims are bounds-checked on the GPU")
        return tuple(src), tuple(dst), whole

    def read(self, src: np.ndarray, offsets: Sequence, padded: np.ndarray) -> np.ndarray:
        """The tile at `offsets`; out-of-bounds elements come from `padded` (a padding-filled tile)."""
        clipped = self.clip(src.shape, offsets)
        if clipped is None:
            return padded.copy()
        index, tile_index, whole = clipped
        block = src[index] if self.to_tile is None else src[index].transpose(self.to_tile)
        if whole:
            return block.copy()
        out = padded.copy()
        out[tile_index] = block
        return out

    def write(self, dst: np.ndarray, offsets: Sequence, value: np.ndarray, add: bool = False) -> None:
        """Store the in-bounds part of `value` at `offsets` (`add`: add it to what is there)."""
        clipped = self.clip(dst.shape, offsets)
        if clipped is None:
            return
        index, tile_index, _ = clipped
        part = value[tile_index]
        part = part if self.to_memref is None else part.transpose(self.to_memref)
        if add:
            dst[index] += part
        else:
            dst[index] = part


def _padded(shape: Sequence[int], padding: float, dt: np.dtype) -> np.ndarray:
    return np.full(tuple(shape), padding, dt)


def _load(c: Compiler, op: tile.LoadOp) -> Step:
    shape = op.result.type.get_shape()
    window = Window(tile.int_values(op.tile_dims), shape, op.src.type.get_num_dims())
    padded = _padded(shape, op.padding.value.data, np_dtype(op.result.type))
    src, offs, out = c.slot(op.src), [c.slot(v) for v in op.offsets], c.out(op)

    def step(f): f[out] = window.read(f[src], [f[o] for o in offs], padded)
    return step


def _load_index(c: Compiler, op: tile.LoadIndexOp) -> Step:
    window = Window((), (), op.src.type.get_num_dims())
    src, offs, out = c.slot(op.src), [c.slot(v) for v in op.offsets], c.out(op)

    def step(f): f[out] = np.int64(window.read(f[src], [f[o] for o in offs], np.zeros((), np.int32)))
    return step


def _load_index_reduce(c: Compiler, op: tile.LoadIndexReduceOp) -> Step:
    axis, count, reduce = op.axis.value.data, op.count.value.data, {"min": np.min, "max": np.max}[op.kind.data]
    src, offs, out = c.slot(op.src), [c.slot(v) for v in op.offsets], c.out(op)

    def step(f):
        index = [int(f[o]) for o in offs]
        run = f[src][(*index[:axis], slice(index[axis], index[axis] + count), *index[axis + 1:])]
        f[out] = np.int64(reduce(run))
    return step


def _load_gather(c: Compiler, op: tile.LoadGatherOp) -> Step:
    axis, dt = op.axis.value.data, np_dtype(op.result.type)
    src, index, offs, out = c.slot(op.src), c.slot(op.index), [c.slot(v) for v in op.offsets], c.out(op)

    def step(f):
        rows, x = f[index].astype(np.int64), f[src]
        inside = (rows >= 0) & (rows < x.shape[axis])
        at = tuple(np.where(inside, rows, 0) if d == axis else np.full(rows.shape, int(f[o]))
                   for d, o in enumerate(offs))
        f[out] = np.where(inside, x[at], np.zeros((), dt)).astype(dt) if x.size else np.zeros(rows.shape, dt)
    return step


def _store(c: Compiler, op: tile.StoreOp) -> Step:
    window = Window(tile.int_values(op.tile_dims), op.value.type.get_shape(), op.dst.type.get_num_dims())
    val, dst, offs = c.slot(op.value), c.slot(op.dst), [c.slot(v) for v in op.offsets]

    def step(f): window.write(f[dst], [f[o] for o in offs], f[val])
    return step


def _atomic_add(c: Compiler, op: tile.AtomicAddOp) -> Step:
    window = Window(tile.int_values(op.tile_dims), op.value.type.get_shape(), op.dst.type.get_num_dims())
    val, dst, offs = c.slot(op.value), c.slot(op.dst), [c.slot(v) for v in op.offsets]

    def step(f): window.write(f[dst], [f[o] for o in offs], f[val], add=True)
    return step


def _store_shared(c: Compiler, op: tile.StoreSharedOp) -> Step:
    val, dst, stage = c.slot(op.value), c.slot(op.dst), c.slot(op.stage)

    def step(f): f[dst][int(f[stage])] = f[val]
    return step


def _copy_async(c: Compiler, op: tile.CopyAsyncOp) -> Step:
    shape = op.tile_shape
    window = Window(tile.int_values(op.tile_dims), shape, op.src.type.get_num_dims())
    padded = _padded(shape, op.padding.value.data, np_dtype(op.dst.type))
    src, dst, stage = c.slot(op.src), c.slot(op.dst), c.slot(op.stage)
    offs = [c.slot(v) for v in op.offsets]
    start, count = op.rows
    rows = slice(start, start + count)

    def step(f):
        data = window.read(f[src], [f[o] for o in offs], padded)
        f[ASYNC_SLOT].open.append((f[dst], (f[stage], rows), data))
    return step


def _async_commit(c: Compiler, op: tile.AsyncCommitOp) -> Step:
    def step(f): f[ASYNC_SLOT].commit()
    return step


def _async_wait(c: Compiler, op: tile.AsyncWaitOp) -> Step:
    pending = op.pending.value.data

    def step(f): f[ASYNC_SLOT].wait(pending)
    return step


def _fresh(c: Compiler, op: tile.AllocSharedOp | tile.AllocGlobalOp) -> Step:
    if tile.is_dynamic_memref(op.result.type):
        return _fresh_dynamic(c, op)
    template = poison(op.result.type.get_shape(), np_dtype(op.result.type))
    out = c.out(op)

    def step(f): f[out] = template.copy()
    return step


def _fresh_dynamic(c: Compiler, op: tile.AllocGlobalOp) -> Step:
    """A global buffer whose dynamic dim is the size of the host argument's of the same dim name
    (`tile.BUFFER_DIMS`)."""
    host = op.parent_op()
    names = [a.data for a in host.attributes[tile.BUFFER_DIMS].data]
    arg = host.body.block.args[names.index(op.attributes[tile.BUFFER_DIMS].data)]
    src, axis = c.slot(arg), arg.type.get_shape().index(tile.DYNAMIC)
    shape, dt, out = op.result.type.get_shape(), np_dtype(op.result.type), c.out(op)

    def step(f): f[out] = poison(tuple(f[src].shape[axis] if n == tile.DYNAMIC else n for n in shape), dt)
    return step


def _dim(c: Compiler, op: tile.DimOp) -> Step:
    axis = op.axis.value.data
    return _apply(lambda buf: np.int64(buf.shape[axis]), c.ins(op), c.out(op))


def _extract(c: Compiler, op: tile.ExtractOp) -> Step:
    return _apply(lambda x: x[()], c.ins(op), c.out(op))


def _view(c: Compiler, op: tile.ViewOp) -> Step:
    shape = tuple(-1 if n == tile.DYNAMIC else n for n in op.result.type.get_shape())
    return _apply(lambda buf: buf.reshape(shape), c.ins(op), c.out(op))


def _load_shared(c: Compiler, op: tile.LoadSharedOp) -> Step:
    return _apply(lambda buf, stage: buf[stage].copy(), c.ins(op), c.out(op))


def _mma(c: Compiler, op: tile.MmaOp) -> Step:
    rd = np_dtype(op.acc.type)
    cd = np.promote_types(compute_dtype(np_dtype(op.a.type)), compute_dtype(rd))
    transpose_a, transpose_b = op.transpose_a is not None, op.transpose_b is not None

    def mma(a, b, acc):
        a, b = a.astype(cd, copy=False), b.astype(cd, copy=False)
        return (acc.astype(cd, copy=False) + (a.T if transpose_a else a) @ (b.T if transpose_b else b)).astype(rd)
    return _apply(mma, c.ins(op), c.out(op))


def _reduce(c: Compiler, op: tile.ReduceOp) -> Step:
    reducer, axis = REDUCERS[op.kind.data], op.axis.value.data
    rd = np_dtype(op.result.type)
    cd = compute_dtype(rd)
    return _apply(lambda x: np.asarray(reducer(x.astype(cd, copy=False), axis=axis)).astype(rd),
                  c.ins(op), c.out(op))


def _cluster_gather(c: Compiler, op: tile.ClusterGatherOp) -> Step:
    xs, outs = c.ins(op), [c.slot(r) for r in op.gathered]

    def step(f):
        if f[CLUSTER_SLOT] is None:
            raise TesseraError("tile.cluster_gather in a kernel launched without a cluster (tile.CLUSTER)")
        cluster, rank = f[CLUSTER_SLOT]
        blocks = cluster.exchange(rank, [f[x] for x in xs])
        for i, out in enumerate(outs):   # (operand i // size of block i % size)
            f[out] = blocks[i % len(blocks)][i // len(blocks)]
    return step


def _broadcast(c: Compiler, op: tile.BroadcastOp) -> Step:
    shape = op.result.type.get_shape()
    expanded = [1] * len(shape)
    for size, d in zip(tile.static_shape(op.x.type), tile.int_values(op.dims)):
        expanded[d] = size
    return _apply(lambda x: np.broadcast_to(np.reshape(x, expanded), shape), c.ins(op), c.out(op))


def _arange(c: Compiler, op: tile.ArangeOp) -> Step:
    base = np.arange(op.result.type.get_shape()[0], dtype=np.int32)
    return _apply(lambda start: base + np.int32(start), c.ins(op), c.out(op))


def _program_id(c: Compiler, op: tile.ProgramIdOp) -> None:
    """No step: the result simply names the frame slot holding the program id."""
    c.slots[op.result] = PID_SLOTS[op.axis.value.data]


def _no_op(c: Compiler, op: Operation) -> None:
    """A program runs on one Python thread, so a block-wide barrier has nothing to order."""


def _assert(c: Compiler, op: tile.AssertOp) -> Step:
    cond, message = c.slot(op.cond), op.message.data
    loc = provenance.loc_of(op)

    def step(f):
        ok = f[cond]
        if not np.all(ok):
            element = tuple(int(i) for i in np.argwhere(~ok)[0]) if np.ndim(ok) else None
            raise DeviceAssertError(message, str(loc) if loc else None,
                                    block=tuple(int(f[s]) for s in PID_SLOTS), element=element)
    return step


def _profile_stamp(which: int):
    """A step writing host nanoseconds into stamp `which` (0: begin, 1: end) of the op's slot for this program."""
    def build(c: Compiler, op: tile.ProfileBeginOp | tile.ProfileEndOp) -> Step:
        buffer, slot, words = c.slot(op.buffer), op.slot.value.data, slice(2 * which, 2 * which + 2)

        def step(f): f[buffer][f[2], f[1], f[0], slot, words] = np.array([time.perf_counter_ns()]).view(np.int32)
        return step
    return build


def _launch(c: Compiler, op: tile.LaunchOp) -> Step:
    name = op.kernel.string_value()
    kernel = c.program.compiled(name, tile.KernelOp)
    grid, args = tile.int_values(op.grid), c.ins(op)
    labels = c.program.profile_labels(name)
    terms = op.dynamic_grid
    if terms:
        def sized(f):
            arrays = [f[a] for a in args]
            kernel.launch(arrays, launch_grid(grid, terms, [getattr(x, "shape", ()) for x in arrays]))
        return sized
    if labels is None:
        def step(f): kernel.launch([f[a] for a in args], grid)
        return step
    from tessera.runtime import profile

    def profiled(f):
        kernel.launch([f[a] for a in args], grid)
        profile.record(name, labels, f[args[-1]], "ns")   # the stamps are the kernel's last argument
    return profiled


BUILDERS: dict[type[Operation], Callable[[Compiler, Operation], Step | None]] = {
    **{cls: _float_builder(fn) for cls, fn in FLOAT_FNS.items()},
    **{cls: _int_builder(fn) for cls, fn in INT_FNS.items()},
    **{cls: _cast for cls in CASTS},
    arith.ConstantOp: _constant, arith.CmpfOp: _cmpf, arith.CmpiOp: _cmpi, arith.SelectOp: _select,
    tile.CmpfOp: _cmpf, tile.CmpiOp: _cmpi, tile.SelectOp: _select,
    scf.ForOp: _for, scf.IfOp: _if,
    tile.ProgramIdOp: _program_id, tile.DimOp: _dim, tile.ExtractOp: _extract, tile.LoadOp: _load, tile.LoadIndexOp: _load_index,
    tile.LoadIndexReduceOp: _load_index_reduce, tile.LoadGatherOp: _load_gather, tile.StoreOp: _store,
    tile.AllocSharedOp: _fresh, tile.AllocGlobalOp: _fresh, tile.ViewOp: _view, tile.CopyAsyncOp: _copy_async,
    tile.AsyncCommitOp: _async_commit, tile.AsyncWaitOp: _async_wait, tile.BarrierOp: _no_op,
    tile.MmaWaitOp: _no_op, tile.ReleaseStageOp: _no_op, tile.MmaTurnOp: _no_op,
    tile.LoadSharedOp: _load_shared, tile.StoreSharedOp: _store_shared, tile.AtomicAddOp: _atomic_add,
    tile.MmaOp: _mma, tile.ReduceOp: _reduce, tile.ClusterGatherOp: _cluster_gather,
    tile.BroadcastOp: _broadcast, tile.ArangeOp: _arange, tile.LaunchOp: _launch,
    tile.AssertOp: _assert, tile.ProfileBeginOp: _profile_stamp(0), tile.ProfileEndOp: _profile_stamp(1),
}
"""Op class -> builder(compiler, op) returning the op's step (None: nothing to do at run time)."""


# ---------------------------------------------------------------- entry points


class TileProgram:
    """A tile module ready to run; each kernel/function is compiled on first use and cached.

    `program(*arrays)` runs the module's only `func.func`; `run(name, *arrays)` a
    named one; `launch(kernel, grid, *args)` one kernel over a (gx, gy, gz) grid.
    Arrays must match the memref types exactly (shape and dtype) and are
    updated in place.
    """

    def __init__(self, module: ModuleOp):
        self.module = module
        self._symbols = {op.sym_name.data: op for op in module.ops
                         if isinstance(op, tile.KernelOp | func.FuncOp)}
        self._compiled: dict[str, CompiledFunction] = {}

    def compiled(self, name: str, kind: type[Operation]) -> CompiledFunction:
        """The compiled form of symbol `name`, which must be a `kind` op."""
        op = self._symbols.get(name)
        if not isinstance(op, kind):
            raise KeyError(f"no {kind.name} @{name} in this module; it has "
                           f"{', '.join('@' + s for s in self._symbols) or 'no symbols'}")
        if name not in self._compiled:
            cluster = tile.cluster_size(op) if isinstance(op, tile.KernelOp) else 1
            self._compiled[name] = Compiler(self).function(name, op.body.block, cluster)
        return self._compiled[name]

    def profile_labels(self, kernel: str) -> list[str] | None:
        """The profile slots' labels of a kernel built with profiling, else None."""
        attr = self._symbols[kernel].attributes.get(provenance.PROFILE)
        return [label.data for label in attr.data] if attr is not None else None

    def run(self, func_name: str, *args) -> list:
        """Run host function `func_name` (destination-passing: outputs are written into `args`)."""
        return self.compiled(func_name, func.FuncOp).run(args)

    def launch(self, kernel: str, grid: Sequence[int], *args) -> None:
        """Run `tile.kernel @kernel` for every program id of `grid` (1 to 3 sizes)."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.compiled(kernel, tile.KernelOp).launch(args, grid)

    def __call__(self, *args) -> list:
        hosts = [name for name, op in self._symbols.items() if isinstance(op, func.FuncOp)]
        if len(hosts) != 1:
            raise ValueError(f"module has host functions {hosts}; name one with run(name, ...)")
        return self.run(hosts[0], *args)


def run_host(module: ModuleOp, func_name: str, args: list[np.ndarray]) -> None:
    """Run host function `func_name` of `module` once; outputs are written into `args`."""
    TileProgram(module).run(func_name, *args)
