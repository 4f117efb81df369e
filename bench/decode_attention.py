"""Decode attention: a few queries against a long KV cache (issue 16), Tessera against torch SDPA.

    python3 bench/decode_attention.py [--quick] [--queries 1,4,16] [--splits 1,4,16] [--space block_n=32,...]
                                      [--kinds MHA] [--paged 16,64,256]

Llama-3-style heads (32 query heads; 8 KV heads for GQA, 32 for MHA), D = 128, bf16, M = 1, 4 and 16
queries per sequence (the last M positions: causal, the mask's diagonal at the bottom right), for
B in {1, 8, 64} and N in {1k, 8k, 32k, 128k} keys (cases whose KV cache exceeds 16 GB are left out). Tessera runs examples/decode_attention.py as written: the split of
the key blocks is the one the compiler derives (`split_kv`), and rows pinned to other splits
(--splits) show what the derivation leaves on the table. Peers: torch SDPA through cuDNN and
through FlashAttention (`enable_gqa` for GQA), on the same inputs; every output is checked
against an fp32 reference before timing.

Times are medians of CUDA-graph replays (triton's do_bench_cudagraph: the kernels' time without
Python's launch cost, which a serving loop hides in a graph too), in us. "KV GB/s" is the K and V
bytes read per second; "of copy" is that against the device's copy bandwidth (a 1 GiB
device-to-device copy, read + write bytes), the issue's goal being 0.9; "vs best" is the best
peer's time over Tessera's (above 1: Tessera is faster). Each case compiles for its own shapes;
the "generic" row is one function per kind and query count called with each of their cases, as a
serving loop calls it: its cache length N taken at run time (one compile per class of N and per
batch size).

With --paged PAGE,...: the same K and V scattered into a paged cache ([P, PAGE, Hk, D], pages in
a shuffled order, a block table per sequence) and read by examples/paged_attention.py's
paged_decode_attention (the same attention, its keys gathered through the table and masked by
each sequence's length); "of unpaged" is the unpaged Tessera kernel's time over the paged one's
(issue 16's goal: at least 0.9).
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
from decode_attention import gqa_decode_attention  # noqa: E402
from paged_attention import paged_decode_attention  # noqa: E402
from tessera.bench.timing import copy_bandwidth, rel_err  # noqa: E402

HEADS, D = 32, 128
KV_HEADS = {"GQA 32/8": 8, "MHA": 32}
MAX_KV_BYTES = 16 << 30


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def sdpa(backend, q, k, v):
    """torch SDPA on `backend`; with several queries, causal with the diagonal at the bottom right
    (the queries are the sequence's last positions)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    m, n = q.shape[-2], k.shape[-2]
    mask = causal_lower_right(m, n) if m > 1 else None
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                enable_gqa=k.shape[1] != q.shape[1])


def reference(q, k, v):
    """Attention in fp32, one sequence at a time (an fp32 copy of the whole cache may not fit),
    with the query heads of each KV head broadcast against it (no copy of K and V per head)."""
    b, h, m, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    rows = torch.arange(m, device=q.device)[:, None] + (n - m)
    visible = rows >= torch.arange(n, device=q.device)[None, :]
    out = []
    for i in range(b):
        qf = q[i].float().view(hk, h // hk, m, d)
        kf, vf = k[i].float().unsqueeze(1), v[i].float().unsqueeze(1)
        s = (qf @ kf.transpose(-1, -2) / d ** 0.5).masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out.append((p @ vf).reshape(h, m, d))
    return torch.stack(out)


def paged(k, v, page: int):
    """K and V [B, Hk, N, D] as a paged cache: (k_cache, v_cache [P, PAGE, Hk, D] with the pages
    shuffled, table [B, N / PAGE] int32)."""
    b, hk, n, d = k.shape
    j = n // page
    order = torch.randperm(b * j, device=k.device)
    caches = []
    for x in (k, v):
        cache = torch.empty(b * j, page, hk, d, device=x.device, dtype=x.dtype)
        cache[order] = x.permute(0, 2, 1, 3).reshape(b * j, page, hk, d)
        caches.append(cache)
    return (*caches, order.to(torch.int32).view(b, j))


def derived_split(dims: dict, space: dict) -> int:
    """The split_kv a call derives for these dims on this GPU (from its compile's schedule)."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    compiled = gqa_decode_attention.compile(gqa_decode_attention.arg_specs_for(dims, "bf16"), arch=platform.arch,
                                            sm_count=platform.sm_count, **({"space": space} if space else {}))
    host = next(iter(compiled.modules["schedule"].ops))
    (kernel,) = (op for op in host.body.block.ops if op.name == "schedule.kernel")
    return kernel.param_values["split_kv"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 8} and N in {32k, 128k} only")
    parser.add_argument("--splits", default="1", help="split_kv values to pin besides the derived one")
    parser.add_argument("--space", default="", help="schedule params pinned in every Tessera run, e.g. "
                        "block_n=32,num_stages=3 (the split is still derived, or pinned by --splits)")
    parser.add_argument("--kinds", default=",".join(KV_HEADS), help=f"of {', '.join(KV_HEADS)}")
    parser.add_argument("--queries", default="1,4,16", help="query lengths M")
    parser.add_argument("--paged", default="", help="page sizes: each case also read from a paged cache")
    args = parser.parse_args()
    page_sizes = [int(x) for x in args.paged.split(",") if x]
    pins = [int(x) for x in args.splits.split(",") if x]
    pinned = {k: [int(v)] for k, v in (item.split("=") for item in args.space.split(",") if item)}
    copy = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy:.0f} GB/s; "
          f"bf16, {HEADS} query heads, D={D}, M queries (causal at the bottom right); CUDA-graph medians in us")
    print(f"{'case':<34} {'split':>6} {'tessera':>9} {'KV GB/s':>8} {'of copy':>8} {'cudnn':>9} {'flash':>9} "
          f"{'vs best':>8} {'rel err':>8}")
    status = 0
    batches, lengths = ([1, 8], [32768, 131072]) if args.quick else ([1, 8, 64], [1024, 8192, 32768, 131072])
    kinds = [k.strip() for k in args.kinds.split(",")]
    queries = [int(x) for x in args.queries.split(",")]
    for kind, m in ((kind, m) for kind in kinds for m in queries):
        # a serving loop's function (one per kind and query count, as a loop has): N at run time
        loop = tsr.function(gqa_decode_attention.fn, dynamic=["N"])
        hk = KV_HEADS[kind]
        for b in batches:
            for n in lengths:
                kv_bytes = 2 * b * hk * n * D * 2
                if kv_bytes > MAX_KV_BYTES:
                    continue
                q = torch.randn(b, HEADS, m, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, hk, n, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, hk, n, D, device="cuda", dtype=torch.bfloat16)
                ref = reference(q, k, v)
                peers = {}
                for name, backend in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                                      ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                    try:
                        assert rel_err(sdpa(backend, q, k, v), ref) < 2e-2
                        peers[name] = graph_us(lambda: sdpa(backend, q, k, v))
                    except Exception:   # a backend that refuses these inputs (or this mask)
                        peers[name] = None
                dims = dict(B=b, Hk=hk, G=HEADS // hk, M=m, N=n, D=D)
                qg, kg, vg = q.view(b, hk, HEADS // hk, m, D), k.view(b, hk, 1, n, D), v.view(b, hk, 1, n, D)
                derived = derived_split(dims, pinned)
                for split in [derived, *(p for p in pins if p != derived)]:
                    space = {**pinned, **({} if split == derived else {"split_kv": [split]})}
                    # (a function of its own per case: one called with every case would take N at
                    # run time after its second call, its split derived for N's class: "generic")
                    fn = tsr.function(gqa_decode_attention.fn, **({"space": space} if space else {}))
                    out = fn(qg, kg, vg)
                    err = rel_err(out.view(b, HEADS, m, D), ref)
                    if err > 2e-2:
                        status = 1
                    us = graph_us(lambda: fn(qg, kg, vg))
                    gbs = kv_bytes / us / 1e3
                    best = min((t for t in peers.values() if t), default=None)
                    label = f"{kind} B={b} M={m} N={n}" + ("" if split == derived else " (pinned)")
                    print(f"{label:<34} {split:>6} {us:9.1f} {gbs:8.0f} {gbs / copy:8.2f} "
                          + " ".join(f"{peers[p]:9.1f}" if peers[p] else f"{'n/a':>9}" for p in ("cudnn", "flash"))
                          + f" {best / us if best else float('nan'):8.2f} {err:8.1e}")
                    unpaged = us if split == derived else unpaged
                if not pins[1:] and not pinned:   # the serving loop's compile (B a constant, N its class's)
                    out = loop(qg, kg, vg)
                    err = rel_err(out.view(b, HEADS, m, D), ref)
                    status |= err > 2e-2
                    us = graph_us(lambda: loop(qg, kg, vg))
                    label = f"{kind} B={b} M={m} N={n} generic"
                    print(f"{label:<34} {'':>6} {us:9.1f} {kv_bytes / us / 1e3:8.0f} {kv_bytes / us / 1e3 / copy:8.2f} "
                          f"{'':>9} {'':>9} {best / us if best else float('nan'):8.2f} {err:8.1e}")
                for page in (p for p in page_sizes if n % p == 0):
                    k_cache, v_cache, table = paged(k, v, page)
                    in_use = torch.full((b,), n, device="cuda", dtype=torch.int32)   # every key of the cache
                    fn = tsr.function(paged_decode_attention.fn, space=pinned) if pinned else paged_decode_attention
                    out = fn(qg, k_cache, v_cache, table, in_use)
                    err = rel_err(out.view(b, HEADS, m, D), ref)
                    if err > 2e-2:
                        status = 1
                    us = graph_us(lambda: fn(qg, k_cache, v_cache, table, in_use))
                    gbs = kv_bytes / us / 1e3
                    label = f"{kind} B={b} M={m} N={n} paged {page}"
                    print(f"{label:<34} {'':>6} {us:9.1f} {gbs:8.0f} {gbs / copy:8.2f} {'':>9} {'':>9} "
                          f"{'':>8} {err:8.1e}   of unpaged {unpaged / us:.2f}")
                    del k_cache, v_cache
                del q, k, v, qg, kg, vg
                torch.cuda.empty_cache()
    return status


if __name__ == "__main__":
    sys.exit(main())
