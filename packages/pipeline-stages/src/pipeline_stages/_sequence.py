"""Batch sequence numbers: how the pipeline tells ``SparseDataDistUtil`` which batch a stage or forward is for.

Every batch a :class:`~pipeline_stages.StagedTrainPipeline` pulls gets a sequence number unique in the process
(across pipelines and epochs). While the pipeline runs a runnable of a stage that belongs to a listener (a
bound method of a ``SparseDataDistUtil``), :data:`CURRENT_BATCH` holds the number of the batch it runs on; the
pipeline also tells its listeners which batch it returned (the input of the next forward) and which batches an
error dropped. Contexts are so matched by number, never by the identity of the batch object (a stage may
return a new object).
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar

__all__ = ["CURRENT_BATCH", "next_sequence"]

CURRENT_BATCH: ContextVar[int | None] = ContextVar("pipeline_stages_current_batch", default=None)
"""Sequence number of the batch the running stage works on (None outside a listener's stage)."""

next_sequence = itertools.count().__next__
"""``next_sequence() -> int``: a new batch sequence number (process-wide, increasing; a bound C method, so
the pipeline's per-batch cost is one call without a Python frame)."""
