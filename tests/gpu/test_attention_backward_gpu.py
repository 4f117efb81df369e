"""The attention backward on CUDA tensors (issue 14, item 4): `flash_chain` kernels that recompute
the scores per block (no S x S tensor in memory), for score modifications written as plain math,
against torch autograd in float64 on the same inputs."""
import pytest

import tessera as tsr

from attention_cases import FUNCTIONS, causal, gqa_causal_attention, torch_reference


def _gradients(torch, kind, q_shape, kv_len, dtype, seed):
    """(q, d_out, Tessera's dQ, dK, dV, torch autograd's in float64) of FUNCTIONS[kind] on random
    CUDA inputs of `dtype` (a torch dtype's name)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, h, m, d = q_shape
    shapes = [q_shape, (b, h, kv_len, d), (b, h, kv_len, d)]
    q, k, v = (torch.randn(s, device="cuda", generator=gen).to(getattr(torch, dtype)) for s in shapes)
    out, f_vjp = tsr.vjp(FUNCTIONS[kind], q, k, v)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    grads = f_vjp(d_out)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    return q, d_out, grads, torch.autograd.grad(torch_reference(torch, kind, *exact), exact, d_out.double())


def rel(torch, got, want) -> float:
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), "NaN in a gradient"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind,q_shape,kv_len", [
    ("plain", (1, 2, 17, 64), 17),
    ("plain", (2, 2, 100, 64), 1000),      # cross attention: 100 queries, 1000 keys
    ("causal", (2, 3, 1000, 128), 1000),
    ("causal", (1, 1, 4097, 64), 4097),
    ("alibi", (1, 2, 257, 128), 257),
    ("softcap_causal", (1, 2, 1000, 64), 1000),
    ("causal", (1, 1, 1, 64), 1),           # one query, one key
    ("plain", (1, 3, 1, 128), 131),        # one query (a decode step) against a prime key count
    ("plain", (2, 1, 5, 128), 1),          # one key: every probability is 1
])
def test_attention_backward_matches_torch_autograd(torch_cuda, dtype, kind, q_shape, kv_len):
    torch = torch_cuda
    q, d_out, grads, want = _gradients(torch, kind, q_shape, kv_len, dtype, seed=11)
    tol = 4e-2 if dtype == "bfloat16" else 1e-2
    for name, got, w in zip("qkv", grads, want):
        assert got.is_cuda and got.dtype == q.dtype and got.shape == w.shape
        if not w.any():   # one key: dQ and dK are exactly 0, and D = rowsum(dO * O) from the rounded O
            assert not torch.isnan(got).any() and got.double().norm() / d_out.double().norm() < tol / 10, \
                f"d{name}: {got.abs().max()} where it is 0"
            continue
        assert rel(torch, got, w) < tol, f"d{name}"


@pytest.mark.parametrize("kind,q_shape,kv_len,dtype", [
    ("plain", (2, 16, 2053, 128), 2053, "bfloat16"),
    ("causal", (2, 16, 4097, 128), 4097, "float16"),
    ("softcap_causal", (3, 8, 2500, 128), 2500, "bfloat16"),
    ("alibi", (1, 17, 2048, 96), 2048, "float16"),     # rows of 96 in the block's 128
    ("plain", (2, 16, 2048, 128), 1100, "bfloat16"),   # cross attention: 2048 queries, 1100 keys
])
def test_dq_summed_in_the_kernel_of_dk_and_dv_matches_torch_autograd(torch_cuda, kind, q_shape, kv_len, dtype):
    """Shapes whose dK/dV kernel fills two waves at a head dim of 65-128 and loops over 2048 queries
    or more: dQ is summed there, across the key blocks' programs (`fusion.merge_across`), against
    torch autograd in float64."""
    from tessera import dtypes
    from tessera.autodiff.api import Derivative

    torch = torch_cuda
    b, h, m, d = q_shape
    specs = FUNCTIONS[kind].arg_specs_for({"B": b, "H": h, "M": m, "S": m, "N": kv_len, "D": d}, dtypes.BY_NAME[dtype])
    d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, specs[0].dtype, specs[0].dims)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compiled = Derivative(FUNCTIONS[kind], cotangent_names=["d_out"]).compile([*specs, d_out], sm_count=sms)
    chains = [len(k.outputs) for k in next(iter(compiled.modules["schedule"].ops)).body.block.ops
              if k.name == "schedule.kernel" and k.kind.data == "flash_chain"]
    assert chains == [3], chains
    q, _, grads, want = _gradients(torch, kind, q_shape, kv_len, dtype, seed=17)
    for name, got, w in zip("qkv", grads, want):
        assert got.dtype == q.dtype and got.shape == w.shape
        assert rel(torch, got, w) < (4e-2 if dtype == "bfloat16" else 1e-2), f"d{name}"


@pytest.mark.parametrize("b,h,hk,s,d,dtype", [(2, 32, 8, 1000, 128, "bfloat16"), (1, 8, 1, 4097, 64, "float16"),
                                              (3, 6, 2, 17, 128, "float16")])
def test_grouped_query_attention_backward_matches_torch_autograd(torch_cuda, b, h, hk, s, d, dtype):
    """GQA (32/8) and MQA: dK and dV in one flash_chain kernel per query head, summed over each KV
    head's query heads, against torch autograd of the attention over K and V repeated, in float64."""
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, h, s, d, device="cuda", generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(b, hk, s, d, device="cuda", generator=gen).to(q.dtype) for _ in range(2))
    out, f_vjp = tsr.vjp(gqa_causal_attention, q, k, v)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    grads = f_vjp(d_out)
    exact = [x.double().requires_grad_() for x in (q, k, v)]
    repeated = [x.repeat_interleave(h // hk, dim=1) for x in exact[1:]]
    want = torch.autograd.grad(torch_reference(torch, "causal", exact[0], *repeated), exact, d_out.double())
    for name, got, w in zip("qkv", grads, want):
        assert got.dtype == q.dtype and got.shape == w.shape
        assert rel(torch, got, w) < (4e-2 if dtype == "bfloat16" else 1e-2), f"d{name}"


def test_attention_backward_through_torch_autograd(torch_cuda):
    """loss.backward() through a Tessera attention runs the same kernels (torch_autograd's op)."""
    torch = torch_cuda
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 4, 513, 64, device="cuda", generator=gen, dtype=torch.float16).requires_grad_()
               for _ in range(3))
    causal(q, k, v).float().square().sum().backward()
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    torch_reference(torch, "causal", *exact).float().square().sum().backward()
    for x, e in zip((q, k, v), exact):
        assert rel(torch, x.grad, e.grad) < 1e-2


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["plain", "causal", "softcap_causal"])
def test_one_backward_compile_serves_every_sequence_length(torch_cuda, monkeypatch, d, kind):
    """tsr.vjp of an attention whose sequence length varies from call to call (issue 17: dims taken
    at run time): the forward that saves the log-sum-exp and the backward's kernels (dK with dV, dQ,
    rowsum(dO * O)) compile once per class of the length, every length's gradients against torch
    autograd in float64 (the on-disk function cache of an earlier run out of the way)."""
    from tessera.autodiff.api import saving
    from tessera.dims import class_of
    torch = torch_cuda
    monkeypatch.setenv("TESSERA_WARM_CACHE", "0")
    fn = tsr.function(FUNCTIONS[kind].fn, dynamic=["M", "N"] if kind == "plain" else ["S"])
    gen = torch.Generator(device="cuda").manual_seed(17)
    lengths = (17, 600, 1000, 1024, 4096, 4097)   # (1024, 4096: multiples of 128, compiled without a column tail)
    for s in lengths:
        q, k, v = (torch.randn(2, 3, s, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
        out, f_vjp = tsr.vjp(fn, q, k, v)
        d_out = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
        grads = f_vjp(d_out)
        exact = [x.double().requires_grad_() for x in (q, k, v)]
        want = torch.autograd.grad(torch_reference(torch, kind, *exact), exact, d_out.double())
        for name, got, w in zip("qkv", grads, want):
            assert rel(torch, got, w) < 4e-2, f"d{name} at S = {s}"
    forward, (backward,) = saving(fn), fn._vjp_derivatives.values()
    classes = len({class_of(s) for s in lengths})
    for f in (forward, backward):
        info = f.cache_info()
        assert info.compiles == classes and not info.fixed, info


def test_torch_autograd_backward_over_lengths_compiles_once_per_class(torch_cuda, monkeypatch):
    """loss.backward() through a Tessera attention called with a new length every step: the torch
    op's forward and backward take the length at run time once it varies (two lengths of one class
    after the first: one compile each for the forward and the backward past the first length's)."""
    torch = torch_cuda
    monkeypatch.setenv("TESSERA_WARM_CACHE", "0")
    fn = tsr.function(causal.fn)
    gen = torch.Generator(device="cuda").manual_seed(19)
    for s in (513, 700, 900):
        q, k, v = (torch.randn(1, 4, s, 64, device="cuda", generator=gen, dtype=torch.float16).requires_grad_()
                   for _ in range(3))
        fn(q, k, v).float().square().sum().backward()
        exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
        torch_reference(torch, "causal", *exact).float().square().sum().backward()
        for x, e in zip((q, k, v), exact):
            assert rel(torch, x.grad, e.grad) < 1e-2, f"S = {s}"
    from tessera.autodiff.api import saving
    (backward,) = fn._torch_derivatives.values()
    for f in (saving(fn), backward):
        info = f.cache_info()
        # 513 static, then 700 makes S dynamic (class <= 1024), and 900 reuses that compile
        assert info.compiles == 2 and info.hits == 1 and info.dynamic == ("S",), info
