"""Reverse-mode automatic differentiation (issue 14, first part).

- `backward.py`: `backward_graph(forward_module)`, the backward of a traced function as an
  ordinary Graph IR function (its module doc says what it recomputes and why);
- `rules.py`: `VJP_RULES`, each Graph IR op's vector-Jacobian product as a table;
- `api.py`: `tsr.vjp` and `tsr.grad` in JAX's conventions, whose derivatives are `Function`s
  compiled and run like any other (CPU interpreter on NumPy arrays, PTX on CUDA tensors).
"""
from .api import Derivative, grad, vjp

__all__ = ["Derivative", "grad", "vjp"]
