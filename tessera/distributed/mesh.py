"""A device mesh: named axes over torch.distributed process groups.

Tessera runs on the distributed engine its users already have: the mesh is torch's
(`torch.distributed.device_mesh`), so its process groups are NCCL's on GPUs and gloo's on CPUs,
and Tessera's collectives are torch.distributed's, on the caller's current stream.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import TesseraError


class DeviceMesh:
    """`DeviceMesh("cuda", (2,), ("tp",))`, or `(2, 4), ("dp", "tp")`: every process of the job
    (torch.distributed initialized, or initialized here from the usual environment variables)
    calls it with the same arguments. `DeviceMesh.of(torch_mesh)` wraps a mesh made elsewhere."""

    def __init__(self, device_type: str, shape: Sequence[int], names: Sequence[str]):
        from torch.distributed.device_mesh import init_device_mesh

        if len(shape) != len(names) or len(set(names)) != len(names):
            raise TesseraError(f"DeviceMesh: one distinct name per mesh dim, got shape {tuple(shape)} and "
                               f"names {tuple(names)}")
        self.torch_mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        self.names = tuple(names)

    @classmethod
    def of(cls, torch_mesh) -> DeviceMesh:
        if not torch_mesh.mesh_dim_names:
            raise TesseraError("DeviceMesh.of: the torch mesh needs mesh_dim_names (the axes' names)")
        mesh = cls.__new__(cls)
        mesh.torch_mesh, mesh.names = torch_mesh, tuple(torch_mesh.mesh_dim_names)
        return mesh

    def _check(self, axis: str) -> str:
        if axis not in self.names:
            raise TesseraError(f"the mesh has no axis {axis!r}; its axes are {', '.join(map(repr, self.names))}")
        return axis

    def size(self, axis: str) -> int:
        """The number of ranks along `axis`."""
        return self.torch_mesh.size(self.names.index(self._check(axis)))

    def rank(self, axis: str) -> int:
        """This process's coordinate along `axis`."""
        return self.torch_mesh.get_local_rank(self._check(axis))

    def group(self, axis: str):
        """The process group of this process's ranks along `axis`."""
        return self.torch_mesh.get_group(self._check(axis))

    def __repr__(self) -> str:
        return f"DeviceMesh({', '.join(f'{n}={self.size(n)}' for n in self.names)})"
