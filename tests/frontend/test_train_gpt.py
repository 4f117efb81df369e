"""examples/train_gpt.py on the CPU: a tiny GPT whose attention, RMSNorms and SwiGLU activation are
Tessera functions (run by the CPU interpreter, forward and backward) trains in float32 with the same
losses and gradients as the same model in plain torch. The GPU run is tests/gpu/test_train_gpt_gpu.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import train_gpt  # noqa: E402
from train_gpt import Config, Run  # noqa: E402

TINY = Config(layers=2, d_model=32, heads=2, seq=16, batch=2, steps=3, lr=3e-3, warmup=1, log_every=1,
              digits=3, dtype="float32", device="cpu", skip_timing=1, no_compile=True)
TOL = 1e-4


def rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def test_tessera_and_torch_losses_agree_over_a_few_steps():
    tessera, reference = train_gpt.train_all(TINY, train_gpt.initial_parameters(TINY), log=lambda line: None)
    assert (tessera.name, reference.name) == ("tessera", "torch eager")
    assert list(tessera.losses) == list(reference.losses) == [0, 1, 2]
    for step, want in reference.losses.items():
        assert abs(tessera.losses[step] - want) <= TOL * want, f"step {step}"
    # the Tessera model called its three functions through their torch ops
    for fn in (train_gpt.causal_attention, train_gpt.rms_norm, train_gpt.swiglu):
        assert vars(fn).get("_torch_ops"), f"{fn.name} was not called through its torch op"


def test_gradients_of_every_parameter_agree_with_torch():
    parameters = train_gpt.initial_parameters(TINY)
    inputs, targets = train_gpt.make_batch(TINY, 0)
    grads = {}
    for ops in (train_gpt.TESSERA, train_gpt.TORCH):
        model = train_gpt.build_model(TINY, ops, parameters)
        model(inputs, targets).backward()
        grads[ops.name] = dict(model.named_parameters())
    names = list(parameters)
    assert len(names) == 2 + 7 * TINY.layers + 1   # embed, head, 7 per block, final norm
    for name in names:
        got, want = grads["tessera"][name].grad, grads["torch"][name].grad
        assert got is not None and rel(got, want) < TOL, name


def test_batches_are_deterministic_copy_examples():
    inputs, targets = train_gpt.make_batch(TINY, 5)
    again, _ = train_gpt.make_batch(TINY, 5)
    assert torch.equal(inputs, again) and not torch.equal(inputs, train_gpt.make_batch(TINY, 6)[0])
    assert inputs.shape == targets.shape == (TINY.batch, TINY.seq)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    text = train_gpt.decode(inputs[0])
    digits, copy = text[:8].split(";")[0].split("=")
    assert len(digits) == TINY.digits and copy == digits


def test_report_fails_on_curves_apart_after_warmup(capsys):
    cfg = Config(warmup=10, tolerance=0.02, steps=30, skip_timing=0)
    ok = [Run("tessera", {0: 2.5, 10: 1.50, 20: 1.20}, 1.0), Run("torch eager", {0: 2.0, 10: 1.49, 20: 1.21}, 1.0)]
    apart = [Run("tessera", {0: 2.0, 10: 1.50, 20: 1.30}, 1.0), Run("torch eager", {0: 2.0, 10: 1.49, 20: 1.21}, 1.0)]
    assert train_gpt.report(cfg, ok)          # step 0 (warm-up) is 25% apart: not compared
    assert not train_gpt.report(cfg, apart)   # step 20 is 7.4% apart
    assert "FAILED" in capsys.readouterr().out
