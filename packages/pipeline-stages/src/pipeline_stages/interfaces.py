"""Protocols that ``pipeline_stages`` consumes; providers fit them structurally and never import them.

The method names follow torchrec (``Pipelineable``, ``ShardedEmbeddingBagCollection.prefetch``), so torchrec
objects fit too.

* :class:`Pipelineable`: a batch (or a part of one) that knows how to move itself to a device and how to
  tell the CUDA caching allocator that another stream uses its tensors.
* :class:`SparseDistModule`: a module whose sparse-feature input distribution (an all-to-all) runs in two
  phases, start then wait, and which accepts already-distributed input for its next forward.
* :class:`Prefetchable`: a module that can pull the rows a distributed batch will look up into a faster
  tier (cache, HBM) ahead of the forward, e.g. a key-value (SSD) embedding table.
* :class:`OutputDistOverlap`: a sparse module whose forward can run a callback while the host waits for its
  output collective (gloo), where a pipeline prepares the next batch instead of waiting idle.
* :class:`KeyedTensorLike`: pooled embeddings of several keys (torchrec's ``KeyedTensor``, kt-regroup's,
  vbe-lookup's pooled output), an embedding module output that :class:`~pipeline_stages.BackwardOverlap` cuts.

How a :class:`SparseDistModule` receives its pre-distributed input (no FX rewrite): ``enqueue_pipelined_input``
appends the distributed features of one batch to a FIFO inside the module; the module's next ``forward`` pops
the oldest entry and uses it instead of running its own input distribution. ``forward`` with an empty FIFO
runs start + wait itself, so the module works unchanged outside a pipeline.
:class:`~pipeline_stages.SparseDataDistUtil` calls ``enqueue_pipelined_input`` from a forward pre-hook of the
module, right before the forward that consumes the entry, so that nothing is left queued in a module between
forwards (``detach()`` then leaves the module exactly as it was).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

__all__ = ["KeyedTensorLike", "OutputDistOverlap", "Pipelineable", "Prefetchable", "SparseDistModule"]

_PipelineableT = TypeVar("_PipelineableT", bound="Pipelineable")


@runtime_checkable
class Pipelineable(Protocol):
    """A batch that can move to a device and mark its tensors as used by another stream (torchrec's name)."""

    def to(self: _PipelineableT, device: torch.device, non_blocking: bool = False) -> _PipelineableT:
        """Return a copy on ``device``; ``non_blocking=True`` lets the copy overlap (pinned host memory)."""
        ...

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Call ``Tensor.record_stream(stream)`` on every CUDA tensor this object holds."""
        ...


@runtime_checkable
class SparseDistModule(Protocol):
    """A module whose input distribution runs in two phases and that accepts pre-distributed input."""

    def start_input_dist(self, features: Any) -> Any:
        """Start the all-to-all of ``features`` (this rank's local batch); return a handle to wait on."""
        ...

    def wait_input_dist(self, handle: Any) -> Any:
        """Finish the all-to-all started by :meth:`start_input_dist`; return the distributed features."""
        ...

    def enqueue_pipelined_input(self, dist_features: Any) -> None:
        """Queue distributed features; the next ``forward`` pops them (FIFO) instead of distributing itself."""
        ...


@runtime_checkable
class Prefetchable(Protocol):
    """A module that prefetches the rows a distributed batch needs (torchrec's ``prefetch``)."""

    def prefetch(self, dist_features: Any, forward_stream: torch.cuda.Stream | None = None) -> None:
        """Pull the rows ``dist_features`` will look up into the fast tier.

        ``forward_stream`` is the stream the forward that consumes them will run on (None on CPU).
        """
        ...


@runtime_checkable
class OutputDistOverlap(Protocol):
    """A sparse module that runs a callback while its forward's host waits for the output collective.

    :class:`~pipeline_stages.SparseDataDistUtil` (``wait_after_forward=True``) registers one on every driven
    module that has it: the next batch's input dist wait and prefetch then run while the current batch's
    pooled embeddings are in flight, instead of after the forward returns. A module calls it only where
    the wait blocks the host (a CPU process group); on CUDA the wait is stream-ordered and the callback
    runs after the forward as before.
    """

    def set_output_dist_overlap(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` in every later forward between launching the output collective and waiting
        for it (``None`` removes it); the collective is waited for even when the callback raises."""
        ...


@runtime_checkable
class KeyedTensorLike(Protocol):
    """Pooled embeddings of several keys side by side along ``key_dim`` (torchrec's ``KeyedTensor`` names).

    :meth:`~pipeline_stages.BackwardOverlap.run` cuts such an output at its ``values()`` and rebuilds it as
    ``type(kt)(keys=kt.keys(), length_per_key=kt.length_per_key(), values=cut)`` (plus ``key_dim=0`` when
    the keys lie along dimension 0): the constructor of torchrec's ``KeyedTensor``, of
    ``kt_regroup.KeyedTensor`` and of vbe-lookup's pooled output.
    """

    def keys(self) -> list[str]:
        """The keys (feature names), in the order their blocks appear along ``key_dim``."""
        ...

    def length_per_key(self) -> list[int]:
        """Width of each key's block along ``key_dim``."""
        ...

    def values(self) -> torch.Tensor:
        """``[B, sum(lengths)]`` when ``key_dim() == 1``, ``[sum(lengths), B]`` when ``key_dim() == 0``."""
        ...

    def key_dim(self) -> int:
        """The dimension of ``values()`` along which the keys' blocks are laid out (0 or 1)."""
        ...
