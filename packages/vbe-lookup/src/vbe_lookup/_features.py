"""``VBEFeatures``: immutable variable-batch sparse features (feature → rank → sample)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from vbe_lookup.errors import BatchLayoutError, InvalidFeaturesError

__all__ = [
    "VBEFeatures",
    "check_length_per_key",
    "check_offsets",
    "check_tensors",
    "complete_cumsum",
]

_INDEX_DTYPES = (torch.int32, torch.int64)


def complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """``[n]`` lengths → ``[n + 1]`` offsets ``0, l0, l0 + l1, ...`` in the lengths' dtype, no host sync."""
    out = torch.zeros(lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, dim=0, dtype=lengths.dtype, out=out[1:])
    return out


class VBEFeatures:
    """Variable-batch sparse features of one step, the way a rank holds them after the input all-to-all.

    ``lengths`` and ``values`` are laid out feature → rank → sample, like torchrec's variable-batch
    ``KeyedJaggedTensor``: the bags of feature ``f`` sent by rank ``r`` are
    ``stride_per_key_per_rank[f][r]`` consecutive entries of ``lengths``.

    Args:
        keys: the ``F`` feature names (unique).
        values: ``[N]`` int32/int64 ids.
        lengths: ``[sum(stride_per_key_per_rank)]`` int32/int64 bag lengths, ``sum(lengths) == N``.
        stride_per_key_per_rank: ``[F][R]`` batch sizes (every feature lists the same ``R`` ranks).
        weights: optional ``[N]`` float per-id weights, on the device of ``values``.
        length_per_key: optional host-side ``[F]`` number of ids per feature. When the producer knows
            it (the input all-to-all does), passing it lets a lookup over several kernels split the ids
            without a device-to-host copy. Its size and total are checked here; each entry is checked
            against ``lengths`` whenever the lookup checks ids (see ``GroupedVBELookup``'s
            ``check_indices``).

    The object is immutable; tensors are shared, never copied. Only shapes are checked here (no host
    sync); the lookup validates contents.
    """

    __slots__ = ("_keys", "_length_per_key", "_lengths", "_offsets", "_stride", "_values", "_weights")

    _keys: tuple[str, ...]
    _values: torch.Tensor
    _lengths: torch.Tensor
    _stride: tuple[tuple[int, ...], ...]
    _weights: torch.Tensor | None
    _length_per_key: tuple[int, ...] | None
    _offsets: torch.Tensor | None

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        stride_per_key_per_rank: Sequence[Sequence[int]],
        weights: torch.Tensor | None = None,
        *,
        length_per_key: Sequence[int] | None = None,
    ) -> None:
        keys_t = tuple(keys)
        stride = tuple(tuple(int(b) for b in row) for row in stride_per_key_per_rank)
        _check(keys_t, values, lengths, stride, weights, length_per_key)
        object.__setattr__(self, "_keys", keys_t)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_stride", stride)
        object.__setattr__(self, "_weights", weights)
        object.__setattr__(
            self, "_length_per_key", None if length_per_key is None else tuple(int(n) for n in length_per_key)
        )
        object.__setattr__(self, "_offsets", None)

    @classmethod
    def _built(
        cls,
        keys: tuple[str, ...],
        values: torch.Tensor,
        lengths: torch.Tensor,
        stride: tuple[tuple[int, ...], ...],
        weights: torch.Tensor | None,
        length_per_key: tuple[int, ...] | None,
    ) -> VBEFeatures:
        """Features a producer of this package built, whose layout is consistent by construction (the input
        dist's: ``stride`` one cached tuple per layout, ``length_per_key`` its host read): the tensors'
        O(1) checks only, no per-feature loop."""
        check_tensors(values, lengths, weights)
        out = object.__new__(cls)
        for name, value in (
            ("_keys", keys),
            ("_values", values),
            ("_lengths", lengths),
            ("_stride", stride),
            ("_weights", weights),
            ("_length_per_key", length_per_key),
            ("_offsets", None),
        ):
            object.__setattr__(out, name, value)
        return out

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(f"VBEFeatures is immutable; cannot set `{name}`")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"VBEFeatures is immutable; cannot delete `{name}`")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Immutable slots cannot be restored by pickle's setattr: rebuild through the constructor (and its
        # checks), so batches cross process boundaries (DataLoader workers, multiprocessing).
        return (
            _rebuild_vbe_features,
            (self._keys, self._values, self._lengths, self._stride, self._weights, self._length_per_key),
        )

    def __repr__(self) -> str:
        return (
            f"VBEFeatures(keys={list(self._keys)}, values={tuple(self._values.shape)} {self._values.dtype}, "
            f"stride_per_key_per_rank={[list(r) for r in self._stride]}, "
            f"weighted={self._weights is not None}, device={self._values.device})"
        )

    def keys(self) -> list[str]:
        """The ``F`` feature names, in the order of ``lengths()``."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """``[N]`` ids."""
        return self._values

    def lengths(self) -> torch.Tensor:
        """``[sum(stride_per_key_per_rank)]`` bag lengths, feature → rank → sample."""
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """``[len(lengths) + 1]`` bag offsets into ``values`` (computed once, on the device, no sync)."""
        if self._offsets is None:
            object.__setattr__(self, "_offsets", complete_cumsum(self._lengths))
        assert self._offsets is not None  # for mypy: set just above
        return self._offsets

    def weights_or_none(self) -> torch.Tensor | None:
        """``[N]`` per-id weights, or ``None``."""
        return self._weights

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """``[F][R]`` batch size of each feature from each source rank."""
        return [list(row) for row in self._stride]

    def length_per_key_or_none(self) -> list[int] | None:
        """The host-side number of ids per feature when the producer supplied it, else ``None``."""
        return None if self._length_per_key is None else list(self._length_per_key)

    def length_per_key(self) -> list[int]:
        """Number of ids per feature (one device-to-host copy unless given at construction)."""
        if self._length_per_key is not None:
            return list(self._length_per_key)
        bounds = [0]
        for row in self._stride:
            bounds.append(bounds[-1] + sum(row))
        offsets = self.offsets()
        at = offsets[torch.tensor(bounds, device=offsets.device)]
        return [int(n) for n in (at[1:] - at[:-1]).tolist()]

    def num_ranks(self) -> int:
        """``R``, the number of source ranks."""
        return len(self._stride[0]) if self._stride else 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VBEFeatures:
        """A copy on ``device`` (the host-side layout is shared, checked when this one was built: no
        per-feature work)."""
        weights = self._weights
        return VBEFeatures._built(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            self._stride,
            None if weights is None else weights.to(device, non_blocking=non_blocking),
            self._length_per_key,
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as used on ``stream`` (CUDA caching-allocator safety across streams)."""
        for tensor in (self._values, self._lengths, self._weights, self._offsets):
            if tensor is not None and tensor.is_cuda:
                tensor.record_stream(stream)

    @classmethod
    def from_kjt_like(cls, features: Any) -> VBEFeatures:
        """Wrap any :class:`~vbe_lookup.interfaces.KeyedJaggedTensorLike` (e.g. a torchrec KJT)."""
        if isinstance(features, VBEFeatures):
            return features
        length_per_key = None
        getter = getattr(features, "length_per_key_or_none", None)
        if callable(getter):
            length_per_key = getter()
        return cls(
            features.keys(),
            features.values(),
            features.lengths(),
            features.stride_per_key_per_rank(),
            features.weights_or_none(),
            length_per_key=length_per_key,
        )


def _rebuild_vbe_features(
    keys: tuple[str, ...],
    values: torch.Tensor,
    lengths: torch.Tensor,
    stride: tuple[tuple[int, ...], ...],
    weights: torch.Tensor | None,
    length_per_key: tuple[int, ...] | None,
) -> VBEFeatures:
    """Unpickle a :class:`VBEFeatures` (see its ``__reduce__``)."""
    return VBEFeatures(keys, values, lengths, stride, weights, length_per_key=length_per_key)


def _check(
    keys: tuple[str, ...],
    values: torch.Tensor,
    lengths: torch.Tensor,
    stride: tuple[tuple[int, ...], ...],
    weights: torch.Tensor | None,
    length_per_key: Sequence[int] | None,
) -> None:
    """Shape, dtype and layout checks that need no host sync."""
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise InvalidFeaturesError(f"`keys` must be unique; {', '.join(dup)} repeat (keys: {list(keys)})")
    check_tensors(values, lengths, weights)
    if len(stride) != len(keys):
        raise BatchLayoutError(
            f"`stride_per_key_per_rank` has {len(stride)} rows but there are {len(keys)} `keys`; "
            "expected one row of per-rank batch sizes per key"
        )
    ranks = {len(row) for row in stride}
    if len(ranks) > 1:
        raise BatchLayoutError(
            f"`stride_per_key_per_rank` rows have different numbers of ranks {sorted(ranks)}; "
            "every key must list the same ranks"
        )
    if any(b < 0 for row in stride for b in row):
        raise BatchLayoutError(
            f"`stride_per_key_per_rank` has a negative batch size: {[list(r) for r in stride]}"
        )
    bags = sum(sum(row) for row in stride)
    if lengths.numel() != bags:
        raise BatchLayoutError(
            f"`lengths` has {lengths.numel()} entries but `stride_per_key_per_rank` sums to {bags} bags "
            f"({[list(r) for r in stride]}); expected one length per bag"
        )
    if length_per_key is not None:
        check_length_per_key(length_per_key, len(keys), values.numel())


def check_tensors(values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None) -> None:
    """Dtype, rank, shape and device of ``values``, ``lengths`` and ``weights``: O(1), no host sync.

    Raises:
        InvalidFeaturesError: ids or lengths that are not 1-D int32/int64, weights that are not a float
            tensor shaped like ``values``, or tensors on different devices.
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.dtype not in _INDEX_DTYPES:
        raise InvalidFeaturesError(f"`values` must be a 1-D int32/int64 tensor, got {_describe(values)}")
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.dtype not in _INDEX_DTYPES:
        raise InvalidFeaturesError(f"`lengths` must be a 1-D int32/int64 tensor, got {_describe(lengths)}")
    if lengths.device != values.device:
        raise InvalidFeaturesError(
            f"`lengths` is on {lengths.device} but `values` is on {values.device}; both must share a device"
        )
    if weights is not None:
        if (
            not isinstance(weights, torch.Tensor)
            or not weights.is_floating_point()
            or weights.shape != values.shape
        ):
            raise InvalidFeaturesError(
                f"`weights` must be a float tensor shaped like `values` {tuple(values.shape)}, got {_describe(weights)}"
            )
        if weights.device != values.device:
            raise InvalidFeaturesError(f"`weights` is on {weights.device} but `values` is on {values.device}")


def check_offsets(offsets: torch.Tensor, lengths: torch.Tensor) -> None:
    """Dtype, shape and device of a producer's ``offsets`` (its contents are checked with the ids).

    Raises:
        InvalidFeaturesError: offsets that are not a 1-D int32/int64 tensor on the lengths' device.
        BatchLayoutError: offsets whose size is not ``len(lengths) + 1``.
    """
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.dtype not in _INDEX_DTYPES:
        raise InvalidFeaturesError(f"`offsets` must be a 1-D int32/int64 tensor, got {_describe(offsets)}")
    if offsets.device != lengths.device:
        raise InvalidFeaturesError(f"`offsets` is on {offsets.device} but `lengths` is on {lengths.device}")
    if offsets.numel() != lengths.numel() + 1:
        raise BatchLayoutError(
            f"`offsets` has {offsets.numel()} entries; expected len(lengths) + 1 = {lengths.numel() + 1}"
        )


def check_length_per_key(length_per_key: Sequence[int], num_keys: int, num_ids: int) -> None:
    """Size and total of a host-side ``length_per_key`` (each entry is checked with the ids).

    Raises:
        BatchLayoutError: not one entry per key, or entries that do not sum to the number of ids.
    """
    if len(length_per_key) != num_keys:
        raise BatchLayoutError(f"`length_per_key` has {len(length_per_key)} entries for {num_keys} keys")
    total = sum(length_per_key)
    if total != num_ids:
        raise BatchLayoutError(f"`length_per_key` sums to {total} but `values` holds {num_ids} ids")


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"{obj.dtype} tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
