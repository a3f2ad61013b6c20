"""VBEFeatures: immutable, torchrec-shaped, shape-checked without a host sync."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vbe_lookup import KeyedJaggedTensorLike, VBEFeatures
from vbe_lookup.errors import BatchLayoutError, InvalidFeaturesError, VBELookupError


def _features(**overrides: object) -> VBEFeatures:
    args: dict[str, object] = {
        "keys": ["a", "b"],
        "values": torch.tensor([1, 2, 3, 4, 5]),
        "lengths": torch.tensor([2, 0, 1, 2]),
        "stride_per_key_per_rank": [[1, 1], [2, 0]],
        "weights": None,
    }
    args.update(overrides)
    return VBEFeatures(**args)  # type: ignore[arg-type]


def test_accessors_follow_torchrec() -> None:
    """keys/values/lengths/offsets/weights_or_none/stride_per_key_per_rank return the layout given."""
    features = _features()
    assert features.keys() == ["a", "b"]
    assert features.values().tolist() == [1, 2, 3, 4, 5]
    assert features.lengths().tolist() == [2, 0, 1, 2]
    assert features.offsets().tolist() == [0, 2, 2, 3, 5]
    assert features.offsets() is features.offsets()  # computed once
    assert features.weights_or_none() is None
    assert features.stride_per_key_per_rank() == [[1, 1], [2, 0]]
    assert features.length_per_key() == [2, 3]
    assert features.length_per_key_or_none() is None
    assert features.num_ranks() == 2
    assert isinstance(features, KeyedJaggedTensorLike)


def test_int32_offsets_keep_dtype() -> None:
    """int32 lengths give int32 offsets."""
    features = _features(lengths=torch.tensor([2, 0, 1, 2], dtype=torch.int32))
    assert features.offsets().dtype == torch.int32
    assert features.offsets().tolist() == [0, 2, 2, 3, 5]


def test_immutable() -> None:
    """Attributes cannot be set or deleted; returned lists are copies."""
    features = _features()
    with pytest.raises(AttributeError):
        features._keys = ("x",)
    with pytest.raises(AttributeError):
        del features._values
    features.keys().append("zzz")
    features.stride_per_key_per_rank()[0][0] = 99
    assert features.keys() == ["a", "b"]
    assert features.stride_per_key_per_rank() == [[1, 1], [2, 0]]
    assert not dataclasses.is_dataclass(features)


def test_to_and_from_kjt_like() -> None:
    """`to` copies tensors and keeps the layout; `from_kjt_like` wraps any KJT-like object."""
    features = _features(weights=torch.ones(5), length_per_key=[2, 3])
    moved = features.to("cpu")
    assert moved.keys() == features.keys()
    assert moved.length_per_key_or_none() == [2, 3]
    assert VBEFeatures.from_kjt_like(features) is features

    class KJT:
        def keys(self) -> list[str]:
            return ["a", "b"]

        def values(self) -> torch.Tensor:
            return features.values()

        def lengths(self) -> torch.Tensor:
            return features.lengths()

        def offsets(self) -> torch.Tensor:
            return features.offsets()

        def weights_or_none(self) -> torch.Tensor | None:
            return None

        def stride_per_key_per_rank(self) -> list[list[int]]:
            return [[1, 1], [2, 0]]

    wrapped = VBEFeatures.from_kjt_like(KJT())
    assert wrapped.length_per_key() == [2, 3]


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"keys": ["a", "a"]}, InvalidFeaturesError, "`keys` must be unique"),
        ({"values": torch.tensor([1.0, 2.0])}, InvalidFeaturesError, "`values`"),
        ({"lengths": torch.tensor([[1, 2]])}, InvalidFeaturesError, "`lengths`"),
        ({"stride_per_key_per_rank": [[1, 1]]}, BatchLayoutError, "1 rows but there are 2 `keys`"),
        ({"stride_per_key_per_rank": [[1, 1], [2]]}, BatchLayoutError, "different numbers of ranks"),
        ({"stride_per_key_per_rank": [[1, 1], [3, 0]]}, BatchLayoutError, "sums to 5 bags"),
        ({"stride_per_key_per_rank": [[1, 1], [-1, 3]]}, BatchLayoutError, "negative"),
        ({"weights": torch.ones(4)}, InvalidFeaturesError, "`weights`"),
        ({"weights": torch.ones(5, dtype=torch.long)}, InvalidFeaturesError, "`weights`"),
        ({"length_per_key": [1, 1]}, BatchLayoutError, "`length_per_key` sums to 2"),
        ({"length_per_key": [5]}, BatchLayoutError, "`length_per_key` has 1 entries"),
    ],
    ids=[
        "dup-keys",
        "float-values",
        "2d-lengths",
        "rows-vs-keys",
        "ragged-ranks",
        "bags-vs-lengths",
        "negative-batch",
        "weights-shape",
        "weights-dtype",
        "length-per-key-sum",
        "length-per-key-len",
    ],
)
def test_malformed_input_is_rejected(
    overrides: dict[str, object], error: type[Exception], message: str
) -> None:
    """Shape/layout errors name the argument and derive from VBELookupError and a builtin."""
    with pytest.raises(error, match=message) as info:
        _features(**overrides)
    assert isinstance(info.value, VBELookupError)
    assert isinstance(info.value, ValueError)
