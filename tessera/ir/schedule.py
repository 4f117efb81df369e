"""Schedule IR: the fusion plan, as the xDSL dialect `schedule`.

Each `schedule.kernel` is one GPU kernel. Its region holds the Graph IR ops of
its fusion group (block arguments are the group's inputs, `schedule.yield`
its outputs); its properties say which kernel template implements it (`kind`),
the tiling parameters in force (`params`), the space the autotuner may
search (`space`), and which backend compiles it (`backend`, and `backend_why`:
the rule or option that chose it, `tessera.passes.backend_choice`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, StringAttr
from xdsl.ir import Attribute, Block, Dialect, Region, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    opt_prop_def,
    prop_def,
    region_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import IsTerminator
from xdsl.utils.exceptions import VerifyException

from ..backends import BACKENDS
from ..dims import hint

#: Kernel templates, each with its default tiling and the space the autotuner searches.
KINDS: dict[str, tuple[dict[str, int], dict[str, list[int]]]] = {
    "flash_attention": (
        {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2, "qk_ahead": 0, "warp_specialize": 0,
         "pingpong": 0, "persistent": 0, "split_kv": 1, "heavy_first": 0},
        {"block_m": [64, 128], "block_n": [32, 64, 128, 256], "num_warps": [4, 8], "num_stages": [1, 2, 3],
         "qk_ahead": [0, 1], "warp_specialize": [0, 1], "pingpong": [0, 1], "persistent": [0, 1],
         "split_kv": [1, 2, 4, 8, 16, 32], "heavy_first": [0, 1]},
    ),
    "flash_chain": (
        {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "heavy_first": 0, "warp_specialize": 0},
        {"block_m": [64, 128], "block_n": [32, 64, 128], "num_warps": [4, 8], "num_stages": [1, 2, 3],
         "heavy_first": [0, 1], "warp_specialize": [0, 1]},
    ),
    "gemm": (
        {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8,
         "mma_async": 0, "warp_specialize": 0, "persistent": 0, "split_k": 1},
        {"block_m": [64, 128, 256], "block_n": [64, 128, 256], "block_k": [32, 64],
         "num_warps": [4, 8], "num_stages": [2, 3, 4], "group_m": [1, 4, 8, 16], "mma_async": [0, 1],
         "warp_specialize": [0, 1], "persistent": [0, 1], "split_k": [1, 2, 4, 8, 16]},
    ),
    # `cluster`: the blocks of a thread-block cluster a row may be split across (`row_split`)
    "row_reduction": (
        {"block_m": 64, "block_n": 8192, "num_warps": 4, "num_stages": 1, "cluster": 1},
        {"block_m": [1, 4, 16, 64], "block_n": [1024, 2048, 4096, 8192, 16384, 32768], "num_warps": [4, 8, 16],
         "num_stages": [1, 2, 3], "cluster": [1, 2, 4, 8]},
    ),
    # block_m rows of the reduced axis a step, block_n kept columns a program: 32 x 128 on 4 warps
    # (32 accumulators a thread); H100, sum(x * y * r, 0) bf16, of the copy bandwidth, against 32 x
    # 256: 4096x32768 0.70 -> 0.95x, 16384x8192 0.87 -> 0.93x, 65536x1024 0.81 -> 0.86x
    "column_reduction": (
        {"block_m": 32, "block_n": 256, "num_warps": 4, "num_stages": 1, "split_rows": 1},
        {"block_m": [8, 16, 32, 64], "block_n": [64, 128, 256, 512], "num_warps": [2, 4, 8], "num_stages": [1],
         "split_rows": [1, 2, 4, 8, 16, 32, 64]},
    ),
    "elementwise": (
        {"block_m": 16, "block_n": 128, "num_warps": 4, "num_stages": 1},
        {"block_m": [4, 8, 16, 32], "block_n": [64, 128, 256], "num_warps": [4, 8], "num_stages": [1]},
    ),
}


#: Params that switch a template feature on (1) or off (0) rather than size something: `mma_async`
#: leaves each GEMM step's (wgmma) mmas running while the next copies are issued; `qk_ahead` (with
#: 2+ stages) has flash attention compute the next key block's scores before this block's P @ V;
#: `warp_specialize` (with 2+ stages) adds a producer warpgroup that alone issues the (TMA) copies, so
#: the warps computing never wait for each other, only for data (ignored where copies are not TMA's);
#: `pingpong` (with warp_specialize and two computing warpgroups, without qk_ahead) has those
#: warpgroups take turns issuing their mmas (`tile.mma_turn`), so one's softmax runs under the other's;
#: `persistent` launches one GEMM block per SM (the schedule's `programs`), each walking output
#: tiles with one pipeline across them, so a tile's first copies land while the previous is stored;
#: an attention's blocks so walk its query tiles (`schedule_to_tile._TileWalk`).
SWITCHES = frozenset({"mma_async", "qk_ahead", "warp_specialize", "pingpong", "persistent", "heavy_first"})

#: Params the fusion pass derives from the target rather than a template's defaults, which a space
#: may still pin: `programs`, the blocks of a persistent GEMM (the SMs times the blocks one holds);
#: `split_k`, the ways a GEMM with too few output tiles to fill the GPU splits its K steps (a first
#: kernel writes fp32 partial products, a second adds them in order and applies the epilogue);
#: `split_kv`, the same for an attention with too few query blocks (a decode step): its key blocks
#: split across blocks, whose outputs and log-sum-exps a second kernel combines (flash-decoding);
#: `split_rows`, the same for a column reduction with too few column blocks (a weight gradient's
#: sum over 16384 rows of 8192 columns has 32 of 256 columns): its reduced rows; `heavy_group`, the
#: batch programs of a flash_chain kernel whose row blocks `heavy_first` interleaves, heaviest first,
#: a group of them at a time (absent: all of them at once).
DERIVED = frozenset({"programs", "split_k", "split_kv", "split_rows", "heavy_group"})

#: A space's one entry that is not a tiling param: the backend of every kernel (`tessera.backends`;
#: "auto": each kernel's by `tessera.passes.backend_choice`), so a tuner can time the backends
BACKEND_PARAM = "backend"

#: the rows (keys) of a flash_chain kernel's block when it sums an across sink (dQ): see SHAPE_DEFAULTS
ACROSS_ROWS = 128


def _scores_ahead(f: dict) -> bool:
    """Whether an attention takes the Hopper D = 128 schedule computing each block's scores ahead
    (16-bit Q, K and V on wgmma, query rows filling 4+ waves of 128-row blocks, no key range read per
    row, no KV head shared by query heads): see SHAPE_DEFAULTS."""
    return bool(f.get("wgmma") and f.get("element_bytes") == 2 and f.get("value_bytes") == 2
                and f.get("head_dim") == 128 and f.get("query_rows", 0) >= 128 and f.get("query_block_waves", 0) >= 4
                and not f.get("reads_indices") and not f.get("shared_keys"))


def _fp8_wide(f: dict) -> bool:
    """Whether an fp8 attention takes 256 keys a block and walks its query tiles (8-bit Q, K and V
    on wgmma at D = 64 or 128, query rows filling 4+ waves of 128-row blocks, no key range read per
    row, no KV head shared by query heads): see SHAPE_DEFAULTS."""
    return bool(f.get("wgmma") and f.get("value_bytes") == 1 and f.get("element_bytes") == 1
                and f.get("head_dim") in (64, 128) and f.get("query_rows", 0) >= 128
                and f.get("query_block_waves", 0) >= 4 and not f.get("reads_indices") and not f.get("shared_keys"))


def _fp8_turns(f: dict) -> bool:
    """Whether an fp8 attention's two computing warpgroups take turns at their mmas (`_fp8_wide`'s
    kernels without a causal mask): see SHAPE_DEFAULTS."""
    return _fp8_wide(f) and not f.get("one_sided_mask")


#: Defaults that depend on the problem, as (kind, condition on the problem's features, overrides), applied
#: in order. Measured with bench/sweep.py on an H100 (bench/RESULTS.md); the autotuner searches `space`.
SHAPE_DEFAULTS: list[tuple[str, Callable[[dict], bool], dict[str, int]]] = [
    # a light epilogue leaves registers for 64 x 64 accumulators per warp; on 4 warps with 2 stages
    # (64 KB, 168 registers), three blocks share an SM and compute while the others wait: the
    # fastest mma.sync tiling measured (about 2% over 256 x 128 on 8 warps, 3 stages)
    ("gemm", lambda f: f.get("epilogue_ops", 0) <= 2,
     {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 2}),
    ("gemm", lambda f: f.get("element_bytes") == 4, {"block_k": 32, "num_stages": 3}),
    # Hopper-native GEMM: one 64 x 256 wgmma per warpgroup, four TMA stages (192 KB), each step's
    # wgmma left running while the next step's copies are issued (mma_async), one block per SM
    # walking tiles (persistent: +1-3% on H100; the mma.sync path loses 2-8% with it)
    ("gemm", lambda f: f.get("wgmma") and f.get("element_bytes") == 2,
     {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4, "mma_async": 1,
      "persistent": 1}),
    # ... and so with 8-bit operands (fp8), whose K steps take 128 elements to fill a 128-byte
    # swizzled row (the same 192 KB of stages)
    ("gemm", lambda f: f.get("wgmma") and f.get("element_bytes") == 1,
     {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 4, "mma_async": 1,
      "persistent": 1}),
    # ... whose 128 accumulators per thread leave no room for an IEEE division's temporaries (a user's
    # `/`: 56 bytes spilled at 256 columns when silu's sigmoid was one). sigmoid (an approximate
    # division) and gelu (erf or tanh, whose reciprocals are rcp.approx) keep 256 columns without
    # spilling: H100 bf16 against torch matmul + separate gelu, 128 -> 256 columns, 8192^3 0.94 ->
    # 1.01-1.11x (erf) and 1.02 -> 1.09-1.14x (tanh), 4096^3 1.14 -> 1.23-1.33x (bench/RESULTS.md
    # session 17); silu 0.84-0.88x -> 1.22-1.35x (session 18)
    ("gemm", lambda f: f.get("wgmma") and f.get("epilogue_divides", 0) > 0, {"block_n": 128}),

    ("flash_attention", lambda f: f.get("head_dim") == 128,
     {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}),
    # Hopper-native attention: two warpgroups, each one 64-row wgmma slice of the 128 query rows, two
    # stages; 128 keys per block at D = 64, 64 at larger head dims (D = 128: 501 TFLOP/s against 477
    # for 128 keys, and against 481 for the three-stage qk_ahead schedule, which the autotuner may
    # still choose)
    ("flash_attention", lambda f: f.get("wgmma") and f.get("element_bytes") == 2,
     {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2}),
    ("flash_attention", lambda f: f.get("wgmma") and f.get("head_dim", 0) > 64, {"block_n": 64}),
    # ... but at D = 128, where the query rows fill a block (not a decode step's few), 128 keys, a
    # producer warpgroup, and each block's scores computed before the previous block's P @ V
    # (qk_ahead: keys and values in two stages each, the 64 registers a thread of the next scores
    # paid by the producer's). H200 bf16, against cuDNN (`python3 bench/attention_schedules.py`,
    # bench/RESULTS.md session 41), before -> after: 8x16x4096x128 0.906 -> 0.980x, causal 0.941 ->
    # 1.009x; 32x12x2048x128 0.887 -> 0.954x, 0.923 -> 0.978x; 4x16x8192x128 0.915 -> 0.983x, 0.941
    # -> 1.013x. 128 keys with the producer alone: 0.92 / 0.96x at 8x16x4096x128; qk_ahead on 64
    # keys (two blocks an SM, 48 bytes spilled): 0.79x. At D = 64 it lost (624 -> 709 us), and so
    # it did where the key ranges are read per row (varlen: GQA 8 x 2048 packed 675 -> 763 us,
    # bench/varlen_attention.py --quick), which keep 64 keys and two blocks an SM. Only over 4+
    # waves of 128-row query blocks (one block an SM, as measured down to 1x16x8192x128: soft-capped
    # causal 675 -> 598 us, plain 966 -> 911, bench/attention_small_grids.py); fewer (B=3 H=5
    # S=1531, B=1 H=8 S=4096) keep the schedules measured there, two blocks an SM, 64-row blocks
    # for a causal one (`fusion._schedule_few_heads`). Grouped-query attention (`shared_keys`) and
    # fp8 values were not measured with it and keep their schedules
    ("flash_attention", lambda f: _scores_ahead(f), {"block_n": 128, "qk_ahead": 1, "warp_specialize": 1}),
    # ... and where every query block's keys start at the first (no mask bounds them below), one
    # block an SM walking the query tiles (`persistent`: `schedule_to_tile._TileWalk`), each tile's
    # first copies landing during the previous tile; under a causal mask, heaviest first. H200 bf16,
    # against cuDNN (`python3 bench/attention_schedules.py`), before -> after: bench/RESULTS.md
    # session 43, 2x16x8192x128 0.990 -> 1.040x, 8x16x4096x128 0.983 -> 1.037x, 32x16x2048x128
    # 0.964 -> 1.037x, 128x16x1024x128 0.932 -> 1.040x, 32x12x2048x128 0.958 -> 1.038x; session
    # 44, causal: 8x16x4096x128 1.010 -> 1.050x, 32x12x2048x128 0.974 -> 1.047x, 4x16x8192x128
    # 1.012 -> 1.031x (fp16 after: 1.040x, 1.045x, 1.024x); soft-capped causal 8x16x4096x128
    # 1.196 -> 1.157 ms (`bench/attention_backward_ab.py --forward`). A causal walk is dropped where
    # its static split loses to the grid's (`fusion._causal_walk_pays`: 3x16x4096 414.9 vs 419.4 us)
    ("flash_attention", lambda f: _scores_ahead(f) and not f.get("keys_bounded_below"), {"persistent": 1}),
    # ... but 128 keys with 8-bit operands (fp8), whose transposed V tile ([D, keys]) must be whole
    # 128-byte swizzled rows of keys for TMA and wgmma, and a producer warpgroup: with the matmuls
    # twice as fast, the softmax bounds the loop, and the consumers issuing no copies pays. H200,
    # 8x16x4096x128 with V passed transposed: 1.763 ms -> 1.606 (causal 1.263 -> 1.182 with V's
    # copy); qk_ahead and 3 stages were slower (1.74-1.86 ms; bench/RESULTS.md session 25), and so
    # was qk_ahead with keys and values two stages each (V^T 1.620 -> 1.820 ms, causal 0.942 ->
    # 0.985; session 41). At D = 64 (Q and K in TMA's 64-byte swizzle) two computing warpgroups too,
    # each a 64-row wgmma slice of the 128 query rows
    ("flash_attention", lambda f: f.get("wgmma") and f.get("value_bytes") == 1,
     {"block_m": 128, "block_n": 128, "num_warps": 8, "warp_specialize": 1}),
    # ... and over 4+ waves of query blocks, the two computing warpgroups take turns at their mmas
    # (`pingpong`): without, they run in step, both softmaxes at once. H200 e4m3, V passed
    # transposed, us (bench/fp8_attention_schedules.py, RESULTS session 42): 8x16x4096x128 1611 -> 1535,
    # 32x12x2048x128 1250 -> 1208, 4x16x8192x128 3121 -> 2991, 16x16x2048x64 714 -> 674. Not under
    # a causal mask (`one_sided_mask`), whose shorter loops pay the turns' start: 938 -> 947, 836 ->
    # 814, 1718 -> 1744 (at D = 64 483 -> 473, one run); nor at 16-bit values, whose matmuls outlast the softmax (bf16 8x16x4096x128 without
    # qk_ahead 2042 -> 2364). Grouped-query and per-row key ranges were not measured
    ("flash_attention", lambda f: _fp8_turns(f), {"pingpong": 1}),
    # ... and 256 keys a block, one block an SM walking the query tiles (`persistent`; under a causal
    # mask where the walk pays, `fusion._causal_walk_pays`): a block's softmax (its row maxima and
    # sums across a quad, the output's rescale, the stage's barriers) comes half as often a key.
    # H200 e4m3, ms (bench/fp8_attention.py, RESULTS session 46; V copied transposed in the call):
    # 8x16x4096x128 1.558 -> 1.410, 32x12x2048x128 1.249 -> 1.168, 4x16x8192x128 3.001 -> 2.766;
    # causal 0.929 -> 0.825, 0.796 -> 0.752, 1.709 -> 1.483. Pins, us (bench/fp8_attention_schedules.py,
    # V^T, 128 keys -> 256 -> 256 walking): 8x16x4096x128 1558 -> 1418 -> 1402, 32x12x2048x128 1229 ->
    # 1124 -> 1084, 16x16x2048x64 (which walked on 128 keys already: sessions 43-44, 673.6 -> 641.7)
    # 632 -> 563 -> 567. Without turns (256 keys) 1491; 3 stages 1434; no producer 1562
    ("flash_attention", lambda f: _fp8_wide(f) and not f.get("keys_bounded_below"), {"block_n": 256, "persistent": 1}),
    # CUDA Tile IR (tileiras stages, pipelines and picks the instructions): 64 keys per block at
    # D = 128, and two blocks per SM asked of tileiras (`occupancy`, the entry's hint). H200 bf16,
    # bench/RESULTS.md session 14: 8x16x4096x128 219 TFLOP/s with 128 keys, 408 with 64; 16x16x2048x64
    # 265 -> 360 with the hint
    ("flash_attention", lambda f: f.get("tile_compiler"), {"occupancy": 2}),
    # ... and fp32 GEMMs (tileiras computes them on the CUDA cores and spills at 128 x 128): 128 x 64.
    # H200, 4096^3: 128 x 128 4.2 TFLOP/s, 64 x 64 5.3, 64 x 128 8.1, 128 x 64 8.2 (`python3 bench/sweep.py
    # --only fp32-tiles`, bench/RESULTS.md session 22; cuBLAS fp32 51)
    ("gemm", lambda f: f.get("tile_compiler") and f.get("element_bytes") == 4, {"block_m": 128, "block_n": 64}),
    # a norm or a softmax over rows longer than one 8192-element chunk: 16 warps, and the whole row
    # (a norm) or half of it (a softmax, whose exponentials take registers too) a chunk, so the row
    # is read from memory once or twice rather than in three passes. H100 (copy 2950 GB/s), 4096 x
    # 32768, of the copy bandwidth, bf16 and fp16: layer_norm 0.57 -> 0.93-0.96x, rms_norm 0.66 ->
    # 0.98x, softmax 0.65 -> 0.82-0.84x (0.70x with the whole row); bench/row_kernels.py --sweep,
    # bench/RESULTS.md session 16
    ("row_reduction", lambda f: f.get("norm") and f.get("row_elements", 0) > 8192,
     {"num_warps": 16, "block_n": 32768}),
    # ... where a layer_norm's whole row of more than 16384 is that chunk, the block walks its rows,
    # the next row staged in shared memory while it reduces one (its two statistics, each a round
    # across the block, leave the memory idle otherwise). H200, of the copy bandwidth, bf16 / fp16:
    # 4096 x 32768 0.74 -> 0.79x / 0.79 -> 0.88x, 4096 x 24576 0.64 -> 0.81x / 0.67 -> 0.83x, 1000 x
    # 20000 0.70 -> 0.84x / 0.71 -> 0.86x (3 stages: less; rms_norm, one round: mixed, +-8%;
    # bench/RESULTS.md session 38)
    ("row_reduction", lambda f: f.get("layer_norm") and 16384 < f.get("row_elements", 0) <= 32768,
     {"num_stages": 2}),
    # ... and so does a reduction with an epilogue over the rows it reduced (a norm backward's dx:
    # rms_norm 4096 x 32768 on the H100, 461 -> 387 us)
    ("row_reduction", lambda f: (f.get("softmax") or f.get("over_rows")) and f.get("row_elements", 0) > 8192,
     {"num_warps": 16, "block_n": 16384}),
    # ... but statistics computed in turn without exponentials (a variance's mean, then the squares
    # about it: a layer_norm written out) take the whole row, as a norm, read from memory once for
    # its passes. H200 fp16 4096 x 32768, 16384 -> 32768 columns: var 131 -> 84 us, a written-out
    # layer_norm 177 -> 165 (a softmax written out, whose exponentials take registers, lost: 196 ->
    # 224; scratch pins, bench/RESULTS.md session 36)
    ("row_reduction", lambda f: f.get("chained_statistics") and not f.get("exponentials")
     and f.get("row_elements", 0) > 8192, {"num_warps": 16, "block_n": 32768}),
    # where blocks form clusters (distributed shared memory), a row kernel carrying column reductions
    # (a norm backward's weight gradients) over rows longer than one 8192-element chunk splits each
    # row across up to 8 blocks of a cluster, each reducing its share as a row of 8192 and carrying
    # the column sums of its share, the cluster combining the shares' statistics
    # (`tile.cluster_gather`); without clusters such rows carry none, and the column sums read the
    # rows again in kernels of their own. H200 bf16 4096 x 32768, vjp us (of the copy bandwidth):
    # layer_norm 523 (0.37x) -> 276 (0.70x), rms_norm 491 (0.40x) -> 243 (0.80x); 2048 x 65536,
    # clusters of 8: 606 -> 286, 479 -> 251 (bench/RESULTS.md session 37)
    ("row_reduction", lambda f: f.get("clusters") and f.get("column_riders") and f.get("row_elements", 0) > 8192,
     {"cluster": 8, "block_n": 8192, "num_warps": 4}),
    # ... and so does a forward over rows past one 8192-element chunk where a block a row measured
    # slower: fewer rows than SMs (a block a row left most SMs idle), a softmax over rows of more
    # than 32768 (4 warps a block), a layer_norm over more than 32768 and an rms_norm over more than
    # 65536 (8 warps; a softmax's max and sum and a layer_norm's mean and variance exchanged in one
    # round each). H200, bf16 / fp16, us, a block a row -> split: 3 x 100003 softmax 57 -> 15,
    # layer_norm 85 -> 17; softmax 2048 x 65536 188 -> 162, 1024 x 131072 207 -> 163; layer_norm
    # 2048 x 65536 237 -> 186 / 217 -> 182, 1024 x 131072 252 -> 205; rms_norm 1024 x 131072 196
    # -> 153. Where the split measured no better: softmax at 20000-32768 (+-5%), layer_norm at
    # 32768 (0.74 -> 0.72x), rms_norm at 32768 (0.90 -> 0.73x) and 65536 (0.74 -> 0.70x)
    # (`.scratch` A/B and pins, bench/RESULTS.md session 37)
    ("row_reduction", lambda f: f.get("clusters") and f.get("row_elements", 0) > 8192 and (
        f.get("few_rows") or f.get("softmax") and f.get("row_elements", 0) > 32768),
     {"cluster": 8, "block_n": 8192, "num_warps": 4}),
    ("row_reduction", lambda f: f.get("clusters") and f.get("norm") and not f.get("few_rows")
     and f.get("row_elements", 0) > (32768 if f.get("layer_norm") else 65536),
     {"cluster": 8, "block_n": 8192, "num_warps": 8}),
    # ... but a softmax over rows of two whole 16384-element chunks splits them across 2 blocks of
    # 8 warps, each share one chunk: H200 bf16 4096 x 32768, of the copy bandwidth, a block a row
    # 0.81-0.82x, 8 shares of 8192 0.85x, 2 of 16384 0.90-0.91x (three runs; fp16 0.90x); a share
    # short of its chunk measured far slower (4096 x 24576 and 1000 x 20000: 0.39x, its column masks
    # taking 154 registers a thread against 80, one block an SM; bench/RESULTS.md session 37)
    ("row_reduction", lambda f: f.get("clusters") and f.get("softmax") and f.get("row_elements") == 32768
     and not f.get("few_rows"), {"cluster": 8, "block_n": 16384, "num_warps": 8}),
    # a row kernel carrying column reductions over rows of 1024+ walks its rows with the next row
    # block's tiles staged in shared memory (num_stages 2: the walk's memory requests, where a
    # block loading its rows as it reduced them left them idle). H200 bf16, us, 1 stage -> 2 (3):
    # rms_norm 65536 x 1024 112 -> 110 (110), 65536 x 2048 210 -> 205 (213); layer_norm 121 -> 120
    # (121), 220 -> 205 (209); at 512 columns 2 stages lost (layer_norm 131072 x 512 127 -> 143 us;
    # bench/RESULTS.md session 38)
    ("row_reduction", lambda f: f.get("column_riders", 0) and f.get("row_elements", 0) >= 1024, {"num_stages": 2}),
    # ... over rows of 4096+ elements with two column reductions (a layer_norm backward's weight and
    # bias gradients), or longer with one: 8 warps, as on 4 its accumulators and rows spill (255
    # registers at 8192; H200 bf16 layer_norm 16384 x 8192 462 -> 404 us, 32768 x 4096 381 -> 353),
    # and two row blocks ahead. H200 bf16, of the copy bandwidth, rows ahead in registers (session
    # 31) -> 2 stages in shared memory -> 3: layer_norm 16384 x 8192 0.76 -> 0.83 -> 0.84x, 32768 x
    # 4096 0.82 -> 0.87 -> 0.90x; rms_norm 16384 x 8192 0.84 -> 0.86 -> 0.92x, 32768 x 4096 0.92 ->
    # 0.93 -> 0.94x (bench/RESULTS.md session 38)
    ("row_reduction", lambda f: f.get("column_riders", 0) >= 2 and f.get("row_elements", 0) >= 4096
     or f.get("column_riders", 0) and f.get("row_elements", 0) > 4096, {"num_warps": 8, "num_stages": 3}),
    # ... but one column reduction (an rms_norm backward's weight gradient) over rows split across a
    # cluster: 16 warps. H200 bf16, us, 8 warps -> 16: 1000 x 20000 65.7 -> 54.4, 8000 x 20000 417
    # -> 329, 4096 x 32768 233 -> 229, 2048 x 65536 244 -> 239 (a layer_norm's two lost: 4096 x 32768
    # 253 -> 285; bench/RESULTS.md session 38)
    ("row_reduction", lambda f: f.get("clusters") and f.get("column_riders", 0) == 1 and f.get("row_elements", 0) > 8192,
     {"num_warps": 16}),
    ("flash_attention", lambda f: f.get("tile_compiler") and f.get("head_dim", 0) > 64, {"block_n": 64}),
    # a chain kernel summing dQ across its key blocks (an across sink, `index_maps.ChainSink.across`):
    # 128 keys a block on 8 warps, so each query block's dQ is added half as often as with 64 (one
    # block an SM either way: the sum's shared buffer). H200 bf16 plain 8x16x4096x128: 64 keys on
    # 4 warps 10.6 ms, 128 on 8 6.14 (two kernels: 6.75); bench/RESULTS.md session 33
    ("flash_chain", lambda f: f.get("staged_tiles", 0) > 0, {"block_m": ACROSS_ROWS, "num_warps": 8}),
    # ... with a producer warpgroup issuing its copies (`warp_specialize`) where no mask bounds its
    # columns: the computing warps release a stage without meeting. H200 bf16 8x16x4096x128, vjp ms
    # (bench/attention_backward_ab.py, bench/RESULTS.md session 45): plain 5.954 -> 5.812 and
    # 5.999 -> 5.859; causal (not taken) 3.465 -> 3.507 and 3.497 -> 3.552
    ("flash_chain", lambda f: f.get("staged_tiles", 0) > 0 and f.get("wgmma") and not f.get("bounded_columns"),
     {"warp_specialize": 1}),
    # A column sum's tile (KINDS): 32 x 256 on 4 warps. bf16, CUDA-graph, of the copy bandwidth, 32 x 128
    # -> 32 x 256: H200 16384x8192 0.82 -> 0.95, 65536x1024 0.73 -> 0.86, 4096x32768 0.91 -> 0.97,
    # 8192x4096 0.64 -> 0.75; H100 0.92 -> 0.98, 0.84 -> 0.91, 0.95 -> 0.99, 0.76 -> 0.82 (64 x 128
    # was as good but for 4096x32768: 0.81 and 0.89; `python3 bench/sweep.py --only column-tiles`,
    # bench/RESULTS.md session 22). CUDA Tile IR keeps
    # the 32 x 128 it was measured at (1.01-1.09x the PTX kernel's 32 x 128 on tall matrices)
    ("column_reduction", lambda f: f.get("tile_compiler"), {"block_n": 128}),
    # an 8-bit layout copy (an fp8 attention's V transposed, `passes.byte_operands`), with its bytes
    # stored 16 at a time: 32 x 64 tiles. H200, [8, 16, 4096, 128] e4m3: 32 x 64 43 us (3089 GB/s),
    # 64 x 64 44, 16 x 128 and 32 x 128 71-72, 32 x 256 144 (bench/RESULTS.md session 25)
    ("elementwise", lambda f: f.get("layout_copy_bytes") == 1, {"block_m": 32, "block_n": 64}),
]


def default_params(kind: str, features: dict[str, int], max_shared: int | None = None) -> dict[str, int]:
    """A kind's default tiling, refined by what is known of the problem (e.g. the head dim) and
    shrunk until its shared-memory pipeline fits `max_shared` bytes (the target's per-block limit)."""
    params = dict(KINDS[kind][0])
    for rule_kind, applies, overrides in SHAPE_DEFAULTS:
        if rule_kind == kind and applies(features):
            params.update(overrides)
    if max_shared is None:
        return params
    # (a row walk stages its rows only where they fit: 1 stage, no walk, at least)
    shrink = [("num_stages", 1 if kind == "row_reduction" else 2), ("block_n", 32), ("block_m", 64), ("block_k", 32)]
    while shared_bytes(kind, params, features) > max_shared:
        key = next((k for k, least in shrink if params.get(k, 0) > least), None)
        if key is None:
            break
        params[key] = params[key] - 1 if key == "num_stages" else params[key] // 2
    return params


def fit_block(block: int, size: int) -> int:
    """A tile's extent along a dim of `size`: the param's `block`, cut to the size rounded up to a
    power of two (16 at least, the tensor cores' granule); for a dynamic dim, cut to its hint."""
    return min(block, max(16, 1 << max(0, hint(size) - 1).bit_length()))


def pow2_at_least(n: int, lo: int = 16) -> int:
    """The least power of two at least `n` and `lo`."""
    return max(lo, 1 << max(0, n - 1).bit_length())


def fit_warps(num_warps: int, most: int) -> int:
    """A kernel's warps: param `num_warps`, cut to the power of two at most `most`, what its tile
    keeps busy (a tensor-core fragment is 16 rows)."""
    return min(num_warps, max(1, 1 << (most.bit_length() - 1)))


def across_transposed(block_n: int, width: int, warps: int) -> bool | None:
    """How a flash_chain kernel on `warps` warps computes an across sum's [block_n, width] block
    (a step's queries x dQ's head dim padded to a power of two): as itself (False) where its rows
    give each warp 16, as its transpose [width, block_n] (True) where the width's do, None where
    neither does (`schedule_to_tile._AcrossSums`)."""
    if block_n == 16 * warps:
        return False
    return True if width == 16 * warps else None


def across_fits(params: dict[str, int], rows: int, columns: int, width: int) -> bool:
    """Whether a flash_chain kernel of `params` over `rows` (keys) and `columns` (queries) can sum
    an across sink `width` wide (`across_transposed`), its tile and warps cut as the template cuts
    them (`fit_block`, `fit_warps`)."""
    block_m, block_n = fit_block(params["block_m"], rows), fit_block(params["block_n"], columns)
    warps = fit_warps(params["num_warps"], block_m // 16)
    return across_transposed(block_n, pow2_at_least(width), warps) is not None


def mma_k_extent(extent: int, element_bytes: int) -> int:
    """A tile's extent along a matmul's K, at least one tensor-core instruction's K step: 32 bytes
    of its operands' rows (16 elements of 16 bits, 32 of 8 bits)."""
    return max(32 // element_bytes, extent)


def head_dim_tile(head_dim: int, element_bytes: int) -> int:
    """An attention tile's extent along the head dim (Q @ K^T's K): the dim rounded up to a power
    of two, at least one instruction's K step."""
    return mma_k_extent(pow2_at_least(head_dim), element_bytes)


#: a wgmma GEMM's block_n values that are not powers of two (`KernelOp._wgmma_columns`)
WGMMA_BLOCK_N = (192,)


def gemm_tile(params: dict[str, int], m: int, n: int, k: int, element_bytes: int = 2) -> dict[str, int]:
    """The tile a GEMM kernel computes for an M x N output over K (`fit_block` of each, K at least
    one instruction's step)."""
    return {"m": fit_block(params["block_m"], m), "n": fit_block(params["block_n"], n),
            "k": mma_k_extent(fit_block(params["block_k"], k), element_bytes)}


def gemm_cluster(params: dict[str, int], tiles_m: int | None, walks: bool) -> int:
    """The blocks of a thread-block cluster that compute consecutive tile rows of one tile column
    of a GEMM, B's tile copied once for all of them (the `cluster` param; 1: none). 1 where their
    pipelines could not hand stages over to one another (they need mma_async over 3+ stages, one
    of which the hand-over's lag takes, and neither a producer warpgroup nor split-K partials),
    where the persistent blocks (`programs`) are not whole clusters, and where a grid of one tile a
    block would not fill whole clusters: the tile rows (None: counted at run time) in whole
    clusters, unless the blocks `walk` tiles, where a cluster's last rows may lie past the output
    (their copies read padding, their stores are masked)."""
    c = params.get("cluster", 1)
    if (c <= 1 or not params.get("mma_async") or params["num_stages"] < 3 or params.get("warp_specialize")
            or params.get("split_k", 1) > 1 or params.get("programs", c) % c):
        return 1
    if not walks and (tiles_m is None or tiles_m % c):
        return 1
    return c


#: elements of a column-reduction tile per warp, at least: the widest vector (16 one-byte elements)
#: times a warp's 32 lanes, so that its layout covers the reduced rows no more than once
COLUMN_TILE_PER_WARP = 16 * 32


#: elements a row-reduction program aims to hold (a row that fits is read once)
ROW_TILE_ELEMENTS = 4096


def row_tile(params: dict[str, int], n_rows: int, row_elements: int) -> tuple[int, int, int]:
    """(rows a program, columns a chunk, chunks a row) of a row kernel over `n_rows` rows (a
    dynamic count's hint) of `row_elements`: block_n cut to the row (a power of two), and rows
    added up to ROW_TILE_ELEMENTS a tile, cut to block_m and to the rows there are."""
    bn = min(params["block_n"], 1 << max(0, row_elements - 1).bit_length())
    bm = min(params["block_m"], max(1, ROW_TILE_ELEMENTS // bn), 1 << max(0, n_rows - 1).bit_length())
    return bm, bn, -(-row_elements // bn)


def row_split(params: dict[str, int], row_elements: int) -> int:
    """The blocks of a cluster that share each row of a row kernel: as many as cut the row into
    chunks of block_n, at most the `cluster` param (1: no cluster). Each then reduces its share
    (`cdiv(row_elements, split)` columns, `row_tile`) and the cluster combines the shares."""
    return max(1, min(params.get("cluster", 1), -(-row_elements // params["block_n"])))


def column_tile(params: dict[str, int], n_red: int, n_col: int) -> tuple[int, int, int]:
    """(rows a step, columns, warps) of a column reduction's tile over `n_red` reduced rows and
    `n_col` kept columns: block_m x block_n cut to the sizes (powers of two), the warps the tile
    keeps busy, and rows raised until they fill COLUMN_TILE_PER_WARP elements a warp."""
    bn = min(params["block_n"], 1 << max(0, n_col - 1).bit_length())
    bm = min(params["block_m"], 1 << max(0, n_red - 1).bit_length())
    warps = min(params["num_warps"], 1 << (max(1, bm * bn // COLUMN_TILE_PER_WARP).bit_length() - 1))
    return max(bm, COLUMN_TILE_PER_WARP * warps // bn), bn, warps


def split_k_splits(steps: int, split_k: int) -> tuple[int, int]:
    """(splits, steps per split) of a GEMM's `steps` K steps for param `split_k`: the steps are
    dealt in equal runs (the last may be shorter), so 16 steps asked to split 5 ways make 4 runs of
    4, and a split never gets less than one step."""
    per_split = -(-steps // max(1, split_k))
    return -(-steps // per_split), per_split


#: the rows of one tensor-core fragment: a query block has at least this many rows, real or not
MMA_ROWS = 16


def attention_row_dim(sizes: Sequence[int], shared: Sequence[bool]) -> int:
    """Which dim of an attention's output [*batch, M, E] its kernel tiles as query rows: M, unless
    M is under one fragment's MMA_ROWS and a batch dim along which K and V do not vary (`shared`:
    grouped-query attention's query heads of one KV head) is longer. A decode step's one query
    per head then fills a block's rows with the G heads that share K and V, which the block reads
    once for all of them, where one block per head would read them G times and compute 15 of
    every 16 rows on padding."""
    rows = len(sizes) - 2
    sizes = [hint(n) for n in sizes]   # (a choice of speed: any dim is a correct row dim)
    if sizes[rows] >= MMA_ROWS:
        return rows
    longer = [i for i, ok in enumerate(shared) if ok and sizes[i] > sizes[rows]]
    return max(longer, key=lambda i: sizes[i], default=rows)


def attention_rows_of(m1, m2, bindings) -> int:
    """`attention_row_dim` of the attention softmax(m1) @ V = m2 (Graph IR matmuls)."""
    from . import graph as g

    out = [g.dim_value(d, bindings) for d in g.tensor_type(m2.res).shape]
    batch = len(out) - 2

    def varies(v, i: int) -> bool:   # operand v's batch dims are right-aligned with the output's
        dims = g.tensor_type(v).shape[:-2]
        j = i - (batch - len(dims))
        return j >= 0 and g.dim_value(dims[j], bindings) != 1
    return attention_row_dim(out, [not (varies(m1.rhs, i) or varies(m2.rhs, i)) for i in range(batch)])


def shared_bytes(kind: str, params: dict[str, int], features: dict[str, int]) -> int:
    """Shared memory of a kind's pipeline (the PTX backend swizzles tiles, so they take no padding)."""
    elem = features.get("element_bytes", 2)

    def tile(rows: int, cols: int, stages: int = 1) -> int:
        return stages * rows * cols * elem
    p = params
    if kind == "gemm":
        return tile(p["block_m"], p["block_k"], p["num_stages"]) + tile(p["block_k"], p["block_n"], p["num_stages"])
    if kind == "flash_attention":
        d = 1 << (features.get("head_dim", 128) - 1).bit_length()   # tiles span the head dim's power of two
        # (a persistent one copies the next tile's Q into a second stage)
        return tile(p["block_m"], d, 1 + bool(p.get("persistent"))) + 2 * tile(p["block_n"], d, p["num_stages"])
    if kind == "flash_chain":   # resident row tiles, the streamed ones in every stage, then per across
        # sum its operand's staged tile and its fp32 block's buffer (rows padded 16 bytes)
        d = 1 << (features.get("head_dim", 128) - 1).bit_length()
        return features.get("row_tiles", 1) * tile(p["block_m"], d) + \
            features.get("streamed_tiles", 2) * tile(p["block_n"], d, p["num_stages"]) + \
            features.get("staged_tiles", 0) * (tile(p["block_m"], p["block_n"]) + 4 * p["block_n"] * (d + 4))
    if kind == "row_reduction" and p.get("num_stages", 1) > 1:   # a row walk's stages: a row block of each
        # input read as the rows (`staged_row_bytes` a row element), where a row is one chunk
        n = features.get("row_elements", 0)
        bm, bn, chunks = row_tile(p, features.get("rows", 1), -(-n // row_split(p, n)))
        return p["num_stages"] * bm * bn * features.get("staged_row_bytes", 0) if chunks == 1 else 0
    return 0


def int_dict(d: dict[str, int]) -> DictionaryAttr:
    return DictionaryAttr({k: IntegerAttr(v, 64) for k, v in d.items()})


def space_dict(d: dict[str, Sequence[int]]) -> DictionaryAttr:
    return DictionaryAttr({k: ArrayAttr([IntegerAttr(v, 64) for v in vs]) for k, vs in d.items()})


@irdl_op_definition
class YieldOp(IRDLOperation):
    name = "schedule.yield"
    values = var_operand_def()
    traits = traits_def(IsTerminator())
    assembly_format = "$values attr-dict `:` type($values)"

    def __init__(self, values: Sequence[SSAValue]):
        super().__init__(operands=[list(values)])


@irdl_op_definition
class KernelOp(IRDLOperation):
    """One fused kernel: graph ops in, template choice and tiling parameters on top."""

    name = "schedule.kernel"
    inputs = var_operand_def()
    outputs = var_result_def()
    sym_name = prop_def(StringAttr)
    kind = prop_def(StringAttr)
    params = prop_def(DictionaryAttr)
    space = prop_def(DictionaryAttr)
    backend = opt_prop_def(StringAttr)       # absent: "ptx"
    backend_why = opt_prop_def(StringAttr)
    body = region_def()
    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = ("$sym_name $kind `(` $inputs `)` attr-dict `:` functional-type($inputs, $outputs) $body")

    def __init__(self, name: str, kind: str, inputs: Sequence[SSAValue], output_types: Sequence[Attribute],
                 body: Block, params: dict[str, int], space: dict[str, Sequence[int]],
                 backend: str = "ptx", backend_why: str | None = None):
        properties = {"sym_name": StringAttr(name), "kind": StringAttr(kind), "params": int_dict(params),
                      "space": space_dict(space), "backend": StringAttr(backend)}
        if backend_why is not None:
            properties["backend_why"] = StringAttr(backend_why)
        super().__init__(operands=[list(inputs)], result_types=[list(output_types)], regions=[Region(body)],
                         properties=properties)

    @property
    def param_values(self) -> dict[str, int]:
        return {k: v.value.data for k, v in self.params.data.items()}

    @property
    def backend_name(self) -> str:
        """The backend that compiles this kernel (`tessera.backends.BACKENDS`)."""
        return self.backend.data if self.backend is not None else "ptx"

    def _wgmma_columns(self, key: str, value: int) -> bool:
        """Whether `value` is a GEMM's block_n the wgmma path takes though not a power of two
        (`WGMMA_BLOCK_N`): an unsplit GEMM's, since a split one's partial products take mma.sync,
        whose warp tiling halves the tile (192 columns there computed wrong products). Whether the
        kernel takes wgmma is Target IR's choice: `tile_to_target._chosen_platform` refuses one
        with such a tile that does not."""
        return (key == "block_n" and self.kind.data == "gemm" and value in WGMMA_BLOCK_N
                and self.param_values.get("split_k", 1) == 1)

    def verify_(self) -> None:
        if self.kind.data not in KINDS:
            raise VerifyException(f"schedule.kernel {self.sym_name.data}: unknown kind {self.kind.data!r}; "
                                  f"expected one of {sorted(KINDS)}")
        if len(self.body.blocks) != 1:
            raise VerifyException(f"schedule.kernel {self.sym_name.data} must have exactly one block")
        if self.backend_name not in BACKENDS:
            raise VerifyException(f"schedule.kernel {self.sym_name.data}: unknown backend {self.backend_name!r}; "
                                  f"expected one of {sorted(BACKENDS)}")
        block = self.body.block
        if [a.type for a in block.args] != [v.type for v in self.inputs]:
            raise VerifyException(f"schedule.kernel {self.sym_name.data}: block arguments do not match its inputs")
        last = block.last_op
        if not isinstance(last, YieldOp):
            raise VerifyException(f"schedule.kernel {self.sym_name.data} must end with schedule.yield")
        if [v.type for v in last.values] != [r.type for r in self.outputs]:
            raise VerifyException(f"schedule.kernel {self.sym_name.data}: yielded types do not match its results")
        for key, value in self.params.data.items():
            allowed = self.space.data.get(key)
            ok = isinstance(value, IntegerAttr) and (value.value.data in (0, 1) if key in SWITCHES
                                                    else value.value.data >= 1)
            if not ok:
                kind = "0 or 1" if key in SWITCHES else "a positive int"
                raise VerifyException(f"schedule.kernel {self.sym_name.data}: param {key} must be {kind}")
            v = value.value.data
            if allowed is not None and key.startswith("block") and v & (v - 1) and not self._wgmma_columns(key, v):
                raise VerifyException(f"schedule.kernel {self.sym_name.data}: {key}={v} is not a power of two"
                                      + (" (192 columns: an unsplit GEMM only)" if key == "block_n" else ""))
        params = self.param_values
        if params.get("persistent") and "programs" not in params:
            raise VerifyException(f"schedule.kernel {self.sym_name.data}: persistent = 1 needs programs "
                                  "(the blocks that walk its tiles)")


Schedule = Dialect("schedule", [KernelOp, YieldOp], [])
