"""The Hopper path's data layout and descriptors, checked without a GPU (tests/gpu runs the kernels)."""
import re

import pytest

from xdsl.dialects import scf

import tessera as tsr
from tessera.ir import target
from tessera import Tensor
from tessera import platforms
from tessera.backends.ptx import emit_module
from tessera.lowering.async_pipelines import RegisterSplit, register_split
from tessera.backends.ptx.hopper import TmaBuffer
from tessera.ir import target as tgt
from tessera.runtime.ptxas import assemble, find_tool

needs_ptxas = pytest.mark.skipif(find_tool("ptxas") is None, reason="ptxas not installed")


def test_tma_buffer_is_boxes_of_128_byte_rows():
    """A [64, 256] f16 tile: four [64, 64] boxes of 8 KB, one after another; a stage is 32 KB."""
    buf = TmaBuffer(offset=0, stages=2, rows=64, cols=256, elem=2)
    assert (buf.box_cols, buf.boxes, buf.box_bytes, buf.stage_bytes, buf.size) == (64, 4, 8192, 32768, 65536)
    assert buf.start(0, 0) == 0
    assert buf.start(0, 48) == 96                  # a k16 step inside a K-major row: +32 bytes each
    assert buf.start(16, 64) == 8192 + 16 * 128    # the second box, 16 rows down
    assert TmaBuffer(0, 1, 8, 64, 2).stage_bytes == 1024   # stages stay on 1024-byte swizzle lines


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    return tsr.matmul(a, b)


def _descriptor_fields(ptx: str) -> set[tuple[int, int, int]]:
    """(swizzle, stride byte offset, leading byte offset) of every descriptor constant in `ptx`."""
    out = set()
    for c in map(int, re.findall(r"or\.b64 %rd\d+, %rd\d+, (\d+);", ptx)):
        out.add((c >> 62, (c >> 32) & 0x3FFF, (c >> 16) & 0x3FFF))
    return out


def test_descriptors_of_a_k_major_a_and_an_n_major_b():
    """A [128, 64] is K-major: 8-row groups 1024 bytes apart, no leading offset (1). B [64, 256]
    is N-major: 1024 bytes between 8-row K groups, one box (64 rows x 128 bytes) between 64-column blocks."""
    compiled = gemm.compile(gemm.arg_specs_for(dict(M=512, K=512, N=512), "fp16"), arch="sm_90a",
                            space={"block_m": [128], "block_n": [256]})
    descriptors = [op for op in compiled.modules["target"].walk() if isinstance(op, tgt.WgmmaDescriptorOp)]
    assert sorted((op.result.type.major.data, op.result.type.shape_dims, op.leading.value.data, op.stride.value.data,
                   op.per_warpgroup.value.data) for op in descriptors) == [
        ("k", (128, 64), 16, 1024, 64 * 128),        # A: each warpgroup's 64 rows start 8 KB on
        ("mn", (64, 256), 64 * 128, 1024, 0)]
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert _descriptor_fields(kernel.ptx) == {(1, 1024 >> 4, 1), (1, 1024 >> 4, (64 * 128) >> 4)}
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.f16\.f16 .*, 1, 1, 0, 1;", kernel.ptx)


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * 0.07, dim=-1), v)


def test_every_box_of_a_tile_wider_than_the_tensor_is_copied():
    """D = 192 in a 256-wide tile: the fourth box lies wholly past the tensor. It is still copied
    (the copy engine writes zeros), so Q @ K^T never sums stale shared memory."""
    compiled = attention.compile(attention.arg_specs_for(dict(B=1, H=1, S=256, D=192), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    copies = re.findall(r"cp\.async\.bulk\.tensor\.4d\S* \[[^\]]+\], \[(%rd\d+)", kernel.ptx)
    q_map = copies[0]
    assert copies.count(q_map) == 4            # Q: one group of four boxes, none skipped


def test_without_tensor_cores_the_native_path_is_not_taken():
    compiled = gemm.compile(gemm.arg_specs_for(dict(M=512, K=512, N=512), "fp16"), arch="sm_90a",
                            tensor_cores=False)
    assert 'mechanism = "tma"' not in compiled.ir("target")


def test_copies_past_the_loop_are_drained_after_it():
    """Flash attention reading one key block ahead (qk_ahead) waits for all wgmmas inside its loop
    too; the drain of copies the loop issued but never read (a wait on each stage still armed)
    must come after the loop, not at that wait: there it would consume a phase the next iteration
    waits for, and the block would hang."""
    ahead = tsr.function(attention.fn, space=dict(num_stages=[3], qk_ahead=[1], split_kv=[1]))
    compiled = ahead.compile(ahead.arg_specs_for(dict(B=1, H=1, S=1000, D=64), "fp16"), arch="sm_90a")
    assert "qk_ahead = 1" in compiled.ir("schedule")
    (kernel,) = [op for op in compiled.modules["target"].ops if isinstance(op, target.KernelOp)]
    top = list(kernel.body.block.ops)
    loop = max(i for i, op in enumerate(top) if isinstance(op, scf.ForOp))
    drains = [i for i, op in enumerate(top) if isinstance(op, scf.IfOp)
              and any(isinstance(inner, target.MBarrierTryWaitOp) for inner in op.walk())]
    assert len(drains) == 7 and min(drains) > loop     # one per stage: Q's one, K's three, V's three
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert "mbarrier.try_wait.parity" in kernel.ptx


@needs_ptxas
def test_a_warp_specialized_gemm_splits_copies_from_compute():
    """`warp_specialize`: a fifth warpgroup whose first thread issues every TMA copy; the eight
    computing warps copy nothing and hand each stage back, one arrive per warp, on its free
    mbarrier; no block barrier is left in the loop, and nothing spills."""
    ws = tsr.function(gemm.fn, space=dict(warp_specialize=[1], block_m=[128], block_n=[256]))
    compiled = ws.compile(ws.arg_specs_for(dict(M=512, K=1024, N=512), "fp16"), arch="sm_90a")
    assert "producer_warps = 4" in compiled.ir("target") and "block = [384, 1, 1]" in compiled.ir("target")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    producer, consumers = kernel.ptx.split("\n$L_consumers_")
    assert "cp.async.bulk.tensor" in producer and "cp.async.bulk.tensor" not in consumers
    assert "mbarrier.arrive.shared" in consumers and "mbarrier.arrive.shared" not in producer
    assert "wgmma.mma_async" in consumers and "wgmma" not in producer
    assert re.search(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\+0\], 8;", kernel.ptx)   # one arrive per warp
    assert "bar.sync" not in consumers
    assert "0 bytes spill stores" in assemble(kernel.ptx, "sm_90a").log
    assert "scratch<offset = 196672, size = 18432>" in compiled.ir("target")   # store buffers for the 8 computing warps only
    assert "st.global" not in producer


@needs_ptxas
def test_warp_specialized_attention_moves_the_producers_registers_to_the_consumers():
    """With a producer warpgroup, 384 threads leave 168 registers each; scores one block ahead at
    D=128 need more. The producer gives its spare registers back (setmaxnreg.dec to 40) and both
    computing warpgroups take them (setmaxnreg.inc to 232), the launch count pinned at 168 so the
    pool they draw from is known: without it this kernel spilled and serialized its wgmmas."""
    ws = tsr.function(attention.fn, space=dict(block_n=[128], num_stages=[3], warp_specialize=[1], split_kv=[1],
                                               qk_ahead=[1]))
    compiled = ws.compile(ws.arg_specs_for(dict(B=1, H=2, S=1000, D=128), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    producer, consumers = kernel.ptx.split("\n$L_consumers_")
    assert ".maxntid 384, 1, 1 .maxnreg 168" in producer
    assert "setmaxnreg.dec.sync.aligned.u32 40;" in producer and "setmaxnreg" not in consumers.split("\n", 3)[3]
    assert consumers.split("\n")[1].strip() == "setmaxnreg.inc.sync.aligned.u32 232;"
    log = assemble(kernel.ptx, "sm_90a").log
    assert "0 bytes spill stores" in log and "serialized" not in log


def test_fp8_attention_at_d64_reads_q_and_k_in_the_64_byte_swizzle():
    """fp8 Q and K at D = 64 are one 64-byte box row each: their buffers, tensor maps and wgmma
    descriptors take TMA's 64-byte swizzle (descriptor mode 2, 8-row groups 512 bytes apart, a
    warpgroup's 64 rows 4096 bytes on), and the second k32 step starts 32 bytes into the row; V^T
    (128 keys a row) keeps the 128-byte one; K's map reads its keys permuted in each 16 (no turns
    here: `lowering.byte_fragments`). ptxas assembles it without spilling."""
    from fp8_attention import fp8_attention_vt
    att = tsr.function(fp8_attention_vt.fn, space={"split_kv": [1]})
    compiled = att.compile(att.arg_specs_for(dict(B=2, H=2, S=1024, N=1024, D=64)), arch="sm_90a")
    ir = compiled.ir("target")
    assert ir.count('swizzle = "tma_64b"') == 2 and ir.count('swizzle = "tma_128b"') == 1
    maps = [line.split("box = ")[1] for line in ir.splitlines() if "tessera_target.tensor_map %" in line]
    assert sorted(maps) == ["[1, 1, 128, 64], swizzle = 64>", "[1, 1, 64, 128], swizzle = 128>",
                            "[8, 2, 4, 2, 64], swizzle = 64>"]   # (K's keys permuted: `byte_fragments`)
    assert "leading = 16 stride = 512 swizzle = 64 per_warpgroup = 4096" in ir
    (kernel,) = emit_module(compiled.modules["target"]).values()
    assert _descriptor_fields(kernel.ptx) == {(2, 512 // 16, 1), (1, 1024 // 16, 1)}   # (16-byte units)
    scores = [re.findall(r"%rd\d+", line)[-2:] for line in kernel.ptx.splitlines()
              if "wgmma.mma_async" in line and "m64n128k32" in line]
    assert len(scores) == 2   # (two k32 steps over the 64-byte rows of Q and K)
    for first, second in zip(*scores):   # the second step's descriptors: +32 bytes (2 in 16-byte units)
        assert re.search(rf"add\.s64 {second}, {first}, 2;", kernel.ptx)
    log = assemble(kernel.ptx, "sm_90a").log
    assert "0 bytes spill stores" in log and "serialized" not in log


def test_an_fp8_gemm_over_64_byte_rows_stays_on_mma_sync():
    """Only attention takes 64-byte box rows: an fp8 GEMM whose K is one 64-element step measured
    slower on the Hopper path, and `native_blockers` says so."""
    from tessera.lowering.tile_to_target import native_blockers
    E4M3 = tsr.fp8_e4m3

    @tsr.function
    def scaled(a: Tensor["M", "K", E4M3], b: Tensor["N", "K", E4M3]):
        return tsr.matmul(a, b.transpose(-2, -1)).to(tsr.bf16)
    compiled = scaled.compile(scaled.arg_specs_for(dict(M=1024, N=1024, K=64)), arch="sm_90a")
    (kernel,) = [op for op in compiled.modules["tile"].walk() if op.name == "tile.kernel"]
    assert "an 8-bit GEMM tile of 64-byte rows (measured slower on the Hopper path)" in \
        native_blockers(kernel, platforms.get("sm_90a"))
    assert "wgmma" not in compiled.ir("target") and "tma_64b" not in compiled.ir("target")


def test_warpgroups_taking_turns_meet_at_named_barriers():
    """`pingpong`: warpgroup w takes its turn at named barrier 2 + w with 256 threads (its own and
    the giver's) and gives it at the other's with bar.arrive; warpgroup 1 gives the first turn and
    warpgroup 0 the last, each predicated on its warpgroup. Barrier 1 stays the computing warps' own;
    the producer takes no turns."""
    pp = tsr.function(attention.fn, space=dict(block_n=[128], warp_specialize=[1], num_warps=[8], split_kv=[1],
                                               pingpong=[1]))
    compiled = pp.compile(pp.arg_specs_for(dict(B=1, H=2, S=1000, D=128), "fp16"), arch="sm_90a")
    (kernel,) = emit_module(compiled.modules["target"]).values()
    producer, consumers = kernel.ptx.split("\n$L_consumers_")
    assert "bar.sync %" not in producer and "bar.arrive" not in producer
    first, last = re.findall(r"@%p\d+ bar\.arrive (\d+), 256;", consumers)
    assert (first, last) == ("2", "3")
    assert len(re.findall(r"bar\.sync %r\d+, 256;", consumers)) == 2     # before the loop and before P @ V
    # once the scores are issued, at the other warpgroup's barrier: 2 + (w + 1) % 2
    (give,) = re.findall(r"add\.s32 (%r\d+), %r\d+, 1;\s*rem\.u32 \1, \1, 2;\s*add\.s32 \1, \1, 2;\s*"
                         r"bar\.arrive \1, 256;", consumers)
    assert len(re.findall(r"^\s*bar\.arrive %r\d+, 256;", consumers, re.M)) == 1
    log = assemble(kernel.ptx, "sm_90a").log
    assert "0 bytes spill stores" in log and "serialized" not in log


def test_register_split_needs_setmaxnreg_and_a_producer_warpgroup():
    sm90a, sm90 = platforms.get("sm_90a"), platforms.get("sm_90")
    assert register_split(sm90a, 384, 128) == RegisterSplit(launch=168, producer=40, consumer=232)
    assert register_split(sm90, 384, 128) is None          # no setmaxnreg without the "a" features
    assert register_split(sm90a, 256, 0) is None           # not warp-specialized
    assert register_split(sm90a, 256, 128) is None         # 255 registers each already: nothing to gain
    assert register_split(sm90a, 192, 128) is None         # the computing warps are not a warpgroup
    assert register_split(sm90a, 320, 128) is None         # setmaxnreg is per whole warpgroup


def test_warp_specialization_needs_bulk_copies():
    """On sm_80 (copies by every thread with cp.async) the switch changes nothing."""
    def target_ir(**space):
        fn = tsr.function(gemm.fn, space=space)
        return fn.compile(fn.arg_specs_for(dict(M=512, K=1024, N=512), "fp16"), arch="sm_80").ir("target")
    assert target_ir(warp_specialize=[1]) == target_ir(warp_specialize=[0])
