"""Tessera functions in torch autograd and torch.compile, on CPU tensors (the CPU interpreter runs
the forward and the backward graphs): `tessera/frontend/torch_autograd.py`.

Gradients are checked against torch autograd on the same math in float64 (Tessera computes in
fp32 from the same fp32 values), so the tolerance is fp32's. torch.compile uses the aot_eager
backend: Dynamo, the fake implementation and AOT autograd are what a graph break or a wrong
registration would fail; inductor's codegen of the surrounding torch ops adds ~20 s of C++
compiles on a 2-core machine and runs in the GPU tests instead.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.errors import TesseraError  # noqa: E402
from torch_autograd_cases import (  # noqa: E402
    CASES, block, float64_twins, gelu_mlp, leaves, rel, rms_norm_matmul, softcapped_causal_attention,
    torch_rms_norm_matmul, torch_softcapped_causal_attention,
)

TOL = 1e-4


@pytest.mark.parametrize("name,fn,reference,shapes", CASES, ids=[c[0] for c in CASES])
def test_backward_matches_torch_autograd_in_float64(name, fn, reference, shapes):
    args = leaves(torch, shapes, torch.float32, "cpu", seed=1)
    out = fn(*args)
    assert out.grad_fn is not None and "tessera" in type(out.grad_fn).__name__
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(cotangent)
    exact = float64_twins(args)
    want_out = reference(torch, *exact)
    want_out.backward(cotangent.double())
    assert rel(torch, out.detach(), want_out.detach()) < TOL
    for a, e in zip(args, exact):
        assert a.grad.dtype == torch.float32 and a.grad.shape == e.shape
        assert rel(torch, a.grad, e.grad) < TOL


def test_loss_backward_through_two_chained_functions():
    """A scalar loss over rms_norm_matmul's output fed to the MLP: torch chains the two backwards."""
    x, w, a = leaves(torch, [(6, 16), (16,), (16, 16)], torch.float32, "cpu", seed=3)
    w1, b1, w2 = leaves(torch, [(16, 32), (32,), (32, 16)], torch.float32, "cpu", seed=4, scale=0.3)
    loss = (gelu_mlp(torch.tanh(rms_norm_matmul(x, w, a)), w1, b1, w2) ** 2).mean()
    loss.backward()
    exact = float64_twins([x, w, a, w1, b1, w2])
    xe, we, ae, w1e, b1e, w2e = exact
    h = torch.tanh(torch_rms_norm_matmul(torch, xe, we, ae))
    want = (torch.nn.functional.gelu(h @ w1e + b1e) @ w2e).pow(2).mean()
    want.backward()
    assert abs(loss.item() - want.item()) < TOL * abs(want.item())
    for got, e in zip([x, w, a, w1, b1, w2], exact):
        assert rel(torch, got.grad, e.grad) < TOL


def test_only_inputs_that_require_grad_are_differentiated():
    """x is data (no grad), w and a are parameters: the backward is built for (w, a) only."""
    @tsr.function
    def layer(x: Tensor["N", "C"], w: Tensor["C"], a: Tensor["C", "F"], eps: float = 1e-6):
        return tsr.matmul(tsr.rms_norm(x, (x.shape[-1],), w, eps), a)

    x = torch.randn(5, 8)
    w, a = leaves(torch, [(8,), (8, 4)], torch.float32, "cpu", seed=5)
    layer(x, w, a).sum().backward()
    assert x.grad is None
    assert list(layer._torch_derivatives) == [((0,), ("w", "a"), 1)]   # (the rms_norm's rstd saved)
    exact = float64_twins([w, a])
    torch_rms_norm_matmul(torch, x.double(), *exact).sum().backward()
    assert rel(torch, w.grad, exact[0].grad) < TOL and rel(torch, a.grad, exact[1].grad) < TOL


def test_non_float_and_constant_arguments_get_no_gradient():
    """An int32 tensor and a Python float are arguments of the op without gradients; an int32
    output is not differentiable; a 0-d tensor is passed as its number (a trace constant)."""
    @tsr.function
    def pick(x: Tensor["N", "C"], offset: Tensor["N"], scale: float):
        y = tsr.softmax(x * scale, dim=-1) + tsr.cast(offset, tsr.fp32)[:, None]
        return y, tsr.argmax(x, dim=-1)

    x = torch.randn(4, 6, requires_grad=True)
    offset = torch.arange(4, dtype=torch.int32)
    y, idx = pick(x, offset, torch.tensor(0.5))
    assert y.requires_grad and not idx.requires_grad and idx.dtype == torch.int32
    (y * torch.linspace(-1, 1, 6)).sum().backward()
    xe = x.detach().double().requires_grad_()
    (torch.softmax(xe * 0.5, dim=-1) * torch.linspace(-1, 1, 6).double()).sum().backward()
    assert rel(torch, x.grad, xe.grad) < TOL
    assert torch.equal(idx, x.detach().argmax(-1).int())


def test_scalar_loss_is_0d_and_backpropagates():
    @tsr.function
    def loss(x: Tensor["N", "C"], w: Tensor["C"]):
        return tsr.mean(tsr.tanh(tsr.layer_norm(x, (x.shape[-1],)) * w))

    x, w = leaves(torch, [(4, 10), (10,)], torch.float32, "cpu", seed=6)
    out = loss(x, w)
    assert out.shape == ()
    out.backward()
    xe, we = float64_twins([x, w])
    torch.tanh(torch.nn.functional.layer_norm(xe, (10,)) * we).mean().backward()
    assert rel(torch, x.grad, xe.grad) < TOL and rel(torch, w.grad, we.grad) < TOL


def test_no_grad_calls_take_the_ordinary_path():
    """Under torch.no_grad, or without inputs that require grad, nothing is recorded and no op is
    registered: the call is Tessera's ordinary one."""
    @tsr.function
    def double(x: Tensor["N"]):
        return x * 2.0

    x = torch.randn(8, requires_grad=True)
    with torch.no_grad():
        y = double(x)
    z = double(torch.randn(8))
    assert y.grad_fn is None and not y.requires_grad and z.grad_fn is None
    assert "_torch_ops" not in vars(double)
    assert torch.equal(y, x.detach() * 2.0)


def test_numpy_calls_do_not_import_torch():
    code = ("import sys, numpy as np, tessera as tsr\n"
            "from tessera import Tensor\n"
            "f = tsr.function(lambda x: x * 2.0)\n"
            "assert (f(np.ones(3, np.float32)) == 2).all()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_double_backward_gives_hessian_vector_products():
    """create_graph=True differentiates the backward op itself (autodiff of the backward graph)."""
    x, w, a = leaves(torch, [(4, 12), (12,), (12, 6)], torch.float32, "cpu", seed=7)
    y = rms_norm_matmul(x, w, a)
    gx, = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    assert gx.requires_grad and "tessera_rms_norm_matmul_vjp_x" in type(gx.grad_fn).__name__
    hw, ha = torch.autograd.grad((gx * torch.cos(x.detach())).sum(), (w, a))
    xe, we, ae = float64_twins([x, w, a])
    gxe, = torch.autograd.grad((torch_rms_norm_matmul(torch, xe, we, ae) ** 2).sum(), xe, create_graph=True)
    hwe, hae = torch.autograd.grad((gxe * torch.cos(xe.detach())).sum(), (we, ae))
    assert rel(torch, hw, hwe) < 10 * TOL and rel(torch, ha, hae) < 10 * TOL


def test_attention_backward_reads_saved_values_and_double_backward_recomputes_them():
    """A first backward of an attention reads the log-sum-exp and output its forward saved (a
    derivative taking 2 saved values); create_graph=True takes the derivative that recomputes
    them, whose own derivative sees how they depend on q, k, v: Hessian-vector products match
    torch's in float64."""
    q, k, v = leaves(torch, [(1, 2, 6, 8)] * 3, torch.float32, "cpu", seed=9)
    fn = softcapped_causal_attention
    fn.__dict__.pop("_torch_derivatives", None)
    gq, = torch.autograd.grad((fn(q, k, v) ** 2).sum(), q)
    assert [key[2] for key in fn._torch_derivatives] == [2]
    gq2, = torch.autograd.grad((fn(q, k, v) ** 2).sum(), q, create_graph=True)
    assert [key[2] for key in fn._torch_derivatives] == [2, 0]
    hk, hv = torch.autograd.grad((gq2 * torch.cos(q.detach())).sum(), (k, v))
    qe, ke, ve = float64_twins([q, k, v])
    gqe, = torch.autograd.grad((torch_softcapped_causal_attention(torch, qe, ke, ve) ** 2).sum(), qe,
                               create_graph=True)
    hke, hve = torch.autograd.grad((gqe * torch.cos(qe.detach())).sum(), (ke, ve))
    assert rel(torch, gq, gqe) < TOL and rel(torch, gq2, gqe) < TOL
    assert rel(torch, hk, hke) < 10 * TOL and rel(torch, hv, hve) < 10 * TOL


def test_gradcheck_in_fp32_with_loose_tolerance():
    """torch's own finite-difference check of the op's backward (fp32: eps and tolerances loose)."""
    x, w, a = leaves(torch, [(3, 5), (5,), (5, 2)], torch.float32, "cpu", seed=8)
    assert torch.autograd.gradcheck(lambda *t: rms_norm_matmul(*t), (x, w, a), eps=1e-2, atol=2e-2, rtol=2e-2,
                                    fast_mode=True)


def _grads(model, x):
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_torch_compile_fullgraph_forward_and_backward():
    """fullgraph=True raises on any graph break; the compiled loss and gradients equal eager's."""
    model = block(torch)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(10))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = _grads(compiled, x)
    eager_loss, eager_grads = _grads(model, x)
    assert torch.allclose(loss, eager_loss, rtol=1e-5)
    for g, e in zip(grads, eager_grads):
        assert torch.allclose(g, e, rtol=1e-4, atol=1e-6)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_torch_compile_before_any_eager_call_registers_while_tracing():
    @tsr.function
    def scaled_softmax(x: Tensor["N", "C"], scale: float):
        return tsr.softmax(x * scale, dim=-1)

    w = torch.nn.Parameter(torch.randn(5, 7))

    def f(x):
        return (scaled_softmax(x @ w, 0.5) * torch.arange(7.0)).sum()

    x = torch.randn(3, 5)
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    loss.backward()
    we = w.detach().double().requires_grad_()
    want = (torch.softmax((x.double() @ we) * 0.5, dim=-1) * torch.arange(7.0).double()).sum()
    want.backward()
    assert abs(loss.item() - want.item()) < TOL * abs(want.item())
    assert rel(torch, w.grad, we.grad) < TOL


def test_torch_op_is_a_checked_custom_op():
    """tsr.torch_op names the op tessera::<function>; torch.library.opcheck checks its schema, its
    fake implementation against the real one, and its autograd registration."""
    args = leaves(torch, [(1, 1, 5, 8)] * 3, torch.float32, "cpu", seed=11)
    op = tsr.torch_op(softcapped_causal_attention, *args)
    assert op is softcapped_causal_attention.torch_op(*args)
    assert str(op._opoverload).startswith("tessera.softcapped_causal_attention")
    result = torch.library.opcheck(op, tuple(args), test_utils=("test_schema", "test_autograd_registration",
                                                                 "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out, lse = op(*[torch.empty(2, 3, 4, 8) for _ in range(3)])
    assert out.shape == (2, 3, 4, 8) and out.dtype == torch.float32
    assert lse.shape == (2, 3, 4, 1) and lse.dtype == torch.float32   # saved for the backward


def test_torch_op_refuses_kernels_and_the_torch_path_refuses_compile_options():
    @tsr.kernel
    def copy(x: Tensor["N"], y: Tensor["N"]):
        y[:] = x

    with pytest.raises(TesseraError, match="torch_op takes a @tsr.function"):
        tsr.torch_op(copy, torch.zeros(2), torch.zeros(2))
    with pytest.raises(TesseraError, match="compile options"):
        gelu_mlp(*leaves(torch, [(2, 4), (4, 8), (8,), (8, 4)], torch.float32, "cpu"), arch="sm_90a")


def test_numpy_arguments_with_grad_tensors_are_refused():
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(TesseraError, match="pass torch tensors"):
        gelu_mlp(x, np.ones((4, 8), np.float32), torch.zeros(8), torch.zeros(8, 4))


def test_derivatives_for_different_inputs_have_different_compile_keys():
    """The partial derivatives of one function share its code and their signature, so their
    captures key (part of the in-process and warm-start compile keys) carries which inputs."""
    x, w, a = leaves(torch, [(3, 4), (4,), (4, 2)], torch.float32, "cpu", seed=12)
    rms_norm_matmul(x, w, a).sum().backward()
    x.grad = None
    rms_norm_matmul(x.detach(), w, a).sum().backward()
    # these calls save the rms_norm's rstd (1 value); a double backward elsewhere saves none
    derivatives = [d for (_, wrt, saved), d in rms_norm_matmul._torch_derivatives.items()
                   if wrt in {("x", "w", "a"), ("w", "a")} and saved == 1]
    assert len(derivatives) == 2
    assert derivatives[0].signature == derivatives[1].signature
    assert derivatives[0].captures.key() != derivatives[1].captures.key()


def test_the_dynamo_constant_mark_is_what_torchs_decorator_sets():
    """torch_autograd marks its registration as a Dynamo constant without importing Dynamo (1-5 s at
    a process's first torch call), by setting the attribute torch's decorator sets: still all it sets."""
    import torch._dynamo

    from tessera.frontend.torch_autograd import DYNAMO_CONSTANT_MARK

    def f():
        return 0
    assert torch._dynamo.assume_constant_result(f) is f and vars(f) == {DYNAMO_CONSTANT_MARK: True}


def test_a_torch_call_does_not_import_dynamo():
    """A call with torch tensors (no grad) in a fresh process imports neither Dynamo nor sympy."""
    import subprocess
    import sys
    code = """
import sys, torch, tessera as tsr
from tessera import Tensor

@tsr.function
def double(x: Tensor["N"]):
    return x * 2.0

assert double(torch.ones(4)).tolist() == [2.0] * 4
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_a_backward_op_saves_nothing_for_a_second_backward():
    """The first backward of an attention runs its derivative's op without residuals of its own:
    saving for a second backward would make every step compute and write two S x S score
    products (the derivative's own matmuls); create_graph=True recomputes instead (above)."""
    from tessera.autodiff.api import saving

    q, k, v = leaves(torch, [(1, 2, 6, 8)] * 3, torch.float32, "cpu", seed=4)
    fn = tsr.function(softcapped_causal_attention.fn)
    (fn(q, k, v) ** 2).sum().backward()
    (derivative,) = fn._torch_derivatives.values()
    (op,) = derivative._torch_ops.values()
    assert op.saved_positions == () and op.n_results == 3 and op.forward is derivative
    assert saving(derivative).cache_info().compiles == 0


def test_a_length_that_varies_compiles_the_forward_and_backward_once_per_class():
    """loss.backward() with a new sequence length each step: past the first length, S is taken at
    run time by the op's forward and by its backward (the saved log-sum-exp and the cotangent keyed
    by S as the forward's trace names their dims), gradients against float64 each step."""
    from tessera.autodiff.api import saving

    fn = tsr.function(softcapped_causal_attention.fn)
    for s, seed in ((40, 1), (50, 2), (60, 3)):
        args = leaves(torch, [(1, 2, s, 16)] * 3, torch.bfloat16, "cpu", seed=seed)
        fn(*args).float().square().sum().backward()
        exact = float64_twins(args)
        torch_softcapped_causal_attention(torch, *exact).float().square().sum().backward()
        for a, e in zip(args, exact):
            assert rel(torch, a.grad, e.grad) < 2e-2, f"S = {s}"
    (backward,) = fn._torch_derivatives.values()
    for f in (saving(fn), backward):
        info = f.cache_info()
        assert (info.compiles, info.hits, info.dynamic, info.fixed) == (2, 1, ("S",), {}), info


def test_a_llama_blocks_backward_matches_float64():
    """examples/llama_block.py through torch autograd: its backward graph views dQ back to
    [B, S, Q] before the merged dK/dV kernel's transposed dK (fusion keeps that kernel where its
    dV's readers are); every gradient against torch autograd in float64."""
    from llama_block import llama_block, torch_llama_block

    dims = {"B": 2, "S": 12, "C": 16, "Q": 32, "F": 24}
    shapes = [tuple(dims[d] for d in spec.dims) for spec in llama_block.annotations.values()]
    args = leaves(torch, shapes, torch.float32, "cpu", seed=12, scale=0.3)
    llama_block(*args, 8, 1e-5).square().sum().backward()
    exact = float64_twins(args)
    torch_llama_block(*exact, 8, 1e-5).square().sum().backward()
    for a, e in zip(args, exact):
        assert rel(torch, a.grad, e.grad) < 1e-3
