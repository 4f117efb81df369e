"""The autotuner's parts that need no GPU: the space, the choice, the key, the on-disk cache."""
import json
import logging

import numpy as np
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import TesseraError
from tessera.runtime import autotune
from tessera.runtime.autotune import Autotuner, TuningCache, Tuned, normalize_space, points


def test_space_takes_the_seed_spelling_and_rejects_unknown_names():
    space = normalize_space(dict(BLOCK_M=[64, 128], num_warps=4, mma_async=[0, 1]), "f")
    assert space == {"block_m": (64, 128), "num_warps": (4,), "mma_async": (0, 1)}
    with pytest.raises(TesseraError, match="'BLOCK_Q'.*known parameters: .*block_m"):
        normalize_space(dict(BLOCK_Q=[1]), "f")
    with pytest.raises(TesseraError, match="'num_warps' must list positive ints"):
        normalize_space(dict(num_warps=[0]), "f")
    with pytest.raises(TesseraError, match="'mma_async' must list 0 or 1"):
        normalize_space(dict(mma_async=[2]), "f")
    assert normalize_space(dict(persistent=1, PROGRAMS=[132, 264]), "f") == {"persistent": (1,),
                                                                          "programs": (132, 264)}


def test_points_start_with_the_first_values():
    assert points({"a": (1, 2), "b": (3, 4)}) == [{"a": 1, "b": 3}, {"a": 1, "b": 4}, {"a": 2, "b": 3},
                                                   {"a": 2, "b": 4}]


def tuner(tmp_path, key=("M", "N")):
    return Autotuner("gemm", {"block_m": (64, 128), "num_warps": (4, 8)}, key, tmp_path, "src0")


def test_choose_measures_once_skips_failures_and_keeps_the_fastest(tmp_path):
    times = {(64, 4): 3.0, (64, 8): 2.0, (128, 4): 1.0}   # (128, 8) fails
    calls = []

    def measure(config):
        calls.append(config)
        t = times.get((config["block_m"], config["num_warps"]))
        if t is None:
            raise TesseraError("too many warps for this tile")
        return t
    t = tuner(tmp_path)
    assert t.choose("k1", measure) == {"block_m": 128, "num_warps": 4}
    assert len(calls) == 4
    tuned = t.results["k1"]
    assert [tr.skipped is not None for tr in tuned.trials] == [False, False, False, True]
    assert "too many warps" in tuned.trials[-1].skipped
    assert t.choose("k1", measure) == {"block_m": 128, "num_warps": 4} and len(calls) == 4


def test_a_new_process_reads_the_choice_from_disk(tmp_path):
    tuner(tmp_path).choose("k1", lambda c: c["block_m"] * c["num_warps"])
    again = tuner(tmp_path)
    assert again.choose("k1", lambda c: pytest.fail("measured again")) == {"block_m": 64, "num_warps": 4}
    other_source = Autotuner("gemm", again.space, again.key, tmp_path, "src1")
    assert other_source.cache.path != again.cache.path   # an edited function tunes again


def test_no_runnable_point_is_an_error_naming_the_reasons(tmp_path):
    def measure(config):
        raise TesseraError("needs 300000 bytes of shared memory")
    with pytest.raises(TesseraError, match="no point of the autotune space runs.*300000 bytes"):
        tuner(tmp_path).choose("k1", measure)


def test_tuning_key_uses_the_key_dims_only(tmp_path):
    t = tuner(tmp_path)
    target = {"device": "H100", "arch": "sm_90a", "path": "native"}
    k1 = t.tuning_key({"M": 64, "N": 32, "B": 2}, ["float16"], {}, target)
    assert k1 == t.tuning_key({"M": 64, "N": 32, "B": 7}, ["float16"], {}, target)
    assert k1 != t.tuning_key({"M": 64, "N": 64, "B": 2}, ["float16"], {}, target)
    assert k1 != t.tuning_key({"M": 64, "N": 32, "B": 2}, ["bfloat16"], {}, target)
    with pytest.raises(TesseraError, match="autotune key names dim.*M.*no argument"):
        t.tuning_key({"N": 32}, [], {}, target)
    every = tuner(tmp_path, key=())
    assert every.tuning_key({"M": 1, "B": 2}, [], {}, target) != every.tuning_key({"M": 1, "B": 3}, [], {}, target)


def test_unreadable_cache_is_set_aside_not_trusted(tmp_path, caplog):
    cache = TuningCache(tmp_path / "f.json")
    cache.path.write_text('{"k": {"config": {"block_m": "big"}, "ms": 1}}')
    with caplog.at_level(logging.WARNING, logger="tessera.autotune"):
        assert cache.load() == {}
    assert "unreadable" in caplog.text and (tmp_path / "f.json.unreadable").exists()
    cache.store("k", Tuned({"block_m": 64}, 0.5))
    assert json.loads(cache.path.read_text()) == {"k": {"config": {"block_m": 64}, "ms": 0.5}}
    assert not list(tmp_path.glob("*.tmp"))


def test_store_keeps_entries_written_by_others(tmp_path):
    a, b = TuningCache(tmp_path / "f.json"), TuningCache(tmp_path / "f.json")
    a.store("k1", Tuned({"block_m": 64}, 1.0))
    b.store("k2", Tuned({"block_m": 128}, 2.0))
    assert set(a.load()) == {"k1", "k2"}


def test_check_same_catches_a_wrong_schedule():
    ref = [np.arange(6, dtype=np.float64).reshape(2, 3)]
    autotune.check_same("f", [ref[0] * (1 + 1e-4)], ref)
    with pytest.raises(TesseraError, match="output 0 differs"):
        autotune.check_same("f", [ref[0] + 1], ref)
    with pytest.raises(TesseraError, match="differs"):
        autotune.check_same("f", [np.full((2, 3), np.nan)], ref)


def test_autotune_decorator_builds_a_tuner_and_cpu_calls_use_the_first_values(tmp_path):
    @tsr.kernel.autotune(space=dict(BLOCK_M=[64, 128], num_warps=[4, 8]), key=["M", "N", "K"], cache=str(tmp_path))
    def mm(A: Tensor["M", "K", tsr.fp32], B: Tensor["K", "N", tsr.fp32], C: Tensor["M", "N", tsr.fp32]):
        C[:] = tsr.matmul(A, B)
    assert mm.tuner.space == {"block_m": (64, 128), "num_warps": (4, 8)}
    assert mm.tuner.cache.path.parent == tmp_path
    a, b = np.ones((3, 5), np.float32), np.ones((5, 2), np.float32)
    c = np.zeros((3, 2), np.float32)
    mm(a, b, c)
    np.testing.assert_allclose(c, a @ b)
    assert not mm.tuner.results          # the interpreter's timing means nothing: no tuning on the CPU
    schedule = mm.compile(mm.arg_specs_for(dict(M=3, K=5, N=2))).modules["schedule"]
    assert "block_m = 64" in str(schedule)
