"""Hand-built kernels through the whole foundation: encode, compare tileirdisasm's text of our
bytecode with our printer's text, and assemble with tileiras for sm_90 (skipped without the tools:
`pip install nvidia-cuda-tileiras`)."""
import os
import re
import subprocess
import tempfile

import cuda_tile_kernels
import pytest

from tessera.backends.cuda_tile import bytecode, text, tools

needs_tileiras = pytest.mark.skipif(tools.find_tool("tileiras") is None or tools.find_tool("tileirdisasm") is None,
                                    reason="tileiras/tileirdisasm not installed (pip install nvidia-cuda-tileiras)")

KERNELS = sorted(cuda_tile_kernels.ALL)


@needs_tileiras
@pytest.mark.parametrize("name", KERNELS)
def test_disassembly_matches_printer(name):
    module = cuda_tile_kernels.ALL[name]()
    disasm = tools.disassemble(bytecode.encode(module))
    assert text.normalize(disasm) == text.normalize(text.print_module(module))


@needs_tileiras
@pytest.mark.parametrize("name", KERNELS)
def test_tileiras_writes_cubin_with_entry(name):
    module = cuda_tile_kernels.ALL[name]()
    cubin = tools.assemble(bytecode.encode(module), arch="sm_90")
    assert cubin[:4] == b"\x7fELF"
    cuobjdump = tools.find_tool("cuobjdump")
    if cuobjdump is None:
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        elf = subprocess.run([cuobjdump, "-elf", path], capture_output=True, text=True, check=True).stdout
    entry = module.entries[0]
    assert f"Function : {entry.name}" in sass
    assert "EXIT" in sass
    # every entry argument is one kernel parameter: 8 bytes for a pointer, 4 for an i32
    sizes = [int(s, 16) for s in re.findall(r"Ordinal : 0x[0-9a-f]+\s+Offset\s+: 0x[0-9a-f]+\s+Size\s+: (0x[0-9a-f]+)", elf)]
    assert len(sizes) == len(entry.args)
    assert "EIATTR_REQNTID" in elf


@needs_tileiras
@pytest.mark.parametrize("version", bytecode.SUPPORTED_VERSIONS)
def test_every_version_assembles(version):
    module = cuda_tile_kernels.elementwise_exp_scale()
    data = bytecode.encode(module, version)
    assert data[8:10] == bytes(version)
    assert text.normalize(tools.disassemble(data)) == text.normalize(text.print_module(module))
    assert tools.assemble(data)[:4] == b"\x7fELF"


@needs_tileiras
def test_tileiras_reports_verifier_errors():
    from tessera.backends.cuda_tile.ir import F32, I32, Module, tile
    from tessera.errors import TesseraError
    m = Module()
    _, b = m.entry("bad", [tile(F32)])
    b.ftoi(m.entries[0].args[0], I32, rounding="zero")   # the dialect only allows nearest_int_to_zero
    b.return_()
    with pytest.raises(TesseraError, match="rounding"):
        tools.assemble(bytecode.encode(m))


@needs_tileiras
def test_supported_versions_listed():
    assert "13.1" in tools.supported_versions()
