"""VBEFeatures crosses process boundaries: pickling rebuilds it through its constructor."""

from __future__ import annotations

import pickle

import torch

from vbe_lookup import VBEFeatures


def test_vbe_features_pickle_round_trip() -> None:
    """An unpickled VBEFeatures has the same keys, ids, lengths, strides, weights and host counts."""
    features = VBEFeatures(
        keys=["a", "b"],
        values=torch.tensor([3, 1, 4, 1, 5]),
        lengths=torch.tensor([2, 0, 1, 2]),
        stride_per_key_per_rank=[[1, 1], [2, 0]],
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]),
        length_per_key=[2, 3],
    )
    copy = pickle.loads(pickle.dumps(features))
    assert isinstance(copy, VBEFeatures)
    assert copy.keys() == features.keys()
    torch.testing.assert_close(copy.values(), features.values())
    torch.testing.assert_close(copy.lengths(), features.lengths())
    assert copy.stride_per_key_per_rank() == features.stride_per_key_per_rank()
    weights = copy.weights_or_none()
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]))
    assert copy.length_per_key() == [2, 3]
