"""Recycled CPU buffers for the regroup outputs (a small caching allocator for host memory).

On CPU a regroup is one memory pass, but a fresh output of hundreds of MB is ``mmap`` ed by the C
allocator and every page is faulted in and zeroed by the kernel on first touch: at the seed shape that
costs about five times the copy itself. The outputs of a training step are dead by the next step, so
their storage is kept here and handed out again once nothing but the pool refers to it (the storage's
use count is 1): no page faults in the steady state, the same bits, and a buffer still referenced by
the caller (an output kept across steps, a ``.grad`` that is accumulated into) is never reused.

Only buffers of at least :data:`MIN_BYTES` are pooled (smaller ones are recycled by the C allocator
itself). ``KT_REGROUP_HOST_POOL_MB`` caps the bytes the pool retains (default 4096; ``0`` turns it
off); :func:`release_host_buffers` empties it.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence

import torch

__all__ = ["MIN_BYTES", "host_empty", "release_host_buffers"]

MIN_BYTES = 1 << 20
_DEFAULT_CAP_MB = 4096


def _cap_bytes() -> int:
    raw = os.environ.get("KT_REGROUP_HOST_POOL_MB", str(_DEFAULT_CAP_MB))
    try:
        return max(0, int(raw)) << 20
    except ValueError:
        raise ValueError(f"`KT_REGROUP_HOST_POOL_MB` must be an integer number of MiB, got {raw!r}") from None


class _HostPool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, list[torch.UntypedStorage]] = {}
        self._retained = 0

    def storage(self, nbytes: int) -> torch.UntypedStorage:
        with self._lock:
            kept = self._by_size.setdefault(nbytes, [])
            for storage in kept:
                if torch._C._storage_Use_Count(storage._cdata) == 1:  # only the pool refers to it
                    return storage
            storage = torch.empty((nbytes,), dtype=torch.uint8).untyped_storage()
            if self._retained + nbytes <= _cap_bytes():
                kept.append(storage)
                self._retained += nbytes
            return storage

    def release(self) -> None:
        with self._lock:
            self._by_size.clear()
            self._retained = 0


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
    if nbytes < MIN_BYTES or _cap_bytes() == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    size = tuple(shape)
    strides = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        strides[i] = strides[i + 1] * size[i + 1]
    return torch.empty((0,), dtype=dtype).set_(_POOL.storage(nbytes), 0, size, strides)


def release_host_buffers() -> None:
    """Drop every buffer the pool retains (tensors still in use keep theirs)."""
    _POOL.release()
