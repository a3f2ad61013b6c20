"""Test helpers for users of ``kt_regroup`` (and its own tests): a slice + cat reference regroup.

Imported on purpose only (``import kt_regroup.testing``); nothing here is on a hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kt_regroup._keyed_tensor import KeyedTensor
from kt_regroup.interfaces import KeyedTensorLike

__all__ = ["clone_kts", "make_kts", "reference", "run_backward"]


def reference(kts: Sequence[KeyedTensorLike], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The plain slice + cat regroup every backend must match (autograd does the backward)."""
    key_dim = kts[0].key_dim()
    blocks: dict[str, torch.Tensor] = {}
    for kt in kts:
        pieces = torch.split(kt.values(), kt.length_per_key(), dim=key_dim)
        blocks.update(zip(kt.keys(), pieces, strict=True))
    values = kts[0].values()
    batch = values.size(1 - key_dim)
    result = []
    for group in groups:
        if group:
            result.append(torch.cat([blocks[k] for k in group], dim=key_dim))
        else:
            shape = (batch, 0) if key_dim == 1 else (0, batch)
            result.append(values.new_zeros(shape))
    return result


def make_kts(
    keys: list[list[str]],
    lengths: list[list[int]],
    batch: int,
    dtype: torch.dtype,
    key_dim: int,
    device: str = "cpu",
    seed: int = 0,
) -> list[KeyedTensor]:
    """KeyedTensors of random values (leaf tensors that require grad)."""
    gen = torch.Generator().manual_seed(seed)
    kts = []
    for kt_keys, kt_lengths in zip(keys, lengths, strict=True):
        width = sum(kt_lengths)
        shape = (batch, width) if key_dim == 1 else (width, batch)
        values = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        kts.append(KeyedTensor(kt_keys, kt_lengths, values.requires_grad_(), key_dim=key_dim))
    return kts


def clone_kts(kts: Sequence[KeyedTensor]) -> list[KeyedTensor]:
    """Fresh leaves with the same values, so two backwards do not share ``.grad``."""
    return [
        KeyedTensor(
            kt.keys(), kt.length_per_key(), kt.values().detach().clone().requires_grad_(), kt.key_dim()
        )
        for kt in kts
    ]


def run_backward(outputs: Sequence[torch.Tensor], seed: int = 1) -> None:
    """Backward with fixed random output gradients (same seed -> same gradients)."""
    gen = torch.Generator().manual_seed(seed)
    grads = [
        torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype).to(o.device) for o in outputs
    ]
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
