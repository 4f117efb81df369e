"""Variable-length attention (issue 16 item 2): packed sequences, Tessera against FlashAttention's varlen kernels.

    python3 bench/varlen_attention.py [--quick] [--space block_m=128,...]

A batch of causal sequences of different lengths, packed without padding ([T, H, D]) with
FlashAttention's cumulative lengths, bf16, D = 128, 32 query heads over 8 KV heads (GQA) and 16
over 16 (MHA). Tessera runs examples/varlen_attention.py as written. Peers on the same inputs, where
this machine has them: torch's varlen_attn (FlashAttention's varlen kernel inside torch), the
flash_attn package's flash_attn_varlen_func, FlexAttention with a document mask (its block mask
built before timing), and SDPA on cuDNN over the batch padded to its longest sequence (what
varlen saves; padding not timed). "packed as batch" is Tessera's plain causal attention
(examples/flash_attention.py) on the same sequences when they are all one length: what the
per-row key ranges cost against a batch.

A second table packs a decode step: one query per sequence against its keys packed with
cu_seqlens_k, against torch's varlen_attn and against Tessera's paged decode over the same keys in
64-key pages (examples/paged_attention.py: the batched form, which the packed one's query blocks,
each spanning many sequences, cannot match; --no-decode leaves it out).

Times are medians of CUDA-graph replays (the kernels' time; Tessera's launches its small index
kernels too), in us; TFLOP/s counts the causal half of each sequence's scores (4 * kept pairs * H
* D); "vs best" is the best peer's time over Tessera's. Every output is checked against fp32
attention per sequence before timing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import tessera as tsr  # noqa: E402
from flash_attention import causal_flash_attention  # noqa: E402
from tessera.bench.timing import rel_err  # noqa: E402
from varlen_attention import varlen_attention  # noqa: E402

D = 128
HEADS = {"GQA 32/8": (32, 8), "MHA 16": (16, 16)}


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def batches(quick: bool) -> dict[str, list[int]]:
    """Named lists of sequence lengths (seeded)."""
    g = torch.Generator().manual_seed(0)

    def uniform(n, lo, hi):
        return torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    cases = {"8 x 2048 (equal)": [2048] * 8,
             "16 in [256, 4096]": uniform(16, 256, 4096),
             "one 8192 + 32 in [64, 512]": [8192] + uniform(32, 64, 512)}
    if not quick:
        cases["64 in [128, 2048]"] = uniform(64, 128, 2048)
        cases["4 x 8192 + 4 x 100"] = [8192, 100] * 4
    return cases


def reference(q, k, v, cu):
    """fp32 causal attention per sequence, the query heads of each KV head broadcast against it."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    h, hk = q.shape[1], k.shape[1]
    for b in range(len(cu) - 1):
        a, e = int(cu[b]), int(cu[b + 1])
        qs, ks, vs = (x[a:e].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(h // hk, 0) for x in (ks, vs))
        s = qs @ ks.transpose(-1, -2) / D ** 0.5
        s = s.masked_fill(torch.ones(e - a, e - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out[a:e] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return out


def peers(q, k, v, cu, lengths) -> dict[str, object]:
    """name -> a call of each peer this machine has (None where it refuses or lacks it)."""
    calls: dict[str, object] = {}
    longest = max(lengths)
    try:
        from torch.nn.attention.varlen import varlen_attn
        calls["torch varlen"] = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
    except Exception:
        calls["torch varlen"] = None
    try:
        from flash_attn import flash_attn_varlen_func
        calls["flash_attn"] = lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
    except Exception:
        calls["flash_attn"] = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device),
                                      torch.tensor(lengths, device=q.device))

        def document_causal(b, h, i, j):
            return (doc[i] == doc[j]) & (j <= i)
        t = q.shape[0]
        block = create_block_mask(document_causal, None, None, t, t, device="cuda")
        flex = torch.compile(flex_attention)
        qf, kf, vf = (x.transpose(0, 1)[None] for x in (q, k, v))
        gqa = k.shape[1] != q.shape[1]
        calls["flex (doc mask)"] = lambda: flex(qf, kf, vf, block_mask=block, enable_gqa=gqa)[0].transpose(0, 1)
    except Exception:
        calls["flex (doc mask)"] = None
    h, hk = q.shape[1], k.shape[1]
    padded = [torch.zeros(len(lengths), x.shape[1], longest, D, device=q.device, dtype=q.dtype) for x in (q, k, v)]
    for b, (a, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        for p, x in zip(padded, (q, k, v)):
            p[b, :, :n] = x[a:a + n].transpose(0, 1)

    def sdpa_padded():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*padded, is_causal=True, enable_gqa=h != hk)

    def unpad(out):
        return torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
    calls["cudnn padded"] = (sdpa_padded, unpad)
    return calls


def decode_case(b: int, lengths: list[int]) -> str:
    """One decode step of `b` sequences packed (one query each) against their keys: Tessera's varlen
    kernel, torch's varlen_attn, and Tessera's paged decode over the same keys (the batched form)."""
    from paged_attention import paged_decode_attention
    from torch.nn.attention.varlen import varlen_attn
    h, hk, page = 32, 8, 64
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(b, h, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    j = -(-max(lengths) // page)
    k_cache, v_cache = (torch.zeros(b * j, page, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.full((b, j), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lengths):
        for p in range(-(-n // page)):
            first, rows = int(cu_k[i]) + p * page, min(page, n - p * page)
            k_cache[used, :rows], v_cache[used, :rows] = k[first:first + rows], v[first:first + rows]
            table[i, p] = used
            used += 1
    in_use = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    qg = q.view(b, hk, h // hk, 1, D)
    packed = varlen_attention(q, k, v, cu_q, cu_k)
    paged = paged_decode_attention(qg, k_cache, v_cache, table, in_use).view(b, h, D)
    torch_out = varlen_attn(q, k, v, cu_q, cu_k, 1, max(lengths), window_size=(-1, 0))
    err = max(rel_err(packed, paged), rel_err(torch_out, paged))
    times = [graph_us(lambda: varlen_attention(q, k, v, cu_q, cu_k)),
             graph_us(lambda: varlen_attn(q, k, v, cu_q, cu_k, 1, max(lengths), window_size=(-1, 0))),
             graph_us(lambda: paged_decode_attention(qg, k_cache, v_cache, table, in_use))]
    label = f"GQA 32/8 decode B={b}, keys in [{min(lengths)}, {max(lengths)}]"
    return f"{label:<44} " + " ".join(f"{x:14.1f}" for x in times) + f" {err:8.1e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three batches, not five")
    parser.add_argument("--no-decode", action="store_true", help="leave out the packed decode table")
    parser.add_argument("--space", default="", help="schedule params pinned in Tessera's runs, e.g. block_m=64")
    args = parser.parse_args()
    pinned = {k: [int(v)] for k, v in (item.split("=") for item in args.space.split(",") if item)}
    fn = tsr.function(varlen_attention.fn, space=pinned) if pinned else varlen_attention
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, D={D}, causal; "
          f"CUDA-graph medians in us")
    names = ["torch varlen", "flash_attn", "flex (doc mask)", "cudnn padded"]
    print(f"{'case':<40} {'tessera':>9} {'TFLOP/s':>8} " + " ".join(f"{n:>15}" for n in names)
          + f" {'vs best':>8} {'rel err':>8}")
    status = 0
    refused: dict[str, str] = {}
    for kind, (h, hk) in HEADS.items():
        for label, lengths in batches(args.quick).items():
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            t = int(cu[-1])
            q = torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(t, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ref = reference(q, k, v, cu)
            flops = sum(4 * n * (n + 1) / 2 * h * D for n in lengths)
            out = fn(q, k, v, cu, cu)
            err = rel_err(out, ref)
            status |= err > 2e-2
            us = graph_us(lambda: fn(q, k, v, cu, cu))
            times = {}
            for name, call in peers(q, k, v, cu, lengths).items():
                run, post = call if isinstance(call, tuple) else (call, lambda x: x)
                try:
                    assert run is not None and rel_err(post(run()), ref) < 2e-2
                    times[name] = graph_us(run)
                except Exception as e:   # a peer this machine lacks, or that refuses these inputs
                    times[name] = None
                    if run is not None and name not in refused:
                        refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            best = min((x for x in times.values() if x), default=None)
            print(f"{kind + ' ' + label:<40} {us:9.1f} {flops / us / 1e6:8.0f} "
                  + " ".join(f"{times[n]:15.1f}" if times.get(n) else f"{'n/a':>15}" for n in names)
                  + f" {best / us if best else float('nan'):8.2f} {err:8.1e}")
            if len(set(lengths)) == 1:   # the same sequences as a batch, through the plain causal kernel
                n = lengths[0]
                qb = q.view(len(lengths), n, h, D).transpose(1, 2)
                kb, vb = (x.view(len(lengths), n, hk, D).transpose(1, 2).repeat_interleave(h // hk, 1).contiguous()
                          for x in (k, v))
                qb = qb.contiguous()
                batch_us = graph_us(lambda: causal_flash_attention(qb, kb, vb))
                print(f"{'   packed as batch (plain causal kernel)':<40} {batch_us:9.1f} {flops / batch_us / 1e6:8.0f}"
                      f"   varlen / batch time {us / batch_us:.2f}")
            torch.cuda.empty_cache()
    for name, why in refused.items():
        print(f"{name}: n/a ({why})")
    if not args.no_decode:
        print(f"\n{'packed decode (one query a sequence)':<44} {'tessera varlen':>14} {'torch varlen':>14} "
              f"{'tessera paged':>14} {'rel err':>8}")
        g = torch.Generator().manual_seed(1)
        for b, lo, hi in ((8, 4096, 8192), (64, 1024, 4096)):
            print(decode_case(b, torch.randint(lo, hi + 1, (b,), generator=g).tolist()))
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
