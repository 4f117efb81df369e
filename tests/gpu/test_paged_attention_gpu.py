"""Paged KV attention and gathers on the GPU against float64 references written in torch.

examples/paged_attention.py as written: the cache's pages in a shuffled order, each sequence's
table partly filled (entries past its length are -1, which reads zeros), key lengths 1, 17, 4097
and 100,003, batch 1, page sizes 16 to 256, GQA 32/8 and MHA, decode and prefill; both code
paths; NaN-poisoned outputs."""
import math

import pytest

import tessera as tsr
from tessera import Tensor
from paged_attention import paged_decode_attention, paged_prefill_attention
from test_kernels import PATHS, check, run


def paged_inputs(torch, spec, gen, lengths):
    """A cache whose pages are shuffled, tables naming each sequence's pages (-1 past its last)."""
    if spec.name == "lengths":
        return torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if spec.name == "table":
        b, j = spec.shape
        pages = torch.randperm(b * j, generator=gen, device="cuda").to(torch.int32).view(b, j)
        page = PAGE_OF[spec.shape]
        used = torch.tensor([math.ceil(n / page) for n in lengths], device="cuda")
        return torch.where(torch.arange(j, device="cuda")[None, :] < used[:, None], pages, -1).to(torch.int32)
    x = torch.randn(spec.shape, generator=gen, device="cuda", dtype=torch.float32)
    return x.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[spec.dtype.name]))


PAGE_OF: dict = {}


def gathered(torch, cache, table):
    """cache[table] with -1 entries reading zeros, pages merged: [B, J * PAGE, H, D] in float64."""
    inside = (table >= 0) & (table < cache.shape[0])
    pages = cache.double()[table.clamp(0, cache.shape[0] - 1).long()] * inside[..., None, None, None]
    return pages.reshape(table.shape[0], -1, *cache.shape[2:])


def decode_reference(torch, q, k_cache, v_cache, table, lengths):
    k = gathered(torch, k_cache, table).transpose(1, 2)[:, :, None]     # [B, Hk, 1, N, D]
    v = gathered(torch, v_cache, table).transpose(1, 2)[:, :, None]
    m, n = q.shape[-2], k.shape[-2]
    s = q.double() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    length = lengths.long()[:, None, None, None, None]
    rows = torch.arange(m, device="cuda")[:, None] + (length - m)
    cols = torch.arange(n, device="cuda")[None, :]
    return torch.softmax(s.masked_fill(~((cols <= rows) & (cols < length)), -math.inf), dim=-1) @ v


DECODE = [   # (dims, lengths, dtype)
    (dict(B=1, Hk=8, G=4, M=1, P=8, PAGE=16, J=8, D=128), [1], "bf16"),                 # one key
    (dict(B=3, Hk=2, G=4, M=1, P=9, PAGE=16, J=3, D=64), [17, 48, 33], "fp16"),         # a page and a key
    (dict(B=1, Hk=8, G=4, M=4, P=40, PAGE=128, J=40, D=128), [4097], "bf16"),
    (dict(B=2, Hk=8, G=4, M=1, P=800, PAGE=256, J=400, D=128), [100003, 65536], "bf16"),
    (dict(B=2, Hk=4, G=1, M=1, P=130, PAGE=64, J=65, D=128), [4097, 17], "fp16"),       # MHA
    (dict(B=1, Hk=8, G=4, M=16, P=66, PAGE=64, J=66, D=128), [4200], "bf16"),
    (dict(B=2, Hk=8, G=4, M=4, P=64, PAGE=16, J=32, D=128), [2 ** 31 - 1, 300], "bf16"),   # "all": no wrap
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dims,lengths,dtype", DECODE, ids=[f"{'-'.join(f'{k}{v}' for k, v in d.items())}-{n}"
                                                             for d, n, _ in DECODE])
def test_paged_decode(torch_cuda, dims, lengths, dtype, path):
    torch = torch_cuda
    PAGE_OF[(dims["B"], dims["J"])] = dims["PAGE"]
    inputs, (out,) = run(paged_decode_attention, dims, dtype, torch, path=path,
                         make=lambda spec, gen: paged_inputs(torch, spec, gen, lengths))
    check(out, decode_reference(torch, *inputs), dtype, torch)


def test_paged_decode_reads_the_cache_in_place(torch_cuda):
    """One attention kernel (and its split combine) reads the cache: no kernel writes its pages out."""
    specs = paged_decode_attention.arg_specs_for(dict(B=8, Hk=8, G=4, M=1, P=4096, PAGE=64, J=512, D=128), "bf16")
    compiled = paged_decode_attention.compile(specs)
    assert all("flash_attention" in name for name in compiled.kernel_names), compiled.kernel_names


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dims,dtype", [(dict(B=2, H=4, S=1000, P=20, PAGE=128, J=8, D=128), "bf16"),
                                        (dict(B=1, H=2, S=17, P=5, PAGE=16, J=3, D=64), "fp16")])
def test_paged_prefill(torch_cuda, dims, dtype, path):
    torch = torch_cuda
    PAGE_OF[(dims["B"], dims["J"])] = dims["PAGE"]
    full = [dims["J"] * dims["PAGE"]] * dims["B"]
    (q, k_cache, v_cache, table), (out,) = run(paged_prefill_attention, dims, dtype, torch, path=path,
                                               make=lambda spec, gen: paged_inputs(torch, spec, gen, full))
    k, v = (gathered(torch, c, table).transpose(1, 2) for c in (k_cache, v_cache))
    s, n = q.shape[-2], k.shape[-2]
    keep = torch.arange(s, device="cuda")[:, None] + (n - s) >= torch.arange(n, device="cuda")[None, :]
    scores = (q.double() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    check(out, torch.softmax(scores, dim=-1) @ v, dtype, torch)


@tsr.function
def embed(w: Tensor["V", "D"], ids: Tensor["B", "T", tsr.int32]):
    return w[ids] * 2.0


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("v,d,b,t", [(1000, 777, 3, 17), (7, 1, 1, 1), (50, 4096, 1, 2)])
def test_gather_rows(torch_cuda, dtype, v, d, b, t):
    """Rows picked by an index tensor, one outside the table on each side (zeros), then scaled."""
    torch = torch_cuda

    def make(spec, gen):
        if spec.name == "ids":
            ids = torch.randint(0, v, spec.shape, generator=gen, device="cuda", dtype=torch.int32)
            return ids.flatten().index_fill(0, torch.tensor([0, ids.numel() - 1], device="cuda")[:ids.numel()],
                                            -3).view(spec.shape) if ids.numel() > 1 else ids
        return torch.randn(spec.shape, generator=gen, device="cuda").to(getattr(torch, {
            "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}[dtype]))
    (w, ids), (out,) = run(embed, dict(V=v, D=d, B=b, T=t), dtype, torch, make=make)
    inside = ((ids >= 0) & (ids < v))[..., None]
    check(out, w.double()[ids.clamp(0, v - 1).long()] * inside * 2.0, dtype, torch)


def test_gather_of_no_rows(torch_cuda):
    torch = torch_cuda
    w = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16)
    out = embed(w, torch.zeros(2, 0, device="cuda", dtype=torch.int32))
    assert tuple(out.shape) == (2, 0, 64)
