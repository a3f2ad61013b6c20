"""Input validation and the device-independent regroup spec (which block goes where)."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kt_regroup.errors import (
    AmbiguousKeyError,
    ArgumentTypeError,
    InvalidGroupsError,
    LayoutMismatchError,
    LengthMismatchError,
    UnknownKeyError,
)
from kt_regroup.interfaces import KeyedTensorLike

__all__ = [
    "Entry",
    "InputLayout",
    "RegroupSpec",
    "as_lengths",
    "build_spec",
    "check_keyed_tensors",
    "normalize_groups",
    "read_layout",
]

# What regroup calls on each input (the KeyedTensorLike Protocol's methods).
_KT_METHODS = ("keys", "length_per_key", "values", "key_dim")


def _preview(keys: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (", ..." if len(keys) > limit else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One key's block copied into one group: ``out[group][:, out_offset:+length] = in[input][:, in_offset:+length]``.

    ``occurrence`` counts earlier entries of the same key (in group order): 0 for its first use.
    """

    group: int
    input: int
    in_offset: int
    out_offset: int
    length: int
    occurrence: int
    key_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RegroupSpec:
    """Where every output block comes from, for one input layout and one list of groups.

    ``entries`` is group-major in output order; ``key_segments[k] = (input, offset, length)`` for every
    input key ``k`` (input-major order); ``key_entries[k]`` lists the entry indices using key ``k``.
    """

    in_widths: tuple[int, ...]
    out_widths: tuple[int, ...]
    entries: tuple[Entry, ...]
    key_segments: tuple[tuple[int, int, int], ...]
    key_entries: tuple[tuple[int, ...], ...]
    max_occurrences: int
    unit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class InputLayout:
    """What a plan depends on: per-input keys and lengths, ``key_dim``, device and dtype (validated)."""

    keys: tuple[tuple[str, ...], ...]
    lengths: tuple[tuple[int, ...], ...]
    key_dim: int
    batch: int
    device: torch.device
    dtype: torch.dtype


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def as_lengths(lengths: Iterable[Any], where: str) -> tuple[int, ...]:
    """``lengths`` as a tuple of ints; a float (or other non-integer) length is an error, never truncated.

    Args:
        lengths: the widths (ints, or integer scalars such as ``numpy.int64`` or 0-d integer tensors).
        where: how the error names the argument, e.g. ``"`length_per_key`"``.

    Raises:
        ArgumentTypeError: ``lengths`` is not a list, or holds a value that is not an integer.
    """
    if lengths is None or isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise ArgumentTypeError(f"{where} must be a list of int widths; got {_type_name(lengths)}")
    try:
        return tuple(map(operator.index, lengths))
    except TypeError:
        bad = next(n for n in lengths if not _is_index(n))
        raise ArgumentTypeError(
            f"{where} holds {bad!r} ({_type_name(bad)}); expected int widths (a float is not truncated)"
        ) from None


def _is_index(value: Any) -> bool:
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_keyed_tensors(keyed_tensors: object) -> None:
    """Raise a precise error unless ``keyed_tensors`` is a list (or tuple) of KeyedTensor-likes.

    Raises:
        ArgumentTypeError: a single KeyedTensor, or a list holding a plain tensor, ``None`` or another object
            without ``keys()``, ``length_per_key()``, ``values()`` and ``key_dim()``.
    """
    if not isinstance(keyed_tensors, (list, tuple)):
        if all(hasattr(keyed_tensors, name) for name in _KT_METHODS):
            raise ArgumentTypeError(
                f"`keyed_tensors` is a single {type(keyed_tensors).__name__}; expected a list of them "
                "(write [kt])"
            )
        raise ArgumentTypeError(
            f"`keyed_tensors` must be a list of KeyedTensor-likes; got {_type_name(keyed_tensors)}"
        )
    for index, kt in enumerate(keyed_tensors):
        if isinstance(kt, torch.Tensor):
            raise ArgumentTypeError(
                f"`keyed_tensors[{index}]` is a plain torch.Tensor of shape {tuple(kt.shape)}; expected a "
                "KeyedTensor-like (wrap it: KeyedTensor(keys, length_per_key, values))"
            )
        if kt is None:
            raise ArgumentTypeError(f"`keyed_tensors[{index}]` is None; expected a KeyedTensor-like")
        missing = [name for name in _KT_METHODS if not callable(getattr(kt, name, None))]
        if missing:
            raise ArgumentTypeError(
                f"`keyed_tensors[{index}]` is {_type_name(kt)}, which has no "
                f"{', '.join(f'`{m}()`' for m in missing)}; expected a KeyedTensor-like"
            )


def normalize_groups(groups: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """``groups`` as a tuple of tuples of str.

    Raises:
        InvalidGroupsError: ``groups`` or one of its groups is a bare ``str``, or a name is not a ``str``.
        ArgumentTypeError: ``groups`` or one of its groups is ``None`` or not a list.
    """
    if isinstance(groups, str):
        raise InvalidGroupsError(f"`groups` must be a list of lists of keys; got the str {groups!r}")
    if not isinstance(groups, Iterable):
        raise ArgumentTypeError(f"`groups` must be a list of lists of keys; got {_type_name(groups)}")
    result = []
    for index, group in enumerate(groups):
        if isinstance(group, str):
            raise InvalidGroupsError(
                f"group {index} of `groups` is the str {group!r}; expected a list of keys (write [{group!r}])"
            )
        if not isinstance(group, Iterable):
            raise ArgumentTypeError(
                f"group {index} of `groups` is {_type_name(group)}; expected a list of keys"
            )
        names = tuple(group)
        for name in names:
            if not isinstance(name, str):
                raise InvalidGroupsError(
                    f"group {index} of `groups` holds {name!r} ({type(name).__name__}); expected str keys"
                )
        result.append(names)
    return tuple(result)


def read_layout(keyed_tensors: Sequence[KeyedTensorLike]) -> InputLayout:
    """Check the inputs agree with each other and with their own lengths; return their layout.

    Raises:
        ArgumentTypeError: see :func:`check_keyed_tensors`; a length is not an int.
        LayoutMismatchError: no inputs, values not 2-D, or ``key_dim`` / batch size / device / dtype differ
            between inputs, or the dtype is not floating point.
        LengthMismatchError: an input's ``length_per_key`` does not match its keys or its values' width.
    """
    check_keyed_tensors(keyed_tensors)
    if len(keyed_tensors) == 0:
        raise LayoutMismatchError("`keyed_tensors` is empty: at least one KeyedTensor is needed")
    keys = []
    lengths = []
    first = keyed_tensors[0].values()
    key_dim = keyed_tensors[0].key_dim()
    if key_dim not in (0, 1):
        raise LayoutMismatchError(f"KeyedTensor 0 has `key_dim` {key_dim!r}; expected 0 or 1")
    for index, kt in enumerate(keyed_tensors):
        values = kt.values()
        if values.dim() != 2:
            raise LayoutMismatchError(
                f"KeyedTensor {index} has `values` of shape {tuple(values.shape)}; expected a 2-D tensor"
            )
        if kt.key_dim() != key_dim:
            raise LayoutMismatchError(
                f"KeyedTensor {index} has key_dim={kt.key_dim()} but KeyedTensor 0 has key_dim={key_dim}"
            )
        batch_dim = 1 - key_dim
        if values.size(batch_dim) != first.size(batch_dim):
            raise LayoutMismatchError(
                f"KeyedTensor {index} has batch size {values.size(batch_dim)} but KeyedTensor 0 has "
                f"{first.size(batch_dim)}"
            )
        if values.device != first.device:
            raise LayoutMismatchError(
                f"KeyedTensor {index} is on {values.device} but KeyedTensor 0 is on {first.device}"
            )
        if values.dtype != first.dtype:
            raise LayoutMismatchError(
                f"KeyedTensor {index} has dtype {values.dtype} but KeyedTensor 0 has {first.dtype}"
            )
        kt_keys = tuple(kt.keys())
        kt_lengths = as_lengths(kt.length_per_key(), f"KeyedTensor {index}'s `length_per_key`")
        if len(kt_keys) != len(kt_lengths):
            raise LengthMismatchError(
                f"KeyedTensor {index} has {len(kt_keys)} keys but {len(kt_lengths)} `length_per_key` entries"
            )
        if sum(kt_lengths) != values.size(key_dim) or any(n < 0 for n in kt_lengths):
            raise LengthMismatchError(
                f"KeyedTensor {index}'s `length_per_key` sums to {sum(kt_lengths)} but its values have "
                f"{values.size(key_dim)} along key_dim={key_dim} (shape {tuple(values.shape)})"
            )
        keys.append(kt_keys)
        lengths.append(kt_lengths)
    if not first.dtype.is_floating_point:
        raise LayoutMismatchError(f"`values` have dtype {first.dtype}; expected a floating-point dtype")
    return InputLayout(
        keys=tuple(keys),
        lengths=tuple(lengths),
        key_dim=key_dim,
        batch=first.size(1 - key_dim),
        device=first.device,
        dtype=first.dtype,
    )


@functools.lru_cache(maxsize=128)
def build_spec(
    keys: tuple[tuple[str, ...], ...],
    lengths: tuple[tuple[int, ...], ...],
    groups: tuple[tuple[str, ...], ...],
) -> RegroupSpec:
    """The regroup spec of ``groups`` over inputs with these keys and lengths (cached).

    Raises:
        AmbiguousKeyError: a key is in two inputs (or twice in one).
        UnknownKeyError: a group names a key that no input holds.
    """
    where: dict[str, int] = {}
    key_segments: list[tuple[int, int, int]] = []
    owner: list[int] = []
    for input_index, (kt_keys, kt_lengths) in enumerate(zip(keys, lengths, strict=False)):
        offset = 0
        for key, length in zip(kt_keys, kt_lengths, strict=False):
            if key in where:
                other = owner[where[key]]
                raise AmbiguousKeyError(
                    f"key `{key}` is in KeyedTensor {other} and KeyedTensor {input_index}: "
                    "a group could not say which one it means"
                    if other != input_index
                    else f"key `{key}` appears twice in KeyedTensor {input_index}"
                )
            where[key] = len(key_segments)
            key_segments.append((input_index, offset, length))
            owner.append(input_index)
            offset += length
    entries: list[Entry] = []
    key_entries: list[list[int]] = [[] for _ in key_segments]
    out_widths = []
    for group_index, group in enumerate(groups):
        out_offset = 0
        for key in group:
            key_id = where.get(key)
            if key_id is None:
                all_keys = [k for kt_keys in keys for k in kt_keys]
                raise UnknownKeyError(
                    f"group {group_index} names key `{key}`, which is in none of the {len(keys)} "
                    f"KeyedTensors (keys: {_preview(all_keys)})"
                )
            input_index, in_offset, length = key_segments[key_id]
            entries.append(
                Entry(
                    group=group_index,
                    input=input_index,
                    in_offset=in_offset,
                    out_offset=out_offset,
                    length=length,
                    occurrence=len(key_entries[key_id]),
                    key_id=key_id,
                )
            )
            key_entries[key_id].append(len(entries) - 1)
            out_offset += length
        out_widths.append(out_offset)
    unit = 0
    for _, _, length in key_segments:
        unit = math.gcd(unit, length)
    return RegroupSpec(
        in_widths=tuple(sum(kt_lengths) for kt_lengths in lengths),
        out_widths=tuple(out_widths),
        entries=tuple(entries),
        key_segments=tuple(key_segments),
        key_entries=tuple(tuple(e) for e in key_entries),
        max_occurrences=max((len(e) for e in key_entries), default=0),
        unit=max(unit, 1),
    )
