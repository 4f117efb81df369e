"""Which backend compiles each kernel: the rule `backend="auto"` (the default) follows.

Fusion asks `choose` once per kernel, before it tiles the kernel, because the tiling depends on
the backend (`tessera.backends.Backend`: tileiras pipelines its own loads and picks its own
instructions). The choice is a property of the kernel in the Schedule IR (`schedule.kernel`'s
`backend`, and `backend_why`: the rule or option that chose it), which `--dump-ir=schedule`
shows and `tessera compile` reports per kernel, with each rule's reason.

`RULES` are data, tried in order; the first that applies and whose backend can compile the kernel
wins. A backend that cannot (tileiras not installed, device asserts, profile regions) is named in
`backend_why`, and the next rule decides; a rule whose backend takes no dim at run time, for a
kernel over a dynamic dim, fixes the dim (`tessera.dims.DynamicDim`) rather than pass the kernel
on. The measurements behind the rules are in bench/RESULTS.md; `bench/cuda_tile.py` times both backends on the same kernels.

Whether tileiras is installed decides only kernels the PTX backend cannot compile, so a warm-start
entry (tessera.runtime.warm) never holds a choice that another machine would make otherwise. A rule
sending tileiras a kernel PTX can compile must add tileiras to `warm.toolchain_fingerprint`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..backends import BACKEND_OPTIONS, BACKENDS
from ..dims import DynamicDim
from ..errors import TesseraError


@dataclass(frozen=True)
class KernelFacts:
    """What of one kernel the rules and the backends' limits read (fusion derives them)."""

    kind: str                     # the schedule.kernel kind
    #: the operand dtypes (Tessera names) of its matmuls that have no matrix instruction on the
    #: target (the PTX backend has no CUDA-core matmul)
    no_matrix_instruction: frozenset = frozenset()
    dtypes: frozenset = frozenset()   # the element types of its inputs, outputs and matmul operands
    target: object = None         # the compile's platforms.Platform (None: no target)
    dynamic: str | None = None    # a dim it takes at run time (`tessera.dims`)
    asserts: bool = False         # it checks device_asserts
    profiled: bool = False        # its compile stamps profile regions
    #: it reads indices from memory: rows through a tensor of indices (graph.gather), or a mask's
    #: limits read at run time (`masks.ColumnLimit`: a sequence's length, a packed query's keys)
    reads_indices: bool = False


@dataclass(frozen=True)
class Rule:
    name: str                                  # `backend_why` and the compile report name it
    backend: str
    applies: Callable[[KernelFacts], bool]
    why: str                                   # the capability or the measurement behind it


RULES: tuple[Rule, ...] = (
    Rule("fp32_matmul", "cuda-tile", lambda k: "fp32" in k.no_matrix_instruction,
         "its matmul's fp32 operands have no matrix instruction on the target (its tensor-core path "
         "would be TF32); the PTX backend has no CUDA-core matmul, and tileiras computes one in fp32 "
         "(8.2 TFLOP/s at 4096^3 on the H100 and H200, cuBLAS 51.7)"),
    Rule("measured", "ptx", lambda k: True,
         "the PTX backend's kernels were faster than tileiras's on the H100 and H200 (as fast on "
         "cuda-tile: GEMMs 0.68-0.94x, attention 0.80-0.96x, decode 0.78-0.95x, row kernels "
         "0.34-0.58x, elementwise 0.64-0.88x, column sums 0.83-0.92x), all but a column sum of "
         "1000x3000 (5 us against 8; bench/RESULTS.md session 22)"),
)

RULES_BY_NAME = {rule.name: rule for rule in RULES}


@functools.cache
def _tileiras_installed() -> bool:
    from ..backends.cuda_tile import tools
    return tools.available()


def cannot_compile(backend: str, kernel: KernelFacts) -> str | None:
    """Why `backend` cannot compile `kernel` (None: it can, as far as a schedule shows; a dim taken at
    run time is `choose`'s to handle: it fixes the dim where this is None)."""
    if backend != "cuda-tile":
        return None
    reason = BACKENDS[backend].cannot_target(kernel.target, kernel.dtypes)
    if reason is not None:
        return reason
    if kernel.reads_indices:
        return "its lowering reads no indices from memory (a gather's rows, a mask's limits per sequence) yet"
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
    if pinned is not None and pinned != "auto":
        if pinned not in BACKENDS:
            raise TesseraError(f"a schedule space's backend is {pinned!r}; backends are "
                               f"{', '.join(BACKEND_OPTIONS)} (a space lists them: {{'backend': ['ptx']}})")
        return Choice(pinned, "the autotune space")
    if option != "auto" and pinned is None:
        return Choice(option, "the backend option")
    passed = []
    for rule in RULES:
        if not rule.applies(kernel):
            continue
        reason = cannot_compile(rule.backend, kernel)
        if reason is None and kernel.dynamic is not None and not BACKENDS[rule.backend].dynamic_dims:
            # (the next rule's backend would take the dim, but a kernel the rule's backend compiles
            # better, or alone, such as an fp32 matmul, is worth a compile per value)
            raise DynamicDim(kernel.dynamic, f"rule {rule.name} gives this kernel to the {rule.backend} "
                                             f"backend, which takes every dim as a constant")
        if reason is None:
            return Choice(rule.backend, f"rule {rule.name}" + (f" ({'; '.join(passed)})" if passed else ""))
        passed.append(f"{rule.name}: {rule.backend} cannot compile it, {reason}")
    raise AssertionError("the last rule applies to every kernel")   # RULES ends with one


def rules_named(whys) -> list[Rule]:
    """The rules that kernels' `backend_why`s name (chose by, or passed over), in RULES' order."""
    named = {word.rstrip(":") for why in whys for word in why.replace("(", " ").split()}
    return [rule for rule in RULES if rule.name in named]


assert all(rule.backend in BACKENDS for rule in RULES) and RULES[-1].applies(KernelFacts("gemm"))
