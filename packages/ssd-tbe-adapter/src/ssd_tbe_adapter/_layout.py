"""The output layout of one forward (fbgemm TBE's): where each feature's pooled bags go, and where backward finds
their gradient. Shared by the host-cache path (``_module``) and the device-cache path (``_device_path``).

Without VBE the output is ``[B, sum(D_f)]`` with feature ``f`` in its column range; with VBE it is 1-D, one
``[bags, D_f]`` block per (rank, feature) at the plan's block offsets (``plan.blocks``), possibly inside a
caller's ``vbe_output`` buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from ssd_tbe_adapter._plan import Plan

__all__ = [
    "allocate_output",
    "bag_grads",
    "chained_input_grad",
    "one_block_start",
    "output_rows",
    "place_pooled",
]


def allocate_output(
    plan: Plan, feature_dims: Sequence[int], device: torch.device, vbe_output: torch.Tensor | None
) -> torch.Tensor:
    """The output tensor of ``plan``: ``vbe_output`` itself when given, else a new float32 tensor on ``device``."""
    if plan.vbe:
        if vbe_output is not None:
            return vbe_output
        return torch.empty(plan.output_numel, dtype=torch.float32, device=device)
    return torch.empty(plan.batch_size, sum(feature_dims), dtype=torch.float32, device=device)


def one_block_start(plan: Plan, feature_dims: Sequence[int]) -> int | None:
    """Where the pooled bags of every feature form one ``[bags, D]`` block of a VBE output, in bag order (one
    rank's layout with one ``D``): its first element, else ``None``. Then the whole forward output is one copy
    and its gradient one view, instead of a copy per feature."""
    if not plan.vbe or not feature_dims or len(set(feature_dims)) != 1:
        return None
    dim = feature_dims[0]
    first_start: int | None = None
    for feature, blocks in enumerate(plan.blocks):
        live = [block for block in blocks if block[1]]
        if not live:
            if plan.num_bags[feature]:
                return None
            continue
        if len(live) != 1:
            return None
        first, count, start = live[0]
        if first or count != plan.num_bags[feature]:
            return None
        if first_start is None:
            first_start = start - dim * plan.bag_start[feature]
        if start != first_start + dim * plan.bag_start[feature]:
            return None
    return first_start


def place_pooled(plan: Plan, output: torch.Tensor, feature: int, column: int, pooled: torch.Tensor) -> None:
    """Write feature ``feature``'s pooled bags ``[bags_f, D_f]`` into ``output`` (``column``: its first column
    without VBE)."""
    dim = pooled.shape[1]
    if plan.vbe:
        for first, count, start in plan.blocks[feature]:
            if count:
                output[start : start + count * dim].view(count, dim).copy_(pooled[first : first + count])
    else:
        output[:, column : column + dim] = pooled


def bag_grads(plan: Plan, grad_output: torch.Tensor, feature: int, column: int, dim: int) -> torch.Tensor:
    """The gradient ``[bags_f, D_f]`` of feature ``feature``'s pooled bags, read from ``grad_output``."""
    if plan.vbe:
        flat = grad_output.view(-1)
        blocks = [
            flat[at : at + count * dim].view(count, dim) for _, count, at in plan.blocks[feature] if count
        ]
        if not blocks:
            return flat.new_zeros(0, dim)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return grad_output[:, column : column + dim]


def chained_input_grad(plan: Plan, grad_output: torch.Tensor, feature_dims: Sequence[int]) -> torch.Tensor:
    """Gradient of a chained ``vbe_output`` input: ``grad_output`` with this call's blocks zeroed (they
    overwrote whatever the buffer held there)."""
    grad = grad_output.clone()
    flat = grad.view(-1)
    for feature, blocks in enumerate(plan.blocks):
        dim = feature_dims[feature]
        for _, bags, start in blocks:
            flat[start : start + bags * dim].zero_()
    return grad


def output_rows(plan: Plan, dim: int, vbe_numel: int | None) -> torch.Tensor | None:
    """When every feature is ``dim`` wide: the row of each bag (bag order, ``[num_bags]`` int64 host) in the
    output viewed as ``[-1, dim]`` (a caller's ``vbe_output`` of ``vbe_numel`` elements, else the plan's own);
    ``None`` when a block does not start on a row boundary. Cached per layout."""
    if plan.vbe:
        blocks = tuple(tuple(feature_blocks) for feature_blocks in plan.blocks)
        return _vbe_output_rows(blocks, dim, vbe_numel)
    return _flat_output_rows(len(plan.num_bags), plan.batch_size)


@functools.lru_cache(maxsize=256)
def _vbe_output_rows(
    blocks: tuple[tuple[tuple[int, int, int], ...], ...], dim: int, vbe_numel: int | None
) -> torch.Tensor | None:
    if vbe_numel is not None and vbe_numel % dim:
        return None
    parts = []
    for feature_blocks in blocks:
        for _, count, start in feature_blocks:  # consecutive bags of the feature, rank by rank
            if count:
                if start % dim:
                    return None
                parts.append(np.arange(start // dim, start // dim + count, dtype=np.int64))
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


@functools.lru_cache(maxsize=256)
def _flat_output_rows(num_features: int, batch_size: int) -> torch.Tensor:
    # Bag b of feature f is row b of the feature's column block: row b * F + f of [B * F, D].
    rows = np.arange(batch_size * num_features, dtype=np.int64).reshape(batch_size, num_features)
    return torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1))
