"""examples/train_gpt.py on CUDA in bf16 (autocast over fp32 weights): a short training run of a small
GPT whose attention, RMSNorms and SwiGLU activation are Tessera functions (their forward and
backward run as Tessera's PTX kernels) tracks the same model in plain torch (SDPA), and learns."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")

import train_gpt  # noqa: E402
from train_gpt import Config  # noqa: E402

SMALL = Config(layers=2, d_model=256, heads=4, seq=256, batch=8, steps=60, lr=3e-3, warmup=10, log_every=5,
               digits=8, dtype="bfloat16", device="cuda", skip_timing=5, no_compile=True)


def quiet(line: str) -> None:
    pass


def rel(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def runs(torch_cuda):
    return train_gpt.train_all(SMALL, train_gpt.initial_parameters(SMALL), log=quiet)


def test_losses_agree_with_torch_within_2_percent(runs):
    tessera, reference = runs
    assert train_gpt.max_relative_difference(SMALL, tessera, reference) < 0.02, (tessera.losses, reference.losses)
    first = max(s for s in reference.losses if s < SMALL.warmup)   # before warm-up: close too, looser
    assert abs(tessera.losses[first] - reference.losses[first]) < 0.05 * reference.losses[first]


def test_loss_falls(runs):
    for run in runs:
        losses = list(run.losses.values())
        assert losses[-1] < 0.85 * losses[0], (run.name, run.losses)   # ~2.5 -> ~1.2 once it copies
    assert runs[0].tokens_per_s > 0


def test_gradients_of_every_parameter_agree_with_torch_in_bf16(torch_cuda):
    torch = torch_cuda
    parameters = train_gpt.initial_parameters(SMALL)
    inputs, targets = train_gpt.make_batch(SMALL, 0)
    grads = {}
    for ops in (train_gpt.TESSERA, train_gpt.TORCH):
        model = train_gpt.build_model(SMALL, ops, parameters)
        with train_gpt.precision(SMALL):
            loss = model(inputs, targets)
        loss.backward()
        grads[ops.name] = {name: p.grad for name, p in model.named_parameters()}
    for name in parameters:
        got, want = grads["tessera"][name], grads["torch"][name]
        assert got is not None and got.device == want.device and torch.isfinite(got).all(), name
        assert rel(got, want) < 5e-2, name


def test_torch_compile_of_the_tessera_model_matches_eager(torch_cuda):
    """torch.compile(fullgraph=True) of the Tessera model (inductor around the Tessera ops) trains
    like the eager model for a few steps."""
    torch = torch_cuda
    cfg = dataclasses.replace(SMALL, steps=4, warmup=1, log_every=1, skip_timing=1)
    parameters = train_gpt.initial_parameters(cfg)
    model = train_gpt.build_model(cfg, train_gpt.TESSERA, parameters)
    eager = train_gpt.train(cfg, "tessera", model, log=quiet)
    model = train_gpt.build_model(cfg, train_gpt.TESSERA, parameters)
    compiled = train_gpt.train(cfg, "tessera compiled", torch.compile(model, fullgraph=True), log=quiet)
    for step, want in eager.losses.items():
        assert abs(compiled.losses[step] - want) < 0.01 * want, (compiled.losses, eager.losses)
