"""Decode attention in the Tessera DSL: a few new queries against a long key/value cache.

    tessera compile examples/decode_attention.py:gqa_decode_attention --shape B=1,Hk=8,G=4,M=1,N=131072,D=128

The queries are the last M positions of the sequence, so the causal mask is `row + (N - M) >= col`.
With the cache length taken at run time (`tsr.function(decode_attention.fn, dynamic=["N"])`),
`k.shape[-2] - q.shape[-2]` is a value the kernel reads (`graph.dim_size`), so one compile serves
every cache length of N's class (`tessera.dims.CLASSES`) rather than one compile per decode step.
Nothing here says "decode": the fusion pass sees an attention whose query blocks are too few to
fill the GPU (one per head and batch) and splits its key blocks across the grid (flash-decoding):
a first kernel writes each split's output and row log-sum-exp, a second combines them. The
compile report (`tessera compile`) shows both kernels and the split (`split_kv` in the schedule).

Grouped-query attention is written with the query heads of one key/value head as a dim of their
own (`G`): q [B, Hk, G, M, D] against k, v [B, Hk, 1, N, D], which matmul broadcasts. Where the
G x M queries fit one block (128 rows), the compiler makes them one dim of rows (the schedule
shows q viewed [B, Hk, G*M, D]), so each key/value head is read from memory once; more queries
(a prefill) are blocks of M rows per head, each reading its head's K and V. A q laid out
[B, Hk * G, M, D] is that tensor viewed (`q.view(B, Hk, G, M, D)`).
"""
import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def decode_attention(q: Tensor["B", "H", "M", "D"], k: Tensor["B", "H", "N", "D"],
                     v: Tensor["B", "H", "N", "D"]) -> Tensor["B", "H", "M", "D"]:
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    rows = tsr.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2])    # the queries' positions
    cols = tsr.arange(k.shape[-2])
    scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


@tsr.function
def gqa_decode_attention(q: Tensor["B", "Hk", "G", "M", "D"], k: Tensor["B", "Hk", 1, "N", "D"],
                         v: Tensor["B", "Hk", 1, "N", "D"]) -> Tensor["B", "Hk", "G", "M", "D"]:
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    rows = tsr.arange(q.shape[-2]) + (k.shape[-2] - q.shape[-2])
    cols = tsr.arange(k.shape[-2])
    scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)
