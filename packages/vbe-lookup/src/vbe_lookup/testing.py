"""Helpers for tests (this package's and others'): random VBE features and pure-PyTorch references.

Nothing here is fast; everything here is simple enough to be obviously right.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from vbe_lookup._features import VBEFeatures
from vbe_lookup.interfaces import KeyedJaggedTensorLike

__all__ = ["ReferenceOptimizer", "random_features", "reference_pooled"]


def random_features(
    keys: Sequence[str],
    num_embeddings: Sequence[int],
    stride_per_key_per_rank: Sequence[Sequence[int]],
    *,
    max_length: int = 4,
    weighted: bool = False,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    index_dtype: torch.dtype = torch.int64,
    with_length_per_key: bool = False,
) -> VBEFeatures:
    """Random :class:`VBEFeatures`: bag lengths in ``[0, max_length]``, ids in each key's table range.

    Args:
        keys: feature names.
        num_embeddings: rows of each key's table (ids are drawn below it).
        stride_per_key_per_rank: ``[F][R]`` batch sizes.
        max_length: longest bag.
        weighted: draw per-id weights in ``[0.5, 1.5)``.
        generator: CPU generator for reproducibility.
        device: where the tensors go.
        index_dtype: dtype of ids and lengths.
        with_length_per_key: pass the host-side ids per key (as an input all-to-all would).
    """
    lengths, values = [], []
    for f, rows in enumerate(num_embeddings):
        bags = sum(stride_per_key_per_rank[f])
        lens = torch.randint(0, max_length + 1, (bags,), generator=generator)
        lengths.append(lens)
        values.append(torch.randint(0, rows, (int(lens.sum()),), generator=generator))
    value_t = torch.cat(values) if values else torch.zeros(0, dtype=torch.long)
    weights = torch.rand(value_t.numel(), generator=generator) + 0.5 if weighted else None
    length_t = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.long)
    return VBEFeatures(
        keys,
        value_t.to(device=device, dtype=index_dtype),
        length_t.to(device=device, dtype=index_dtype),
        stride_per_key_per_rank,
        None if weights is None else weights.to(device),
        length_per_key=[v.numel() for v in values] if with_length_per_key else None,
    )


def reference_pooled(
    tables: dict[str, torch.Tensor],
    features: KeyedJaggedTensorLike,
    *,
    pooling: str = "sum",
    order: Sequence[str] | None = None,
) -> torch.Tensor:
    """Pooled VBE output, rank → feature (``order``) → sample → dim, one ``F.embedding_bag`` per feature.

    Args:
        tables: ``[rows, dim]`` table read by each feature (differentiable).
        features: the input.
        pooling: ``"sum"`` or ``"mean"`` (weighted mean divides the weighted sum by the bag length).
        order: output feature order (default: the input's).

    Returns:
        1-D tensor in the tables' dtype.
    """
    keys = features.keys()
    stride = features.stride_per_key_per_rank()
    offsets = features.offsets().to(torch.long)
    values = features.values().to(torch.long)
    weights = features.weights_or_none()
    num_ranks = len(stride[0]) if stride else 0
    blocks: dict[tuple[int, str], torch.Tensor] = {}
    bag = 0
    for f, key in enumerate(keys):
        n_bags = sum(stride[f])
        bag_offsets = offsets[bag : bag + n_bags + 1]
        start, end = int(bag_offsets[0]), int(bag_offsets[-1])
        table = tables[key]
        psw = None if weights is None else weights[start:end].to(table.dtype)
        pooled = F.embedding_bag(
            values[start:end],
            table,
            bag_offsets - start,
            mode="sum",
            per_sample_weights=psw,
            include_last_offset=True,
        )
        if pooling == "mean":
            lengths = (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1)
            pooled = pooled / lengths.to(pooled.dtype)[:, None]
        first = 0
        for r in range(num_ranks):
            blocks[(r, key)] = pooled[first : first + stride[f][r]].reshape(-1)
            first += stride[f][r]
        bag += n_bags
    order = list(keys) if order is None else list(order)
    pieces = [blocks[(r, key)] for r in range(num_ranks) for key in order]
    if not pieces:
        dtype = next(iter(tables.values())).dtype if tables else torch.float32
        return torch.zeros(0, dtype=dtype)
    return torch.cat(pieces)


class ReferenceOptimizer:
    """Dense ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` over leaf tables with ``.grad``.

    Rows with a zero gradient are left exactly unchanged, as the sparse fused optimizers leave rows no
    id touched.
    """

    def __init__(
        self, tables: Sequence[torch.Tensor], optimizer: str, learning_rate: float, eps: float = 1e-8
    ):
        self.tables = list(tables)
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.eps = eps
        self.momentum = [torch.zeros(t.shape[0], dtype=torch.float32, device=t.device) for t in self.tables]

    @torch.no_grad()
    def step(self) -> None:
        """Apply one update from ``.grad`` and clear it."""
        for table, momentum in zip(self.tables, self.momentum, strict=True):
            grad = table.grad
            if grad is None:
                continue
            grad = grad.to(torch.float32)
            if self.optimizer == "sgd":
                table -= (self.learning_rate * grad).to(table.dtype)
            else:
                momentum += grad.square().mean(1)
                table -= (self.learning_rate * grad / (momentum.sqrt() + self.eps)[:, None]).to(table.dtype)
            table.grad = None
