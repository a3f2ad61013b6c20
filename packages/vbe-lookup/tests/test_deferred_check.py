"""Issue 14 item 15: what an unchecked out-of-range id does, and the sync-free ``check_indices="deferred"``."""

from __future__ import annotations

import pytest
import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures
from vbe_lookup.errors import BatchLayoutError, IndexOutOfRangeError, VBELookupError


def _lookup(check_indices: str) -> tuple[GroupedVBELookup, TorchEmbeddingKernel]:
    kernel = TorchEmbeddingKernel([10, 20], [4, 4], optimizer=None)
    lookup = GroupedVBELookup([KernelGroup(kernel, ["a", "b"], [4, 4])], check_indices=check_indices)  # type: ignore[arg-type]  # modes as strings
    return lookup, kernel


def _features(a_id: int, b_id: int = 3) -> VBEFeatures:
    return VBEFeatures(["a", "b"], torch.tensor([a_id, b_id]), torch.tensor([1, 1]), [[1], [1]])


def test_never_reads_the_neighbouring_tables_row() -> None:
    """The documented contract: unchecked, an id past its table reads another table's row of that dim."""
    lookup, kernel = _lookup("never")
    a, b = kernel.split_embedding_weights()
    out = lookup(_features(12, -1)).values().view(2, 4)
    torch.testing.assert_close(out[0], b[2].detach())  # a's id 12 of 10 rows: b's row 2
    torch.testing.assert_close(out[1], a[9].detach())  # b's id -1: a's last row


def test_deferred_flags_a_bad_id_at_the_next_check() -> None:
    """``"deferred"`` runs the forward, then ``check_deferred()`` raises for it and clears the flags."""
    lookup, _ = _lookup("deferred")
    lookup(_features(1))
    lookup.check_deferred()  # nothing bad yet
    lookup(_features(12))
    lookup(_features(1))
    with pytest.raises(
        IndexOutOfRangeError, match=r"at least one of the 2 forward\(s\).*out of range"
    ) as info:
        lookup.check_deferred()
    assert isinstance(info.value, IndexError)
    assert isinstance(info.value, VBELookupError)
    lookup.check_deferred()  # cleared
    lookup(_features(1, -1))
    with pytest.raises(IndexOutOfRangeError, match="1 forward"):
        lookup.check_deferred()


def test_deferred_flags_lengths_and_length_per_key() -> None:
    """Lengths that do not cover the ids and a wrong ``length_per_key`` are deferred the same way."""
    lookup, _ = _lookup("deferred")
    lookup(
        VBEFeatures(
            ["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]), [[1], [1]], length_per_key=[1, 2]
        )
    )
    with pytest.raises(BatchLayoutError, match="`length_per_key` entry"):
        lookup.check_deferred()
    with pytest.raises(BatchLayoutError, match="`offsets` must end"):  # the kernel's own check
        lookup(VBEFeatures(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([2, 2]), [[1], [1]]))
    with pytest.raises(BatchLayoutError, match="`lengths` that do not sum"):
        lookup.check_deferred()


def test_check_deferred_is_a_no_op_in_other_modes() -> None:
    """Under ``"never"`` nothing is recorded, so ``check_deferred()`` never raises."""
    lookup, _ = _lookup("never")
    lookup(_features(12))
    lookup.check_deferred()


@pytest.mark.gpu
def test_deferred_check_makes_no_host_sync_on_cuda() -> None:
    """On CUDA a ``"deferred"`` forward with a length_per_key and a bad id syncs nowhere; the check raises."""
    kernel = TorchEmbeddingKernel([10, 20], [4, 4], optimizer=None, device="cuda")
    other = TorchEmbeddingKernel([30], [4], optimizer=None, device="cuda")
    lookup = GroupedVBELookup(
        [KernelGroup(kernel, ["a", "b"], [4, 4]), KernelGroup(other, ["c"], [4])], check_indices="deferred"
    )
    features = VBEFeatures(
        ["a", "b", "c"],
        torch.tensor([12, 3, 4], device="cuda"),
        torch.tensor([1, 1, 1], device="cuda"),
        [[1], [1], [1]],
        length_per_key=[1, 1, 1],
    )
    lookup(features)  # first sight of the layout: host-side metadata, may copy
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lookup(features)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(IndexOutOfRangeError, match="2 forward"):
        lookup.check_deferred()
