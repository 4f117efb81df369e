"""Flash attention in the Tessera DSL: the seeds' example, and a causal variant.

    python -m tessera demo                                   # compile, run and check both
    tessera compile examples/flash_attention.py:flash_attention --shape B=2,H=4,S=1000,D=64 --dtype fp16

The fusion pass recognises matmul -> score modification -> softmax -> matmul
and emits one flash-attention kernel (online softmax, no S x S tensor in
memory); the causal mask is a score modification, so it fuses too.
"""
import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def flash_attention(q: Tensor["B", "H", "S", "D"], 
                   k: Tensor["B", "H", "S", "D"],
                   v: Tensor["B", "H", "S", "D"]) -> Tensor["B", "H", "S", "D"]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = tsr.matmul(q, k.transpose(-2, -1)) * scale
    probs = tsr.softmax(scores, dim=-1)
    return tsr.matmul(probs, v)


@tsr.function
def causal_flash_attention(q: Tensor["B", "H", "S", "D"],
                           k: Tensor["B", "H", "S", "D"],
                           v: Tensor["B", "H", "S", "D"]) -> Tensor["B", "H", "S", "D"]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = tsr.matmul(q, k.transpose(-2, -1)) * scale
    rows = tsr.arange(q.shape[-2])
    cols = tsr.arange(k.shape[-2])
    scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
    probs = tsr.softmax(scores, dim=-1)
    return tsr.matmul(probs, v)
