"""Element types, as one table.

Every layer (frontend, IR printers, interpreters, PTX emitter) looks dtypes up
here instead of branching on names, so adding a type is adding a row.
NumPy has no bf16/fp8; ml_dtypes provides them so the CPU interpreter computes
in the same storage formats the GPU does.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str          # user-facing and IR name: "fp16"
    mlir: str          # builtin MLIR element type: "f16"
    np: np.dtype       # storage dtype on the CPU
    bits: int
    is_float: bool
    ptx: str           # PTX register/storage type suffix: "f16", "b16", ...

    @property
    def itemsize(self) -> int:
        return max(1, self.bits // 8)

    @property
    def significand_bits(self) -> int:
        """A float's precision, its implicit leading bit included (fp32 24, fp16 11, bf16 8): a value
        rounded to it is off by at most 2^-(bits - 1) of itself, one unit in the last place."""
        if not self.is_float:
            raise TypeError(f"{self.name} is not a float type")
        return int(ml_dtypes.finfo(self.np).nmant) + 1

    def __repr__(self) -> str:
        return f"tessera.{self.name}"

    def __str__(self) -> str:
        return self.name


fp32 = DType("fp32", "f32", np.dtype(np.float32), 32, True, "f32")
fp16 = DType("fp16", "f16", np.dtype(np.float16), 16, True, "f16")
bf16 = DType("bf16", "bf16", np.dtype(ml_dtypes.bfloat16), 16, True, "bf16")
fp8_e4m3 = DType("fp8_e4m3", "f8E4M3FN", np.dtype(ml_dtypes.float8_e4m3fn), 8, True, "e4m3")
fp8_e5m2 = DType("fp8_e5m2", "f8E5M2", np.dtype(ml_dtypes.float8_e5m2), 8, True, "e5m2")
int32 = DType("int32", "i32", np.dtype(np.int32), 32, False, "s32")
bool_ = DType("bool", "i1", np.dtype(np.bool_), 1, False, "pred")

ALL = (fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int32, bool_)
#: the 8-bit floats: storage types, whose matmul product is fp32
FP8 = (fp8_e4m3, fp8_e5m2)
BY_NAME = {d.name: d for d in ALL}
BY_NAME.update({"float32": fp32, "float16": fp16, "half": fp16, "bfloat16": bf16, "i32": int32, "int": int32})
BY_MLIR = {d.mlir: d for d in ALL}
BY_NP = {d.np: d for d in ALL}
_TORCH_NAMES = {"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def lookup(x) -> DType:
    """Accept a DType, its name, a NumPy/ml_dtypes dtype, or a torch dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        if x in BY_NAME:
            return BY_NAME[x]
        if x in BY_MLIR:
            return BY_MLIR[x]
        raise TypeError(f"unknown dtype {x!r}; known: {', '.join(d.name for d in ALL)}")
    if type(x).__module__ == "torch":  # torch.float16, torch.int32, torch.bool, ...
        return lookup(_TORCH_NAMES.get(str(x).removeprefix("torch."), str(x).removeprefix("torch.")))
    try:
        return BY_NP[np.dtype(x)]
    except (TypeError, KeyError):
        raise TypeError(f"unsupported dtype {x!r}; Tessera supports {', '.join(d.name for d in ALL)}") from None


def promote(a: DType, b: DType) -> DType:
    """Result type of a binary op: the wider float wins; float beats int beats bool.

    Mixed fp16/bf16 promotes to fp32, as in PyTorch.
    """
    if a == b:
        return a
    if a.is_float and b.is_float:
        if {a, b} == {fp16, bf16}:
            return fp32
        return a if a.bits >= b.bits else b
    if a.is_float:
        return a
    if b.is_float:
        return b
    return int32
