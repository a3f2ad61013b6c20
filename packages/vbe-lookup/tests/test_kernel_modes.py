"""Kernel modes the lookup cannot honour are rejected by name (issue 14, items 17 and 20).

A mean-pooling kernel under an owner that applies mean itself (``kernel_pooling="sum"``, the sharded
modules) would divide twice; fbgemm-gpu-cpu 1.8 has no bf16 forward and gets weighted mean with fp16
output wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.errors import ConfigurationError, VBELookupError
from vbe_lookup.interfaces import EmbeddingKernel
from vbe_lookup.sharding import KernelSpec, ShardedEmbeddingBags, ShardingPlan, TableConfig
from vbe_lookup.testing import random_features, reference_pooled

HAS_FBGEMM = _fbgemm.fbgemm_available()


def test_mean_kernel_rejected_when_the_owner_applies_mean() -> None:
    """``kernel_pooling="sum"`` rejects a mean-pooling kernel by its pooling mode, naming its group."""
    mean = TorchEmbeddingKernel([10], [4], pooling="mean")
    with pytest.raises(ConfigurationError, match=r"kernel group 1 \(features `b`\).*'mean'.*divide") as info:
        GroupedVBELookup(
            [KernelGroup(TorchEmbeddingKernel([10], [4]), ["a"], [4]), KernelGroup(mean, ["b"], [4])],
            kernel_pooling="sum",
        )
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, VBELookupError)
    GroupedVBELookup([KernelGroup(mean, ["b"], [4])])  # the default accepts any pooling
    with pytest.raises(ConfigurationError, match="`kernel_pooling`"):
        GroupedVBELookup([KernelGroup(mean, ["b"], [4])], kernel_pooling="mean")  # type: ignore[arg-type]  # deliberately wrong


class PoolingModeKernel(torch.nn.Module):
    """A kernel that states its pooling like fbgemm's TBE does (an enum-like ``pooling_mode``)."""

    class _Mode:
        name = "MEAN"

    pooling_mode = _Mode()

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, **kwargs: object) -> torch.Tensor:
        raise AssertionError("never called")


def test_pooling_mode_enum_is_read() -> None:
    """A kernel's ``pooling_mode`` enum (fbgemm's ``PoolingMode.MEAN``) is read too."""
    with pytest.raises(ConfigurationError, match="'mean'"):
        GroupedVBELookup([KernelGroup(PoolingModeKernel(), ["a"], [4])], kernel_pooling="sum")


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
def test_fbgemm_mean_tbe_rejected_when_the_owner_applies_mean() -> None:
    """An fbgemm TBE built with ``PoolingMode.MEAN`` is rejected the same way."""
    with pytest.raises(ConfigurationError, match="'mean'"):
        GroupedVBELookup(
            [KernelGroup(_fbgemm.new_tbe([10], [4], pooling="mean"), ["a"], [4])], kernel_pooling="sum"
        )


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    with _dist_harness.one_rank_gloo():
        yield


def test_sharded_module_rejects_a_mean_pooling_kernel_factory(one_rank: None) -> None:
    """``ShardedEmbeddingBags`` applies mean itself: a factory building mean-pooling kernels is rejected."""
    del one_rank
    tables = [TableConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=("f",), pooling="mean")]

    def factory(spec: KernelSpec) -> EmbeddingKernel:
        return TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
            pooling="mean",
        )

    with pytest.raises(ConfigurationError, match="mean pooling itself"):
        ShardedEmbeddingBags(tables, ShardingPlan.table_wise(tables, 1), kernel_factory=factory)


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
@pytest.mark.parametrize(
    ("weights_dtype", "output_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["bf16-bf16", "fp32-bf16", "bf16-fp32"],
)
def test_fbgemm_cpu_bf16_tbe_rejected(weights_dtype: torch.dtype, output_dtype: torch.dtype) -> None:
    """fbgemm-gpu-cpu has no bf16 forward: a bf16 TBE is a ConfigurationError at construction."""
    tbe = _fbgemm.new_tbe([10], [4], weights_dtype=weights_dtype, output_dtype=output_dtype)
    with pytest.raises(ConfigurationError, match=r"fbgemm-gpu-cpu TBE.*no bfloat16"):
        GroupedVBELookup([KernelGroup(tbe, ["a"], [4])])


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
def test_fbgemm_cpu_fp32_tbe_with_bf16_lookup_output() -> None:
    """The documented bf16 route on CPU: an fp32 fbgemm TBE placed into a bf16 lookup output."""
    tbe = _fbgemm.new_tbe([10, 20], [4, 4])
    for w in tbe.split_embedding_weights():
        torch.nn.init.normal_(w)
    lookup = GroupedVBELookup([KernelGroup(tbe, ["a", "b"], [4, 4])], output_dtype=torch.bfloat16)
    features = random_features(["a", "b"], [10, 20], [[2, 1], [1, 3]])
    out = lookup(features).values()
    assert out.dtype == torch.bfloat16
    tables = dict(zip(["a", "b"], tbe.split_embedding_weights(), strict=True))
    torch.testing.assert_close(out, reference_pooled(tables, features).to(torch.bfloat16))


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
def test_fbgemm_cpu_fp16_weighted_mean_rejected() -> None:
    """fbgemm-gpu-cpu 1.8 drops the 1/L of a weighted mean with fp16 output: weights are refused there."""
    tbe = _fbgemm.new_tbe([10], [4], pooling="mean", output_dtype=torch.float16)
    lookup = GroupedVBELookup([KernelGroup(tbe, ["a"], [4])])
    weighted = VBEFeatures(["a"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]), [[2]], torch.ones(3))
    with pytest.raises(ConfigurationError, match=r"`weights` given.*float16 output"):
        lookup(weighted)
    unweighted = VBEFeatures(["a"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]), [[2]])
    assert lookup(unweighted).values().dtype == torch.float16  # unweighted mean is right
