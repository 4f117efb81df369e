"""The fp8 cast functions the PTX (CPU) and GPU fp8 tests share: widen an fp8 tensor to a wider float,
narrow a wider float to fp8, each with a scale so the cast is not the whole kernel."""
import tessera as tsr
from tessera import Tensor


def widen(to: str):
    @tsr.function
    def up(x: Tensor["N", "C"]):
        return x.to(getattr(tsr, to)) * 2.0
    return up


def narrow(to: str):
    @tsr.function
    def down(x: Tensor["N", "C"]):
        return (x * 2.0).to(getattr(tsr, to))
    return down
