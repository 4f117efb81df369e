"""FP8 GEMMs written as ordinary tensor math, as torch._scaled_mm computes them: an fp8 matmul's
product is fp32, scaled per tensor or per row and column, then a fused epilogue and a cast. B is
stored [N, K] (both operands K-contiguous, which fp8 tensor cores read). Shared by the CPU tests
(tests/backends/test_fp8_gemm.py), the GPU tests and bench/fp8_gemm.py."""
import tessera as tsr
from tessera.bench.cases import scaled_fp8_gemm as scaled_mm   # per-tensor scales, a bf16 result

__all__ = ["scaled_mm", "rowwise_bias_gelu", "reference"]


@tsr.function
def rowwise_bias_gelu(a, b, sa, sb, bias):
    """Per-row scales of A ([M, 1]) and per-column scales of B ([1, N]), a bias and a gelu, fp16 out."""
    return tsr.gelu(tsr.matmul(a, b.transpose(0, 1)) * sa * sb + bias, approximate="tanh").to(tsr.fp16)


def reference(torch, fn, a, b, sa, sb, bias=None):
    """The same math in float64 on the fp8 values."""
    x = (a.double() @ b.double().T) * sa.double() * sb.double()
    if fn is rowwise_bias_gelu:
        x = torch.nn.functional.gelu(x + bias.double(), approximate="tanh")
    return x
