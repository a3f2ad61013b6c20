"""Protocols that ``kt_regroup`` consumes; providers fit them structurally (torchrec's names)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["KeyedTensorLike"]


@runtime_checkable
class KeyedTensorLike(Protocol):
    """Pooled embeddings of several keys laid side by side along ``key_dim``.

    torchrec's ``KeyedTensor``, ``kt_regroup.KeyedTensor`` and vbe-lookup's pooled output all fit.
    """

    def keys(self) -> list[str]:
        """The keys (feature names), in the order their blocks appear along ``key_dim``."""
        ...

    def length_per_key(self) -> list[int]:
        """Width of each key's block along ``key_dim``; sums to ``values().size(key_dim())``."""
        ...

    def values(self) -> torch.Tensor:
        """``[B, sum(lengths)]`` when ``key_dim() == 1``, ``[sum(lengths), B]`` when ``key_dim() == 0``."""
        ...

    def key_dim(self) -> int:
        """The dimension of ``values()`` along which the keys' blocks are laid out (0 or 1)."""
        ...
