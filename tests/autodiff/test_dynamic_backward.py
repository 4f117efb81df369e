"""Derivatives over dims taken at run time (issue 17): `tsr.vjp` of a function called with a new
sequence length every step compiles its saving forward and its backward once per class of the
length (`tessera.dims.CLASSES`), not once per value, the backward's flash_chain kernels (dK with
dV, dQ) counting their row blocks and column blocks at run time. Gradients on the CPU interpreter
against float64 derived by hand (tests/attention_cases.py), bf16 inputs (an fp32 matmul could go
to tileiras, which takes every dim as a constant)."""
from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest

import tessera as tsr
from attention_cases import FUNCTIONS, reference_grads
from tessera import Tensor, dtypes
from tessera.autodiff.api import Derivative, Layout, saving
from tessera.autodiff.backward import backward_graph, forward_function, saved_values
from tessera.compiler import compile_module
from tessera.dims import class_of

BF16 = ml_dtypes.bfloat16


def derivatives(fn):
    """fn's saving forward and its one vjp derivative (what `tsr.vjp` compiled)."""
    (backward,) = fn._vjp_derivatives.values()
    return saving(fn), backward


def check_grads(kind, fn, q, k, v, rng):
    out, f_vjp = tsr.vjp(fn, q, k, v)
    d_out = rng.standard_normal(out.shape).astype(BF16)
    got = f_vjp(d_out)
    for name, g, want in zip("qkv", got, reference_grads(kind, q, k, v, d_out)):
        assert g.shape == want.shape and not np.isnan(g.astype(np.float64)).any(), f"d{name}"
        err = np.linalg.norm(g.astype(np.float64) - want) / np.linalg.norm(want)
        assert err < 2e-2, f"d{name}: relative error {err:.2e} at shapes {q.shape}, {k.shape}"


@pytest.mark.parametrize("kind", ["causal", "softcap_causal"])
def test_one_backward_compile_serves_every_length_of_a_class(kind):
    fn = tsr.function(FUNCTIONS[kind].fn, dynamic=["S"])
    rng = np.random.default_rng(3)
    lengths = (17, 37, 45, 64, 100)   # three classes: <= 32 (whose top is no longer than D), <= 64, <= 128
    for s in lengths:
        q, k, v = (rng.standard_normal((1, 2, s, 32)).astype(BF16) for _ in range(3))
        check_grads(kind, fn, q, k, v, rng)
    classes = [class_of(s) for s in lengths]
    for f in derivatives(fn):
        info = f.cache_info()
        assert (info.compiles, info.fixed, info.dynamic) == (len(set(classes)), {}, ("S",)), info
        assert [key["S"] for key in info.keys] == list(dict.fromkeys(classes))


def test_cross_attention_takes_both_lengths_at_run_time():
    """Queries and keys of different lengths, each dynamic: the dK/dV and dQ kernels (their rows
    the keys and the queries) stay two kernels, compiled once."""
    fn = tsr.function(FUNCTIONS["plain"].fn, dynamic=["M", "N"])
    rng = np.random.default_rng(4)
    for m, n in ((33, 40), (50, 61), (64, 35)):
        q = rng.standard_normal((2, 1, m, 16)).astype(BF16)
        k, v = (rng.standard_normal((2, 1, n, 16)).astype(BF16) for _ in range(2))
        check_grads("plain", fn, q, k, v, rng)
    for f in derivatives(fn):
        assert (f.cache_info().compiles, f.cache_info().fixed) == (1, {})


def test_a_length_seen_twice_becomes_dynamic_in_the_backward_too():
    """No marks: the second length makes S dynamic (as for any function), in the saving forward
    and in the backward, whose saved log-sum-exp and cotangent take S from the forward's trace."""
    fn = tsr.function(FUNCTIONS["causal"].fn)
    rng = np.random.default_rng(5)
    for s in (40, 50, 60):
        q, k, v = (rng.standard_normal((1, 1, s, 16)).astype(BF16) for _ in range(3))
        check_grads("causal", fn, q, k, v, rng)
    forward, backward = derivatives(fn)
    assert backward.dim_annotations["d_out0"].dims == ("B", "H", "S", "D")
    for f in (forward, backward):
        info = f.cache_info()
        assert (info.compiles, info.hits, info.dynamic) == (2, 1, ("S",)), info   # 40, then 50 and 60 generic


def test_a_saved_value_with_a_dim_no_annotation_names_keys_by_value():
    """A result whose dims the forward's annotations do not all name stays unannotated in the
    derivative: its shape keys the compile by value, never by a class the compile does not take."""
    layout = Layout(1, (1,), (("B", "S"), ("B", 6)))
    fn = FUNCTIONS["causal"]
    assert layout.annotations(fn, ["saved0"], ["d_out0"], [0]) == {"d_out0": tsr.Tensor["B", "S"],
                                                                    "saved0": tsr.Tensor["B", 6]}
    odd = Layout(1, (1,), (("B", "S"), ("B", "S_times_2")))
    assert set(odd.annotations(fn, ["saved0"], ["d_out0"], [0])) == {"d_out0"}


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("d,dim", [(64, "S"), (128, "S"), (64, "B")])
def test_the_generic_backward_kernels_assemble(arch, d, dim):
    """The causal backward over a run-time S (or batch), on the wgmma path (tensor maps encoded per
    call) and on mma.sync, for a GPU's SMs (whose schedule choices read the dim's hint): every
    kernel's PTX assembles, and the chain kernels' grids grow with the dim."""
    fn = FUNCTIONS["causal"]
    module = fn.trace(fn.arg_specs_for({"B": 2, "H": 4, "S": 1000, "D": d}, "bf16"), None, frozenset({dim}), 32)
    saved = [f"saved{i}" for i in range(len(saved_values(forward_function(module))))]
    compiled = compile_module(backward_graph(module, None, False, "causal_vjp", ("d_out0",), saved), arch=arch,
                              sm_count=132)
    assert compiled.dynamic_dims == (dim,)
    chains = [launch for name, launch in compiled.launches.items() if "flash_chain" in name]
    assert len(chains) == 2 and all(launch.grid_terms for launch in chains)
    assert compiled.stage("cubin")


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_norm_backward_walks_a_row_count_taken_at_run_time(norm):
    """A norm's backward is one row kernel writing dx with the weight's (and bias's) column sums
    riding it (a persistent walk over row blocks, partial sums combined after): with the rows
    taken at run time the walk ends then, and blocks past it add nothing. Three row counts of one
    class, one compile, against float64."""
    @tsr.function(dynamic=["M"])
    def rms(x: tsr.Tensor["M", "N"], w: tsr.Tensor["N"]):
        return tsr.rms_norm(x, (x.shape[-1],), w, 1e-6)

    @tsr.function(dynamic=["M"])
    def layer(x: tsr.Tensor["M", "N"], w: tsr.Tensor["N"], b: tsr.Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    fn = rms if norm == "rms_norm" else layer
    rng = np.random.default_rng(6)
    for m in (600, 777, 1000):   # (one class: 513-1024 rows)
        x, dy = (rng.standard_normal((m, 96)).astype(BF16) for _ in range(2))
        params = [(1 + 0.1 * rng.standard_normal(96)).astype(BF16)] + \
            ([(0.1 * rng.standard_normal(96)).astype(BF16)] if norm == "layer_norm" else [])
        _, f_vjp = tsr.vjp(fn, x, *params)
        got = f_vjp(dy)
        x64, w64, dy64 = (a.astype(np.float64) for a in (x, params[0], dy))
        centered = x64 - x64.mean(-1, keepdims=True) if norm == "layer_norm" else x64
        rstd = 1 / np.sqrt((centered ** 2).mean(-1, keepdims=True) + (1e-5 if norm == "layer_norm" else 1e-6))
        xhat, g = centered * rstd, dy64 * w64
        dx = rstd * (g - (g.mean(-1, keepdims=True) if norm == "layer_norm" else 0) - xhat * (g * xhat).mean(-1, keepdims=True))
        want = [dx, (dy64 * xhat).sum(0)] + ([dy64.sum(0)] if norm == "layer_norm" else [])
        for name, a, w in zip(("dx", "dw", "db"), got, want):
            err = np.linalg.norm(a.astype(np.float64) - w) / np.linalg.norm(w)
            assert err < 1e-2, f"{name} at M = {m}: relative error {err:.2e}"
    for f in derivatives(fn):
        info = f.cache_info()
        assert (info.compiles, info.fixed) == (1, {}), info


@pytest.mark.parametrize("kind", ["plain", "causal"])
def test_multiples_of_128_compile_apart_and_other_lengths_never_reuse_them(kind):
    """A length that is a multiple of 128 compiles the forward and the backward without their
    column tails (`tessera.dims.whole_blocks`); the compiles name the dims they rely on, and the
    lengths between them run a compile of their own, every gradient against float64."""
    fn = tsr.function(FUNCTIONS[kind].fn, dynamic=["M", "N"] if kind == "plain" else ["S"])
    rng = np.random.default_rng(31)
    for s in (256, 200, 384, 130):
        q, k, v = (rng.standard_normal((1, 2, s, 16)).astype(BF16) for _ in range(3))
        check_grads(kind, fn, q, k, v, rng)
    for f in derivatives(fn):
        info = f.cache_info()
        lengths = [key.get("S", key.get("N")) for key in info.keys]
        assert lengths == ["dynamic<=256%128", "dynamic<=256", "dynamic<=512%128", "dynamic<=256"][:info.compiles]
        assert info.compiles == 3 and not f.specialization.unaligned & {"N", "S"}   # (M: the forward's queries)


def test_each_template_that_cuts_tails_names_the_dims_it_relies_on():
    """The safety of the %128 class: a compile whose code depends on a dim's multiple says so
    (`Compiled.dim_multiples`, checked by every call), for the attention's key loop, the backward's
    flash_chain kernels and a norm backward's column sums; compiled for any value, it says 1."""
    @tsr.function
    def norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
        return tsr.layer_norm(x, (x.shape[-1],), w, b)

    cases = [(FUNCTIONS["plain"], {"B": 1, "H": 2, "M": 256, "N": 256, "D": 16}, {"M", "N"}),
             (FUNCTIONS["causal"], {"B": 1, "H": 2, "S": 256, "D": 16}, {"S"}),
             (norm, {"M": 256, "N": 64}, {"M"})]
    for fn, dims, dynamic in cases:
        specs = fn.arg_specs_for(dims, dtypes.bf16)
        d_out = tsr.frontend.trace.ArgSpec("d_out", specs[0].shape, dtypes.bf16, specs[0].dims)
        derivative = Derivative(fn, cotangent_names=["d_out"])
        for aligned, multiple in ((frozenset(dynamic), 128), (frozenset(), 1)):
            c = derivative.compile([*specs, d_out], dynamic=frozenset(dynamic), aligned=aligned)
            assert c.dim_multiples == {d: multiple for d in dynamic}, (fn.name, c.dim_multiples)
