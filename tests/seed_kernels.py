"""The seeds' attention functions, shared by the tests that trace, fuse, lower and run them."""
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
def causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    s = tsr.where(i[:, None] >= i[None, :], s, -math.inf)
    return tsr.matmul(tsr.softmax(s, dim=-1), v)


@tsr.function
def alibi_attention(q: Tensor["B", "H", "Sq", "D"], k: Tensor["B", "H", "Sk", "D"], v: Tensor["B", "H", "Sk", "D"],
                    slopes: Tensor["H"]):
    s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    i = tsr.arange(q.shape[-2])
    j = tsr.arange(k.shape[-2])
    s = s + slopes[:, None, None] * (j[None, :] - i[:, None])
    return tsr.matmul(tsr.softmax(s, dim=-1), v)
