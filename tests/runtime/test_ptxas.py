"""ptxas and cuobjdump through tessera.runtime.ptxas (no GPU needed)."""
import pytest

from tessera.runtime import ptxas
from tessera.runtime.ptxas import PtxasError

pytestmark = pytest.mark.skipif(not ptxas.available(), reason="ptxas not installed")

# Stores its s32 and f32 params to the u64 pointer; `spill_me` has a 4 KB local
# array (a stack frame) and 1 KB of static shared memory.
PTX = """\
.version 8.0
.target {arch}
.address_size 64

.visible .entry store_params(
    .param .u64 out,
    .param .s32 n,
    .param .f32 x
)
{{
    .reg .b64 %rd<3>;
    .reg .b32 %r<2>;
    .reg .f32 %f<2>;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd2, %rd1;
    ld.param.s32 %r1, [n];
    ld.param.f32 %f1, [x];
    st.global.s32 [%rd2], %r1;
    st.global.f32 [%rd2+4], %f1;
    ret;
}}

.visible .entry spill_me(.param .u64 out)
{{
    .local .align 4 .b8 buf[4096];
    .shared .align 4 .b8 tile[1024];
    ret;
}}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_assemble_returns_a_cubin_and_the_resource_report(arch):
    out = ptxas.assemble(PTX.format(arch=arch), arch)
    assert out.cubin[:4] == b"\x7fELF" and out.arch == arch and out.opt_level == 3
    assert set(out.resources) == {"store_params", "spill_me"}
    store = out.resources["store_params"]
    assert 0 < store.registers <= 32
    assert (store.shared_bytes, store.stack_frame_bytes, store.spill_store_bytes) == (0, 0, 0)
    assert not store.spills
    spill_me = out.resources["spill_me"]
    assert spill_me.shared_bytes == 1024 and spill_me.stack_frame_bytes == 4096


def test_parse_resources_reads_every_field_and_skips_called_functions():
    log = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    24 bytes stack frame, 16 bytes spill stores, 8 bytes spill loads
ptxas info    : Function properties for helper
    48 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 24 bytes cumulative stack size, 2048 bytes smem, 368 bytes cmem[0]
"""
    assert ptxas.parse_resources(log) == {"k": ptxas.Resources(40, 2048, 24, 16, 8)}
    assert ptxas.parse_resources(log)["k"].spills


def test_syntax_error_quotes_the_offending_line():
    bad = PTX.format(arch="sm_90a").replace("st.global.s32 [%rd2], %r1;", "st.global.s32 [%rd2], %r1 oops;")
    with pytest.raises(PtxasError) as info:
        ptxas.assemble(bad, "sm_90a")
    message = str(info.value)
    assert "line 18" in message and "oops" in message
    assert "18 | st.global.s32 [%rd2], %r1 oops;" in message
    assert info.value.diagnostics[0][0] == 18
    assert "tessera-ptxas-" not in message  # no temp paths


def test_unknown_symbol_is_reported_with_its_line():
    bad = PTX.format(arch="sm_80").replace("ld.param.s32 %r1, [n];", "ld.param.s32 %r1, [missing];")
    with pytest.raises(PtxasError, match=r"line 16.*missing.*\n.*16 \| ld.param.s32 %r1, \[missing\];"):
        ptxas.assemble(bad, "sm_80")


def test_opt_level_is_checked():
    with pytest.raises(ValueError, match="opt_level must be 0, 1, 2 or 3"):
        ptxas.assemble(PTX.format(arch="sm_80"), "sm_80", opt_level=4)


def test_version_names_the_release():
    assert "release" in ptxas.version()


@pytest.mark.skipif(not (ptxas.available("cuobjdump") and ptxas.available("nvdisasm")),
                    reason="cuobjdump/nvdisasm not installed")
def test_sass_shows_the_stores():
    text = ptxas.sass(ptxas.assemble(PTX.format(arch="sm_80"), "sm_80").cubin)
    store_params = text.split("Function : store_params")[1]
    assert store_params.count("STG.E") == 2 and "EXIT" in store_params
