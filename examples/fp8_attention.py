"""FP8 attention in the Tessera DSL: Q, K and V in e4m3 with per-tensor scales, as ordinary tensor math.

    tessera compile examples/fp8_attention.py:fp8_attention --shape B=2,H=4,S=1000,N=1000,D=128 --arch sm_90a
    tessera run examples/fp8_attention.py:causal_fp8_attention --shape B=1,H=2,S=130,N=257,D=64

The scores are the fp8 product Q @ K^T (fp32 accumulation) times the scales and 1/sqrt(D); the
probabilities are cast to e4m3 for the second product, as FlashAttention-3's FP8 forward does, and
the output is bf16. Fusion makes it one flash-attention kernel on fp8 tensor cores (wgmma m64nNk32
on sm_90a, mma.sync m16n8k32 on sm_89), plus a copy of V transposed to [B, H, D, N]
(`tessera.passes.byte_operands`: 8-bit tensor cores read both operands K-contiguous); a V passed
already transposed (`fp8_attention_vt`) needs no copy.
"""
import math

import tessera as tsr
from tessera import Tensor

E4M3 = tsr.fp8_e4m3
Q, K, V = Tensor["B", "H", "S", "D", E4M3], Tensor["B", "H", "N", "D", E4M3], Tensor["B", "H", "N", "D", E4M3]
SCALE, OUT = Tensor[1, tsr.fp32], Tensor["B", "H", "S", "D", tsr.bf16]


def scores(q, k, q_scale, k_scale):
    """The fp8 product Q @ K^T (fp32) times the scales and 1/sqrt(D)."""
    return tsr.matmul(q, k.transpose(-2, -1)) * (q_scale * k_scale * (1.0 / math.sqrt(q.shape[-1])))


def attend(scores, v, v_scale):
    """softmax(scores) @ V, the probabilities cast to e4m3, times V's scale, in bf16."""
    probs = tsr.softmax(scores, dim=-1)
    return (tsr.matmul(probs.to(tsr.fp8_e4m3), v) * v_scale).to(tsr.bf16)


@tsr.function
def fp8_attention(q: Q, k: K, v: V, q_scale: SCALE, k_scale: SCALE, v_scale: SCALE) -> OUT:
    return attend(scores(q, k, q_scale, k_scale), v, v_scale)


@tsr.function
def causal_fp8_attention(q: Q, k: K, v: V, q_scale: SCALE, k_scale: SCALE, v_scale: SCALE) -> OUT:
    """Causal, its diagonal at the bottom right (the last query sees every key) when N > S."""
    rows = tsr.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2])
    cols = tsr.arange(k.shape[-2])
    masked = tsr.where(rows[:, None] >= cols[None, :], scores(q, k, q_scale, k_scale), -math.inf)
    return attend(masked, v, v_scale)


@tsr.function
def fp8_attention_vt(q: Q, k: K, vt: Tensor["B", "H", "D", "N", E4M3], q_scale: SCALE, k_scale: SCALE,
                     v_scale: SCALE) -> OUT:
    """V passed transposed ([B, H, D, N], keys contiguous): the layout fp8 tensor cores read, no copy."""
    return attend(scores(q, k, q_scale, k_scale), vt.transpose(-2, -1), v_scale)
