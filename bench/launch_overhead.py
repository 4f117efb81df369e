"""Launch path (issue 17 item 3): host time per steady call of a cached Tessera function on torch
tensors, against torch's eager op and a Triton kernel launch on the same inputs, in one process.

    python3 bench/launch_overhead.py [--calls 200] [--profile NAME | --pieces]

Each case's GPU work is tiny (8 rows, a 128-long attention) and a timed loop issues `--calls`
calls, few enough that the launch queue never fills, so the loop measures the host: the time per
call is the median over 51 loops (no synchronize inside a loop), in us. Every Tessera output is checked against float64 first.
The launch fast path's C module (tessera/runtime/fastcall.py) is built or loaded before timing;
the header says when it is unavailable (every call then takes the general path), and what an
empty kernel launched through the same C call costs (the floor: the driver's launch and the call).
Goal (issue 17): at most 5 us per call of a cached kernel, argument checks included. `--profile
NAME` prints where a Tessera call of case NAME spends its time (cProfile, by own time); `--pieces`
what the pieces of a call cost: the floor (an empty kernel launched through the same C call, no
argument to check or allocate), each case's C call without Tessera's Python `__call__`, and the
torch calls the C call makes per tensor.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import tessera as tsr  # noqa: E402
from tessera import Tensor  # noqa: E402
from tessera.bench.timing import rel_err  # noqa: E402
from tessera.runtime import fastcall  # noqa: E402


@tsr.function
def add(x: Tensor["M", "N"], y: Tensor["M", "N"]):
    return x + y


@tsr.function
def layer_norm(x: Tensor["M", "N"], w: Tensor["N"], b: Tensor["N"]):
    return tsr.layer_norm(x, (x.shape[-1],), w, b)


@tsr.function
def mlp(x: Tensor["M", "K"], w1: Tensor["K", "F"], w2: Tensor["F", "K"]):
    return tsr.matmul(tsr.gelu(tsr.matmul(x, w1)), w2)


@tsr.function
def attention(q: Tensor["B", "H", "S", "D"], k: Tensor["B", "H", "S", "D"], v: Tensor["B", "H", "S", "D"]):
    return tsr.softmax(tsr.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5), dim=-1) @ v


@tsr.kernel
def add_into(x: Tensor["M", "N"], y: Tensor["M", "N"], out: Tensor["M", "N"]):
    out[:] = x + y


@triton.jit
def _triton_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=keep) + tl.load(y_ptr + offsets, mask=keep), mask=keep)


def triton_add(x, y, out=None):
    out = torch.empty_like(x) if out is None else out
    n = x.numel()
    _triton_add[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
    return out


@dataclass
class Case:
    tessera: Callable          # the Tessera function (or @kernel, writing its last argument)
    torch: Callable            # torch's eager op(s) on the same arguments
    triton: Callable | None    # a Triton kernel's launch on them
    inputs: tuple
    reference: Callable        # float64 inputs -> the expected result

    def check(self) -> float:
        got = self.tessera(*self.inputs)
        got = self.inputs[-1] if got is None else got
        return rel_err(got, self.reference(*(x.double() for x in self.inputs)))


def cases() -> dict[str, Case]:
    f16 = dict(device="cuda", dtype=torch.float16)
    x, y, out = torch.randn(8, 1024, **f16), torch.randn(8, 1024, **f16), torch.empty(8, 1024, **f16)
    xn, w, b = torch.randn(8, 4096, **f16), torch.randn(4096, **f16), torch.randn(4096, **f16)
    xm, w1, w2 = torch.randn(8, 1024, **f16), torch.randn(1024, 1024, **f16) / 32, torch.randn(1024, 1024, **f16) / 32
    q, k, v = (torch.randn(1, 8, 128, 64, **f16) for _ in range(3))
    F = torch.nn.functional
    layer_norm_ref = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)   # noqa: E731
    mlp_ref = lambda x, w1, w2: F.gelu(x @ w1) @ w2                         # noqa: E731
    return {
        "add": Case(add, torch.add, triton_add, (x, y), torch.add),
        "add (out=)": Case(add_into, lambda x, y, out: torch.add(x, y, out=out), triton_add, (x, y, out),
                           lambda x, y, out: x + y),
        "layer_norm": Case(layer_norm, layer_norm_ref, None, (xn, w, b), layer_norm_ref),
        "mlp": Case(mlp, mlp_ref, None, (xm, w1, w2), mlp_ref),
        "attention": Case(attention, F.scaled_dot_product_attention, None, (q, k, v), F.scaled_dot_product_attention),
    }


def host_us(fn, args, calls: int, loops: int = 51) -> float:
    """Median over `loops` loops of `calls` calls of the host time per call, in us. A loop is short
    enough that the launch queue never fills (a synchronize between loops, untimed, empties it): a
    full queue would make the host wait for the GPU, and the loop would time the kernels."""
    for _ in range(200):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


EMPTY_KERNEL = """.version 8.0
.target sm_80
.address_size 64
.visible .entry empty(.param .u32 a, .param .u32 b, .param .u32 c) { ret; }
"""


def floor_call():
    """A fastcall `Call` that launches an empty three-parameter kernel, checking and allocating
    nothing: the host time no call of the C path can go below."""
    from tessera.runtime import driver
    kernel = driver.Module.from_ptx(EMPTY_KERNEL, 0).function("empty")
    launch = fastcall.Launch(int(kernel.handle), (1, 1, 1), (32, 1, 1), 0, False,
                             tuple((fastcall.U32, 0) for _ in range(3)))
    record = fastcall.Record((), (), (), 0, driver._torch_raw_stream(), 0, int(driver.primary_context(0)),
                             None, (launch,), owner=kernel)
    return fastcall.make(record)


def print_pieces(table: dict[str, Case], calls: int) -> None:
    """The floor, each case's C call alone, and the torch calls it makes per tensor, in us."""
    floor = floor_call()
    rows = [("floor: empty kernel, same C call", floor, ())] if floor is not None else []
    for name, case in table.items():
        for _ in range(3):   # (a record is made at a program's second call; its C call at the next)
            case.tessera(*case.inputs)
        fast = case.tessera._fast[0] if case.tessera._fast else None
        if fast is not None:
            rows.append((f"{name}: C call alone", fast, case.inputs))
    x = table["add"].inputs[0]
    raw = torch._C._cuda_getCurrentRawStream
    rows += [("x.shape", lambda: x.shape, ()), ("x.dtype", lambda: x.dtype, ()),
             ("x.requires_grad", lambda: x.requires_grad, ()), ("x.get_device()", x.get_device, ()),
             ("x.is_contiguous()", x.is_contiguous, ()), ("x.data_ptr()", x.data_ptr, ()),
             ("torch.empty_like(x)", torch.empty_like, (x,)), ("current raw stream", raw, (0,)),
             ("torch.empty_like(x, dtype=)", lambda: torch.empty_like(x, dtype=x.dtype), ()),
             ("torch.empty(shape, dtype=, device=)", lambda: torch.empty((8, 1024), dtype=x.dtype, device=x.device), ()),
             ("a Python lambda", lambda: None, ())]
    print("| piece | us/call |")
    print("|---|---|")
    for what, fn, fn_args in rows:
        print(f"| {what} | {host_us(fn, fn_args, calls):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--profile", default=None, help="a case name: print where its Tessera call spends time")
    parser.add_argument("--pieces", action="store_true", help="print what the pieces of a call cost")
    args = parser.parse_args()
    print(f"# device: {torch.cuda.get_device_name()}  command: python3 bench/launch_overhead.py --calls {args.calls}")
    if fastcall.wait(timeout=120) is None:
        print(f"# the fast path is unavailable: {fastcall.unavailable()}")
    table = cases()
    for name, case in table.items():
        err = case.check()
        assert err < 2e-2, f"{name}: relative error {err:.2e}"
    if args.profile:
        case = table[args.profile]
        host_us(case.tessera, case.inputs, 100)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            case.tessera(*case.inputs)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    if args.pieces:
        print_pieces(table, args.calls)
        return
    floor = floor_call()
    if floor is not None:
        print(f"# floor: an empty kernel launched through the same C call, nothing checked or allocated: "
              f"{host_us(floor, (), args.calls):.1f} us/call")
    print("| case | kernels | Tessera us/call | torch eager us/call | Triton launch us/call | Tessera/torch |")
    print("|---|---|---|---|---|---|")
    for name, case in table.items():
        ours, theirs = host_us(case.tessera, case.inputs, args.calls), host_us(case.torch, case.inputs, args.calls)
        tri = f"{host_us(case.triton, case.inputs, args.calls):.1f}" if case.triton else "-"
        kernels = len(next(iter(case.tessera._programs.values())).program.plan.steps)
        print(f"| {name} | {kernels} | {ours:.1f} | {theirs:.1f} | {tri} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
