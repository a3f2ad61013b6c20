"""Protocols this package consumes. Providers fit them structurally and never import this module.

- :class:`KeyedJaggedTensorLike`: the sparse features of one step, laid out feature → rank → sample
  (torchrec's variable-batch ``KeyedJaggedTensor`` and :class:`~vbe_lookup.VBEFeatures` fit).
- :class:`EmbeddingKernel`: fbgemm's TBE forward signature (``SplitTableBatchedEmbeddingBagsCodegen``,
  :class:`~vbe_lookup.TorchEmbeddingKernel` and ssd-tbe-adapter's ``KeyValueEmbeddingBags`` fit).
- :class:`PrefetchableKernel`: kernels that pull the rows of a batch into a cache ahead of the forward.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["EmbeddingKernel", "KeyedJaggedTensorLike", "PrefetchableKernel"]


@runtime_checkable
class KeyedJaggedTensorLike(Protocol):
    """Variable-batch sparse features: ``F`` keys, ``R`` source ranks, jagged ids per sample.

    ``lengths()`` and ``values()`` are laid out feature → rank → sample: the bags of feature ``f`` from
    rank ``r`` are ``stride_per_key_per_rank()[f][r]`` consecutive entries of ``lengths()``.
    """

    def keys(self) -> list[str]:
        """The ``F`` feature names, in the order of ``lengths()``."""
        ...

    def values(self) -> torch.Tensor:
        """Ids ``[N]`` (int32 or int64)."""
        ...

    def lengths(self) -> torch.Tensor:
        """Bag lengths ``[sum of stride_per_key_per_rank]`` (int32 or int64)."""
        ...

    def offsets(self) -> torch.Tensor:
        """``[len(lengths()) + 1]``: 0 followed by the running sum of ``lengths()``."""
        ...

    def weights_or_none(self) -> torch.Tensor | None:
        """Per-id weights ``[N]`` (float) or ``None`` for unweighted features."""
        ...

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """``[F][R]`` batch size of each feature from each source rank."""
        ...


@runtime_checkable
class EmbeddingKernel(Protocol):
    """A table-batched pooled embedding kernel with fbgemm TBE's forward signature.

    Arguments after ``offsets`` are passed by keyword, so a provider may take them positionally or by
    keyword (fbgemm's TBE puts ``feature_requires_grad`` before ``batch_size_per_feature_per_rank``).
    """

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        *,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled lookup.

        Args:
            indices: ``[N]`` ids, bag after bag, feature → (rank →) sample.
            offsets: ``[num_bags + 1]`` bag boundaries into ``indices``, starting at 0.
            per_sample_weights: ``[N]`` float weights or ``None``.
            batch_size_per_feature_per_rank: ``[F][R]`` batch sizes (VBE) or ``None`` (every feature
                has ``num_bags / F`` samples).
            vbe_output: optional 1-D buffer the VBE output is written into.
            vbe_output_offsets: ``[R, F]`` int64 start offsets of each block in ``vbe_output``.

        Returns:
            With VBE, 1-D ``rank → feature → sample → dim`` (``vbe_output`` itself when given);
            otherwise ``[B, sum(dims)]``.
        """
        ...

    def __call__(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        *,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Same as :meth:`forward` (``nn.Module`` routes the call through hooks)."""
        ...


@runtime_checkable
class PrefetchableKernel(Protocol):
    """A kernel whose rows can be fetched into a cache before the forward that needs them."""

    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> None:
        """Fetch the rows ``indices`` (bags delimited by ``offsets``) will touch."""
        ...
