"""The argument list GpuProgram launches each step with (no GPU needed: encoding is faked)."""
from tessera.backends.ptx.emitter import TensorMapSpec
from tessera.runtime.launcher import Step, launch_args

POINTERS = [0x1000, 0x2000, 0x3000, 0x4000]


def fake_encode(ptr, spec):
    return ("encoded", ptr, spec.shape)


def step(buffers, tensor_maps=()):
    return Step(kernel=None, grid=(1, 1, 1), block=128, shared=0, buffers=buffers, tensor_maps=tensor_maps)


def test_without_tensor_maps_each_buffer_is_a_pointer():
    assert launch_args(step((2, 0)), POINTERS, fake_encode) == [("u64", 0x3000), ("u64", 0x1000)]


def test_tensor_maps_follow_the_pointers_over_the_buffers_they_name():
    a = TensorMapSpec(arg=1, dtype="f16", shape=(64, 64), box=(64, 64))
    b = TensorMapSpec(arg=0, dtype="f16", shape=(32, 64), box=(32, 64))
    assert launch_args(step((3, 1, 2), (a, b)), POINTERS, fake_encode) == [
        ("u64", 0x4000), ("u64", 0x2000), ("u64", 0x3000),
        ("tmap", ("encoded", 0x2000, (64, 64))), ("tmap", ("encoded", 0x4000, (32, 64)))]
