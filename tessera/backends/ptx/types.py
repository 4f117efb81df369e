"""PTX register types (`PtxType`: F32, F16, BF16, S32, PRED, U64), the type of an MLIR value's
registers (`ptx_type`), literals and instruction suffixes, and the backend's error
(`UnsupportedByBackend`: Target IR this backend has no form for yet, sm_100's tcgen05 say).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from xdsl.dialects.builtin import (
    BFloat16Type,
    Float8E4M3FNType,
    Float8E5M2Type,
    Float16Type,
    Float32Type,
    IndexType,
    IntegerType,
    MemRefType,
    TensorType,
)
from xdsl.ir import Attribute

from .. import UnsupportedByBackend  # noqa: F401  (the PTX backend's modules import it from here)


@dataclass(frozen=True)
class PtxType:
    reg: str        # register class prefix and declaration type: ("f", ".f32")
    decl: str
    op: str         # type suffix for arithmetic / ld / st
    bytes: int


F32 = PtxType("f", ".f32", "f32", 4)
F16 = PtxType("h", ".b16", "f16", 2)
BF16 = PtxType("hb", ".b16", "bf16", 2)
S32 = PtxType("r", ".b32", "s32", 4)
PRED = PtxType("p", ".pred", "pred", 1)
U64 = PtxType("rd", ".b64", "u64", 8)
#: a byte in a 16-bit register: how a bool (PRED) element is loaded from and stored to memory
B8 = PtxType("rs", ".b16", "u8", 1)
#: fp8 elements (OCP E4M3FN, E5M2): one byte in the low half of a 16-bit register; kernels only load,
#: store and convert them (`cvt ... .e4m3x2` / `.e5m2x2`, sm_89+), as the frontend allows no arithmetic on fp8
E4M3 = PtxType("q", ".b16", "e4m3", 1)
E5M2 = PtxType("qe", ".b16", "e5m2", 1)
FP8 = (E4M3, E5M2)


def ptx_type(t: Attribute) -> PtxType:
    element = t.get_element_type() if isinstance(t, (TensorType, MemRefType)) else t
    if isinstance(element, Float32Type):
        return F32
    if isinstance(element, Float16Type):
        return F16
    if isinstance(element, BFloat16Type):
        return BF16
    if isinstance(element, Float8E4M3FNType):
        return E4M3
    if isinstance(element, Float8E5M2Type):
        return E5M2
    if isinstance(element, IndexType):
        return S32
    if isinstance(element, IntegerType):
        return PRED if element.width.data == 1 else S32
    raise UnsupportedByBackend(f"PTX backend: element type {element} is not supported yet")


def f32_literal(x: float) -> str:
    return "0f" + struct.pack(">f", x).hex().upper()


def storage_suffix(ty: PtxType) -> str:
    return {F32: "f32", F16: "b16", BF16: "b16", S32: "b32", E4M3: "u8", E5M2: "u8"}[ty]


def vector_suffix(ty: PtxType, width: int) -> tuple[str, int]:
    """(ld/st type with vector prefix, registers packed per 32-bit word) for a run of `width` elements."""
    if ty.bytes < 4 and width * ty.bytes >= 4:
        pack = 4 // ty.bytes
        words = width // pack
        return (f"v{words}.b32" if words > 1 else "b32"), pack
    return (f"v{width}.{storage_suffix(ty)}" if width > 1 else storage_suffix(ty)), 1


def braced(regs: list[str]) -> str:
    """A vector operand's registers: {a, b, ..}, or the one register."""
    return regs[0] if len(regs) == 1 else "{" + ", ".join(regs) + "}"


def mov_suffix(ty: PtxType) -> str:
    return {F32: "f32", F16: "b16", BF16: "b16", S32: "b32", PRED: "pred", U64: "b64", E4M3: "b16",
            E5M2: "b16"}[ty]


def mov_constant(ty: PtxType, r: str, value: float) -> str:
    if ty is F32:
        return f"mov.f32 {r}, {f32_literal(value)};"
    if ty in (F16, BF16, *FP8):
        import numpy as np
        import ml_dtypes
        np_type = {F16: np.float16, BF16: ml_dtypes.bfloat16, E4M3: ml_dtypes.float8_e4m3fn,
                   E5M2: ml_dtypes.float8_e5m2}[ty]
        bits = np.array(value, dtype=np_type).view(np.uint16 if ty.bytes == 2 else np.uint8)
        return f"mov.b16 {r}, {int(bits)};"
    return f"mov.b32 {r}, {int(value)};"
