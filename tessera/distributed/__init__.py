"""Tessera functions over a device mesh (issue 19): `DeviceMesh` (torch.distributed's process
groups), `shard` (a function run on shards, with the collectives its math needs derived from its
Graph IR: `placement.py`). Imports torch only when a mesh is made or a sharded function called."""
from .mesh import DeviceMesh
from .sharded import ShardedFunction, shard

__all__ = ["DeviceMesh", "ShardedFunction", "shard"]
