"""The pre-allocated chain when a kernel returns its ``vbe_output`` input as-is (or a view of it), as fbgemm does.

fbgemm's TBE autograd function writes into ``vbe_output`` and returns that tensor without marking it dirty,
so autograd hands back a view "created inside a custom Function"; an in-place autograd op (or
``mark_dirty``) on that view is forbidden. This CPU mimic of fbgemm checks that every later step of the
chain (our fused and plain kernels, the placement copy of a kernel that cannot write in place) accepts it
and that gradients still reach every kernel exactly once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures
from vbe_lookup.testing import ReferenceOptimizer, random_features, reference_pooled

KEYS = ["a", "b", "c", "d", "e", "f"]
ROWS = [11, 12, 13, 14, 15, 16]
DIMS = [4, 8, 4, 12, 8, 4]
STRIDE = [[2, 0, 3], [1, 2, 0], [1, 0, 2], [3, 1, 1], [2, 2, 0], [0, 1, 2]]
LR = 0.1


class _WriteReturnInput(torch.autograd.Function):
    """fbgemm's pattern: write ``y`` into ``out`` (not marked dirty), return ``out`` as-is or as a view."""

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, y: torch.Tensor, index: torch.Tensor, as_view: bool
    ) -> torch.Tensor:
        out.index_copy_(0, index, y.detach())
        ctx.save_for_backward(index)
        return out.view(-1) if as_view else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad, grad.index_select(0, index), None, None


class FbgemmLike(nn.Module):
    """A kernel that writes through ``vbe_output`` like fbgemm's TBE (a fused-SGD torch kernel inside)."""

    def __init__(self, rows: list[int], dims: list[int], *, as_view: bool, in_place: bool = True) -> None:
        super().__init__()
        self.inner = TorchEmbeddingKernel(rows, dims, optimizer="sgd", learning_rate=LR)
        self.dims = dims
        self.as_view = as_view
        self.supports_vbe_output = in_place
        self.calls_in_place = 0

    def split_embedding_weights(self) -> list[torch.Tensor]:
        return self.inner.split_embedding_weights()

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y: torch.Tensor = self.inner(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        if vbe_output is None:
            return y
        assert vbe_output_offsets is not None
        assert batch_size_per_feature_per_rank is not None
        self.calls_in_place += 1
        # The kernel's own order is rank -> feature -> sample -> dim; block (r, f) goes to offsets[r, f].
        index: list[int] = []
        starts = vbe_output_offsets.tolist()
        for r in range(len(starts)):
            for f, dim in enumerate(self.dims):
                size = batch_size_per_feature_per_rank[f][r] * dim
                index.extend(range(starts[r][f], starts[r][f] + size))
        out: torch.Tensor = _WriteReturnInput.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
            vbe_output, y, torch.tensor(index, dtype=torch.long), self.as_view
        )
        return out


def _weights_of(kernel: Any) -> list[torch.Tensor]:
    weights: list[torch.Tensor] = kernel.split_embedding_weights()
    return weights


def _features(seed: int) -> VBEFeatures:
    return random_features(KEYS, ROWS, STRIDE, weighted=True, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("as_view", [False, True], ids=["returns-input", "returns-view"])
def test_chain_accepts_custom_function_views(as_view: bool) -> None:
    """fbgemm-like -> fused torch -> plain torch -> fbgemm-like, plus a placed kernel: output, grads, steps."""
    torch.manual_seed(0)
    first = FbgemmLike(ROWS[0:2], DIMS[0:2], as_view=as_view)
    fused = TorchEmbeddingKernel(ROWS[2:3], DIMS[2:3], optimizer="sgd", learning_rate=LR)
    plain = TorchEmbeddingKernel(ROWS[3:4], DIMS[3:4], optimizer=None)
    last = FbgemmLike(ROWS[4:5], DIMS[4:5], as_view=as_view)
    placed = FbgemmLike(ROWS[5:6], DIMS[5:6], as_view=as_view, in_place=False)
    groups = [
        KernelGroup(first, KEYS[0:2], DIMS[0:2]),
        KernelGroup(fused, KEYS[2:3], DIMS[2:3]),
        KernelGroup(plain, KEYS[3:4], DIMS[3:4]),
        KernelGroup(last, KEYS[4:5], DIMS[4:5]),
        KernelGroup(placed, KEYS[5:6], DIMS[5:6]),
    ]
    lookup = GroupedVBELookup(groups)
    tables: dict[str, torch.Tensor] = {}
    for group in groups:
        weights = _weights_of(group.kernel)
        for name, w in zip(group.features, weights, strict=True):
            tables[name] = w.detach().clone().requires_grad_(True)
    ref_opt = ReferenceOptimizer([tables[k] for k in KEYS if k != "d"], "sgd", LR)
    for step in range(2):
        features = _features(step)
        out = lookup(features)
        ref = reference_pooled(tables, features, order=out.keys())
        torch.testing.assert_close(out.values(), ref.detach())
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(100 + step))
        torch.autograd.backward(out.values(), grad)
        torch.autograd.backward(ref, grad)
        (plain_weight,) = plain.split_embedding_weights()
        ref_grad = tables["d"].grad
        assert ref_grad is not None
        plain_grad = plain.weights_0.grad
        assert isinstance(plain_grad, torch.Tensor)
        torch.testing.assert_close(plain_grad, ref_grad)
        ref_opt.step()
        with torch.no_grad():  # the plain kernel: our own SGD step on both sides
            plain_weight -= LR * plain_grad
            tables["d"] -= LR * ref_grad
        plain.weights_0.grad = None
        tables["d"].grad = None
        for group in groups:
            weights = _weights_of(group.kernel)
            for name, w in zip(group.features, weights, strict=True):
                torch.testing.assert_close(w.detach(), tables[name].detach(), msg=name)
    assert first.calls_in_place == 2
    assert last.calls_in_place == 2
    assert placed.calls_in_place == 0
