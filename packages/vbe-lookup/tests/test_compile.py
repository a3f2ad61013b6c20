"""torch.compile (inductor): TorchEmbeddingKernel and GroupedVBELookup give eager's numbers, forward and backward."""

from __future__ import annotations

import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures
from vbe_lookup.testing import random_features


def _lookup() -> GroupedVBELookup:
    torch.manual_seed(0)
    fused = TorchEmbeddingKernel([10, 20], [4, 8], optimizer="rowwise_adagrad", learning_rate=0.1)
    dense = TorchEmbeddingKernel([30], [4], optimizer=None, pooling="mean")
    return GroupedVBELookup(
        [KernelGroup(fused, ["a", "b"], [4, 8]), KernelGroup(dense, ["c"], [4])], check_indices="never"
    )


def _step(lookup: GroupedVBELookup, features: VBEFeatures) -> torch.Tensor:
    out: torch.Tensor = lookup(features).values()
    loss = (out * torch.linspace(-1, 1, out.numel())).sum()
    torch.autograd.backward(loss)
    return out.detach()


def test_compiled_step_matches_eager() -> None:
    """Two compiled training steps (fused rowwise Adagrad + dense-gradient kernel) equal eager ones."""
    eager, compiled = _lookup(), _lookup()
    step = torch.compile(_step, backend="inductor")
    for i in range(2):
        features = random_features(
            ["a", "b", "c"],
            [10, 20, 30],
            [[2, 1], [1, 3], [2, 2]],
            weighted=True,
            generator=torch.Generator().manual_seed(i),
        )
        torch.testing.assert_close(step(compiled, features), _step(eager, features))
        for (name, want), got in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert want.grad is not None, name
            assert got.grad is not None, name
            torch.testing.assert_close(got.grad, want.grad, msg=name)
        for (name, want), got in zip(eager.state_dict().items(), compiled.state_dict().values(), strict=True):
            torch.testing.assert_close(got, want, msg=name)
