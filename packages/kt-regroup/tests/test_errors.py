"""Clear errors before any kernel runs; messages name the argument and the value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kt_regroup import (
    AmbiguousKeyError,
    ArgumentTypeError,
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


def test_integer_values_are_rejected_at_construction() -> None:
    """A KeyedTensor of int64 values is rejected when it is made, not first when it is regrouped."""
    with pytest.raises(
        LayoutMismatchError, match=r"`values` have dtype torch.int64; expected a floating-point dtype"
    ):
        KeyedTensor(["a"], [2], torch.zeros(3, 2, dtype=torch.int64))


def test_integer_values_of_a_foreign_keyed_tensor_are_rejected() -> None:
    """A KeyedTensor-like of int values (not built by us) is rejected by regroup, before any kernel."""

    class IntValues(_BadLengths):
        def length_per_key(self) -> list[int]:
            return [2, 3]

        def values(self) -> torch.Tensor:
            return torch.zeros(3, 5, dtype=torch.int64)

    with pytest.raises(LayoutMismatchError, match=r"expected a floating-point dtype"):
        regroup([IntValues()], [["a"]])


_KT = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5))
# Wrong-typed arguments, typed Any: the wrong type is the test.
_NONE: Any = None
_TENSOR: Any = torch.randn(4, 5)
_SINGLE: Any = _KT
_HALVES: Any = [2.5, 2.5]
_FLOATS: Any = [2.0, 3.0]


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda: regroup([_TENSOR], [["a"]]),
            r"`keyed_tensors\[0\]` is a plain torch.Tensor of shape \(4, 5\)",
        ),
        (
            lambda: KTRegroupAsDict([["a"]], ["g"])([_KT, _TENSOR]),
            r"`keyed_tensors\[1\]` is a plain torch.Tensor",
        ),
        (
            lambda: regroup([_KT, _NONE], [["a"]]),
            r"`keyed_tensors\[1\]` is None; expected a KeyedTensor-like",
        ),
        (lambda: KTRegroupAsDict([["a"]], ["g"])([_NONE]), r"`keyed_tensors\[0\]` is None"),
        (lambda: regroup([_KT], _NONE), r"`groups` must be a list of lists of keys; got None"),
        (lambda: KTRegroupAsDict(_NONE, ["g"]), r"`groups` must be a list of lists of keys; got None"),
        (lambda: regroup([_KT], [["a"], _NONE]), r"group 1 of `groups` is None; expected a list of keys"),
        (
            lambda: regroup_as_dict([_KT], [["a"]], _NONE),
            r"`keys` must be a list of names, one per group; got None",
        ),
        (
            lambda: KTRegroupAsDict([["a"]], ["g"])(_SINGLE),
            r"`keyed_tensors` is a single KeyedTensor; expected a list of them \(write \[kt\]\)",
        ),
        (lambda: regroup(_SINGLE, [["a"]]), r"`keyed_tensors` is a single KeyedTensor"),
        (
            lambda: KeyedTensor("ab", [2, 3], torch.randn(4, 5)),
            r"`keys` must be a list of str; got the str 'ab'",
        ),
        (
            lambda: KeyedTensor(["a", "b"], _HALVES, torch.randn(4, 5)),
            r"`length_per_key` holds 2.5 \(float\); expected int widths",
        ),
        (
            lambda: KeyedTensor(["a", "b"], _FLOATS, torch.randn(4, 5)),
            r"`length_per_key` holds 2.0 \(float\)",
        ),
    ],
    ids=[
        "plain-tensor",
        "plain-tensor-module",
        "none-in-list",
        "none-in-list-module",
        "groups-none",
        "groups-none-module",
        "group-none",
        "names-none",
        "single-kt-module",
        "single-kt-regroup",
        "str-keys",
        "float-lengths",
        "integral-float-lengths",
    ],
)
def test_wrong_argument_types_raise_argument_type_error(call: Callable[[], object], pattern: str) -> None:
    """Wrong types give ArgumentTypeError (a KTRegroupError and a TypeError) naming the argument."""
    with pytest.raises(ArgumentTypeError, match=pattern) as info:
        call()
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, KTRegroupError)


def test_an_input_without_key_dim_is_named() -> None:
    """An object with values() but no key_dim() is named, by the module and by regroup."""

    class NoKeyDim:
        def keys(self) -> list[str]:
            return ["a"]

        def length_per_key(self) -> list[int]:
            return [2]

        def values(self) -> torch.Tensor:
            return torch.zeros(3, 2)

    odd: Any = NoKeyDim()
    for call in (lambda: KTRegroupAsDict([["a"]], ["g"])([odd]), lambda: regroup([odd], [["a"]])):
        with pytest.raises(
            ArgumentTypeError, match=r"`keyed_tensors\[0\]` is NoKeyDim, which has no `key_dim\(\)`"
        ):
            call()


def test_float_lengths_of_a_foreign_keyed_tensor_are_not_truncated() -> None:
    """A KeyedTensor-like reporting float lengths is an error, not silently truncated widths."""

    class FloatLengths(_BadLengths):
        def length_per_key(self) -> list[int]:
            return [2.5, 2.5]  # type: ignore[list-item]  # the wrong type is the test

    with pytest.raises(ArgumentTypeError, match=r"KeyedTensor 0's `length_per_key` holds 2.5"):
        regroup([FloatLengths()], [["a"]])


def test_integer_like_lengths_are_accepted() -> None:
    """numpy-free integer scalars (0-d int tensors) count as int widths."""
    kt = KeyedTensor(["a", "b"], [torch.tensor(2), torch.tensor(3)], torch.randn(4, 5))  # type: ignore[list-item]  # int-like
    assert kt.length_per_key() == [2, 3]
    assert all(type(n) is int for n in kt.length_per_key())


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
