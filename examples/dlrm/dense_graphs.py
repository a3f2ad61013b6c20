"""The DLRM's dense part captured in CUDA graphs, with batch sizes bucketed so that captures are reused.

The trainer's step is host-bound on a GPU: every dense op (bottom MLP, interaction, top MLP, loss and their
backward) is a Python call and a kernel launch. ``torch.cuda.make_graphed_callables`` captures the forward and
the backward of a callable once per input shape and replays both as one launch each. Batch sizes vary per step
(``[min_batch_size, batch_size]``), so a batch of ``B`` samples is padded to the next bucket ``Bp`` (a multiple
of ``granularity``) and the padded rows get weight 0 in the loss: their gradients are exactly zero and the
result equals the unpadded step up to float summation order.

Two graphed callables per bucket, because the sparse lookup and the KT regroup run eagerly between them:

- ``bottom``: ``dense_features [Bp, 13] -> [Bp, D]`` (the bottom MLP);
- ``head``: ``(grouped [Bp, (F + 1) * D], labels [Bp], weight [Bp]) -> loss []`` (interaction, top MLP and
  the weighted BCE loss; ``weight`` is ``1 / B`` on real rows and 0 on padding).

Captures happen once, at construction (their warm-up runs write ``.grad``: the constructor clears it); a batch
larger than the largest bucket is an error naming it. On CPU nothing is captured: :class:`DenseGraphs` is not
used there and the eager path computes the same function (``DLRM.train_loss``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DenseGraphs", "bucket_sizes", "pad_rows", "weighted_bce"]


def bucket_sizes(min_batch: int, max_batch: int, granularity: int) -> list[int]:
    """Padded batch sizes covering ``[min_batch, max_batch]``: multiples of ``granularity``, the last >= max."""
    if granularity < 1:
        raise ValueError(f"`granularity` is {granularity}, expected >= 1")
    if not 0 <= min_batch <= max_batch or max_batch < 1:
        raise ValueError(f"batch range [{min_batch}, {max_batch}] is empty or negative")
    first = max(1, -(-max(min_batch, 1) // granularity)) * granularity
    last = -(-max_batch // granularity) * granularity
    return list(range(first, last + 1, granularity))


def weighted_bce(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum(weight * bce(logits, labels))``: with ``weight = 1 / B`` on B real rows, the mean BCE over them."""
    return (F.binary_cross_entropy_with_logits(logits, labels, reduction="none") * weight).sum()


class _Shared(nn.Module):
    """Calls ``inner``: a per-bucket module over shared parameters, for ``make_graphed_callables``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(*args)
        return out


class DenseGraphs:
    """Graphed ``bottom`` and ``head`` callables of one model, one pair per padded batch size.

    Args:
        bottom: the bottom MLP module (``[B, num_dense] -> [B, D]``).
        head: a module ``(grouped [B, (F + 1) D], labels [B], weight [B]) -> loss []``.
        num_dense: dense features per sample.
        grouped_width: ``(F + 1) * D``.
        buckets: padded batch sizes to capture (from :func:`bucket_sizes`).
        device: the CUDA device.
    """

    def __init__(
        self,
        *,
        bottom: nn.Module,
        head: nn.Module,
        num_dense: int,
        grouped_width: int,
        buckets: Sequence[int],
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"`device` is {device}, expected a CUDA device (CUDA graphs)")
        if not buckets:
            raise ValueError("`buckets` is empty, expected at least one padded batch size")
        self.buckets = sorted({int(b) for b in buckets})
        self._bottom: dict[int, Callable[..., torch.Tensor]] = {}
        self._head: dict[int, Callable[..., torch.Tensor]] = {}
        params = [*bottom.parameters(), *head.parameters()]
        for size in self.buckets:
            dense_in = torch.randn(size, num_dense, device=device)
            grouped = torch.randn(size, grouped_width, device=device, requires_grad=True)
            labels = torch.randint(0, 2, (size,), device=device).float()
            weight = torch.full((size,), 1.0 / size, device=device)
            # make_graphed_callables replaces the forward of the module it is given: one thin module per bucket
            # (sharing the real module's parameters) keeps every bucket's graphs.
            self._bottom[size] = torch.cuda.make_graphed_callables(_Shared(bottom), (dense_in,))  # type: ignore[assignment]  # returns the module's graphed twin
            self._head[size] = torch.cuda.make_graphed_callables(_Shared(head), (grouped, labels, weight))  # type: ignore[assignment]  # as above
        for p in params:  # the captures' warm-up iterations accumulated into .grad
            p.grad = None

    def bucket(self, batch: int) -> int:
        """The smallest captured size holding ``batch`` samples."""
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch of {batch} samples exceeds the largest captured size {self.buckets[-1]}")

    def bottom(self, dense_in: torch.Tensor) -> torch.Tensor:
        """Graphed bottom MLP over ``dense_in [Bp, num_dense]`` (``Bp`` a captured size)."""
        return self._bottom[dense_in.shape[0]](dense_in)

    def head(self, grouped: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Graphed interaction + top MLP + weighted loss over ``[Bp, ...]`` inputs."""
        return self._head[grouped.shape[0]](grouped, labels, weight)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (itself when it has them already)."""
    extra = rows - tensor.shape[0]
    if extra == 0:
        return tensor
    return F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, extra))  # one op (was new_zeros + cat)
