"""The argument list GpuProgram launches each step with (no GPU needed: encoding is faked)."""
from tessera.backends.ptx.emitter import TensorMapSpec
from tessera.runtime.launcher import Step, launch_args

POINTERS = [0x1000, 0x2000, 0x3000, 0x4000]


def fake_encode(ptr, spec):
    return ("encoded", ptr, spec.shape)


def step(buffers, tensor_maps=()):
    return Step(kernel=None, grid=(1, 1, 1), block=128, shared=0, buffers=buffers, tensor_maps=tensor_maps)


def test_without_tensor_maps_each_buffer_is_a_pointer():
    assert launch_args(step((2, 0)), POINTERS, fake_encode) == [0x3000, 0x1000]
    assert step((2, 0)).param_types == ["u64", "u64"]


def test_tensor_maps_follow_the_pointers_over_the_buffers_they_name():
    a = TensorMapSpec(arg=1, dtype="f16", shape=(64, 64), box=(64, 64))
    b = TensorMapSpec(arg=0, dtype="f16", shape=(32, 64), box=(32, 64))
    assert launch_args(step((3, 1, 2), (a, b)), POINTERS, fake_encode) == [
        0x4000, 0x2000, 0x3000, ("encoded", 0x2000, (64, 64)), ("encoded", 0x4000, (32, 64))]
    assert step((3, 1, 2), (a, b)).param_types == ["u64"] * 3 + ["tmap"] * 2


def test_encoded_tensor_maps_are_reused_per_pointer_and_spec(monkeypatch):
    """A steady-state call re-launches on the same buffers: their maps are encoded once; another
    pointer or another box is encoded anew, and the cache starts over past its size."""
    from types import SimpleNamespace

    from tessera.runtime import driver, launcher

    calls = []
    monkeypatch.setattr(driver, "encode_tensor_map", lambda ptr, spec: calls.append((ptr, spec)) or bytes(128))
    program = SimpleNamespace(_tensor_maps={})
    a = TensorMapSpec(arg=0, dtype="f16", shape=(64, 64), box=(64, 64))
    b = TensorMapSpec(arg=0, dtype="f16", shape=(64, 64), box=(32, 64))
    for ptr, spec in [(0x1000, a), (0x1000, a), (0x2000, a), (0x1000, b), (0x1000, a)]:
        launcher.GpuProgram._tensor_map(program, ptr, spec)
    assert calls == [(0x1000, a), (0x2000, a), (0x1000, b)]
    monkeypatch.setattr(launcher, "TENSOR_MAP_CACHE_SIZE", 3)
    launcher.GpuProgram._tensor_map(program, 0x3000, a)
    assert len(program._tensor_maps) == 1 and calls[-1] == (0x3000, a)
