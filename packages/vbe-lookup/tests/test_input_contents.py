"""GroupedVBELookup checks what it reads of the input: ``length_per_key`` and KJT-like producers' tensors.

Issue 14, items 14 and 16: a wrong ``length_per_key`` with the right total, and inputs that are not
``VBEFeatures`` (a torchrec KJT, any ``KeyedJaggedTensorLike``), are caught before any kernel runs, and
fbgemm's in-place offsets repair never reaches the features' own offsets.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.errors import BatchLayoutError, InvalidFeaturesError, VBELookupError
from vbe_lookup.testing import random_features, reference_pooled

HAS_FBGEMM = _fbgemm.fbgemm_available()


class CountingKernel(torch.nn.Module):
    """A TorchEmbeddingKernel that counts its calls."""

    def __init__(self, rows: list[int], dims: list[int]) -> None:
        super().__init__()
        self.inner = TorchEmbeddingKernel(rows, dims)
        self.calls = 0

    def feature_dims(self) -> list[int]:
        """Embedding dim of each feature."""
        return self.inner.feature_dims()

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.inner(indices, offsets, **kwargs)
        return out


class KJTLike:
    """A minimal ``KeyedJaggedTensorLike`` that is not a ``VBEFeatures`` (its tensors are taken as given)."""

    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        stride: list[list[int]],
        *,
        offsets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        length_per_key: list[int] | None = None,
    ) -> None:
        self._keys, self._values, self._lengths, self._stride = keys, values, lengths, stride
        self._offsets = offsets
        self._weights = weights
        self._length_per_key = length_per_key

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is not None:
            return self._offsets
        return torch.cat([torch.zeros(1, dtype=self._lengths.dtype), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride_per_key_per_rank(self) -> list[list[int]]:
        return self._stride

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key


KEYS = ["a", "b", "c"]


def _lookup(check_indices: Any = "auto") -> tuple[GroupedVBELookup, list[CountingKernel]]:
    first, second = CountingKernel([10, 20], [4, 4]), CountingKernel([30], [4])
    lookup = GroupedVBELookup(
        [KernelGroup(first, ["a", "b"], [4, 4]), KernelGroup(second, ["c"], [4])], check_indices=check_indices
    )
    return lookup, [first, second]


def _tensors() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """6 ids: feature a has 1, b has 2, c has 3 (one rank, one or two samples)."""
    values = torch.tensor([1, 2, 3, 4, 5, 6])
    lengths = torch.tensor([1, 2, 1, 2])
    return values, lengths, [[1], [1], [2]]


@pytest.mark.parametrize("mode", ["auto", "always"], ids=["auto", "always"])
def test_wrong_length_per_key_with_the_right_total_is_rejected(mode: str) -> None:
    """A ``length_per_key`` summing to ``len(values)`` but wrong per feature is a BatchLayoutError."""
    lookup, kernels = _lookup(mode)
    values, lengths, stride = _tensors()
    features = VBEFeatures(KEYS, values, lengths, stride, length_per_key=[1, 3, 2])
    with pytest.raises(
        BatchLayoutError, match=r"`length_per_key\[1\]` = 3 but feature `b`.*sum to 2"
    ) as info:
        lookup(features)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, VBELookupError)
    assert [k.calls for k in kernels] == [0, 0]
    # The right counts pass and give the reference.
    good = VBEFeatures(KEYS, values, lengths, stride, length_per_key=[1, 2, 3])
    tables = {
        "a": kernels[0].inner.split_embedding_weights()[0],
        "b": kernels[0].inner.split_embedding_weights()[1],
        "c": kernels[1].inner.split_embedding_weights()[0],
    }
    torch.testing.assert_close(lookup(good).values(), reference_pooled(tables, good))


def test_wrong_length_per_key_of_a_kjt_like_input_is_rejected() -> None:
    """A producer's ``length_per_key_or_none()`` is checked the same way (size, total, then each entry)."""
    lookup, kernels = _lookup("always")
    values, lengths, stride = _tensors()
    with pytest.raises(BatchLayoutError, match=r"`length_per_key\[0\]` = 2"):
        lookup(KJTLike(KEYS, values, lengths, stride, length_per_key=[2, 1, 3]))
    with pytest.raises(BatchLayoutError, match="`length_per_key` has 2 entries for 3 keys"):
        lookup(KJTLike(KEYS, values, lengths, stride, length_per_key=[3, 3]))
    with pytest.raises(BatchLayoutError, match="`length_per_key` sums to 7"):
        lookup(KJTLike(KEYS, values, lengths, stride, length_per_key=[1, 3, 3]))
    assert [k.calls for k in kernels] == [0, 0]


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
def test_fbgemm_never_rewrites_the_features_offsets() -> None:
    """Unchecked bad input reaches fbgemm, whose bounds check repairs offsets in place: never the features'."""
    values, lengths, stride = _tensors()
    # Two kernels: the first one's offsets are a slice of the features' offsets (wrong counts).
    two = GroupedVBELookup(
        [
            KernelGroup(_fbgemm.new_tbe([10, 20], [4, 4]), ["a", "b"], [4, 4]),
            KernelGroup(_fbgemm.new_tbe([30], [4]), ["c"], [4]),
        ],
        check_indices="never",
    )
    features = VBEFeatures(KEYS, values, lengths, stride, length_per_key=[1, 1, 4])
    before = features.offsets().clone()
    two(features)
    torch.testing.assert_close(features.offsets(), before)
    # One kernel reading the whole input: lengths that sum past the ids.
    one = GroupedVBELookup([KernelGroup(_fbgemm.new_tbe([10], [4]), ["a"], [4])], check_indices="never")
    short = VBEFeatures(["a"], torch.tensor([1, 2]), torch.tensor([2, 3]), [[2]])
    before = short.offsets().clone()
    one(short)
    torch.testing.assert_close(short.offsets(), before)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"values": torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])}, InvalidFeaturesError, "`values` must be"),
        ({"values": torch.tensor([[1, 2, 3, 4, 5, 6]])}, InvalidFeaturesError, "`values` must be"),
        (
            {"lengths": torch.tensor([1, 2, 1, 2], dtype=torch.int16)},
            InvalidFeaturesError,
            "`lengths` must be",
        ),
        ({"weights": torch.ones(5)}, InvalidFeaturesError, "`weights` must be a float tensor shaped like"),
        ({"weights": torch.ones(6, dtype=torch.int64)}, InvalidFeaturesError, "`weights` must be a float"),
        (
            {"offsets": torch.tensor([0, 1, 3, 4, 6], dtype=torch.int16)},
            InvalidFeaturesError,
            "`offsets` must",
        ),
        (
            {"offsets": torch.tensor([0, 1, 3, 6])},
            BatchLayoutError,
            r"`offsets` has 4 entries; expected .* 5",
        ),
        (
            {"offsets": torch.tensor([0, 2, 3, 4, 6])},
            BatchLayoutError,
            "`offsets` disagree with `lengths` at bag 0",
        ),
        ({"offsets": torch.tensor([1, 2, 4, 5, 6])}, BatchLayoutError, r"`offsets\[0\]` is 1"),
    ],
    ids=[
        "float-ids",
        "2d-ids",
        "int16-lengths",
        "short-weights",
        "int-weights",
        "int16-offsets",
        "offsets-size",
        "offsets-vs-lengths",
        "offsets-start",
    ],
)
def test_kjt_like_input_is_validated_like_vbe_features(
    change: dict[str, torch.Tensor], error: type[Exception], match: str
) -> None:
    """A KJT-like input that is not ``VBEFeatures`` gets the same checks, before any kernel runs."""
    lookup, kernels = _lookup()
    values, lengths, stride = _tensors()
    args: dict[str, Any] = {"values": values, "lengths": lengths, "offsets": None, "weights": None} | change
    features = KJTLike(
        KEYS, args["values"], args["lengths"], stride, offsets=args["offsets"], weights=args["weights"]
    )
    with pytest.raises(error, match=match) as info:
        lookup(features)
    assert isinstance(info.value, VBELookupError)
    assert [k.calls for k in kernels] == [0, 0]


def test_valid_kjt_like_input_matches_vbe_features() -> None:
    """A valid KJT-like input (with weights and offsets) gives what the same ``VBEFeatures`` gives."""
    lookup, _ = _lookup()
    features = random_features(KEYS, [10, 20, 30], [[2, 1], [0, 3], [1, 1]], weighted=True)
    like = KJTLike(
        features.keys(),
        features.values(),
        features.lengths(),
        features.stride_per_key_per_rank(),
        offsets=features.offsets().clone(),
        weights=features.weights_or_none(),
        length_per_key=features.length_per_key(),
    )
    torch.testing.assert_close(lookup(like).values(), lookup(features).values())
