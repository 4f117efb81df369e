"""The async-hazard checker: `check_async(module) -> list[Hazard]` over Target IR.

A kernel's copies (TMA bulk copies completing on mbarriers, cp.async groups), its wgmma groups
and its warp-specialized producer and consumers run concurrently; the IR orders them only through
waits, arrives and barriers. One missing or misplaced synchronization op gives a kernel that
usually computes the right answer and sometimes does not. This pass finds such kernels by
*executing* them abstractly, so it follows the real loop trip counts, stage indices and phase
bits rather than guessing them from the IR's shape.

The model (a concrete abstract interpreter):

* Each kernel runs for a few blocks (`program_ids`: first, middle and last of its grid, and
  their neighbours), a kernel that reads indices from memory (`tile.INDEX_READS`: a page,
  a sequence's length, a block's per-row limits) once for each of a few values they may read
  (`INDEX_SAMPLES`), and a kernel over dims taken at run time (`tile.dim`) once for each of a
  few sizes (`DIM_SAMPLES`). Scalar `arith`/`scf` ops are evaluated (compilation is specialised to
  shapes, and such indices are sampled, so every loop bound, stage index and parity is a
  number); tile data is not. A tensor value is a *marker* of who
  wrote it: a wgmma group (`("wg", agent, group, op)`), registers written at clock t
  (`("reg", t)`), or a shared stage a wgmma reads through a descriptor (`("sh", stage)`).
* A kernel in thread-block clusters runs one block, and the others of its cluster are taken to
  run alike: a cluster arrival (`mbarrier_arrive per = "cluster"`) counts every block's, a
  multicast `tma_load` writes every block's box. What one block's refill owes the others' reads
  is not checked (their handshake is `async_pipelines`', a pattern the tests pin).
* Agents: the block (its threads run alike, as Tile IR promises); inside `warp_specialize`, the
  producer thread and the consumer warps, run as coroutines. The scheduler always resumes the
  producer first, so it runs as far ahead as the barriers let it: that exposes refills of stages
  still being read.
* Happens-before as knowledge, not timing. Each agent has `own` (what every thread knows of its
  own ops: sync reads issued, cp.async and wgmma groups retired, synchronous copies done) and
  `known` (facts about every thread: `(agent, stream) -> count`, and `("tma", mbarrier) -> phases
  completed`). A block or named barrier turns `own` into `known`. An mbarrier arrive releases the
  arriving agent's `known` into the barrier's current phase (an arrive by every warp or thread of
  the agent also its `own`); a `mbarrier_try_wait` that returns acquires every phase up to the one
  it observed (PTX semantics: parity p returns at once when the current phase's parity is not p).
  A phase completes when its arrivals are all in and its copies' bytes equal the expected bytes.
* Checks: a read of a stage needs every copy into it visible to the reader; a refill needs every
  earlier read of the stage (and the stage's previous copy) known complete by the refilling
  agent; a register read of a wgmma result needs its group retired; a wgmma needs a
  `wgmma_fence` after the registers it reads were written; an arrive must not exceed the arrivals
  left in its phase; copies' bytes must match `expect_tx`; every TMA copy must be waited on by
  someone before the block exits; a wait no agent can satisfy is a hang. Registers stored to a
  stage (`st.shared`) are the generic proxy's writes: a wgmma reads them only after each thread
  fenced them (`fence kind = "async_shared"`) and then a barrier published that.

Synchronous copies and reads complete at once in program order. Tensor cores other than wgmma
(mma.sync, MFMA, WMMA) are synchronous. cp.async copies in flight at exit are not reported (the
Ampere path leaves its copies past the last step in flight, and the SM retires them).
"""
from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from xdsl.dialects import builtin
from xdsl.ir import BlockArgument, Operation
from xdsl.printer import Printer

from ..errors import TesseraError
from ..ir import target as tgt
from ..ir import tile

#: hazard kind -> what it means (the brief's (a)..(d), and the rest of the protocol)
KINDS: dict[str, str] = {
    "read-before-wait": "(a) a read of a shared stage or an accumulator before the copy or wgmma writing it is "
                        "waited on",
    "refill-race": "(b) a stage refilled while a read of its previous contents (or its previous copy) may still run",
    "wrong-phase": "(c) an mbarrier wait on the wrong phase: it returns at once or never",
    "arrive-count": "(d) arrivals that do not match the mbarrier's init",
    "tx-bytes": "(d) copy bytes that do not match the expect_tx bytes",
    "hang": "a wait that no agent can satisfy",
    "in-flight-at-exit": "a TMA copy nobody waits on before the block exits, or a bulk reduction still reading "
                         "shared memory",
    "mbarrier-init": "an mbarrier used before its init is fenced (fence mbarrier_init) and published (barrier)",
    "register-overwrite": "(a) a loop overwrites registers a wgmma still reads (its A operand or accumulator) before "
                          "a wgmma_wait retires it",
    "wgmma-fence": "a wgmma with no wgmma_fence between it and the register writes it reads",
    "proxy-fence": "a wgmma or bulk copy reads shared memory that threads stored with no fence kind = "
                   "\"async_shared\" between the stores and the barrier publishing them (stores are the generic "
                   "proxy's, wgmma and bulk copies read through the async proxy)",
    "barrier-threads": "a barrier whose thread count does not match the threads that reach it",
}


class CheckAsyncError(TesseraError):
    """Target IR the checker cannot execute (a loop bound or branch condition it cannot evaluate)."""


@dataclass(frozen=True)
class Hazard:
    """One hazard: its `kind` (a key of KINDS), the op at fault and the block that showed it."""

    kind: str
    kernel: str
    op: Operation = field(compare=False, repr=False)
    message: str
    block: tuple[int, ...]
    line: int | None = None        # the op's line in the module as Tessera prints it (1-based)
    text: str = ""                 # the op's printed first line

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.kind}: @{self.kernel} block {list(self.block)}: {self.message}\n    {self.text}"


# --- runtime objects ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Agent:
    """Threads that run the same ops: the block, or a warp_specialize region's producer/consumers."""

    name: str
    threads: int
    known: dict                                    # fact -> count, about every thread (module docstring)
    own: dict = field(default_factory=lambda: {"read": 0, "wgmma": 0, "cp": 0, "ld": 0, "st": 0, "st_fenced": 0,
                                               "bulk": 0})
    wg_commits: int = 0
    bulk_commits: int = 0                          # bulk groups (bulk_reduce) issued; own["bulk"]: read
    cp_commits: int = 0
    fence_at: int = -1                             # clock of the last wgmma_fence
    wgmma_reads: dict = field(default_factory=dict)  # loop iter_arg -> (group, wgmma) of the last wgmma reading it
    waits: dict = field(default_factory=dict)      # mbarrier -> its last try_wait if that acquired nothing new
    stale_wait: Operation | None = None            # the last try_wait, if it acquired nothing new

    @property
    def warps(self) -> int:
        return max(1, self.threads // 32)

    def publish(self) -> None:
        """A barrier of every thread of the agent: each now knows what each knew of its own ops."""
        for stream, n in self.own.items():
            key = (self.name, stream)
            if self.known.get(key, 0) < n:
                self.known[key] = n

    def release(self, whole: bool) -> dict:
        """What an arrive hands over: by every thread/warp (`whole`), also each one's own ops."""
        facts = dict(self.known)
        if whole:
            for stream, n in self.own.items():
                facts[(self.name, stream)] = max(facts.get((self.name, stream), 0), n)
        return facts


def _merge(into: dict, facts: dict) -> None:
    for key, n in facts.items():
        if into.get(key, 0) < n:
            into[key] = n


@dataclass(eq=False)
class _Write:
    """A copy into a stage: TMA (completes on `bar`'s phase `seq`), cp.async (group `seq` of its
    agent), a synchronous copy (the agent's `seq`-th) or the threads' stores of registers (st.shared,
    the agent's `seq`-th; the async proxy sees them only once fenced)."""

    op: Operation
    mechanism: str
    agent: _Agent
    seq: int
    bar: _MBarrier | None = None


@dataclass(eq=False)
class _Stage:
    name: str
    writes: dict = field(default_factory=dict)   # byte offset -> latest _Write
    reads: dict = field(default_factory=dict)    # (agent name, "read" | "wgmma") -> seq of the latest read


@dataclass(eq=False)
class _Barriers:
    """An mbarrier_alloc's group and its init state (init, then fence, then a block barrier)."""

    name: str
    stages: list = field(default_factory=list)
    inited: bool = False
    fenced: bool = False
    published: bool = False
    reported: bool = False


@dataclass(eq=False)
class _MBarrier:
    """One mbarrier: its current phase (`completed` phases so far), what the phase still waits
    for, and the knowledge released into each completed phase (cumulative)."""

    name: str
    group: _Barriers
    arrivals: int = 0
    pending: int = 0
    expect: int = 0                  # expect_tx bytes of the current phase
    tx: int = 0                      # bytes of the copies completing on the current phase
    completed: int = 0
    release: dict = field(default_factory=dict)
    cum: list = field(default_factory=list)    # cum[j]: knowledge released into phases 0..j
    last_copy: _Write | None = None

    def init(self, arrivals: int) -> None:
        self.arrivals = self.pending = arrivals

    def settle(self) -> None:
        """Completes the current phase if nothing it waits for is missing (copies land eventually)."""
        if self.group.inited and self.pending == 0 and self.tx == self.expect:
            facts = dict(self.cum[-1]) if self.cum else {}
            _merge(facts, self.release)
            self.completed += 1
            facts[("tma", self)] = self.completed
            self.cum.append(facts)
            self.pending, self.expect, self.tx, self.release = self.arrivals, 0, 0, {}


class _Wait:
    """A try_wait blocked until `bar` completes phase `phase`."""

    def __init__(self, op, bar: _MBarrier, phase: int, known: int, parity: int):
        self.op, self.bar, self.phase, self.known, self.parity = op, bar, phase, known, parity

    def ready(self) -> bool:
        self.bar.settle()
        return self.bar.completed > self.phase


class _Fork:
    """warp_specialize: run these (agent, generator) pairs, then resume the forking agent."""

    def __init__(self, children):
        self.children = children
        self.tasks = []

    def ready(self) -> bool:
        return all(t.done for t in self.tasks)


@dataclass(eq=False)
class _Task:
    agent: _Agent
    gen: Iterator
    wait: object = None
    done: bool = False


# --- scalars -------------------------------------------------------------------------------------

_PREDICATES = {0: lambda a, b: a == b, 1: lambda a, b: a != b, 2: lambda a, b: a < b, 3: lambda a, b: a <= b,
               4: lambda a, b: a > b, 5: lambda a, b: a >= b}


def _compare(predicate: int, a: int, b: int, bits: int) -> int:
    """arith.cmpi: predicates 0..5 eq ne slt sle sgt sge, 6..9 ult ule ugt uge."""
    if predicate >= 6:
        predicate, a, b = predicate - 4, a & (1 << bits) - 1, b & (1 << bits) - 1
    return int(_PREDICATES[predicate](a, b))


def _tdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


_BINARY = {
    "arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
    "arith.divsi": _tdiv, "arith.floordivsi": lambda a, b: a // b, "arith.ceildivsi": lambda a, b: -(-a // b),
    "arith.remsi": lambda a, b: a - b * _tdiv(a, b), "arith.andi": lambda a, b: a & b, "arith.ori": lambda a, b: a | b,
    "arith.xori": lambda a, b: a ^ b, "arith.shli": lambda a, b: a << b, "arith.shrsi": lambda a, b: a >> b,
    "arith.maxsi": max, "arith.minsi": min,
}
#: unsigned ops, on operands taken as unsigned numbers of their width
_UNSIGNED = {"arith.divui": lambda a, b: a // b, "arith.remui": lambda a, b: a % b, "arith.shrui": lambda a, b: a >> b,
             "arith.maxui": max, "arith.minui": min}
_CASTS = ("arith.index_cast", "arith.index_castui", "arith.extui", "arith.extsi", "arith.trunci")


def _width(t) -> int | None:
    """Bits of an integer scalar type (index: 64); None for anything else."""
    if isinstance(t, builtin.IndexType):
        return 64
    if isinstance(t, builtin.IntegerType):
        return t.width.data
    return None


def _wrap(v: int, bits: int) -> int:
    if bits == 1:
        return v & 1
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


# --- one block's run ---------------------------------------------------------------------------


class _Run:
    """Runs one kernel for one program id and collects its hazards into `report`."""

    def __init__(self, kernel: tgt.KernelOp, pid: tuple[int, ...], report, plans: dict, index_value: int = 0,
                 dim_sample: int = 0):
        self.kernel, self.pid, self._report, self.plans = kernel, pid, report, plans
        self.index_value = index_value   # what every tile.load_index reads (`INDEX_SAMPLES`)
        self.dim_sample = dim_sample     # which sizes the dynamic dims take (`dim_size`)
        self.env: dict = {}
        self.clock = 0
        self.agents: list[_Agent] = []
        self.barriers: list[_MBarrier] = []
        self.buffers = 0
        self.scratch: dict[int, _Stage] = {}   # an op's scratch buffer (its byte offset) as a stage

    def hazard(self, kind: str, op: Operation, message: str) -> None:
        self._report(kind, op, message, self.pid)

    # scheduling

    def run(self) -> None:
        block = self._agent("block", self.kernel.config.threads)
        for arg in self.kernel.body.block.args:
            self.env[arg] = ("reg", 0)
        tasks = [_Task(block, self._exec(block, self.kernel.body.block))]
        while True:
            task = next((t for t in tasks if not t.done and (t.wait is None or t.wait.ready())), None)
            if task is None:
                break
            task.wait = None
            try:
                item = next(task.gen)
            except StopIteration:
                task.done = True
                continue
            if isinstance(item, _Fork):
                item.tasks = [_Task(a, g) for a, g in item.children]
                tasks[tasks.index(task):tasks.index(task)] = item.tasks   # children first: producer, consumer
            task.wait = item
        stuck = [t for t in tasks if not t.done]
        for t in stuck:
            if isinstance(t.wait, _Wait):
                self._hang(t.wait)
        if not stuck:
            self._check_exit()

    def _agent(self, name: str, threads: int, known: dict | None = None) -> _Agent:
        agent = _Agent(name, threads, dict(known or {}))
        self.agents.append(agent)
        return agent

    def _exec(self, agent: _Agent, block, skip_terminator: bool = False):
        """Runs the ops of `block` (a generator: it yields where the agent waits or arrives)."""
        for step, flow in self._plan(block, skip_terminator):
            if flow is None:
                step(self, agent)
            else:
                yield from flow(self, agent)

    def _plan(self, block, skip_terminator: bool) -> list:
        """(step, flow) for each op of `block` to run (`_compile`), made once per kernel."""
        plan = self.plans.get(block)
        if plan is None:
            ops = list(block.ops)[:-1] if skip_terminator else list(block.ops)
            plan = self.plans[block] = [_compile(op) for op in ops]
        return plan

    # values

    def scalar(self, value, op: Operation) -> int:
        v = self.env.get(value)
        if not isinstance(v, int):
            raise CheckAsyncError(f"check-async: {op.name} in @{self.kernel.sym_name.data} needs a value it "
                                  f"cannot compute ({v!r})")
        return v

    def read_registers(self, agent: _Agent, op: Operation, operands) -> None:
        """A register read of each operand: a wgmma result must be retired first."""
        for v in operands:
            m = self.env.get(v)
            if type(m) is tuple and m[0] == "wg":
                self._read_accumulator(agent, op, m)

    def write_registers(self, results) -> None:
        self.clock += 1
        marker = ("reg", self.clock)
        for r in results:
            self.env[r] = marker

    def _program_id(self, agent: _Agent, op: Operation) -> None:
        self.env[op.results[0]] = self.pid[op.axis.value.data]

    def _load_index(self, agent: _Agent, op: Operation) -> None:
        self.env[op.results[0]] = self.index_value

    def _dim(self, agent: _Agent, op: Operation) -> None:
        self.env[op.results[0]] = dim_size(self.kernel, op.source.index, self.dim_sample)

    # control flow

    def _for(self, agent: _Agent, op: Operation):
        lb, ub, step = (self.scalar(v, op) for v in (op.lb, op.ub, op.step))
        values = [self.env[v] for v in op.iter_args]
        body = op.body.block
        iv, *args = body.args
        for i in range(lb, ub, step):
            self.env[iv] = i
            self.env.update(zip(args, values))
            yield from self._exec(agent, body, skip_terminator=True)
            values = [self.env[v] for v in body.last_op.operands]
            self._check_overwrite(agent, body.last_op, args, values)
        self.env.update(zip(op.results, values))

    def _check_overwrite(self, agent: _Agent, yield_op: Operation, args, values) -> None:
        """A loop-carried value lives in the same registers every iteration (as the PTX backend
        emits it), so yielding a new one overwrites what a running wgmma may still read, unless
        it is that wgmma's own accumulator (updated in place)."""
        for arg, value in zip(args, values):
            group, mma = agent.wgmma_reads.get(arg, (0, None))
            if agent.own["wgmma"] < group and value is not self.env[arg] and value is not self.env[mma.result]:
                self.hazard("register-overwrite", yield_op, f"overwrites the registers of a loop-carried value that "
                            f"the wgmma of group {group} still reads ({agent.wg_commits} committed, "
                            f"{agent.own['wgmma']} retired)")

    def _if(self, agent: _Agent, op: Operation):
        if not isinstance(self.env.get(op.cond), int) and _computes_in_registers(op):
            region = op.true_region   # (a branch on a value read at run time, each side as the other to the checker)
        else:
            region = op.true_region if self.scalar(op.cond, op) else op.false_region
        if region.blocks:
            block = region.block
            yield from self._exec(agent, block, skip_terminator=True)
            self.env.update(zip(op.results, (self.env[v] for v in block.last_op.operands)))

    def _warp_specialize(self, agent: _Agent, op: tgt.WarpSpecializeOp):
        """The producer region on one thread, the consumer region on the warps left, concurrently."""
        producer = self._agent("producer", 1, agent.known)
        consumer = self._agent("consumer", agent.threads - 32 * op.producer_warps.value.data, agent.known)
        yield _Fork([(producer, self._exec(producer, op.producer.block)),
                     (consumer, self._exec(consumer, op.consumer.block))])

    # shared memory

    def _allocate(self, agent: _Agent, op: tgt.AllocateOp) -> None:
        t = op.result.type
        if tgt._space(t) != tgt.MEMORY_SPACES["shared"]:
            return self.write_registers(op.results)
        name = f"buffer #{self.buffers} ({t})"
        self.buffers += 1
        self.env[op.result] = [_Stage(f"stage {s} of {name}") for s in range(t.get_shape()[0])]

    def _stage(self, buffer, stage, op) -> _Stage:
        return self.env[buffer][self.scalar(stage, op)]

    def _wgmma_descriptor(self, agent: _Agent, op: tgt.WgmmaDescriptorOp) -> None:
        """A descriptor of a stage: the wgmma that reads through it reads the stage."""
        self.env[op.result] = ("sh", self._stage(op.buffer, op.stage, op))

    def _load_shared(self, agent: _Agent, op: Operation, synchronous: bool) -> None:
        """A read of a stage into registers (`synchronous`), or a wgmma operand, which the wgmma reads."""
        stage = self._stage(op.src, op.stage, op)
        self.env[op.result] = ("sh", stage)
        if synchronous:
            self._check_read(agent, op, stage)
            agent.own["read"] += 1
            stage.reads[(agent.name, "read")] = agent.own["read"]

    def _visible(self, agent: _Agent, w: _Write, async_proxy: bool = False) -> bool:
        """Whether `agent` knows copy `w` is done and, for a read through the async proxy (wgmma),
        that stores by the threads were fenced for it before the barrier that told it so."""
        if w.mechanism == "tma":
            return agent.known.get(("tma", w.bar), 0) > w.seq
        if w.mechanism == "st.shared":
            return agent.known.get((w.agent.name, "st_fenced" if async_proxy else "st"), 0) >= w.seq
        return agent.known.get((w.agent.name, "cp" if w.mechanism == "cp.async" else "ld"), 0) >= w.seq

    def _complete_for(self, agent: _Agent, w: _Write) -> bool:
        """Whether `agent` knows copy `w` is done (a thread's own cp.async group: once it waited)."""
        if w.mechanism == "cp.async" and w.agent is agent:
            return agent.own["cp"] >= w.seq
        return w.mechanism in ("ld.global", "st.shared") or self._visible(agent, w)

    def _check_read(self, agent: _Agent, op: Operation, stage: _Stage, async_proxy: bool = False) -> None:
        for w in stage.writes.values():
            if self._visible(agent, w, async_proxy):
                continue
            if async_proxy and self._visible(agent, w):
                self.hazard("proxy-fence", op, f"reads {stage.name}, which {w.op.name} stored, with no "
                            f"fence kind = \"async_shared\" between the stores and the barrier")
                continue
            stale = agent.waits.get(w.bar) if w.bar is not None else None
            if stale is not None:
                self.hazard("wrong-phase", stale, f"returned at once without the phase of {w.bar.name} that the "
                            f"read of {stage.name} by {op.name} needs")
            else:
                how = {"tma": f"a mbarrier_try_wait on the phase of {w.bar.name if w.bar else ''} it completes on",
                       "cp.async": "a cp_async_wait retiring its group and a barrier",
                       "ld.global": "a barrier", "st.shared": "a barrier"}[w.mechanism]
                self.hazard("read-before-wait", op, f"reads {stage.name} before {w.op.name} writing it is waited "
                            f"on ({agent.name} needs {how})")

    def _check_refill(self, agent: _Agent, op: Operation, stage: _Stage, offset: int) -> None:
        racing = [f"{reader}'s {_READS.get(stream, 'synchronous')} reads"
                  for (reader, stream), seq in stage.reads.items() if agent.known.get((reader, stream), 0) < seq]
        previous = stage.writes.get(offset)
        if previous is not None and not self._complete_for(agent, previous):
            racing.append(f"its previous {previous.op.name}")
        if not racing:
            return
        if agent.stale_wait is not None:
            self.hazard("wrong-phase", agent.stale_wait, f"returned at once, so {op.name} refills {stage.name} while "
                        f"{' and '.join(racing)} may still run")
        else:
            self.hazard("refill-race", op, f"refills {stage.name} while {' and '.join(racing)} may still run "
                        f"({agent.name} has not been told they are done)")

    def _write(self, agent: _Agent, op: Operation, stage: _Stage, offset: int, write: _Write) -> None:
        self._check_refill(agent, op, stage, offset)
        stage.writes[offset] = write

    def _memcpy(self, agent: _Agent, op: tgt.MemcpyOp) -> None:
        """cp.async: a copy in the agent's open group; ld.global: done at once in each thread."""
        stage = self._stage(op.dst, op.dst_indices[0], op)
        mechanism = op.mechanism.data
        if mechanism == "cp.async":
            write = _Write(op, mechanism, agent, agent.cp_commits + 1)
        else:
            agent.own["ld"] += 1
            write = _Write(op, "ld.global", agent, agent.own["ld"])
        self._write(agent, op, stage, op.rows[0] if op.rows else 0, write)   # (copies of a stage's rows apart)

    def _store_shared(self, agent: _Agent, op: Operation) -> None:
        """The threads' stores of a register tile into a stage (dS^T for an across sum's mma): done
        at once in each thread, so readers need a barrier after it, and a wgmma (the async proxy)
        also a `fence kind = "async_shared"` before that barrier."""
        self._threads_store(agent, op, self._stage(op.dst, op.stage, op))

    def _threads_store(self, agent: _Agent, op: Operation, stage: _Stage) -> None:
        self.read_registers(agent, op, (op.value,))
        agent.own["st"] += 1
        self._write(agent, op, stage, 0, _Write(op, "st.shared", agent, agent.own["st"]))

    def _scratch_stage(self, op: Operation) -> _Stage:
        offset = op.attributes[tgt.SCRATCH].offset.data
        return self.scratch.setdefault(offset, _Stage(f"the scratch buffer at byte {offset}"))

    def _stage_rows(self, agent: _Agent, op: Operation) -> None:
        """The threads' stores of a tile into a scratch buffer (a bulk reduction's source): a
        refill, once an earlier bulk_reduce read it, needs its `bulk_wait read` published."""
        self._threads_store(agent, op, self._scratch_stage(op))

    def _bulk_reduce(self, agent: _Agent, op: Operation) -> None:
        """A bulk reduction reads its scratch buffer through the async proxy until a `bulk_wait`."""
        stage = self._scratch_stage(op)
        self._check_read(agent, op, stage, async_proxy=True)
        agent.bulk_commits += 1
        stage.reads[(agent.name, "bulk")] = agent.bulk_commits

    def _bulk_wait(self, agent: _Agent, op: Operation) -> None:
        agent.own["bulk"] = max(agent.own["bulk"], agent.bulk_commits - op.pending.value.data)

    def _cp_commit(self, agent: _Agent, op: Operation) -> None:
        agent.cp_commits += 1

    def _cp_wait(self, agent: _Agent, op: Operation) -> None:
        agent.own["cp"] = max(agent.own["cp"], agent.cp_commits - op.pending.value.data)

    def _barrier(self, agent: _Agent, op: tgt.BarrierOp) -> None:
        if op.threads is None and agent.name != "block":
            self.hazard("hang", op, f"a block barrier in the {agent.name} region: the other region's threads "
                        f"never reach it")
        elif op.threads is not None and op.threads.value.data != agent.threads:
            self.hazard("barrier-threads", op, f"named barrier for {op.threads.value.data} threads, reached by the "
                        f"{agent.threads} threads of the {agent.name} region")
        agent.publish()
        if op.threads is None:
            for bars in self._groups():
                bars.published = bars.published or bars.fenced

    # mbarriers

    def _groups(self):
        return {id(b.group): b.group for b in self.barriers}.values()

    def _mbarrier_alloc(self, agent: _Agent, op: tgt.MBarrierAllocOp) -> None:
        group = _Barriers(f"mbarriers #{len(self._groups())}")
        group.stages = [_MBarrier(f"{group.name}[{s}]", group) for s in range(op.result.type.count.data)]
        self.barriers += group.stages
        self.env[op.result] = group

    def _mbarrier_init(self, agent: _Agent, op: tgt.MBarrierInitOp) -> None:
        group = self.env[op.barriers]
        group.inited = True
        for bar in group.stages:
            bar.init(op.arrivals.value.data)

    def _fence(self, agent: _Agent, op: tgt.FenceOp) -> None:
        if op.kind.data == "async_shared":
            agent.own["st_fenced"] = agent.own["st"]
        if op.kind.data != "mbarrier_init":
            return
        for group in self._groups():
            group.fenced = group.fenced or group.inited

    def _mbarrier(self, op: Operation, barriers, stage) -> _MBarrier:
        group: _Barriers = self.env[barriers]
        if not group.published and not group.reported:
            group.reported = True
            missing = ("mbarrier_init" if not group.inited else "fence kind = \"mbarrier_init\"" if not group.fenced
                       else "a block barrier after its fence")
            self.hazard("mbarrier-init", op, f"uses {group.name} before {missing}")
        return group.stages[self.scalar(stage, op)]

    def _arrive(self, agent: _Agent, op: Operation, bar: _MBarrier, count: int, nbytes: int, whole: bool):
        bar.settle()
        if count > bar.pending:
            self.hazard("arrive-count", op, f"{count} arrival(s) on {bar.name}, whose phase {bar.completed} has "
                        f"{bar.pending} of its {bar.arrivals} left (mbarrier_init arrivals = {bar.arrivals})")
            count = bar.pending
        bar.pending -= count
        bar.expect += nbytes
        self._check_bytes(op, bar)
        _merge(bar.release, agent.release(whole))
        yield None   # a scheduling point: a waiting agent may go on now

    def _arrive_expect_tx(self, agent: _Agent, op: tgt.MBarrierArriveExpectTxOp):
        """One arrival (the issuing thread's), N bytes expected."""
        bar = self._mbarrier(op, op.barriers, op.stage)
        yield from self._arrive(agent, op, bar, 1, op.bytes.value.data, agent.threads == 1)

    def _mbarrier_arrive(self, agent: _Agent, op: tgt.MBarrierArriveOp):
        """Each thread's or warp's arrival; a cluster arrival is the cluster's blocks' (they run
        alike: each block arrives where this one does), one each, by the issuing thread."""
        bar = self._mbarrier(op, op.barriers, op.stage)
        per = op.per.data
        if per == "cluster":
            yield from self._arrive(agent, op, bar, self.kernel.cluster.value.data, 0, False)
            return
        count = agent.warps if per == "warp" else agent.threads
        yield from self._arrive(agent, op, bar, count, 0, True)

    def _check_bytes(self, op: Operation, bar: _MBarrier) -> None:
        if bar.pending == 0 and bar.tx > bar.expect:
            self.hazard("tx-bytes", op, f"copies of {bar.tx} bytes complete on phase {bar.completed} of {bar.name}, "
                        f"which expects {bar.expect} (mbarrier_arrive_expect_tx bytes)")

    def _tma_load(self, agent: _Agent, op: tgt.TmaLoadOp) -> None:
        """A box into the stage; a multicast copy's boxes from every block of the cluster (they run
        alike: each block issues its box where this one does)."""
        bar = self._mbarrier(op, op.barriers, op.barrier_stage)
        stage = self._stage(op.dst, op.stage, op)
        box = op.tensor_map.type.box_bytes
        write = _Write(op, "tma", agent, bar.completed, bar)
        for k in range(op.copies):
            self._write(agent, op, stage, op.offset.value.data + k * box, write)
        bar.tx += box * op.copies
        bar.last_copy = write
        self._check_bytes(op, bar)

    def _try_wait(self, agent: _Agent, op: tgt.MBarrierTryWaitOp):
        """PTX try_wait.parity: returns at once when the current phase's parity is not p (the phase
        before it, of parity p, is complete), else once the current phase completes."""
        bar = self._mbarrier(op, op.barriers, op.stage)
        parity = self.scalar(op.parity, op)
        if parity not in (0, 1):
            self.hazard("wrong-phase", op, f"parity {parity} is neither 0 nor 1")
            parity &= 1
        known = agent.known.get(("tma", bar), 0)
        bar.settle()
        phase = bar.completed
        if phase % 2 != parity:
            phase -= 1
        else:
            yield _Wait(op, bar, phase, known, parity)
        if phase >= 0:
            _merge(agent.known, bar.cum[phase])
        stale = op if phase < known else None
        agent.waits[bar] = agent.stale_wait = stale

    def _hang(self, wait: _Wait) -> None:
        bar, op = wait.bar, wait.op
        state = (f"{bar.arrivals - bar.pending} of {bar.arrivals} arrivals, {bar.tx} of {bar.expect} expected "
                 f"bytes")
        if wait.parity != wait.known % 2:
            self.hazard("wrong-phase", op, f"parity {wait.parity} waits for phase {wait.phase} of {bar.name}, but the "
                        f"phase the waiter needs next is {wait.known} (parity {wait.known % 2}); phase "
                        f"{wait.phase} never completes ({state})")
        elif bar.pending == 0 and bar.tx != bar.expect:
            self.hazard("tx-bytes", op, f"waits forever for phase {wait.phase} of {bar.name}: {state}")
        elif 0 < bar.pending < bar.arrivals:
            self.hazard("arrive-count", op, f"waits forever for phase {wait.phase} of {bar.name}: {state} "
                        f"(mbarrier_init arrivals = {bar.arrivals})")
        else:
            self.hazard("hang", op, f"waits forever for phase {wait.phase} of {bar.name}, which no agent "
                        f"completes ({state})")

    def _check_exit(self) -> None:
        """Every TMA copy's phase must be known complete to some agent when the block exits, and
        every bulk reduction's read of shared memory waited for."""
        for agent in self.agents:
            if agent.own["bulk"] < agent.bulk_commits:
                last = next(op for op in self.kernel.walk() if op.name == "tessera_target.bulk_reduce")
                self.hazard("in-flight-at-exit", last, f"{agent.bulk_commits - agent.own['bulk']} bulk "
                            f"reductions still read shared memory when the block exits: no bulk_wait for them")
        for bar in self.barriers:
            w = bar.last_copy
            if w is not None and all(a.known.get(("tma", bar), 0) <= w.seq for a in self.agents):
                self.hazard("in-flight-at-exit", w.op, f"its copy into {bar.name}'s phase {w.seq} is still in "
                            f"flight when the block exits: no agent waits for it")

    # wgmma

    def _tensor_core(self, agent: _Agent, op: tgt.TensorCoreOp) -> None:
        """wgmma: reads its shared operands and registers, writes its accumulator, until retired."""
        if not _is_wgmma(op):
            self.read_registers(agent, op, op.operands)
            return self.write_registers(op.results)
        group = agent.wg_commits + 1
        if agent.fence_at < 0:
            self.hazard("wgmma-fence", op, f"no wgmma_fence in the {agent.name} before its first wgmma")
        for role, value in (("A", op.a), ("B", op.b), ("accumulator", op.acc)):
            m = self.env[value]
            if m[0] == "sh":
                self._check_read(agent, op, m[1], async_proxy=True)
                m[1].reads[(agent.name, "wgmma")] = group
            elif m[0] == "wg" and role != "accumulator":
                self._read_accumulator(agent, op, m)
            elif m[0] == "reg" and m[1] > agent.fence_at >= 0:
                self.hazard("wgmma-fence", op, f"its {role} registers were written after the last wgmma_fence")
            if m[0] != "sh" and isinstance(value, BlockArgument):
                agent.wgmma_reads[value] = (group, op)
        self.env[op.result] = ("wg", agent, group, op)

    def _read_accumulator(self, agent: _Agent, op: Operation, marker) -> None:
        _, owner, group, mma = marker
        if owner is agent and agent.own["wgmma"] < group:
            self.hazard("read-before-wait", op, f"reads the accumulator of the wgmma of group {group} before a "
                        f"wgmma_wait retires it ({agent.wg_commits} committed, {agent.own['wgmma']} retired)")

    def _wgmma_fence(self, agent: _Agent, op: Operation) -> None:
        self.clock += 1
        agent.fence_at = self.clock

    def _wgmma_commit(self, agent: _Agent, op: Operation) -> None:
        agent.wg_commits += 1

    def _wgmma_wait(self, agent: _Agent, op: Operation) -> None:
        agent.own["wgmma"] = max(agent.own["wgmma"], agent.wg_commits - op.pending.value.data)


def _is_wgmma(op: Operation) -> bool:
    return isinstance(op, tgt.TensorCoreOp) and op.family.data == "wgmma"


#: a stage's asynchronous readers (`_Stage.reads`' streams) as the checker's messages name them
_READS = {"wgmma": "wgmma", "bulk": "bulk reduction"}


def _nothing(run: _Run, agent: _Agent, op: Operation) -> None:
    """Ops with no effect on the async protocol (setmaxnreg, return)."""


#: ops that never wait: op name -> handler(run, agent, op)
_STEPS = {
    "tile.program_id": _Run._program_id,
    "tile.dim": _Run._dim,
    "tile.load_index": _Run._load_index,
    "tile.load_index_reduce": _Run._load_index,
    "tessera_target.allocate": _Run._allocate,
    "tessera_target.memcpy": _Run._memcpy,
    "tile.store_shared": _Run._store_shared,
    "tessera_target.stage_rows": _Run._stage_rows,
    "tessera_target.bulk_reduce": _Run._bulk_reduce,
    "tessera_target.bulk_wait": _Run._bulk_wait,
    "tessera_target.cp_async_commit": _Run._cp_commit,
    "tessera_target.cp_async_wait": _Run._cp_wait,
    "tessera_target.barrier": _Run._barrier,
    "tessera_target.mbarrier_alloc": _Run._mbarrier_alloc,
    "tessera_target.mbarrier_init": _Run._mbarrier_init,
    "tessera_target.fence": _Run._fence,
    "tessera_target.tma_load": _Run._tma_load,
    "tessera_target.wgmma_descriptor": _Run._wgmma_descriptor,
    "tessera_target.tensor_core": _Run._tensor_core,
    "tessera_target.wgmma_fence": _Run._wgmma_fence,
    "tessera_target.wgmma_commit": _Run._wgmma_commit,
    "tessera_target.wgmma_wait": _Run._wgmma_wait,
    "tessera_target.setmaxnreg": _nothing,
    "tessera_target.return": _nothing,
}

#: ops that may wait or hand control to another agent: op name -> generator(run, agent, op)
_FLOWS = {
    "scf.for": _Run._for,
    "scf.if": _Run._if,
    "tessera_target.warp_specialize": _Run._warp_specialize,
    "tessera_target.mbarrier_arrive_expect_tx": _Run._arrive_expect_tx,
    "tessera_target.mbarrier_arrive": _Run._mbarrier_arrive,
    "tessera_target.mbarrier_try_wait": _Run._try_wait,
}

_SCALAR_OPS = {*_BINARY, *_UNSIGNED, *_CASTS, "arith.constant", "arith.cmpi", "arith.select"}


def _compile(op: Operation):
    """(step, flow): a closure step(run, agent) for an op that never waits, else a generator
    flow(run, agent). Scalar arith and register ops, most of what runs, get closures holding
    their operands, so the interpreter does not look properties up every iteration."""
    if op.name in _FLOWS:
        flow = _FLOWS[op.name]
        return None, lambda run, agent: flow(run, agent, op)
    if op.name == "tile.load_shared":
        synchronous = any(not _is_wgmma(use.operation) for use in op.result.uses)
        return (lambda run, agent: run._load_shared(agent, op, synchronous)), None
    if op.name in _STEPS:
        step = _STEPS[op.name]
        return (lambda run, agent: step(run, agent, op)), None
    return (_scalar_step(op) if op.name in _SCALAR_OPS else None) or _register_step(op), None


def _computes_in_registers(branch: Operation) -> bool:
    """Whether every op of an `scf.if`'s regions only reads and writes registers (`_register_step`,
    scalar arith): a branch on a value read at run time, such as an attention's scale's sign
    choosing the row min or max (`schedule_to_tile._SignedScale`), where the checker takes either
    side for both: they wait for, copy and release nothing."""
    return all(inner.name == "scf.yield" or (inner.name not in _FLOWS and inner.name not in _STEPS
                                             and inner.name != "tile.load_shared")
               for region in branch.regions for inner in region.walk())


def _register_step(op: Operation):
    """Any op on tiles or floats: reads its operands' registers, writes its results'."""
    operands, results = tuple(op.operands), tuple(op.results)

    def step(run: _Run, agent: _Agent) -> None:
        run.read_registers(agent, op, operands)
        run.write_registers(results)
    return step


def _scalar_step(op: Operation):
    """arith on integer scalars, evaluated (on tiles, or a non-integer constant: None)."""
    bits = _width(op.results[0].type)
    result, operands = op.results[0], tuple(op.operands)
    if bits is None or (op.name == "arith.constant" and not isinstance(op.value, builtin.IntegerAttr)):
        return None
    if op.name == "arith.constant":
        value = _wrap(op.value.value.data, bits)
        return lambda run, agent: run.env.__setitem__(result, value)
    if op.name == "arith.cmpi":
        predicate, width = op.predicate.value.data, _width(op.operands[0].type)
        fn = lambda a, b: _compare(predicate, a, b, width)   # noqa: E731
    elif op.name == "arith.select":
        fn = lambda c, a, b: a if c else b                   # noqa: E731
    elif op.name in ("arith.extui", "arith.index_castui"):
        mask = (1 << _width(op.operands[0].type)) - 1
        fn = lambda a: a & mask                              # noqa: E731
    elif op.name in _CASTS:
        fn = lambda a: a                                     # noqa: E731
    elif op.name in _UNSIGNED:
        unsigned, mask = _UNSIGNED[op.name], (1 << bits) - 1
        fn = lambda a, b: unsigned(a & mask, b & mask)       # noqa: E731
    else:
        fn = _BINARY[op.name]
    fallback = _register_step(op)

    def step(run: _Run, agent: _Agent) -> None:
        values = [run.env.get(v) for v in operands]
        if all(type(v) is int for v in values):
            run.env[result] = _wrap(fn(*values), bits)
        else:
            fallback(run, agent)
    return step


#: ops one of which a kernel needs to have anything to check: shared memory or async matrix ops
_ASYNC_OPS = {"tile.load_shared", "tessera_target.memcpy", "tessera_target.tma_load", "tessera_target.mbarrier_alloc",
              "tessera_target.tensor_core"}


# --- entry points ----------------------------------------------------------------------------


def dim_size(kernel: tgt.KernelOp, arg: int, sample: int) -> int:
    """The size kernel argument `arg`'s dynamic dim takes in run `sample` of `DIM_SAMPLES`: dims of
    different names take different samples (a cross-attention's query and key lengths are not
    checked only equal), buffers of one name the same."""
    names = kernel.attributes.get(tile.BUFFER_DIMS)
    listed = [a.data for a in names.data] if names is not None else []
    name = listed[arg] if arg < len(listed) and listed[arg] else f"arg{arg}"
    distinct = sorted(set(n for n in listed if n) | {name})
    return DIM_SAMPLES[(sample + distinct.index(name)) % len(DIM_SAMPLES)]


def program_ids(kernel: tgt.KernelOp, dim_sample: int = 0) -> list[tuple[int, ...]]:
    """The blocks a kernel is checked for: the first three, the middle one and the last three along
    every grid axis at once. Blocks differ in trip counts (a causal attention's query block sees
    more key blocks the later it is, a persistent GEMM's last blocks take fewer tiles), and so in
    which stages end armed: three neighbours catch trip counts one apart even where two blocks
    share one (64-row query blocks over 128-key blocks), the middle one the common case. An axis
    growing with a dynamic dim (`tessera_target.grid_dims`) is as long as run `dim_sample`'s size of
    the dim makes it (`dim_size`)."""
    grid = list(kernel.config.grid_dims)
    for axis, arg, _, block in tile.grid_terms(kernel.attributes.get(tgt.GRID_DIMS)):
        grid[axis] *= -(-dim_size(kernel, arg, dim_sample) // block)
    picks = (lambda g: 0, lambda g: min(1, g - 1), lambda g: min(2, g - 1), lambda g: g // 2,
             lambda g: max(g - 3, 0), lambda g: max(g - 2, 0), lambda g: g - 1)
    return list(dict.fromkeys(tuple(pick(g) for g in grid) for pick in picks))


def check_kernel(kernel: tgt.KernelOp) -> list[Hazard]:
    """The hazards of one Target IR kernel (each (kind, op) once, from the first block showing it)."""
    if not any(op.name in _ASYNC_OPS for op in kernel.walk()):
        return []
    found: dict[tuple[str, int], Hazard] = {}

    def report(kind: str, op: Operation, message: str, pid: tuple[int, ...]) -> None:
        found.setdefault((kind, id(op)), Hazard(kind, kernel.sym_name.data, op, message, pid))

    plans: dict = {}   # block -> its ops' handlers, shared by the blocks' runs
    reads_indices = any(isinstance(op, tile.INDEX_READS) for op in kernel.walk())
    dynamic = tgt.GRID_DIMS in kernel.attributes or any(isinstance(op, tile.DimOp) for op in kernel.walk())
    for sample in range(len(DIM_SAMPLES)) if dynamic else (0,):
        for value in INDEX_SAMPLES if reads_indices else (0,):
            for pid in program_ids(kernel, sample):
                _Run(kernel, pid, report, plans, value, sample).run()
    return list(found.values())


#: what a kernel's tile.load_index(_reduce) ops read in its checked runs (one run per value and block): the
#: data a loop bound comes from (a sequence's length) is no number at compile time, so each block
#: runs with none, one, a few blocks' worth and more than every extent (a loop then runs its
#: whole static trip count; a page table's entry then names no page)
INDEX_SAMPLES = (0, 1, 200, 2 ** 20)

#: the sizes a kernel's dynamic dims (`tile.dim`) take in its checked runs: the least (2), a block
#: and a tail, several blocks of any tile up to 256 rows and a tail, and enough keys that a split
#: attention's runs hold several blocks each (a split over 1000 keys gives each one block at most)
DIM_SAMPLES = (2, 70, 1000, 3001)


def check_async(module: builtin.ModuleOp) -> list[Hazard]:
    """Every async hazard of every tessera_target.kernel of `module`, each with the op's line in
    the module as Tessera prints it and that line's text."""
    hazards = [h for op in module.walk() if isinstance(op, tgt.KernelOp) for h in check_kernel(op)]
    if not hazards:
        return []
    lines, text = _op_lines(module)
    located = [Hazard(h.kind, h.kernel, h.op, h.message, h.block, lines.get(h.op), text[lines[h.op] - 1].strip()
                      if h.op in lines else h.op.name) for h in hazards]
    return sorted(located, key=lambda h: h.line or 0)


class _LinePrinter(Printer):
    """A Printer that notes the line each op starts on."""

    def __init__(self, stream):
        super().__init__(stream=stream)
        self.lines: dict[Operation, int] = {}

    def print_op(self, op: Operation) -> None:
        self.lines[op] = self._current_line + 1
        super().print_op(op)


def _op_lines(module: builtin.ModuleOp) -> tuple[dict[Operation, int], list[str]]:
    out = io.StringIO()
    printer = _LinePrinter(out)
    printer.print_op(module)
    return printer.lines, out.getvalue().splitlines()


class AsyncHazardError(TesseraError):
    """Hazards found by `require_no_hazards`: a summary line, then each hazard."""

    def __init__(self, hazards: list[Hazard], location: str | None = None):
        self.hazards = hazards
        kinds = ", ".join(sorted({h.kind for h in hazards}))
        super().__init__(f"check-async: {len(hazards)} async hazard(s) ({kinds})\n" + "\n".join(map(str, hazards)),
                         location)


def require_no_hazards(module: builtin.ModuleOp, location: str | None = None) -> None:
    """Raises AsyncHazardError naming every hazard of `module` (the target stage's TESSERA_CHECK_ASYNC hook)."""
    hazards = check_async(module)
    if hazards:
        raise AsyncHazardError(hazards, location)


def opt_pass(module: builtin.ModuleOp, args: argparse.Namespace | None = None) -> builtin.ModuleOp:
    """`tessera opt --passes=check-async`: each hazard on stderr, then the failure; a clean module passes on.
    (The CLI prints an error's first line only, so the hazards are printed here.)"""
    try:
        require_no_hazards(module, "")
    except AsyncHazardError as err:
        for h in err.hazards:
            print(h, file=sys.stderr)
        raise
    return module
