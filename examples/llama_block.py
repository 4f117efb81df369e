"""A Llama-style transformer block as one Tessera function, and the same block in torch.

    y = llama_block(x, attn_norm, wq, wk, wv, wo, mlp_norm, wg, wu, wd, head_dim=128)

Pre-norm: RMSNorm -> causal multi-head attention (no rotary positions) -> residual add; RMSNorm ->
SwiGLU MLP -> residual add. Sharded with `tessera.distributed.shard(llama_block, mesh, {"Q": "tp",
"F": "tp"})` its heads (the columns Q of wq, wk, wv and the rows of wo) and the MLP's hidden dim F
split over the mesh: Tessera derives the two all-reduces (of the attention's and the MLP's output
projections) and the gradients' all-reduces of the normed inputs, or, with `sequence="S"`,
reduce-scatters and all-gathers along the sequence with the norms and residuals on 1/tp of the rows
(Megatron-LM's sequence parallelism). bench/tensor_parallel.py runs it against torch's DTensor.
"""
from __future__ import annotations

import math

import tessera as tsr
from tessera import Tensor


@tsr.function
def llama_block(x: Tensor["B", "S", "C"], attn_norm: Tensor["C"], wq: Tensor["C", "Q"], wk: Tensor["C", "Q"],
                wv: Tensor["C", "Q"], wo: Tensor["Q", "C"], mlp_norm: Tensor["C"], wg: Tensor["C", "F"],
                wu: Tensor["C", "F"], wd: Tensor["F", "C"], head_dim: int = 128, eps: float = 1e-5):
    b, s = x.shape[0], x.shape[1]

    def heads(t):   # [B, S, Q] -> [B, Q / head_dim, S, head_dim]
        return t.reshape(b, s, t.shape[-1] // head_dim, head_dim).transpose(1, 2)

    h = tsr.rms_norm(x, (x.shape[-1],), attn_norm, eps)
    q, k, v = heads(tsr.matmul(h, wq)), heads(tsr.matmul(h, wk)), heads(tsr.matmul(h, wv))
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
    rows, cols = tsr.arange(s), tsr.arange(s)
    p = tsr.softmax(tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf), dim=-1)
    o = tsr.matmul(p, v).transpose(1, 2).reshape(b, s, wo.shape[0])
    x = x + tsr.matmul(o, wo)
    h = tsr.rms_norm(x, (x.shape[-1],), mlp_norm, eps)
    return x + tsr.matmul(tsr.silu(tsr.matmul(h, wg)) * tsr.matmul(h, wu), wd)


def torch_llama_block(x, attn_norm, wq, wk, wv, wo, mlp_norm, wg, wu, wd, head_dim: int = 128, eps: float = 1e-5):
    """The same block in torch (F.rms_norm, SDPA, F.silu)."""
    import torch.nn.functional as F

    b, s = x.shape[0], x.shape[1]

    def heads(t):
        return t.unflatten(-1, (-1, head_dim)).transpose(1, 2)
    h = F.rms_norm(x, (x.shape[-1],), attn_norm, eps)
    o = F.scaled_dot_product_attention(heads(h @ wq), heads(h @ wk), heads(h @ wv), is_causal=True)
    x = x + o.transpose(1, 2).reshape(b, s, -1) @ wo
    h = F.rms_norm(x, (x.shape[-1],), mlp_norm, eps)
    return x + (F.silu(h @ wg) * (h @ wu)) @ wd
