"""Variable-length (packed) attention on the GPU against a float64 reference written in torch.

examples/varlen_attention.py as written: sequences of lengths 1, 17, primes, 1000 and 4097 packed
without padding, FlashAttention's cumulative lengths, queries fewer than keys (the causal diagonal
at the bottom right), a sequence of no queries, a packed decode step and a hundred short sequences
(query blocks spanning many), GQA 32/8 and MHA, head dims 64 and 128, both code paths;
NaN-poisoned outputs. Also an attention output stored transposed by the attention itself
([B, S, H, D] out), and a grid past CUDA's 65,535 blocks along axis 2."""
import math

import pytest

import tessera as tsr
from tessera import Tensor
from varlen_attention import varlen_attention
from test_kernels import PATHS, check, run


def cumulative(torch, lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def reference(torch, q, k, v, cu_q, cu_k):
    """float64 attention per sequence (a row with no key would be NaN: none here)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device="cuda")
    g = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        a, e, ka, ke = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        if e == a:
            continue
        qs = q[a:e].double().transpose(0, 1)
        ks, vs = (x[ka:ke].double().transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
        s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
        rows = torch.arange(e - a, device="cuda")[:, None] + (ke - ka) - (e - a)
        s = s.masked_fill(torch.arange(ke - ka, device="cuda")[None, :] > rows, -math.inf)
        out[a:e] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return out


CASES = [   # (queries per sequence, keys per sequence, H, Hk, D, dtype)
    ([17, 1, 4097, 31], [17, 1, 4097, 31], 32, 8, 128, "bf16"),
    ([1000, 257, 64], [1000, 257, 64], 16, 16, 64, "fp16"),
    ([1], [1], 4, 4, 128, "bf16"),                                   # one query, one key
    ([5, 0, 130, 1], [300, 7, 1000, 4099], 8, 2, 128, "bf16"),       # fewer queries than keys; one of none
    ([1] * 64, [1000 + 37 * i for i in range(64)], 32, 8, 128, "bf16"),   # a decode step packed: blocks span sequences
    ([3, 1, 17, 2, 5] * 20, [3, 1, 17, 2, 5] * 20, 8, 8, 64, "fp16"),      # a hundred short sequences
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("queries,keys,h,hk,d,dtype", CASES, ids=[f"{q}-{k}-H{h}-Hk{hk}-D{d}"
                                                                   for q, k, h, hk, d, _ in CASES])
def test_varlen_attention(torch_cuda, queries, keys, h, hk, d, dtype, path):
    torch = torch_cuda
    cu_q, cu_k = cumulative(torch, queries), cumulative(torch, keys)
    dims = dict(T=sum(queries), N=sum(keys), H=h, Hk=hk, D=d, B1=len(queries) + 1)

    def make(spec, gen):
        if spec.name in ("cu_seqlens_q", "cu_seqlens_k"):
            return cu_q if spec.name == "cu_seqlens_q" else cu_k
        return torch.randn(spec.shape, generator=gen, device="cuda").to(
            {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    (q, k, v, _, _), (out,) = run(varlen_attention, dims, dtype, torch, path=path, make=make)
    check(out, reference(torch, q, k, v, cu_q, cu_k), dtype, torch)


def test_a_query_block_loops_over_its_sequences_keys_only(torch_cuda):
    """Values outside every query's sequence are NaN: a key block no row of a query block keeps
    must not be read (0 * NaN would poison the row), so the loop skips them."""
    torch = torch_cuda
    lengths = [256, 512, 128, 384]
    cu = cumulative(torch, lengths)
    t, h, d = sum(lengths), 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(t, h, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    out = varlen_attention(q, k, v, cu, cu)
    check(out, reference(torch, q, k, v, cu, cu), "bf16", torch)
    v_poisoned = v.clone()
    v_poisoned[256:768] = float("nan")     # sequence 1's values: sequences 0, 2 and 3 never see them
    out = varlen_attention(q, k, v_poisoned, cu, cu)
    rows = torch.ones(t, dtype=torch.bool, device="cuda")
    rows[256:768] = False
    assert not torch.isnan(out[rows]).any()


def test_batches_of_any_total_run_one_compile_per_class(torch_cuda, monkeypatch):
    """T and N taken at run time (`dynamic=["T", "N"]`): batches whose totals differ (primes, 1000,
    4097) run the compile of their totals' class, each against float64 (every row checked)."""
    monkeypatch.setenv("TESSERA_WARM_CACHE", "0")
    torch = torch_cuda
    fn = tsr.function(varlen_attention.fn, dynamic=["T", "N"])
    gen = torch.Generator(device="cuda").manual_seed(2)
    batches = [([17, 1, 4079], [17, 1, 4079]), ([3000, 1000, 97], [3000, 1000, 97]),
               ([1, 2, 3], [500, 7, 4099]), ([9, 1000, 13], [9, 1000, 13])]
    for queries, keys in batches:
        cu_q, cu_k = cumulative(torch, queries), cumulative(torch, keys)
        q = torch.randn(sum(queries), 32, 128, generator=gen, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(sum(keys), 8, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
        check(fn(q, k, v, cu_q, cu_k), reference(torch, q, k, v, cu_q, cu_k), "bf16", torch)
    info = fn.cache_info()
    assert info.fixed == {} and set(info.dynamic) == {"T", "N"}
    assert info.compiles == len({(tsr.dims.class_of(sum(q)), tsr.dims.class_of(sum(k))) for q, k in batches}) == 3


# --- what varlen needed elsewhere ----------------------------------------------------------------

@tsr.function
def bshd_gqa(q: Tensor["B", "S", "H", "D"], k: Tensor["B", "S", "Hk", "D"], v: Tensor["B", "S", "Hk", "D"]):
    """[B, S, H, D] in and out (FlashAttention's layout), GQA, causal: the attention kernel stores
    its output through the transposes and the merged heads itself."""
    b, s, h, d = q.shape
    hk = k.shape[2]
    qh = q.reshape(b, s, hk, h // hk, d).transpose(1, 2).transpose(2, 3)
    kh, vh = (x.transpose(1, 2)[:, :, None] for x in (k, v))
    scores = tsr.matmul(qh, kh.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    i = tsr.arange(s)
    scores = tsr.where(i[None, :] <= i[:, None], scores, -math.inf)
    out = tsr.matmul(tsr.softmax(scores, dim=-1), vh)
    return out.transpose(2, 3).transpose(1, 2).reshape(b, s, h, d)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dims,dtype", [(dict(B=2, S=1000, H=8, Hk=2, D=128), "bf16"),
                                        (dict(B=1, S=17, H=4, Hk=4, D=64), "fp16"),
                                        (dict(B=3, S=1, H=4, Hk=1, D=128), "bf16")])
def test_a_transposed_attention_output_is_stored_by_the_attention(torch_cuda, dims, dtype, path):
    torch = torch_cuda
    (q, k, v), (out,) = run(bshd_gqa, dims, dtype, torch, path=path)
    b, s, h, d = q.shape
    cu = cumulative(torch, [s] * b)
    packed = [x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)]
    check(out.reshape(b * s, h, d), reference(torch, *packed, cu, cu), dtype, torch)


@tsr.function
def transposed_twice(x: Tensor["A", "B", "C", "D"]):
    return x.transpose(0, 2) * 2.0


def test_a_grid_past_65535_on_axis_2_launches(torch_cuda):
    """140,000 batch programs (CUDA allows 65,535 along grid axis 2): laid along axis 0."""
    torch = torch_cuda
    (x,), (out,) = run(transposed_twice, dict(A=3, B=70000, C=2, D=4), "bf16", torch)
    check(out, x.double().transpose(0, 2) * 2.0, "bf16", torch)
