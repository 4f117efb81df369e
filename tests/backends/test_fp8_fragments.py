"""The 8-bit A fragments built from accumulator registers (`tensor_core._byte_a_fragments`: quad
shuffles and byte permutes), run instruction by instruction for the 32 lanes of a warp on the CPU
and compared with the PTX ISA's A layout of m16n8k32 / wgmma k32 (lane 4g + t holds columns 4t..4t+3
and 16+4t..19+4t of rows g and g + 8, a 32-bit register for each), from fp8 bytes (with junk in
their registers' high bytes, which nothing may read) and from f32 values narrowed two at a time."""
import re

import ml_dtypes
import numpy as np
import pytest
from xdsl.dialects.builtin import Float8E4M3FNType

from tessera.backends.ptx import tensor_core
from tessera.backends.ptx.types import ptx_type
from tessera.ir.layouts import Mma

E4M3 = ml_dtypes.float8_e4m3fn


class Recorder:
    """The KernelEmitter calls `_byte_a_fragments` makes, recording the instructions."""

    def __init__(self):
        self.count, self.code, self.state = 0, [], {}

    def new(self, ty):
        self.count += 1
        return f"%r{self.count}"

    def emit(self, line):
        self.code.append(line)

    at_entry = emit


def _permute(a: int, b: int, selector: int) -> int:
    source = (b << 32) | a
    return sum(((source >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _narrow(x: float) -> int:
    return int(np.float32(x).astype(E4M3).view(np.uint8))


def simulate(program: list[str], lanes: list[dict]) -> None:
    """Runs the instructions the fragments use, each on all 32 lanes (registers in `lanes`)."""
    for line in program:
        op, rest = line.rstrip(";").split(" ", 1)
        args = [a.strip() for a in re.split(r",\s*(?![^{]*\})", rest)]
        if op == "shfl.sync.idx.b32":
            values = [lane[args[1]] for lane in lanes]
            for lane in lanes:
                lane[args[0]] = values[lane[args[2]] & 31]
            continue
        for index, r in enumerate(lanes):
            def val(x):
                return index if x == "%tid.x" else r[x] if x.startswith("%") else int(x, 0)
            if op == "mov.b32" and args[1].startswith("{"):
                lo, hi = args[1].strip("{}").split(", ")
                r[args[0]] = (r[lo] & 0xFFFF) | ((r[hi] & 0xFFFF) << 16)
            elif op == "mov.u32":
                r[args[0]] = val(args[1])
            elif op == "and.b32":
                r[args[0]] = val(args[1]) & val(args[2])
            elif op == "mad.lo.u32":
                r[args[0]] = val(args[1]) * val(args[2]) + val(args[3])
            elif op == "or.b32":
                r[args[0]] = val(args[1]) | val(args[2])
            elif op == "setp.ge.u32":
                r[args[0]] = val(args[1]) >= val(args[2])
            elif op == "selp.b32":
                r[args[0]] = val(args[1]) if r[args[3]] else val(args[2])
            elif op == "prmt.b32":
                r[args[0]] = _permute(val(args[1]), val(args[2]), val(args[3]))
            elif op == "cvt.rn.satfinite.e4m3x2.f32":    # (d, a, b): a to the high byte, b to the low
                r[args[0]] = _narrow(r[args[2]]) | (_narrow(r[args[1]]) << 8)
            else:
                pytest.fail(f"the fragments use an instruction this simulation does not model: {line}")


@pytest.mark.parametrize("byte_a", [False, True], ids=["accumulator order", "byte_a order"])
@pytest.mark.parametrize("wide", [False, True], ids=["bytes", "f32 pairs"])
@pytest.mark.parametrize("cols", [32, 64, 128])
def test_fragments_hold_the_ptx_a_layout(cols, wide, byte_a):
    """Either order of the columns (`Mma.byte_a`: keys loaded permuted, whose layout's offsets and
    lane base 4t say where each column is), its fragments hold the A layout; byte_a's with no
    exchange between lanes."""
    layout = Mma((16, cols), 1, 1, byte_a=byte_a)
    lane_step = 4 if byte_a else 2
    n = len(layout.offsets)
    regs, wide_regs = [f"%a{i}" for i in range(n)], [f"%w{i}" for i in range(n)]
    p = np.random.default_rng(cols).uniform(0, 1, (16, cols)).astype(np.float32)
    p8 = p.astype(E4M3).view(np.uint8)
    lanes = [{} for _ in range(32)]
    for index, lane in enumerate(lanes):
        g, t = divmod(index, 4)
        for i, (r, c) in enumerate(layout.offsets):    # the accumulator layout: rows g (+8), columns 2t, 2t+1
            lane[regs[i]] = int(p8[r + g, c + lane_step * t]) | 0xAB00
            lane[wide_regs[i]] = float(p[r + g, c + lane_step * t])
    e = Recorder()
    tile = tensor_core.RegisterTile(regs, layout, ptx_type(Float8E4M3FNType()), wide_regs if wide else None)
    fragments = tensor_core._byte_a_fragments(e, tile, cols // 32)
    simulate(e.code, lanes)
    for kk in range(cols // 32):
        for index, lane in enumerate(lanes):
            g, t = divmod(index, 4)
            for word, (row, col) in zip(fragments[kk][0], ((g, 0), (g + 8, 0), (g, 16), (g + 8, 16))):
                want = [int(p8[row, 32 * kk + col + 4 * t + i]) for i in range(4)]
                assert [(lane[word] >> (8 * i)) & 0xFF for i in range(4)] == want, (kk, index, word)
    assert byte_a == (not any("shfl" in line for line in e.code))


@pytest.mark.parametrize("cols", [16, 48, 256])
def test_byte_a_order_is_a_permutation_within_each_16_columns(cols):
    """`Mma.byte_a`: over a warp's lanes, its registers hold every column once, each 16 columns
    within their own 16, in the order `TensorMapType.byte_a_rows` loads keys (box row 16h + 8g + 2t + e
    holds key 16h + 4t + 2g + e, and the accumulator's plain order holds box row 8 ni + 2t + c % 2)."""
    plain, permuted = Mma((16, cols), 1, 1), Mma((16, cols), 1, 1, byte_a=True)
    for t in range(4):
        for (_, c), (_, k) in zip(plain.offsets, permuted.offsets):
            row = c + 2 * t                                  # the box row the register holds
            h, g, tt, e = row // 16, row % 16 // 8, row % 8 // 2, row % 2
            assert k + 4 * t == 16 * h + 4 * tt + 2 * g + e
    keys = sorted({k + 4 * t for t in range(4) for _, k in permuted.offsets})
    assert keys == list(range(cols))
    with pytest.raises(ValueError, match="permutes each 16 columns"):
        Mma((16, 24), 1, 1, byte_a=True)
