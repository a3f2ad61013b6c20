"""Worker-fed, pinned batches: a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` of DLRM batches.

The trainer's host thread is the bottleneck of a GPU step; generating (synthetic) or parsing (Criteo TSV) a batch
of 8k samples costs milliseconds of it. :func:`worker_batches` moves that work into DataLoader worker processes,
pins each batch on the loader's pin thread (CUDA), and yields the batches in exactly the order the source would:

- synthetic data is random access (batch ``i`` depends only on ``(seed, rank, i)``), so worker ``w`` of ``n``
  makes batches ``start + w, start + w + n, ...`` and the DataLoader's round-robin over its workers restores the
  order ``start, start + 1, ...``;
- a Criteo TSV reader is sequential: it runs in one worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from examples.dlrm.data import CriteoTSVReader, DLRMBatch, SyntheticCriteo

__all__ = ["BatchStream", "worker_batches"]


class BatchStream(IterableDataset[Any]):
    """Batches ``start`` to ``stop - 1`` of a synthetic source, or every batch of a TSV reader from ``start`` on.

    Args:
        source: the rank's :class:`SyntheticCriteo` or :class:`CriteoTSVReader` (picklable: workers get a copy).
        start: first batch index (a resumed run skips the batches it trained on).
        stop: one past the last batch index.
        transform: applied to each batch where it is made (in the worker; picklable), e.g. the padding of
            the whole-step CUDA graphs.
    """

    def __init__(
        self,
        source: SyntheticCriteo | CriteoTSVReader,
        *,
        start: int,
        stop: int,
        transform: Callable[[DLRMBatch], Any] | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= start <= stop:
            raise ValueError(f"batch range [{start}, {stop}) is empty or negative")
        self.source = source
        self.start = start
        self.stop = stop
        self.transform = transform

    def __iter__(self) -> Iterator[Any]:
        if self.transform is None:
            yield from self._batches()
        else:
            yield from map(self.transform, self._batches())

    def _batches(self) -> Iterator[DLRMBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if isinstance(self.source, SyntheticCriteo):
            for index in range(self.start + worker, self.stop, workers):
                yield self.source.batch(index)
            return
        if worker != 0:  # a sequential reader: one worker reads, the others yield nothing
            return
        for index, batch in enumerate(self.source):
            if index >= self.stop:
                return
            if index >= self.start:
                yield batch


def worker_batches(stream: BatchStream, *, workers: int, pin: bool) -> Iterator[Any]:
    """The stream's batches made by ``workers`` processes (0: in this process), pinned when ``pin``."""
    if workers < 0:
        raise ValueError(f"`workers` is {workers}, expected >= 0")
    if isinstance(stream.source, CriteoTSVReader):
        workers = min(workers, 1)
    loader: DataLoader[Any] = DataLoader(
        stream,
        batch_size=None,  # the stream yields whole batches
        num_workers=workers,
        pin_memory=pin and torch.cuda.is_available(),
        prefetch_factor=4 if workers else None,
    )
    yield from loader
