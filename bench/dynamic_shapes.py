"""Shape-generic kernels (issue 17 item 1): one compile for every row count, against the kernels
compiled for each count, and the compiles a sweep of random counts costs.

    python3 bench/dynamic_shapes.py [--rows 1000,4097,16384] [--sweep 200] [--only linear_gelu,...]

For each function (layer_norm, softmax, rms_norm, a bias + gelu epilogue and a column sum over
[M, N], and a GEMM [M, N] x [N, N] with a bias + gelu epilogue, bf16) and each row count M, in one process on
the same inputs: the value-specialized compile (`static=["M"]`), the generic one (`dynamic=["M"]`, compiled once, before the timed rows, at another M), and torch's
own op; then the attention forward and backward over a dynamic length, a decode step over a
dynamic cache length, and packed variable-length attention over dynamic totals (`--only varlen`). Every output is checked against float64 before timing. Times are medians of CUDA-graph
replays (triton's do_bench_cudagraph), in us; "generic/specialized" above 1.00 means the generic
kernel is slower. The host table is the Python time per steady call of each (8 rows), which a
shape-generic program spends binding its dims as well. The sweep calls each generic function with `--sweep` random row counts in
[2, 16384] and prints its `cache_info()` compile count (the issue's goal: a handful).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.bench.timing import rel_err  # noqa: E402
from decode_attention import decode_attention  # noqa: E402
from flash_attention import causal_flash_attention, flash_attention  # noqa: E402
from varlen_attention import varlen_attention  # noqa: E402


def functions(**kw):
    @tsr.function(**kw)
    def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b)

    @tsr.function(**kw)
    def softmax(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.softmax(x, dim=-1)

    @tsr.function(**kw)
    def rms_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)

    @tsr.function(**kw)
    def bias_gelu(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.gelu(x * w + b)

    @tsr.function(**kw)
    def linear_gelu(x: Tensor["M", "K"], w: Tensor["K", "N"], b: Tensor["N"]):
        return tsr.gelu(tsr.matmul(x, w) + b)

    @tsr.function(**kw)
    def column_sum(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):   # (a norm's weight gradient's form)
        return tsr.sum(x, dim=0) * w + b
    return {"layer_norm": layer_norm, "softmax": softmax, "rms_norm": rms_norm, "bias_gelu": bias_gelu,
            "linear_gelu": linear_gelu, "column_sum": column_sum}


TORCH = {
    "layer_norm": lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b),
    "softmax": lambda x, w, b: torch.softmax(x, dim=-1),
    "rms_norm": lambda x, w, b: torch.nn.functional.rms_norm(x, x.shape[-1:], w, 1e-6),
    "bias_gelu": lambda x, w, b: torch.nn.functional.gelu(x * w + b),
    "linear_gelu": lambda x, w, b: torch.nn.functional.gelu(x @ w + b),
    "column_sum": lambda x, w, b: x.sum(0) * w + b,
}


def weights(name: str, n: int) -> tuple:
    """(w, b) of function `name` (a GEMM's w is an [N, N] matrix, scaled so outputs stay O(1))."""
    shape = (n, n) if name == "linear_gelu" else (n,)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if name == "linear_gelu":
        w = w / n ** 0.5
    return w, torch.randn(n, device="cuda", dtype=torch.bfloat16)


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def host_us(fn, calls: int = 3000) -> float:
    """Host time per call of a steady call (tiny GPU work, so the launch queue never fills): the
    median over 5 loops of `calls` calls."""
    import statistics
    import time
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def print_pair(name: str, shape: str, static, generic, peer, args: tuple) -> None:
    """One table row: the value-specialized and the generic compile, each checked against the peer's
    output (relative error under 2e-2), then the three timed (CUDA-graph medians, us)."""
    ref = peer().float()
    for fn in (static, generic):
        err = rel_err(fn(*args), ref)
        assert err < 2e-2, f"{name} {shape}: relative error {err:.2e}"
    t_static, t_generic = (graph_us(lambda f=f: f(*args)) for f in (static, generic))
    print(f"| {name} | {shape} | {t_static:.1f} | {t_generic:.1f} | {graph_us(peer):.1f} | {t_generic / t_static:.3f} |")


def attention_functions(causal: bool, **kw):
    """examples/flash_attention.py's attention (or its causal one), compiled as `kw` says."""
    return tsr.function((causal_flash_attention if causal else flash_attention).fn, **kw)


def attention_table(rows: list[int], sweep: int, names: list[str]) -> None:
    """Attention over [B, H, S, 128] bf16 (B x S = 32768 tokens, H = 16): the value-specialized compile,
    the generic one (S dynamic, compiled at S=3 first) and torch SDPA (cuDNN or FlashAttention), in
    us; then `sweep` random lengths in [2, 8192] through the generic function and its compile count."""
    print("\n| attention | B x H x S x D | specialized us | generic us | torch SDPA us | generic/specialized |")
    print("|---|---|---|---|---|---|")
    for name in names:
        causal = name == "causal_attention"
        static, generic = attention_functions(causal, static=["S"]), attention_functions(causal, dynamic=["S"])
        generic(*(torch.randn(1, 16, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
        for s in rows:
            b = max(1, 32768 // s)
            q, k, v = (torch.randn(b, 16, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            print_pair(name, f"{b} x 16 x {s} x 128", static, generic, sdpa, (q, k, v))
        rng = random.Random(1)
        for _ in range(sweep):
            s = rng.randint(2, 8192)
            generic(*(torch.randn(1, 16, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)))
        info = generic.cache_info()
        print(f"sweep {name}: {sweep} random lengths, {info.compiles} compile(s), keys {info.keys}")


def backward_table(lengths: list[int], names: list[str]) -> None:
    """The attention backward (`tsr.vjp` of the attention of `attention_table`, [B, 16, S, 128] bf16,
    B x S = 16384 tokens): the value-specialized derivative, the generic one (S dynamic, compiled
    at S=3 first) and torch SDPA's backward, each checked against SDPA's gradients, then timed
    (do_bench medians, us: millisecond kernels, where a CUDA graph would change nothing)."""
    print("\n| backward | B x H x S x D | specialized us | generic us | torch SDPA us | generic/specialized |")
    print("|---|---|---|---|---|---|")
    for name in names:
        causal = name == "causal_backward"
        static, generic = attention_functions(causal, static=["S"]), attention_functions(causal, dynamic=["S"])
        small = [torch.randn(1, 16, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        tsr.vjp(generic, *small[:3])[1](small[3])
        for s in lengths:
            b = max(1, 16384 // s)
            q, k, v, d_out = (torch.randn(b, 16, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            sdpa = lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True)  # noqa: E731
            want = sdpa()
            vjps = [tsr.vjp(fn, q, k, v)[1] for fn in (static, generic)]
            for f_vjp in vjps:
                for got, w in zip(f_vjp(d_out), want):
                    err = rel_err(got, w.float())
                    assert err < 2e-2, f"{name} S={s}: relative error {err:.2e}"
            t_static, t_generic, t_sdpa = (1e3 * triton.testing.do_bench(lambda f=f: f(d_out) if f is not sdpa else f(),
                                                                           rep=200, return_mode="median")
                                           for f in (*vjps, sdpa))
            print(f"| {name} | {b} x 16 x {s} x 128 | {t_static:.1f} | {t_generic:.1f} | {t_sdpa:.1f} | "
                  f"{t_generic / t_static:.3f} |")
        info = generic._vjp_derivatives and next(iter(generic._vjp_derivatives.values())).cache_info()
        print(f"{name}: the generic derivative {info.compiles} compile(s), keys {info.keys}")


def decode_functions(causal: bool = False, **kw):
    """A decode step: one query a head, or (causal) examples/decode_attention.py's, whose queries
    are the last of the sequence (`row + (N - M) >= col`: N - M read at run time where N is)."""
    def decode(q: Tensor["B", "H", "Q", "D"], k: Tensor["B", "H", "N", "D"], v: Tensor["B", "H", "N", "D"]):
        return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / q.shape[-1] ** 0.5), dim=-1), v)
    return tsr.function(decode_attention.fn if causal else decode, **kw)


def decode_table(lengths: list[int], batches: tuple[int, ...] = (1, 8), causal: bool = False) -> None:
    """A decode step (one query a head; causal: four, the last of the sequence; 32 heads, D = 128,
    bf16) over a KV cache of N keys: the value-specialized compile, the generic one (N dynamic:
    flash-decoding's split counted for its class's hint, the runs counted at run time) and torch
    SDPA, in us."""
    name, queries = ("causal decode", 4) if causal else ("decode", 1)
    print(f"\n| {name} | B x H x M x N x D | specialized us | generic us | torch SDPA us | generic/specialized |")
    print("|---|---|---|---|---|---|")
    for b in batches:   # (fresh functions a batch: B pinned, so only N is ever generic)
        static = decode_functions(causal, static=["B", "N"])
        generic = decode_functions(causal, static=["B"], dynamic=["N"])
        q = torch.randn(b, 32, queries, 128, device="cuda", dtype=torch.bfloat16)
        for n in lengths:
            k, v = (torch.randn(b, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            keep = torch.arange(queries, device="cuda")[:, None] + (n - queries) >= torch.arange(n, device="cuda")
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                q, k, v, attn_mask=keep if causal else None)
            print_pair(name, f"{b} x 32 x {queries} x {n} x 128", static, generic, sdpa, (q, k, v))
        print(f"{name} B={b}: {generic.cache_info().compiles} generic compile(s), keys {generic.cache_info().keys}")


def varlen_table() -> None:
    """Packed causal sequences (examples/varlen_attention.py, 32 query heads over 8 KV heads, D = 128,
    bf16): the compile for each batch's totals (`static=["T", "N"]`) against the one whose T and N
    are taken at run time (compiled first at a batch of 9 tokens), in us, both checked against SDPA
    per sequence."""
    print("\n| varlen attention | sequences | specialized us | generic us | torch SDPA us (per sequence) "
          "| generic/specialized |")
    print("|---|---|---|---|---|---|")
    static = tsr.function(varlen_attention.fn, static=["T", "N"])
    generic = tsr.function(varlen_attention.fn, dynamic=["T", "N"])

    def packed(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lengths), 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return q, k, v, cu, cu
    generic(*packed([2, 3, 4]))
    g = random.Random(2)
    for name, lengths in (("8 x 2048", [2048] * 8), ("16 in [256, 4096]", [g.randint(256, 4096) for _ in range(16)]),
                          ("1000, 4097, 17, 1531", [1000, 4097, 17, 1531])):
        q, k, v, cu, _ = args = packed(lengths)
        bounds = cu.tolist()

        def sdpa():
            return torch.cat([torch.nn.functional.scaled_dot_product_attention(
                *(x[a:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                for a, e in zip(bounds, bounds[1:])])
        print_pair("varlen", name, static, generic, sdpa, args)
    print(f"varlen: {generic.cache_info().compiles} generic compile(s), keys {generic.cache_info().keys}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1000,4097,16384,65536")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--sweep", type=int, default=200)
    parser.add_argument("--only", default="", help="the functions to run, comma-separated (default: all)")
    parser.add_argument("--attention-lengths", default="1000,4097,8192")
    parser.add_argument("--decode-lengths", default="4097,32768,131072")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    n = args.n
    print(f"# device: {torch.cuda.get_device_name()}  command: python3 bench/dynamic_shapes.py "
          f"--rows {args.rows} --n {n} --sweep {args.sweep}" + (f" --only {args.only}" if args.only else ""))
    only = set(filter(None, args.only.split(",")))
    static, generic = ({name: fn for name, fn in functions(**kw).items() if not only or name in only}
                       for kw in ({"static": ["M"]}, {"dynamic": ["M"]}))
    params = {name: weights(name, n) for name in generic}
    for name, fn in generic.items():   # compiled before the timed rows, at a row count none of them has
        fn(torch.randn(3, n, device="cuda", dtype=torch.bfloat16), *params[name])
    print("| kernel | M | specialized us | generic us | torch us | generic/specialized |")
    print("|---|---|---|---|---|---|")
    for name in generic:
        w, b = params[name]
        for m in rows:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ref = TORCH[name](x.double(), w.double(), b.double())
            for fn in (static[name], generic[name]):
                err = rel_err(fn(x, w, b), ref)
                assert err < 3e-2, f"{name} M={m}: relative error {err:.2e}"
            t_static = graph_us(lambda: static[name](x, w, b))
            t_generic = graph_us(lambda: generic[name](x, w, b))
            t_torch = graph_us(lambda: TORCH[name](x, w, b))
            print(f"| {name} | {m} | {t_static:.1f} | {t_generic:.1f} | {t_torch:.1f} | {t_generic / t_static:.3f} |")
    print("\n| kernel | M | specialized host us/call | generic host us/call | torch host us/call |")
    print("|---|---|---|---|---|")
    x = torch.randn(8, n, device="cuda", dtype=torch.bfloat16)
    for name in generic:
        row = [host_us(lambda: f(x, *params[name])) for f in (static[name], generic[name], TORCH[name])]
        print(f"| {name} | 8 | " + " | ".join(f"{t:.1f}" for t in row) + " |")
    if not only or "decode" in only:
        decode_table([int(n) for n in args.decode_lengths.split(",")])
    if not only or "causal_decode" in only:
        decode_table([int(n) for n in args.decode_lengths.split(",")], causal=True)
    if not only or only & {"backward", "causal_backward"}:
        backward_table([int(r) for r in args.attention_lengths.split(",")],
                       names=[n for n in ("backward", "causal_backward") if not only or n in only])
    if not only or "varlen" in only:
        varlen_table()
    if not only or only & {"attention", "causal_attention"}:
        attention_table(rows=[int(r) for r in args.attention_lengths.split(",")], sweep=args.sweep,
                        names=[n for n in ("attention", "causal_attention") if not only or n in only])
    rng = random.Random(0)
    for name, fn in generic.items():
        for _ in range(args.sweep):
            m = rng.randint(2, 16384)
            fn(torch.randn(m, n, device="cuda", dtype=torch.bfloat16), *params[name])
        info = fn.cache_info()
        print(f"sweep {name}: {args.sweep} random row counts, {info.compiles} compile(s), keys {info.keys}")


if __name__ == "__main__":
    main()
