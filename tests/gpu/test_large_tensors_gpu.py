"""Tensors of 2^31 elements or more (4 GiB in fp16): addresses past a 32-bit element index.

An 8 x 32 x 131072 x 128 KV cache (a decode batch) has 2^32 elements; indexing it in 32-bit
arithmetic faulted on the H100 (an illegal address) before kernels summed 64-bit products for
such tensors. Each test needs about 9-18 GB of GPU memory and skips with the reason where the
device has less free."""
import math

import pytest

import tessera as tsr
from decode_attention import decode_attention
from tessera import Tensor

ROWS, COLS = 2 ** 15 + 1, 2 ** 16 - 1   # 2^31 + 32767 elements


@tsr.function
def doubled(x: Tensor["M", "N"]):
    return x * 2.0


def needs_free_bytes(torch, n: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < n:
        pytest.skip(f"needs {n / 2**30:.0f} GiB of free GPU memory, the device has {free / 2**30:.0f}")


def test_elementwise_over_2_31_elements(torch_cuda):
    """Loads and stores past element 2^31: every element doubled (exact in fp16), the last ones included."""
    torch = torch_cuda
    needs_free_bytes(torch, 2 * ROWS * COLS * 2 + (1 << 30))
    x = torch.empty(ROWS, COLS, device="cuda", dtype=torch.float16)
    x.uniform_(-4, 4)
    out = doubled(x)
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    assert torch.equal(out[-1], x[-1] * 2)


def test_decode_attention_over_a_cache_of_2_31_elements(torch_cuda):
    """K and V of 2^24 + 3 keys x 128 (2^31 + 384 elements each), copied by cp.async and TMA into
    the split-KV kernel; the reference is float64, taken over key chunks."""
    torch = torch_cuda
    n, d = 2 ** 24 + 3, 128
    needs_free_bytes(torch, 2 * n * d * 2 + (2 << 30))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1, 1, d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.empty(1, 1, n, d, device="cuda", dtype=torch.float16)
    v = torch.empty(1, 1, n, d, device="cuda", dtype=torch.float16)
    k.normal_(generator=gen)
    v.normal_(generator=gen)
    k[..., -1, :] = q[..., 0, :] * 4     # the last key dominates: an error there shows
    out = decode_attention(q, k, v)
    chunk = 1 << 22
    scores = torch.cat([(k[0, 0, i:i + chunk].double() @ q[0, 0, 0].double()) / math.sqrt(d)
                        for i in range(0, n, chunk)])
    p = torch.softmax(scores, dim=0)
    ref = sum(p[i:i + chunk] @ v[0, 0, i:i + chunk].double() for i in range(0, n, chunk))
    err = float((out[0, 0, 0].double() - ref).norm() / ref.norm())
    assert not torch.isnan(out).any() and err < 1e-2, f"relative error {err:.2e}"
