"""Decode attention on the GPU: split-KV (flash-decoding) kernels against a float64 reference.

examples/decode_attention.py as written, on the split the compiler derives for this GPU and on
pinned splits (uneven runs, more splits than key blocks, a prefill-sized query block on the
native path), both code paths, NaN-poisoned outputs; two runs agree bit for bit (the combining
kernel takes the splits in order)."""
import math

import pytest

from decode_attention import decode_attention, gqa_decode_attention
from test_kernels import PATHS, TOL, _arch, run


def reference(torch, q, k, v):
    """Attention of the last M positions over N keys (bottom-right causal), in float64."""
    q, k, v = q.double(), k.double(), v.double()
    m, n = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    keep = torch.arange(m, device=q.device)[:, None] + (n - m) >= torch.arange(n, device=q.device)[None, :]
    return torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1) @ v


def check64(torch, out, ref, dtype):
    out64 = out.double()
    assert not torch.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN elements"
    err = float((out64 - ref).norm() / ref.norm())
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]}"


CASES = [
    (decode_attention, dict(B=1, H=2, M=1, N=4097, D=64), "fp16", None),      # derived split, a partial last block
    (decode_attention, dict(B=2, H=4, M=1, N=32768, D=128), "bf16", None),
    (decode_attention, dict(B=1, H=1, M=1, N=1, D=64), "fp16", None),         # one key: nothing to split
    (decode_attention, dict(B=3, H=2, M=5, N=1000, D=128), "fp16", [3]),      # uneven runs
    (decode_attention, dict(B=1, H=1, M=16, N=300, D=64), "bf16", [32]),      # more splits than key blocks
    (decode_attention, dict(B=1, H=2, M=256, N=1024, D=128), "fp16", [4]),    # prefill-sized: splits a query
    (gqa_decode_attention, dict(B=2, Hk=2, G=4, M=1, N=1000, D=128), "bf16", None),   # block sees none of
    (gqa_decode_attention, dict(B=1, Hk=8, G=4, M=7, N=8191, D=128), "fp16", None),   # G x M merged rows
    (gqa_decode_attention, dict(B=1, Hk=8, G=4, M=16, N=32768, D=128), "bf16", None),
    (gqa_decode_attention, dict(B=3, Hk=2, G=8, M=2, N=4097, D=64), "fp16", [5]),
    (gqa_decode_attention, dict(B=1, Hk=8, G=4, M=1, N=1024, D=128), "bf16", None),   # a key block a split
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fn,dims,dtype,split", CASES, ids=[f"{f.name}-{'-'.join(f'{k}{v}' for k, v in d.items())}"
                                                            for f, d, _, _ in CASES])
def test_split_kv_decode(torch_cuda, fn, dims, dtype, split, path):
    torch = torch_cuda
    space = {"split_kv": split} if split else None
    inputs, (out,) = run(fn, dims, dtype, torch, path=path, space=space)
    check64(torch, out, reference(torch, *inputs), dtype)
    _, (again,) = run(fn, dims, dtype, torch, path=path, space=space)
    assert torch.equal(out, again)


def test_a_long_cache_is_split(torch_cuda):
    """One query per head against 32k keys leaves the GPU idle without a split: the compiler
    derives one, and the kernels say so."""
    from tessera.runtime import driver
    platform = driver.Device(0).platform()
    dims = dict(B=2, H=4, M=1, N=32768, D=128)
    compiled = decode_attention.compile(decode_attention.arg_specs_for(dims, "bf16"), arch=_arch(),
                                        sm_count=platform.sm_count)
    assert compiled.kernel_names == ["decode_attention_flash_attention_0_partials",
                                     "decode_attention_flash_attention_0"]


def test_torch_call_matches(torch_cuda):
    """The plain call with torch tensors (q laid out [B, Hk * G, M, D], viewed as the example wants)."""
    torch = torch_cuda
    b, hk, g, m, n, d = 2, 2, 4, 1, 5000, 128
    q = torch.randn(b, hk * g, m, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = gqa_decode_attention(q.view(b, hk, g, m, d), k.view(b, hk, 1, n, d), v.view(b, hk, 1, n, d))
    ref = reference(torch, q.view(b, hk, g, m, d), k.view(b, hk, 1, n, d), v.view(b, hk, 1, n, d))
    check64(torch, out, ref, "bf16")


@pytest.mark.parametrize("m", [1, 4])
def test_strided_queries_are_read_in_place(torch_cuda, m):
    """q as a [B, M, Hk, G, D] buffer seen as [B, Hk, G, M, D] (the layout a projection writes):
    read through its strides, G and M then kept apart (merging them would need a copy)."""
    torch = torch_cuda
    b, hk, g, n, d = 2, 2, 4, 3000, 128
    q = torch.randn(b, m, hk, g, d, device="cuda", dtype=torch.bfloat16).permute(0, 2, 3, 1, 4)
    k, v = (torch.randn(b, hk, 1, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = gqa_decode_attention(q, k, v)
    check64(torch, out, reference(torch, q, k, v), "bf16")


def test_a_decode_loop_over_batch_and_cache_sizes(torch_cuda):
    """One function called as a serving loop does, batches and cache lengths changing from call to
    call: marked dynamic, B's split partial outputs are sized at run time; unmarked, N stays
    generic and B is fixed; against float64."""
    import tessera as tsr
    torch = torch_cuda
    for fn, dynamic in ((tsr.function(gqa_decode_attention.fn, dynamic=["B"]), ("B",)),
                        (tsr.function(gqa_decode_attention.fn), ("N",))):
        for b, n in ((1, 1024), (8, 4097), (3, 8192), (8, 131), (5, 20000), (16, 4096)):
            q = torch.randn(b, 8, 4, 1, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, 8, 1, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            check64(torch, fn(q, k, v), reference(torch, q, k, v), "bf16")
        assert fn.cache_info().dynamic == dynamic
