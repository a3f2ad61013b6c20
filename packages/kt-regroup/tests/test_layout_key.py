"""KTRegroupAsDict recognises the input layout by comparing lists, and never serves a stale plan."""

from __future__ import annotations

import pytest
import torch

from kt_regroup import KeyedTensor, KTRegroupAsDict, LayoutMismatchError, regroup


class _SharedListKT:
    """A KeyedTensor-like that hands out its own lists (as torchrec's KeyedTensor does), not copies."""

    def __init__(self, keys: list[str], lengths: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = keys, lengths, values

    def keys(self) -> list[str]:
        return self._keys

    def length_per_key(self) -> list[int]:
        return self._lengths

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return 1


def test_lists_mutated_in_place_between_calls_get_a_new_plan() -> None:
    module = KTRegroupAsDict([["a"], ["b"]], ["x", "y"], backend="torch")
    keys, lengths = ["a", "b"], [2, 3]
    values = torch.arange(10.0).view(2, 5)
    out = module([_SharedListKT(keys, lengths, values)])
    torch.testing.assert_close(out["x"], values[:, :2])
    keys.reverse()  # now "b" holds the first 2 columns... of a layout with lengths [3, 2]
    lengths.reverse()
    out = module([_SharedListKT(keys, lengths, values)])
    torch.testing.assert_close(out["x"], values[:, 3:])
    torch.testing.assert_close(out["y"], values[:, :3])


def test_same_layout_new_objects_reuses_the_plan() -> None:
    module = KTRegroupAsDict([["b", "a"]], ["x"], backend="torch")
    for seed in range(3):
        values = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
        out = module([_SharedListKT(["a", "b"], [2, 3], values)])
        torch.testing.assert_close(out["x"], torch.cat([values[:, 2:], values[:, :2]], dim=1))
    assert len(module._plans) == 1


def test_changed_key_dim_of_a_later_input_is_noticed() -> None:
    """A cached layout whose second input switches to key_dim=0 raises instead of reading it as key_dim=1."""
    module = KTRegroupAsDict([["b", "a"]], ["x"], backend="torch")
    first = KeyedTensor(["a"], [4], torch.randn(4, 4))
    module([first, KeyedTensor(["b"], [4], torch.randn(4, 4))])
    # Same keys and lengths, [4, 4] values: only key_dim says the blocks now lie along dim 0.
    transposed = KeyedTensor(["b"], [4], torch.randn(4, 4), key_dim=0)
    with pytest.raises(
        LayoutMismatchError, match=r"KeyedTensor 1 has key_dim=0 but KeyedTensor 0 has key_dim=1"
    ):
        module([first, transposed])
    with pytest.raises(LayoutMismatchError, match=r"KeyedTensor 1 has key_dim=0"):
        regroup([first, transposed], [["b", "a"]])


def test_all_inputs_switching_key_dim_get_their_own_plan() -> None:
    """Every input on key_dim=0 after a key_dim=1 call: a new plan, blocks read along dim 0."""
    module = KTRegroupAsDict([["b", "a"]], ["x"], backend="torch")
    values = torch.arange(16.0).view(4, 4)
    module([KeyedTensor(["a"], [4], values), KeyedTensor(["b"], [4], values + 100)])
    out = module(
        [KeyedTensor(["a"], [4], values, key_dim=0), KeyedTensor(["b"], [4], values + 100, key_dim=0)]
    )
    torch.testing.assert_close(out["x"], torch.cat([values + 100, values], dim=0))


class _CountingStr(str):
    """A key name that counts how often it is hashed."""

    hashes = 0

    def __hash__(self) -> int:
        _CountingStr.hashes += 1
        return str.__hash__(self)


def test_cached_layout_is_not_rehashed_per_call() -> None:
    """A call on a cached layout hashes no key name (hashing ~1,000 names cost ~30 us a call)."""
    names = [_CountingStr(f"k{i}") for i in range(50)]
    module = KTRegroupAsDict([names[::2], names[1::2]], ["x", "y"], backend="torch")
    kt = KeyedTensor(names, [2] * 50, torch.randn(3, 100))
    module([kt])
    _CountingStr.hashes = 0
    for _ in range(3):
        module([kt])
    assert _CountingStr.hashes == 0


def test_layout_key_pickles_and_hashes_like_its_tuple() -> None:
    """The key equals and hashes like the plain tuple, and is re-hashed when unpickled (a deepcopy too)."""
    import copy
    import pickle

    module = KTRegroupAsDict([["b", "a"]], ["x"], backend="torch")
    module([KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5))])
    (key,) = module._plans
    assert hash(key) == hash(tuple(key))
    for clone in (pickle.loads(pickle.dumps(key)), copy.deepcopy(key)):
        assert clone == key
        assert hash(clone) == hash(tuple(key))
    copied = copy.deepcopy(module)
    out = copied([KeyedTensor(["a", "b"], [2, 3], torch.ones(4, 5))])
    assert len(copied._plans) == 1
    torch.testing.assert_close(out["x"], torch.ones(4, 5))
