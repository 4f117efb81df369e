"""fp8 tensors in the PTX backend: loaded and stored a byte each, or 4 to 16 where a row's bytes
allow (packed into 32-bit words), widened with `cvt.rn.f16x2.e4m3x2` (or `.e5m2x2`) and narrowed
with `cvt.rn.satfinite...` plus the overflow the CPU interpreter gives; sm_89+."""
import re

import pytest

from fp8_cases import narrow, widen
from tessera.backends.ptx import UnsupportedByBackend, emit_module
from tessera.runtime.ptxas import assemble, find_tool

needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")
FP8 = ["fp8_e4m3", "fp8_e5m2"]
WIDE = ["fp32", "fp16", "bf16"]


def ptx_of(fn, dtype: str, arch: str = "sm_90a", columns: int = 130) -> str:
    compiled = fn.compile(fn.arg_specs_for(dict(N=61, C=columns), dtype), arch=arch)
    (kernel,) = emit_module(compiled.modules["target"]).values()
    return kernel.ptx


@needs_ptxas
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("wide", WIDE)
def test_fp8_casts_assemble_on_hopper(fp8, wide, tmp_path):
    kind = fp8.split("_")[1]
    up, down = ptx_of(widen(wide), fp8), ptx_of(narrow(fp8), wide)
    assert f"cvt.rn.f16x2.{kind}x2" in up and re.search(r"ld\.global\.u8", up)
    assert f"cvt.rn.satfinite.{kind}x2.f32" in down and re.search(r"st\.global\.u8", down)
    for ptx in (up, down):
        assemble(ptx, "sm_90a")


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_casts_are_refused_before_sm89_with_the_reason(fp8):
    with pytest.raises(UnsupportedByBackend, match="fp8 conversions .* need sm_89 or later; sm_80 has no fp8"):
        ptx_of(widen("fp32"), fp8, arch="sm_80")


@needs_ptxas
@pytest.mark.parametrize("columns,access", [(1024, "v4.b32"), (1000, "v2.b32"), (1004, "b32"), (1001, "u8"),
                                            (4, "b32"), (2, "u8")])
def test_fp8_rows_move_in_words_where_their_bytes_allow(columns, access):
    """Runs of 16, 8 or 4 bytes (a row length that many divide, rows aligned alike) load and store as
    32-bit words, bytes packed with prmt and unpacked with and/shr; other rows a byte at a time."""
    up, down = ptx_of(widen("fp32"), "fp8_e4m3", columns=columns), ptx_of(narrow("fp8_e4m3"), "fp32", columns=columns)
    assert re.search(rf"ld\.global\.{access} ", up) and re.search(rf"st\.global\.{access} ", down)
    for ptx in (up, down):
        assemble(ptx, "sm_90a")
