"""Target IR: text round trip of every op and attribute, and the verifiers."""
import pytest
from xdsl.dialects import arith
from xdsl.dialects.builtin import IndexType, IntegerAttr, MemRefType, f16, i32
from xdsl.utils.exceptions import VerifyException

from tessera import platforms
from tessera.ir import target
from tessera.ir.target import KernelConfigAttr, PlatformAttr

CONFIG = "#tessera_target.kernel_config<grid = [4, 4, 1], block = [128, 1, 1], shared = 16384, regs = 64>"
SM80 = '#tessera_target.platform<"nvidia", "sm_80", 108>'
SM90A = '#tessera_target.platform<"nvidia", "sm_90a", 132>'
SHARED = "memref<2x64x32xf16, 3 : i64>"
GLOBAL = "memref<256x128xf16>"
TILE = "tensor<64x32xf16>"
ACC = "tensor<64x64xf32>"

CLUSTERED = "#tessera_target.kernel_config<grid = [4, 1, 1], block = [128, 1, 1], shared = 64, regs = 64>"

# Every op of the dialect, every attribute and type, every optional part.
DESC = "!tessera_target.wgmma_descriptor<f16, [64, 64], major = mn>"
SUM, DQ = "memref<256x132xf32>", "tensor<64x128xf32>"
STAGED = ("tessera_target.scratch = #tessera_target.scratch<offset = 16400, size = 33792>, "
          "tessera_target.staging = #tessera_target.staging<cols = 132, pitch = 528>")

EVERY_OP = f"""builtin.module {{
  tessera_target.kernel @k(%a: {GLOBAL}, %x: {TILE}, %y: tensor<32x64xf16>, %acc: {ACC}, %p: i1) config = {CONFIG} platform = {SM80} opt_level = 3 {{
    %c0 = arith.constant 0 : index
    %buf = tessera_target.allocate pool = "shared" align = 128 size = 8192 offset = 0 : {SHARED}
    tessera_target.profile_begin label = "mainloop"
    tessera_target.memcpy %buf[%c0], %a[%c0, %c0] kind = "global_to_shared" async = true mechanism = "cp.async" tile_dims = [0, 1] padding = 0.000000e+00 : f64 : {SHARED}, {GLOBAL}
    tessera_target.cp_async_commit
    tessera_target.cp_async_wait pending = 0
    tessera_target.barrier
    %d = tessera_target.tensor_core "mma.sync" (%x, %y, %acc) shape = [16, 8, 16] layout = "nn" precision = "f16" : ({TILE}, tensor<32x64xf16>, {ACC}) -> {ACC}
    tessera_target.profile_end label = "mainloop"
    tessera_target.assert %p message = "bad tile"
    tessera_target.return
  }}
  tessera_target.kernel @hopper(%g: {GLOBAL}, %x: tensor<64x64xf16>, %acc: {ACC}, %sum: {SUM}, %dq: {DQ}) config = #tessera_target.kernel_config<grid = [1, 1, 1], block = [384, 1, 1], shared = 16400, regs = 168> platform = {SM90A} producer_warps = 4 maxnreg = 168 {{
    %m = tessera_target.tensor_map %g : {GLOBAL} -> !tessera_target.tensor_map<f16, [256, 128], box = [64, 64], swizzle = 128>
    %buf = tessera_target.allocate pool = "shared" align = 1024 size = 16384 offset = 0 swizzle = "tma_128b" : memref<2x64x64xf16, 3 : i64>
    %b = tessera_target.mbarrier_alloc offset = 16384 : !tessera_target.mbarriers<2>
    %f = tessera_target.mbarrier_alloc : !tessera_target.mbarriers<2>
    tessera_target.mbarrier_init %b arrivals = 1 : !tessera_target.mbarriers<2>
    tessera_target.mbarrier_init %f arrivals = 8 : !tessera_target.mbarriers<2>
    tessera_target.fence kind = "mbarrier_init"
    tessera_target.barrier
    %s = arith.constant 0 : index
    %parity = arith.constant 0 : i32
    tessera_target.warp_specialize producer_warps = 4 {{
      tessera_target.setmaxnreg "dec" regs = 40
      tessera_target.mbarrier_try_wait %f[%s] parity %parity : !tessera_target.mbarriers<2>
      tessera_target.mbarrier_arrive_expect_tx %b[%s] bytes = 8192 : !tessera_target.mbarriers<2>
      tessera_target.tma_load %m[%s, %s], %buf[%s] + 0, %b[%s] : !tessera_target.tensor_map<f16, [256, 128], box = [64, 64], swizzle = 128>, memref<2x64x64xf16, 3 : i64>, !tessera_target.mbarriers<2>
    }} {{
      tessera_target.setmaxnreg "inc" regs = 232
      tessera_target.warpgroup_turn "give" warpgroup = 1
      tessera_target.warpgroup_turn "take"
      tessera_target.mbarrier_try_wait %b[%s] parity %parity : !tessera_target.mbarriers<2>
      %t = tessera_target.wgmma_descriptor %buf[%s] leading = 8192 stride = 1024 swizzle = 128 per_warpgroup = 0 : memref<2x64x64xf16, 3 : i64> -> {DESC}
      tessera_target.wgmma_fence
      %r = tessera_target.tensor_core "wgmma" (%x, %t, %acc) shape = [64, 64, 16] layout = "nn" precision = "f16" : (tensor<64x64xf16>, {DESC}, {ACC}) -> {ACC}
      tessera_target.wgmma_commit
      tessera_target.wgmma_wait pending = 0
      tessera_target.mbarrier_arrive %f[%s] per = "warp" : !tessera_target.mbarriers<2>
      tessera_target.barrier id = 1 threads = 256
    }}
    tessera_target.bulk_wait pending = 0 read
    tessera_target.barrier
    tessera_target.stage_rows %dq rows_dim = 0 {{{STAGED}}} : {DQ}
    tessera_target.fence kind = "async_shared"
    tessera_target.barrier
    tessera_target.bulk_reduce %sum[%s, %s] tile_dims = [0, 1] rows = 64 {{{STAGED}}} : {SUM}
    tessera_target.bulk_wait pending = 0
    tessera_target.return
  }}
  tessera_target.kernel @clustered(%g: {GLOBAL}) config = {CLUSTERED} platform = {SM90A} cluster = 2 {{
    tessera_target.cluster_barrier "arrive"
    tessera_target.cluster_barrier "wait"
    tessera_target.return
  }}
  func.func @main(%a: {GLOBAL}, %x: {TILE}, %y: tensor<32x64xf16>, %acc: {ACC}, %p: i1) {{
    tessera_target.launch @k(%a, %x, %y, %acc, %p) grid = [4, 4, 1] block = [128, 1, 1] shared = 16384 : {GLOBAL}, {TILE}, tensor<32x64xf16>, {ACC}, i1
    func.return
  }}
}}
"""


def test_every_op_round_trips_exactly():
    module = target.parse_target_module(EVERY_OP)
    module.verify()
    assert target.print_module(module) == EVERY_OP
    names = {op.name for op in module.walk()}
    assert {op.name for op in target.TesseraTarget.operations} <= names


def test_attributes_print_like_the_seeds():
    p = PlatformAttr.of(platforms.get("sm_90a"))
    cfg = KernelConfigAttr.of((128, 64, 1), (128, 1, 1), 49152, 128)
    assert str(p) == '#tessera_target.platform<"nvidia", "sm_90a", 132>'
    assert str(cfg) == ("#tessera_target.kernel_config<grid = [128, 64, 1], block = [128, 1, 1], "
                        "shared = 49152, regs = 128>")
    assert p.platform.has("wgmma") and cfg.threads == 128


def test_platform_attr_rejects_unknown_arch_and_wrong_vendor():
    with pytest.raises(Exception, match="unknown GPU architecture 'sm_42'"):
        target.parse_target_module(EVERY_OP.replace('"sm_80"', '"sm_42"'))
    with pytest.raises(Exception, match="sm_90a is an nvidia target"):
        target.parse_target_module(EVERY_OP.replace('"nvidia", "sm_90a"', '"amd", "sm_90a"'))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_compiled_attention_reads_back(arch):
    """What the compiler prints for a causal attention (masks are tensors of i1, selects on tiles)
    parses and prints back the same, on both code paths."""
    from seed_kernels import causal_attention
    compiled = causal_attention.compile(causal_attention.arg_specs_for(dict(B=1, H=2, S=100, D=64), "fp16"),
                                        arch=arch)
    text = compiled.ir("target")
    module = target.parse_target_module(text)
    module.verify()
    assert target.print_module(module) == text


def test_compiled_fp8_attention_over_permuted_keys_reads_back():
    """A causal fp8 attention (no warpgroup turns) reads K through a map in 8-bit A order
    (`byte_a_rows`) and holds its scores in `Mma.byte_a` layout; the text parses and prints back."""
    from fp8_attention import causal_fp8_attention
    compiled = causal_fp8_attention.compile(causal_fp8_attention.arg_specs_for(
        dict(B=2, H=2, S=512, N=512, D=64), "fp8_e4m3"), arch="sm_90a")
    text = compiled.ir("target")
    assert "{byte_a_rows}" in text and ", byte_a>" in text
    module = target.parse_target_module(text)
    module.verify()
    assert target.print_module(module) == text


def _box_rows(m: target.TensorMapType, first_group: int) -> list[int]:
    """The tensor rows one box of `m` at [first_group, 0, 0, 0, 0] lands in shared memory, in order
    (a box fills shared memory innermost dim fastest), for a map whose rows are `strides[-2]` apart."""
    import itertools
    row_stride = m.element_strides[3]
    rows = []
    for index in itertools.product(*(range(b) for b in m.box_dims[:-1])):
        coords = (first_group + index[0], *index[1:])
        rows.append(sum(c * st for c, st in zip(coords, m.element_strides)) // row_stride)
    return rows


@pytest.mark.parametrize("shape,box_rows", [((256, 128), 64), ((2, 3, 48, 64), 32)])
def test_a_map_reading_rows_in_byte_a_order(shape, box_rows):
    """`TensorMapType.byte_a_rows`: box row 16h + 8g + 2t + e is tensor row 16h + 4t + 2g + e past the
    box's first, the order `Mma.byte_a` holds keys in; its op verifies against the tensor it reads."""
    from xdsl.dialects.builtin import Float8E4M3FNType
    f8 = Float8E4M3FNType()
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    m = target.TensorMapType.byte_a_rows(f8, shape, strides, box_rows, shape[-1], 128)
    for group in (0, 3):
        want = [16 * group + 16 * (p // 16) + 4 * (p % 8 // 2) + 2 * (p % 16 // 8) + p % 2 for p in range(box_rows)]
        assert _box_rows(m, group) == want
    assert m.box_bytes == box_rows * shape[-1]
    memref = f"memref<{'x'.join(map(str, shape))}xf8E4M3FN>"
    module = f"""builtin.module {{
  tessera_target.kernel @k(%g: {memref}) config = {CONFIG} platform = {SM90A} {{
    %m = tessera_target.tensor_map %g {{byte_a_rows}} : {memref} -> {m}
    tessera_target.return
  }}
}}
"""
    parsed = target.parse_target_module(module)
    parsed.verify()
    assert target.print_module(parsed) == module
    plain = target.TensorMapType.of(f8, shape, [1] * (len(shape) - 2) + [box_rows, shape[-1]], 128)
    assert "is not " + memref + " read with its rows in groups of 16" in verify_error(module.replace(str(m), str(plain)))
    gapped = f"memref<{'x'.join(map(str, shape))}xf8E4M3FN, strided<{[2 * x for x in strides[:-1]] + [2]}>>"
    assert "as one run of rows, which it is not" in verify_error(module.replace(memref, gapped))


def verify_error(text: str) -> str:
    module = target.parse_target_module(text)
    with pytest.raises(VerifyException) as e:
        module.verify()
    return str(e.value)


def test_too_many_threads():
    text = EVERY_OP.replace("block = [128, 1, 1], shared = 16384", "block = [1024, 2, 1], shared = 16384")
    assert "block [1024, 2, 1] = 2048 threads exceeds the 1024 threads per block of sm_80" in verify_error(text)


def test_too_much_shared_memory():
    text = EVERY_OP.replace(f"{CONFIG} platform = {SM80}",
                            f"{CONFIG.replace('16384', '200000')} platform = {SM80}")
    assert "shared = 200000 bytes exceeds the 166912 bytes per block of sm_80" in verify_error(text)


def test_registers_must_fit_on_an_sm():
    text = EVERY_OP.replace("block = [128, 1, 1], shared = 16384, regs = 64",
                            "block = [1024, 1, 1], shared = 16384, regs = 128")
    assert "1024 threads x 128 registers exceeds the 65536 registers" in verify_error(text)


def test_a_cluster_needs_a_platform_with_clusters_and_whole_clusters_of_blocks():
    on_sm80 = EVERY_OP.replace(f"{CLUSTERED} platform = {SM90A}", f"{CLUSTERED} platform = {SM80}")
    assert "cluster_barrier needs clusters, which sm_80 does not have" in verify_error(on_sm80)
    barriers = ('    tessera_target.cluster_barrier "arrive"\n', '    tessera_target.cluster_barrier "wait"\n')
    assert "clusters of 2 blocks, which sm_80 does not have" in verify_error(
        on_sm80.replace(barriers[0], "").replace(barriers[1], ""))
    assert "grid [4, 1, 1] is not whole clusters of 3 along x" in verify_error(EVERY_OP.replace("cluster = 2", "cluster = 3"))
    assert "a cluster of 16 blocks; 1 to 8 are portable" in verify_error(EVERY_OP.replace("cluster = 2", "cluster = 16"))


def test_wgmma_is_not_available_on_sm80():
    text = EVERY_OP.replace('tensor_core "mma.sync" (%x, %y, %acc) shape = [16, 8, 16]',
                            'tensor_core "wgmma" (%x, %y, %acc) shape = [64, 64, 16]')
    assert "'wgmma' is not available on sm_80 (available: mma.sync, wmma)" in verify_error(text)


def test_wgmma_reads_b_through_a_descriptor():
    text = EVERY_OP.replace('tensor_core "mma.sync" (%x, %y, %acc) shape = [16, 8, 16]',
                            'tensor_core "wgmma" (%x, %y, %acc) shape = [64, 64, 16]')
    text = text.replace(SM80, '#tessera_target.platform<"nvidia", "sm_90a", 132>')
    text = text.replace('mechanism = "cp.async"', 'mechanism = "tma"')
    assert "tensor_core wgmma: b must be a !tessera_target.wgmma_descriptor" in verify_error(text)
    described_mma_sync = EVERY_OP.replace('"wgmma" (%x, %t, %acc) shape = [64, 64, 16]',
                                          '"mma.sync" (%x, %t, %acc) shape = [16, 8, 16]')
    assert "tensor_core mma.sync: reads register tiles, not wgmma descriptors" in verify_error(described_mma_sync)


def test_wgmma_descriptor_verifier():
    wrong_stage = EVERY_OP.replace("wgmma_descriptor<f16, [64, 64], major = mn>",
                                   "wgmma_descriptor<f16, [64, 32], major = mn>")
    assert "does not describe a stage of memref<2x64x64xf16, 3 : i64>" in verify_error(wrong_stage)
    assert "leading = 8200 is not a multiple of 16" in verify_error(EVERY_OP.replace("leading = 8192", "leading = 8200"))
    assert "swizzle = 32 is not one of 128, 64" in verify_error(EVERY_OP.replace("swizzle = 128 per", "swizzle = 32 per"))
    with pytest.raises(VerifyException, match="major must be one of k, mn"):
        target.parse_target_module(EVERY_OP.replace("major = mn", "major = m"))


def test_tensor_core_shape_and_precision_come_from_the_registry():
    text = EVERY_OP.replace("shape = [16, 8, 16]", "shape = [16, 8, 8]")
    assert "mma.sync on sm_80 has no shape [16, 8, 8] with precision 'f16'" in verify_error(text)


def test_copy_mechanism_must_exist_on_the_platform():
    text = EVERY_OP.replace('mechanism = "cp.async"', 'mechanism = "tma"')
    assert "mechanism on sm_80" in verify_error(text)


def test_memcpy_checks_memory_spaces():
    text = EVERY_OP.replace('kind = "global_to_shared"', 'kind = "shared_to_global"')
    assert "memcpy shared_to_global: src memref<256x128xf16> is not in shared memory" in verify_error(text)


def test_async_ops_need_their_features():
    """TMA and mbarriers need `tma`, wgmma groups `wgmma`, setmaxnreg the "a" features."""
    on_sm90 = EVERY_OP.replace(SM90A, '#tessera_target.platform<"nvidia", "sm_90", 132>')
    assert "setmaxnreg needs setmaxnreg, which sm_90 does not have" in verify_error(on_sm90)
    on_sm80 = EVERY_OP.replace(SM90A, '#tessera_target.platform<"nvidia", "sm_80", 108>')
    assert "needs tma, which sm_80 does not have" in verify_error(on_sm80)
    wgmma_wait_on_sm80 = EVERY_OP.replace("tessera_target.cp_async_wait pending = 0", "tessera_target.wgmma_wait pending = 0")
    assert "wgmma_wait needs wgmma, which sm_80 does not have" in verify_error(wgmma_wait_on_sm80)


def test_multicast_copies_and_cluster_arrivals_round_trip_and_verify():
    """A multicast tma_load (the cluster's boxes stacked along the map's rows, each block's box
    copied into every block) and an arrival on every block's mbarrier print as they parse; boxes
    past the stage are refused."""
    shared = EVERY_OP.replace("box = [64, 64]", "box = [32, 64]").replace(
        "%buf[%s] + 0, %b[%s] :", "%buf[%s] + 0, %b[%s] multicast = 2 :").replace(
        'mbarrier_arrive %f[%s] per = "warp"', 'mbarrier_arrive %f[%s] per = "cluster"')
    module = target.parse_target_module(shared)
    module.verify()
    assert target.print_module(module) == shared
    (load,) = [op for op in module.walk() if isinstance(op, target.TmaLoadOp)]
    assert load.copies == 2
    too_many = shared.replace("multicast = 2", "multicast = 4")
    assert "4 4096-byte boxes at offset 0 does not fit a 8192-byte stage" in verify_error(too_many)


def test_async_op_verifiers():
    box_too_far = EVERY_OP.replace("%buf[%s] + 0, %b[%s]", "%buf[%s] + 4096, %b[%s]")
    assert "a 8192-byte box at offset 4096 does not fit a 8192-byte stage" in verify_error(box_too_far)
    wrong_map = EVERY_OP.replace("tensor_map<f16, [256, 128], box", "tensor_map<f16, [256, 64], box")
    assert "does not describe memref<256x128xf16>" in verify_error(wrong_map)
    no_arrivals = EVERY_OP.replace("arrivals = 8", "arrivals = 0")
    assert "arrivals = 0 must be positive" in verify_error(no_arrivals)
    odd_regs = EVERY_OP.replace('"inc" regs = 232', '"inc" regs = 230')
    assert "regs = 230 must be a multiple of 8" in verify_error(odd_regs)
    negative = EVERY_OP.replace("cp_async_wait pending = 0", "cp_async_wait pending = -1")
    assert "pending = -1 must not be negative" in verify_error(negative)
    partial_warp = EVERY_OP.replace("id = 1 threads = 256", "id = 1 threads = 100")
    assert "threads = 100 is not whole warps" in verify_error(partial_warp)
    assert "per must be one of" in verify_error(EVERY_OP.replace('per = "warp"', 'per = "block"'))
    assert "swizzle must be one of" in verify_error(EVERY_OP.replace('swizzle = "tma_128b"', 'swizzle = "64b"'))


def test_bulk_reduction_op_verifiers():
    overrun = EVERY_OP.replace("rows = 64", "rows = 65")
    assert "65 rows of 528 bytes overrun its 33792-byte scratch" in verify_error(overrun)
    assert "rows_dim = 2 of a 2-d tile" in verify_error(EVERY_OP.replace("rows_dim = 0", "rows_dim = 2"))
    assert "is not an f32 global memref" in verify_error(EVERY_OP.replace(SUM, "memref<256x132xf16>"))
    assert "tile_dims [1, 0] for a 2-d destination" in verify_error(EVERY_OP.replace("tile_dims = [0, 1] rows",
                                                                                    "tile_dims = [1, 0] rows"))
    unstaged = EVERY_OP.replace(f"%dq rows_dim = 0 {{{STAGED}}}", "%dq rows_dim = 0")
    assert "stage_rows: needs a tessera_target.scratch attribute" in verify_error(unstaged)


def test_launch_must_match_the_kernel_config():
    text = EVERY_OP.replace("grid = [4, 4, 1] block = [128, 1, 1] shared = 16384 :",
                            "grid = [8, 4, 1] block = [128, 1, 1] shared = 16384 :")
    assert "launch of @k: grid/block/shared" in verify_error(text)


def test_allocate_size_covers_the_buffer():
    text = EVERY_OP.replace("size = 8192", "size = 4096")
    assert "size = 4096 bytes is less than the 8192 bytes" in verify_error(text)


def test_kernel_block_arguments_must_match_function_type():
    kernel = target.KernelOp("k", [MemRefType(f16, [4])], KernelConfigAttr.of((1, 1, 1), (32, 1, 1), 0, 32),
                             PlatformAttr.of(platforms.get("sm_80")))
    kernel.body.block.add_op(target.ReturnOp())
    kernel.body.block.insert_arg(i32, 1)
    with pytest.raises(VerifyException, match="block arguments .* do not match function_type inputs"):
        kernel.verify()


def test_builders_make_verifiable_ops():
    p = PlatformAttr.of(platforms.get("sm_90a"))
    kernel = target.KernelOp("k", [MemRefType(f16, [64, 64])], KernelConfigAttr.of((1, 1, 1), (128, 1, 1), 8192, 64), p)
    block = kernel.body.block
    shared = target.AllocateOp(MemRefType(f16, [1, 64, 64], memory_space=IntegerAttr(3, 64)), "shared", 8192, 1024)
    zero = arith.ConstantOp.from_int_and_width(0, IndexType())
    block.add_ops([zero, shared,
                   target.MemcpyOp(shared.result, [zero.result], block.args[0], [zero.result, zero.result],
                                   "global_to_shared", True, "tma", (0, 1)),
                   target.BarrierOp(), target.ReturnOp()])
    kernel.verify()
