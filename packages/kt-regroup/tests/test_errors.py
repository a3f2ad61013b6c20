"""Clear errors before any kernel runs; messages name the argument and the value."""

from __future__ import annotations

import pytest
import torch

from kt_regroup import (
    AmbiguousKeyError,
    BackendUnavailableError,
    InvalidGroupsError,
    KeyedTensor,
    KTRegroupAsDict,
    KTRegroupError,
    LayoutMismatchError,
    LengthMismatchError,
    UnknownBackendError,
    UnknownKeyError,
    regroup,
    regroup_as_dict,
)


def _kts() -> list[KeyedTensor]:
    return [
        KeyedTensor(["f1", "f2"], [2, 3], torch.randn(4, 5)),
        KeyedTensor(["f3"], [2], torch.randn(4, 2)),
    ]


def test_unknown_key_names_key_and_group() -> None:
    """A group naming an absent key raises a KeyError naming the key and the group index."""
    with pytest.raises(
        UnknownKeyError,
        match=r"group 1 names key `f9`, which is in none of the 2 KeyedTensors \(keys: f1, f2, f3\)",
    ) as info:
        regroup(_kts(), [["f1"], ["f2", "f9"]])
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, KTRegroupError)


def test_key_in_two_inputs_is_ambiguous() -> None:
    """A key present in two input KeyedTensors raises a ValueError."""
    kts = [KeyedTensor(["f1"], [2], torch.randn(4, 2)), KeyedTensor(["f2", "f1"], [1, 2], torch.randn(4, 3))]
    with pytest.raises(AmbiguousKeyError, match=r"key `f1` is in KeyedTensor 0 and KeyedTensor 1") as info:
        regroup(kts, [["f2"]])
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("second", "pattern"),
    [
        (
            KeyedTensor(["f3"], [2], torch.randn(5, 2)),
            r"KeyedTensor 1 has batch size 5 but KeyedTensor 0 has 4",
        ),
        (
            KeyedTensor(["f3"], [2], torch.randn(4, 2, dtype=torch.float64)),
            r"KeyedTensor 1 has dtype torch.float64 but KeyedTensor 0 has torch.float32",
        ),
        (
            KeyedTensor(["f3"], [2], torch.randn(2, 4), key_dim=0),
            r"KeyedTensor 1 has key_dim=0 but KeyedTensor 0 has key_dim=1",
        ),
        (
            KeyedTensor(["f3"], [2], torch.randn(4, 2, device="meta")),
            r"KeyedTensor 1 is on meta but KeyedTensor 0 is on cpu",
        ),
    ],
    ids=["batch", "dtype", "key_dim", "device"],
)
def test_layout_mismatch_names_the_tensors(second: KeyedTensor, pattern: str) -> None:
    """Batch, dtype, key_dim and device mismatches raise a ValueError naming both tensors."""
    first = KeyedTensor(["f1"], [2], torch.randn(4, 2))
    with pytest.raises(LayoutMismatchError, match=pattern) as info:
        regroup([first, second], [["f1", "f3"]])
    assert isinstance(info.value, ValueError)
    with pytest.raises(LayoutMismatchError, match=pattern):
        KTRegroupAsDict([["f1", "f3"]], ["g"])([first, second])


class _BadLengths:
    """A KeyedTensor-like whose lengths do not add up (torchrec does not check)."""

    def keys(self) -> list[str]:
        return ["a", "b"]

    def length_per_key(self) -> list[int]:
        return [2, 2]

    def values(self) -> torch.Tensor:
        return torch.zeros(3, 5)

    def key_dim(self) -> int:
        return 1


def test_lengths_that_do_not_match_the_values() -> None:
    """Lengths summing to another width than the values' raise before any kernel."""
    with pytest.raises(
        LengthMismatchError, match=r"KeyedTensor 0's `length_per_key` sums to 4 but its values have 5"
    ):
        regroup([_BadLengths()], [["a"]])


def test_module_checks_widths_on_every_call() -> None:
    """A cached layout with values of another width is caught (no out-of-bounds gather)."""
    module = KTRegroupAsDict([["a"]], ["g"])
    good = KeyedTensor(["a", "b"], [2, 2], torch.randn(3, 4))
    module([good])

    class Liar(_BadLengths):
        def values(self) -> torch.Tensor:
            return torch.zeros(3, 3)

    with pytest.raises(LengthMismatchError, match=r"sums to 4 but its values have shape \(3, 3\)"):
        module([Liar()])


def test_malformed_groups_and_names() -> None:
    """A bare str group, non-str keys, and a names/groups count mismatch raise InvalidGroupsError."""
    with pytest.raises(InvalidGroupsError, match=r"group 0 of `groups` is the str 'f1'"):
        regroup(_kts(), ["f1"])
    with pytest.raises(InvalidGroupsError, match=r"group 0 of `groups` holds 3 \(int\)"):
        regroup(_kts(), [[3]])  # type: ignore[list-item]  # the wrong type is the test
    with pytest.raises(InvalidGroupsError, match=r"`keys` has 1 names but `groups` has 2 groups"):
        regroup_as_dict(_kts(), [["f1"], ["f2"]], ["only"])
    with pytest.raises(InvalidGroupsError, match=r"`keys` names an output twice"):
        KTRegroupAsDict([["f1"], ["f2"]], ["x", "x"])


def test_empty_input_list() -> None:
    """No KeyedTensors raises LayoutMismatchError."""
    with pytest.raises(LayoutMismatchError, match=r"`keyed_tensors` is empty"):
        regroup([], [["f1"]])


def test_integer_values_are_rejected() -> None:
    """Only floating-point values are regrouped."""
    kt = KeyedTensor(["a"], [2], torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(LayoutMismatchError, match=r"expected a floating-point dtype"):
        regroup([kt], [["a"]])


def test_unknown_and_unavailable_backends() -> None:
    """Unknown names raise UnknownBackendError; Triton on CPU tensors raises BackendUnavailableError."""
    with pytest.raises(
        UnknownBackendError, match=r"`backend` is 'cuda'; expected one of auto, fbgemm, torch, triton"
    ):
        regroup(_kts(), [["f1"]], backend="cuda")
    with pytest.raises(UnknownBackendError, match=r"`backend` is 'nope'"):
        KTRegroupAsDict([["f1"]], ["g"], backend="nope")
    with pytest.raises(
        BackendUnavailableError, match=r"`backend` is 'triton' but Triton kernels need CUDA tensors"
    ):
        regroup(_kts(), [["f1"]], backend="triton")
