"""Held-out evaluation of the DLRM: AUC and normalized entropy over all ranks, through torchmetrics.

``EvalMetrics`` accumulates the logits and labels of every eval batch on each rank; ``compute()`` is a
collective: torchmetrics all-gathers the states over the default process group (ranks may hold different
numbers of samples) and every rank gets the same numbers:

- ``auc``: area under the ROC curve (``torchmetrics.classification.BinaryAUROC``, exact: every prediction is
  kept; ``auc_thresholds`` bins them instead, in constant memory);
- ``ne``: normalized entropy, the mean log loss divided by the entropy of the label rate
  (He et al., *Practical Lessons from Predicting Clicks on Ads at Facebook*, 2014); 1.0 is what predicting the
  base rate scores, lower is better;
- ``loss``: mean log loss; ``ctr``: label rate; ``samples``: eval samples over all ranks.

torchmetrics was chosen over torcheval: both install with torch 2.13 (CPU pins), torchmetrics is maintained
(torcheval's last release is 0.0.7, 2023) and reduces its metric states over any process group (gloo or NCCL)
by itself. It has no normalized entropy, so :class:`NormalizedEntropy` is a small ``torchmetrics.Metric`` whose
three sum states torchmetrics reduces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from examples.dlrm.data import DLRMBatch

__all__ = ["EvalMetrics", "NormalizedEntropy", "evaluate"]


class NormalizedEntropy(Metric):
    """Normalized entropy of binary predictions from logits; sums reduced over the ranks by torchmetrics."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    bce_sum: torch.Tensor
    label_sum: torch.Tensor
    count: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.add_state("bce_sum", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("label_sum", default=zero.clone(), dist_reduce_fx="sum")
        self.add_state("count", default=zero.clone(), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``logits`` ``[B]`` float, ``labels`` ``[B]`` in {0, 1}."""
        logits64, labels64 = logits.detach().double(), labels.detach().double()
        self.bce_sum += F.binary_cross_entropy_with_logits(logits64, labels64, reduction="sum")
        self.label_sum += labels64.sum()
        self.count += labels64.numel()

    def compute(self) -> dict[str, torch.Tensor]:
        """``{"ne", "loss", "ctr", "samples"}`` as 0-d float64 tensors (NaN without samples)."""
        count = self.count.clamp_min(1.0)
        loss = self.bce_sum / count
        ctr = (self.label_sum / count).clamp(1e-12, 1 - 1e-12)
        entropy = -(ctr * ctr.log() + (1 - ctr) * (1 - ctr).log())
        nan = torch.full_like(loss, math.nan)
        empty = self.count == 0
        return {
            "ne": torch.where(empty, nan, loss / entropy),
            "loss": torch.where(empty, nan, loss),
            "ctr": torch.where(empty, nan, self.label_sum / count),
            "samples": self.count.clone(),
        }


class EvalMetrics:
    """AUC and NE of one evaluation pass; ``compute()`` is collective (every rank calls it).

    Args:
        device: where the metric states live (the batches' device; NCCL reduces CUDA tensors only).
        auc_thresholds: ``None`` for the exact AUC, else that many bins (constant memory for big eval sets).
    """

    def __init__(self, device: torch.device, *, auc_thresholds: int | None = None) -> None:
        self.auc = BinaryAUROC(thresholds=auc_thresholds).to(device)
        self.entropy = NormalizedEntropy().to(device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch of ``[B]`` logits and ``[B]`` labels (stays on the device: no host sync).

        Empty batches are added too: a rank without held-out samples then still holds states of the right
        dtype, which torchmetrics' all-gather needs (its own empty-state fallback is float for every state).
        """
        self.auc.update(torch.sigmoid(logits.detach().float()), labels.detach().long())
        self.entropy.update(logits, labels)

    def compute(self) -> dict[str, float]:
        """``{"auc", "ne", "loss", "ctr", "samples"}`` over every rank's batches (one host sync).

        A rank that saw no sample still joins (torchmetrics gathers its empty state); without any sample
        on any rank every value but ``samples`` is NaN.
        """
        values = {key: float(value) for key, value in self.entropy.compute().items()}
        # The count is reduced over the ranks, so every rank takes the same branch (the AUC's gather is
        # collective too).
        values["auc"] = float(self.auc.compute()) if values["samples"] > 0 else math.nan
        return values

    def reset(self) -> None:
        """Forget the batches (for the next evaluation pass)."""
        self.auc.reset()
        self.entropy.reset()


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[DLRMBatch],
    device: torch.device,
    metrics: EvalMetrics,
) -> dict[str, float]:
    """Run ``model`` without gradients over this rank's held-out ``batches`` and compute the metrics.

    Collective: the sharded embedding module's forward is an all-to-all, so every rank must run the same
    number of forwards: ``batches`` yields the same count on every rank (a rank whose held-out data ran out
    yields empty batches, :func:`examples.dlrm.data.empty_batch`, until every rank's has).
    """
    metrics.reset()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                on_device = batch.to(device, non_blocking=True)
                logits = model(on_device)
                metrics.update(logits, on_device.labels)
    finally:
        model.train(was_training)
    return metrics.compute()
