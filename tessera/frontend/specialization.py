"""Which dims of a call a function compiles as constants, and which as kernel arguments.

A dim is *dynamic* (one compile serves every value of 2 or more: `tessera.dims`) when the user
marks it (`@tsr.function(dynamic=["S"])`) or, as torch.compile's automatic dynamic shapes do,
once it has been called with two different values (a dim the annotations name: an unannotated
argument's dims are dynamic only when marked); `static=[...]` pins a dim as a constant
whatever it does. A dim the compile could not take at run time (the function's code reads its
value, or a kernel's template takes it as a constant: `Function._compile_generic`) is fixed for
the function's later calls, and `cache_info()` says why, so a sweep over a dim the compiler
cannot make generic costs one failed attempt, not one per call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..dims import class_of
from ..errors import ShapeError, TesseraError


@dataclass(frozen=True)
class CacheInfo:
    """What `Function.cache_info()` reports."""

    compiles: int
    #: calls the compile cache served (a call of shapes that ran before takes the fast path: not counted)
    hits: int
    #: per compile, each dim's value in its key, or a dynamic dim's class (`tessera.dims.class_of`:
    #: "dynamic<=128", "dynamic<=1024", "dynamic", and for a multiple of 128 "dynamic<=1024%128", ...)
    keys: list[dict[str, Any]]
    #: the dims compiled as kernel arguments now (marked, or seen with two values)
    dynamic: tuple[str, ...]
    #: dims a compile had to take as constants, and why
    fixed: dict[str, str] = field(default_factory=dict)


class Specialization:
    """One function's specialization state: the user's `static` and `dynamic` dims, the values
    each dim was called with, the dims fixed as constants, and the compile and hit counts."""

    def __init__(self, fn_name: str, static: Sequence[str] = (), dynamic: Sequence[str] = ()):
        for what, dims in (("static", static), ("dynamic", dynamic)):
            if isinstance(dims, str):
                raise TesseraError(f"{fn_name}: {what}= takes a list of dim names, e.g. {what}=[{dims!r}]")
        both = set(static) & set(dynamic)
        if both:
            raise TesseraError(f"{fn_name}: dim(s) {', '.join(sorted(both))} marked both static and dynamic")
        self.static, self.dynamic = frozenset(static), frozenset(dynamic)
        self.seen: dict[str, int] = {}     # each dim's first value
        self.varied: set[str] = set()      # dims called with two values
        self.fixed: dict[str, str] = {}    # dims a compile could not take at run time: why
        self.yielded: dict[str, str] = {}  # dims fixed only so that another of their tensor's stays generic: that one
        self.compiles = self.hits = 0
        self.keys: list[dict[str, Any]] = []
        #: a call's outputs outgrew 32-bit offsets (`tessera.dims.OffsetWidthError`): 64 from then on
        self.wide = False
        #: dynamic dims whose kernels' code a compile showed not to depend on their multiple
        #: (`tessera.dims.whole_blocks`): their multiples of ALIGNMENT are keyed as any other value
        self.unaligned: set[str] = set()

    def observe(self, fn_name: str, annotations: dict, tensors) -> None:
        """Notes a call's dim values (once per call): a dim the annotations name that is seen with
        a second value becomes dynamic (unnamed ones only by `dynamic=`). The first call checks
        the names `static=` and `dynamic=` give."""
        for name, x in tensors:   # (a call refused for its ranks notes no dim values)
            spec = annotations.get(name)
            if spec is not None and len(spec.dims) != len(x.shape):
                raise ShapeError(f"{fn_name}: argument {name!r} is annotated {spec} (rank {len(spec.dims)}) "
                                 f"but has shape {[int(n) for n in x.shape]} (rank {len(x.shape)})")
        positions = dim_positions(annotations, tensors)
        if not self.seen:
            unknown = sorted((self.static | self.dynamic) - set(positions))
            if unknown:
                raise TesseraError(f"{fn_name}: static=/dynamic= name dim(s) {', '.join(map(repr, unknown))}, "
                                   f"which no argument has; its dims are {', '.join(sorted(positions))}")
        for d, ((i, axis), *others) in positions.items():
            v = int(tensors[i][1].shape[axis])
            for j, other_axis in others:   # (before any cache is asked: a call that fails is no hit)
                w = int(tensors[j][1].shape[other_axis])
                if w != v:
                    raise ShapeError(f"{fn_name}: argument {tensors[j][0]!r} has {d}={w} but argument "
                                     f"{tensors[i][0]!r} has {d}={v}")
            if self.seen.setdefault(d, v) != v and _named(annotations, tensors, positions[d]):
                self.varied.add(d)

    def dynamic_for(self, annotations: dict, tensors) -> dict[str, list[tuple[int, int]]]:
        """The dims this call compiles as kernel arguments, each with its (tensor, axis) positions."""
        positions = dim_positions(annotations, tensors)
        values = {d: int(tensors[i][1].shape[axis]) for d, ((i, axis), *_) in positions.items()}
        wanted = {d for d in (self.dynamic | self.varied) - self.static - self.fixed.keys() if values[d] >= 2}
        self._one_per_tensor(wanted, positions, tensors)
        return {d: positions[d] for d in sorted(wanted - self.fixed.keys())}

    def _one_per_tensor(self, wanted: set, positions: dict, tensors) -> None:
        """A buffer takes one dim at run time (`schedule_to_tile.memref_of`): where a tensor has
        several wanted dims (of 2 or more in this call), the one the user marked dynamic (else its
        last) stays, and the others are fixed, saying why: an attention called with new batch sizes
        and new lengths keeps its length generic, which models lay out after the batch ([B, H, S, D],
        [B, S, D]) and which a decode loop changes every step (its cache) while the batch changes
        seldom; keeping the batch (the first, as it was) recompiled every step."""
        for i, (name, _) in enumerate(tensors):
            dims = [d for d in wanted - self.fixed.keys() if any(j == i for j, _ in positions[d])]
            if len(dims) < 2:
                continue
            axis = {d: next(a for j, a in positions[d] if j == i) for d in dims}
            keep = min(dims, key=lambda d: (d not in self.dynamic, -axis[d]))
            for d in dims:
                if d != keep:
                    self.fix(d, f"argument {name!r} also has dim {keep!r}, which is dynamic, and a tensor "
                                f"takes one dim at run time")
                    self.yielded[d] = keep

    def shapes(self, generic: dict[str, list[tuple[int, int]]], tensors) -> list[tuple]:
        """Each tensor's shape as a cache key: a generic dim's value replaced by its class."""
        shapes = [list(x.shape) for _, x in tensors]
        for d, places in generic.items():
            for i, axis in places:
                shapes[i][axis] = class_of(int(shapes[i][axis]), d not in self.unaligned)
        return [tuple(s) for s in shapes]

    def learn_alignment(self, generic: dict[str, list[tuple[int, int]]], relied: dict[str, int]) -> None:
        """After a compile: each generic dim no kernel's code depends on the multiple of (`relied`:
        the compile's `dim_multiples`) is keyed without ALIGNMENT's class from now on, so one compile
        serves its whole class (a GEMM's or a norm's rows gain nothing from it)."""
        self.unaligned.update(d for d in generic if d not in relied)

    def fix(self, dim: str, why: str) -> None:
        """Takes `dim` as a constant from now on. Dims fixed only so that `dim` could stay generic
        (`_one_per_tensor`) are released: otherwise a length a compile cannot take at run time (a
        paged table's page count, a GEMM's K) would leave its tensor's batch fixed too, and every
        call recompile."""
        self.fixed[dim] = why
        for other in [d for d, kept in self.yielded.items() if kept == dim]:
            del self.yielded[other], self.fixed[other]

    def compiled(self, annotations: dict, tensors, generic) -> None:
        """Counts a compile and keeps its key: each dim's value, or its class where it is dynamic."""
        self.compiles += 1
        values = {d: int(tensors[i][1].shape[axis])
                  for d, ((i, axis), *_) in dim_positions(annotations, tensors).items()}
        self.keys.append({d: class_of(v, d not in self.unaligned) if d in generic else v for d, v in values.items()})

    def info(self) -> CacheInfo:
        return CacheInfo(self.compiles, self.hits, list(self.keys),
                         tuple(sorted((self.dynamic | self.varied) - self.static - self.fixed.keys())),
                         dict(self.fixed))


def dim_positions(annotations: dict, tensors) -> dict[str, list[tuple[int, int]]]:
    """Each symbolic dim's (tensor, axis) positions: the annotation's names, and for an
    unannotated argument `NAME_i` (what `trace.bind_dims` calls them)."""
    positions: dict[str, list[tuple[int, int]]] = {}
    for i, (name, x) in enumerate(tensors):
        spec = annotations.get(name)
        dims = spec.dims if spec is not None and len(spec.dims) == len(x.shape) else \
            [f"{name}_{axis}" for axis in range(len(x.shape))]
        for axis, d in enumerate(dims):
            if isinstance(d, str):
                positions.setdefault(d, []).append((i, axis))
    return positions


def _named(annotations: dict, tensors, places) -> bool:
    """Whether a dim is one the annotations name (a dim of an unannotated argument, `x_0`, is
    only made dynamic when asked: its equality with other dims is unknown to the compile)."""
    i, _ = places[0]
    return tensors[i][0] in annotations
