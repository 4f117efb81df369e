"""Train a GPT-style decoder whose attention, RMSNorms and SwiGLU activation are Tessera functions,
next to the same model in plain torch, and compare their loss curves and speed (issue 14, item 6).

    python examples/train_gpt.py          # one GPU: 8 layers, d_model 1024, 16 heads, seq 2048, batch 8, bf16
    python examples/train_gpt.py --device cpu --dtype float32 --layers 2 --d-model 32 --heads 2 --seq 32 \\
        --batch 8 --steps 100 --lr 5e-3 --warmup 5 --digits 3 --no-compile      # tiny, on the CPU (~20 s)

On the CPU the Tessera functions run on Tessera's CPU interpreter (slow: keep the model tiny; on a
busy machine, OMP_NUM_THREADS=1 keeps torch's threads from waiting on each other). On the GPU, fp32
matmuls have no Tessera path: use --dtype bfloat16 there (the default).

The model: token embeddings, then pre-norm blocks (RMSNorm with a learned weight -> causal multi-head
attention with rotary positions -> residual add; RMSNorm -> SwiGLU MLP -> residual add), a final
RMSNorm and an untied output projection. Three pieces are `@tsr.function`s, called with torch tensors
that require grad, so they are torch custom ops whose backward runs Tessera's generated backward
kernels (tessera/frontend/torch_autograd.py): the causal attention over [B, H, S, D] (one flash
kernel forward, flash-style kernels backward reading the saved log-sum-exp), the RMSNorm and
silu(gate) * up. Everything else (embeddings, projections, rotary, residuals, the loss, AdamW) is
torch. The reference model is the same module with those three pieces in torch
(F.scaled_dot_product_attention(is_causal=True), RMSNorm math, F.silu); both start from one set of parameters made from
--seed, use the same precision policy (bf16 autocast over fp32 weights, or plain fp32) and see the
same batches in the same order.

The data: a copy task the script makes itself, deterministic from --seed and the step. Each row
packs examples "<d digits>=<the same digits>;"; the loss is over all tokens, so the random digits
keep it above a floor of about ln(10) * d / (2d + 2), which it reaches once the model copies.

It reports the loss every --log-every steps for the Tessera model, torch eager and torch.compile of
the reference (and of the Tessera model with --compile-tessera), the largest relative difference
between the Tessera and the eager torch losses at the logged steps from --warmup on (and, for
scale, torch.compile's difference from eager: training amplifies the rounding differences of any
other kernels for the same math), and each model's training throughput in tokens/s (timed with
synchronize around the steps after the first --skip-timing). It exits with status 1 when the
Tessera difference exceeds --tolerance (default 2%).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tessera as tsr
from tessera import Tensor

# --- the three pieces, in Tessera and in torch ----------------------------------------------------


@tsr.function
def causal_attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"],
                     v: Tensor["B", "H", "S", "D"]) -> Tensor["B", "H", "S", "D"]:
    scores = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    rows = tsr.arange(q.shape[-2])
    cols = tsr.arange(k.shape[-2])
    scores = tsr.where(rows[:, None] >= cols[None, :], scores, -math.inf)
    return tsr.matmul(tsr.softmax(scores, dim=-1), v)


@tsr.function
def rms_norm(x: Tensor["B", "S", "C"], weight: Tensor["C"], eps: float) -> Tensor["B", "S", "C"]:
    return tsr.rms_norm(x, (x.shape[-1],), weight, eps)


@tsr.function
def swiglu(gate: Tensor["B", "S", "F"], up: Tensor["B", "S", "F"]) -> Tensor["B", "S", "F"]:
    return tsr.silu(gate) * up


def torch_causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def torch_rms_norm(x, weight, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def torch_swiglu(gate, up):
    return F.silu(gate) * up


@dataclass(frozen=True)
class Ops:
    """The model's pieces that differ between the two implementations."""
    name: str
    attention: Callable   # (q, k, v) of [B, H, S, D] -> causal softmax attention
    rms_norm: Callable    # (x, weight, eps) -> RMSNorm over the last dim
    swiglu: Callable      # (gate, up) -> silu(gate) * up


TESSERA = Ops("tessera", causal_attention, rms_norm, swiglu)
TORCH = Ops("torch", torch_causal_attention, torch_rms_norm, torch_swiglu)


# --- the model ------------------------------------------------------------------------------------

@dataclass
class Config:
    layers: int = 8
    d_model: int = 1024
    heads: int = 16
    seq: int = 2048
    batch: int = 8
    steps: int = 300
    lr: float = 6e-4            # peak learning rate, after a linear warm-up over --warmup steps
    warmup: int = 30            # also: the logged steps compared start here
    log_every: int = 10
    digits: int = 16            # digits per copy example
    seed: int = 0
    dtype: str = "bfloat16"     # autocast dtype over fp32 weights, or float32
    device: str = "cuda"
    tolerance: float = 0.02     # largest relative loss difference allowed after --warmup
    skip_timing: int = 10       # steps (compiles, warm-up) left out of tokens/s
    no_compile: bool = False    # skip the torch.compile run
    compile_tessera: bool = False   # also train torch.compile of the Tessera model

    @property
    def vocab(self) -> int:
        return len(ALPHABET)

    @property
    def mlp_hidden(self) -> int:
        return 64 * math.ceil(8 * self.d_model / 3 / 64)   # SwiGLU's 8/3 d, rounded up to 64


EPS = 1e-5
ALPHABET = "0123456789=;"


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):
    """Rotary position embedding of x [B, H, S, D] (halves rotated), in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: Config, ops: Ops):
        super().__init__()
        self.ops, self.heads = ops, cfg.heads
        self.attn_norm = nn.Parameter(torch.ones(cfg.d_model))
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.d_model))
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, s, c = x.shape
        h = self.ops.rms_norm(x, self.attn_norm, EPS)
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = self.ops.attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, c))
        h = self.ops.rms_norm(x, self.mlp_norm, EPS)
        return x + self.down(self.ops.swiglu(self.gate(h), self.up(h)))


class GPT(nn.Module):
    def __init__(self, cfg: Config, ops: Ops):
        super().__init__()
        self.ops = ops
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq, cfg.d_model // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():   # GPT-2's init: residual outputs scaled by depth
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens, targets):
        """The mean cross-entropy of next-token predictions over all positions."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.ops.rms_norm(x, self.norm, EPS))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def initial_parameters(cfg: Config) -> dict:
    """One set of parameters, from cfg.seed (made on the CPU, so the same on every device)."""
    torch.manual_seed(cfg.seed)
    return GPT(cfg, TORCH).state_dict()


def build_model(cfg: Config, ops: Ops, parameters: dict) -> GPT:
    model = GPT(cfg, ops)
    model.load_state_dict(parameters)
    return model.to(cfg.device)


# --- data -----------------------------------------------------------------------------------------

def copy_examples(n: int, digits: int, gen: torch.Generator) -> torch.Tensor:
    """n examples "<digits>=<the same digits>;" as token ids [n, 2 * digits + 2]."""
    x = torch.randint(0, 10, (n, digits), generator=gen)
    sep = torch.full((n, 1), ALPHABET.index("="))
    end = torch.full((n, 1), ALPHABET.index(";"))
    return torch.cat([x, sep, x, end], dim=1)


def make_batch(cfg: Config, step: int):
    """The inputs and next-token targets [batch, seq] of one step: rows of packed copy examples,
    the same for a given (seed, step) whatever the model or device."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    per_row = -(-(cfg.seq + 1) // (2 * cfg.digits + 2))
    rows = copy_examples(cfg.batch * per_row, cfg.digits, gen).view(cfg.batch, -1)[:, :cfg.seq + 1]
    rows = rows.to(cfg.device)
    return rows[:, :-1], rows[:, 1:]


def decode(tokens) -> str:
    return "".join(ALPHABET[t] for t in tokens.tolist())


# --- training -------------------------------------------------------------------------------------

@dataclass
class Run:
    name: str
    losses: dict      # step -> loss, at the logged steps
    tokens_per_s: float


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=cfg.device.startswith("cuda"))


def precision(cfg: Config):
    """bf16 autocast over fp32 weights, or nothing (float32)."""
    if cfg.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(cfg.device).type, dtype=getattr(torch, cfg.dtype))


def synchronize(cfg: Config) -> None:
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(cfg: Config, model, optimizer, step: int) -> torch.Tensor:
    """One optimizer step on batch `step`; returns the loss (before the step)."""
    inputs, targets = make_batch(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    with precision(cfg):
        loss = model(inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(cfg: Config, name: str, model, log=print) -> Run:
    """cfg.steps steps of AdamW on `model` (a GPT, or torch.compile of one); the losses at the
    logged steps and the tokens/s of the steps after cfg.skip_timing."""
    optimizer = make_optimizer(cfg, model)
    losses, start = {}, None
    for step in range(cfg.steps):
        if step == cfg.skip_timing:
            synchronize(cfg)
            start = time.perf_counter()
        loss = train_step(cfg, model, optimizer, step)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            losses[step] = loss.item()
            log(f"  {name:>16} step {step:5d}  loss {losses[step]:.4f}")
    synchronize(cfg)
    timed = cfg.steps - cfg.skip_timing
    tokens_per_s = timed * cfg.batch * cfg.seq / (time.perf_counter() - start) if start is not None else math.nan
    return Run(name, losses, tokens_per_s)


def train_all(cfg: Config, parameters: dict, log=print) -> list[Run]:
    """The Tessera model, then the torch reference eager, then compiled (unless cfg.no_compile),
    each from a copy of `parameters`, on the same batches."""
    plan = [("tessera", TESSERA, False), ("torch eager", TORCH, False)]
    if not cfg.no_compile:
        plan.append(("torch.compile", TORCH, True))
        if cfg.compile_tessera:
            plan.append(("tessera compiled", TESSERA, True))
    runs = []
    for name, ops, compiled in plan:
        model = build_model(cfg, ops, parameters)
        runs.append(train(cfg, name, torch.compile(model, fullgraph=True) if compiled else model, log))
        del model
        if cfg.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return runs


def max_relative_difference(cfg: Config, a: Run, b: Run) -> float:
    """max |a - b| / |b| over the logged steps from cfg.warmup on (all of them, if none is)."""
    steps = [s for s in b.losses if s >= cfg.warmup] or list(b.losses)
    return max(abs(a.losses[s] - b.losses[s]) / abs(b.losses[s]) for s in steps)


def report(cfg: Config, runs: list[Run]) -> bool:
    """Prints the curves side by side and the throughputs; whether Tessera's curve agrees."""
    tessera, reference = runs[0], runs[1]
    print("\n  step" + "".join(f"{r.name:>18}" for r in runs) + "   rel. diff")
    for step in reference.losses:
        diff = abs(tessera.losses[step] - reference.losses[step]) / abs(reference.losses[step])
        print(f"{step:6d}" + "".join(f"{r.losses[step]:18.4f}" for r in runs) + f"   {diff:9.2%}")
    worst = max_relative_difference(cfg, tessera, reference)
    agree = worst <= cfg.tolerance
    print(f"\nmax relative difference, tessera vs torch eager, logged steps >= {cfg.warmup}: {worst:.3%} "
          f"(tolerance {cfg.tolerance:.1%}): {'OK' if agree else 'FAILED'}")
    for r in runs[2:]:   # other kernels for the same math drift apart too: training amplifies rounding
        print(f"  for scale, {r.name} vs torch eager: {max_relative_difference(cfg, r, reference):.3%}")
    floor = math.log(10) * cfg.digits / (2 * cfg.digits + 2)
    print(f"loss floor of the task (the unpredictable digits): {floor:.4f}")
    print(f"\ntokens/s (steps {cfg.skip_timing}..{cfg.steps - 1}, {cfg.batch} x {cfg.seq} tokens a step):")
    for r in runs:
        print(f"  {r.name:>16}  {r.tokens_per_s:12,.0f}   {r.tokens_per_s / reference.tokens_per_s:5.2f}x torch eager")
    return agree


def parse_args(argv=None) -> Config:
    """A Config from command line flags: one per field (--d-model for d_model), defaulting to it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f"default: {f.default}")
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.dtype not in ("bfloat16", "float32"):
        parser.error("--dtype: bfloat16 (autocast over fp32 weights) or float32")
    if cfg.dtype == "float32" and cfg.device.startswith("cuda"):
        parser.error("--dtype float32 on a GPU: Tessera has no fp32 matmul for the GPU; use bfloat16")
    if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
        parser.error("--d-model must be --heads times an even head dim")
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    parameters = initial_parameters(cfg)
    n_params = sum(p.numel() for p in parameters.values())
    print(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, MLP {cfg.mlp_hidden}, "
          f"{n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}, {cfg.steps} steps, "
          f"{cfg.dtype} on {cfg.device}")
    print(f"data: rows of copy examples, e.g. {decode(make_batch(cfg, 0)[0][0, :2 * cfg.digits + 2])}")
    runs = train_all(cfg, parameters)
    return 0 if report(cfg, runs) else 1


if __name__ == "__main__":
    sys.exit(main())
