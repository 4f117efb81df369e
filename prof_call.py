import cProfile, pstats, time
import torch
import tessera as tsr
from tessera import Tensor

@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)

x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
w, b = torch.randn(256, device="cuda", dtype=torch.float16), torch.randn(256, device="cuda", dtype=torch.float16)
for _ in range(50):
    layer_norm(x, w, b)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(2000):
    layer_norm(x, w, b)
torch.cuda.synchronize()
print("us/call", (time.perf_counter() - t) / 2000 * 1e6)
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    layer_norm(x, w, b)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
