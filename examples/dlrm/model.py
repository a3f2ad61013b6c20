"""The DLRM: bottom MLP, sharded embedding bags, KT regroup into the interaction group, dot interaction, top MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from examples.dlrm.data import DLRMBatch
from kt_regroup import KeyedTensor, KTRegroupAsDict

__all__ = ["DLRM", "MLP", "DotInteraction"]

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

    def __init__(self, num_embeddings: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_embeddings, num_embeddings, offset=1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        self.num_embeddings = num_embeddings

    @property
    def output_size(self) -> int:
        """Interactions per sample."""
        return self.num_embeddings * (self.num_embeddings - 1) // 2

    def forward(self, stacked: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(stacked, stacked.transpose(1, 2))
        return gram[:, self._rows, self._cols]


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
        self.sparse_feature_names = list(sparse_features)
        self.bottom = MLP(num_dense, [*bottom_layers, embedding_dim], final_relu=True, seed=seed)
        self.sparse_arch = sparse_arch
        self.regroup = KTRegroupAsDict(
            groups=[[DENSE_KEY, *self.sparse_feature_names]],
            keys=[INTERACTION_GROUP],
            backend=regroup_backend,
        )
        self.interaction = DotInteraction(len(self.sparse_feature_names) + 1)
        self.top = MLP(
            embedding_dim + self.interaction.output_size, [*top_layers, 1], final_relu=False, seed=seed + 1
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

    def forward(self, batch: DLRMBatch) -> torch.Tensor:
        dense = self.bottom(batch.dense_features)
        pooled = self.sparse_arch(batch.sparse_features)
        dense_kt = KeyedTensor(keys=[DENSE_KEY], length_per_key=[self.embedding_dim], values=dense)
        grouped = self.regroup([dense_kt, pooled])[INTERACTION_GROUP]
        stacked = grouped.view(grouped.shape[0], self.interaction.num_embeddings, self.embedding_dim)
        top_in = torch.cat([dense, self.interaction(stacked)], dim=1)
        logits: torch.Tensor = self.top(top_in).squeeze(1)
        return logits
