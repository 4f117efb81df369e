"""Calls with a zero-size dim (S=0, B=0): nothing is compiled or launched.

A kernel's grid tiles its output, and a dim of size 0 leaves nothing to tile.
Such a call's results come from the traced graph instead: an empty result is
allocated, in the inputs' framework and on their device; a result that is not
empty (a sum over an empty dim, a matmul with K = 0) is the graph's NumPy
reference evaluated on the inputs (copied to the host when they are on a GPU).
`ZeroSizeCall` stands where a `Compiled` would, with the same `run` and
`gpu_program`, so the call paths and caches treat it alike.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import TesseraError


class ZeroSizeCall:
    """The results of a traced function with a zero-size dim, without kernels."""

    def __init__(self, graph_module):
        from ..ir import graph

        self.graph = next(iter(graph_module.ops))
        self.name = self.graph.sym_name.data
        self.arg_names = [a.data for a in self.graph.attributes["tessera.arg_names"].data]
        self.result_names = [a.data for a in self.graph.attributes["tessera.result_names"].data]
        bindings = graph.bindings_of(self.graph)
        self.results = [(tuple(d if isinstance(d, int) else bindings[d] for d in t.shape), t.dtype)
                        for t in self.graph.function_type.outputs.data if isinstance(t, graph.TensorType)]

    @property
    def all_empty(self) -> bool:
        return all(math.prod(shape) == 0 for shape, _ in self.results)

    def run(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The results on the host."""
        if self.all_empty:
            return [np.empty(shape, dt.np) for shape, dt in self.results]
        from ..interpreter.reference import run_graph

        try:
            return run_graph(self.graph, inputs)
        except ValueError as e:   # a max or min over an empty dim: NumPy and PyTorch have no value for it
            raise TesseraError(f"{self.name}: {e} (a zero-size dim of the call)") from None

    def gpu_program(self, device: int = 0) -> "ZeroSizeProgram":
        return ZeroSizeProgram(self)


class ZeroSizeProgram:
    """`ZeroSizeCall` on CUDA arrays, called as a `GpuProgram` is: arrays of the inputs' framework."""

    def __init__(self, call: ZeroSizeCall):
        self.call = call

    def __call__(self, *inputs, out: Sequence | None = None) -> list:
        from ..runtime import interop

        interop.validate(dict(zip(self.call.arg_names, inputs)))
        if out is not None and len(out) != len(self.call.results):
            raise TesseraError(f"{self.call.name}: out= takes {len(self.call.results)} array(s), got {len(out)}")
        outputs = list(out) if out is not None else [interop.empty_like_framework(inputs[0], shape, dt)
                                                     for shape, dt in self.call.results]
        if not self.call.all_empty:
            values = self.call.run(*[interop.device_to_host(x) for x in inputs])
            for target, value in zip(outputs, values):
                if value.size:
                    interop.copy_to_device(target, value)
        return outputs
