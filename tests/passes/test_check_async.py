"""The async-hazard checker (`tessera.passes.check_async`) on the kernels Tessera compiles.

1. Every real kernel is clean: GEMM (pipelined, warp-specialized, one stage, persistent, without
   mma_async) and attention (plain, causal, warp-specialized, scores ahead, one stage), on the
   Hopper-native path (TMA + mbarriers + wgmma) and the Ampere path (cp.async + mma.sync).
2. Mutation tests: each synchronization op of each kernel deleted in turn, and each perturbed (a
   try_wait's parity flipped through a new `arith.subi 1, %p`, a wait's pending count moved by one,
   an init's arrivals, an expect_tx's bytes, an arrive's `per`). `expected` says which mutants are
   real hazards; every harmless one is harmless for a reason it names, and the checker must agree
   on every mutant.
3. `tessera opt FILE --passes=check-async`, and the TESSERA_CHECK_ASYNC hook of the target stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import IntegerAttr, StringAttr, i32, i64

import tessera as tsr
from tessera import Tensor
from tessera import cli
from tessera.errors import TesseraError
from tessera.ir import print_ir
from tessera.ir import target as tgt
from tessera.passes.check_async import KINDS, check_async, check_kernel

from attention_cases import causal_temperature, temperature
from seed_kernels import causal_attention, flash_attention


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]) -> Tensor["M", "N"]:
    return tsr.matmul(a, b)


@dataclass(frozen=True)
class Case:
    fn: object
    dims: dict
    space: dict
    path: str = "native"


GEMM, ATTN = dict(M=256, K=384, N=256), dict(B=1, H=1, S=640, D=64)
CASES = {
    "gemm": Case(gemm, GEMM, {}),
    "gemm-ampere": Case(gemm, GEMM, {}, "ampere"),
    "gemm-ws": Case(gemm, GEMM, {"warp_specialize": [1], "block_m": [128], "block_n": [256]}),   # two consumer warpgroups
    "gemm-1stage": Case(gemm, GEMM, {"num_stages": [1]}),
    "gemm-1stage-ampere": Case(gemm, GEMM, {"num_stages": [1]}, "ampere"),
    "gemm-sync-mma": Case(gemm, GEMM, {"mma_async": [0]}),
    "gemm-persistent": Case(gemm, dict(M=512, K=384, N=512), {"persistent": [1], "programs": [3]}),
    "gemm-persistent-ampere": Case(gemm, dict(M=512, K=384, N=512), {"persistent": [1], "programs": [3]}, "ampere"),
    "attn": Case(flash_attention, ATTN, {}),
    "attn-ampere": Case(flash_attention, ATTN, {}, "ampere"),
    "causal": Case(causal_attention, ATTN, {}),
    "causal-ampere": Case(causal_attention, ATTN, {}, "ampere"),
    "attn-ws": Case(flash_attention, ATTN, {"warp_specialize": [1], "num_stages": [3]}),
    "causal-ws": Case(causal_attention, ATTN, {"warp_specialize": [1], "num_stages": [3]}),
    "attn-ahead": Case(flash_attention, ATTN, {"qk_ahead": [1], "num_stages": [3]}),
    "causal-ahead-ampere": Case(causal_attention, ATTN, {"qk_ahead": [1], "num_stages": [3]}, "ampere"),
    "causal-ahead-ws": Case(causal_attention, ATTN, {"qk_ahead": [1], "num_stages": [3], "warp_specialize": [1]}),
    # the Hopper default at D = 128: keys and values two stages each, 128 keys a block, a producer warpgroup
    "causal-ahead-ws-d128": Case(causal_attention, dict(B=1, H=1, S=640, D=128),
                                 {"qk_ahead": [1], "num_stages": [2], "warp_specialize": [1], "block_n": [128]}),
    # persistent: 3 blocks walking 5 (10) query tiles, the pipelines' steps counting across them
    "attn-ahead-walk": Case(flash_attention, ATTN, {"qk_ahead": [1], "num_stages": [3], "persistent": [1],
                                                    "programs": [3]}),
    "attn-ahead-walk-ampere": Case(flash_attention, ATTN, {"qk_ahead": [1], "num_stages": [3], "persistent": [1],
                                                           "programs": [3]}, "ampere"),
    "attn-walk": Case(flash_attention, ATTN, {"num_stages": [3], "persistent": [1], "programs": [3]}),
    "attn-walk-ampere": Case(flash_attention, ATTN, {"num_stages": [3], "persistent": [1], "programs": [3]},
                             "ampere"),
    "attn-ws-walk": Case(flash_attention, dict(B=2, H=1, S=640, D=128),
                         {"num_stages": [2], "warp_specialize": [1], "persistent": [1], "programs": [3]}),
    "attn-ws-walk-turns": Case(flash_attention, dict(B=2, H=1, S=640, D=128),
                               {"num_stages": [2], "warp_specialize": [1], "persistent": [1], "programs": [3],
                                "pingpong": [1], "num_warps": [8], "block_m": [128]}),
    "attn-ahead-ws-d128-walk": Case(flash_attention, dict(B=2, H=1, S=640, D=128),
                                    {"qk_ahead": [1], "num_stages": [2], "warp_specialize": [1], "block_n": [128],
                                     "persistent": [1], "programs": [3]}),
    # ... and causal: each tile its own count of key blocks, heaviest first, odd rounds reversed
    "causal-walk": Case(causal_attention, ATTN, {"num_stages": [3], "persistent": [1], "programs": [3]}),
    "causal-ahead-walk-ampere": Case(causal_attention, ATTN, {"qk_ahead": [1], "num_stages": [2], "persistent": [1],
                                                              "programs": [3]}, "ampere"),
    "causal-ahead-ws-d128-walk": Case(causal_attention, dict(B=2, H=1, S=640, D=128),
                                      {"qk_ahead": [1], "num_stages": [2], "warp_specialize": [1], "block_n": [128],
                                       "persistent": [1], "programs": [3]}),
    # a scale read at run time: a uniform branch on its sign inside the loop (the row min or max)
    "temperature-ws-walk-turns": Case(temperature, dict(B=2, H=1, S=640, D=128),
                                      {"num_stages": [2], "warp_specialize": [1], "persistent": [1], "programs": [3],
                                       "pingpong": [1], "num_warps": [8], "block_m": [128]}),
    "causal-temperature-ampere": Case(causal_temperature, ATTN, {"num_stages": [3]}, "ampere"),
    "attn-1stage": Case(flash_attention, ATTN, {"num_stages": [1]}),
    "attn-1stage-ampere": Case(flash_attention, ATTN, {"num_stages": [1]}, "ampere"),
}


@dataclass
class Compiled:
    module: object
    params: dict          # the schedule kernel's params
    kernel: tgt.KernelOp

    @property
    def specialized(self) -> bool:
        return any(isinstance(op, tgt.WarpSpecializeOp) for op in self.kernel.walk())


_COMPILED: dict[str, Compiled] = {}


def compiled(name: str) -> Compiled:
    """Case `name` compiled to Target IR (once per session); its one kernel and schedule params
    (an attention's keys not split across blocks: that makes two kernels)."""
    if name not in _COMPILED:
        case = CASES[name]
        c = case.fn.compile(case.fn.arg_specs_for(case.dims, "fp16"), arch="sm_90a", path=case.path,
                            space={"split_kv": [1], **(case.space or {})})
        (sk,) = [op for op in c.modules["schedule"].walk() if op.name == "schedule.kernel"]
        params = {k: v.value.data for k, v in sk.params.data.items()}
        (kernel,) = [op for op in c.modules["target"].ops if isinstance(op, tgt.KernelOp)]
        _COMPILED[name] = Compiled(c.modules["target"], params, kernel)
    return _COMPILED[name]


# --- 1. real kernels are clean ------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_real_kernels_have_no_hazard(name):
    c = compiled(name)
    wanted = "wgmma" if CASES[name].path == "native" else "mma.sync"
    assert f'"{wanted}"' in print_ir(c.kernel), f"{name} is not on the path it is meant to test"
    assert c.specialized == bool(CASES[name].space.get("warp_specialize")) or CASES[name].path == "ampere"
    if "persistent" in name:
        assert math.prod(c.kernel.config.grid_dims) == 3, "a persistent GEMM walks its 8 tiles on 3 blocks"
    assert check_async(c.module) == []


# --- 2. mutations ---------------------------------------------------------------------------------

SYNC_OPS = ("mbarrier_init", "fence", "barrier", "mbarrier_arrive_expect_tx", "mbarrier_arrive", "mbarrier_try_wait",
            "cp_async_commit", "cp_async_wait", "wgmma_fence", "wgmma_commit", "wgmma_wait")
SYNC_NAMES = {f"tessera_target.{n}" for n in SYNC_OPS}


def sync_ops(module) -> list:
    return [op for op in module.walk() if op.name in SYNC_NAMES]


def _short(op) -> str:
    return op.name.removeprefix("tessera_target.")


def mutations(module) -> list[tuple[int, str]]:
    """(index of the sync op, mutation) for every mutant of `module`."""
    out = []
    for i, op in enumerate(sync_ops(module)):
        out.append((i, "delete"))
        name = _short(op)
        if name == "mbarrier_try_wait":
            out.append((i, "flip parity"))
        elif name in ("wgmma_wait", "cp_async_wait"):
            out += [(i, "pending+1")] + ([(i, "pending-1")] if op.pending.value.data else [])
        elif name == "mbarrier_init":
            out += [(i, "arrivals+1")] + ([(i, "arrivals-1")] if op.arrivals.value.data > 1 else [])
        elif name == "mbarrier_arrive_expect_tx":
            out += [(i, "bytes+16"), (i, "bytes-16")]
        elif name == "mbarrier_arrive":
            out.append((i, "per thread"))
    return out


def mutate(module, index: int, mutation: str):
    """A copy of `module` with sync op `index` mutated."""
    m = module.clone()
    op = sync_ops(m)[index]
    if mutation == "delete":
        op.detach()
        op.erase()
    elif mutation == "flip parity":
        one = arith.ConstantOp(IntegerAttr(1, i32))
        flipped = arith.SubiOp(one.result, op.parity)
        op.parent_block().insert_ops_before([one, flipped], op)
        op.operands[2] = flipped.result
    elif mutation.startswith(("pending", "arrivals", "bytes")):
        prop = mutation.rstrip("+-0123456789")
        delta = int(mutation[len(prop):])
        op.properties[prop] = IntegerAttr(op.properties[prop].value.data + delta, i64)
    elif mutation == "per thread":
        op.per = StringAttr("thread")
    else:
        raise ValueError(mutation)
    return m


# Which mutants are real hazards. A sync op guards something only where it runs and nothing else
# guards the same thing; the exceptions below say what else does, or why the op never runs.

def _loop_of(op):
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, scf.ForOp):
        parent = parent.parent_op()
    return parent


def _is_drain(op) -> bool:
    """A wait for the copies still in flight when the pipelined loops are done: a try_wait on a
    constant stage, in an scf.if outside every loop."""
    return (isinstance(op, tgt.MBarrierTryWaitOp) and isinstance(op.parent_op(), scf.IfOp)
            and _loop_of(op) is None and isinstance(op.stage.owner, arith.ConstantOp))


def _walk(name: str, c: Compiled) -> list[list[int]] | None:
    """The key blocks of each query tile each block of a persistent attention walks, or None where
    each block takes one. Block b takes tile b + u * blocks in round u; a causal walk takes them in
    reverse in odd rounds (blocks - 1 - b), each head's last query block (the most keys) first, or
    with `heavy_first` every head's last query block first."""
    dims, p = CASES[name].dims, c.params
    if CASES[name].fn is gemm or not p.get("persistent"):
        return None
    query_blocks = math.ceil(dims["S"] / p["block_m"])
    tiles = query_blocks * dims["B"] * dims["H"]
    blocks = math.prod(c.kernel.config.grid_dims)
    if blocks >= tiles:
        return None
    causal = CASES[name].fn is causal_attention

    def key_blocks(index: int) -> int:
        if not causal:
            return math.ceil(dims["S"] / p["block_n"])
        heads = dims["B"] * dims["H"]
        q = query_blocks - 1 - (index // heads if p.get("heavy_first") else index % query_blocks)
        return math.ceil(min(dims["S"], (q + 1) * p["block_m"]) / p["block_n"])
    lanes = [[b if u % 2 == 0 or not causal else blocks - 1 - b for u in range(math.ceil(tiles / blocks))]
             for b in range(blocks)]
    return [[key_blocks(u * blocks + lane) for u, lane in enumerate(walk) if u * blocks + lane < tiles]
            for walk in lanes]


def _walked_tiles(name: str, c: Compiled) -> list[int] | None:
    """The query tiles each block of a persistent attention walks, or None where each block takes one."""
    walk = _walk(name, c)
    return None if walk is None else [len(tiles) for tiles in walk]


def _steps_per_block(name: str, c: Compiled) -> set[int]:
    """The pipeline steps a block reads (its main loop's trip count), over every block of the grid.
    A GEMM with fewer blocks than output tiles is persistent: block b takes tiles b, b + blocks, ...,
    and its steps count on across them; so do an attention's walking query tiles."""
    dims, p = CASES[name].dims, c.params
    if CASES[name].fn is gemm:
        k_steps = math.ceil(dims["K"] / p["block_k"])
        tiles = math.ceil(dims["M"] / p["block_m"]) * math.ceil(dims["N"] / p["block_n"])
        blocks = math.prod(c.kernel.config.grid_dims)
        return {math.ceil((tiles - b) / blocks) * k_steps for b in range(blocks)}
    if (walk := _walk(name, c)) is not None:
        return {sum(tiles) for tiles in walk}
    if CASES[name].fn is causal_attention:   # query block q sees the key blocks up to its diagonal
        return {math.ceil(min(dims["S"], (q + 1) * p["block_m"]) / p["block_n"])
                for q in range(math.ceil(dims["S"] / p["block_m"]))}
    return {math.ceil(dims["S"] / p["block_n"])}


def _unread_stages(name: str, c: Compiled, pipe: str) -> set[int]:
    """Stages of the main loop's pipeline `pipe` holding a fill no step waits for, in some block.
    A pipeline of S stages reading n steps issues steps up to n + S - 2 (S - 1 ahead of the last).
    With scores ahead, keys and values are pipelines of their own: the keys are issued as far, the
    values one step less (up to n + S - 3). A walk copies the Q of the tile after its last, and
    with the scores ahead its last tile, done with the stages, the next tile's next key and
    value blocks (one step more of each)."""
    stages = c.params["num_stages"]
    if pipe == "q":
        return {n % 2 for n in _walked_tiles(name, c)}
    if stages == 1:
        return set()   # copy, wait, compute: nothing is issued ahead
    ahead = (-1 if pipe == "v" else 1 if _walked_tiles(name, c) is not None else 0) if c.params.get("qk_ahead") else 0
    if pipe == "v" and _walked_tiles(name, c) is not None:
        ahead = 0
    return {step % stages for n in _steps_per_block(name, c) for step in range(n, n + stages - 1 + ahead)}


def _loop_pipes(name: str, c: Compiled) -> dict:
    """The "full" mbarrier groups of the main loop's pipelines (those its TMA copies complete, of
    num_stages stages: not a resident tile's), by the operands they stage: "k" and "v" with scores
    ahead, else "kv" ("a" and "b" for a GEMM); a walk's two stages of Q ("q") come first."""
    filled = {op.barriers for op in c.kernel.walk() if isinstance(op, tgt.TmaLoadOp)}
    groups = [op.results[0] for op in c.kernel.walk()
              if isinstance(op, tgt.MBarrierAllocOp) and op.results[0] in filled]
    walked = _walked_tiles(name, c) is not None
    pipes = [g for i, g in enumerate(groups) if g.type.count.data == c.params["num_stages"] or (walked and i == 0)]
    names = ["q"] * walked + (["k", "v"] if c.params.get("qk_ahead") else ["kv"])
    return dict(zip(pipes, names)) if CASES[name].fn is not gemm else dict(zip(pipes, ["ab"]))


def _drain_verdict(name: str, c: Compiled, op, mutation: str) -> bool | str:
    """Deleting or flipping a drain wait is a hazard iff it waits for a fill no step read (copies
    in flight at exit). A warp-specialized producer drains every stage it filled; deleting its wait
    for a fill the consumers read is harmless, but a flipped one waits for a phase that never comes."""
    stage = op.stage.owner.value.value.data
    pipes = _loop_pipes(name, c)
    if (op.barriers not in pipes or stage not in _unread_stages(name, c, pipes[op.barriers])):
        if c.specialized and mutation == "flip parity":
            return True
        return ("the drain of a stage whose last fill a step read: " +
                ("the consumers waited for it" if c.specialized else "its scf.if never runs"))
    return True


def _unused_group(op) -> bool:
    return all(isinstance(use.operation, tgt.MBarrierInitOp) for use in op.barriers.uses)


def _retired_at_loop_end(loop) -> bool:
    """Whether every iteration of `loop` ends with all wgmma groups retired: its body's last
    wgmma_wait waits for all (pending = 0) and no wgmma follows it."""
    ops = list(loop.walk())
    waits = [i for i, o in enumerate(ops) if isinstance(o, tgt.WgmmaWaitOp)]
    mmas = [i for i, o in enumerate(ops) if isinstance(o, tgt.TensorCoreOp) and o.family.data == "wgmma"]
    return bool(waits) and ops[waits[-1]].pending.value.data == 0 and (not mmas or mmas[-1] < waits[-1])


def _walk_exception(name: str, c: Compiled, op, mutation: str) -> str | None:
    """Why a mutant of a walking attention is harmless, if it is: on cp.async with the scores
    ahead, its first group (the first tile's Q) is waited for with the next (the first key block,
    read with it); without, each tile's Q is read into registers once (mma.sync), so the barrier
    before a tile's copy of the Q after the next guards nothing and that copy's group, waited for
    two tiles later, may join the next; warp-specialized, the producer's waits before a tile's last
    P @ V for the value and key stages follow its wait for the Q stage, on which the consumers
    arrive at the same point."""
    if _walked_tiles(name, c) is None:
        return None
    ops = list(c.kernel.walk())
    walks = [o for o in ops if isinstance(o, scf.ForOp) and any(isinstance(i, scf.ForOp) for i in o.body.walk())]
    if c.specialized and _short(op) == "mbarrier_try_wait" and isinstance(op.parent_op(), scf.IfOp):
        starts = [o for w in walks for i in w.body.block.ops if isinstance(i, scf.IfOp)
                  for o in i.true_region.block.ops if _short(o) == "mbarrier_try_wait"]
        if op in starts[1:]:
            return "the producer waited for the Q stage the consumers free at the same point"
    if CASES[name].path != "ampere" or mutation != "delete":
        return None
    if c.params.get("qk_ahead"):
        if op is next(o for o in ops if _short(o) == "cp_async_commit"):
            return "the first tile's Q is waited for with the first key block"
        return None
    body = list(walks[0].body.block.ops)
    after = body[max(i for i, o in enumerate(body) if isinstance(o, scf.ForOp)):]
    if op is next(o for o in after if _short(o) == "barrier"):
        return "a tile's Q is read into registers once: nothing reads its stage after the loop"
    if op is next(o for o in after if _short(o) == "cp_async_commit"):
        return "the Q after the next is waited for two tiles later, with the groups after it"
    return None


def expected(name: str, c: Compiled, op, mutation: str) -> bool | str:
    """True where the mutant is a real hazard, else the reason it is harmless."""
    kind = _short(op)
    if mutation == "pending-1":
        return "waiting for one more group only waits longer"
    if (why := _walk_exception(name, c, op, mutation)) is not None:
        return why
    if kind == "mbarrier_init" and _unused_group(op):
        return "nothing arrives on or waits for this mbarrier group (a free mbarrier of a stage never refilled)"
    if _is_drain(op):
        return _drain_verdict(name, c, op, mutation)
    if (kind == "wgmma_wait" and mutation in ("delete", "pending+1") and isinstance(op.prev_op, scf.ForOp)
            and _retired_at_loop_end(op.prev_op)):
        return "every iteration of the loop before it already ends with all wgmma groups retired"
    return True


def _mutation_matrix(name: str):
    c = compiled(name)
    rows = []
    for index, mutation in mutations(c.module):
        op = sync_ops(c.module)[index]
        verdict = expected(name, c, op, mutation)
        (kernel,) = [k for k in mutate(c.module, index, mutation).ops if isinstance(k, tgt.KernelOp)]
        hazards = check_kernel(kernel)   # check_async without printing the module to locate them
        rows.append((index, _short(op), mutation, verdict, hazards))
    return rows


@pytest.mark.parametrize("name", CASES)
def test_mutants_are_flagged_exactly_when_they_are_hazards(name):
    rows = _mutation_matrix(name)
    wrong = [f"#{i} {op} {mutation}: expected {'a hazard' if verdict is True else 'none (' + verdict + ')'}, got "
             f"{[h.kind for h in hazards] or 'none'}"
             for i, op, mutation, verdict, hazards in rows if (verdict is True) != bool(hazards)]
    assert not wrong, "\n".join(wrong)
    covered = {op for _, op, mutation, _, hazards in rows if mutation == "delete" and hazards}
    wanted = ({"mbarrier_init", "fence", "barrier", "mbarrier_arrive_expect_tx", "mbarrier_try_wait", "wgmma_fence",
               "wgmma_commit", "wgmma_wait"} if CASES[name].path == "native"
              else {"cp_async_commit", "cp_async_wait", "barrier"})
    if compiled(name).specialized:
        wanted.add("mbarrier_arrive")
    assert wanted <= covered, f"no deletion of {wanted - covered} is a hazard in {name}"


def test_a_flipped_parity_is_a_wrong_phase():
    """The consumer's wait on a full mbarrier, parity flipped: it returns at once (the phase before,
    of the other parity, is complete) and the wgmma reads the stage while its copy is in flight,
    or, once the copy landed, waits for a phase no copy will complete."""
    c = compiled("gemm")
    (index, wait), *_ = [(i, op) for i, op in enumerate(sync_ops(c.module))
                         if isinstance(op, tgt.MBarrierTryWaitOp) and _loop_of(op) is not None]
    (h,) = check_async(mutate(c.module, index, "flip parity"))
    assert h.kind == "wrong-phase" and h.text.startswith("tessera_target.mbarrier_try_wait")


def test_hazards_name_their_kind_op_and_line():
    c = compiled("attn-ws")
    arrive = next(i for i, op in enumerate(sync_ops(c.module)) if isinstance(op, tgt.MBarrierArriveOp))
    mutant = mutate(c.module, arrive, "per thread")
    (h, *_) = check_async(mutant)
    assert h.kind == "arrive-count" and h.kind in KINDS
    assert "256 arrival(s)" in h.message and "arrivals = 8" in h.message
    assert print_ir(mutant).splitlines()[h.line - 1].strip() == h.text
    assert str(h).startswith(f"line {h.line}: arrive-count: @{c.kernel.sym_name.data} block [")


def test_a_block_barrier_in_a_warp_specialized_region_hangs():
    c = compiled("gemm-ws")
    m = c.module.clone()
    ws = next(op for op in m.walk() if isinstance(op, tgt.WarpSpecializeOp))
    consumer = ws.consumer.block
    consumer.insert_op_before(tgt.BarrierOp(), consumer.last_op)
    consumer.insert_op_before(tgt.BarrierOp(1, 128), consumer.last_op)
    assert {h.kind for h in check_async(m)} == {"hang", "barrier-threads"}


# --- 3. the command line and the compile hook -------------------------------------------------------


def test_opt_check_async_passes_a_clean_kernel(tmp_path, capsys):
    path = tmp_path / "target.mlir"
    path.write_text(print_ir(compiled("gemm").module))
    assert cli.main(["opt", str(path), "--passes=check-async", "--verify-only"]) == 0


def test_opt_check_async_prints_each_hazard_and_fails(tmp_path, capsys):
    c = compiled("gemm")
    index = next(i for i, op in enumerate(sync_ops(c.module)) if isinstance(op, tgt.BarrierOp) and _loop_of(op))
    path = tmp_path / "target.mlir"
    path.write_text(print_ir(mutate(c.module, index, "delete")))
    assert cli.main(["opt", str(path), "--passes=check-async"]) == 1
    err = capsys.readouterr().err
    assert "refill-race" in err and "tessera_target.tma_load" in err
    assert err.splitlines()[-1].startswith("error: check-async: ")


def test_the_target_stage_checks_when_asked(monkeypatch):
    """TESSERA_CHECK_ASYNC=1 (tests/conftest.py sets it) makes the target stage fail on a hazard."""
    monkeypatch.setenv("TESSERA_CHECK_ASYNC", "1")
    case = CASES["gemm"]
    fresh = case.fn.compile(case.fn.arg_specs_for(case.dims, "fp16"), arch="sm_90a", space={"num_stages": [2]})
    bad = mutate(compiled("gemm").module, 0, "delete")
    monkeypatch.setattr("tessera.lowering.tile_to_target.lower_tile_to_target", lambda *a, **k: bad)
    with pytest.raises(TesseraError, match="mbarrier-init"):
        fresh.stage("target")
