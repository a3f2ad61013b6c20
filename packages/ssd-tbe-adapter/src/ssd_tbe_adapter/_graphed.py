"""One function replayed as a CUDA graph per key: its tensor inputs copied into static buffers, its outputs
(the graph's own tensors) valid until the next replay of that key.

Used for the device cache's survey of a batch (the ~150 small kernels before an assignment's one read of its
counts): a replay is one launch, so a prefetch costs the host a few copies instead of a kernel launch per op.
The first call of a key runs eagerly (it compiles the Triton kernels and settles the allocator), the second
captures; each graph has its own memory pool. Elsewhere than on CUDA every call runs eagerly.
"""

from __future__ import annotations

import gc
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

__all__ = ["GraphedCalls"]

T = TypeVar("T")


@dataclass(eq=False)
class _Entry(Generic[T]):
    graph: Any  # torch.cuda.CUDAGraph (untyped in torch's stubs)
    inputs: list[torch.Tensor]
    output: T


class GraphedCalls(Generic[T]):
    """Graphs of ``fn`` per key on ``device`` (at most ``limit``, least recently used dropped).

    ``fn`` must be capturable for a key: static shapes, no host syncs, no host values that change between
    calls of that key other than through its tensor inputs, and only buffers whose addresses stay fixed
    while the key does (the caller puts anything that reallocates them, e.g. a generation counter, in the key).
    """

    def __init__(self, device: torch.device, fn: Callable[..., T], *, limit: int = 32) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._fn = fn
        self._limit = limit
        self._entries: OrderedDict[Hashable, _Entry[T]] = OrderedDict()
        self._seen: set[Hashable] = set()
        self._uncapturable: set[Hashable] = set()
        self._name = getattr(fn, "__qualname__", "graphed call")
        self.replays = 0
        self.captures = 0

    def __call__(self, key: Hashable, inputs: Sequence[torch.Tensor], *, fixed: Sequence[Any] = ()) -> T:
        """``fn(*inputs, *fixed)``: replayed when ``key`` was captured, captured at its second call.

        ``inputs`` are copied into the graph's static buffers; ``fixed`` (e.g. pinned host buffers the graph
        copies results into) are passed as they are and must be the same memory at every call of ``key``."""
        if not self._cuda:
            return self._fn(*inputs, *fixed)
        entry = self._entries.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return self._fn(*inputs, *fixed)
            if key in self._uncapturable:
                return self._fn(*inputs, *fixed)
            captured = self._capture(key, inputs, fixed)
            if captured is None:
                return self._fn(*inputs, *fixed)
            entry = captured
        else:
            self._entries.move_to_end(key)
            for static, value in zip(entry.inputs, inputs, strict=True):
                static.copy_(value)
        entry.graph.replay()
        self.replays += 1
        return entry.output

    def captured(self, key: Hashable) -> bool:
        """Whether ``key`` has a graph (its outputs are the same tensors at every call)."""
        return key in self._entries

    def clear(self) -> None:
        """Drop every graph (the buffers they read were reallocated)."""
        self._entries.clear()
        self._seen.clear()
        self._uncapturable.clear()

    def _capture(
        self, key: Hashable, inputs: Sequence[torch.Tensor], fixed: Sequence[Any]
    ) -> _Entry[T] | None:
        """A graph of ``fn`` for ``key`` (None, and ``key`` left eager, when the capture fails)."""
        static = [value.clone() for value in inputs]
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        side.wait_stream(current)
        collecting = gc.isenabled()
        gc.collect()  # dead graphs in reference cycles go now: destroying a graph during a capture voids it
        gc.disable()
        try:
            # thread_local: other threads (a DataLoader's pin-memory thread) may allocate while this one captures.
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                output = self._fn(*static, *fixed)
        except RuntimeError as error:  # torch.AcceleratorError too: nothing captured ran, nothing changed
            self._uncapturable.add(key)
            warnings.warn(f"{self._name}: CUDA graph capture failed, running eagerly: {error}", stacklevel=3)
            return None
        finally:
            if collecting:
                gc.enable()
        current.wait_stream(side)
        entry = _Entry(graph=graph, inputs=static, output=output)
        self._entries[key] = entry
        if len(self._entries) > self._limit:
            current.synchronize()  # host sync (rare): kernels queued may still read the dropped graph's memory
            while len(self._entries) > self._limit:
                self._entries.popitem(last=False)
        self.captures += 1
        return entry
