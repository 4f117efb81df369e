"""Where fusion puts device_asserts: in the kernel computing what the condition reads when that
kernel can check it on its output tile, else in a kernel of its own; never dropped, and never
changing how the other ops are fused."""
import pytest

import tessera as tsr
from tessera import Tensor
from tessera.errors import TesseraError
from tessera.ir import graph as g
from tessera.ir import schedule as s
from tessera.passes.fusion import fuse


def kernels(fn, dims):
    module = fuse(fn.trace(fn.arg_specs_for(dims, "fp32")))
    return [(op.kind.data, sum(isinstance(x, g.AssertOp) for x in op.body.block.ops), len(op.outputs))
            for op in module.walk() if isinstance(op, s.KernelOp)]


@tsr.function
def elementwise(x: Tensor["M", "N"]):
    y = tsr.exp(x)
    tsr.device_assert(y > 0, "positive")
    return y + 1.0


@tsr.function
def gemm(a: Tensor["M", "K"], b: Tensor["K", "M"]):
    c = tsr.matmul(a, b)
    tsr.device_assert(c == c, "no NaN")
    return tsr.relu(c)


@tsr.function
def softmax(x: Tensor["M", "N"]):
    p = tsr.softmax(x * 2.0, dim=-1)
    tsr.device_assert(p <= 1.0, "probabilities")
    return p


@tsr.function
def row_sum(x: Tensor["M", "N"]):
    total = x.sum(dim=-1, keepdim=True)
    tsr.device_assert(total > -1e6, "sum")
    return total


@pytest.mark.parametrize("fn, expected", [
    (elementwise, [("elementwise", 1, 1)]),
    (gemm, [("gemm", 1, 1)]),
    (softmax, [("row_reduction", 1, 1)]),
    (row_sum, [("row_reduction", 1, 1)]),
])
def test_an_assert_joins_the_kernel_computing_its_condition(fn, expected):
    assert kernels(fn, {"M": 40, "N": 70, "K": 32}) == expected


@tsr.function
def on_arguments(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    tsr.device_assert(x <= y, "ordered")
    return x + y


@tsr.function
def on_two_kernels(x: Tensor["M", "N"]):
    p = tsr.softmax(x, dim=-1)
    total = x.sum(dim=-1, keepdim=True)
    tsr.device_assert(p < total + 1.0, "two kernels")
    return p, total


@pytest.mark.parametrize("fn, expected", [
    (on_arguments, [("elementwise", 1, 0), ("elementwise", 0, 1)]),
    (on_two_kernels, [("row_reduction", 0, 1), ("row_reduction", 0, 1), ("elementwise", 1, 0)]),
])
def test_otherwise_an_assert_gets_a_kernel_without_outputs(fn, expected):
    assert kernels(fn, {"M": 40, "N": 70}) == expected


def test_asserts_do_not_change_how_the_rest_fuses():
    @tsr.function
    def plain(x: Tensor["M", "N"]):
        y = tsr.exp(x)
        return y + 1.0
    assert [k[0] for k in kernels(plain, {"M": 8, "N": 8})] == [k[0] for k in kernels(elementwise, {"M": 8, "N": 8})]


def test_an_assert_on_a_value_that_never_reaches_memory_is_an_error():
    @tsr.function
    def attention_scores(q: Tensor["S", "D"], k: Tensor["S", "D"], v: Tensor["S", "D"]):
        scores = tsr.matmul(q, k.transpose(0, 1))
        tsr.device_assert(scores == scores, "no NaN scores")
        return tsr.matmul(tsr.softmax(scores, dim=-1), v)
    with pytest.raises(TesseraError, match="computed inside a fused flash_attention kernel"):
        kernels(attention_scores, {"S": 64, "D": 32})
