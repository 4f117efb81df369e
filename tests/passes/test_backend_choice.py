"""The backend of each kernel (`backend="auto"`, the default): the rules as data, the fallbacks with
their reasons, the Schedule/Tile/Target IR of a function whose kernels two backends compile, and
the autotune space's `backend`."""
import numpy as np
import pytest

import backend_auto_cases as cases
import tessera as tsr
from tessera import platforms
from tessera.backends import BACKENDS, UnsupportedByBackend
from tessera.backends.cuda_tile import tools
from tessera.dims import DynamicDim
from tessera.errors import TesseraError
from tessera.ir import schedule as s
from tessera.ir import target
from tessera.ir import tile as t
from tessera.passes import backend_choice
from tessera.passes.backend_choice import KernelFacts, choose
from tessera.runtime.autotune import normalize_space


scores = cases.scores


def specs(dtype, m=70, k=33, n=129):
    return scores.arg_specs_for(dict(M=m, K=k, N=n), dtype)


@pytest.fixture
def tileiras(monkeypatch):
    """Whether the rules see tileiras installed, set by the test (the choice reads only that)."""
    def set_installed(installed: bool):
        monkeypatch.setattr(backend_choice, "_tileiras_installed", lambda: installed)
    return set_installed


H100 = platforms.get("sm_90a")


def gemm_facts(no_instruction=frozenset({"fp32"}), dtypes=frozenset({"fp32"}), target=H100, **kw):
    return KernelFacts("gemm", no_matrix_instruction=no_instruction, dtypes=dtypes, target=target, **kw)


def test_the_rules_are_data_ending_in_one_that_takes_every_kernel():
    assert all(rule.backend in BACKENDS for rule in backend_choice.RULES)
    assert len({rule.name for rule in backend_choice.RULES}) == len(backend_choice.RULES)
    last = backend_choice.RULES[-1]
    for kind in s.KINDS:
        assert last.applies(KernelFacts(kind)) and last.applies(KernelFacts(kind, no_matrix_instruction={"fp32"}))


def test_a_matmul_without_a_matrix_instruction_goes_to_tileiras_when_it_is_there(tileiras):
    fp32 = gemm_facts()
    tileiras(True)
    assert choose(fp32) == backend_choice.Choice("cuda-tile", "rule fp32_matmul")
    assert choose(gemm_facts(frozenset(), frozenset({"fp16"}))) == backend_choice.Choice("ptx", "rule measured")
    tileiras(False)
    assert choose(fp32) == backend_choice.Choice(
        "ptx", "rule measured (fp32_matmul: cuda-tile cannot compile it, tileiras is not installed "
               "(pip install 'tessera[cuda-tile]'))")


def test_a_rule_for_a_backend_of_constant_dims_fixes_a_dynamic_dim(tileiras):
    """An fp32 matmul over a dynamic dim: the fp32 rule's backend (tileiras) takes no dim at run time,
    and the next rule's (PTX) cannot run the matmul on a GPU, so the dim is fixed (compiled per value)."""
    tileiras(True)
    with pytest.raises(DynamicDim, match="rule fp32_matmul gives this kernel to the cuda-tile backend"):
        choose(gemm_facts(dynamic="M"))
    assert choose(gemm_facts(frozenset(), frozenset({"fp16"}), dynamic="M")) == backend_choice.Choice("ptx", "rule measured")
    tileiras(False)   # a rule whose backend could not compile the kernel anyway fixes nothing
    assert choose(gemm_facts(dynamic="M")).backend == "ptx"


@pytest.mark.parametrize("facts, reason", [
    (gemm_facts(asserts=True), "it has no device_assert"),
    (gemm_facts(profiled=True), "it has no profile regions"),
    (gemm_facts(target=platforms.get("gfx942")), "it compiles for nvidia sm_80 and newer, not gfx942"),
    (gemm_facts(target=platforms.get("sm_75")), "it compiles for nvidia sm_80 and newer, not sm_75"),
    (gemm_facts(dtypes=frozenset({"fp32", "fp8_e4m3"})), "it has no fp8_e4m3 yet"),
])
def test_what_tileiras_cannot_compile_stays_with_ptx_and_says_why(tileiras, facts, reason):
    tileiras(True)
    choice = choose(facts)
    assert choice.backend == "ptx" and reason in choice.why and choice.why.startswith("rule measured (fp32_matmul")


def test_an_option_or_a_space_names_the_backend_of_every_kernel(tileiras):
    tileiras(False)
    fp16 = gemm_facts(frozenset(), frozenset({"fp16"}))
    assert choose(fp16, "cuda-tile") == backend_choice.Choice("cuda-tile", "the backend option")
    assert choose(gemm_facts(), "ptx") == backend_choice.Choice("ptx", "the backend option")
    assert choose(fp16, "auto", "cuda-tile") == backend_choice.Choice("cuda-tile", "the autotune space")
    tileiras(True)
    assert choose(gemm_facts(), "ptx", "auto") == backend_choice.Choice("cuda-tile", "rule fp32_matmul")
    with pytest.raises(TesseraError, match="a schedule space's backend is 'triton'; backends are auto, ptx, cuda-tile"):
        choose(fp16, "auto", "triton")


def test_fp8_without_a_matrix_instruction_is_not_an_fp32_rule(tileiras):
    """fp8 on sm_80 has no matrix instruction either, but no rule sends it to tileiras (which has
    no fp8 yet): PTX, which says what it cannot do."""
    tileiras(True)
    choice = choose(gemm_facts(frozenset({"fp8_e4m3"}), frozenset({"fp8_e4m3", "bf16"}), platforms.get("sm_80")))
    assert choice == backend_choice.Choice("ptx", "rule measured")


def test_the_ptx_error_says_why_the_kernel_is_ptxs(tileiras):
    """An fp32 GEMM with a device_assert, tileiras installed: PTX has it because tileiras has no
    asserts, and its refusal says so rather than suggesting to install tileiras."""
    tileiras(True)

    @tsr.function
    def checked(a: tsr.Tensor["M", "K"], b: tsr.Tensor["K", "N"]):
        y = tsr.matmul(a, b)
        tsr.device_assert(y < 1e30, "finite")
        return y

    compiled = checked.compile(checked.arg_specs_for(dict(M=64, K=32, N=64), tsr.fp32))
    with pytest.raises(UnsupportedByBackend, match=r"fp32 operands; this backend's tensor-core matmuls.*\(The PTX backend has kernel checked_gemm_0 by "
                                                   r"rule measured \(fp32_matmul: cuda-tile cannot compile it, it has no "
                                                   r"device_assert\)\.\)") as e:
        compiled.stage("ptx")
    assert "pip install" not in str(e.value)


def test_rules_named_finds_chosen_and_passed_over_rules():
    whys = ["rule measured (fp32_matmul: cuda-tile cannot compile it, tileiras is not installed)", "the backend option"]
    assert [rule.name for rule in backend_choice.rules_named(whys)] == ["fp32_matmul", "measured"]
    assert backend_choice.rules_named(["the autotune space"]) == []


def test_two_backends_in_one_function(tileiras):
    """fp32 scores: the GEMM is tileiras's (its operands are register tiles loaded from global
    memory), the softmax Tessera's PTX; each IR stage says so, each backend's stage holds its own
    kernels, and the CPU run of the whole matches float64."""
    tileiras(True)
    compiled = scores.compile(specs(tsr.fp32))
    assert compiled.kernel_backends == {"scores_gemm_0": ("cuda-tile", "rule fp32_matmul"),
                                        "scores_row_reduction_1": ("ptx", "rule measured")}
    assert 'backend = "cuda-tile", backend_why = "rule fp32_matmul"' in compiled.ir("schedule")
    gemm, row = (op for op in compiled.stage("tile").ops if isinstance(op, t.KernelOp))
    assert not any(isinstance(op, t.CopyAsyncOp) for op in gemm.walk())   # tileiras pipelines its loads
    kernels = {op.sym_name.data: op for op in compiled.stage("target").ops if isinstance(op, (t.KernelOp, target.KernelOp))}
    assert isinstance(kernels["scores_gemm_0"], t.KernelOp) and isinstance(kernels["scores_row_reduction_1"], target.KernelOp)
    assert list(compiled.stage("ptx")) == ["scores_row_reduction_1"]
    assert list(compiled.stage("cuda_tile")) == ["scores_gemm_0"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((70, 33)).astype(np.float32), rng.standard_normal((33, 129)).astype(np.float32)
    x = (a.astype(np.float64) @ b) * 0.5
    want = np.exp(x - x.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    np.testing.assert_allclose(compiled.run(a, b)[0], want, rtol=1e-5, atol=1e-6)


def test_16_bit_kernels_stay_with_ptx(tileiras):
    tileiras(True)
    compiled = scores.compile(specs(tsr.fp16))
    assert {backend for backend, _ in compiled.kernel_backends.values()} == {"ptx"}
    assert compiled.stage("cuda_tile") == {}


def test_without_tileiras_an_fp32_matmul_is_refused_with_the_way_out(tileiras):
    tileiras(False)
    compiled = scores.compile(specs(tsr.fp32))
    assert compiled.kernel_backends["scores_gemm_0"][0] == "ptx"
    with pytest.raises(UnsupportedByBackend, match=r"tessera\[cuda-tile\]"):
        compiled.stage("ptx")


@pytest.mark.skipif(not tools.available(), reason="tileiras not installed (CI installs the test extra's)")
def test_a_mixed_compile_assembles_every_kernel_and_launches_each_as_its_backend_says(tileiras):
    tileiras(True)
    compiled = scores.compile(specs(tsr.fp32))
    cubins = compiled.stage("cubin")
    assert set(cubins) == {"scores_gemm_0", "scores_row_reduction_1"}
    assert all(c.cubin[:4] == b"\x7fELF" for c in cubins.values())
    gemm, row = compiled.launches.values()   # in the Tile IR module's order
    assert (gemm.name, gemm.tensor_maps, gemm.programmatic) == ("scores_gemm_0", (), False)
    assert row.name == "scores_row_reduction_1" and row.arch == "sm_90a"


def test_the_autotune_space_takes_backends():
    assert normalize_space({"BACKEND": ["ptx", "cuda-tile", "auto"], "block_m": [64]}, "f") == \
        {"backend": ("ptx", "cuda-tile", "auto"), "block_m": (64,)}
    with pytest.raises(TesseraError, match=r"autotune space 'backend' must list backends \(auto, ptx, cuda-tile\)"):
        normalize_space({"backend": ["triton"]}, "f")


@pytest.mark.parametrize("pin", [["cuda-tile"], "cuda-tile"])
def test_a_space_pins_every_kernels_backend(tileiras, pin):
    tileiras(False)
    compiled = scores.compile(specs(tsr.fp16), space={"backend": pin})
    assert set(compiled.kernel_backends.values()) == {("cuda-tile", "the autotune space")}


def test_a_space_naming_no_backend_is_an_error():
    with pytest.raises(TesseraError, match="a schedule space's backend is 'triton'; backends are auto, ptx, cuda-tile"):
        scores.compile(specs(tsr.fp16), space={"backend": ["triton"]})


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_fp32_cases_split_between_backends_and_assemble(tileiras, name):
    """Each GPU case's kernels go to the backends it names; with tileiras, every kernel assembles
    (run with TESSERA_CACHE_DIR set, this fills the cubin cache the GPU test reads)."""
    tileiras(True)
    case = cases.CASES[name]
    compiled = case.fn.compile(case.specs())
    assert tuple(backend for backend, _ in compiled.kernel_backends.values()) == case.backends
    if tools.available():
        assert set(compiled.stage("cubin")) == set(compiled.kernel_names)


def test_the_tuned_gemms_cuda_tile_point_assembles(tmp_path):
    """The GPU test's autotuned GEMM, compiled as its tuner compiles the cuda-tile point on an
    H100/H200 (fills TESSERA_CACHE_DIR for a GPU machine without tileiras)."""
    gemm = cases.backend_tuned_gemm(tmp_path)
    compiled = gemm.compile(gemm.arg_specs_for(cases.TUNED_DIMS, tsr.fp16), arch="sm_90a", sm_count=132,
                            space={"backend": ["cuda-tile"]})
    assert {backend for backend, _ in compiled.kernel_backends.values()} == {"cuda-tile"}
    if tools.available():
        assert set(compiled.stage("cubin")) == set(compiled.kernel_names)


def test_a_dim_taken_at_run_time_never_reaches_tileiras():
    """Asked for CUDA Tile IR, a kernel over a dynamic dim is a DynamicDim naming it (the function
    then fixes the dim and compiles again); under auto it is PTX's, generic."""
    from tessera.dims import DynamicDim

    @tsr.function
    def soft(x: tsr.Tensor["M", "N"]):
        return tsr.softmax(x, dim=-1)

    spec = soft.arg_specs_for(dict(M=100, N=64), tsr.fp16)
    with pytest.raises(DynamicDim, match="the cuda-tile backend takes every dim as a constant"):
        soft.compile(spec, None, frozenset({"M"}), backend="cuda-tile")
    assert soft.compile(spec, None, frozenset({"M"})).dynamic_dims == ("M",)
