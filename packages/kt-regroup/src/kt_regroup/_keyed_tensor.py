"""``KeyedTensor``: pooled embeddings of several keys, side by side along one dimension."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx._symbolic_trace import PH  # torch.fx.PH (fx's __init__ does not list it in __all__)

from kt_regroup._regroup import regroup, regroup_as_dict
from kt_regroup._spec import as_lengths
from kt_regroup.errors import (
    AmbiguousKeyError,
    ArgumentTypeError,
    InvalidGroupsError,
    LayoutMismatchError,
    LengthMismatchError,
    UnknownKeyError,
)
from kt_regroup.interfaces import KeyedTensorLike

__all__ = ["KeyedTensor"]


def _preview(keys: Sequence[str], limit: int = 6) -> str:
    """``f1, f2, ...`` for error messages (at most ``limit`` names)."""
    shown = ", ".join(keys[:limit])
    return shown + (", ..." if len(keys) > limit else "")


class KeyedTensor:
    """Immutable pooled embeddings of several keys laid out along ``key_dim``.

    Args:
        keys: the key (feature) names, unique, in layout order.
        length_per_key: the width of each key's block along ``key_dim``, each ``>= 0``.
        values: ``[B, sum(length_per_key)]`` when ``key_dim == 1`` (the fast path) or
            ``[sum(length_per_key), B]`` when ``key_dim == 0``; any device, a floating-point dtype.
        key_dim: 0 or 1.

    Raises:
        ArgumentTypeError: ``keys`` is a ``str`` (or not a list), or a length is not an int (never truncated).
        InvalidGroupsError: a key is not a ``str``.
        AmbiguousKeyError: a key appears twice.
        LengthMismatchError: ``length_per_key`` has another length than ``keys``, holds a negative
            value, or does not sum to ``values.size(key_dim)``.
        LayoutMismatchError: ``values`` is not a 2-D floating-point tensor or ``key_dim`` is not 0 or 1.
    """

    __slots__ = ("_key_dim", "_keys", "_length_per_key", "_offset_per_key", "_values")

    _keys: tuple[str, ...]
    _length_per_key: tuple[int, ...]
    _values: torch.Tensor
    _key_dim: int
    _offset_per_key: tuple[int, ...] | None

    def __init__(
        self,
        keys: Sequence[str],
        length_per_key: Sequence[int],
        values: torch.Tensor,
        key_dim: int = 1,
    ) -> None:
        if isinstance(keys, str) or not isinstance(keys, Iterable):
            # A str is iterable: KeyedTensor("ab", ...) would silently mean keys "a" and "b".
            got = f"the str {keys!r}" if isinstance(keys, str) else type(keys).__name__
            raise ArgumentTypeError(f"`keys` must be a list of str; got {got} (write [{keys!r}] for one key)")
        keys_t = tuple(keys)
        lengths_t = as_lengths(length_per_key, "`length_per_key`")
        if key_dim not in (0, 1):
            raise LayoutMismatchError(f"`key_dim` is {key_dim!r}; expected 0 or 1")
        # Under torch.fx.symbolic_trace the values are a Proxy (no shape or dtype yet), or torch.fx.PH in a
        # KeyedTensor given as a concrete_args template: keys and lengths are still checked here, the values
        # when the traced graph runs regroup.
        given: object = values
        traced = isinstance(given, torch.fx.Proxy) or given is PH
        if not traced and (not isinstance(values, torch.Tensor) or values.dim() != 2):
            shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise LayoutMismatchError(f"`values` must be a 2-D tensor; got {shape}")
        if not traced and not values.dtype.is_floating_point:
            # Checked here, not first at regroup time: every regroup path rejects other dtypes.
            raise LayoutMismatchError(
                f"`values` have dtype {values.dtype}; expected a floating-point dtype (pooled embeddings)"
            )
        for key in keys_t:
            if not isinstance(key, str):
                raise InvalidGroupsError(f"`keys` must hold str; got {key!r} ({type(key).__name__})")
        seen: set[str] = set()
        for key in keys_t:
            if key in seen:
                raise AmbiguousKeyError(f"`keys` names key `{key}` more than once")
            seen.add(key)
        if len(lengths_t) != len(keys_t):
            raise LengthMismatchError(
                f"`length_per_key` has {len(lengths_t)} entries but `keys` has {len(keys_t)}"
            )
        if any(n < 0 for n in lengths_t):
            raise LengthMismatchError(f"`length_per_key` must be >= 0; got {list(lengths_t)[:8]}")
        width = sum(lengths_t)
        if not traced and width != values.size(key_dim):
            raise LengthMismatchError(
                f"`length_per_key` sums to {width} but `values` has {values.size(key_dim)} "
                f"along key_dim={key_dim} (shape {tuple(values.shape)})"
            )
        self._keys = keys_t
        self._length_per_key = lengths_t
        self._values = values
        self._key_dim = key_dim
        self._offset_per_key = None

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[torch.Tensor], key_dim: int = 1
    ) -> KeyedTensor:
        """Concatenate per-key tensors along ``key_dim`` into one KeyedTensor.

        Args:
            keys: one name per tensor.
            tensors: ``[B, D_k]`` each (``key_dim == 1``) or ``[D_k, B]`` each (``key_dim == 0``).
            key_dim: 0 or 1.

        Returns:
            A KeyedTensor whose ``values()`` is ``torch.cat(tensors, dim=key_dim)``.
        """
        if len(keys) != len(tensors):
            raise LengthMismatchError(f"`keys` has {len(keys)} entries but `tensors` has {len(tensors)}")
        if key_dim not in (0, 1):
            raise LayoutMismatchError(f"`key_dim` is {key_dim!r}; expected 0 or 1")
        if not tensors:
            raise LengthMismatchError("`tensors` is empty: the batch size would be unknown")
        lengths = [t.size(key_dim) for t in tensors]
        return KeyedTensor(keys, lengths, torch.cat(list(tensors), dim=key_dim), key_dim)

    def keys(self) -> list[str]:
        """The keys, in layout order."""
        return list(self._keys)

    def length_per_key(self) -> list[int]:
        """Width of each key's block along ``key_dim``."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """Start of each key's block along ``key_dim``, plus the total width at the end (``len(keys) + 1``)."""
        if self._offset_per_key is None:
            offsets = [0]
            for n in self._length_per_key:
                offsets.append(offsets[-1] + n)
            self._offset_per_key = tuple(offsets)
        return list(self._offset_per_key)

    def values(self) -> torch.Tensor:
        """``[B, sum(D)]`` (``key_dim == 1``) or ``[sum(D), B]`` (``key_dim == 0``)."""
        return self._values

    def key_dim(self) -> int:
        """0 or 1."""
        return self._key_dim

    def device(self) -> torch.device:
        """The device of ``values()`` (torchrec's name)."""
        return self._values.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        """A KeyedTensor with the same keys, lengths and ``key_dim`` whose values are on ``device``.

        Args:
            device: the target device.
            non_blocking: passed to ``Tensor.to`` (an async copy from pinned host memory).

        Returns:
            A new KeyedTensor (its values are ``values()`` itself when they are on ``device`` already).
        """
        moved = KeyedTensor.__new__(KeyedTensor)
        moved._keys = self._keys
        moved._length_per_key = self._length_per_key
        moved._values = self._values.to(device, non_blocking=non_blocking)
        moved._key_dim = self._key_dim
        moved._offset_per_key = self._offset_per_key
        return moved

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark ``values()`` (the only tensor held) as used by ``stream``, so its memory outlives that use.

        Values on another device type than ``stream`` are left alone (a host tensor has no
        ``record_stream``), as pipeline-stages' ``record_stream_all`` does for plain tensors.

        Args:
            stream: the stream (``torch.cuda.Stream`` on CUDA) that will read the values.
        """
        if self._values.device.type == stream.device.type:
            self._values.record_stream(stream)

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensorLike], groups: Sequence[Sequence[str]]
    ) -> list[torch.Tensor]:
        """torchrec's ``KeyedTensor.regroup``: :func:`kt_regroup.regroup` with the ``"auto"`` backend."""
        return regroup(keyed_tensors, groups)

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensorLike], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """torchrec's ``KeyedTensor.regroup_as_dict``: :func:`kt_regroup.regroup_as_dict` (``"auto"`` backend)."""
        return regroup_as_dict(keyed_tensors, groups, keys)

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: its block}``; blocks are views of ``values()`` (``[B, D_k]`` or ``[D_k, B]``)."""
        values: object = self._values  # typed Tensor, a Proxy under torch.fx.symbolic_trace
        if isinstance(values, torch.fx.Proxy):
            # A traced split cannot be unpacked: one traced narrow per key instead.
            return {key: self[key] for key in self._keys}
        blocks = torch.split(self._values, list(self._length_per_key), dim=self._key_dim)
        return dict(zip(self._keys, blocks, strict=False))

    def __getitem__(self, key: str) -> torch.Tensor:
        """The block of ``key`` (a view of ``values()``).

        Raises:
            UnknownKeyError: ``key`` is not one of ``keys()``.
        """
        try:
            index = self._keys.index(key)
        except ValueError:
            raise UnknownKeyError(
                f"key `{key}` is not in this KeyedTensor (keys: {_preview(self._keys)})"
            ) from None
        start = self.offset_per_key()[index]
        return self._values.narrow(self._key_dim, start, self._length_per_key[index])

    def __reduce__(self) -> tuple[type[KeyedTensor], tuple[list[str], list[int], torch.Tensor, int]]:
        """Pickle through the validating constructor (also what ``torch.load(weights_only=True)`` allows)."""
        return (KeyedTensor, (list(self._keys), list(self._length_per_key), self._values, self._key_dim))

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys=[{_preview(self._keys)}], values={tuple(self._values.shape)} "
            f"{self._values.dtype} on {self._values.device}, key_dim={self._key_dim})"
        )


def _flatten(kt: KeyedTensor) -> tuple[list[torch.Tensor], Any]:
    return [kt.values()], (tuple(kt.keys()), tuple(kt.length_per_key()), kt.key_dim())


def _flatten_with_keys(kt: KeyedTensor) -> tuple[list[tuple[Any, torch.Tensor]], Any]:
    values, context = _flatten(kt)
    return [(pytree.GetAttrKey("_values"), values[0])], context


def _unflatten(values: Any, context: Any) -> KeyedTensor:
    keys, lengths, key_dim = context
    return KeyedTensor(list(keys), list(lengths), next(iter(values)), key_dim)


def _to_dumpable_context(context: Any) -> dict[str, Any]:
    """The pytree context as JSON data, for ``torch.export.save``."""
    keys, lengths, key_dim = context
    return {"keys": list(keys), "length_per_key": list(lengths), "key_dim": key_dim}


def _from_dumpable_context(dumpable: Any) -> tuple[tuple[str, ...], tuple[int, ...], int]:
    """The pytree context back from JSON data: the same tuples ``_flatten`` builds, so that a loaded
    program's input spec equals the spec of the KeyedTensors it is called with."""
    return (
        tuple(str(k) for k in dumpable["keys"]),
        tuple(int(n) for n in dumpable["length_per_key"]),
        int(dumpable["key_dim"]),
    )


# A pytree node, so that torch.export / torch.compile accept KeyedTensors as module inputs and outputs, and
# an exported program with KeyedTensor inputs survives torch.export.save / load (JSON has no tuples: without
# the dumpable-context pair a loaded spec holds lists and no longer matches the inputs' spec).
pytree.register_pytree_node(
    KeyedTensor,
    _flatten,
    _unflatten,
    serialized_type_name="kt_regroup.KeyedTensor",
    to_dumpable_context=_to_dumpable_context,
    from_dumpable_context=_from_dumpable_context,
    flatten_with_keys_fn=_flatten_with_keys,
)
# torch.export.save pickles the example inputs; a weights-only load rebuilds them through the constructor,
# which validates its arguments like any other call.
torch.serialization.add_safe_globals([KeyedTensor])
