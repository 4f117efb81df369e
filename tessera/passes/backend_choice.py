"""Which backend compiles each kernel: the rule `backend="auto"` (the default) follows.

Fusion asks `choose` once per kernel, before it tiles the kernel, because the tiling depends on
the backend (`tessera.backends.Backend`: tileiras pipelines its own loads and picks its own
instructions). The choice is a property of the kernel in the Schedule IR (`schedule.kernel`'s
`backend`, and `backend_why`: the rule or option that chose it), which `--dump-ir=schedule`
shows and `tessera compile` reports per kernel, with each rule's reason.

`RULES` are data, tried in order; the first that applies and whose backend can compile the kernel
wins. A backend that cannot (tileiras not installed, a dim taken at run time, device asserts,
profile regions) is named in `backend_why`, and the next rule decides. The measurements behind the
rules are in bench/RESULTS.md; `bench/cuda_tile.py` times both backends on the same kernels.

Whether tileiras is installed decides only kernels the PTX backend cannot compile, so a warm-start
entry (tessera.runtime.warm) never holds a choice that another machine would make otherwise. A rule
sending tileiras a kernel PTX can compile must add tileiras to `warm.toolchain_fingerprint`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..backends import BACKENDS


@dataclass(frozen=True)
class KernelFacts:
    """What of one kernel the rules and the backends' limits read (fusion derives them)."""

    kind: str                     # the schedule.kernel kind
    ptx_matmul: bool              # every matmul it has (if any) has a matrix instruction on the
                                  # target (the PTX backend has no CUDA-core matmul)
    dynamic: str | None = None    # a dim it takes at run time (`tessera.dims`)
    asserts: bool = False         # it checks device_asserts
    profiled: bool = False        # its compile stamps profile regions


@dataclass(frozen=True)
class Rule:
    name: str                                  # `backend_why` and the compile report name it
    backend: str
    applies: Callable[[KernelFacts], bool]
    why: str                                   # the capability or the measurement behind it


RULES: tuple[Rule, ...] = (
    Rule("fp32_matmul", "cuda-tile", lambda k: not k.ptx_matmul,
         "its matmul's operands have no matrix instruction on the target (fp32, whose tensor-core path "
         "would be TF32); the PTX backend has no CUDA-core matmul, and tileiras compiles one"),
    Rule("measured", "ptx", lambda k: True,
         "the PTX backend's kernels are faster than tileiras's on every kernel kind measured on the "
         "H100 and H200 (GEMMs 0.67-0.92x, attention 0.86-0.96x, soft-capped attention 0.79x, row "
         "kernels 0.26-0.40x as fast on cuda-tile; bench/RESULTS.md sessions 14 and 22)"),
)

RULES_BY_NAME = {rule.name: rule for rule in RULES}


@functools.cache
def _tileiras_installed() -> bool:
    from ..backends.cuda_tile import tools
    return tools.available()


def cannot_compile(backend: str, kernel: KernelFacts) -> str | None:
    """Why `backend` cannot compile `kernel` (None: it can, as far as a schedule shows)."""
    if kernel.dynamic is not None and not BACKENDS[backend].dynamic_dims:
        return f"it takes every dim as a constant, and this kernel takes {kernel.dynamic} at run time"
    if backend != "cuda-tile":
        return None
    if not _tileiras_installed():
        return "tileiras is not installed (pip install 'tessera[cuda-tile]')"
    if kernel.asserts:
        return "it has no device_assert"
    if kernel.profiled:
        return "it has no profile regions"
    return None


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str          # "rule NAME", "the backend option", "the autotune space", with any rule
                      # passed over and why: "rule measured (fp32_matmul: tileiras is not installed)"


def choose(kernel: KernelFacts, option: str = "auto", pinned: str | None = None) -> Choice:
    """The backend of `kernel` under the compile's `backend` option ("auto", or one backend for
    every kernel), or as an autotune space `pinned` it."""
    if pinned is not None:
        return Choice(pinned, "the autotune space")
    if option != "auto":
        return Choice(option, "the backend option")
    passed = []
    for rule in RULES:
        if not rule.applies(kernel):
            continue
        reason = cannot_compile(rule.backend, kernel)
        if reason is None:
            return Choice(rule.backend, f"rule {rule.name}" + (f" ({'; '.join(passed)})" if passed else ""))
        passed.append(f"{rule.name}: {rule.backend} cannot compile it, {reason}")
    raise AssertionError("the last rule applies to every kernel")   # RULES ends with one


def rules_named(whys) -> list[Rule]:
    """The rules that kernels' `backend_why`s name (chose by, or passed over), in RULES' order."""
    named = {word.rstrip(":") for why in whys for word in why.replace("(", " ").split()}
    return [rule for rule in RULES if rule.name in named]


assert all(rule.backend in BACKENDS for rule in RULES) and RULES[-1].applies(KernelFacts("gemm", True))
