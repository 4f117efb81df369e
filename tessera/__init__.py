"""Tessera: tensor math in Python, compiled through Graph, Schedule, Tile and Target IR to GPU kernels.

    import tessera as tsr
    from tessera import Tensor

    @tsr.function
    def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
        s = tsr.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        return tsr.matmul(tsr.softmax(s, dim=-1), v)

Importing tessera is cheap: xDSL (the IR machinery) loads on the first compile.
"""
from .autodiff import grad, vjp
from .dtypes import bf16, bool_, fp8_e4m3, fp8_e5m2, fp16, fp32, int32
from .errors import DeviceAssertError, DTypeError, ShapeError, TesseraError
from .frontend.debug import device_assert, profile_begin, profile_end, profile_region
from .frontend.function import Function, Kernel, function, kernel, torch_op
from .frontend.ops import (
    abs, add, amax, amin, arange, cast, cos, div, eq, erf, exp, exp2, ge, gelu, gt, layer_norm, le, log, log2,
    logical_and, logical_not, logical_or, lt, matmul, maximum, mean, minimum, mul, ne, neg, permute, pow, relu,
    reshape, rms_norm, rsqrt, sigmoid, silu, sin, softmax, sqrt, sub, sum, tanh, transpose, unsqueeze, where,
)
from .frontend.tensor import SymInt, Tensor, TensorSpec
from .frontend.torch_ops import (
    ValuesIndices, argmax, argmin, cat, clamp, clip, concat, einsum, expand, flatten, floor_divide, log_softmax,
    logsumexp, masked_fill, max, min, remainder, stack, std, std_mean, tril, triu, var, var_mean,
)
from .runtime.profile import profile_report, reset_profile

float32, float16, bfloat16, half = fp32, fp16, bf16, fp16
to = cast


def load(path):
    """The AOT package `tessera package` wrote in directory `path` (runtime/package.py): its
    functions, callable on CUDA tensors with no compiler (no xDSL, no ptxas) behind them."""
    from .runtime.package import load as load_package
    return load_package(path)


__version__ = "0.1.0"

__all__ = [
    "DTypeError",
    "DeviceAssertError",
    "Function",
    "Kernel",
    "ShapeError",
    "SymInt",
    "Tensor",
    "TensorSpec",
    "TesseraError",
    "ValuesIndices",
    "__version__",
    "abs",
    "add",
    "amax",
    "amin",
    "arange",
    "argmax",
    "argmin",
    "bf16",
    "bfloat16",
    "bool_",
    "cast",
    "cat",
    "clamp",
    "clip",
    "concat",
    "cos",
    "device_assert",
    "div",
    "einsum",
    "eq",
    "erf",
    "exp",
    "exp2",
    "expand",
    "flatten",
    "float16",
    "float32",
    "floor_divide",
    "fp16",
    "fp32",
    "fp8_e4m3",
    "fp8_e5m2",
    "function",
    "ge",
    "gelu",
    "grad",
    "gt",
    "half",
    "int32",
    "kernel",
    "layer_norm",
    "le",
    "load",
    "log",
    "log2",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "logsumexp",
    "lt",
    "masked_fill",
    "matmul",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "mul",
    "ne",
    "neg",
    "permute",
    "pow",
    "profile_begin",
    "profile_end",
    "profile_region",
    "profile_report",
    "relu",
    "remainder",
    "reset_profile",
    "reshape",
    "rms_norm",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "sqrt",
    "stack",
    "std",
    "std_mean",
    "sub",
    "sum",
    "tanh",
    "to",
    "torch_op",
    "transpose",
    "tril",
    "triu",
    "unsqueeze",
    "var",
    "var_mean",
    "vjp",
    "where",
]
