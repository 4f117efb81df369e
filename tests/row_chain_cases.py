"""Row statistics that a later reduction over the same rows reads (`fusion.merge_row_chains`: one
kernel computes them in turn), with their float64 references (NumPy): tests/passes/test_fusion.py
runs them on the CPU interpreter, tests/gpu/test_reductions_gpu.py on the GPU."""
import numpy as np

import tessera as tsr
from tessera import Tensor


@tsr.function
def written_softmax(x: Tensor["M", "N"]):
    e = tsr.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


@tsr.function
def written_layer_norm(x: Tensor["M", "N"]):
    d = x - x.mean(-1, keepdim=True)
    return d / tsr.sqrt((d * d).mean(-1, keepdim=True) + 1e-5)


@tsr.function
def variance(x: Tensor["M", "N"]):
    return x.var(-1), tsr.std(x, -1, keepdim=True)


@tsr.function
def probability_purity(x: Tensor["M", "N"]):
    """Three statistics in a chain: the max, the sum about it, the sum of the squared probabilities."""
    e = tsr.exp(x - x.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    return (p * p).sum(-1)


@tsr.function
def std_and_column_sum(x: Tensor["M", "N"]):
    """With a column sum of the same rows riding along (`fusion.merge_column_reductions`)."""
    return tsr.std(x, -1), x.sum(0)


@tsr.function
def var_and_mean(x: Tensor["M", "N"]):
    """torch.var_mean: the mean is written beside the variance, by its kernel (rounded to x's dtype)."""
    return tsr.var_mean(x, -1)


@tsr.function
def written_std_and_mean(x: Tensor["M", "N"]):
    """A mean read by the kernel of the variance about it and returned too, and an epilogue over the rows."""
    m = x.mean(-1, keepdim=True)
    d = x - m
    return tsr.sqrt((d * d).sum(-1, keepdim=True) / x.shape[-1]), m, d * 2.0


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _normalized(x):
    d = x - x.mean(-1, keepdims=True)
    return d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)


def _var(x, keepdims=False):
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((x - x.mean(-1, keepdims=True)) ** 2).sum(-1, keepdims=keepdims) / (x.shape[-1] - 1)


#: function -> (float64 references of its outputs from x, the row kernels it takes)
CASES = {
    written_softmax: (lambda x: [_softmax(x)], 1),
    written_layer_norm: (lambda x: [_normalized(x)], 1),
    variance: (lambda x: [_var(x), np.sqrt(_var(x, True))], 2),
    probability_purity: (lambda x: [(_softmax(x) ** 2).sum(-1)], 1),
    std_and_column_sum: (lambda x: [np.sqrt(_var(x)), x.sum(0)], 1),
    var_and_mean: (lambda x: [_var(x), x.mean(-1)], 1),
    written_std_and_mean: (lambda x: [x.std(-1, keepdims=True), x.mean(-1, keepdims=True),
                                      (x - x.mean(-1, keepdims=True)) * 2.0], 1),
}
