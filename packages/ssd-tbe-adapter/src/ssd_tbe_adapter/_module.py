"""``KeyValueEmbeddingBags``: pooled embedding tables in a key-value store behind a per-table row cache.

This module holds the ``nn.Module`` (public API, pooled forward and its backward); the jobs behind it live
apart: argument checks (``_checks``), batch planning and id grouping (``_plan``), the caches and every row
move between cache and store (``_tier``), prefetch jobs (``_prefetch``), the row optimizers
(``_optimizer``), the record layout (``_records``), checkpoint files (``_checkpoint``), counters
(``_metrics``) and the autograd node (``_autograd``).

Threads and locking: the training thread runs forward/backward/flush and, when no prefetch job is in flight,
a prefetch's survey; one background thread runs the rest of the prefetch jobs (the misses' store reads, on
reader threads, and inserts) in FIFO order (see ``_prefetch``). Every cache or
store *metadata* change happens under the tier's lock; the only work done without the lock is a prefetch
job's store read.

The fused host-cache step: tables of one width keep their cache slots in one slab (``_cache.RowSlab``), so on
the CPU a batch whose rows its prefetch left cached is pooled by one ``embedding_bag`` over every table and
updated by one optimizer step (``_fused_forward``, ``_fused_backward``), with the same sums, term by term, as
the per-table path that serves every other case. The prefetch's survey finds the batch's slab rows in one pass
over every table and stamps them in one (the use ticks and counts are slab-wide too); forward and backward use
those rows as they are while no cached row was dropped since (the slab's generation), else check them table by
table; a forward of the prefetched batch also takes the prefetch's plan. Backward applies each row's update
to wherever the row lives *at backward time* (cache slot, else the store); a slot remembered from forward
(or from the prefetch) is used only after checking that it still holds the row, so no update depends on the
cache size or on timing.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from ssd_tbe_adapter._autograd import KVBagFunction
from ssd_tbe_adapter._checkpoint import read_chunks, read_manifest, verify_checkpoint, write_checkpoint
from ssd_tbe_adapter._checks import check_cache_rows, check_feature_table_map, check_options, check_tables
from ssd_tbe_adapter._device_path import DevicePath
from ssd_tbe_adapter._init import table_salt
from ssd_tbe_adapter._layout import allocate_output, bag_grads, output_rows, place_pooled
from ssd_tbe_adapter._optimizer import Optimizer, RowOptimizer
from ssd_tbe_adapter._plan import BatchGroups, Plan, device_inverse, group_batch, plan_batch
from ssd_tbe_adapter._prefetch import Prefetcher
from ssd_tbe_adapter._records import RecordLayout
from ssd_tbe_adapter._schema import check_schema, describe_store, ensure_schema
from ssd_tbe_adapter._specs import TableChunk, TableSpec
from ssd_tbe_adapter._tier import CacheTier
from ssd_tbe_adapter.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModuleClosedError,
    RowsNotRestoredWarning,
    SchemaMismatchError,
)
from ssd_tbe_adapter.interfaces import KVStore

__all__ = ["KeyValueEmbeddingBags", "TableChunk", "TableSpec"]

Pooling = Literal["sum", "mean"]
WeightsPrecision = Literal["fp32", "fp16"]


class KeyValueEmbeddingBags(nn.Module):
    """Pooled embedding bags over key-value tables, with the forward signature of an fbgemm TBE.

    Rows live in ``store`` (one record per ``(table, id)``: weights then optimizer state); each table has
    a cache of ``cache_rows`` rows on ``device`` in front of it. A row that was never written is created on
    first touch from a hash of (``seed``, table name, id): uniform in ``init_range``. Backward applies the
    optimizer (``sgd`` or fbgemm's exact ``rowwise_adagrad``) to the touched rows where they live; dirty
    cache rows reach the store when evicted or on :meth:`flush`.

    Args:
        tables: the tables, ``T >= 1``, unique names.
        feature_table_map: per feature ``f``, the table it looks up (``F`` entries); ``None`` means one
            feature per table.
        store: a :class:`~ssd_tbe_adapter.interfaces.KVStore` (``RocksDBStore`` or ``MemoryStore``).
        cache_rows: cache slots per table (an int for all tables or one per table), ``>= 0``. Any size is
            exact: rows that do not fit are served from scratch space and updated in the store.
        optimizer: ``"sgd"`` or ``"rowwise_adagrad"`` (state: one float32 per row, stored with the row).
        learning_rate: optimizer step size.
        pooling: ``"sum"`` or ``"mean"`` (mean of an empty bag is 0).
        weights_precision: ``"fp32"`` or ``"fp16"`` row storage; optimizer state and output are float32.
        eps: Adagrad epsilon.
        init_range: ``(low, high)`` of the uniform first-touch initialisation.
        seed: initialisation seed.
        device: where the cache, inputs and outputs live (CPU or one CUDA device).
        cache_on_device: manage the cache on ``device`` (id -> slot index, victims and row moves as batched
            device work, pooled lookup and optimizer over the cache rows; see ``_device_path``); ``None``
            (default) means on CUDA only. ``True`` on the CPU runs the same code there.
        host_cache_rows: rows of a host-DRAM tier (host memory) between the device cache and the store,
            ``>= 0`` (device cache only).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int] | None,
        store: KVStore,
        *,
        cache_rows: int | Sequence[int],
        optimizer: Optimizer = "sgd",
        learning_rate: float = 0.01,
        pooling: Pooling = "sum",
        weights_precision: WeightsPrecision = "fp32",
        eps: float = 1.0e-8,
        init_range: tuple[float, float] = (-0.01, 0.01),
        seed: int = 0,
        device: torch.device | str | None = None,
        cache_on_device: bool | None = None,
        host_cache_rows: int = 0,
    ) -> None:
        super().__init__()
        self._tables = check_tables(tables)
        self._dims = [table.dim for table in self._tables]
        self._feature_table_map = check_feature_table_map(feature_table_map, len(self._tables))
        if not isinstance(cast(object, store), KVStore):
            raise ArgumentTypeError(
                f"`store` must implement KVStore (get/put/iter_chunks/flush/close), got {type(store).__name__}"
            )
        capacities = check_cache_rows(cache_rows, len(self._tables))
        low, high = check_options(optimizer, pooling, weights_precision, learning_rate, init_range)
        self.optimizer: Optimizer = optimizer
        self.learning_rate = float(learning_rate)
        self.pooling: Pooling = pooling
        self.weights_precision: WeightsPrecision = weights_precision
        self.eps = float(eps)
        self.seed = int(seed)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        if self._device == torch.device("cuda"):  # no index: the current device
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self._device.type == "cuda"
        weight_dtype = torch.float16 if weights_precision == "fp16" else torch.float32
        self._layout = RecordLayout(self._dims, weight_dtype, 1 if optimizer == "rowwise_adagrad" else 0)
        self._table_numbers = {table.name: number for number, table in enumerate(self._tables)}
        # The store's schema record: a store written by a differently configured module raises here.
        self._store_id = ensure_schema(
            store,
            {
                **self._config(),
                "state_width": self._layout.state_width,
                "record_bytes": list(self._layout.record_bytes),
            },
        )
        on_device = self._cuda if cache_on_device is None else bool(cache_on_device)
        if isinstance(host_cache_rows, bool) or not isinstance(host_cache_rows, int) or host_cache_rows < 0:
            raise InvalidArgumentError(f"`host_cache_rows` must be an int >= 0, got {host_cache_rows!r}")
        if host_cache_rows and not on_device:
            raise InvalidArgumentError(
                f"`host_cache_rows`={host_cache_rows} needs the device cache (`cache_on_device` true, or CUDA)"
            )
        self._tier = CacheTier(
            store,
            [0] * len(capacities) if on_device else capacities,
            self._layout,
            [table_salt(self.seed, table.name) for table in self._tables],
            (low, high),
            self._device,
        )
        self._prefetcher = Prefetcher(self._tier, self._feature_table_map)
        self._device_path = (
            DevicePath(
                self._tier,
                capacities,
                self._dims,
                self._feature_table_map,
                self._device,
                host_cache_rows=host_cache_rows,
                round_fp16=weights_precision == "fp16",
            )
            if on_device
            else None
        )
        # An empty leaf that requires grad, so every forward output is part of the autograd graph even
        # though the rows themselves are not parameters (they live in the cache and the store).
        self._anchor = torch.zeros(0, device=self._device, requires_grad=True)
        # Reader threads of the prefetch jobs (read when the first prefetch starts them).
        self.read_threads = max(1, min(len(self._tables), (os.cpu_count() or 2) // 2, 8))
        self._closed = False

    # ------------------------------------------------------------------ public API

    @property
    def tables(self) -> tuple[TableSpec, ...]:
        """The tables, in order."""
        return self._tables

    @property
    def feature_table_map(self) -> tuple[int, ...]:
        """Per feature, the table it looks up."""
        return tuple(self._feature_table_map)

    @property
    def store(self) -> KVStore:
        """The key-value store behind the caches."""
        return self._tier.store

    @property
    def cache_on_device(self) -> bool:
        """Whether the cache is managed on the device (``cache_on_device``; CUDA graphs can record it)."""
        return self._device_path is not None

    @property
    def device(self) -> torch.device:
        """Where the cache, inputs and outputs live."""
        return self._device

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled lookup, fbgemm TBE signature.

        Bags are ordered feature → (rank →) sample. Without VBE every feature has ``B = (len(offsets) - 1)
        / F`` bags and the output is ``[B, sum(D_f)]`` float32 (feature ``f`` in its column range). With
        ``batch_size_per_feature_per_rank`` (``[F][R]`` bag counts) the output is 1-D float32, laid out
        rank → feature → sample → dim; when ``vbe_output`` (1-D float32) and ``vbe_output_offsets``
        (``[R, F]`` int64 start offsets) are given, the blocks are written there and ``vbe_output`` itself
        is returned (in place, autograd-aware), so several kernels can chain on one buffer.

        Args:
            indices: ``[N]`` int64/int32 ids on :attr:`device` (any int64 value is a valid id).
            offsets: ``[num_bags + 1]`` int64/int32 on :attr:`device`, ``offsets[0] == 0``,
                ``offsets[-1] == N``, non-decreasing.
            per_sample_weights: optional ``[N]`` float weights of the lookups (may require grad).
            batch_size_per_feature_per_rank: optional VBE batch sizes ``[F][R]``.
            vbe_output: optional pre-allocated 1-D float32 output (VBE only).
            vbe_output_offsets: ``[R, F]`` int64 block offsets into ``vbe_output``.

        Returns:
            ``[B, sum(D)]`` float32, or 1-D float32 with VBE (``vbe_output`` when given).
        """
        self._check_open()
        if self._device_path is not None:
            return self._device_path.forward(
                self._anchor,
                indices,
                offsets,
                per_sample_weights,
                batch_size_per_feature_per_rank,
                vbe_output,
                vbe_output_offsets,
                RowOptimizer(self.optimizer, self.learning_rate, self.eps),
                self.pooling,
            )
        taken = None
        if (
            not self._cuda
            and per_sample_weights is None
            and vbe_output is None
            and vbe_output_offsets is None
            and _host_int64(indices)
            and _host_int64(offsets)
        ):
            # The batch of a pending prefetch, which checked and planned it already: its plan, no second one.
            taken = self._prefetcher.take_planned(indices, offsets, batch_size_per_feature_per_rank)
        batch: BatchGroups | None
        if taken is not None:
            plan, batch = taken
        else:
            plan, indices_cpu = plan_batch(
                indices,
                offsets,
                per_sample_weights,
                batch_size_per_feature_per_rank,
                vbe_output,
                vbe_output_offsets,
                **self._layout_args(),
            )
            batch = self._prefetcher.take(indices, offsets, plan, indices_cpu)
        self._tier.metrics.forwards += 1
        if batch is None:
            self._tier.metrics.forwards_without_prefetch += 1
            batch = group_batch(plan, indices_cpu, self._feature_table_map)
            self._tier.count_first_look(batch.tables)
        plan.batch = batch
        psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32)
        if torch.is_grad_enabled():
            # autograd.Function.apply is untyped in torch's stubs.
            result = KVBagFunction.apply(self._anchor, psw, vbe_output, self, plan)  # type: ignore[no-untyped-call]
            return cast(torch.Tensor, result)
        output, _, _ = self._forward_impl(plan, psw, vbe_output)
        return output

    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        *,
        complete: bool = True,
    ) -> None:
        """Bring the rows of a future batch into the cache; the rows it must read from the store, on a background
        thread.

        A later :meth:`forward` of the same batch (the same tensors unchanged, or equal ids, offsets and bag
        counts: matched by content, so ``indices`` changed in place after this call is not mistaken for the
        prefetched batch) waits for this prefetch and reuses its id grouping; prefetches queued before the
        matched one are dropped, and a forward matching none leaves the queue as it is. The lookup of the
        batch's rows runs at this call when no earlier prefetch is still reading; store reads and inserts run
        on the background thread; on CUDA its row copies run on the stream current at this call (the
        pipeline's prefetch stream) and forward's stream waits for them.

        Args:
            indices: ``[N]`` ids on :attr:`device`.
            offsets: ``[num_bags + 1]`` on :attr:`device`.
            batch_size_per_feature_per_rank: optional VBE batch sizes ``[F][R]``.

        With the device cache the work runs at this call on the current stream (only the missing ids and
        the moved rows cross to the host); a failed store read surfaces at the forward that would use it.
        ``complete=False`` (device cache) issues only its device survey now, without the host sync: the
        rest (the sync, the row moves, on the same stream) runs at :meth:`complete_prefetch` or at the next
        call that needs it (prefetch, wait_prefetch, forward, flush, a replay of another batch), so other
        work (say a graph replay of the current batch) can be issued while the survey runs; bad ``offsets``
        values raise there. Ignored without the device cache (its prefetch already runs on a thread).
        """
        self._check_open()
        if self._device_path is not None:
            self._device_path.prefetch(indices, offsets, batch_size_per_feature_per_rank, complete=complete)
            return
        plan, indices_cpu = plan_batch(
            indices, offsets, None, batch_size_per_feature_per_rank, None, None, **self._layout_args()
        )
        stream = torch.cuda.current_stream(self._device) if self._cuda else None
        self._prefetcher.submit(
            plan, indices, offsets, indices_cpu, stream, self.read_threads, batch_size_per_feature_per_rank
        )
        self._tier.metrics.prefetches += 1

    def complete_prefetch(self) -> None:
        """Finish a prefetch issued with ``complete=False`` (its one host sync and row moves); a store error it
        meets stays for its batch's forward (as in :meth:`prefetch`). Nothing to do otherwise.

        Raises:
            InvalidArgumentError: the prefetched ``offsets`` hold bad values (the prefetch is dropped).
        """
        self._check_open()
        if self._device_path is not None:
            self._device_path.complete()

    def wait_prefetch(self) -> None:
        """Block until every pending prefetch has finished its store reads and cache inserts.

        The prefetches stay queued: later forwards still consume them. A failed prefetch is dropped and its
        error (for example a store error) raised, once: the next call, ``flush()`` and ``close()`` work.
        """
        if self._device_path is not None:
            self._device_path.wait()
        self._prefetcher.wait()

    # ------------------------------------------------------------------ CUDA graphs

    @contextlib.contextmanager
    def replaying(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
    ) -> Iterator[None]:
        """Around the replay of a CUDA graph that captured this module's forward (and backward) of a batch
        of ``N = indices.numel()`` lookups: hands that batch's slots to the replay.

        A forward recorded under ``torch.cuda.graph`` (device-managed cache only) reads each lookup's slot
        from static buffers of its ``N`` instead of the pending prefetches, and its backward updates the
        slots found there; no host work of the forward or backward runs on a replay. On entry the pending
        prefetch of ``(indices, offsets)`` (matched as :meth:`forward` matches it; without one the batch gets
        its slots now, with host syncs) is copied into those buffers on the current stream; on exit (after
        the replay was issued) its rows may move again once the replay's work is done. Forward counters
        advance here. A capture is stale once :meth:`captured_buffers` changes (the cache grew).

            with kv.replaying(kv_indices, kv_offsets):
                graph.replay()

        Raises:
            InvalidArgumentError: no device-managed cache.
            StaleCaptureError: the batch had no prefetch and assigning its slots here grew the cache (the
                graph holds the old tensors); the batch stays pending for the retry after a new capture.
            Exception: a failed prefetch's store error (as the forward of that batch raises it).
        """
        self._check_open()
        path = self._graph_path()
        path.stage(indices, offsets, batch_size_per_feature_per_rank)
        try:
            yield
        finally:
            path.replayed()

    @contextlib.contextmanager
    def static_slots(self) -> Iterator[None]:
        """Forwards inside read their slots from the static buffers, as under a CUDA graph capture (which
        turns this on by itself): the captured code run eagerly, e.g. on the CPU, where a replay is a
        second run of the same calls inside :meth:`replaying`."""
        path = self._graph_path()
        path.static_mode = True
        try:
            yield
        finally:
            path.static_mode = False

    def captured_buffers(self) -> list[torch.Tensor]:
        """The cache tensors a captured forward and backward use by address; once one of them is another
        tensor (the cache grew its scratch pool), captures of this module are stale: record them again."""
        return self._graph_path().captured_buffers()

    def _graph_path(self) -> DevicePath:
        if self._device_path is None:
            raise InvalidArgumentError(
                "CUDA graph replays need the device-managed cache (`cache_on_device=True`, the default on CUDA)"
            )
        return self._device_path

    def flush(self) -> None:
        """Write every dirty cached row to the store and make the store durable (``store.flush()``).

        Waits for pending prefetches first (they are still consumed by later forwards); a failed prefetch is
        dropped without raising here (it lost no row; its forward reads the rows itself), so a flush after a
        store error works as soon as the store does.

        Raises:
            DiskFullError: no space left for the store; every dirty row stays cached (retry once freed).
        """
        self._check_open()
        if self._device_path is not None:
            self._device_path.wait(raise_failed=False)
        self._prefetcher.wait(raise_failed=False)
        if self._device_path is not None:
            self._device_path.flush()
        with self._tier.lock:
            self._tier.wait_insert_event()
            self._tier.write_back_dirty()
            self._tier.store.flush()

    def metrics(self) -> dict[str, float]:
        """Counters since construction.

        Keys: ``cache_hit_rate`` (rows already cached at a batch's first look, prefetch or forward, over
        unique rows looked up), ``forward_hit_rate`` (at forward time; 1.0 when prefetch did its job),
        ``lookups``, ``hits``, ``sync_fetched_rows`` (fetched by forward itself), ``scratch_rows`` (did
        not fit the cache), ``prefetched_rows``, ``evicted_rows``, ``written_back_rows``,
        ``write_through_rows`` (updated directly in the store), ``store_rows_read``, ``store_rows_written``,
        ``store_read_seconds``, ``store_write_seconds``, ``store_read_rows_per_s``,
        ``store_write_rows_per_s``, ``forwards``, ``forwards_without_prefetch``, ``prefetches``, and
        ``cached_rows``. With the device cache, also per tier: ``hbm_*`` (device cache: ``hbm_hit_rate``,
        rows and bytes moved, ``hbm_scratch_slots``), ``host_tier_*`` (with ``host_cache_rows``) and
        ``store_tier_*``.
        """
        out = self._tier.summary()
        if self._device_path is not None:
            out.update(self._device_path.summary())
        return out

    def reset_metrics(self) -> None:
        """Zero every counter."""
        self._tier.reset_metrics()
        if self._device_path is not None:
            self._device_path.reset_metrics()

    def checkpoint(self, *, chunk_rows: int = 65536) -> Iterator[TableChunk]:
        """Stream every stored row, table by table, in chunks (flushes first; never holds a whole table).

        Args:
            chunk_rows: rows per chunk, ``>= 1``.

        Yields:
            :class:`TableChunk` objects on the CPU.
        """
        if chunk_rows < 1:
            raise InvalidArgumentError(f"`chunk_rows` must be >= 1, got {chunk_rows}")
        self.flush()
        for table, spec in enumerate(self._tables):
            for ids, records in self._tier.store.iter_chunks(table=table, chunk_rows=chunk_rows):
                weights, state = self._layout.decode(table, records)
                yield TableChunk(table=spec.name, ids=ids, weights=weights, optimizer_state=state)

    def restore(self, chunks: Iterable[TableChunk]) -> None:
        """Load rows from checkpoint chunks: every table named in a chunk is cleared in the store first,
        the cache is emptied, then the rows are written and the store flushed. Rows absent from the
        checkpoint start again from their deterministic initialisation.

        ``chunks`` is consumed as it comes, so a chunk that fails its checks after earlier ones were written
        leaves the tables partly restored; :meth:`load_checkpoint` checks the whole checkpoint first.

        Raises:
            InvalidArgumentError: a chunk names an unknown table or has the wrong row width, dtype or state
                width (nothing of that chunk's table was cleared yet if it is the table's first chunk).
        """
        self._restore(chunks, clear=())

    def _restore(self, chunks: Iterable[TableChunk], *, clear: Iterable[int]) -> None:
        """:meth:`restore`, clearing the tables ``clear`` too (even when no chunk names them)."""
        self.flush()
        cleared: set[int] = set()
        tier = self._tier
        with tier.lock:
            for cache in tier.caches:
                cache.clear()
            if self._device_path is not None:
                self._device_path.clear()
            for table in clear:
                tier.store.clear_table(table=table)
                cleared.add(table)
            for chunk in chunks:
                table = self._check_chunk(chunk)
                if table not in cleared:
                    tier.store.clear_table(table=table)
                    cleared.add(table)
                records = self._layout.encode(table, chunk.weights, chunk.optimizer_state)
                tier.store_put(table, chunk.ids.contiguous(), records)
            tier.store.flush()

    def _check_chunk(self, chunk: TableChunk) -> int:
        """The table number of ``chunk``; raises :class:`InvalidArgumentError` unless its rows fit that table."""
        table = self._table_numbers.get(chunk.table)
        if table is None:
            raise InvalidArgumentError(
                f"checkpoint chunk names table `{chunk.table}`, not one of {sorted(self._table_numbers)}"
            )
        self._layout.check_chunk(table, chunk, self.optimizer)
        return table

    def save_checkpoint(self, directory: str | Path, *, chunk_rows: int = 65536) -> int:
        """Write :meth:`checkpoint` to ``directory`` atomically: one ``torch.save`` file per chunk plus
        ``manifest.json`` with each file's size and SHA-256, chunk by chunk.

        The files go to a temporary directory first (each fsynced), which is renamed into place; a manifest
        rename is the commit point. A process killed at any moment, a full disk or a store error leaves the
        previous checkpoint in ``directory`` whole and loadable, never a mix.

        Returns:
            The number of rows written.

        Raises:
            DiskFullError: no space left for the checkpoint (the previous one is intact; retry once freed).
            StoreIOError: another I/O error writing the checkpoint.
            StoreCorruptError: the store is damaged (see :meth:`checkpoint`).
        """
        return write_checkpoint(directory, self.checkpoint(chunk_rows=chunk_rows), self.get_extra_state())

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore from a :meth:`save_checkpoint` directory, one chunk in memory at a time.

        The whole checkpoint is checked first (manifest against this module's configuration, then every file's
        size, checksum, decoding and row layout, and the row count); only then are this module's tables
        cleared and refilled. A bad checkpoint raises and leaves the live tables as they were. Every table of
        the module is cleared, also those the checkpoint holds no row of.

        Returns:
            The number of rows restored.

        Raises:
            CheckpointNotFoundError: ``directory`` has no ``manifest.json``.
            CheckpointCorruptError: a file is missing, truncated, damaged or does not fit (names the file).
            SchemaMismatchError: the checkpoint was written by a differently configured module.
        """
        manifest = read_manifest(directory)
        self._check_config(
            {key: manifest.get(key) for key in self._config()}, f"checkpoint {str(directory)!r}"
        )
        verify_checkpoint(directory, manifest, self._check_chunk)
        self._restore(read_chunks(directory, manifest), clear=range(len(self._tables)))
        return int(manifest["rows"])

    def _config(self) -> dict[str, Any]:
        """What checkpoints and state dicts record of the configuration (compared on load)."""
        return {
            "tables": [[table.name, table.dim] for table in self._tables],
            "optimizer": self.optimizer,
            "weights_precision": self.weights_precision,
            "seed": self.seed,
        }

    def _check_config(self, theirs: dict[str, Any], where: str) -> None:
        """Raise :class:`SchemaMismatchError` naming the first field of ``theirs`` that differs from ours."""
        check_schema(theirs, self._config(), where)

    def get_extra_state(self) -> dict[str, Any]:
        """The configuration and the id of the store (not the rows: those are in the store; use
        :meth:`save_checkpoint` / :meth:`checkpoint`)."""
        return {**self._config(), "store_id": self._store_id}

    def set_extra_state(self, state: Any) -> None:
        """Check that a saved configuration matches this module's (``load_state_dict`` calls this).

        A state dict carries no rows. When it comes from another store than this module's, or this module's
        store holds no row, a :class:`~ssd_tbe_adapter.errors.RowsNotRestoredWarning` says that the rows were
        not restored (use :meth:`load_checkpoint` or :meth:`restore`).

        Raises:
            SchemaMismatchError: tables, optimizer, precision or seed differ.
        """
        if not isinstance(state, dict):
            raise SchemaMismatchError(
                f"saved configuration {state!r} is not a dict, expected {self._config()!r}"
            )
        self._check_config({key: state.get(key) for key in self._config()}, "the state dict")
        their_store = state.get("store_id")
        if not self._store_has_rows() or (their_store is not None and their_store != self._store_id):
            warnings.warn(
                RowsNotRestoredWarning(
                    "load_state_dict restored only the configuration of this KeyValueEmbeddingBags: its rows live "
                    f"in the store, not in the state dict, and {describe_store(self.store)} "
                    + (
                        "holds no row"
                        if not self._store_has_rows()
                        else f"is not the store the state dict came from (store id {their_store})"
                    )
                    + "; use save_checkpoint()/load_checkpoint() (or checkpoint()/restore()) to move rows"
                ),
                stacklevel=3,
            )

    def _store_has_rows(self) -> bool:
        """Whether the store holds a row of any of this module's tables."""
        store = self._tier.store
        return any(
            next(iter(store.iter_chunks(table=table, chunk_rows=1)), None) is not None
            for table in range(len(self._tables))
        )

    def close(self) -> None:
        """Flush, stop the prefetch thread and close the store; idempotent. Also the end of a ``with`` block.

        Raises:
            DiskFullError: the final flush found no space; the module stays open (close again once freed).
        """
        if self._closed:
            return
        self.flush()
        self._prefetcher.close()
        if self._device_path is not None:
            self._device_path.close()
        self._tier.store.close()
        self._closed = True

    def __enter__(self) -> KeyValueEmbeddingBags:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close (flush, stop the prefetch threads, close the store) at the end of a ``with`` block."""
        self.close()

    def extra_repr(self) -> str:
        """Tables, optimizer and cache sizes."""
        tables = ", ".join(f"{t.name}:{t.dim}" for t in self._tables)
        return (
            f"tables=[{tables}], optimizer={self.optimizer}, lr={self.learning_rate}, pooling={self.pooling}, "
            f"precision={self.weights_precision}, cache_rows={self._cache_rows()}, device={self._device}"
        )

    # ------------------------------------------------------------------ helpers

    def _cache_rows(self) -> list[int]:
        """Cache slots per table (the device cache's when it manages the cache)."""
        if self._device_path is not None:
            return list(self._device_path.cache.capacities)
        return [c.capacity for c in self._tier.caches]

    def _check_open(self) -> None:
        if self._closed:
            raise ModuleClosedError("this KeyValueEmbeddingBags was closed")

    def _layout_args(self) -> dict[str, Any]:
        """The keyword arguments :func:`plan_batch` takes from this module."""
        return {"feature_table_map": self._feature_table_map, "dims": self._dims, "device": self._device}

    # ------------------------------------------------------------------ forward / backward

    def _forward_impl(
        self,
        plan: Plan,
        per_sample_weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor | None], list[torch.Tensor]]:
        """The pooled output of ``plan`` (its ``batch`` set), the rows copied out per table (for backward) and
        each feature's lookups into its table's unique rows on the device (none for the fused step)."""
        fused = self._fused_forward(plan, per_sample_weights, vbe_output)
        if fused is not None:
            return fused, {}, []
        batch = plan.batch
        assert batch is not None  # set by forward
        plan.groups = batch.tables
        indices_device = device_inverse(plan, self._feature_table_map, self._device)
        # Rows are copied out of the cache only where needed: tables with misses (scratch rows), fp16 weights
        # (pooled in float32) and a per-sample-weight gradient (backward reads the forward's rows). Otherwise
        # the lookups are mapped to cache slots and pooled straight from the cache.
        need_rows = per_sample_weights is not None and per_sample_weights.requires_grad
        rows = {
            table: self._tier.gather(
                table, group.unique, plan.slots, need_rows, self._prior_slots(batch, table)
            )
            for table, group in plan.groups.items()
        }
        slots_device = {
            table: plan.slots[table].to(self._device, non_blocking=True)
            for table, table_rows in rows.items()
            if table_rows is None
        }
        output = allocate_output(
            plan, [self._dims[t] for t in self._feature_table_map], self._device, vbe_output
        )
        column = 0
        offsets_device = plan.offsets.to(self._device, non_blocking=True)
        for feature, table in enumerate(self._feature_table_map):
            dim = self._dims[table]
            bags = plan.num_bags[feature]
            if bags:
                table_rows = rows[table]
                if table_rows is None:
                    lookups = slots_device[table].index_select(0, indices_device[feature])
                    table_rows = self._tier.caches[table].weights
                else:
                    lookups = indices_device[feature]
                pooled = self._pool(plan, feature, offsets_device, lookups, table_rows, per_sample_weights)
                place_pooled(plan, output, feature, column, pooled)
            column += dim
        return output, rows, indices_device

    def _prior_slots(self, batch: BatchGroups, table: int) -> torch.Tensor | None:
        """The slots the prefetch left table ``table``'s rows of ``batch`` in (``[U_t]`` int64 host), if it
        left them all cached: its own, or the table's part of the slab rows (checked before use either way)."""
        return self._tier.table_slots(batch, batch.names.index(table))

    def _fused_forward(
        self, plan: Plan, per_sample_weights: torch.Tensor | None, vbe_output: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The fused host-cache step's forward: every table's bags pooled by one ``embedding_bag`` straight
        from the slab and placed into the output by one ``index_copy_`` (the same sums, term by term, as the
        per-feature path), when the batch allows it: CPU, tables of one width in a float32 slab, sum
        pooling, no per-sample weights, every row still where its prefetch left it, and each output block on
        a row boundary. ``None`` otherwise (nothing changed: the per-table path runs)."""
        batch = plan.batch
        slab = self._tier.slab
        if (
            self._cuda
            or batch is None
            or slab is None
            or per_sample_weights is not None
            or self.pooling != "sum"
            or not plan.num_bags
        ):
            return None
        dim = self._dims[0]
        bag_rows = output_rows(plan, dim, None if vbe_output is None else vbe_output.numel())
        if bag_rows is None:
            return None
        slots = self._tier.gather_batch(batch, plan.slots)
        if slots is None:
            return None
        lookups = torch.from_numpy(slots.numpy()[batch.inverse.numpy()])
        pooled = F.embedding_bag(lookups, slab.weights, plan.offsets, mode="sum", include_last_offset=True)
        output = allocate_output(
            plan, [self._dims[t] for t in self._feature_table_map], self._device, vbe_output
        )
        output.view(-1, dim).index_copy_(0, bag_rows, pooled)
        plan.fused_slots = slots
        plan.bag_rows = bag_rows
        return output

    def _fused_backward(self, plan: Plan, grad_output: torch.Tensor) -> None:
        """The fused host-cache step's backward (after :meth:`_fused_forward`): each bag's gradient read by one
        gather, every row's gradient by one ``embedding_bag`` over the batch's transpose, one optimizer step
        over the slab (see :meth:`CacheTier.apply_update_batch`)."""
        batch, slots, bag_rows = plan.batch, plan.fused_slots, plan.bag_rows
        # All three set by _fused_forward.
        assert batch is not None
        assert slots is not None
        assert bag_rows is not None
        grad_bags = grad_output.view(-1, self._dims[0]).index_select(0, bag_rows)
        if slots.numel():
            grad_rows = F.embedding_bag(
                batch.sorted_bags, grad_bags, batch.row_offsets, mode="sum", include_last_offset=True
            )
        else:
            grad_rows = grad_bags.new_zeros(0, grad_bags.shape[1])
        optimizer = RowOptimizer(self.optimizer, self.learning_rate, self.eps)
        self._tier.apply_update_batch(batch, slots, grad_rows, optimizer)

    def _pool(
        self,
        plan: Plan,
        feature: int,
        offsets_device: torch.Tensor,
        lookups: torch.Tensor,
        rows: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        start = plan.bag_start[feature]
        bag_offsets = offsets_device[start : start + plan.num_bags[feature] + 1]
        base = bag_offsets[0]
        psw = None
        if per_sample_weights is not None:
            psw = per_sample_weights[
                int(plan.offsets[start]) : int(plan.offsets[start + plan.num_bags[feature]])
            ]
        pooled = F.embedding_bag(
            lookups, rows, bag_offsets - base, mode="sum", per_sample_weights=psw, include_last_offset=True
        )
        if self.pooling == "mean":
            lengths = (bag_offsets[1:] - bag_offsets[:-1]).clamp(min=1).to(torch.float32)
            pooled = pooled / lengths[:, None]
        return pooled

    def _backward_impl(
        self,
        plan: Plan,
        indices_device: list[torch.Tensor],
        rows: dict[int, torch.Tensor | None],
        per_sample_weights: torch.Tensor | None,
        grad_output: torch.Tensor,
    ) -> torch.Tensor | None:
        if plan.fused_slots is not None:
            self._fused_backward(plan, grad_output)
            return None
        want_psw = per_sample_weights is not None and per_sample_weights.requires_grad
        grad_psw = (
            torch.zeros_like(per_sample_weights) if per_sample_weights is not None and want_psw else None
        )
        # Bag lengths only where they are used: mean pooling and the per-sample-weight gradient.
        need_lengths = self.pooling == "mean" or grad_psw is not None
        offsets_device = plan.offsets.to(self._device, non_blocking=True) if need_lengths else None
        # Per table, in feature order: the gradient of each bag ([bags_f, D]) and the weight of each lookup.
        sources: dict[int, list[torch.Tensor]] = {}
        weights: dict[int, list[torch.Tensor]] = {}
        column = 0
        for feature, table in enumerate(self._feature_table_map):
            dim = self._dims[table]
            bags = plan.num_bags[feature]
            start = plan.bag_start[feature]
            grad_bags = bag_grads(plan, grad_output, feature, column, dim)
            column += dim
            lengths = None
            if offsets_device is not None:
                bag_offsets = offsets_device[start : start + bags + 1]
                lengths = bag_offsets[1:] - bag_offsets[:-1]
            if self.pooling == "mean" and bags:
                assert lengths is not None  # need_lengths
                grad_bags = grad_bags / lengths.clamp(min=1).to(torch.float32)[:, None]
            sources.setdefault(table, []).append(grad_bags)
            if per_sample_weights is not None:
                lo, hi = int(plan.offsets[start]), int(plan.offsets[start + bags])
                weights.setdefault(table, []).append(per_sample_weights[lo:hi])
                if grad_psw is not None and bags:
                    assert lengths is not None  # need_lengths
                    lookups = indices_device[feature]
                    bag_of_lookup = torch.repeat_interleave(
                        torch.arange(bags, device=self._device), lengths, output_size=lookups.numel()
                    )
                    table_rows = rows[table]
                    assert table_rows is not None  # forward keeps rows when a psw gradient is wanted
                    grad_psw[lo:hi] = (grad_bags[bag_of_lookup] * table_rows[lookups]).sum(1)
        optimizer = RowOptimizer(self.optimizer, self.learning_rate, self.eps)
        for table, group in plan.groups.items():
            parts = sources[table]
            source = (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()
            psw_sorted = None
            if per_sample_weights is not None:
                psw_parts = weights[table]
                psw_table = psw_parts[0] if len(psw_parts) == 1 else torch.cat(psw_parts)
                psw_sorted = psw_table.detach().index_select(
                    0, group.order.to(self._device, non_blocking=True)
                )
            if group.unique.numel():
                # Row gradient = sum over the row's lookups of (weight x its bag's gradient): the transpose
                # of the forward as one embedding_bag over the bag gradients.
                grad_rows = F.embedding_bag(
                    group.sorted_bags.to(self._device, non_blocking=True),
                    source,
                    group.row_offsets.to(self._device, non_blocking=True),
                    mode="sum",
                    per_sample_weights=psw_sorted,
                    include_last_offset=True,
                )
            else:
                grad_rows = source.new_zeros(0, source.shape[1])
            self._tier.apply_update(table, group.unique, grad_rows, optimizer, plan.slots.get(table))
        return grad_psw


def _host_int64(tensor: object) -> bool:
    """Whether ``tensor`` is a 1-D int64 CPU tensor (a forward's ``indices`` or ``offsets`` as its prefetch keeps
    them, so equal content means the same batch)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype == torch.int64
        and tensor.dim() == 1
        and tensor.device.type == "cpu"
    )
