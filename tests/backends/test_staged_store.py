"""The staged store's PTX, run lane by lane on the CPU (no GPU needed).

`emit_staged_store` writes an accumulator tile through a shared buffer per warp. A small interpreter
of the PTX it emits runs each warp's 32 lanes in lockstep, every accumulator register holding the
tile coordinate the Mma layout says it holds, and checks that each element of the tile inside the
tensor is written once at its own address, nothing else is written, each warp stays inside its own
buffer, and no lane reads what another lane wrote, or overwrites what another lane read,
without a warp barrier between.
"""
import math
import re
from dataclasses import dataclass

import pytest
from xdsl.dialects.builtin import MemRefType, bf16, f16, f32

import tessera as tsr
from tessera import Tensor
from tessera.backends.ptx.core import KernelEmitter
from tessera.backends.ptx.memory import emit_staged_store
from tessera.backends.ptx.paths import emitter_for
from tessera.backends.ptx.types import BF16, F16, F32
from tessera.ir.layouts import Mma
from tessera.ir import target as tgt
from tessera.ir import tile as t
from tessera.lowering.shared_memory import Staging

DST = 1 << 40   # the output tensor's address


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def fresh_emitter(warps: int) -> KernelEmitter:
    """An emitter of a real native kernel that has emitted nothing yet, with `warps` warps."""
    compiled = gemm.compile(gemm.arg_specs_for(dict(M=128, K=64, N=128), "fp16"), arch="sm_90a")
    kernel = next(op for op in compiled.modules["target"].ops if isinstance(op, tgt.KernelOp))
    e = emitter_for(kernel)
    e.threads, e.producer_threads = 32 * warps, 0
    return e


def accumulator_coords(layout: Mma, warp: int, lane: int) -> list[tuple[int, int]]:
    """Per register, the tile (row, col) it holds: layout.py's fragment formula, warps row-major
    over a wm x wn grid."""
    warp_rows, warp_cols = layout.warp_tile
    row0, col0 = warp // layout.wn * warp_rows, warp % layout.wn * warp_cols
    mi_n, ni_n = layout.fragments
    coords = [None] * (mi_n * ni_n * 4)
    for mi in range(mi_n):
        for ni in range(ni_n):
            for c in range(4):
                coords[layout.register(mi, ni, c)] = (row0 + 16 * mi + 8 * (c // 2) + lane // 4,
                                                      col0 + 8 * ni + 2 * (lane % 4) + c % 2)
    return coords


ARITH = {"and.b32": lambda a, b: a & b, "shr.u32": lambda a, b: a >> b, "shl.b32": lambda a, b: a << b,
         "sub.s32": lambda a, b: a - b, "add.s32": lambda a, b: a + b, "mul.lo.s32": lambda a, b: a * b,
         "add.s64": lambda a, b: a + b, "mul.wide.s32": lambda a, b: a * b}


class Warp:
    """32 lanes running the emitted lines in lockstep over a block's shared memory and the tensor."""

    def __init__(self, warp: int, lanes: list[dict], shared: dict, written: dict, buffer_bytes: int, elem: int):
        self.warp, self.lanes, self.shared, self.written, self.elem = warp, lanes, shared, written, elem
        self.slice = range(warp * buffer_bytes, (warp + 1) * buffer_bytes)
        self.segment_writes: dict[int, int] = {}   # shared byte -> lane, since the last warp barrier
        self.segment_reads: dict[int, set[int]] = {}   # shared byte -> lanes, since the last warp barrier

    def value(self, regs: dict, x: str):
        x = x.strip()
        if x.startswith("%"):
            return regs[x]
        return int(x)

    def run(self, line: str) -> None:
        if line.startswith("//"):
            return
        guard, opcode, args = re.match(r"(?:@(%p\d+) )?(\S+) ?(.*);$", line).groups()
        if opcode == "bar.warp.sync":
            self.segment_writes, self.segment_reads = {}, {}
            return
        for lane, regs in enumerate(self.lanes):
            if guard is None or regs[guard]:
                self.step(lane, regs, opcode, args)

    def step(self, lane: int, regs: dict, opcode: str, args: str) -> None:
        ops = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if opcode in ("mov.u32", "mov.s32", "mov.b64", "cvt.s64.s32"):
            regs[ops[0]] = self.warp * 32 + lane if ops[1] == "%tid.x" else self.value(regs, ops[1])
        elif opcode == "mov.b32":   # {lo, hi} -> one word holding both halves
            regs[ops[0]] = tuple(regs[r] for r in re.findall(r"%\w+", ops[1]))
        elif opcode in ARITH:
            regs[ops[0]] = ARITH[opcode](self.value(regs, ops[1]), self.value(regs, ops[2]))
        elif opcode in ("mad.lo.s32", "mad.wide.s32", "mad.lo.s64"):
            regs[ops[0]] = self.value(regs, ops[1]) * self.value(regs, ops[2]) + self.value(regs, ops[3])
        elif opcode == "setp.lt.s32":
            regs[ops[0]] = self.value(regs, ops[1]) < self.value(regs, ops[2])
        elif opcode == "and.pred":
            regs[ops[0]] = regs[ops[1]] and regs[ops[2]]
        elif opcode.startswith("st.shared"):
            base, off = re.match(r"\[(%\w+)\+(-?\d+)\]", ops[0]).groups()
            values = regs[ops[1]] if opcode == "st.shared.b32" else [regs[r] for r in re.findall(r"%\w+", ops[1])]
            self.store_shared(lane, regs[base] + int(off), values)
        elif opcode == "ld.shared.v4.b32":
            base, off = re.match(r"\[(%\w+)\+(\d+)\]", ops[1]).groups()
            regs[re.findall(r"%\w+", ops[0])[0]] = self.load_shared(lane, regs[base] + int(off))
        elif opcode == "st.global.v4.b32":
            base, off = re.match(r"\[(%\w+)\+(\d+)\]", ops[0]).groups()
            address = regs[base] + int(off)
            assert address % 16 == 0, f"unaligned 16-byte store at {address}"
            for i, value in enumerate(regs[re.findall(r"%\w+", ops[1])[0]]):
                assert address + i * self.elem not in self.written, f"element at {address} written twice"
                self.written[address + i * self.elem] = value
        else:
            raise AssertionError(f"the interpreter does not know {opcode}")

    def store_shared(self, lane: int, address: int, values) -> None:
        for i, value in enumerate(values):
            at = address + i * self.elem
            assert at in self.slice, f"warp {self.warp} writes shared byte {at}, outside its buffer"
            assert self.segment_reads.get(at, {lane}) <= {lane}, f"lane {lane} overwrites {at} before a barrier"
            self.shared[at] = value
            self.segment_writes[at] = lane

    def load_shared(self, lane: int, address: int) -> list:
        assert address % 16 == 0 and address in self.slice and address + 15 in self.slice
        out = []
        for at in range(address, address + 16, self.elem):
            assert self.segment_writes.get(at, lane) == lane, f"lane {lane} reads {at} without a barrier"
            self.segment_reads.setdefault(at, set()).add(lane)
            out.append(self.shared[at])
        return out


@dataclass(eq=False)
class Argument:
    """The stored tensor, as the kernel argument it is (a dynamic dim is read from its size param)."""
    type: MemRefType
    block: object
    index: int = 0


def run_staged_store(ty, tile, wm, wn, shape, offsets, dynamic: bool = False) -> dict[int, tuple[int, int]]:
    """{global byte address: tile coordinate written there} after every warp's staged store; with
    `dynamic`, the tensor's leading dim is taken at run time (`tile.DYNAMIC`, its size param %rows)."""
    layout = Mma(tile, wm, wn)
    staging = Staging.of(ty.bytes, layout.warp_tile[1])
    assert staging is not None
    e = fresh_emitter(wm * wn)
    regs = [f"%acc{i}" for i in range(len(layout.offsets))]
    declared = (t.DYNAMIC, *shape[1:]) if dynamic else shape
    dst = Argument(MemRefType({F16: f16, BF16: bf16, F32: f32}[ty], declared), e.kernel.body.block)
    e.env[dst], e.dim_regs[(0, 0)] = "%dst", "%rows"
    emit_staged_store(e, layout, ty, dst, regs, [f"%off{d}" for d in range(len(shape))], staging, 0)
    assert ("%rows" in "".join(e.lines + e.entry)) == (dynamic and len(shape) == 2)   # (a batch dim bounds nothing)
    shared, written = {}, {}
    for warp in range(wm * wn):
        lanes = [{"%dst": DST, "%rows": shape[0], e.smem_base(): 0, **{f"%off{d}": o for d, o in enumerate(offsets)},
                  **dict(zip(regs, accumulator_coords(layout, warp, lane)))} for lane in range(32)]
        runner = Warp(warp, lanes, shared, written, staging.buffer_bytes, ty.bytes)
        for line in [*(x for x in e.entry if "%rows" in x), *e.lines]:   # (the size param's row limits)
            runner.run(line.strip())
    return written


CASES = {   # (element type, tile, warps wm x wn, tensor shape, tile offsets)
    "gemm-128x256-fp16": (F16, (128, 256), 8, 1, (4096, 4096), (256, 512)),
    "tails-bf16": (BF16, (128, 256), 8, 1, (300, 1000), (256, 768)),
    "fp32-2x2-warps": (F32, (128, 128), 2, 2, (200, 136), (128, 128)),
    "batched": (F16, (64, 64), 1, 1, (3, 70, 40), (2, 64, 0)),
    "narrow-warp-tile": (F16, (128, 16), 8, 1, (1000, 40), (896, 32)),
    "fp32-narrow": (F32, (64, 32), 4, 1, (64, 32), (0, 0)),
    "dynamic-rows": (BF16, (128, 256), 8, 1, (300, 1000), (256, 768), True),
    "dynamic-batch": (F16, (64, 64), 1, 1, (3, 70, 40), (2, 64, 0), True),
}


@pytest.mark.parametrize("ty,tile,wm,wn,shape,offsets,dynamic", [(*c, False)[:7] for c in CASES.values()],
                         ids=CASES.keys())
def test_each_element_of_the_tile_lands_once_at_its_address(ty, tile, wm, wn, shape, offsets, dynamic):
    written = run_staged_store(ty, tile, wm, wn, shape, offsets, dynamic)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    batch = sum(o * s for o, s in zip(offsets[:-2], strides[:-2]))
    expected = {DST + ty.bytes * (batch + (offsets[-2] + r) * strides[-2] + offsets[-1] + c): (r, c)
                for r in range(tile[0]) for c in range(tile[1])
                if offsets[-2] + r < shape[-2] and offsets[-1] + c < shape[-1]}
    assert written == expected
