"""The fused row optimizers (SGD and fbgemm's exact row-wise Adagrad) on rows and on cache slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ssd_tbe_adapter._cache import RowSlab, TableCache

__all__ = ["Optimizer", "RowOptimizer"]

Optimizer = Literal["sgd", "rowwise_adagrad"]


@dataclass(frozen=True, slots=True)
class RowOptimizer:
    """One optimizer step's settings: ``kind``, ``learning_rate`` and Adagrad's ``eps``."""

    kind: Optimizer
    learning_rate: float
    eps: float

    def step(
        self, weights: torch.Tensor, state: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step, in place, on float32 rows ``[K, D]`` (owned by the caller) with state
        ``[K, S]`` and gradients ``[K, D]``; returns the updated ``(weights, state)``."""
        if self.kind == "sgd":
            return weights.add_(grads, alpha=-self.learning_rate), state
        state = state + grads.square().mean(dim=1, keepdim=True)
        # -lr / (sqrt(state) + eps), computed as torch computes ``scalar / tensor`` (reciprocal, then scale).
        scale = state.sqrt().add_(self.eps).reciprocal_().mul_(-self.learning_rate)
        return weights.addcmul_(grads, scale), state

    def step_in_place(self, cache: TableCache | RowSlab, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """:meth:`step` on float32 cache rows ``slots`` (``[K]`` unique, on the device) of one table's cache or
        of a slab of several, without copying the rows out and back: the state and weight updates are
        ``index_add_`` of the (same) increments."""
        if self.kind == "sgd":
            cache.weights.index_add_(0, slots, grads, alpha=-self.learning_rate)
            return
        state = cache.state.view(-1)
        state.index_add_(0, slots, grads.square().mean(dim=1))
        scale = state.index_select(0, slots).sqrt_().add_(self.eps).reciprocal_().mul_(-self.learning_rate)
        cache.weights.index_add_(0, slots, grads * scale[:, None])
