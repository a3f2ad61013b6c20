"""Counters of :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags` (:class:`Metrics`) and their summary."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Metrics", "summarize"]


@dataclass(slots=True)
class Metrics:
    """Raw counters since construction or the last reset (see :meth:`KeyValueEmbeddingBags.metrics`)."""

    lookups: int = 0
    hits: int = 0
    forward_lookups: int = 0
    forward_hits: int = 0
    sync_fetched_rows: int = 0
    scratch_rows: int = 0
    prefetched_rows: int = 0
    evicted_rows: int = 0
    written_back_rows: int = 0
    write_through_rows: int = 0
    store_rows_read: int = 0
    store_rows_written: int = 0
    store_read_seconds: float = 0.0
    store_write_seconds: float = 0.0
    forwards: int = 0
    forwards_without_prefetch: int = 0
    prefetches: int = 0


def summarize(m: Metrics, cached_rows: int) -> dict[str, float]:
    """Every counter as a float plus the derived rates and ``cached_rows``."""
    out: dict[str, float] = {name: float(getattr(m, name)) for name in m.__slots__}
    out["cache_hit_rate"] = m.hits / m.lookups if m.lookups else 0.0
    out["forward_hit_rate"] = m.forward_hits / m.forward_lookups if m.forward_lookups else 0.0
    out["store_read_rows_per_s"] = m.store_rows_read / m.store_read_seconds if m.store_read_seconds else 0.0
    out["store_write_rows_per_s"] = (
        m.store_rows_written / m.store_write_seconds if m.store_write_seconds else 0.0
    )
    out["cached_rows"] = float(cached_rows)
    return out
