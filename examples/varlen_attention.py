"""Attention over a batch of sequences of different lengths, packed without padding, in the Tessera DSL.

    tessera compile examples/varlen_attention.py:varlen_attention \\
        --shape T=16384,N=16384,H=32,Hk=8,D=128,B1=9

The layout and the arguments are FlashAttention's varlen API's: the queries of every sequence one
after another ([T, H, D], T their total), the keys and values likewise ([N, Hk, D]; Hk may divide
H, grouped-query attention), and the cumulative lengths `cu_seqlens_q` and `cu_seqlens_k` ([B + 1],
int32, starting at 0): sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1.
Query i of sequence b sees the keys of sequence b only, causally with the diagonal at the bottom
right (its last query sees all its keys, as FlashAttention aligns a sequence with more keys than
queries).

Nothing here is special to Tessera. Each query's sequence is the number of sequence ends at or
before it; gathering the cumulative lengths by it gives each query row its first and last key,
and the mask compares the key index with them. The compiler reads the mask's limits per row: a
query block loops over the key blocks between its rows' first and last keys only (read at run
time, `tile.load_index_reduce`), and masks none but the blocks at a sequence's edges; a
sequence's keys are never padded.

T and N (the packed totals) can be taken at run time: `tsr.function(varlen_attention.fn,
dynamic=["T", "N"])` compiles once per class of the totals (`tessera.dims.CLASSES`), and
`q.reshape(t, hk, h // hk, d)` keeps T whole. B + 1 stays a constant (the slice
`cu_seqlens_q[1:]` needs its value): a serving loop pads the cumulative lengths to a capacity of
sequences with their last value (empty sequences change nothing). Buffers kept at one capacity of
tokens and keys also run one compile: rows past the last sequence belong to none (they come out
NaN: softmax over no key), and keys past the last are never read.

This is the form for prefill. A decode step (a query or a few per sequence) is faster batched
over a paged or partly filled cache with each sequence's length (examples/paged_attention.py):
packed, a query block spans many sequences and loops over all their keys (2.2-2.5x slower at
B=8 and 64 on the H200, though 2.2-3.1x faster than torch's varlen kernel; bench/RESULTS.md).
"""
import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def varlen_attention(q: Tensor["T", "H", "D"], k: Tensor["N", "Hk", "D"], v: Tensor["N", "Hk", "D"],
                     cu_seqlens_q: Tensor["B1", tsr.int32],
                     cu_seqlens_k: Tensor["B1", tsr.int32]) -> Tensor["T", "H", "D"]:
    t, h, d = q.shape
    n, hk = k.shape[0], k.shape[1]
    rows, cols = tsr.arange(t), tsr.arange(n)[None, :]
    seq = tsr.sum((rows[:, None] >= cu_seqlens_q[None, 1:]).to(tsr.int32), dim=1)   # [T]: each query's sequence
    after = seq + 1
    first_key, end_key, end_query = cu_seqlens_k[seq], cu_seqlens_k[after], cu_seqlens_q[after]
    keep = (cols >= first_key[:, None]) & (cols < end_key[:, None]) & \
        (cols <= rows[:, None] + (end_key - end_query)[:, None])
    qh = q.reshape(t, hk, h // hk, d).transpose(0, 1).transpose(1, 2)        # [Hk, G, T, D]
    kh, vh = (x.transpose(0, 1)[:, None] for x in (k, v))                    # [Hk, 1, N, D]
    scores = tsr.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    out = tsr.matmul(tsr.softmax(tsr.where(keep, scores, -math.inf), dim=-1), vh)   # [Hk, G, T, D]
    return out.transpose(1, 2).transpose(0, 1).reshape(t, h, d)
