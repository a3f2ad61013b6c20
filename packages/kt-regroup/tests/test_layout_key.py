"""KTRegroupAsDict recognises the input layout by comparing lists, and never serves a stale plan."""

from __future__ import annotations

import torch

from kt_regroup import KTRegroupAsDict


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
