"""``gather_mean_hook``: DDP's gradients on gloo ranks equal the default all-reduce's (bit for bit on two ranks,
the same on every replica with three), for a small bucket (gathered) and a large one (all-reduced)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel

from examples.dlrm.gather_hook import GATHER_MAX_BYTES, gather_mean_hook

pytestmark = [pytest.mark.distributed]


def _grads(width: int, hook: bool, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if hook:
        ddp.register_comm_hook(dist.group.WORLD, gather_mean_hook)
    torch.manual_seed(100 + rank)  # every rank its own batch
    for _ in range(2):  # the second step runs on DDP's rebuilt buckets
        ddp.zero_grad()
        ddp(torch.randn(8, width)).square().mean().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = {}
        for width in (64, 1024):  # ~17 KB and ~4 MB of gradients: gathered, then all-reduced
            result[width] = (_grads(width, hook=True, rank=rank), _grads(width, hook=False, rank=rank))
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gathered_gradients_equal_the_all_reduce(tmp_path: Path, world: int) -> None:
    assert 1024 * 1024 * 4 * world > GATHER_MAX_BYTES > 64 * 64 * 4 * world  # one bucket of each kind
    out = str(tmp_path / "grads")
    start_processes(_worker, args=(world, str(tmp_path / "store"), out), nprocs=world, join=True)  # type: ignore[no-untyped-call]  # unannotated in torch
    results = [torch.load(f"{out}.{rank}") for rank in range(world)]
    for width in (64, 1024):
        for rank in range(world):
            hooked, reduced = results[rank][width]
            first, _ = results[0][width]
            for h, r, f in zip(hooked, reduced, first, strict=True):
                assert torch.equal(h, f)  # every replica the same bits
                if world == 2 or width == 1024:
                    assert torch.equal(h, r)
                else:  # a different summation order than gloo's ring
                    torch.testing.assert_close(h, r, rtol=1e-6, atol=1e-7)
