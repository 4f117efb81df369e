"""Graph IR -> Schedule IR: decide which ops share a kernel.

Rules, in the order they claim ops:
1. attention: matmul -> score modification (any elementwise ops, masks,
   biases, soft-capping) -> softmax over the last axis -> matmul becomes one
   `flash_attention` kernel (online softmax; no S x S tensor in memory); a
   log-sum-exp of the same scores becomes its second output (what a forward
   saves for its backward);
2. every other matmul becomes a `gemm` kernel with its elementwise epilogue;
3. softmax / layer_norm / rms_norm / reduce become one `row_reduction` kernel
   each, with their elementwise prologue and epilogue (a norm's kernel also
   writes the norm_statistics of its rows a forward saves; a row statistic's
   epilogue may be over the whole rows it reduced, and a statistic only a
   later one over the same rows reads, a variance's mean, is computed in
   that kernel first); a reduce over an axis
   before the last (a weight gradient's sum over the rows) becomes a
   `column_reduction` kernel, which reads along the kept, contiguous axis,
   unless a row kernel over the same rows computes it on the way;
4. the remaining elementwise ops form `elementwise` kernels.

`device_assert`s are planned after the rest, so that they never change which ops share a kernel:
each goes, with the ops computing its condition, into the kernel that computes what the
condition reads where that kernel can evaluate it on its output tile, else into a kernel of its
own (a kernel with no output). An assert is never dropped.

Cheap ops (constants, arange, transposes, reshapes that only add or drop
size-1 dims) are never kernels of their own: each kernel that needs them gets
its own copy, so transposes become index maps of the loads rather than copies
in memory. A reshape that merges or splits dims stays between kernels, at the
host level, where it is a view of a contiguous buffer.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue

from ..errors import TesseraError
from ..ir import graph as g
from ..ir import provenance
from .. import dtypes, platforms
from ..platforms import HOPPER_NATIVE
from ..ir import schedule as s
from ..ir import index_maps, tile
from ..ir.masks import ColumnBounds, attention_mask, chain_bounds, column_bounds
from ..runtime import interop, tensor_maps
from ..runtime.tensor_maps import TMA_ROW_BYTES, whole_box_rows
from ..backends import BACKENDS, Backend, check_backend_option
from ..dims import DynamicDim, hint, is_dynamic, least, unbounded
from . import backend_choice, byte_operands, query_groups, recompute

CHEAP = (*g.SOURCE_OPS, g.TransposeOp, g.ReshapeOp)


#: ops that read their operands elsewhere than at their own element (a shifted tile): they fuse into
#: the kernels that load them, never into an epilogue, which has only the output tile in registers
WINDOWS = (g.SliceOp, g.ConcatOp, g.GatherOp)
ELEMENTWISE = (g.ElementwiseOp, g.CastOp, *WINDOWS)
ROW_REDUCTIONS = (g.SoftmaxOp, g.LayerNormOp, g.RmsNormOp, g.ReduceOp, g.NormStatisticOp)
#: reductions a tile accumulates elementwise: those the column template computes (a log-sum-exp over
#: a leading axis takes the row template) and a row kernel computes beside its own (siblings)
ACCUMULATED_KINDS = ("sum", "mean", "max", "min")
#: an attention reads a paged KV cache page by page where its pages hold a multiple of this many
#: keys (a key block then spans whole pages, a copy each, or lies in one: `_paged_key_block`); other
#: page sizes are gathered into a contiguous copy first
PAGE_MULTIPLE = 16


def is_column_reduction(op) -> bool:
    """A sum/mean/max/min over an axis before the last (a norm's weight gradient sums over the
    rows): the `column_reduction` template reads it along the kept last axis, contiguous in memory."""
    if not isinstance(op, g.ReduceOp) or op.kind.data not in ACCUMULATED_KINDS:
        return False
    rank = g.tensor_type(op.input).rank
    return rank >= 2 and op.axis.data < rank - 1


@dataclass
class Group:
    kind: str
    ops: set = field(default_factory=set)
    output: SSAValue | None = None   # None: a kernel of device_asserts only
    #: outputs the template writes besides `output` (a flash attention's log-sum-exp), read only by
    #: ops after `output`'s producer, where the kernel runs
    extra: list[SSAValue] = field(default_factory=list)

    @property
    def outputs(self) -> list[SSAValue]:
        return ([self.output] if self.output is not None else []) + self.extra


#: the fewest columns (queries) a flash_chain kernel's loop takes for an across sink to merge into
#: it (`_Planner._long_enough`)
ACROSS_LEAST_LOOP = 2048


class _Planner:
    target = None                    # the compile's platform, when known
    backend_option: str = "ptx"      # the compile's `backend` option (backend_choice.choose)
    profiled: bool = False           # kernels stamp profile regions
    # the platform as the kernel being planned sees it (its backend's, `_aim`):
    max_shared: int | None = None    # the target's shared memory per block, when known
    native: bool = False             # the target has the Hopper-native path (TMA + wgmma)
    sm_count: int = 1                # the target's SMs: with the blocks one holds, how many blocks
    platform = None                  # a persistent kernel launches (the target, when known)
    tile_compiler: bool = False      # the backend's own compiler stages and pipelines the tiles (tileiras)
    pins: dict = {}                  # the compile's `space` (its first values are what kernels take)

    def __init__(self, f: func.FuncOp):
        self.f = f
        self.bindings = g.bindings_of(f)
        names = [a.data for a in f.attributes["tessera.arg_names"].data]
        strides = g.arg_strides(f)
        #: the arguments passed strided that kernels will read in place, and their element strides
        self.strided = {arg: strides[name] for name, arg in zip(names, f.body.block.args)
                        if name in strides and tile.strides_problem(strides[name]) is None}
        self.order = {op: i for i, op in enumerate(f.body.block.ops)}
        self.group_of: dict[Operation, Group] = {}
        self.groups: list[Group] = []
        #: reshapes merging a gather's pages into one dim (`graph.paged_view`), with their gathers:
        #: cheap while an attention can read them page by page (`_unpage_all_but_attention`)
        self.paged: dict[g.ReshapeOp, g.GatherOp] = self._paged_views(f)
        self.views = [op for op in f.body.block.ops if isinstance(op, g.ReshapeOp)
                      and (not self.cheap(op) or self._returned_unit_view(op))]
        self.assert_only = self._assert_only_ops()

    def _paged_views(self, f: func.FuncOp) -> dict:
        """The reshapes that merge a gather's pages into one dim (`graph.paged_view`), each with its
        gather, where the gather has no other reader, its table is in memory (not an `arange`
        recomputed in the kernel) and the page dim fits key blocks (a multiple of PAGE_MULTIPLE
        elements)."""
        paged = {}
        for op in f.body.block.ops:
            gather = g.paged_view(op, self.bindings) if isinstance(op, g.ReshapeOp) else None
            if gather is None or not all(isinstance(u.operation, g.ReshapeOp)
                                         and g.paged_view(u.operation, self.bindings) is gather
                                         for u in gather.res.uses):
                continue
            table = gather.index
            while isinstance(table.owner, (g.TransposeOp, g.ReshapeOp)):
                table = table.owner.input
            if isinstance(table.owner, g.SOURCE_OPS):
                continue
            page = g.dim_value(g.tensor_type(gather.input).shape[1], self.bindings)
            if page % PAGE_MULTIPLE == 0 and op.res not in f.body.block.last_op.operands:
                paged[op] = gather
        return paged

    def _unpage_all_but_attention(self) -> None:
        """Keeps a paged view cheap (each reader reads the cache page by page) only where every
        reader is an attention kernel's keys or values (the second operand of either matmul) with
        the merged pages along its key axis; any other is a gather kernel writing the pages out,
        then a view at the host level."""
        for view, gather in list(self.paged.items()):
            merged = g.tensor_type(gather.index).rank - 1
            if all(self._attention_keys(u.operation, v, dim) for v, u, dim in self._view_readers(view.res, merged)):
                continue
            del self.paged[view]
            self.views.append(view)

    def _view_readers(self, v: SSAValue, dim: int) -> list:
        """(value, use, where dim `dim` of `v` is in it) for every reader of `v` through cheap
        transposes and unit reshapes (`dim` None once a view drops it)."""
        out = []
        for u in v.uses:
            op = u.operation
            if isinstance(op, (g.TransposeOp, g.ReshapeOp)) and self.cheap(op) and op not in self.paged:
                out.extend(self._view_readers(op.results[0], _dim_after_view(op, dim, self.bindings)))
            else:
                out.append((v, u, dim))
        return out

    def _attention_keys(self, op: Operation, v: SSAValue, dim: int | None) -> bool:
        """Whether `v` is an attention kernel's K (scores = Q @ v, v's last dim the keys) or V
        (out = P @ v, its dim before last the keys) with its dim `dim` the keys."""
        group = self.group_of.get(op)
        if group is None or group.kind != "flash_attention" or not isinstance(op, g.MatmulOp) or op.rhs is not v:
            return False
        rank = g.tensor_type(v).rank
        probabilities = self.producer(op.lhs)
        while isinstance(probabilities, g.CastOp):
            probabilities = self.producer(probabilities.input)
        return dim == (rank - 2 if isinstance(probabilities, g.SoftmaxOp) else rank - 1)

    def _returned_unit_view(self, op: g.ReshapeOp) -> bool:
        """A unit reshape that is returned, of a value computed by an op that is not cheap and
        not returned itself (`sum(x, 0)` is a keepdim reduction, then a reshape dropping the
        kept dim): a view at the host level, which the kernel computing its input writes
        through, where a cheap op returned would cost a copy kernel."""
        returned = self.f.body.block.last_op.operands
        source = self.producer(op.input)
        return (op.res in returned and op.input not in returned and source is not None
                and not self.cheap(source))

    def _assert_only_ops(self) -> set[Operation]:
        """device_asserts, and the elementwise and cheap ops only they read (transitively): the
        rules plan kernels as if these were not there (`_place_asserts` places them after)."""
        only: set[Operation] = set()
        for op in reversed(list(self.f.body.block.ops)):
            if isinstance(op, g.AssertOp):
                only.add(op)
            elif (isinstance(op, ELEMENTWISE) or self.cheap(op)) and op.results[0].uses \
                    and all(u.operation in only for u in op.results[0].uses):
                only.add(op)
        return only

    def cheap(self, op) -> bool:
        """Recomputed inside every kernel that reads it (see the module docstring); a paged view
        and its gather are an attention's keys or values read page by page. A layout copy
        (`byte_operands`) is a transpose written to memory."""
        if byte_operands.is_layout_copy(op):
            return False
        if isinstance(op, g.ReshapeOp):
            return g.is_unit_reshape(op, self.bindings) or op in self.paged
        if isinstance(op, g.GatherOp):
            return op in self.paged.values()
        return isinstance(op, CHEAP)

    # --- helpers ----------------------------------------------------------
    def producer(self, v: SSAValue) -> Operation | None:
        return v.owner if isinstance(v.owner, Operation) else None

    def users(self, v: SSAValue) -> list[Operation]:
        """The ops reading `v` that fusion plans around (asserts and what only they read aside)."""
        return [u.operation for u in v.uses if u.operation not in self.assert_only]

    def free(self, op) -> bool:
        return (op is not None and op not in self.group_of and not self.cheap(op) and op not in self.views
                and op not in self.assert_only and not isinstance(op, func.ReturnOp))

    def position(self, group: Group) -> int:
        """Where a group's kernel runs among the others: at its output's producer in the trace (at
        its last op, for a kernel of asserts only)."""
        if group.output is None:
            return max(self.order[op] for op in group.ops)
        return self.order.get(self.producer(group.output), len(self.order))

    def strip_cheap(self, v: SSAValue) -> SSAValue:
        """Looks through transposes and unit reshapes to the value they read."""
        op = self.producer(v)
        while isinstance(op, (g.TransposeOp, g.ReshapeOp)) and self.cheap(op):
            v = op.input
            op = self.producer(v)
        return v

    def claim(self, group: Group, ops) -> None:
        for op in ops:
            group.ops.add(op)
            self.group_of[op] = group

    def new_group(self, kind: str, ops, output: SSAValue) -> Group:
        group = Group(kind, output=output)
        self.claim(group, ops)
        self.groups.append(group)
        return group

    def pull_producers(self, group: Group, values) -> None:
        """Absorbs elementwise producers whose every user is already in the group."""
        work = list(values)
        while work:
            op = self.producer(self.strip_cheap(work.pop()))
            if not self.free(op) or not isinstance(op, ELEMENTWISE):
                continue
            if group.kind == "flash_attention" and isinstance(op, WINDOWS):
                continue
            if isinstance(op, g.GatherOp) and group.kind != "elementwise":   # (its rows are program indices)
                continue
            if self.read_only_by(group, op.results[0]):
                self.claim(group, [op])
                work.extend([op.input] if isinstance(op, g.GatherOp) else op.operands)   # (an index is read)

    def read_only_by(self, group: Group, v: SSAValue) -> bool:
        """Whether every user of `v` is in `group`, directly or through cheap ops (a causal mask's
        `rows + offset` read as `rows[:, None]`), which each kernel recomputes."""
        return all(u in group.ops or (self.cheap(u) and self.read_only_by(group, u.results[0]))
                   for u in self.users(v))

    def inputs_of(self, group: Group) -> set[SSAValue]:
        """Values the group reads that other groups produce (arguments and cheap ops excluded)."""
        out = set()
        for op in group.ops:
            for v in op.operands:
                p = self.producer(self.strip_cheap(v))
                if p is not None and p not in group.ops and p in self.group_of:
                    out.add(self.strip_cheap(v))
        return out

    def merge_epilogues(self) -> None:
        """Folds an elementwise group into the kernel producing its only computed input.

        This is how `gelu(x @ w + b)` or `softmax(s).to(fp16)` become one kernel: the
        consumer group reads nothing but that kernel's output (plus arguments and
        cheap ops) and has the same shape, so its ops can run on the output tile.
        """
        for consumer in [grp for grp in self.groups if grp.kind == "elementwise" and grp.ops]:
            inputs = self.inputs_of(consumer)
            if len(inputs) != 1:
                continue
            (value,) = inputs
            producer = self.group_of[self.producer(value)]
            if producer.kind == "elementwise" or producer.output is not value:
                continue
            if any(u not in consumer.ops for u in self._readers(value)):
                continue
            through_views = bool(self._unit_views(value))
            if (through_views or g.tensor_type(consumer.output).shape != g.tensor_type(value).shape) \
                    and not self._unit_dims_apart(producer, consumer, value):
                continue
            if any(isinstance(o, WINDOWS) or byte_operands.is_layout_copy(o) for o in consumer.ops):
                continue
            if not self._extras_read_after(producer, self.producer(consumer.output)):
                continue
            self.claim(producer, consumer.ops)
            producer.output = consumer.output
            self.groups.remove(consumer)

    def _unit_views(self, v: SSAValue) -> list[Operation]:
        """The size-1 dims' reshapes of v, and theirs (cheap views every kernel recomputes)."""
        views, work = [], [v]
        while work:
            for u in self.users(work.pop()):
                if isinstance(u, g.ReshapeOp) and g.is_unit_reshape(u, self.bindings) and u not in views:
                    views.append(u)
                    work.append(u.res)
        return views

    def _readers(self, v: SSAValue) -> list[Operation]:
        """`users` of v, those of its `_unit_views` in their place."""
        views = self._unit_views(v)
        return [u for x in (v, *(view.res for view in views)) for u in self.users(x) if u not in views]

    def _unit_dims_apart(self, producer: Group, consumer: Group, value: SSAValue) -> bool:
        """Whether elementwise `consumer` keeps column reduction `producer`'s result `value` but for
        size-1 dims, which its reshapes add or drop (a weight gradient's [1, N] sum stored as the
        weight's [N] and cast to its dtype, in the kernel that sums it, or that combines its
        partial sums: `schedule_to_tile.epilogue_map`), where two more kernels took a launch each.
        Not where an op broadcasts the value, nor where the kept last dim, which the template tiles
        as its columns, is a size-1 dim a reshape could drop."""
        sizes = self._sizes(value)
        if producer.kind != "column_reduction" or sizes[-1] == 1 or \
                [n for n in sizes if n != 1] != [n for n in self._sizes(consumer.output) if n != 1]:
            return False
        on_path = {value}
        for op in sorted(consumer.ops | set(self._unit_views(value)), key=self.order.__getitem__):
            computed = [x for x in op.operands if x in on_path]
            if not computed:
                continue
            if isinstance(op, g.ReshapeOp) and not g.is_unit_reshape(op, self.bindings):
                return False
            if not isinstance(op, g.ReshapeOp) and any(self._sizes(x) != self._sizes(op.results[0]) for x in computed):
                return False
            on_path.add(op.results[0])
        return consumer.output in on_path

    def merge_row_broadcasts(self) -> None:
        """Folds an elementwise group that reads a row reduction's result broadcast along the
        reduced axis, over the reduction's own rows (`x * rstd - y * mean(x * y, -1, keepdim=True)`,
        a norm's backward), into the reduction's kernel: the template reduces each block of rows,
        then computes the group's ops over the same rows, whose inputs it has just read (a row that
        fits in registers is read once), where two kernels read every input twice. Of several such
        reductions read only by the group (a layer_norm backward's mean(dy * w) and mean(dy * w *
        x_hat)), the last made takes the group and the others with it (siblings: the template
        reduces each over the same rows); the group's other computed inputs are read from memory,
        as they were."""
        for consumer in [grp for grp in self.groups if grp.kind == "elementwise" and grp.output is not None]:
            if any(isinstance(o, WINDOWS) for o in consumer.ops):
                continue
            shape = g.tensor_type(consumer.output).shape
            reductions = [v for v in self.inputs_of(consumer) if self._row_reduced(v)
                          and all(u in consumer.ops for u in self.users(v))
                          and g.tensor_type(self.producer(v).input).shape == shape]
            if not reductions:
                continue
            producer = self.group_of[self.producer(max(reductions, key=lambda v: self.order[self.producer(v)]))]
            for v in reductions:   # the others: siblings the template reduces over the same rows
                sibling = self.group_of[self.producer(v)]
                if sibling is not producer and self.producer(v).kind.data in ACCUMULATED_KINDS:
                    self.claim(producer, sibling.ops)
                    self.groups.remove(sibling)
            self.claim(producer, consumer.ops)
            producer.output = consumer.output
            self.groups.remove(consumer)

    def merge_row_chains(self) -> None:
        """Folds a row statistic that only a later row reduction's kernel over the same rows reads
        (the mean a variance or a written-out layer norm subtracts, the max a written-out softmax
        subtracts) into that kernel: the template reduces the rows for each in turn
        (`lower_row_reduction`'s siblings), where two kernels read every row twice and launched
        twice. A statistic also read after that kernel (returned beside the variance, as
        torch.var_mean does) is written by it as a further output. Only into kernels whose row
        reductions are all reduces over the last axis."""
        merged = True
        while merged:
            merged = False
            # (the last kernels first: a statistic read by two goes into the last, which may take
            # the first then, where the first would have kept a further output instead)
            for group in sorted((grp for grp in self.groups if self._reduces_rows_only(grp)),
                                key=self.position, reverse=True):
                v = next((v for v in self.inputs_of(group) if self._chains_into(v, group)), None)
                if v is None:
                    continue
                earlier = self.group_of[self.producer(v)]
                self.claim(group, earlier.ops)
                self.groups.remove(earlier)
                group.extra = [*group.extra, *(w for w in dict.fromkeys((v, earlier.output))
                                               if any(u not in group.ops for u in self.users(w)))]
                group.extra = [self._extra_epilogue(group, w) for w in group.extra]
                merged = True
                break

    def _reads_written(self, op: Operation) -> bool:
        """Whether `op` may read a row kernel's further output from memory: the function's return or
        a view (no kernel's), or an elementwise kernel's op. Not a reduction's kernel, which may yet
        become a rider of the row kernel that the statistic would have been a kernel before (a norm
        backward's weight gradient: `merge_column_reductions` takes only inputs made before its host)."""
        group = self.group_of.get(op)
        return group is None or group.kind == "elementwise"

    def _runs_at(self, op: Operation) -> int:
        """Where `op` runs: its kernel's `position`, or its own place in the trace (a return)."""
        group = self.group_of.get(op)
        return self.position(group) if group is not None else self.order.get(op, len(self.order))

    def _extra_epilogue(self, group: Group, w: SSAValue) -> SSAValue:
        """A further output `w` of a row kernel, or the output of the elementwise group of its shape
        that alone reads it (its cast to the input's dtype, as torch.var_mean returns the mean),
        folded into the kernel, where it took a kernel of its own."""
        readers = [u for u in self.users(w) if u not in group.ops]
        consumer = self.group_of.get(readers[0]) if readers else None
        if consumer is None or consumer.kind != "elementwise" or consumer.output is None \
                or self.inputs_of(consumer) != {w} or any(self.group_of.get(u) is not consumer for u in readers) \
                or self._sizes(consumer.output) != self._sizes(w) or any(isinstance(o, WINDOWS) for o in consumer.ops):
            return w
        self.claim(group, consumer.ops)
        self.groups.remove(consumer)
        return consumer.output

    def _reduces_rows_only(self, group: Group) -> bool:
        """A row_reduction kernel whose row reductions are reduces over the last axis (no norm,
        softmax or column rider, whose templates take no statistic of the rows before theirs), its
        further outputs statistics of the rows it computes (`merge_row_chains`)."""
        reductions = [op for op in group.ops if isinstance(op, ROW_REDUCTIONS)]
        return (group.kind == "row_reduction" and group.output is not None
                and all(self.producer(v) in group.ops for v in group.extra)
                and all(isinstance(op, g.ReduceOp) and _over_last_axis(op) for op in reductions))

    def _chains_into(self, v: SSAValue, group: Group) -> bool:
        """Whether `v` is a row statistic (`_row_statistic`) over the rows `group` reduces, read by
        `group` and else only after it (`merge_row_chains`)."""
        earlier = self.group_of.get(self.producer(v))
        statistic = self._row_statistic(earlier) if earlier is not None and earlier is not group else None
        if statistic is None or not any(u in group.ops for u in self.users(v)):
            return False
        # (read as computed, not through a view before the kernel: one dropping its size-1 dim
        # broadcasts it along the columns, where the template's statistic is a row's)
        at, members = self.position(group), group.ops | earlier.ops
        outside = [u for w in (v, earlier.output) for u in self.users(w) if u not in members]
        if any(self._runs_at(u) <= at or not self._reads_written(u) for u in outside):
            return False
        rows = [self._sizes(op.input) for op in group.ops if isinstance(op, g.ReduceOp)]
        return all(sizes == self._sizes(statistic.input) for sizes in rows)

    def _row_statistic(self, group: Group) -> g.ReduceOp | None:
        """The reduce of a row_reduction kernel computing one accumulated statistic of its rows,
        kept as a column ([M, 1]) and maybe scaled (a sum divided by a count), else None."""
        reductions = [op for op in group.ops if isinstance(op, ROW_REDUCTIONS)]
        if len(reductions) != 1 or not self._reduces_rows_only(group):
            return None
        (op,) = reductions
        kept = self._sizes(op.input)[:-1] + [1]
        if op.kind.data not in ACCUMULATED_KINDS or not op.keepdim.data or self._sizes(group.output) != kept:
            return None
        return op

    def merge_column_reductions(self) -> None:
        """Folds a column reduction of a 2-D value (a sum over its rows, maybe with an epilogue,
        which the combining kernel computes) into a row kernel over the same rows (a norm
        backward's dx kernel and its weight and bias gradients): the row kernel walks its row
        blocks persistently and adds each block's rows into column accumulators
        (`lower_row_reduction`'s riders), so the operands both read come from memory once, where
        the column kernel read them again. Only where the row fits in one chunk of the row template
        (the accumulators are a row wide), or in one a block of a cluster where the PTX backend can
        split rows across clusters (`schedule.row_split`), the column kernel's inputs come from
        kernels that run before the row kernel, and its result is read after it. Of several row
        kernels, the one sharing the most inputs, then the last."""
        longest = s.KINDS["row_reduction"][0]["block_n"] * self._most_row_split()
        for column in [grp for grp in self.groups if grp.kind == "column_reduction"]:
            (reduce,) = (op for op in column.ops if isinstance(op, g.ReduceOp))
            if reduce.axis.data != 0 or g.tensor_type(reduce.input).rank != 2:
                continue
            sizes = self._sizes(reduce.input)
            if sizes[1] > longest:
                continue
            hosts = [grp for grp in self.groups if self._hosts_column(grp, column, sizes)]
            if not hosts:
                continue
            reads = {v for op in column.ops for v in op.operands}
            host = max(hosts, key=lambda grp: (len(reads & {v for op in grp.ops for v in op.operands}),
                                               self.position(grp)))
            self.claim(host, column.ops)
            host.extra = [*host.extra, column.output]
            self.groups.remove(column)

    def _most_row_split(self) -> int:
        """The most blocks of a cluster a row kernel may split its rows across: none without
        clusters on the target, or with a space pinning a backend other than PTX; else the space's
        `cluster` pin, or the portable most. (A rider's accumulators are its share of the row wide:
        merged into a row kernel that could not split, a 65536-column layer_norm backward spilled
        10 KB a thread.)"""
        backend = self.pins.get(s.BACKEND_PARAM, [self.backend_option])
        backend = backend if isinstance(backend, str) else backend[0]
        if self.target is None or not self.target.has("clusters") or backend not in ("ptx", "auto"):
            return 1
        return self.pins.get("cluster", [platforms.MAX_CLUSTER])[0]

    def _hosts_column(self, group: Group, column: Group, sizes: list[int]) -> bool:
        """Whether row kernel `group` (over the last axis of a value of `sizes`) can compute
        `column`'s reduction on the way (`merge_column_reductions`)."""
        if group.kind != "row_reduction" or group.output is None:
            return False
        anchors = [op for op in group.ops if isinstance(op, ROW_REDUCTIONS) and op not in _column_riders(group, self)]
        if not anchors or any(not _over_last_axis(op) or self._sizes(op.operands[0]) != sizes for op in anchors):
            return False
        if len(_column_riders(group, self)) >= MAX_COLUMN_RIDERS:
            return False
        at = self.position(group)
        made_before = all(self.position(self.group_of[self.producer(v)]) < at for v in self.inputs_of(column))
        return made_before and all(self.order.get(u.operation, len(self.order)) > at for u in column.output.uses)

    def _row_reduced(self, v: SSAValue) -> bool:
        """Whether `v` is the output of a row_reduction kernel of a reduce over the last axis,
        keeping it (a row statistic), with nothing after the reduce in that kernel."""
        op = self.producer(v)
        group = self.group_of.get(op)
        return (group is not None and group.kind == "row_reduction" and group.output is v
                and isinstance(op, g.ReduceOp) and op.keepdim.data
                and op.axis.data == g.tensor_type(op.input).rank - 1)

    def _extras_read_after(self, group: Group, op: Operation) -> bool:
        """Whether every reader of the group's extra outputs comes after `op` (where the kernel
        would run with `op`'s result as its output)."""
        return all(self.order.get(u.operation, -1) > self.order[op] for v in group.extra for u in v.uses)

    # --- rules ---------------------------------------------------------------
    def attention(self, m2: g.MatmulOp) -> None:
        probs = m2.lhs
        casts = []
        op = self.producer(probs)
        while isinstance(op, g.CastOp):
            casts.append(op)
            op = self.producer(op.input)
        if not isinstance(op, g.SoftmaxOp) or op.axis.data != g.tensor_type(op.input).rank - 1:
            return
        sm = op
        if any(len(self.users(c.results[0])) != 1 for c in [sm, *casts]):
            return
        lse = self._logsumexp_of_scores(sm, m2)
        region, m1 = self._score_region(sm.input, set(lse))
        if m1 is None or not self.free(m1) or not self.free(sm):
            return
        group = self.new_group("flash_attention", [m1, *region, sm, *casts, m2, *lse], m2.res)
        group.extra = [op.res for op in lse if isinstance(op, g.ReduceOp)]
        self.pull_producers(group, [v for o in region for v in o.operands])

    def _statistics_of(self, norm) -> list[SSAValue]:
        """The row statistics of `norm` (`graph.norm_statistic`s of its input with its eps and
        centering) that its kernel writes as further outputs from the mean and rstd it computes:
        what a norm's forward saves for its backward. Only those every reader of which runs
        after the norm (where the kernel runs)."""
        found, x = [], g.structure(norm.x)
        for op in self.f.body.block.ops:   # (each reads its own copy of a prologue: recompute.py)
            if isinstance(op, g.NormStatisticOp) and self.free(op) and g.structure(op.input) == x \
                    and op.eps.value.data == norm.eps.value.data \
                    and bool(op.centered.data) == isinstance(norm, g.LayerNormOp) \
                    and all(self.order.get(u.operation, len(self.order)) > self.order[norm] for u in op.res.uses):
                found.append(op.res)
        return found

    def _logsumexp_of_scores(self, sm: g.SoftmaxOp, m2: g.MatmulOp) -> list[Operation]:
        """The ops of the row statistics of the softmax's scores that the attention kernel writes as
        further outputs from its row max and sum (an attention backward's saved residuals): a
        `graph.reduce` logsumexp over the last axis of the scores or of their cast to fp32; and,
        where the backward keeps the row max apart (`autodiff.backward.may_hold_huge_fill`), a max
        reduce of them and the logsumexp of them less it. Each only where every reader runs after
        the kernel (after m2 in program order); else not."""
        scores, found = sm.input, []
        for reduce in self._reductions_of(scores):
            if reduce.kind.data == "logsumexp":
                ops = [reduce]
            elif reduce.kind.data == "max" and reduce.keepdim.data:
                ops = [reduce, *self._logsumexp_less(reduce, scores)]
                if len(ops) == 1:
                    continue
            else:
                continue
            casts = {v.owner for op in ops for v in op.operands if self._widens(v, scores)}
            if any(u not in ops for c in casts for u in self.users(c.res)):
                continue
            outputs = [op.res for op in ops if isinstance(op, g.ReduceOp)]
            readers = [u.operation for v in outputs for u in v.uses if u.operation not in ops]
            if all(self.free(op) for op in [*casts, *ops]) and all(self.order.get(r, -1) > self.order[m2] for r in readers):
                found += [*casts, *ops]
        return sorted(found, key=self.order.__getitem__)

    def _widens(self, v: SSAValue, scores: SSAValue) -> bool:
        """Whether v is a cast of `scores` to fp32."""
        return isinstance(v.owner, g.CastOp) and v.owner.input is scores and g.tensor_type(v).dtype == dtypes.fp32

    def _reductions_of(self, scores: SSAValue) -> list[g.ReduceOp]:
        """The reduces over the last axis reading the scores, or their cast to fp32."""
        read = [scores, *(u.res for u in self.users(scores) if isinstance(u, g.CastOp) and self._widens(u.res, scores))]
        return [u for v in read for u in self.users(v) if isinstance(u, g.ReduceOp) and _over_last_axis(u)]

    def _logsumexp_less(self, rowmax: g.ReduceOp, scores: SSAValue) -> list[Operation]:
        """[the sub, its logsumexp] of logsumexp(scores - rowmax) (the scores maybe cast to fp32),
        else []."""
        for sub in self.users(rowmax.res):
            if not (isinstance(sub, g.ElementwiseOp) and sub.kind == "sub" and sub.operands[1] is rowmax.res
                    and (sub.operands[0] is scores or self._widens(sub.operands[0], scores))):
                continue
            readers = self.users(sub.results[0])
            if len(readers) == 1 and isinstance(readers[0], g.ReduceOp) and readers[0].kind.data == "logsumexp" \
                    and _over_last_axis(readers[0]):
                return [sub, readers[0]]
        return []

    def _score_region(self, v: SSAValue, lse: set[Operation] = frozenset()):
        """Elementwise ops between the first matmul and the softmax, and that matmul (the ops of a
        log-sum-exp `lse` of the scores may read them too)."""
        region, m1, work, seen = [], None, [v], set()
        while work:
            op = self.producer(self.strip_cheap(work.pop()))
            if op is None or op in seen:
                continue
            seen.add(op)
            if isinstance(op, g.MatmulOp):
                if m1 is not None and m1 is not op:
                    return [], None
                m1 = op
                continue
            if isinstance(op, ELEMENTWISE) and not isinstance(op, WINDOWS) and self.free(op) \
                    and self._depends_on_matmul(op):
                region.append(op)
                work.extend(op.operands)
        if m1 is None or len([u for u in self.users(m1.res) if u not in lse]) != 1:
            return [], None
        members = set(region) | {m1} | lse
        for op in region:
            if any(u not in members and not isinstance(u, g.SoftmaxOp) for u in self.users(op.results[0])):
                return [], None
        return region, m1

    def chain(self, sink) -> None:
        """A row/column reduction or a matmul whose operand is computed from score matmuls through
        elementwise ops (`recompute.py` gave it a producer tree of its own): one `flash_chain` kernel
        recomputing the tree per block of the reduced axis, the tile never stored."""
        for v in sink.operands:
            if not recompute.chain_sink(sink, v, self.bindings):
                continue
            region = self._chain_region(sink, v)
            if region is None:
                continue
            group = self.new_group("flash_chain", [sink, *region], sink.results[0])
            self.pull_producers(group, [x for o in region for x in o.operands])
            return

    def merge_chains(self) -> None:
        """Folds each flash_chain kernel into a later one that loops over the same score tiles in
        the same orientation (`_chain_tiling`): one kernel with an output per sink. An attention
        backward's dV = P^T dO and dK = dS^T Q are such a pair (key blocks as rows, looping over
        query blocks): merged, each block's scores, probabilities and dP are computed once and Q
        and dO read once for both, as FlashAttention's dK/dV kernel does, where two kernels
        computed S twice and streamed Q and dO twice. Only where the earlier kernel's outputs are
        read after the later one runs (it is the merged kernel's position), or where what reads
        them before can run after it (`_defer_readers`: a grouped-query attention's dV summed over
        the query heads of each KV head)."""
        chains = sorted((grp for grp in self.groups if grp.kind == "flash_chain"), key=self.position)
        for i, later in enumerate(chains):
            for earlier in chains[:i]:
                if earlier in self.groups and self._chains_match(earlier, later) \
                        and (self._outputs_read_after(earlier, self.position(later))
                             or self._defer_readers(earlier, later)):
                    self.claim(later, earlier.ops)
                    later.extra = [*later.extra, *earlier.outputs]
                    self.groups.remove(earlier)

    def _defer_readers(self, earlier: Group, later: Group) -> bool:
        """Moves the ops that read `earlier`'s outputs (directly or through each other) before
        `later`'s position to just after it, where none of them is in a kernel yet and `later`
        reads none of them; returns whether it did. The trace's order is the kernels' order, so
        the merged kernel (at `later`'s position) then runs before them."""
        at = self.producer(later.output)
        block = self.f.body.block
        tainted, deferred = {*earlier.outputs}, []
        for op in block.ops:
            if op is at:
                break
            if op not in earlier.ops and any(v in tainted for v in op.operands):
                if op in later.ops or op in self.group_of or isinstance(op, func.ReturnOp):
                    return False
                deferred.append(op)
                tainted.update(op.results)
        else:
            return False
        if any(v in tainted for op in later.ops for v in op.operands):
            return False
        anchor = at
        for op in deferred:
            op.detach()
            block.insert_op_after(op, anchor)
            anchor = op
        self.order = {op: i for i, op in enumerate(block.ops)}
        return True

    def merge_across(self) -> None:
        """Folds a flash_chain kernel of one matmul sink into a later one that loops over the same
        score tiles transposed (`_chains_match(transposed=True)`), as an `across` sink
        (`index_maps.ChainSink.across`): the attention backward's dQ = dS @ K (query blocks as rows,
        looping over keys) into the kernel of dK and dV (key blocks as rows, looping over queries).
        Each step then adds its query block's share of dQ, dS^T's block times K's, to an fp32 sum
        (atomically: every key block's program adds to it), so S = Q K^T and dP = dO V^T are
        computed once where the kernel of its own computed them again: the backward's matmuls go
        from 7 to 5, as FlashAttention-2 and -3 do. Only where the template can sum across
        programs and it pays (`_sums_across`, `_long_enough`); the later kernel's outputs stay
        first, so its tiling orients the kernel (`index_maps.chain_sinks`). One across sink a
        kernel: its sum's zeroing and epilogue kernels are the kernel's own."""
        chains = sorted((grp for grp in self.groups if grp.kind == "flash_chain"), key=self.position)
        summing: list[Group] = []   # the kernels that took one
        for i, later in enumerate(chains):
            for earlier in chains[:i]:
                if earlier in self.groups and later in self.groups and later not in summing \
                        and len(earlier.outputs) == 1 and self._sums_across(earlier) \
                        and self._chains_match(earlier, later, transposed=True) and self._long_enough(later) \
                        and self._across_fits(later, earlier) \
                        and self._outputs_read_after(earlier, self.position(later)):
                    self.claim(later, earlier.ops)
                    later.extra = [*later.extra, *earlier.outputs]
                    self.groups.remove(earlier)
                    summing.append(later)

    def _long_enough(self, group: Group) -> bool:
        """Whether a chain kernel merged with an across sink pays for its one block an SM on blocks
        of `schedule.ACROSS_ROWS` rows, its sum's zeroing and epilogue kernels and its staged adds:
        where its blocks fill two waves of the target's SMs and each loops over at least
        ACROSS_LEAST_LOOP columns (queries). H200 bf16 (bench/RESULTS.md session 33): causal
        3x5x1531x128, 180 blocks on 132 SMs, 0.116 -> 0.128 ms merged; grouped-query causal
        8x32/8x1024x128 0.674 -> 0.770; at 4096 queries merged is faster (8x16x4096x128 6.65 ->
        5.98 ms, causal 3.82 -> 3.48, 2x32/8 1.99 -> 1.91)."""
        extents = dict(self._chain_tiling(group, speed=True)[1])
        batch = math.prod(n for axis, n in extents.items() if axis not in ("m", "n", "e"))
        waves = batch * -(-extents["m"] // s.ACROSS_ROWS) / self.target.sm_count
        return waves >= 2 and extents["n"] >= ACROSS_LEAST_LOOP

    def _across_fits(self, group: Group, across: Group) -> bool:
        """Whether chain kernel `group`'s tiling, under this compile's space, has a side of `across`'s
        sum block that gives each warp 16 rows (`schedule.across_fits`): a space pinning 32-key
        blocks or 2 warps gives neither 64 queries nor the head dim's 128."""
        extents = dict(self._chain_tiling(group, speed=True)[1])
        width = g.dim_value(g.tensor_type(across.output).shape[-1], self.bindings)
        params = s.default_params("flash_chain", {"staged_tiles": 1})
        params.update({k: v[0] for k, v in self.pins.items() if k in params})
        return s.across_fits(params, extents["m"], extents["n"], width)

    def _sums_across(self, group: Group) -> bool:
        """Whether `group`'s sink can be a chain kernel's across sink on this compile's target, and
        pays: a matmul with 16-bit operands on the PTX backend's Hopper path (its template stores
        dS^T to shared memory for a transposed-A wgmma and adds fp32 tiles with the copy engine;
        the CPU interpreter runs the same Tile IR) whose output rows are 65 to 128 wide: a block of
        128 keys on 8 warps then holds dQ^T's 128 rows (`schedule_to_tile._AcrossSums`; a head dim
        under 128 computes K's zero padding too, as the two kernels' 128-wide tiles did). H200
        bf16, against dQ's own kernel at D=128: plain 8x16x4096x128 6.75 -> 6.14 ms, causal 3.83
        -> 3.56 (65-127 not measured; a head dim not a multiple of 8 has rows TMA can't copy, 16
        bytes a step, so the kernel would leave the Hopper path: not measured, not taken); at
        D=64 the two kernels stay (16x16x2048x64 2.15 ms, merged on 64 keys 2.22-2.30, its
        128-key blocks 128 queries wide spill); bench/RESULTS.md session 33. A space pinning another backend, or blocks of fewer than 64 queries (dS^T's
        shared rows are whole 128-byte swizzle rows), keeps the two kernels."""
        sink = self.producer(group.output)
        target = self.target
        if not isinstance(sink, g.MatmulOp) or target is None or not HOPPER_NATIVE <= target.features:
            return False
        width = g.dim_value(g.tensor_type(sink.res).shape[-1], self.bindings)
        if is_dynamic(width) or not 64 < width <= 128 or width % 8:
            return False
        pinned = self.pins.get(s.BACKEND_PARAM, [self.backend_option])
        if (pinned if isinstance(pinned, str) else pinned[0]) not in ("ptx", "auto"):
            return False
        if self.pins.get("block_n", [s.KINDS["flash_chain"][0]["block_n"]])[0] < 64:
            return False   # (dS^T's rows in shared memory are whole 128-byte swizzle rows: 64 elements)
        operand_dtypes = {g.tensor_type(v).dtype for v in (sink.lhs, sink.rhs)}
        return all(dt.bits == 16 and platforms.mma_instructions(target, dt) for dt in operand_dtypes)

    def _chains_match(self, a: Group, b: Group, transposed: bool = False) -> bool:
        """Whether two flash_chain groups tile the same score matmuls (the same math on the same
        inputs, `graph.structure`) with the same maps, over the same extents (a matmul sink's columns
        too: one kernel's sinks share them); `transposed`: `a`'s with its rows and loop swapped."""
        ta, tb = self._chain_tiling(a), self._chain_tiling(b)
        if ta is None or tb is None:
            return False
        scores_a, extents_a = ta
        if transposed:
            scores_a = {k: index_maps.swap_rows_and_loop(m) for k, m in scores_a.items()}
            axes = index_maps.swap_rows_and_loop(tuple(axis for axis, _ in extents_a))
            extents_a = tuple(sorted(zip(axes, (n for _, n in extents_a))))
        if extents_a != tb[1]:
            return False
        common = set(scores_a) & set(tb[0])
        return bool(common) and all(scores_a[k] == tb[0][k] for k in common)

    def _chain_tiling(self, group: Group, speed: bool = False):
        """(structure of each score matmul -> its map, the extents of the kernel's axes) of a
        flash_chain group made by `chain` (one sink), or None; with `speed`, a dynamic dim's extent
        is its hint (for a choice of speed), else its name."""
        sink = self.producer(group.output)
        operands = [v for v in sink.operands if self.producer(self.strip_cheap(v)) in group.ops]
        if len(operands) != 1:
            return None
        tiling = index_maps.chain_tile(sink, operands[0], group.ops | self._views_in(group), self.bindings)
        if tiling is None:
            return None
        def extent(d):   # (dims taken at run time match by name: their values are unknown)
            n = g.dim_value(d, self.bindings)
            return hint(n) if speed else f"{n.name}=?" if is_dynamic(n) else n
        extents: dict[str, int | str] = {}
        for v, m in tiling.maps.items():
            for axis, d in zip(m, g.tensor_type(v).shape):
                if axis is not None and extent(d) != 1:
                    extents[axis] = extent(d)
        for axis, d in zip(tiling.result_map, g.tensor_type(sink.results[0]).shape):
            if axis is not None:
                extents[axis] = extent(d)
        return {g.structure(mm.res): m for mm, m in tiling.scores.items()}, tuple(sorted(extents.items()))

    def _views_in(self, group: Group) -> set[Operation]:
        """The cheap view ops (transposes, unit reshapes) the group's ops read through."""
        views, work = set(), [v for op in group.ops for v in op.operands]
        while work:
            op = self.producer(work.pop())
            if op is not None and op not in views and isinstance(op, (g.TransposeOp, g.ReshapeOp)) and self.cheap(op):
                views.add(op)
                work.extend(op.operands)
        return views

    def _outputs_read_after(self, group: Group, position: int) -> bool:
        return all(self.order.get(u.operation, len(self.order)) > position for v in group.outputs for u in v.uses)

    def _chain_region(self, sink, v: SSAValue) -> list[Operation] | None:
        """The elementwise ops and score matmuls `v` is computed by, when each is free and read only
        by them and the sink, and the score matmuls' tiles are the sink's (`chain_tile`)."""
        tree = recompute.producer_tree(v, self.bindings)
        region = [op for op in tree if isinstance(op, ELEMENTWISE) or recompute.is_score_matmul(op, self.bindings)]
        if any(not self.free(op) or isinstance(op, WINDOWS) for op in region):
            return None
        members = set(region) | {sink}
        if any(not self._read_only_by(op.results[0], members) for op in region):
            return None
        if index_maps.chain_tile(sink, v, set(tree), self.bindings) is None:
            return None
        return region

    def _read_only_by(self, v: SSAValue, ops: set) -> bool:
        """Whether every user of `v` is one of `ops`, directly or through cheap ops."""
        return all(u in ops or (self.cheap(u) and self._read_only_by(u.results[0], ops)) for u in self.users(v))

    def _depends_on_matmul(self, op) -> bool:
        work, seen = list(op.operands), set()
        while work:
            p = self.producer(work.pop())
            if p is None or p in seen:
                continue
            seen.add(p)
            if isinstance(p, g.MatmulOp):
                return True
            if isinstance(p, ELEMENTWISE) or self.cheap(p):
                work.extend(p.operands)
        return False

    def plan(self) -> list[Group]:
        ops = list(self.f.body.block.ops)
        for op in reversed(ops):
            if isinstance(op, g.MatmulOp) and self.free(op):
                self.attention(op)
        self._unpage_all_but_attention()
        for op in ops:
            if isinstance(op, (g.MatmulOp, g.ReduceOp)) and self.free(op):
                self.chain(op)
        self.merge_chains()
        self.merge_across()
        ops = list(self.f.body.block.ops)   # (in its order now: `_defer_readers` may move ops)
        for op in ops:
            if isinstance(op, g.MatmulOp) and self.free(op):
                self.new_group("gemm", [op], op.res)
        for op in ops:
            if byte_operands.is_layout_copy(op) and self.free(op):
                self.new_group("elementwise", [op], op.res)
        for op in ops:
            if isinstance(op, ROW_REDUCTIONS) and self.free(op):
                kind = "column_reduction" if is_column_reduction(op) else "row_reduction"
                group = self.new_group(kind, [op], op.res)
                if isinstance(op, (g.LayerNormOp, g.RmsNormOp)):
                    group.extra = self._statistics_of(op)
                    self.claim(group, [self.producer(v) for v in group.extra])
                self.pull_producers(group, [x for o in (op, *(self.producer(v) for v in group.extra)) for x in o.operands])
        for op in reversed(ops):
            if isinstance(op, ELEMENTWISE) and self.free(op):
                group = self.new_group("elementwise", [op], op.results[0])
                self.pull_producers(group, [op.input] if isinstance(op, g.GatherOp) else op.operands)
        self.merge_epilogues()
        self.merge_row_broadcasts()
        self.merge_row_chains()
        self.merge_column_reductions()
        self._place_asserts()
        self._copies_for_unproduced_results()
        return sorted(self.groups, key=self.position)

    # --- device asserts -----------------------------------------------------------
    def _place_asserts(self) -> None:
        """Puts each assert, with the ops computing its condition, into the one kernel computing
        the values the condition reads when that kernel's template evaluates them on its output
        tile (the condition has the output's shape), else into a kernel of its own, which reads
        them from memory; a value that never reaches memory (inside a fused kernel) is an error."""
        for op in self.f.body.block.ops:
            if not isinstance(op, g.AssertOp):
                continue
            chain = self._assert_chain(op)
            leaves = self._computed_leaves(chain)
            host = self._assert_host(op, leaves)
            if host is not None:
                host.ops.update(chain)
                continue
            unwritten = [self.producer(v) for v in leaves if not self._materialized(v)]
            if unwritten:
                loc = provenance.loc_of(op)
                raise TesseraError(
                    f"device_assert: its condition reads {unwritten[0].name} computed inside a fused "
                    f"{self.group_of[unwritten[0]].kind} kernel, which never writes it to memory; assert on "
                    f"that kernel's result instead", str(loc) if loc else None)
            self.groups.append(Group("elementwise", set(chain)))

    def _assert_chain(self, op: g.AssertOp) -> list[Operation]:
        """The assert and the assert-only ops computing its condition."""
        chain, work = [], [op]
        while work:
            x = work.pop()
            if x in chain:
                continue
            chain.append(x)
            work.extend(p for v in x.operands if (p := self.producer(v)) in self.assert_only)
        return chain

    def _computed_leaves(self, chain: list[Operation]) -> set[SSAValue]:
        """Values the chain reads that kernels compute (not arguments; through cheap ops, which
        every kernel recomputes)."""
        leaves, work = set(), [v for op in chain for v in op.operands]
        while work:
            v = work.pop()
            p = self.producer(v)
            if p is None or p in chain:
                continue
            if self.cheap(p):
                work.extend(p.operands)
            else:
                leaves.add(v)
        return leaves

    def _assert_host(self, op: g.AssertOp, leaves: set[SSAValue]) -> Group | None:
        groups = {id(grp): grp for grp in (self.group_of.get(self.producer(v)) for v in leaves)}
        if len(groups) != 1 or None in groups.values():
            return None
        (group,) = groups.values()
        if group.output is None or self._sizes(op.cond) != self._sizes(group.output):
            return None
        return group if leaves <= self._result_side(group) else None

    def _sizes(self, v: SSAValue) -> list[int]:
        return [g.dim_value(d, self.bindings) for d in g.tensor_type(v).shape]

    def _result_side(self, group: Group) -> set[SSAValue]:
        """The values a kernel's template computes on its output tile: the output and, back
        through the group's elementwise and cheap ops, what they read, up to an anchor whose
        result the template supplies there (a matmul, a reduction); a softmax's or a norm's
        input too, whose tile the same pass reads."""
        seen, work = set(), [group.output]
        while work:
            v = work.pop()
            if v in seen:
                continue
            seen.add(v)
            op = self.producer(v)
            if op is None or (op not in group.ops and not self.cheap(op)) or isinstance(op, (g.MatmulOp, g.ReduceOp)):
                continue
            work.extend(op.operands[:1] if isinstance(op, (g.SoftmaxOp, g.LayerNormOp, g.RmsNormOp)) else op.operands)
        return seen

    def _materialized(self, v: SSAValue) -> bool:
        """Whether `v` is in memory when kernels run: an argument, a host view, a kernel's output."""
        producer = self.producer(v)
        return producer is None or producer in self.views or any(v in grp.outputs for grp in self.groups)

    def _copies_for_unproduced_results(self) -> None:
        """Materializes what no kernel writes: results that are arguments or cheap views of
        something, and inputs of host views that are not contiguous buffers (transposes).
        A returned host view of a kernel's output needs no copy: the host lets that kernel
        write through a view of the output buffer. Only one result can be that buffer: a second
        returned view of the same output (or of a returned output) is a copy."""
        ret = self.f.body.block.last_op
        for view in self.views:
            if not self._transposed_output(view.input):
                self._materialize(view.input)
        written_through = set(ret.operands)
        for v in ret.operands:
            producer = self.producer(v)
            if producer in self.views and self._written_by_kernel(producer.input) \
                    and producer.input not in written_through:
                written_through.add(producer.input)
                continue
            if self._transposed_output(v):
                continue
            self._materialize(v)

    def _transposed_output(self, v: SSAValue) -> bool:
        """A transpose (or a chain of them, with size-1 dims added or removed) of an attention's or a
        flash_chain kernel's output that nothing else reads, returned or read only by host views:
        the kernel's output becomes the transpose, which it stores through its own tile's map,
        where a copy kernel would read and write it again (an attention's [B, H, S, D] output
        returned as [B, S, H, D], FlashAttention's layout; an attention backward's dK = (Q^T @ dS)^T).
        Returns whether it did."""
        chain, src = [], v
        while isinstance(self.producer(src), g.TransposeOp) or (
                isinstance(self.producer(src), g.ReshapeOp) and g.is_unit_reshape(self.producer(src), self.bindings)
                and self.producer(src) not in self.paged):
            chain.append(self.producer(src))
            src = chain[-1].input
        group = next((grp for grp in self.groups if grp.kind in ("flash_chain", "flash_attention")
                      and src in grp.outputs), None)
        ret = self.f.body.block.last_op
        if not any(isinstance(op, g.TransposeOp) for op in chain) or group is None or src in ret.operands:
            return False
        if group.kind == "flash_attention" and (src is not group.output or not self._keeps_tile_axes(group, chain)):
            return False   # (its log-sum-exp is stored as the scores' rows; a view dropping a tile axis: a copy)
        if group.kind == "flash_chain" and any(isinstance(op, g.ReshapeOp) for op in chain):
            return False
        if any([u.operation for u in op.input.uses] != [op] for op in chain):
            return False
        if any(u.operation is not ret and u.operation not in self.views for u in v.uses):
            return False
        if group.output is src:
            # the kernel then runs at the transpose (`position`): not past a reader of its other
            # outputs (a dK/dV kernel whose dV a host view reads before dK's transpose)
            if any(self.order.get(u.operation, len(self.order)) < self.order[chain[0]] for x in group.extra for u in x.uses):
                return False
            group.output = v
        else:
            group.extra = [v if x is src else x for x in group.extra]
        for op in chain:
            group.ops.add(op)
            self.group_of[op] = group
        return True

    def _keeps_tile_axes(self, group: Group, views: list) -> bool:
        """Whether an attention's output through `views` (the last first) still has the dims its
        template tiles (the query rows and the head dim): a view that drops a size-1 one (a decode
        step's one query squeezed out) leaves its store no dim to walk."""
        m1, m2 = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=self.order.__getitem__)
        rank, rows = g.tensor_type(m2.res).rank, s.attention_rows_of(m1, m2, self.bindings)
        m = tuple("e" if i == rank - 1 else "m" if i == rows else None for i in range(rank))
        for op in reversed(views):
            m = index_maps.view_map(op, m, self.bindings)
        return "m" in m and "e" in m

    def _written_by_kernel(self, v: SSAValue) -> bool:
        return self.producer(v) in self.group_of or any(v in grp.outputs for grp in self.groups)

    def _materialize(self, v: SSAValue) -> None:
        producer = self.producer(v)
        returned = v in self.f.body.block.last_op.operands
        if self._written_by_kernel(v) or producer in self.views and not returned:
            return
        if producer is None and not returned:  # an argument read through a view: already a buffer
            return
        self.groups.append(Group("elementwise", output=v))


def _dim_after_view(op, dim: int | None, bindings) -> int | None:
    """Where dim `dim` of a transpose's or unit reshape's input is in its result (a dim of size > 1:
    among the non-unit dims, in order)."""
    if dim is None:
        return None
    if isinstance(op, g.TransposeOp):
        return op.permutation.index(dim)
    src = [g.dim_value(d, bindings) for d in g.tensor_type(op.input).shape]
    dst = [g.dim_value(d, bindings) for d in g.tensor_type(op.res).shape]
    nth = sum(1 for n in src[:dim] if n != 1)
    kept = [i for i, n in enumerate(dst) if n != 1]
    return kept[nth] if src[dim] != 1 and nth < len(kept) else None


def _merge_duplicates(block: Block) -> None:
    """Replaces each op of a kernel body that repeats an earlier one (same name, operands and
    attributes) by the earlier one's results: a merged flash_chain kernel's sinks then share one
    copy of the score tiles (`_Planner.merge_chains`), which the template computes once a block."""
    seen: dict = {}
    for op in list(block.ops):
        if not op.results or op.regions:
            continue
        key = (op.name, tuple(op.operands), g.op_settings(op))
        if key in seen:
            for old, new in zip(op.results, seen[key].results):
                old.replace_all_uses_with(new)
            op.detach()
            op.erase()
        else:
            seen[key] = op


def _clone_cheap_chain(v: SSAValue, mapping: dict, block: Block, inputs: list, planner: _Planner, group) -> SSAValue:
    """The group-local value for `v`: a block argument for group inputs, clones for cheap ops."""
    if v in mapping:
        return mapping[v]
    op = planner.producer(v)
    if op is not None and (op in group.ops or planner.cheap(op)):
        _clone_op(op, mapping, block, inputs, planner, group)
        return mapping[v]
    arg = block.insert_arg(v.type, len(block.args))
    inputs.append(v)
    mapping[v] = arg
    return arg


def _clone_op(op: Operation, mapping: dict, block: Block, inputs: list, planner: _Planner, group) -> None:
    """Clones `op` into the kernel body, after what its operands need."""
    for operand in op.operands:
        _clone_cheap_chain(operand, mapping, block, inputs, planner, group)
    clone = op.clone(value_mapper=mapping)
    block.add_op(clone)
    for old, new in zip(op.results, clone.results):
        mapping[old] = new


def _aim(planner: _Planner, backend: Backend) -> None:
    """Points the planner's view of the platform at `backend`'s (`Backend.platform`) for the kernel
    it plans next: a kernel's tiling fits the backend that compiles it."""
    platform = backend.platform(planner.target) if planner.target else None
    planner.max_shared = platform.max_shared_per_block if platform else None
    planner.native = bool(platform) and HOPPER_NATIVE <= platform.features
    planner.sm_count = platform.sm_count if platform else 1
    planner.platform = platform
    planner.tile_compiler = backend.tile_compiler


def _kernel_facts(group: Group, planner: _Planner, block: Block, inputs: list[SSAValue]) -> backend_choice.KernelFacts:
    """What the backend rules read of a group's kernel."""
    matmul_dtypes = {g.tensor_type(v).dtype for op in group.ops if isinstance(op, g.MatmulOp) for v in (op.lhs, op.rhs)}
    dynamic = next((d for v in [*inputs, *group.outputs] for d in g.tensor_type(v).shape
                    if is_dynamic(g.dim_value(d, planner.bindings))), None)
    no_instruction = frozenset(dt.name for dt in matmul_dtypes
                               if planner.target is not None and not platforms.mma_instructions(planner.target, dt))
    return backend_choice.KernelFacts(
        group.kind, no_matrix_instruction=no_instruction,
        dtypes=frozenset(dt.name for dt in matmul_dtypes | {g.tensor_type(v).dtype for v in [*inputs, *group.outputs]}),
        target=planner.target, dynamic=dynamic, asserts=any(isinstance(op, g.AssertOp) for op in group.ops),
        profiled=planner.profiled, reads_indices=_reads_indices(block, planner.bindings))


def _reads_indices(block: Block, bindings) -> bool:
    """Whether a kernel body reads indices from memory: a gather's, or an attention mask's limits
    read at run time (`masks.ColumnLimit`) from a tensor (not a dim's size, `graph.dim_size`)."""
    if any(isinstance(op, g.GatherOp) for op in block.ops):
        return True
    for sm in (op for op in block.ops if isinstance(op, g.SoftmaxOp)):
        rank = g.tensor_type(sm.input).rank
        terms = attention_mask(sm.input, (*(f"b{i}" for i in range(rank - 2)), "m", "n"), "m", "n", bindings)
        if terms is not None and any(not isinstance(term.value.owner, g.DimSizeOp)
                                     for limit in terms.limits for term in limit.terms):
            return True
    return False


def _kernel_body(group: Group, planner: _Planner, space_override) -> tuple:
    block = Block()
    mapping: dict = {}
    inputs: list[SSAValue] = []
    for op in sorted(group.ops, key=planner.order.__getitem__):
        if op.results:
            _clone_cheap_chain(op.results[0], mapping, block, inputs, planner, group)
        else:
            _clone_op(op, mapping, block, inputs, planner, group)
    outs = []
    for output in group.outputs:
        out = _clone_cheap_chain(output, mapping, block, inputs, planner, group)
        if out in block.args:  # a bare copy: give the kernel one op that produces its output
            copy = g.CastOp(out, out.type)
            block.add_op(copy)
            out = copy.res
        outs.append(out)
    block.add_op(s.YieldOp(outs))
    if group.kind == "flash_chain" and len(outs) > 1:
        _merge_duplicates(block)
    facts = _kernel_facts(group, planner, block, inputs)
    pins = (space_override or {}).get(s.BACKEND_PARAM, [None])   # (a space lists values; a bare name is one)
    choice = backend_choice.choose(facts, planner.backend_option, pins if isinstance(pins, str) else pins[0])
    if facts.dynamic is not None and not BACKENDS[choice.backend].dynamic_dims:
        raise DynamicDim(facts.dynamic, f"the {choice.backend} backend takes every dim as a constant")
    _aim(planner, BACKENDS[choice.backend])
    features = _features(group, planner, block)
    params = s.default_params(group.kind, features, planner.max_shared)
    space = s.KINDS[group.kind][1]
    if space_override:
        space = {k: list(v) for k, v in space_override.items() if k in params}
        params = {k: (space[k][0] if k in space else v) for k, v in params.items()}
    if group.kind == "gemm" and features.get("wgmma") and planner.platform \
            and not {"block_m", "block_n", "num_warps"} & set(space_override or {}):
        if features.get("element_bytes") == 2:
            params.update(_small_gemm_tile(group, planner, params, features))
        params.update(_narrow_tile(group, planner, params, features))
    if params.get("persistent") and group.kind != "flash_attention":
        # as many blocks as the SMs' shared memory holds, or as the space says
        shared = s.shared_bytes(group.kind, params, features)
        per_sm = max(1, platforms.blocks_per_sm_by_shared(planner.platform, shared)) if planner.platform else 1
        params["programs"] = (space_override or {}).get("programs", [planner.sm_count * per_sm])[0]
    pinned = space_override or {}
    if group.kind == "elementwise" and any(isinstance(op, g.GatherOp) for op in block.ops):
        blocks = _gather_blocks(group, planner)   # (no tuning moves them)
        params.update(blocks)
        space = {**space, **{k: [v] for k, v in blocks.items()}}
    if group.kind == "flash_attention":
        params.update(_paged_key_block(block, planner, params, pinned))
    if group.kind == "gemm" and planner.platform and "split_k" not in pinned:
        # a split GEMM's partial products neither walk tiles nor warp-specialize, nor take wgmma-only
        # widths (`schedule.WGMMA_BLOCK_N`): a pin of either, or such a tile, wins
        wants_one_kernel = any(pinned.get(switch, [0])[0] for switch in ("persistent", "warp_specialize")) \
            or params["block_n"] in s.WGMMA_BLOCK_N
        params["split_k"] = 1 if wants_one_kernel else _split_k(group, planner, params, features)
    if group.kind == "gemm" and planner.platform:
        params.update(_gemm_cluster(group, planner, params, features, pinned))
    if group.kind == "flash_attention" and planner.platform and "split_kv" not in pinned:
        params["split_kv"] = _split_kv(group, planner, params, features)
    if group.kind in ("flash_attention", "flash_chain") and planner.platform and params.get("split_kv", 1) == 1:
        _schedule_few_heads(group, block, planner, params, features, pinned)   # (a split attention's order is its own)
    if group.kind in ("flash_attention", "flash_chain") and planner.platform and not planner.tile_compiler \
            and "occupancy" not in pinned and (group.kind == "flash_attention" or _chain_work(block, planner)):
        params.pop("occupancy", None)
        params.update(_occupancy(group.kind, planner, params, features))
    if group.kind == "flash_attention" and params.get("persistent"):
        params.update(_attention_walk(group, planner, params, features, pinned))
    if group.kind == "flash_chain" and planner.platform and not params.get("heavy_first") \
            and not {"heavy_first", "heavy_group"} & set(pinned) and _chain_work(block, planner) \
            and _static_grid(group, planner):
        params.update(_heavy_group(block, planner, params, planner.sm_count * _blocks_per_sm(params)))
    if group.kind == "column_reduction" and planner.platform and "split_rows" not in pinned:
        params["split_rows"] = _split_rows(group, planner, params)
    if features.get("column_riders") or _walks_ahead(group, planner, params):
        # a row kernel carrying column reductions walks its rows, as does one loading its rows ahead
        params["programs"] = pinned.get("programs", [_row_walk_programs(group, planner, params)])[0]
    return block, inputs, params, space, choice


#: a causal attention's walk takes every head's heaviest query tiles first (`heavy_first`) where
#: this many blocks of each head run at once (they share its keys in L2), else each head's in turn.
#: H200 bf16 causal D = 128, every head's first -> each head's in turn (bench/attention_schedules.py,
#: bench/RESULTS.md session 44): 1x16x8192 492 -> 619 us (16 heads: a walk in turn balances badly),
#: 2x16x8192 1026 -> 974, 4x8x4096 267 -> 256 (32 heads: their keys crowd L2)
HEAVY_FIRST_WALK_BLOCKS_PER_PROGRAM = 8

#: a causal attention's time in a model, for whether its walk pays (`_causal_walk_pays`), us: a key
#: block, and a query tile's fixed part in a grid of a tile a block and in a walk (H200, D = 128,
#: 128 x 128 tiles: session 43's fit, 1.77 and 3.0; for the walk, cuDNN's fixed part, 1.8)
KEY_BLOCK_US, GRID_TILE_US, WALK_TILE_US = 1.77, 3.0, 1.8
#: ... the walk kept where the model makes it at most this much slower than the grid (its error on
#: the shapes measured)
WALK_MODEL_SLACK = 0.02


def _blocks_per_sm(params: dict[str, int]) -> int:
    """The blocks of an attention or chain kernel an SM holds: one where warp-specialized (its
    register split is one block's), else what `_occupancy` asked (one where it asked none)."""
    return 1 if params.get("warp_specialize") else params.get("occupancy", 1)


def _attention_walk(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int],
                    pinned: dict) -> dict:
    """A persistent attention's `programs`: the SMs times `_blocks_per_sm`, and under a causal
    mask the order of its tiles (`heavy_first`); or no walk (`persistent` 0) where the walk's
    second Q stage does not fit in shared memory beside the (pinned) tiles, or, unpinned, where a
    causal walk does not pay (`_causal_walk_pays`)."""
    if planner.max_shared is not None and s.shared_bytes("flash_attention", params, features) > planner.max_shared:
        return {"persistent": 0}
    per_sm = _blocks_per_sm(params)
    walk = {"programs": pinned.get("programs", [planner.sm_count * per_sm])[0]}
    if (work := _attention_work(group, planner)) is not None and "heavy_first" not in pinned:
        walk["heavy_first"] = int(planner.sm_count >= HEAVY_FIRST_WALK_BLOCKS_PER_PROGRAM * work[0])
    bounds = _key_bounds(group, planner)
    if bounds.upper is not None and bounds.lower is None and "persistent" not in pinned and not _causal_walk_pays(
            _key_blocks_per_query_block(group, planner, params, bounds), work[0], walk["programs"],
            planner.sm_count * per_sm, bool(walk.get("heavy_first", params.get("heavy_first"))),
            bool(params.get("heavy_first"))):
        return {"persistent": 0}
    return walk


def _key_blocks_per_query_block(group: Group, planner: _Planner, params: dict[str, int],
                                bounds: ColumnBounds) -> list[int]:
    """The key blocks each query block of an attention under a causal mask (`bounds`' upper) loops
    over, as `schedule_to_tile._key_blocks` counts them (dims' hints: a choice of speed)."""
    m1, _ = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=planner.order.__getitem__)
    rows, keys = (hint(g.dim_value(d, planner.bindings)) for d in g.tensor_type(m1.res).shape[-2:])
    return _column_blocks(rows, keys, s.fit_block(params["block_m"], rows), params["block_n"], bounds)


def _column_blocks(rows: int, columns: int, bm: int, bn: int, bounds: ColumnBounds) -> list[int]:
    """The column blocks each row block of `bm` rows loops over, `bn` columns a block, under a
    mask's `bounds`, as `schedule_to_tile._key_blocks` counts them."""
    out = []
    for m0 in range(0, rows, bm):
        end = -(-columns // bn)
        if bounds.upper is not None:   # columns <= m0 + bm - 1 + upper
            end = min(end, -(-max(0, m0 + bm + bounds.upper) // bn))
        first = max(0, m0 + bounds.lower) // bn if bounds.lower is not None else 0
        out.append(max(0, end - first))
    return out


def _causal_walk_pays(key_blocks: list[int], heads: int, programs: int, slots: int, walk_heads_first: bool,
                      grid_heads_first: bool) -> bool:
    """Whether a causal attention's walk (`persistent`) beats a grid of a tile a block in a model of
    both, each tile a fixed part and its key blocks (`KEY_BLOCK_US`): the grid's tiles taken by its
    `slots` as they free, in launch order (each head's query blocks in turn, or, `heavy_first`,
    every head's heaviest first), the walk's split over its `programs` blocks in its static order
    (`schedule_to_tile._TileWalk`). A static walk balances badly where its rounds fall out of step
    with the heads' query blocks. H200 bf16 causal D = 128, walk / grid, model and measured
    (bench/attention_schedules.py, bench/RESULTS.md session 44): 8x16x4096 0.956 / 0.962, 32x12x2048
    0.936 / 0.930, 4x16x8192 0.973 / 0.981, 16x16x2048 0.929 / 0.930, 2x16x8192 1.008 / 0.937;
    3x16x4096 1.038 / 1.011, 2x12x4096 1.216 / 1.058, 1x24x8192 1.251 / 1.084. The walk's order
    here is `_TileWalk.tile_at`'s, with its lanes (`_TileWalk.lane`)."""
    blocks = len(key_blocks)

    def cost(fixed: float, query_block: int) -> float:
        return fixed + KEY_BLOCK_US * key_blocks[query_block]

    def heaviest_first(index: int, heads_first: bool) -> int:
        return blocks - 1 - (index // heads if heads_first else index % blocks)
    lanes = [0.0] * programs
    for index in range(blocks * heads):
        round_, lane = divmod(index, programs)
        lane = lane if round_ % 2 == 0 else programs - 1 - lane
        lanes[lane] += cost(WALK_TILE_US, heaviest_first(index, walk_heads_first))
    free = [0.0] * slots
    for index in range(blocks * heads):
        query_block = heaviest_first(index, True) if grid_heads_first else index % blocks
        heapq.heappush(free, heapq.heappop(free) + cost(GRID_TILE_US, query_block))
    return max(lanes) <= (1 + WALK_MODEL_SLACK) * max(free)


#: registers a thread holds, over its share of a kernel's fp32 tiles (`_tile_registers`), as ptxas
#: allocated them on the wgmma path (sm_90a, bf16): attention 128 x 64 tiles at D=128 on 8 warps, 96
#: a thread: 125-140 (126 plain causal, 140 with each packed sequence's keys read per row); D=64
#: with 128 keys: 128; the backward's chain kernels on 4 warps, 64 x 64 tiles: dQ at D=64 96 -> 122,
#: dK/dV at D=64 128 -> 177, at D=128 192 -> 240. Below TILE_REGISTERS_KNOWN the tiles are not what
#: a thread's registers go to, and nothing is asked
TILE_REGISTER_RATIO = 1.3
TILE_REGISTERS_KNOWN = 64


def _tile_registers(kind: str, params: dict[str, int], features: dict[str, int]) -> int:
    """A thread's share of a kernel's fp32 tiles: an attention's output block [BM, E] and one key
    block's scores [BM, BN] (two with `qk_ahead`: the next block's beside this block's
    probabilities; without counting them, two blocks an SM spilled 48-220 bytes and serialized the
    wgmmas); a chain's sinks' accumulators [BM, their columns] and its recomputed score tiles
    [BM, BN] (`_chain_tiles`)."""
    e = 1 << max(0, features.get("head_dim", 128) - 1).bit_length()
    columns = e if kind == "flash_attention" else features.get("sink_columns", e)
    scores = 1 + bool(params.get("qk_ahead")) if kind == "flash_attention" else features.get("row_tiles", 1)
    return params["block_m"] * (columns + scores * params["block_n"]) // (32 * params["num_warps"])


def _occupancy(kind: str, planner: _Planner, params: dict[str, int], features: dict[str, int]) -> dict[str, int]:
    """{"occupancy": N}: the blocks an SM's shared memory holds, down to those the registers its tiles
    take leave room for (`TILE_REGISTER_RATIO`), where that is more than the registers ptxas would
    take on its own allow, so that ptxas keeps to them. Attention, H200: with each packed sequence's
    keys read per row (varlen) 140 registers made one block an SM, 797 us; asked for two, 128 without
    spilling, ~600 us (plain kernels unchanged, within 0.6%). The backward's dK/dV kernel at D=64
    (177 registers, two blocks, four by shared memory): three blocks, causal 16x16x2048x64 1.67 ->
    1.59 ms on the H200, 1.69 -> 1.60 on the H100; at D=128 shared memory holds two, as its
    registers do (three squeezed it to 168: 4.4 -> 7.3 ms). A chain kernel is asked only where a
    one-sided mask makes its blocks' work uneven (`_chain_work`): unmasked, the D=64 one's third
    block paid its 12 bytes of spill for nothing (H100 2.63 -> 2.65 ms). The wgmma path only
    (mma.sync holds operand tiles in registers too), and not where warp-specialized (its registers
    are its split's)."""
    if params.get("warp_specialize") or not features.get("wgmma"):
        return {}
    tiles = _tile_registers(kind, params, features)
    if tiles < TILE_REGISTERS_KNOWN:
        return {}
    threads = 32 * params["num_warps"]
    shared = s.shared_bytes(kind, params, features)
    blocks = min(platforms.blocks_per_sm_by_shared(planner.platform, shared),
                 planner.platform.max_threads_per_sm // threads)
    while blocks > 1 and TILE_REGISTER_RATIO * tiles > min(255, 65536 // (blocks * threads)):
        blocks -= 1
    return {"occupancy": blocks} if blocks > 1 else {}


def _gathers_elements(op: g.GatherOp, group: Group, planner: _Planner) -> bool:
    """Whether a gather's rows are single elements of a tensor in memory (an argument or another
    kernel's output, through views): a kernel reads them an element a row of its index tile
    (`tile.load_gather`), where a row a program would take one program an element (three such
    gathers of FlashAttention's cumulative lengths by each packed query's sequence took 11 us each
    for 16k queries on the H200, a program each)."""
    shape = [g.dim_value(d, planner.bindings) for d in g.tensor_type(op.input).shape]
    if shape[0] == 1 or any(n != 1 for n in shape[1:]):
        return False
    v = op.input
    while (producer := planner.producer(v)) in group.ops or (producer is not None and planner.cheap(producer)):
        if not (isinstance(producer, g.TransposeOp) or (isinstance(producer, g.ReshapeOp)
                                                        and g.is_unit_reshape(producer, planner.bindings))):
            return False
        v = producer.input
    return True


def _gather_blocks(group: Group, planner: _Planner) -> dict[str, int]:
    """An elementwise kernel's tile along the output dims a gather's index walks: one element,
    since a gathered row is an index per program (`emit.Emitter`'s gather), while the dims of the
    rows themselves keep their blocks (an embedding lookup: a program per token, D in blocks);
    none where the rows are single elements of a tensor in memory (`_gathers_elements`)."""
    rank = g.tensor_type(group.output).rank
    axes = tuple(f"d{i}" for i in range(rank))
    walked, work, seen = set(), [(group.output, axes)], set()
    while work:
        v, m = work.pop()
        op = planner.producer(v)
        if (v, m) in seen or op is None or not (op in group.ops or planner.cheap(op)):
            continue
        seen.add((v, m))
        if isinstance(op, g.GatherOp):
            if not _gathers_elements(op, group, planner):
                walked.update(a for a in m[:g.tensor_type(op.index).rank] if a is not None)
                work.append((op.input, (None, *m[g.tensor_type(op.index).rank:])))
        elif isinstance(op, WINDOWS):
            work.extend((x, m) for x in op.operands)
        elif isinstance(op, (g.ElementwiseOp, g.CastOp, g.TransposeOp, g.ReshapeOp)):
            work.extend(zip(op.operands, index_maps.operand_maps(op, m, planner.bindings)))
    blocks = {}
    if axes[-1] in walked:
        blocks["block_n"] = 1
    if rank >= 2 and axes[-2] in walked:
        blocks["block_m"] = 1
    return blocks


def _paged_key_block(block: Block, planner: _Planner, params: dict[str, int], pinned: dict) -> dict[str, int]:
    """An attention over a paged KV cache (`_Planner.paged`) reads each key block from whole pages,
    a copy each, or from part of one: its key blocks (block_n) keep the default where the pages
    divide it or it divides them, else shrink to the largest power of two dividing the page. H200,
    GQA 32/8 decode over 16-key pages, 16 queries, B=8, 32k keys: 16-key blocks on 2 stages 345 us,
    on 4 stages 304, 64-key blocks of four pages 280, against 275 unpaged (bench/decode_attention.py
    --paged 16; bench/RESULTS.md session 23)."""
    pages = {g.dim_value(g.tensor_type(op.input).shape[1], planner.bindings)
             for op in block.ops if isinstance(op, g.GatherOp)}
    if not pages:
        return {}
    block_n = params["block_n"]
    if all(page % block_n == 0 or block_n % page == 0 for page in pages):   # (K's and V's pages may differ)
        return {}
    if "block_n" in pinned:
        raise TesseraError(f"the schedule space's block_n={block_n} neither divides the KV cache's pages of "
                           f"{', '.join(map(str, sorted(pages)))} keys nor spans whole pages")
    page = math.gcd(*pages)
    return {"block_n": min(block_n, page & -page)}   # (the largest power of two dividing every page)


#: the output tiles of a native 16-bit GEMM, largest first, and the warps each takes: a GEMM whose default
#: tiles are too few for the SMs takes the largest of these of which it has SMALL_GEMM_TILES_PER_SM
#: x the SMs at least, else the smallest. H200 bf16, CUDA-graph us, default (128 x 256) -> chosen,
#: cuBLAS beside: 512^3 7.6 -> 3.3 (64 x 64; cuBLAS 3.2), 1024^3 12.3 -> 7.3 (128 x 128; 64 x 128
#: was 6.7; cuBLAS 5.4), 16x4096x4096 11.0 -> 8.1 (64 x 64; 9.5), 128x4096x4096 18.3 -> 15.7
#: (64 x 128; 128 x 128 was 14.6; 13.1), 256x4096x4096 23.5 -> 20.2 (128 x 128; 16.1); 2048^3 keeps
#: 128 x 256 (26.5; 128 x 128 26.7). A threshold of half the SMs did worse at 128 and 256 rows
#: (`python3 bench/sweep.py --only gemm-tiles`; bench/RESULTS.md session 22)
GEMM_TILES = ((128, 256, 8), (128, 128, 8), (64, 128, 4), (64, 64, 4))
SMALL_GEMM_TILES_PER_SM = 0.25


def _gemm_rows(group: Group, planner: _Planner):
    """A GEMM group's output rows (M): a dim value, `tessera.dims.Dynamic` where taken at run time."""
    (mm,) = (op for op in group.ops if isinstance(op, g.MatmulOp))
    return g.dim_value(g.tensor_type(mm.res).shape[-2], planner.bindings)


def _output_tiles(group: Group, planner: _Planner, params: dict[str, int],
                  blocks: tuple[int, ...]) -> tuple[dict[str, int], int]:
    """A GEMM kernel's tile (`schedule.gemm_tile`) with output blocks `blocks` (block_m, block_n)
    in place of the params', and how many of them its output (batch included) takes: for a dynamic
    dim, at its hint (a choice of speed)."""
    (mm,) = (op for op in group.ops if isinstance(op, g.MatmulOp))
    dims = [hint(g.dim_value(d, planner.bindings)) for d in g.tensor_type(mm.res).shape]
    k = g.dim_value(g.tensor_type(mm.lhs).shape[-1], planner.bindings)
    tile = s.gemm_tile({**params, "block_m": blocks[0], "block_n": blocks[1]}, dims[-2], dims[-1], k,
                       g.tensor_type(mm.lhs).dtype.itemsize)
    return tile, math.prod(dims[:-2]) * -(-dims[-2] // tile["m"]) * -(-dims[-1] // tile["n"])


def _small_gemm_tile(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int]) -> dict:
    """A native GEMM's tile (block_m, block_n, num_warps) where its default leaves most SMs idle
    (`GEMM_TILES`); {} where the default fills them, or is not one of those tiles."""
    if (params["block_m"], params["block_n"], params["num_warps"]) not in GEMM_TILES:
        return {}
    usable = [t for t in GEMM_TILES if t[1] <= params["block_n"]]   # (an epilogue that asked for 128 columns)
    enough = planner.sm_count * SMALL_GEMM_TILES_PER_SM
    chosen = next((t for t in usable if _output_tiles(group, planner, params, t)[1] >= enough), usable[-1])
    if chosen == (params["block_m"], params["block_n"], params["num_warps"]):
        return {}
    return {"block_m": chosen[0], "block_n": chosen[1], "num_warps": chosen[2]}


#: the blocks of a cluster sharing a 16-bit GEMM's B tiles where B's rows split 128-byte lines
#: (`_rows_split_lines`). H200, bf16, M x K x N, B [K, N] (`python3 bench/gemm_clusters.py`,
#: bench/RESULTS.md session 40): 3000x4096x5000 236.1 -> 201.0 us, 8192x8192x8104 1925 -> 1691
#: (cuBLAS 181.6 and 1616: clusters of two sharing B are its answer as well). Only where the blocks
#: walk several tiles each: in one wave (1000x8192x3000, 96 tiles) it gained nothing (88.0 -> 89.6
#: us); where B's rows are whole lines it cost 1-3% (4096^3 199.6 -> 204.0). Not fp8 GEMMs, half the
#: bytes a FLOP: e4m3 4096x3008x4096 (B [N, K] rows split) 77.6 -> 78.4 us, 1.07x torch._scaled_mm.
SPLIT_ROWS_GEMM_CLUSTER = 2

#: the most tile rows past M, as a share of the GEMM's at its smallest M (a dynamic M's class's
#: least), that the default's clusters may add (a cluster's last rows past M compute padding, stored
#: nowhere): one tile row computed as two cost 128x4096x40008 127.3 -> 158.3 us, 3 as 4 at
#: 384x4096x40008 230.8 -> 254.4 (H200, `python3 bench/gemm_clusters.py`, session 40), against the
#: 13-17% the pairs gain where all their rows are inside M. An 8th (9 tile rows as 10: a dynamic M's
#: last class starts at 1025 rows) is a bound under that gain, not a measured boundary.
MAX_CLUSTER_PADDING = 1 / 8


def _gemm_cluster(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int],
                  pinned: dict) -> dict:
    """{"cluster": c} for a GEMM whose blocks pair up in thread-block clusters sharing B's tiles
    (`schedule.gemm_cluster` drops it where the schedule cannot), on a target with clusters and a
    wgmma path (TMA multicast): the space's pin, else SPLIT_ROWS_GEMM_CLUSTER for a persistent
    16-bit GEMM whose B rows split lines, with more tiles than blocks or on NARROW_TILE's one wave
    of whole pairs of tile rows, and whose clusters add few tile rows past M even at its smallest
    (MAX_CLUSTER_PADDING); {} for none. A persistent GEMM's blocks are then no more than the
    clusters that run at once hold (`platforms.resident_clusters`), unless pinned."""
    default = 1
    if features.get("rhs_rows_split") and features["element_bytes"] == 2 and params.get("persistent"):
        tile, tiles = _output_tiles(group, planner, params, (params["block_m"], params["block_n"]))
        rows = -(-least(_gemm_rows(group, planner)) // tile["m"])
        padding = -rows % SPLIT_ROWS_GEMM_CLUSTER
        narrow_wave = params["block_n"] == NARROW_TILE[1] and not padding   # (`_narrow_tile`'s one wave)
        if (tiles > params["programs"] or narrow_wave) and padding <= rows * MAX_CLUSTER_PADDING:
            default = SPLIT_ROWS_GEMM_CLUSTER
    cluster = pinned.get("cluster", [default])[0]
    if cluster <= 1 or not planner.platform.has("clusters") or not features.get("wgmma"):
        return {}
    chosen = {"cluster": cluster}
    if params.get("persistent") and "programs" not in pinned:
        per_sm = max(1, params["programs"] // planner.sm_count)
        chosen["programs"] = min(params["programs"],
                                 cluster * platforms.resident_clusters(planner.platform, cluster, per_sm))
    return chosen


#: the narrower native GEMM tile a GEMM on the default (128 x 256) takes where its tiles' waves are
#: shorter by WAVE_GAIN at least: a persistent block computes ceil(tiles / SMs) tiles one after
#: another, so the longest walk is that count times the tile's width. H200, `python3
#: bench/gemm_one_wave.py` and session 40's scratch runs (us, 128 x 256 -> 128 x 192):
#: - fp8 (bench/fp8_gemm.py): 1008x3008x8192 96 -> 128 tiles, 46.2 -> 39.5 (0.89x -> 1.04x
#:   torch._scaled_mm); 4096^3 and 8192^3 lost 10% and 3% (walks 1024 -> 1152, 4096 -> 4032);
#: - bf16, B rows whole lines: 1024x8192x3072 85.1 -> 70.2 (walk 256 -> 192); stored [N, K]
#:   (`python3 bench/gemm_clusters.py`, eed64a8's default -> this one) 1000x8192x3000 84.5 -> 70.4,
#:   1000x4096x3000 46.1 -> 38.2, 2000x4096x3000 89.3 -> 72.1 (each about 1.0x cuBLAS); 4096^3
#:   197.6 -> 215.0 and 4000x4096x4096 195.0 -> 215.1 (1024 -> 1152); 3000x4096x5120 188.8 -> 187.9
#:   (1024 -> 960: not taken);
#: - bf16, B rows split (both in clusters of two, `_gemm_cluster`): 2000x4096x3000 93.7 -> 82.8
#:   (512 -> 384; eed64a8's 108.8 -> 84.1), 3000x8192x6000 492.2 -> 474.9 (1280 -> 1152),
#:   3000x4096x5000 199.0 -> 205.4 (1024 -> 960: not taken). In one wave, paired: 1000x8192x3000
#:   87.0 -> 80.3, 1000x4096x3000 46.7 -> 46.8; unpaired it lost (89.9, 47.8), so a one-wave GEMM
#:   whose tile rows cannot pair (odd, or counted at run time) keeps 128 x 256.
#: Every case measured had more narrow tiles than wide ones, and no 16-bit one split K (192 columns
#: take no split-K: `_kernel_body`'s `wants_one_kernel`), so neither is taken otherwise.
NARROW_TILE = (128, 192, 8)
WAVE_GAIN = 0.9
#: an fp8 GEMM's measured case: its wide tiles fill under this share of one wave, its narrow ones
#: one wave at most (multi-wave fp8 GEMMs on narrow tiles: not measured)
ONE_WAVE_FILL = 0.8


def _narrow_tile(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int]) -> dict:
    """NARROW_TILE for a native GEMM on the default tile: a 16-bit one whose blocks' longest walk it
    shortens by WAVE_GAIN and whose wide tiles would not split K (`_split_k`), an fp8 one in its
    measured case (ONE_WAVE_FILL, as since session 35); in either where the narrow tiles are more
    than the wide ones, and where its tile takes the wgmma path, which 192 columns need
    (`tile_to_target._chosen_platform`): whole 128-row blocks (one wgmma a warpgroup) and K steps
    of whole 128-byte TMA rows. A 16-bit
    GEMM whose B rows split lines (`_rows_split_lines`) and whose narrow tiles fill one wave takes
    them only where its blocks pair up over them (`_gemm_cluster`: whole pairs of tile rows, known
    at compile time). Else {}."""
    if ((params["block_m"], params["block_n"], params["num_warps"]) != GEMM_TILES[0] or params.get("split_k", 1) > 1
            or features["element_bytes"] not in (1, 2)):   # (fp32's tf32 wgmma: not measured)
        return {}
    before = _output_tiles(group, planner, params, GEMM_TILES[0])[1]
    tile, after = _output_tiles(group, planner, params, NARROW_TILE)
    native = tile["m"] == NARROW_TILE[0] and tile["k"] * features["element_bytes"] % TMA_ROW_BYTES == 0
    if not native or after <= before:
        return {}
    sms = planner.sm_count
    if features["element_bytes"] == 1:
        taken = before < ONE_WAVE_FILL * sms and after <= sms
    else:
        taken = (-(-after // sms) * NARROW_TILE[1] <= WAVE_GAIN * -(-before // sms) * GEMM_TILES[0][1]
                 and _split_k(group, planner, params, features) == 1)
    if not taken:
        return {}
    if features["element_bytes"] == 2 and features.get("rhs_rows_split") and after <= sms:
        m = _gemm_rows(group, planner)
        if is_dynamic(m) or -(-m // tile["m"]) % SPLIT_ROWS_GEMM_CLUSTER:
            return {}
    return {"block_m": NARROW_TILE[0], "block_n": NARROW_TILE[1], "num_warps": NARROW_TILE[2]}


#: the fewest K steps (of block_k) each split of a split-K GEMM gets: fewer, and the second kernel's
#: launch and the partial products' traffic cost more than the split gains
MIN_SPLIT_STEPS = 16


def _split_k(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int]) -> int:
    """How many ways to split a GEMM's K steps: enough for its output tiles' blocks to fill the
    GPU's block slots when the tiles alone fill at most half of them (a 128 x 4096 x 4096 GEMM
    has 16 to 32 tiles for 132 SMs), each split keeping at least MIN_SPLIT_STEPS steps, so K loops
    shorter than twice that are never split. The partial products go through an fp32 buffer and a
    second kernel, which is cheap next to an idle GPU, not next to a busy one or a short K loop."""
    (mm,) = (op for op in group.ops if isinstance(op, g.MatmulOp))
    k = g.dim_value(g.tensor_type(mm.lhs).shape[-1], planner.bindings)
    tile, tiles = _output_tiles(group, planner, params, (params["block_m"], params["block_n"]))
    shared = s.shared_bytes(group.kind, params, features)
    slots = planner.sm_count * max(1, platforms.blocks_per_sm_by_shared(planner.platform, shared))
    if 2 * tiles > slots:
        return 1
    return max(1, min(slots // tiles, -(-k // tile["k"]) // MIN_SPLIT_STEPS))


#: blocks of each batch program (a head of a batch) the SMs hold at once, one block each, for
#: `heavy_first` to start an attention's heaviest query blocks first: that many share the program's
#: K and V in L2, where with fewer each block would read its K and V prefix from memory alone
#: (H200, causal bf16 with the last query blocks first, a pinned sweep: 16 programs at D=128 1.13-1.39x
#: faster, 32 at D=64 1.31x, 128 programs 0.85x; bench/RESULTS.md, session 19)
HEAVY_FIRST_BLOCKS_PER_PROGRAM = 4


def _schedule_few_heads(group: Group, block: Block, planner: _Planner, params: dict[str, int],
                        features: dict[str, int], pinned: dict) -> None:
    """An attention (or an attention backward's flash_chain kernel) whose mask bounds one side of
    each row block's columns (causal: `column_bounds`, `chain_bounds`), so the row blocks at one
    end do the most work, over few enough batch programs that HEAVY_FIRST_BLOCKS_PER_PROGRAM of
    each fit the SMs at once: `heavy_first` (those row blocks of every program launch first, so
    the grid does not end on a tail of long blocks started last), and for a forward attention on
    the wgmma path, where 128-row query blocks make at most two waves, 64-row ones (twice the
    blocks to balance). A space that pins either param keeps it. Measured on an H200, causal
    bf16 forward (bench/attention_small_grids.py): B=3 H=5 S=1531 D=128 0.049 -> 0.036-0.041 ms,
    B=1 H=8 S=4096 0.118 -> 0.076, B=2 H=8 S=4096 0.185 -> 0.134 (heavy first alone: 64 rows there
    took 0.153); in the sweep, attentions without such a mask lost 1-3% with heavy first and 5-20% with
    64-row blocks."""
    work = _attention_work(group, planner) if group.kind == "flash_attention" else _chain_work(block, planner)
    if work is None:
        return
    programs, rows = work
    if planner.sm_count < HEAVY_FIRST_BLOCKS_PER_PROGRAM * programs:
        return
    if "heavy_first" not in pinned and _static_grid(group, planner):
        params["heavy_first"] = 1
    if group.kind != "flash_attention":
        return
    query_blocks = -(-rows // s.fit_block(params["block_m"], rows))
    if "block_m" not in pinned and features.get("wgmma") and params["block_m"] > 64 \
            and query_blocks * programs <= 2 * planner.sm_count:
        params["block_m"] = 64


#: a flash_chain block's fixed part (its resident tiles' copies, its outputs' stores) in a model of
#: its grid (`_heavy_group`), in steps of its column loop
CHAIN_BLOCK_STEPS = 2
#: ... the groups of programs the model tries, and how much faster than the plain order (each
#: program's row blocks in turn) it must make the grid for heavy_first to take one
HEAVY_GROUPS = (2, 4, 8, 16)
HEAVY_GROUP_GAIN = 0.01


def _heavy_group(block: Block, planner: _Planner, params: dict[str, int], slots: int) -> dict[str, int]:
    """{"heavy_first": 1, "heavy_group": G} for a flash_chain kernel whose mask bounds one side of
    each row block's columns (the causal backward's), over more batch programs than few-heads
    ordering takes (`_schedule_few_heads`), where the model of `_grouped_order_pays` gives a group;
    {} where none pays."""
    sinks = index_maps.chain_sinks(block, planner.bindings)
    bounds = chain_bounds(block, sinks, planner.bindings)
    sizes = index_maps.chain_axis_sizes(sinks, lambda d: hint(g.dim_value(d, planner.bindings)))
    programs = math.prod(n for a, n in sizes.items() if a not in ("m", "n", "e"))
    bm, bn = (s.fit_block(params[k], sizes[a]) for k, a in (("block_m", "m"), ("block_n", "n")))
    steps = _column_blocks(sizes["m"], sizes["n"], bm, bn, bounds)
    group = _grouped_order_pays(steps, programs, slots, heaviest_last=bounds.upper is not None)
    return {} if group is None else {"heavy_first": 1, "heavy_group": group}


def _grouped_order_pays(steps: list[int], programs: int, slots: int, heaviest_last: bool) -> int | None:
    """The programs G (of HEAVY_GROUPS) a group whose row blocks go heaviest first, group after
    group (`schedule_to_tile._ordered_program`), where that ends a grid of `programs` x `steps`
    (each row block's column blocks; `heaviest_last` where they grow along the rows) sooner than
    each program's row blocks in turn by HEAVY_GROUP_GAIN: the smallest G within 0.1% of the best
    (a group's blocks share its programs' operands in L2 as one program's do); None where none
    pays. The model: each block `CHAIN_BLOCK_STEPS` plus its column blocks, taken by `slots` in
    launch order. In turn, the last program's heavy blocks start in the last wave. H200 bf16
    causal 8x16x4096x128 vjp (groups of 4): 3.481 -> 3.424 ms (bench/RESULTS.md session 45)."""
    heaviest = steps[::-1] if heaviest_last else steps
    longest, total = CHAIN_BLOCK_STEPS + max(steps, default=0), programs * sum(CHAIN_BLOCK_STEPS + n for n in steps)
    if longest < HEAVY_GROUP_GAIN * total / slots:   # (any order ends within a block of total / slots:
        return None                                  # a long sequence's grid, whose model would take long)

    def makespan(costs) -> float:
        free = [0] * slots
        for cost in costs:
            heapq.heapreplace(free, free[0] + CHAIN_BLOCK_STEPS + cost)
        return max(free)

    def grouped(size: int):
        for first in range(0, programs, size):
            for cost in heaviest:
                yield from [cost] * min(size, programs - first)
    plain = makespan(cost for _ in range(programs) for cost in steps)
    times = {size: makespan(grouped(size)) for size in HEAVY_GROUPS if size < programs}
    best = min(times.values(), default=plain)
    if not times or best > (1 - HEAVY_GROUP_GAIN) * plain:
        return None
    return min(size for size, t in times.items() if t <= 1.001 * best)


def _attention_work(group: Group, planner: _Planner) -> tuple[int, int] | None:
    """(batch programs, query rows) of an attention whose mask bounds one side of each query
    block's keys, as the template tiles it; None for one without such a mask."""
    _, m2 = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=planner.order.__getitem__)
    out = [hint(g.dim_value(d, planner.bindings)) for d in g.tensor_type(m2.res).shape]   # (a choice of speed)
    if _one_sided(_key_bounds(group, planner)):
        return math.prod(out[:-2]), out[-2]
    return None


def _key_bounds(group: Group, planner: _Planner) -> ColumnBounds:
    """The bounds an attention's mask puts on each query block's keys, as the template tiles it
    (none where its rows are not query positions: the query heads of a decode step)."""
    m1, m2 = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=planner.order.__getitem__)
    (sm,) = (op for op in group.ops if isinstance(op, g.SoftmaxOp))
    rows = s.attention_rows_of(m1, m2, planner.bindings)   # as the template tiles P @ V, whatever it stores
    if rows != g.tensor_type(m2.res).rank - 2:
        return ColumnBounds(None, None)
    axes = (*(f"b{i}" for i in range(rows)), "m", "e")
    p_map, _ = index_maps.matmul_operand_maps(m2, axes, "n", planner.bindings)
    return column_bounds(sm.input, p_map, "m", "n", planner.bindings)


def _static_grid(group: Group, planner: _Planner) -> bool:
    """Whether no output dim is taken at run time: heavy_first orders the blocks it counts, so it
    is not asked of a grid growing with a dynamic dim."""
    return not any(is_dynamic(g.dim_value(d, planner.bindings)) for v in group.outputs
                   for d in g.tensor_type(v).shape)


def _chain_work(block: Block, planner: _Planner) -> tuple[int, int] | None:
    """(batch programs, rows) of a flash_chain kernel body whose mask bounds one side of each
    row block's columns; None for one without such a mask."""
    sinks = index_maps.chain_sinks(block, planner.bindings)
    if not _one_sided(chain_bounds(block, sinks, planner.bindings)):
        return None
    sizes = index_maps.chain_axis_sizes(sinks, lambda d: hint(g.dim_value(d, planner.bindings)))   # (a speed choice)
    return math.prod(n for a, n in sizes.items() if a not in ("m", "n", "e")), sizes["m"]


def _one_sided(bounds: ColumnBounds) -> bool:
    """Whether a mask bounds the columns of each row on one side only (causal, or its transpose):
    the row blocks' work then grows or shrinks along the rows."""
    return (bounds.upper is None) != (bounds.lower is None)


#: the fewest key blocks each split of a split-KV attention gets: fewer, and the combining kernel's
#: launch and the partial outputs' traffic cost more than the split gains
MIN_SPLIT_KEY_BLOCKS = 4


def _split_kv(group: Group, planner: _Planner, params: dict[str, int], features: dict[str, int]) -> int:
    """How many ways to split an attention's key blocks (flash-decoding): enough for its query
    blocks' blocks to fill the GPU's block slots when they alone fill at most half of them (one
    query per head of a decode step makes one block per head and batch), each split keeping at
    least MIN_SPLIT_KEY_BLOCKS blocks, except that a cache of 2 * MIN_SPLIT_KEY_BLOCKS blocks or
    more is split until every SM has two blocks, down to one key block a split: a block's key
    blocks run one after another, each a load's latency. The slots count the blocks an SM holds
    by shared memory at the query tile the kernel really uses (16 rows for a decode step, not
    `block_m`). A batch dim taken at run time splits for its class's smallest value where the
    slots decide (a long cache: too few splits cost more than too many, `dims.least`) and for its
    middle where the SMs do (`_middle`); the query and key counts as their classes' hints.
    Measured (bf16, D = 128, one query, bench/RESULTS.md sessions 19 and 32): MHA B=1 over 1024
    keys 9.3 us at 4 splits (a block an SM) -> 7.6 at 8, on the H100 and the H200 alike; B=1 GQA
    32/8 over 1024 keys, 16 blocks of 64: 4 splits 9.2 us, 8 7.3, 16 7.0 (H100). One block an SM
    loading three key blocks ahead was 3% faster over long caches on the H100 and 37-45% slower
    on the H200 (B=1 GQA 131072 keys 173.7 us against 126.9 for 33 splits of two stages): the
    H200's bandwidth wants more loads in flight an SM, and the slots' split keeps them."""
    m1, m2 = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=planner.order.__getitem__)
    *batch, keys = (g.dim_value(d, planner.bindings) for d in g.tensor_type(m1.res).shape)   # [*batch, M, N]
    queries = hint(batch.pop(s.attention_rows_of(m1, m2, planner.bindings)))   # the rows P @ V's template tiles
    rows = s.fit_block(params["block_m"], queries)
    keys, block = hint(keys), s.mma_k_extent(s.fit_block(params["block_n"], keys), g.tensor_type(m2.lhs).dtype.itemsize)

    def programs(value) -> int:
        return math.prod(map(value, batch)) * -(-queries // rows)
    shared = s.shared_bytes(group.kind, {**params, "block_m": rows, "block_n": block}, features)
    slots = planner.sm_count * max(1, platforms.blocks_per_sm_by_shared(planner.platform, shared))
    if 2 * programs(least) > slots:
        return 1
    blocks = -(-keys // block)
    splits = blocks // MIN_SPLIT_KEY_BLOCKS
    if blocks >= 2 * MIN_SPLIT_KEY_BLOCKS:   # a cache worth splitting: two blocks on every SM
        splits = max(splits, min(blocks, 2 * planner.sm_count // programs(_middle)))
    return max(1, min(slots // programs(least), splits))


def _middle(value) -> int:
    """A dim's value, or a dynamic dim's class's geometric middle (between `least` and `hint`): the
    batch a short cache's split for the SMs is derived for. Split for the class's smallest batch (2
    of 2..16), GQA 32/8 B=8 over 1024 keys took 16 splits, 15.9 us against 10.5 at the 4 of its own
    compile, while a long cache's runs cost the class's top little (B=8 over 131072 keys, 1396 us
    at 8 splits against 1367 at 2; both H100, measured under the one-block-an-SM rule since
    dropped, bench/RESULTS.md session 32)."""
    return math.isqrt(least(value) * hint(value)) if is_dynamic(value) else value


#: blocks of 4 warps per SM a split column reduction aims for (a block holds 64 fp32 accumulators
#: a thread, so several share an SM and one's loads cover another's latency), and the fewest steps of
#: block_m rows each split keeps: fewer, and the partial results' traffic and the second kernel
#: cost more than the split gains
COLUMN_BLOCKS_PER_SM = 4
MIN_SPLIT_ROW_STEPS = 8


#: registers a thread of a row kernel walking its rows takes (`_row_walk_blocks`): per element of
#: its share of the row tile and of the riders' accumulators, and besides. Fitted to what ptxas
#: allocated the norm backwards (sm_90a, bf16, rows of 512-8192, 4-16 warps, 1-2 stages: 66
#: kernels) for the blocks an SM then holds: it names them for every default schedule but rms_norm's
#: at 1024 and 2048 columns (3 where ptxas's 114 and 128 registers leave 4; at 1024, 3 and 4
#: measured the same on the H200, 0.944x and 0.940x the copy bandwidth, ptxas held to them; 2048
#: not measured); a linear count gets 6 of the 66 wrong, ptxas's choices being its own. (The rows
#: staged ahead take shared memory, not registers: `schedule.shared_bytes`.)
ROW_WALK_REGISTERS = (3.4, 1.2, 12)


#: column reductions one row kernel carries at most: each holds a row-wide accumulator in registers
#: (a layer_norm backward's two at 8192 columns take 8 warps not to spill)
MAX_COLUMN_RIDERS = 2


def _over_last_axis(op) -> bool:
    """Whether a row kernel's anchor (a norm, a norm statistic, a softmax or a reduce) works along
    its input's last axis, which the row template then tiles as its columns."""
    if isinstance(op, (g.SoftmaxOp, g.ReduceOp)):
        return op.axis.data == g.tensor_type(op.operands[0]).rank - 1
    return True


def _column_riders(group: Group, planner: _Planner) -> list:
    """The column reductions `merge_column_reductions` put in a row kernel: those its extra outputs
    are computed from, maybe through an epilogue (`_unit_dims_apart`; a walk back from each output
    that stops at reductions)."""
    riders = []
    for v in group.extra:
        work, seen = [v], set()
        while work:
            op = planner.producer(work.pop())
            if op is None or op in seen or not (op in group.ops or isinstance(op, g.ReshapeOp)):
                continue
            seen.add(op)
            if isinstance(op, ROW_REDUCTIONS):
                if isinstance(op, g.ReduceOp) and op.axis.data == 0 and g.tensor_type(op.input).rank == 2 \
                        and op not in riders:
                    riders.append(op)
                continue
            work.extend(op.operands)
    return riders


def _row_walk_programs(group: Group, planner: _Planner, params: dict[str, int]) -> int:
    """The blocks of a row walk (`_row_walk_blocks` on each SM), in whole clusters where its rows
    are split across them (`schedule.row_split`): only as many as run at once
    (`platforms.resident_clusters`)."""
    blocks = _row_walk_blocks(group, planner, params)
    split = s.row_split(params, planner._sizes(_walked_rows(group, planner))[-1])
    if split == 1 or planner.platform is None:
        return planner.sm_count * blocks
    return split * platforms.resident_clusters(planner.platform, split, blocks)


def _walks_ahead(group: Group, planner: _Planner, params: dict[str, int]) -> bool:
    """Whether a row kernel without riders walks its rows to stage the next row blocks ahead
    (`num_stages` 2+, a row of one chunk, rows of a 2-D input): `schedule_to_tile._walks_rows`."""
    if group.kind != "row_reduction" or params.get("num_stages", 1) < 2:
        return False
    anchor = _row_anchor(group, planner, [])
    sizes = planner._sizes(anchor.operands[0])
    axis = anchor.axis.data if isinstance(anchor, (g.SoftmaxOp, g.ReduceOp)) else -1
    split = s.row_split(params, sizes[-1])
    return len(sizes) == 2 and axis % 2 == 1 and s.row_tile(params, hint(sizes[0]), -(-sizes[-1] // split))[2] == 1


def _row_walk_blocks(group: Group, planner: _Planner, params: dict[str, int]) -> int:
    """Blocks an SM holds of a row kernel walking its rows, by the registers a thread takes
    (`ROW_WALK_REGISTERS`) and its stages' shared memory: its walk has as many programs as the SMs
    hold at once, as each writes a row of partials for the combining kernel to add. Fewer leave memory requests
    unissued; more run as later waves (H100 rms_norm 16384 x 8192, 3 an SM where 2 fit: 0.81x
    against 0.92x, half the SMs idle in the last wave), and asking ptxas to fit more
    (.minnctapersm) spilled: 0.06-0.4x. Of the copy bandwidth, bench/RESULTS.md session
    31, 2 a SM before: H100 bf16 layer_norm 16384 x 8192 (236 registers on 8 warps, 1 block)
    0.797 -> 0.823x, 65536 x 1024 (145 on 4, 3 blocks) 0.813 -> 0.895x, rms_norm there (114 on 4,
    4 blocks) 0.888 -> 0.94x; H200 rms_norm 32768 x 4096 (168 on 4, 3 blocks) 0.81 -> 0.94x. Not
    measured off NVIDIA: 2 a compute unit there, as before."""
    riders = _column_riders(group, planner)
    n_rows, row_elements = planner._sizes(_walked_rows(group, planner))
    rows, cols, chunks = s.row_tile(params, hint(n_rows), -(-row_elements // s.row_split(params, row_elements)))
    threads = 32 * params["num_warps"]
    per_tile, per_accumulator, fixed = ROW_WALK_REGISTERS
    registers = fixed + (per_tile * rows * cols + per_accumulator * len(riders) * chunks * cols) / threads
    platform = planner.platform
    if platform is None or platform.vendor != "nvidia":   # (no register file to count by)
        return 2
    regs = min(platform.max_regs_per_thread, math.ceil(registers))
    staged = s.shared_bytes("row_reduction", params, _row_features(group, planner))
    return max(1, platforms.occupancy(platform, threads, regs, staged)[0])


def _staged_row_bytes(group: Group, planner: _Planner) -> int:
    """The bytes a row element of the inputs a row walk stages takes (`schedule.shared_bytes`):
    those of the kernel's inputs shaped as its rows (`schedule_to_tile._row_tiles_read`)."""
    rows = planner._sizes(_walked_rows(group, planner))
    inputs = {v for op in group.ops for v in op.operands if planner.producer(v) not in group.ops
              and planner._sizes(v) == rows}
    return sum(g.tensor_type(v).dtype.itemsize for v in inputs)


def _split_rows(group: Group, planner: _Planner, params: dict[str, int]) -> int:
    """How many ways to split a column reduction's reduced axis: enough for its column blocks to
    give every SM COLUMN_BLOCKS_PER_SM blocks, each split keeping at least MIN_SPLIT_ROW_STEPS
    steps. A reduced axis taken at run time splits as its class's largest value would: the last
    class has none, and splits as many ways as the SMs want (its runs' steps counted at run time).
    Split for the hint's 4096 rows (16 ways where 65536 rows take 33), the generic sum of [65536,
    4096] bf16 ran 2.1x the time of the one compiled for its rows; split as the SMs want, 0.99x
    (with the loop unrolled, `schedule_to_tile.COLUMN_UNROLL`), but 1.16x at [16384, 1024], where
    the compile for its rows splits 64 ways rather than 132 (H200, bench/RESULTS.md session 27)."""
    (op,) = (op for op in group.ops if isinstance(op, g.ReduceOp))
    values = [g.dim_value(d, planner.bindings) for d in g.tensor_type(op.input).shape]
    sizes = [hint(v) for v in values]
    axis = op.axis.data
    rows, cols, _ = s.column_tile(params, sizes[axis], sizes[-1])   # the template's tile
    programs = math.prod(sz for i, sz in enumerate(sizes[:-1]) if i != axis) * -(-sizes[-1] // cols)
    wanted = -(-planner.sm_count * COLUMN_BLOCKS_PER_SM // programs)
    if unbounded(values[axis]):
        return wanted
    steps = -(-sizes[axis] // rows)
    return max(1, min(wanted, steps // MIN_SPLIT_ROW_STEPS))


def _stored(v: SSAValue, group: Group, planner: _Planner) -> tuple[SSAValue, tuple[int, ...]] | None:
    """Matmul operand `v` as read from memory through any views, and its element strides (a dynamic
    dim counted as 1: its strides' factors); None for one the kernel computes (attention's
    probabilities)."""
    while isinstance(v.owner, (g.TransposeOp, g.ReshapeOp, g.GatherOp)):   # (a paged cache's pages: its rows)
        v = v.owner.input
    if v.owner in group.ops:
        return None
    shape = [g.dim_value(d, planner.bindings) for d in g.tensor_type(v).shape]
    return v, planner.strided.get(v) or interop.c_strides([1 if is_dynamic(n) else n for n in shape])


def _rows_aligned(v: SSAValue, group: Group, planner: _Planner) -> bool:
    """Whether matmul operand `v`, read from memory through any views, has strides a TMA tensor map
    holds: 16-byte rows (one computed in the kernel, like attention's probabilities, is not
    copied). A GEMM with 70-element fp16 rows takes the mma.sync path, so it should not get the
    native path's tiling (Target IR decides the path per kernel; this keeps the defaults in step)."""
    stored = _stored(v, group, planner)
    if stored is None:
        return True
    v, strides = stored
    return tensor_maps.stride_problem(strides, g.tensor_type(v).dtype.itemsize) is None


def _rows_split_lines(v: SSAValue, group: Group, planner: _Planner) -> bool:
    """Whether the stored rows of matmul operand `v` start off the 128-byte lines a TMA box row
    spans (a row pitch not a multiple of TMA_ROW_BYTES, known at compile time): each box row then
    costs about three L2 requests rather than one (bench/gemm_l2_traffic.py, session 39). Through
    transposes only: the rows of a reshaped or gathered view need not be its source's."""
    while isinstance(v.owner, g.TransposeOp):
        v = v.owner.input
    if isinstance(v.owner, (g.ReshapeOp, g.GatherOp)):
        return False
    stored = _stored(v, group, planner)
    if stored is None or len(stored[1]) < 2:
        return False
    v, strides = stored
    shape = g.tensor_type(v).shape
    if is_dynamic(g.dim_value(shape[-1], planner.bindings)) and v not in planner.strided:
        return False
    return strides[-2] * g.tensor_type(v).dtype.itemsize % TMA_ROW_BYTES != 0


def _query_rows_whole_lines(head_dim, element_bytes: int) -> bool:
    """Whether an attention's Q and K tiles are whole TMA box rows, as the Hopper path's copies and
    wgmma take them (`tile_to_target.native_blockers`, `tensor_maps.whole_box_rows`): fp8 at D = 32
    is not, and runs on mma.sync, where the wgmma schedule spills (at D = 64 before its 64-byte
    swizzle: 255 registers, 692 bytes; 1456 us at 16x16x2048x64 against 1194 with mma.sync's own,
    H200, bench/RESULTS.md session 42). Asked only of 8-bit operands: 16-bit ones at D = 32 were
    not measured."""
    if not isinstance(head_dim, int):
        return True
    return whole_box_rows(s.head_dim_tile(head_dim, element_bytes), element_bytes)


def _wgmma_reads(mm: g.MatmulOp) -> bool:
    """Whether wgmma reads this matmul's operands as they are stored: 16-bit ones in any layout,
    8-bit ones only K-contiguous (A as [M, K], B the transpose of an [N, K] tensor: `a @ b.T`), as
    `tile_to_target.native_blockers` requires."""
    if g.tensor_type(mm.lhs).dtype.bits != 8:
        return True
    return not g.swaps_last_dims(mm.lhs) and g.swaps_last_dims(mm.rhs)


def _features(group: Group, planner: _Planner, block: Block) -> dict[str, int]:
    """What of a group's problem its default tiling depends on."""
    matmuls = sorted((op for op in group.ops if isinstance(op, g.MatmulOp)), key=planner.order.__getitem__)
    if group.kind == "row_reduction":
        return _row_features(group, planner)
    if not matmuls:
        copies = [op for op in group.ops if byte_operands.is_layout_copy(op)]
        return {"tile_compiler": int(planner.tile_compiler),
                **({"layout_copy_bytes": g.tensor_type(copies[0].res).dtype.itemsize} if copies else {})}
    lhs = g.tensor_type(matmuls[0].lhs)
    features = {"element_bytes": lhs.dtype.itemsize,
                "epilogue_ops": sum(isinstance(op, ELEMENTWISE) and op not in planner.assert_only for op in group.ops),
                "epilogue_divides": sum(isinstance(op, g.ElementwiseOp) and op.kind == "div" for op in group.ops),
                "wgmma": int(planner.native and all(_rows_aligned(v, group, planner) and _wgmma_reads(mm)
                                                    for mm in matmuls for v in (mm.lhs, mm.rhs))),
                "tile_compiler": int(planner.tile_compiler)}
    if group.kind == "gemm":
        features["rhs_rows_split"] = int(_rows_split_lines(matmuls[0].rhs, group, planner))
    if group.kind == "flash_attention":
        features["head_dim"] = g.dim_value(lhs.shape[-1], planner.bindings)
        if features["element_bytes"] == 1 and not _query_rows_whole_lines(features["head_dim"], 1):
            features["wgmma"] = 0
        features["value_bytes"] = g.tensor_type(matmuls[1].rhs).dtype.itemsize
        features.update(_query_blocks(matmuls, planner))
        features["reads_indices"] = int(_reads_indices(block, planner.bindings))
        bounds = _key_bounds(group, planner)
        features["one_sided_mask"] = int(_one_sided(bounds))
        features["keys_bounded_below"] = int(bounds.lower is not None)   # (a sliding window's start)
    if group.kind == "flash_chain":
        features.update(_chain_tiles(block, planner.bindings))
    return features


def _query_blocks(matmuls: list[g.MatmulOp], planner: _Planner) -> dict[str, int]:
    """An attention's `query_rows` (the rows P @ V's template tiles, a dynamic dim's hint),
    `query_block_waves` (its blocks of 128 query rows, over every batch program, in whole waves of
    one block an SM) and `shared_keys` (K or V broadcast along a batch dim of the scores, as
    grouped-query attention shares each KV head among query heads)."""
    *rows, _ = (hint(g.dim_value(d, planner.bindings)) for d in g.tensor_type(matmuls[0].res).shape)
    batch = rows[:-1]
    queries = rows.pop(s.attention_rows_of(*matmuls, planner.bindings))
    blocks = math.prod(rows) * -(-queries // 128)

    def broadcast(v: SSAValue) -> bool:   # (batch dims right-aligned with the scores')
        dims = [hint(g.dim_value(d, planner.bindings)) for d in g.tensor_type(v).shape[:-2]]
        return any(n == 1 < m for n, m in zip(reversed(dims), reversed(batch)))
    return {"query_rows": queries, "query_block_waves": blocks // planner.sm_count,
            "shared_keys": int(any(broadcast(mm.rhs) for mm in matmuls))}


def _row_features(group: Group, planner: _Planner) -> dict[str, int]:
    """A row kernel's `row_elements` (the reduced axis's length), the `column_riders` it carries,
    whether it is a norm's (`norm`; `layer_norm`) or a softmax's (`softmax`), which hold one row in registers, and
    whether a reduction's epilogue is `over_rows` it reduced (a norm backward's dx), its `rows` and
    the bytes a row element of its rows' inputs takes (`staged_row_bytes`), the statistics
    computed before the anchor's (`chained_statistics`: `merge_row_chains`), the `exponentials`,
    whether its blocks may form `clusters` (PTX on a platform that has them: a long row splits),
    and whether it has `few_rows` (fewer than the SMs)."""
    riders = _column_riders(group, planner)
    anchor = _row_anchor(group, planner, riders)
    axis = anchor.axis.data if isinstance(anchor, (g.SoftmaxOp, g.ReduceOp)) else -1
    over_rows = isinstance(anchor, g.ReduceOp) and planner._sizes(group.output) == planner._sizes(anchor.operands[0])
    chained = [op for op in group.ops if isinstance(op, g.ReduceOp) and op is not anchor
               and g.computed_from(anchor.operands[0], op)]
    sizes = planner._sizes(anchor.operands[0])
    rows = math.prod(hint(n) for i, n in enumerate(sizes) if i != axis % len(sizes))
    return {"row_elements": sizes[axis], "column_riders": len(riders), "few_rows": int(rows < planner.sm_count),
            "rows": rows, "staged_row_bytes": _staged_row_bytes(group, planner),
            "clusters": int(planner.platform is not None and not planner.tile_compiler
                            and planner.platform.has("clusters")),
            "norm": int(isinstance(anchor, (g.LayerNormOp, g.RmsNormOp))),
            "layer_norm": int(isinstance(anchor, g.LayerNormOp)),
            "softmax": int(isinstance(anchor, g.SoftmaxOp)),
            "over_rows": int(over_rows), "chained_statistics": len(chained),
            "exponentials": sum(isinstance(op, g.ElementwiseOp) and op.kind in ("exp", "exp2") for op in group.ops)}


def _row_anchor(group: Group, planner: _Planner, riders: list):
    """The op a row kernel's rows are reduced by (the template's anchor): the last row reduction
    but its `riders` and saved statistics, else a statistic."""
    *_, anchor = [op for op in sorted(group.ops, key=planner.order.__getitem__)   # (siblings before it)
                  if isinstance(op, ROW_REDUCTIONS) and not isinstance(op, g.NormStatisticOp) and op not in riders] \
        or [op for op in group.ops if isinstance(op, g.NormStatisticOp)]
    return anchor


def _walked_rows(group: Group, planner: _Planner) -> SSAValue:
    """The rows a row walk (`_row_walk_programs`) walks: its riders' operand, else its anchor's."""
    riders = _column_riders(group, planner)
    return riders[0].input if riders else _row_anchor(group, planner, riders).operands[0]


def _chain_tiles(block: Block, bindings) -> dict[str, int]:
    """A flash_chain kernel's tiles in shared memory (`schedule.shared_bytes`): `row_tiles`
    resident (each score matmul's row operand), `streamed_tiles` per pipeline stage (the score
    matmuls' column operands and the matmul sinks' other operands, each input once, as the
    template streams them), and `head_dim`, the widest of their rows: the head dims, not the
    reduced sequence length that a sink's own inner dim is (taking that shrank dV/dQ/dK's key
    blocks to 32 rows); `sink_columns`, the matmul sinks' accumulator columns together; and
    `staged_tiles`, the [block_m, block_n] tiles the across sinks store (dS^T for dQ: their other
    operand, K, is already a resident row tile, and their sums leave the kernel every step); and
    `bounded_columns`, whether a mask bounds each row block's columns (causal, a window)."""
    def size(d) -> int:
        return g.dim_value(d, bindings)
    sinks = index_maps.chain_sinks(block, bindings)
    scores = {mm: m for sink in sinks for mm, m in sink.tiling.scores.items()}
    streamed, widths = set(), []
    for mm, m in scores.items():
        streamed.add(index_maps.chain_source(mm.rhs if m[-2] == index_maps.CHAIN_ROWS else mm.lhs))
        widths.append(size(g.tensor_type(mm.lhs).shape[-1]))
    carried = [sink for sink in sinks if isinstance(sink.op, g.MatmulOp) and not sink.across]
    for sink in carried:
        computed_lhs = sink.computed is sink.op.lhs
        streamed.add(index_maps.chain_source(sink.op.rhs if computed_lhs else sink.op.lhs))
        widths.append(size(g.tensor_type(sink.op.res).shape[-1 if computed_lhs else -2]))
    columns = sum(size(g.tensor_type(sink.op.res).shape[-1 if sink.computed is sink.op.lhs else -2])
                  for sink in carried)
    bounds = chain_bounds(block, sinks, bindings)
    return {"head_dim": max(widths), "row_tiles": len(scores), "streamed_tiles": len(streamed),
            "sink_columns": columns, "staged_tiles": sum(sink.across for sink in sinks),
            "bounded_columns": int(bounds.upper is not None or bounds.lower is not None)}


def _graph_passes(module: ModuleOp, backend: str) -> ModuleOp:
    """The Graph IR rewrites fusion plans over, in order (each returns its input when it has
    nothing to do). V's layout copy is for the PTX backend's matrix instructions: tileiras lays
    out an 8-bit attention's V itself."""
    rewrites = (query_groups.merge_query_groups,
                *((byte_operands.transpose_byte_values,) if backend != "cuda-tile" else ()),
                recompute.recompute_scores, recompute.copy_shared_prologues)
    for rewrite in rewrites:
        module = rewrite(module)
    return module


def fuse(module: ModuleOp, space: dict | None = None, platform=None, backend: str = "ptx",
         profile: bool = False) -> ModuleOp:
    """The Schedule IR module for a Graph IR module (the input is left unchanged). Each kernel is
    assigned a backend (`backend`: one for all, or "auto": `backend_choice.RULES` per kernel, which
    read `profile`, whether kernels stamp profile regions). With a target `platform`, a kernel's
    default tiling fits its shared memory per block and suits the matrix instructions its backend
    plans for; a backend whose own compiler stages and pipelines tiles (tileiras) gets
    schedule.SHAPE_DEFAULTS' `tile_compiler` rules."""
    check_backend_option(backend)
    out_funcs = []
    for f in _graph_passes(module, backend).ops:
        planner = _Planner(f)
        planner.target = platform
        planner.backend_option = backend
        planner.profiled = profile
        planner.pins = space or {}
        groups = planner.plan()
        body = Block(arg_types=[a.type for a in f.body.block.args])
        outer = dict(zip(f.body.block.args, body.args))
        items = [(planner.position(grp), 1, grp) for grp in groups]
        items += [(planner.order[view], 0, view) for view in planner.views]
        index = 0
        for _, _, item in sorted(items, key=lambda x: (x[0], x[1])):
            if isinstance(item, g.ReshapeOp):
                view = g.ReshapeOp(outer[item.input], item.res.type)
                body.add_op(view)
                outer[item.res] = view.res
                continue
            block, inputs, params, group_space, choice = _kernel_body(item, planner, space)
            name = f"{f.sym_name.data}_{item.kind}_{index}"
            index += 1
            outputs = item.outputs
            kernel = s.KernelOp(name, item.kind, [outer[v] for v in inputs], [v.type for v in outputs], block,
                                params, group_space, choice.backend, choice.why)
            body.add_op(kernel)
            outer.update(zip(outputs, kernel.outputs))
        body.add_op(func.ReturnOp(*[outer[v] for v in f.body.block.last_op.operands]))
        new = func.FuncOp(f.sym_name.data, f.function_type, Region(body))
        for key, value in f.attributes.items():
            if key.startswith("tessera."):
                new.attributes[key] = value
        out_funcs.append(new)
    return ModuleOp(out_funcs)
