"""Rank bodies of the sharded-state-dict tests (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _dist_workers import EPS, LR, TABLES, plans
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from vbe_lookup.sharding import ShardedEmbeddingBags, torch_kernel_factory


def full_tables(seed: int) -> dict[str, Tensor]:
    """Unsharded weights and row-wise Adagrad momenta, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for t in TABLES:
        out[f"{t.name}.weight"] = torch.randn(t.num_embeddings, t.embedding_dim, generator=gen)
        out[f"{t.name}.momentum"] = torch.rand(t.num_embeddings, generator=gen) + 0.1
    return out


def save_on_two_load_on_three(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Global ranks 1 and 2 (a subgroup) save with DCP under a 2-rank plan; all 3 ranks load another plan."""
    factory = torch_kernel_factory(optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS)
    device = torch.device("cpu")
    expected = full_tables(21)
    sub = dist.new_group(ranks=[1, 2])
    local_keys: list[str] = []
    if rank in (1, 2):
        small = ShardedEmbeddingBags(TABLES, plans(2)[0], sub, kernel_factory=factory, device=device)
        small.load_state_dict(expected)
        state = small.sharded_state_dict()
        local_keys = sorted(state)
        # Views of the kernel storage: writing a row through the kernel shows in the state (no copy).
        dcp_save(state, storage_writer=FileSystemWriter(folder), process_group=sub)
    dist.barrier()
    big = ShardedEmbeddingBags(TABLES, plans(3)[0], kernel_factory=factory, device=device)
    state = big.sharded_state_dict()
    dcp_load(state, storage_reader=FileSystemReader(folder))
    big.load_sharded_state_dict(state)
    gathered = big.state_dict()
    mismatched = [k for k, v in expected.items() if not torch.equal(gathered[k].cpu(), v)]
    return {"saved_keys": local_keys, "loaded_keys": sorted(state), "mismatched": mismatched}
