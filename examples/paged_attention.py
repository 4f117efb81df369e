"""Decode attention over a paged KV cache, as vLLM and FlashInfer lay one out, in the Tessera DSL.

    tessera compile examples/paged_attention.py:paged_decode_attention \\
        --shape B=4,Hk=8,G=4,M=1,P=512,PAGE=64,Hk=8,D=128,J=32

The cache holds fixed-size pages ([P, PAGE, Hk, D] for keys and for values); a sequence's keys are
the pages its row of the block table names ([B, J], int32), in order. `k_cache[table]` gathers
them ([B, J, PAGE, Hk, D]) and the reshape merges the pages into one key dim ([B, J * PAGE, Hk,
D]). Nothing here is special to Tessera: it is NumPy's indexing. The compiler sees the gather
merged into the keys of an attention and reads the cache page by page inside the attention's key
loop (one table entry per key block, its key blocks a divisor of the page), so no gathered copy of
the cache is ever written. An entry outside [0, P) reads zeros: the mask by `lengths` (each
sequence's keys in use, [B], int32) is what excludes a partly filled last page.
"""
import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def paged_decode_attention(q: Tensor["B", "Hk", "G", "M", "D"], k_cache: Tensor["P", "PAGE", "Hk", "D"],
                           v_cache: Tensor["P", "PAGE", "Hk", "D"], table: Tensor["B", "J", tsr.int32],
                           lengths: Tensor["B", tsr.int32]) -> Tensor["B", "Hk", "G", "M", "D"]:
    b, hk, _, m, d = q.shape
    n = table.shape[1] * k_cache.shape[1]
    k = k_cache[table].reshape(b, n, hk, d).transpose(1, 2)[:, :, None]    # [B, Hk, 1, N, D]
    v = v_cache[table].reshape(b, n, hk, d).transpose(1, 2)[:, :, None]
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    length = lengths[:, None, None, None, None]
    rows = tsr.arange(m)[:, None] + (length - m)       # each query's position: the last M of its sequence
    cols = tsr.arange(n)[None, :]
    scores = tsr.where((cols <= rows) & (cols < length), scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


@tsr.function
def paged_prefill_attention(q: Tensor["B", "H", "S", "D"], k_cache: Tensor["P", "PAGE", "H", "D"],
                            v_cache: Tensor["P", "PAGE", "H", "D"],
                            table: Tensor["B", "J", tsr.int32]) -> Tensor["B", "H", "S", "D"]:
    """Causal attention of a whole prompt over its keys in the cache (chunked prefill, the prompt's
    keys already written to its pages): the same gather, with S queries a sequence."""
    b, h, s, d = q.shape
    n = table.shape[1] * k_cache.shape[1]
    k = k_cache[table].reshape(b, n, h, d).transpose(1, 2)
    v = v_cache[table].reshape(b, n, h, d).transpose(1, 2)
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    rows = tsr.arange(s)[:, None] + (n - s)
    scores = tsr.where(tsr.arange(n)[None, :] <= rows, scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)
