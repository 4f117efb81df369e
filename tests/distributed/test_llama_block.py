"""examples/llama_block.py, the block bench/tensor_parallel.py shards: Tessera's function against
the same block in torch, whole, on the CPU interpreter (the sharded runs check against this one)."""
import pytest

torch = pytest.importorskip("torch")

from llama_block import llama_block, torch_llama_block  # noqa: E402
from sharded_cases import BLOCK  # noqa: E402


@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 13)])
def test_the_tessera_block_matches_torchs(batch, seq):
    dims = {**BLOCK, "B": batch, "S": seq}
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(tuple(dims[d] for d in spec.dims), generator=gen, dtype=torch.float64) * 0.5
            for spec in llama_block.annotations.values()]
    want = torch_llama_block(*args, head_dim=8)
    got = llama_block(*[a.float() for a in args], 8)
    assert got.shape == want.shape and not got.isnan().any()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
