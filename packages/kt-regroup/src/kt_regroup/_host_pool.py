"""Recycled CPU buffers for the regroup outputs (a small caching allocator for host memory).

On CPU a regroup is one memory pass, but a fresh output of hundreds of MB is ``mmap`` ed by the C
allocator and every page is faulted in and zeroed by the kernel on first touch: at the seed shape that
costs about five times the copy itself. The outputs of a training step are dead by the next step, so
their storage is kept here and handed out again once nothing but the pool refers to it (the storage's
use count is 1): no page faults in the steady state, the same bits, and a buffer still referenced by
the caller (an output kept across steps, a ``.grad`` that is accumulated into) is never reused.

Only buffers of at least :data:`MIN_BYTES` are pooled (smaller ones are recycled by the C allocator
itself). Sizes are rounded up to 8 classes per power of two, so a varying batch size reuses a few
buffers. ``KT_REGROUP_HOST_POOL_MB`` caps the bytes the pool retains (default 4096; ``0`` turns it off;
at the cap, free buffers of other classes are dropped first); :func:`release_host_buffers` empties it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from kt_regroup import _env

__all__ = ["MIN_BYTES", "host_empty", "release_host_buffers", "size_class"]

MIN_BYTES = 1 << 20
# How many references a storage has (torch's private helper, used by torch.multiprocessing too); without it
# a buffer's reuse cannot be proven safe, so the pool stays off.
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _cap_bytes() -> int:
    raw = _env.HOST_POOL_MB.get()
    try:
        return max(0, int(raw)) << 20
    except ValueError:
        raise ValueError(f"`KT_REGROUP_HOST_POOL_MB` must be an integer number of MiB, got {raw!r}") from None


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of 8 steps per power of two (at most 12.5% more): batches of nearby
    sizes share buffers."""
    step = max(1, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class _HostPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_class: dict[int, list[torch.UntypedStorage]] = {}
        self._retained = 0

    def claim(self, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` on a free pooled buffer of at least ``nbytes`` (or a new one).

        The buffer is picked *and* claimed (the tensor is made on it, so its use count is 2) under the
        lock: a buffer picked under the lock but claimed after it could be picked by a second thread
        in between, and both would write to it.
        """
        size = size_class(nbytes)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        with self._lock:
            kept = self._by_class.setdefault(size, [])
            for storage in kept:
                if _free(storage):
                    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape, strides)
            storage = torch.empty((size,), dtype=torch.uint8).untyped_storage()
            cap = _cap_bytes()
            if self._retained + size > cap:
                self._drop_free(self._retained + size - cap)
            if self._retained + size <= cap:
                kept.append(storage)
                self._retained += size
            return torch.empty((0,), dtype=dtype).set_(storage, 0, shape, strides)

    def _drop_free(self, wanted: int) -> None:
        """Forget free buffers (largest classes first) until ``wanted`` bytes are released or none is free."""
        for size in sorted(self._by_class, reverse=True):
            kept = self._by_class[size]
            for storage in [s for s in kept if _free(s)]:
                kept.remove(storage)
                self._retained -= size
                wanted -= size
                if wanted <= 0:
                    return

    def retained_bytes(self) -> int:
        with self._lock:
            return self._retained

    def release(self) -> None:
        with self._lock:
            self._by_class.clear()
            self._retained = 0


def _free(storage: torch.UntypedStorage) -> bool:
    """Whether only the pool refers to ``storage`` (no tensor uses it)."""
    assert _USE_COUNT is not None  # host_empty does not pool without it
    return bool(_USE_COUNT(storage._cdata) == 1)


_POOL = _HostPool()


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on recycled storage when it is large enough.

    Args:
        shape: the tensor's shape.
        dtype: its dtype.

    Returns:
        A tensor that shares its storage with no live tensor (not a view).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or _cap_bytes() == 0 or _USE_COUNT is None:
        return torch.empty(tuple(shape), dtype=dtype)
    return _POOL.claim(nbytes, tuple(shape), dtype)


def release_host_buffers() -> None:
    """Drop every buffer the pool retains (tensors still in use keep theirs)."""
    _POOL.release()
