"""The recycled host buffers of the CPU torch path: reused only when nothing else refers to them."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kt_regroup import KeyedTensor, KTRegroupAsDict, _host_pool, regroup, release_host_buffers
from kt_regroup._host_pool import MIN_BYTES, host_empty, size_class

_ROWS = 64
_COLS = MIN_BYTES // (4 * _ROWS)  # one pooled fp32 buffer


def _kt(seed: int, requires_grad: bool = False) -> KeyedTensor:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(_ROWS, 2 * _COLS, generator=gen).requires_grad_(requires_grad)
    return KeyedTensor(["a", "b"], [_COLS, _COLS], values)


def test_storage_is_reused_once_released() -> None:
    release_host_buffers()
    first = host_empty((_ROWS, _COLS), torch.float32)
    address = first.data_ptr()
    del first
    again = host_empty((_ROWS, _COLS), torch.float32)
    assert again.data_ptr() == address
    assert again._base is None  # a plain tensor, not a view of a pool tensor


def test_live_outputs_are_never_overwritten() -> None:
    release_host_buffers()
    kept = regroup([_kt(0)], [["b", "a"]], backend="torch")[0]
    expected = kept.clone()
    later = regroup([_kt(1)], [["b", "a"]], backend="torch")[0]
    assert later.data_ptr() != kept.data_ptr()
    torch.testing.assert_close(kept, expected, rtol=0, atol=0)


def test_steady_state_training_reuses_buffers_and_stays_exact() -> None:
    release_host_buffers()
    module = KTRegroupAsDict([["b", "a"], ["a"]], ["x", "y"], backend="torch")
    pointers = []
    for seed in range(3):
        kt = _kt(seed, requires_grad=True)
        out = module([kt])
        pointers.append(out["x"].data_ptr())
        (out["x"].sum() + 2 * out["y"].sum()).backward()
        grad = kt.values().grad
        assert grad is not None
        torch.testing.assert_close(grad[:, :_COLS], torch.full_like(grad[:, :_COLS], 3.0), rtol=0, atol=0)
        torch.testing.assert_close(grad[:, _COLS:], torch.ones_like(grad[:, _COLS:]), rtol=0, atol=0)
        reference = torch.cat([kt.values()[:, _COLS:], kt.values()[:, :_COLS]], dim=1)
        torch.testing.assert_close(out["x"], reference, rtol=0, atol=0)
        del out, grad, kt
    assert pointers[1] == pointers[2]


def test_pool_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_REGROUP_HOST_POOL_MB", "0")
    first = host_empty((_ROWS, _COLS), torch.float32)
    assert first.untyped_storage().nbytes() == MIN_BYTES


def test_bad_pool_size_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KT_REGROUP_HOST_POOL_MB", "lots")
    with pytest.raises(ValueError, match="KT_REGROUP_HOST_POOL_MB"):
        host_empty((_ROWS, _COLS), torch.float32)


def test_nearby_batch_sizes_share_a_buffer() -> None:
    release_host_buffers()
    first = host_empty((2 * _ROWS, _COLS), torch.float32)
    address = first.data_ptr()
    del first
    smaller = host_empty((2 * _ROWS - 3, _COLS), torch.float32)  # same size class
    assert smaller.data_ptr() == address
    assert size_class((2 * _ROWS - 3) * _COLS * 4) == size_class(2 * _ROWS * _COLS * 4)
    assert size_class(12345678) >= 12345678
    assert size_class(12345678) <= 12345678 * 1.125


def test_cap_drops_free_buffers_of_other_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    release_host_buffers()
    monkeypatch.setenv("KT_REGROUP_HOST_POOL_MB", "3")
    kept = host_empty((_ROWS, 2 * _COLS), torch.float32)  # 2 MiB, held by the caller
    freed = host_empty((_ROWS, _COLS), torch.float32)  # 1 MiB, released below
    del freed
    assert _host_pool._POOL.retained_bytes() == 3 * MIN_BYTES
    other = host_empty((_ROWS, _COLS + 512), torch.float32)  # another class: the free 1 MiB buffer makes room
    assert _host_pool._POOL.retained_bytes() <= 3 * MIN_BYTES
    assert other.untyped_storage().nbytes() >= other.numel() * 4
    assert kept.untyped_storage().nbytes() == 2 * MIN_BYTES


class _ReleaseHookLock:
    """A lock that runs ``hook`` right after each release: the moment another thread could take it."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._hook = hook
        self._in_hook = False

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if not self._in_hook:
            self._in_hook = True
            try:
                self._hook()
            finally:
                self._in_hook = False


def test_a_free_buffer_is_claimed_before_the_lock_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second caller that takes the lock just after the first one left it gets another buffer."""
    release_host_buffers()
    spare = host_empty((_ROWS, _COLS), torch.float32)
    del spare  # one free pooled buffer
    stolen: list[torch.Tensor] = []
    lock = _ReleaseHookLock(lambda: stolen.append(host_empty((_ROWS, _COLS), torch.float32)))
    monkeypatch.setattr(_host_pool._POOL, "_lock", lock)
    mine = host_empty((_ROWS, _COLS), torch.float32)
    assert len(stolen) == 1
    assert stolen[0].data_ptr() != mine.data_ptr()


def test_threads_never_share_a_buffer() -> None:
    """8 threads x 150 calls: each output holds exactly what its own thread wrote."""
    release_host_buffers()
    wrong: list[tuple[int, int]] = []
    start = threading.Barrier(8)

    def work(thread: int) -> None:
        start.wait()
        for call in range(150):
            token = float(thread * 1000 + call)
            out = host_empty((_ROWS, _COLS), torch.float32)
            out.fill_(token)
            time.sleep(0)  # let the other threads run between the fill and the check
            if not bool((out == token).all()):
                wrong.append((thread, call))
            del out

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old)
    assert wrong == []
