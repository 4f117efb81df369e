"""Profile stamps in Tile IR: a stamp buffer per profiled kernel, slot 0 around the whole body,
one slot per region around the top-level ops its graph ops generated."""
from xdsl.dialects import scf
from xdsl.dialects.builtin import ArrayAttr

import tessera as tsr
from tessera import Tensor
from tessera.ir import provenance
from tessera.ir import tile as t


@tsr.function
def two_regions(a: Tensor["M", "K"], b: Tensor["K", "N"]):
    with tsr.profile_region("mainloop"):
        c = tsr.matmul(a, b)
    with tsr.profile_region("epilogue"):
        return tsr.relu(c) * 2.0


def tile_module(profile: bool):
    dims = {"M": 200, "K": 128, "N": 96}
    return two_regions.compile(two_regions.arg_specs_for(dims, "fp16"), arch="sm_80", profile=profile).modules["tile"]


def test_a_profiled_kernel_takes_a_stamp_buffer_last_and_names_its_slots():
    module = tile_module(profile=True)
    (kernel,) = [op for op in module.ops if isinstance(op, t.KernelOp)]
    (launch,) = [op for op in module.walk() if isinstance(op, t.LaunchOp)]
    gx, gy, gz = t.int_values(launch.grid)
    stamps = kernel.body.block.args[-1]
    assert stamps.type.get_shape() == (gz, gy, gx, 3, t.PROFILE_WORDS)
    assert launch.args[-1].type == stamps.type and isinstance(launch.args[-1].owner, t.AllocGlobalOp)
    labels = kernel.attributes[provenance.PROFILE]
    assert isinstance(labels, ArrayAttr) and [a.data for a in labels.data] == [kernel.sym_name.data, "mainloop",
                                                                                 "epilogue"]


def test_slot_0_spans_the_body_and_regions_span_their_ops():
    (kernel,) = [op for op in tile_module(profile=True).ops if isinstance(op, t.KernelOp)]
    ops = list(kernel.body.block.ops)
    assert isinstance(ops[0], t.ProfileBeginOp) and ops[0].slot.value.data == 0
    assert isinstance(ops[-2], t.ProfileEndOp) and ops[-2].slot.value.data == 0
    assert isinstance(ops[-1], t.ReturnOp)
    stamps = {(type(op), op.label.data): i for i, op in enumerate(ops) if isinstance(op, (t.ProfileBeginOp,
                                                                                           t.ProfileEndOp))}
    (loop,) = [i for i, op in enumerate(ops) if isinstance(op, scf.ForOp)]
    begin, end = stamps[(t.ProfileBeginOp, "mainloop")], stamps[(t.ProfileEndOp, "mainloop")]
    assert begin < loop < end    # the K loop's mmas are the matmul's: the region holds the loop
    (store,) = [i for i, op in enumerate(ops) if isinstance(op, t.StoreOp)]
    assert stamps[(t.ProfileBeginOp, "epilogue")] < store < stamps[(t.ProfileEndOp, "epilogue")]


def test_without_profiling_nothing_changes():
    module = tile_module(profile=False)
    assert not any(isinstance(op, (t.ProfileBeginOp, t.ProfileEndOp)) for op in module.walk())
    assert not any(provenance.PROFILE in op.attributes for op in module.ops)
