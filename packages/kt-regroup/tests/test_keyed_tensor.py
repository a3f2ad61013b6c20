"""KeyedTensor: construction checks, accessors and pytree registration."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from kt_regroup import (
    AmbiguousKeyError,
    InvalidGroupsError,
    KeyedTensor,
    KeyedTensorLike,
    LayoutMismatchError,
    LengthMismatchError,
    UnknownKeyError,
)


def _kt(key_dim: int = 1) -> KeyedTensor:
    values = torch.arange(10.0).view(2, 5)
    return KeyedTensor(
        ["a", "b"], [2, 3], values if key_dim == 1 else values.t().contiguous(), key_dim=key_dim
    )


def test_accessors_follow_torchrec_names() -> None:
    """keys, length_per_key, offset_per_key, values, key_dim return what was given."""
    kt = _kt()
    assert kt.keys() == ["a", "b"]
    assert kt.length_per_key() == [2, 3]
    assert kt.offset_per_key() == [0, 2, 5]
    assert kt.key_dim() == 1
    assert kt.values().shape == (2, 5)
    assert isinstance(kt, KeyedTensorLike)


@pytest.mark.parametrize("key_dim", [0, 1], ids=["key_dim0", "key_dim1"])
def test_getitem_and_to_dict_give_each_keys_block(key_dim: int) -> None:
    """kt[key] and to_dict()[key] are the key's slice along key_dim."""
    kt = _kt(key_dim)
    full = torch.arange(10.0).view(2, 5)
    expected_b = full[:, 2:5] if key_dim == 1 else full[:, 2:5].t()
    torch.testing.assert_close(kt["b"], expected_b)
    torch.testing.assert_close(kt.to_dict()["b"], expected_b)
    assert list(kt.to_dict()) == ["a", "b"]


def test_keys_returns_a_copy() -> None:
    """Mutating the list keys() returned does not change the KeyedTensor."""
    kt = _kt()
    kt.keys().append("z")
    assert kt.keys() == ["a", "b"]


def test_from_tensor_list_concatenates_along_key_dim() -> None:
    """from_tensor_list cats the per-key tensors and records their widths."""
    a, b = torch.randn(3, 2), torch.randn(3, 4)
    kt = KeyedTensor.from_tensor_list(["a", "b"], [a, b])
    assert kt.length_per_key() == [2, 4]
    torch.testing.assert_close(kt.values(), torch.cat([a, b], dim=1))
    kt0 = KeyedTensor.from_tensor_list(["a", "b"], [a.t(), b.t()], key_dim=0)
    torch.testing.assert_close(kt0["b"], b.t())


def test_lengths_must_sum_to_the_width() -> None:
    """A width mismatch names both numbers."""
    with pytest.raises(LengthMismatchError, match=r"sums to 6 but `values` has 5 along key_dim=1"):
        KeyedTensor(["a", "b"], [3, 3], torch.zeros(2, 5))


def test_lengths_must_match_keys() -> None:
    """One length per key."""
    with pytest.raises(LengthMismatchError, match=r"`length_per_key` has 1 entries but `keys` has 2"):
        KeyedTensor(["a", "b"], [5], torch.zeros(2, 5))


def test_duplicate_keys_are_ambiguous() -> None:
    """A key twice in one KeyedTensor raises AmbiguousKeyError (a ValueError)."""
    with pytest.raises(AmbiguousKeyError, match=r"names key `a` more than once") as info:
        KeyedTensor(["a", "a"], [2, 3], torch.zeros(2, 5))
    assert isinstance(info.value, ValueError)


def test_values_must_be_2d_and_key_dim_0_or_1() -> None:
    """Other ranks and key_dims raise LayoutMismatchError."""
    with pytest.raises(LayoutMismatchError, match=r"`values` must be a 2-D tensor"):
        KeyedTensor(["a"], [5], torch.zeros(5))
    with pytest.raises(LayoutMismatchError, match=r"`key_dim` is 2"):
        KeyedTensor(["a"], [5], torch.zeros(2, 5), key_dim=2)


def test_keys_must_be_str() -> None:
    """Non-str keys raise InvalidGroupsError."""
    with pytest.raises(InvalidGroupsError, match=r"`keys` must hold str; got 3"):
        KeyedTensor([3], [5], torch.zeros(2, 5))  # type: ignore[list-item]  # the wrong type is the test


def test_getitem_unknown_key() -> None:
    """An unknown key raises UnknownKeyError (a KeyError) naming the key."""
    with pytest.raises(UnknownKeyError, match=r"key `z` is not in this KeyedTensor \(keys: a, b\)") as info:
        _kt()["z"]
    assert isinstance(info.value, KeyError)


def test_pytree_round_trip() -> None:
    """KeyedTensor flattens to its values and rebuilds with the same keys and lengths."""
    kt = _kt()
    leaves, spec = pytree.tree_flatten(kt)
    assert len(leaves) == 1
    assert leaves[0] is kt.values()
    again = pytree.tree_unflatten(leaves, spec)
    assert isinstance(again, KeyedTensor)
    assert again.keys() == kt.keys()
    assert again.length_per_key() == kt.length_per_key()
