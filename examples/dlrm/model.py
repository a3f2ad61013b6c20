"""The DLRM: bottom MLP, sharded embedding bags, KT regroup into the interaction group, dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from examples.dlrm.data import DLRMBatch
from examples.dlrm.dense_graphs import DenseGraphs, bucket_sizes, pad_rows, weighted_bce
from kt_regroup import KeyedTensor, KTRegroupAsDict

__all__ = ["DLRM", "MLP", "DLRMHead", "DotInteraction"]

DENSE_KEY = "dense"
INTERACTION_GROUP = "interaction"


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (and after the last one when ``final_relu``).

    Input ``[B, in_features]``, output ``[B, layers[-1]]``.
    """

    def __init__(self, in_features: int, layers: Sequence[int], *, final_relu: bool, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        modules: list[nn.Module] = []
        width = in_features
        for i, out in enumerate(layers):
            linear = nn.Linear(width, out)
            # Seeded init, independent of the global RNG: every rank builds identical dense weights.
            bound = (1.0 / width) ** 0.5
            with torch.no_grad():
                linear.weight.uniform_(-bound, bound, generator=gen)
                linear.bias.uniform_(-bound, bound, generator=gen)
            modules.append(linear)
            if i < len(layers) - 1 or final_relu:
                modules.append(nn.ReLU())
            width = out
        super().__init__(*modules)


class DotInteraction(nn.Module):
    """Pairwise dot products of ``F`` embeddings: ``[B, F, D] -> [B, F (F - 1) / 2]`` (strict upper triangle)."""

    _rows: torch.Tensor
    _cols: torch.Tensor
    _flat: torch.Tensor

    def __init__(self, num_embeddings: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_embeddings, num_embeddings, offset=1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        self.register_buffer("_flat", rows * num_embeddings + cols, persistent=False)
        self.num_embeddings = num_embeddings

    @property
    def output_size(self) -> int:
        """Interactions per sample."""
        return self.num_embeddings * (self.num_embeddings - 1) // 2

    def forward(self, stacked: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(stacked, stacked.transpose(1, 2))
        # One index_select over the flattened gram: its backward is an index_add. Advanced indexing
        # (gram[:, rows, cols]) has a sort-based index_put backward that took 0.47 ms of a 1.7 ms step on an H200.
        return gram.flatten(1).index_select(1, self._flat)


class DLRMHead(nn.Module):
    """Interaction, top MLP and the weighted loss: the dense part after the KT regroup.

    forward(grouped ``[B, (F + 1) * D]`` (dense vector first), labels ``[B]``, weight ``[B]``) -> loss ``[]``,
    ``sum(weight * bce(logits, labels))``; :meth:`logits` gives ``[B]`` logits. One module so that
    ``torch.cuda.make_graphed_callables`` can capture it (``examples/dlrm/dense_graphs.py``).
    """

    def __init__(
        self, *, num_embeddings: int, embedding_dim: int, top_layers: Sequence[int], seed: int
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.interaction = DotInteraction(num_embeddings)
        self.top = MLP(
            embedding_dim + self.interaction.output_size, [*top_layers, 1], final_relu=False, seed=seed
        )

    def logits(self, grouped: torch.Tensor) -> torch.Tensor:
        """``[B]`` logits of the grouped embeddings."""
        stacked = grouped.view(grouped.shape[0], self.interaction.num_embeddings, self.embedding_dim)
        top_in = torch.cat([grouped[:, : self.embedding_dim], self.interaction(stacked)], dim=1)
        logits: torch.Tensor = self.top(top_in).squeeze(1)
        return logits

    def forward(self, grouped: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weighted_bce(self.logits(grouped), labels, weight)


class DLRM(nn.Module):
    """DLRM over a (sharded) embedding module.

    forward(batch): the dense features go through the bottom MLP to ``[B, D]`` (a one-key KeyedTensor
    ``"dense"``); ``sparse_arch(batch.sparse_features)`` returns the pooled embeddings of the local batch as a
    KeyedTensor-like ``[B, F * D]``; ``KTRegroupAsDict`` puts ``dense`` and the ``F`` sparse features into the
    interaction group ``[B, (F + 1) * D]``; dot interaction, concatenated with the dense vector, feeds the top MLP,
    whose output is the logit ``[B]``.
    """

    def __init__(
        self,
        *,
        sparse_arch: nn.Module,
        sparse_features: Sequence[str],
        embedding_dim: int,
        num_dense: int,
        bottom_layers: Sequence[int],
        top_layers: Sequence[int],
        regroup_backend: str = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.num_dense = num_dense
        self.sparse_feature_names = list(sparse_features)
        self.bottom = MLP(num_dense, [*bottom_layers, embedding_dim], final_relu=True, seed=seed)
        self.sparse_arch = sparse_arch
        self.regroup = KTRegroupAsDict(
            groups=[[DENSE_KEY, *self.sparse_feature_names]],
            keys=[INTERACTION_GROUP],
            backend=regroup_backend,
        )
        self.head = DLRMHead(
            num_embeddings=len(self.sparse_feature_names) + 1,
            embedding_dim=embedding_dim,
            top_layers=top_layers,
            seed=seed + 1,
        )
        self.graphs: DenseGraphs | None = None
        self._loss_weights: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

    @property
    def top(self) -> MLP:
        """The top MLP (held by :attr:`head`)."""
        return self.head.top

    @property
    def interaction(self) -> DotInteraction:
        """The dot interaction (held by :attr:`head`)."""
        return self.head.interaction

    def capture_dense(self, *, min_batch: int, max_batch: int, granularity: int) -> None:
        """Capture the dense part in CUDA graphs for every padded batch size in ``[min_batch, max_batch]``.

        Call after the model is on its CUDA device and before training; :meth:`train_loss` then replays them.
        """
        device = next(self.bottom.parameters()).device
        self.graphs = DenseGraphs(
            bottom=self.bottom,
            head=self.head,
            num_dense=self.num_dense,
            grouped_width=self.interaction.num_embeddings * self.embedding_dim,
            buckets=bucket_sizes(min_batch, max_batch, granularity),
            device=device,
        )

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated on every rank (their gradients are averaged over the ranks)."""
        return [*self.bottom.parameters(), *self.top.parameters()]

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """State of the replicated (dense) part: bottom and top MLPs (copies on the host)."""
        return {
            f"{prefix}.{k}": v.detach().to("cpu", copy=True)
            for prefix, module in (("bottom", self.bottom), ("top", self.top))
            for k, v in module.state_dict().items()
        }

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`dense_state_dict` returned."""
        for prefix, module in (("bottom", self.bottom), ("top", self.top)):
            module.load_state_dict(
                {k.removeprefix(prefix + "."): v for k, v in state.items() if k.startswith(prefix + ".")}
            )

    def _grouped(self, batch: DLRMBatch, dense: torch.Tensor) -> torch.Tensor:
        """Sparse lookup, then the KT regroup of ``dense`` and the pooled embeddings: ``[B, (F + 1) * D]``."""
        return self.regrouped(dense, self.sparse_arch(batch.sparse_features))

    def regrouped(self, dense: torch.Tensor, pooled: Any) -> torch.Tensor:
        """The KT regroup of the bottom MLP's ``dense [B, D]`` and ``pooled`` (a KeyedTensor-like of the
        sparse features): the interaction group ``[B, (F + 1) * D]``."""
        dense_kt = KeyedTensor(keys=[DENSE_KEY], length_per_key=[self.embedding_dim], values=dense)
        grouped: torch.Tensor = self.regroup([dense_kt, pooled])[INTERACTION_GROUP]
        return grouped

    def forward(self, batch: DLRMBatch) -> torch.Tensor:
        """``[B]`` logits (eager; evaluation)."""
        return self.head.logits(self._grouped(batch, self.bottom(batch.dense_features)))

    def train_loss(self, batch: DLRMBatch) -> torch.Tensor:
        """Mean BCE loss of ``batch``; through the captured dense graphs when :meth:`capture_dense` ran.

        With graphs the batch is padded to its bucket: the bottom MLP runs on ``[Bp, 13]``, its first ``B`` rows
        go through the lookup and the regroup, the grouped rows are padded back to ``Bp`` and the padded rows
        weigh 0 in the loss (exactly zero gradients).
        """
        rows = batch.batch_size
        if self.graphs is None:
            dense = self.bottom(batch.dense_features)
            weight = torch.full_like(batch.labels, 1.0 / max(rows, 1))
            loss: torch.Tensor = self.head(self._grouped(batch, dense), batch.labels, weight)
            return loss
        padded = self.graphs.bucket(rows)
        dense = self.graphs.bottom(pad_rows(batch.dense_features, padded))[:rows]
        grouped = pad_rows(self._grouped(batch, dense), padded)
        return self.graphs.head(
            grouped, pad_rows(batch.labels, padded), self._loss_weight(rows, padded, grouped)
        )

    def _loss_weight(self, rows: int, padded: int, like: torch.Tensor) -> torch.Tensor:
        """``[padded]``: ``1 / rows`` for the batch's rows, 0 for the padding (cached per batch size)."""
        key = (rows, padded, like.dtype, like.device)
        weight = self._loss_weights.get(key)
        if weight is None:
            weight = (torch.arange(padded, device=like.device) < rows).to(like.dtype) / max(rows, 1)
            if len(self._loss_weights) >= 256:
                self._loss_weights.clear()
            self._loss_weights[key] = weight
        return weight
