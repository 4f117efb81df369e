import math, sys
import torch
import tessera as tsr
from tessera import Tensor
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    scale = 1.0 / math.sqrt(q.shape[-1])
    return tsr.matmul(tsr.softmax(tsr.matmul(q, k.transpose(-2, -1)) * scale, dim=-1), v)
q, k, v = (torch.randn(4, 12, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
tsr.function(attention)(q, k, v)
torch.cuda.synchronize()
