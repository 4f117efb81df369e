"""Tessera functions through the CUDA Tile IR backend on the CPU (issue 18): every case of
tests/cuda_tile_cases.py lowers to cuda_tile, its bytecode disassembles (tileirdisasm) to the text
we print, and tileiras assembles it for sm_90 into a cubin whose block size the launch reads.
These fill the cubin cache that tests/gpu/test_cuda_tile_gpu.py runs from."""
import pytest

import cuda_tile_cases as cases
from tessera.backends import UnsupportedByBackend
from tessera.backends.cuda_tile import kernels, text, tools
from tessera.ir import tile as t

needs_tileiras = pytest.mark.skipif(not tools.available() or tools.find_tool("tileirdisasm") is None,
                                    reason="tileiras not installed (pip install 'tessera[cuda-tile]')")


def test_tile_ir_for_cuda_tile_streams_no_shared_memory():
    """The backend's compiler pipelines loads itself: its Tile IR has plain loads, no copies into
    shared memory, waits or barriers (the PTX backend's Tile IR of the same function has them)."""
    case = cases.CASES["attention-fp16"]
    staged = {"tile.copy_async", "tile.alloc_shared", "tile.load_shared", "tile.barrier", "tile.async_wait"}

    def ops(backend):
        module = case.fn.compile(case.specs(), backend=backend).stage("tile")
        return {op.name for k in module.ops if isinstance(k, t.KernelOp) for op in k.walk()}
    assert not ops("cuda-tile") & staged
    assert ops("ptx") & staged


@pytest.mark.parametrize("case_id", sorted(cases.CASES))
def test_lowers_to_cuda_tile(case_id):
    case = cases.CASES[case_id]
    compiled = case.fn.compile(case.specs(), backend="cuda-tile")
    lowered = compiled.stage("cuda_tile")
    assert list(lowered) == compiled.kernel_names
    for name, kernel in lowered.items():
        assert kernel.text.startswith(f"cuda_tile.module @{name}")
        assert f"entry @{name}(" in kernel.text
        assert kernel.bytecode


@needs_tileiras
@pytest.mark.parametrize("case_id", sorted(cases.CASES))
def test_tileiras_assembles_each_kernel(case_id):
    case = cases.CASES[case_id]
    compiled = case.fn.compile(case.specs(), backend="cuda-tile")
    for name, kernel in compiled.stage("cuda_tile").items():
        assert text.normalize(tools.disassemble(kernel.bytecode)) == text.normalize(kernel.text)
    params = {k.sym_name.data: len(k.body.block.args) for k in compiled.stage("tile").ops if isinstance(k, t.KernelOp)}
    for name, cubin in compiled.stage("cubin").items():
        assert cubin.cubin[:4] == b"\x7fELF" and cubin.arch == "sm_90"
        launch = compiled.launches[name]
        assert launch.threads % 32 == 0 and launch.tensor_maps == () and launch.dynamic_shared == 0
        assert launch.pointers == params[name]


def test_unsupported_op_is_a_clear_error():
    """A device assert (no cuda_tile counterpart yet) names the backend and the op."""
    import tessera as tsr
    from tessera import Tensor

    @tsr.function
    def checked(x: Tensor["N"]):
        tsr.device_assert(x > 0, "x must be positive")
        return x * 2.0

    compiled = checked.compile(cases.Case("checked", checked, {"x": (64,)}).specs(), backend="cuda-tile")
    with pytest.raises(UnsupportedByBackend, match="CUDA Tile IR backend: tile.assert"):
        compiled.stage("cuda_tile")


def test_required_threads_reads_reqntid():
    """The block size tileiras compiled for is read from the cubin's .nv.info (EIATTR_REQNTID)."""
    import struct

    info = bytes([0x04, 0x10]) + struct.pack("<H", 12) + struct.pack("<III", 128, 2, 1)
    info = bytes([0x03, 0x1b, 0xff, 0x00]) + info
    assert kernels.required_threads(_elf({".nv.info.k": info}), "k") == 256
    with pytest.raises(Exception, match="REQNTID"):
        kernels.required_threads(_elf({".nv.info.k": bytes([0x03, 0x1b, 0xff, 0x00])}), "k")


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF file holding `sections` (for the .nv.info reader)."""
    import struct

    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    body = b"".join(sections.values())
    header_size = 64
    data_offset = header_size
    names_offset = data_offset + len(body)
    shoff = names_offset + len(names)
    headers = [bytes(64)]
    offset, name_at = data_offset, 1
    for name, data in sections.items():
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset, len(data), 0, 0, 1, 0))
        offset += len(data)
        name_at += len(name) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", name_at, 3, 0, 0, names_offset, len(names), 0, 0, 1, 0))
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    elf_header = ident + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                                     len(headers), len(headers) - 1)
    return elf_header + body + names + b"".join(headers)


def test_attention_schedule_for_cuda_tile():
    """Flash attention's defaults under the CUDA Tile IR backend (schedule.SHAPE_DEFAULTS'
    tile_compiler rules): 64 keys per block at D = 128 and an occupancy hint, which the entry
    carries to tileiras; the PTX backend's schedule asks two blocks of ptxas where its tiles leave
    them room (fusion's `_occupancy`), and not with 128 keys a block."""
    case = cases.CASES["causal-fp16"]    # D = 128
    tiled = case.fn.compile(case.specs(), backend="cuda-tile")
    (kernel,) = [k for k in tiled.stage("schedule").walk() if k.name == "schedule.kernel"]
    params = kernel.param_values
    assert params["block_n"] == 64 and params["occupancy"] == 2
    (lowered,) = [k for n, k in tiled.stage("cuda_tile").items() if not n.endswith("_partials")]
    assert "optimization_hints=<sm_90 = {occupancy = 2}>" in lowered.text
    for space, occupancy in (({}, 2), ({"block_n": [128]}, None)):
        ptx = case.fn.compile(case.specs(), space=space)
        (kernel,) = [k for k in ptx.stage("schedule").walk() if k.name == "schedule.kernel"]
        assert kernel.param_values.get("occupancy") == occupancy


@needs_tileiras
def test_artifact_of_a_cuda_tile_compile_carries_cubins_only():
    """The warm-start artifact of a cuda-tile compile: its cubins, no PTX image, tileiras named."""
    from tessera.runtime.artifact import Artifact

    case = cases.CASES["softmax-fp16"]
    compiled = case.fn.compile(case.specs(), backend="cuda-tile")
    artifact = Artifact.from_compiled(compiled, case.specs(), dims={})
    (record,) = artifact.record["kernels"].values()
    assert list(record["images"]) == ["sm_90a"] and list(artifact.record["toolchain"]) == ["tileiras"]


def test_sliced_loads_gather_with_masks():
    """Tiles at offsets that are not multiples of the tile (a slice starting at column 1) go
    through masked pointer tiles, and compute the same as float64 (NumPy run of the cuda_tile
    program)."""
    import numpy as np
    import tessera as tsr
    from tessera import Tensor
    from tessera.backends.cuda_tile import interp

    @tsr.function
    def diff(x: Tensor["M", "N"]):
        return x[:, 1:] - x[:, :-1]

    case = cases.Case("diff", diff, {"x": (37, 1000)})
    compiled = diff.compile(case.specs(), backend="cuda-tile")
    lowered = compiled.stage("cuda_tile")
    assert any("load_ptr_tko" in k.text for k in lowered.values())
    inputs = [cases.as_dtype(x, "fp16") for x in case.inputs()]
    (got,) = interp.run_kernels(lowered, compiled.stage("tile"), *inputs)
    assert not np.isnan(got).any()
    assert cases.relative_error(got, compiled.reference(*inputs)[0]) < cases.tolerance("fp16")
