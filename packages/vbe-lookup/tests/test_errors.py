"""GroupedVBELookup rejects bad configurations and inputs with clear errors before any kernel runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.errors import (
    BatchLayoutError,
    ConfigurationError,
    DimensionMismatchError,
    FeatureCoverageError,
    IndexOutOfRangeError,
    VBELookupError,
)


class CountingKernel(torch.nn.Module):
    """A kernel that records calls and otherwise delegates to a TorchEmbeddingKernel."""

    def __init__(self, rows: list[int], dims: list[int]) -> None:
        super().__init__()
        self.inner = TorchEmbeddingKernel(rows, dims)
        self.calls = 0

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.inner(indices, offsets, **kwargs)
        return out


def _lookup(**kwargs: Any) -> tuple[GroupedVBELookup, CountingKernel]:
    counting = CountingKernel([5], [4])
    groups = [
        KernelGroup(TorchEmbeddingKernel([10, 20], [4, 8]), ["a", "b"], [4, 8]),
        KernelGroup(counting, ["c"], [4], num_embeddings=[5]),
    ]
    return GroupedVBELookup(groups, **kwargs), counting


def _features(keys: list[str], values: list[int], lengths: list[int], stride: list[list[int]]) -> VBEFeatures:
    return VBEFeatures(keys, torch.tensor(values), torch.tensor(lengths), stride)


def test_feature_in_two_groups() -> None:
    """A feature served by two kernels is rejected at construction."""
    kernel = TorchEmbeddingKernel([10], [4])
    with pytest.raises(FeatureCoverageError, match="`a` is covered by two kernel groups") as info:
        GroupedVBELookup(
            [KernelGroup(kernel, ["a"], [4]), KernelGroup(TorchEmbeddingKernel([10], [4]), ["a"], [4])]
        )
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, VBELookupError)


def test_feature_in_no_group() -> None:
    """An input feature no kernel serves is rejected before any kernel runs."""
    lookup, counting = _lookup()
    features = _features(["a", "b", "c", "zz"], [1, 2, 3, 4], [1, 1, 1, 1], [[1], [1], [1], [1]])
    with pytest.raises(FeatureCoverageError, match="`zz` is covered by no kernel group"):
        lookup(features)
    assert counting.calls == 0


def test_kernel_feature_missing_from_input() -> None:
    """A kernel's feature absent from the input is named."""
    lookup, counting = _lookup()
    with pytest.raises(FeatureCoverageError, match="needs feature\\(s\\) `c`"):
        lookup(_features(["a", "b"], [1, 2], [1, 1], [[1], [1]]))
    assert counting.calls == 0


def test_dims_disagree_with_kernel() -> None:
    """Declared dims must match the kernel's tables."""
    with pytest.raises(DimensionMismatchError, match=r"`dims` \[8, 4\].*\[4, 8\]") as info:
        KernelGroup(TorchEmbeddingKernel([10, 20], [4, 8]), ["a", "b"], [8, 4])
    assert isinstance(info.value, ValueError)
    with pytest.raises(DimensionMismatchError, match="`dims` has 1 entries for 2"):
        KernelGroup(TorchEmbeddingKernel([10, 20], [4, 8]), ["a", "b"], [4])


@pytest.mark.skipif(not _fbgemm.fbgemm_available(), reason="fbgemm unavailable")
def test_dims_disagree_with_fbgemm_tbe() -> None:
    """fbgemm TBEs describe their tables too."""
    with pytest.raises(DimensionMismatchError):
        KernelGroup(_fbgemm.new_tbe([10], [8]), ["a"], [4])


def test_unknown_bounds_check_mode_is_rejected_by_name() -> None:
    """An unknown bounds-check mode fails before fbgemm is even loaded."""
    with pytest.raises(ValueError, match="`bounds_check`"):
        _fbgemm.new_tbe([10], [8], bounds_check="strict")


@pytest.mark.skipif(not _fbgemm.fbgemm_available(), reason="fbgemm is not installed: no TBE to configure")
def test_fbgemm_tbe_bounds_check_mode_reaches_the_tbe() -> None:
    """``new_tbe(bounds_check=...)`` sets fbgemm's ``BoundsCheckMode`` on the TBE it builds."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

    tbe = _fbgemm.new_tbe([10], [8], bounds_check="none")
    assert tbe.bounds_check_mode_int == BoundsCheckMode.NONE.value


def test_bad_configuration() -> None:
    """Unknown merge modes, empty groups and bad check modes are configuration errors."""
    kernel = TorchEmbeddingKernel([10], [4])
    with pytest.raises(ConfigurationError, match="`merge`"):
        GroupedVBELookup([KernelGroup(kernel, ["a"], [4])], merge="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="`groups`"):
        GroupedVBELookup([])
    with pytest.raises(ConfigurationError, match="`check_indices`"):
        GroupedVBELookup([KernelGroup(kernel, ["a"], [4])], check_indices="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="`features`"):
        KernelGroup(kernel, [], [])


def test_stride_inconsistent_with_lengths() -> None:
    """Batch sizes that do not add up to the number of lengths are rejected (no kernel runs)."""

    class LooseKJT:
        def keys(self) -> list[str]:
            return ["a", "b", "c"]

        def values(self) -> torch.Tensor:
            return torch.tensor([1, 2, 3])

        def lengths(self) -> torch.Tensor:
            return torch.tensor([1, 1, 1])

        def offsets(self) -> torch.Tensor:
            return torch.tensor([0, 1, 2, 3])

        def weights_or_none(self) -> torch.Tensor | None:
            return None

        def stride_per_key_per_rank(self) -> list[list[int]]:
            return [[1], [2], [1]]

    lookup, counting = _lookup()
    with pytest.raises(
        BatchLayoutError, match="`lengths` has 3 entries but `stride_per_key_per_rank` sums to 4"
    ):
        lookup(LooseKJT())
    assert counting.calls == 0


def test_lengths_do_not_cover_values() -> None:
    """sum(lengths) != len(values) is caught by the id check."""
    lookup, counting = _lookup()
    with pytest.raises(BatchLayoutError, match=r"`lengths` sum to 3 .* `values` holds 4 ids"):
        lookup(_features(["a", "b", "c"], [1, 2, 3, 4], [1, 1, 1], [[1], [1], [1]]))
    assert counting.calls == 0


@pytest.mark.parametrize(
    ("values", "feature", "bad"),
    [([1, 25, 3], "b", 25), ([1, 2, 5], "c", 5), ([-1, 2, 3], "a", -1)],
    ids=["too-large", "user-rows", "negative"],
)
def test_ids_out_of_range(values: list[int], feature: str, bad: int) -> None:
    """Ids outside the table are reported with feature, id and table size, before any kernel runs."""
    lookup, counting = _lookup()
    with pytest.raises(
        IndexOutOfRangeError, match=f"= {bad} is out of range for feature `{feature}`"
    ) as info:
        lookup(_features(["a", "b", "c"], values, [1, 1, 1], [[1], [1], [1]]))
    assert isinstance(info.value, IndexError)
    assert counting.calls == 0


def test_check_indices_never_skips_the_check() -> None:
    """`check_indices="never"` trusts the ids (the kernel then sees them)."""
    lookup, counting = _lookup(check_indices="never")
    lookup(_features(["a", "b", "c"], [1, 2, 3], [1, 1, 1], [[1], [1], [1]]))
    assert counting.calls == 1


def test_kernel_rejects_bad_vbe_arguments() -> None:
    """TorchEmbeddingKernel checks its VBE arguments like fbgemm does, with named arguments."""
    kernel = TorchEmbeddingKernel([10, 20], [4, 8])
    indices, offsets = torch.tensor([1, 2]), torch.tensor([0, 1, 2])
    with pytest.raises(BatchLayoutError, match="`batch_size_per_feature_per_rank`"):
        kernel(indices, offsets, batch_size_per_feature_per_rank=[[1, 1], [1, 1]])
    with pytest.raises(BatchLayoutError, match="not a multiple"):
        kernel(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(BatchLayoutError, match="together"):
        kernel(indices, offsets, batch_size_per_feature_per_rank=[[1], [1]], vbe_output=torch.zeros(12))
    with pytest.raises(BatchLayoutError, match=r"`vbe_output_offsets` must be \[1, 2\]"):
        kernel(
            indices,
            offsets,
            batch_size_per_feature_per_rank=[[1], [1]],
            vbe_output=torch.zeros(12),
            vbe_output_offsets=torch.zeros(2, 1, dtype=torch.long),
        )
    with pytest.raises(ConfigurationError, match="`pooling`"):
        TorchEmbeddingKernel([10], [4], pooling="max")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="`optimizer`"):
        TorchEmbeddingKernel([10], [4], optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="`feature_table_map`"):
        TorchEmbeddingKernel([10], [4], feature_table_map=[0, 1])
    with pytest.raises(ConfigurationError, match="same non-zero number"):
        TorchEmbeddingKernel([10, 20], [4, 8, 16])
