"""`tessera.distributed.shard`: a Tessera function run on shards over a device mesh.

    mesh = DeviceMesh("cuda", (2,), ("tp",))
    block_tp = shard(block, mesh, {"Q": "tp", "F": "tp"}, sequence="S")
    args = block_tp.local(x, wq, wk, wv, wo, w1, w3, w2)   # this rank's shards of whole tensors
    y = block_tp(*args)                                   # this rank's rows of the block's output

Each rank runs the function's math on its shards. Where that math needs communication follows
from `placement.analyze` on the function's Graph IR: a partial sum read by anything but linear
math is all-reduced (or reduce-scattered along the sequence dim, with sequence parallelism), a
sequence-sharded value all-gathered where an op needs all of it. The function is split at those
collectives into segments (`placement.segments`), each compiled as an ordinary function for its
local sizes (and cached like one), run in order with the collectives between them: torch.distributed's
on the mesh's process groups, on the caller's current stream.

Under torch autograd each collective has its gradient (an all-reduce's is the identity, a
reduce-scatter's an all-gather and back), and a value that enters sharded math from replicated
math gets its gradient all-reduced (Megatron-LM's f and g, derived rather than placed by hand):
a replicated input of column-parallel matmuls, a weight under data parallelism, a
sequence-parallel norm's weight. A result that is sharded stays the rank's shard (the next sharded
function takes it as it is, as Megatron-LM's layers do).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import ArgumentKindError, ShapeError, TesseraError
from ..frontend.function import Function
from .mesh import DeviceMesh


#: the fewest rows a chunk of an overlapped call gets: smaller GEMMs lose more to their tails
#: than hiding the collective gains
MIN_CHUNK_ROWS = 512


@dataclass
class _Step:
    """One step of a sharded call: a segment (its function, and the overlap when it runs in
    chunks: (dim name, chunks, per output its dim index)), or a cut (a collective)."""

    segment: Any = None
    function: Any = None
    cut: Any = None
    overlap: tuple | None = None
    reducing: tuple = ()        # an overlapped segment's outputs' all-reduce cuts
    owns_source: bool = False   # the cut's source is read by nothing else: reduce it in place


@dataclass
class _Plan:
    """A call signature's schedule: the analysis, the steps, and the words for them."""

    analysis: Any
    steps: list[_Step] = field(default_factory=list)

    def describe(self, name: str) -> str:
        """The schedule in words (the sharded function's compile report)."""
        a = self.analysis
        lines = []
        if a.sequence:
            lines.append(f"{name}: sequence parallel along {a.sequence[0]} over {a.sequence[1]}")
        for step in self.steps:
            if step.segment is not None:
                seg = step.segment
                line = f"{name} part {seg.index}: {_summary(seg.ops)}"
                if seg.sequence_sharded:
                    line += f", rows sharded along {a.sequence[0]}"
                if step.overlap:
                    dim, chunks, _ = step.overlap
                    line += (f"; in {chunks} chunks along {dim}, each chunk's all-reduce overlapping the next "
                             f"chunk's kernels")
                lines.append(line)
            elif step.cut.collective.kind != "enter":
                lines.append(f"{name}: {_cut_words(a, step.cut)}")
        entering = [c for c in a.cuts() if c.collective.kind == "enter"]
        if entering:
            lines.append(f"{name} backward: all-reduce of the gradients of "
                         + ", ".join(f"{_value_words(a, c.source)} (over {', '.join(c.collective.axes)})"
                                     for c in entering))
        for i, k in enumerate(a.results):
            if not hasattr(k, "collective"):
                lines.append(f"{name} result {i}: no communication")
        return "\n".join(lines)


class ShardedFunction:
    """`fn` over `mesh` with the dims named in `dims` split over the mesh axes they map to, and
    the `sequence` dim (a name, or (name, axis)) split between tensor-parallel regions."""

    def __init__(self, fn: Function, mesh: DeviceMesh, dims: dict[str, str], chunks: int = 1,
                 sequence: str | tuple[str, str] | None = None):
        if not isinstance(fn, Function):
            raise TesseraError(f"shard takes a @tessera.function, got {type(fn).__name__}")
        named = {d for spec in fn.annotations.values() for d in spec.dims if isinstance(d, str)}
        for dim, axis in dims.items():
            mesh.size(axis)   # the axis exists
            if dim not in named:
                raise TesseraError(f"shard of {fn.name}: no argument of it has a dim named {dim!r} (its annotations "
                                   f"name {', '.join(sorted(named)) or 'no dims'})")
        if isinstance(sequence, str):
            axes = sorted(set(dims.values()))
            if len(axes) != 1:
                raise TesseraError(f"shard of {fn.name}: sequence={sequence!r} needs its mesh axis when the "
                                   f"sharded dims use {len(axes)} axes: pass sequence=({sequence!r}, axis)")
            sequence = (sequence, axes[0])
        if sequence is not None:
            mesh.size(sequence[1])
            if sequence[0] not in named or sequence[0] in dims:
                raise TesseraError(f"shard of {fn.name}: the sequence dim {sequence[0]!r} must be a dim of its "
                                   f"arguments that `dims` does not shard already")
        self.fn, self.mesh, self.dims, self.chunks = fn, mesh, dict(dims), chunks
        self.sequence = tuple(sequence) if sequence else None
        self.name = fn.name
        self._plans: dict[tuple, _Plan] = {}

    # --- shards of whole tensors ------------------------------------------------------------
    def _split_dims(self) -> dict[str, str]:
        return {**self.dims, **({self.sequence[0]: self.sequence[1]} if self.sequence else {})}

    def local(self, *args) -> list:
        """This rank's shards of whole-tensor arguments: each dim named in `dims` (and the
        sequence dim) cut into equal parts along its mesh axis (a ShapeError naming the dim and
        argument when it does not divide); other arguments as they are."""
        split = self._split_dims()
        out = []
        for name, x in zip(self.fn.signature.parameters, args):
            spec = self.fn.annotations.get(name)
            if spec is None or not hasattr(x, "shape"):
                out.append(x)
                continue
            for i, d in enumerate(spec.dims):
                if d in split:
                    axis = split[d]
                    n, size = self.mesh.size(axis), x.shape[i]
                    if size % n:
                        raise ShapeError(f"shard of {self.name}: dim {d}={size} of argument {name!r} does not divide "
                                         f"over mesh axis {axis!r} of {n} ranks; pad it to a multiple of {n}")
                    part = size // n
                    x = x.narrow(i, self.mesh.rank(axis) * part, part)
            out.append(x.contiguous())
        return out

    # --- calls --------------------------------------------------------------------------------
    def __call__(self, *args):
        """The function on this rank's shards (what `local` cuts). Shapes are taken as given: a
        whole tensor passed where a shard belongs is computed with as if it were one (nothing
        on a rank knows the global sizes), so pass `local`'s results."""
        import torch

        tensors, constants = self.fn._split_args(args)
        for name, x in tensors:
            if not isinstance(x, torch.Tensor):
                raise ArgumentKindError(f"shard of {self.name}: argument {name!r} is a {type(x).__name__}; a sharded "
                                        f"function takes torch tensors (its collectives are torch.distributed's)")
        training = torch.is_grad_enabled() and any(x.requires_grad for _, x in tensors)
        plan = self._plan(tensors, constants, training)
        env: dict = dict(zip(plan.analysis.f.body.block.args, [x for _, x in tensors]))
        done: set[int] = set()
        for step in plan.steps:
            if step.segment is not None:
                self._run_segment(step, env, done, training)
            elif id(step.cut) not in done:
                env[step.cut] = self._collective(step.cut, env[step.cut.source], training, step.owns_source)
        results = [env[k] for k in plan.analysis.results]
        return tuple(results) if len(results) > 1 else results[0]

    def _run_segment(self, step: _Step, env: dict, done: set[int], training: bool) -> None:
        seg = step.segment
        ins = [env[k] for k in seg.inputs]
        if step.overlap:
            return self._overlapped(step, ins, env, done, training)
        outs = step.function(*ins)
        env.update(zip(seg.outputs, outs if isinstance(outs, tuple) else (outs,)))

    def _overlapped(self, step: _Step, ins: list, env: dict, done: set[int], training: bool) -> None:
        """The segment in chunks along the step's dim: each chunk's kernels, then its outputs'
        all-reduces issued asynchronously (NCCL's stream waits for the kernels, the next chunk's
        kernels do not wait for it), all waited for before the chunks are joined."""
        import torch

        from . import collectives

        dim, chunks, out_dims = step.overlap
        fn, cuts = step.function, step.reducing
        pending: list = []
        parts: list[list] = []
        for i in range(chunks):
            chunk = []
            for name, x in zip(fn.signature.parameters, ins):
                dims = fn.annotations[name].dims
                if dim in dims:
                    axis = dims.index(dim)
                    part = x.shape[axis] // chunks
                    x = x.narrow(axis, i * part, part)
                chunk.append(x)
            outs = fn(*chunk)
            outs = outs if isinstance(outs, tuple) else (outs,)
            parts.append([collectives.all_reduce_async(o, self._groups(c.collective.axes), pending, training)
                          for o, c in zip(outs, cuts)])
        for work in pending:
            work.wait()
        for j, (c, d) in enumerate(zip(cuts, out_dims)):
            env[c] = torch.cat([p[j] for p in parts], dim=d)
            done.add(id(c))

    def _collective(self, cut, x, training: bool, owned: bool):
        from . import collectives

        c = cut.collective
        groups = self._groups(c.axes)
        if training:
            return collectives.apply(x, c.kind, c.dim, groups, cut.grad)
        return collectives.run(x, c.kind, c.dim, groups, in_place=owned)

    def _groups(self, axes: Sequence[str]) -> tuple:
        return tuple(self.mesh.group(a) for a in axes)

    # --- plans --------------------------------------------------------------------------------
    def report(self, *args) -> str:
        """What a call with these arguments communicates, and when (module doc)."""
        import torch

        tensors, constants = self.fn._split_args(args)
        training = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for _, x in tensors)
        return self._plan(tensors, constants, training).describe(self.name)

    def communication(self, *args) -> list[Transfer]:
        """The collectives a call with these arguments runs, forward and (where an argument
        requires grad) backward, with the shapes they move: what bench/tensor_parallel.py times
        alone to find how much of it the kernels hide."""
        import torch

        tensors, constants = self.fn._split_args(args)
        training = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for _, x in tensors)
        plan = self._plan(tensors, constants, training)
        a = plan.analysis
        parts = self.mesh.size(self.sequence[1]) if self.sequence else 1
        out = []
        for cut in a.cuts():
            c = cut.collective
            source, result = _sizes(a, cut.source, parts), _sizes(a, cut, parts)
            dtype = _value(cut).type.dtype
            if c.kind not in ("enter", "split"):
                out.append(Transfer("forward", c.kind, source, dtype, c.axes, c.dim))
            if training:
                from . import collectives
                grad = collectives.gradient_kind(c.kind, cut.grad)
                if grad not in (None, "split"):   # (a split keeps each rank's part: no transfer)
                    out.append(Transfer("backward", grad, result, dtype, c.axes, c.dim))
        return out

    def placements(self, *args):
        """The placement (`placement.Placement`) of each result of a call with these arguments."""
        tensors, constants = self.fn._split_args(args)
        a = self._plan(tensors, constants, False).analysis
        return [a.states[k].placement() for k in a.results]

    def _plan(self, tensors, constants, training: bool) -> _Plan:
        key = (tuple((n, tuple(x.shape), str(x.dtype)) for n, x in tensors), tuple(sorted(constants.items())),
               training)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(tensors, constants, training)
        return plan

    def _make_plan(self, tensors, constants, training: bool) -> _Plan:
        from . import placement

        module, bindings = self._trace(tensors, constants)
        parts = self.mesh.size(self.sequence[1]) if self.sequence else 1
        a = placement.analyze(module, self.dims, self.sequence, gradients=training)
        plan = _Plan(a)
        cuts = a.cuts()
        references: dict[int, int] = {}
        for k in [*a.uses.values(), *a.results, *(c.source for c in cuts)]:
            references[id(k)] = references.get(id(k), 0) + 1
        cut_of = {c.source: c for c in cuts if not isinstance(c.source, placement.Cut)}
        segments = placement.segments(a, split_tails=self.chunks > 1)
        level_of_cut = {}

        def cut_level(c) -> int:
            if id(c) not in level_of_cut:
                src = c.source
                base = cut_level(src) if isinstance(src, placement.Cut) else next(
                    (s.level for s in segments if any(src is v for v in s.outputs)), -1)
                level_of_cut[id(c)] = base + 1
            return level_of_cut[id(c)]
        levels = sorted({s.level for s in segments} | {cut_level(c) for c in cuts})
        for lv in levels:
            for c in cuts:
                if cut_level(c) == lv:
                    plan.steps.append(_Step(cut=c, owns_source=references.get(id(c.source), 0) == 1))
            for s in segments:
                if s.level == lv:
                    fn = SegmentFunction(self.fn, a, s, bindings, parts)
                    overlap = self._overlap(fn, s, references, cut_of)
                    plan.steps.append(_Step(segment=s, function=fn, overlap=overlap,
                                            reducing=tuple(cut_of[v] for v in s.outputs) if overlap else ()))
        return plan

    def _trace(self, tensors, constants):
        """The function's Graph IR for this call, traced for its tensor-parallel regions: the
        sharded dims at their local sizes, the sequence dim whole."""
        shaped = tensors
        if self.sequence:
            n = self.mesh.size(self.sequence[1])
            shaped = []
            for name, x in tensors:
                spec = self.fn.annotations.get(name)
                shape = list(x.shape)
                if spec is not None and self.sequence[0] in spec.dims:
                    shape[spec.dims.index(self.sequence[0])] *= n
                shaped.append((name, _Shaped(tuple(shape), x.dtype)))
        bindings, specs = self.fn.arg_specs(shaped)
        return self.fn.trace(specs, constants), bindings

    def _overlap(self, fn: SegmentFunction, seg, references: dict[int, int], cut_of: dict):
        """(dim, chunks, per output that dim's index) when the segment's outputs are each read
        only by an all-reduce over one axis, and a dim every output has, along which the segment
        is independent (`placement.independent_dims`), cuts every input and output that has it
        into `chunks` contiguous blocks (only dims of size 1 before it) of at least MIN_CHUNK_ROWS
        rows (the output's elements over its last dim); the outermost such dim. Else None."""
        import math

        from ..ir import graph as g
        from . import placement

        if self.chunks < 2 or not seg.outputs:
            return None
        for v in seg.outputs:
            c = cut_of.get(v)
            if c is None or c.collective.kind != "all_reduce" or len(c.collective.axes) != 1 or \
                    references.get(id(v), 0) != 1:
                return None
        module = fn.trace(fn.specs())
        sizes = fn.local_sizes()
        outputs = [g.tensor_type(v).shape for v in seg.outputs]
        shapes = [*outputs, *(t.shape for t in fn.input_types)]

        def contiguous_blocks(d) -> bool:
            return all(all(g.dim_value(e, sizes) == 1 for e in s[:list(s).index(d)]) for s in shapes if d in s)

        def rows(d) -> int:
            return min(math.prod(g.dim_value(e, sizes) for e in s[:-1]) for s in outputs) // self.chunks
        candidates = [d for d in placement.independent_dims(module) if all(d in s for s in outputs)
                      and sizes.get(d, 0) % self.chunks == 0 and contiguous_blocks(d) and rows(d) >= MIN_CHUNK_ROWS]
        if not candidates:
            return None
        dim = min(candidates, key=lambda d: list(outputs[0]).index(d))
        return dim, self.chunks, tuple(list(s).index(dim) for s in outputs)


@dataclass(frozen=True)
class Transfer:
    """One collective of a sharded call: its pass, kind, the shape and dtype of what it reads,
    mesh axes and dim (`ShardedFunction.communication`)."""

    phase: str
    kind: str
    shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str, ...]
    dim: int | None


def _sizes(a, k, parts: int) -> tuple[int, ...]:
    """The local shape of value or cut `k`: the trace's sizes, the sequence-sharded dim's local count."""
    from ..ir import graph as g

    bindings = g.bindings_of(a.f)
    shape = [g.dim_value(d, bindings) for d in g.tensor_type(_value(k)).shape]
    seq = a.states[k].seq
    if seq is not None:
        shape[seq] //= parts
    return tuple(shape)


@dataclass(frozen=True)
class _Shaped:
    """An argument's shape and dtype, standing in for a tensor in `Function.arg_specs`."""

    shape: tuple[int, ...]
    dtype: Any


class SegmentFunction(Function):
    """One segment of a sharded function as a function of its own: its inputs are parameters
    (named after the function's arguments, or `t<i>`), its trace clones the segment's ops from the
    function's Graph IR, its dims bound from the call (a sequence-sharded segment's rows at their
    local count). It compiles, caches, and runs under torch autograd like any function, each dim a
    constant."""

    takes_dynamic_dims = False

    def __init__(self, parent: Function, analysis, segment, bindings: dict[str, int], sequence_parts: int):
        from ..frontend.tensor import TensorSpec
        from ..ir import graph as g

        super().__init__(parent.fn, space=parent.space)
        self.analysis, self.segment = analysis, segment
        self.name = self.__name__ = f"{parent.name}_part{segment.index}"
        self.captures = parent.captures
        self.whole_bindings = dict(bindings)
        self.sequence_parts = sequence_parts
        arg_names = [n.data for n in analysis.f.attributes["tessera.arg_names"].data]
        block_args = list(analysis.f.body.block.args)
        names = []
        for i, k in enumerate(segment.inputs):
            v = _value(k)
            base = arg_names[block_args.index(v)] if v in block_args else f"t{i}"
            names.append(base if base not in names else f"{base}_{i}")
        self.input_types = [g.tensor_type(_value(k)) for k in segment.inputs]
        self.annotations = {n: TensorSpec(tuple(t.shape)) for n, t in zip(names, self.input_types)}
        self.signature = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                              annotation=self.annotations[n]) for n in names])

    def specs(self):
        """The segment's argument specs at its local sizes."""
        from ..frontend.trace import ArgSpec
        from ..ir import graph as g

        sizes = self.local_sizes()
        return [ArgSpec(n, tuple(g.dim_value(d, sizes) for d in t.shape), t.dtype, tuple(t.shape))
                for n, t in zip(self.signature.parameters, self.input_types)]

    def local_sizes(self) -> dict[str, int]:
        """The dims' sizes in this segment: the trace's, the sequence dim's local count where its
        rows are sharded."""
        sizes = dict(self.whole_bindings)
        if self.segment.sequence_sharded:
            dim = self.analysis.sequence[0]
            sizes[dim] = sizes[dim] // self.sequence_parts
        return sizes

    def trace(self, args, constants: dict[str, Any] | None = None):
        from ..frontend.trace import bind_dims, current_trace, trace
        from ..frontend.tensor import Tensor
        from ..ir import graph as g

        bindings, checked = bind_dims(self.name, [(a.name, self.annotations.get(a.name), a.shape, a.dtype)
                                                  for a in args])
        checked = [dataclasses.replace(c, strides=a.strides) for c, a in zip(checked, args)]
        bound = {**self.whole_bindings, **bindings}
        a, seg = self.analysis, self.segment

        def body(*tensors):
            t = current_trace()
            new: dict[int, Any] = {id(k): x.value for k, x in zip(seg.inputs, tensors)}
            for op in [*seg.free, *seg.ops]:
                operands = [new[id(a.uses.get((op, i), v))] if id(a.uses.get((op, i), v)) in new else new[id(v)]
                            for i, v in enumerate(op.operands)]
                clone = op.clone(value_mapper=dict(zip(op.operands, operands)))
                clone.operands = operands
                t.block.add_op(clone)
                for old, r in zip(op.results, clone.results):
                    new[id(old)] = r
            return tuple(Tensor(t, new[id(v)], g.tensor_type(v).shape, g.tensor_type(v).dtype)
                         for v in seg.outputs)
        body.__signature__ = inspect.Signature(
            [inspect.Parameter(s.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for s in checked])
        module, _ = trace(body, self.name, checked, bound, {})
        return module


def _value(k):
    """The Graph IR value under a chain of cuts."""
    while hasattr(k, "collective"):
        k = k.source
    return k


def _summary(ops) -> str:
    """The ops of a segment in a few words: their names in order (repeats folded), and where the
    first of them is."""
    from ..ir.provenance import loc_of

    names: list[str] = []
    for op in ops:
        name = op.name.removeprefix("graph.")
        if not names or names[-1] != name:
            names.append(name)
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    loc = next((loc_of(op) for op in ops if loc_of(op)), None)
    return shown + (f" (from {loc})" if loc else "")


def _value_words(a, k) -> str:
    from ..ir.provenance import loc_of

    v = _value(k)
    owner = v.owner
    if hasattr(owner, "name") and hasattr(owner, "results"):
        loc = loc_of(owner)
        return f"the {owner.name.removeprefix('graph.')}" + (f" at {loc}" if loc else "")
    names = [n.data for n in a.f.attributes["tessera.arg_names"].data]
    return f"argument {names[v.index]!r}"


def _cut_words(a, cut) -> str:
    from ..ir import graph as g

    c = cut.collective
    what = _value_words(a, cut.source)
    along = f" along {g.tensor_type(_value(cut)).shape[c.dim]}" if c.dim is not None else ""
    words = {"all_reduce": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
             "split": "own rows (no communication) of"}[c.kind]
    line = f"{words} {what}{along} over {', '.join(c.axes)}"
    if c.kind == "all_gather":
        line += f" (its gradient {'reduce-scattered' if cut.grad == 'reduce_scatter' else 'split'})"
    if any(r is cut for r in a.results):
        line += ": a result"
    return line


def shard(fn: Function, mesh: DeviceMesh, dims: dict[str, str], chunks: int = 1,
          sequence: str | tuple[str, str] | None = None) -> ShardedFunction:
    """`fn` run on shards over `mesh`: each dim named in `dims` split over the mesh axis it maps
    to, the communication derived from the function's math (module doc). `sequence`: the dim
    (with its axis, where `dims` uses several) that sequence parallelism splits between the
    tensor-parallel regions (Megatron-LM's): reduce-scatters and all-gathers along it instead of
    all-reduces. With `chunks` > 1, a segment whose results are all-reduced runs in that many
    chunks, each chunk's all-reduce overlapping the next chunk's kernels, where its math allows
    (`ShardedFunction.report` says). Off by default: on 2 H200s the Llama-style block's forward in
    4 chunks took 4.59 ms against 4.15 unchunked: the overlap hid 46% of its 0.57 ms of all-reduces,
    the chunked matmuls cost more (bench/tensor_parallel.py, bench/RESULTS.md session 15)."""
    return ShardedFunction(fn, mesh, dims, chunks, sequence)
