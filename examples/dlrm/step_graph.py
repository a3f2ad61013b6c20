"""The whole training step as one CUDA graph replay, on a world of one rank: its tables in one fbgemm TBE, and
optionally key-value tables (ssd-tbe-adapter, device-managed cache) beside it.

The dense part alone in graphs (:mod:`examples.dlrm.dense_graphs`) leaves the step host-bound on a GPU: the
sparse input dist (~25 ops and a host read), the lookup, the KT regroup, the autograd engine walking the
backward and the dense optimizer cost ~4 ms of host time for ~1.2 ms of GPU work. On one rank there is nothing to
exchange, so everything from the batch's device tensors to the updated weights is captured once per padded shape
and replayed:

    bottom MLP -> fbgemm TBE lookup (vbe-lookup's GroupedVBELookup, fbgemm's op called directly) -> KT regroup
    -> interaction, top MLP, weighted BCE -> backward (fbgemm's fused row-wise Adagrad updates the tables)
    -> the dense Adagrad (the same foreach ops as torch.optim.Adagrad) and the gradients' reset.

A graph replays fixed shapes, so :class:`StepPadding` pads each batch on the host (in the data loader or once
per batch of a cycled pool, off the step): ``B`` samples to ``Bp > B`` (a bucket of ``graph_granularity``) and
its ``n`` ids to a capacity ``Cp >= n`` (a multiple of ``Bp * F / 16``). The padding samples have weight 0 in
the loss; the padding ids (id 0 of each table) fill the padding samples' bags, so their bags' gradients, and
with them their rows' updates, are exactly zero (row-wise Adagrad and SGD leave a row with a zero gradient
as it was). The step equals the unpadded step up to float summation order (tested on the CPU, eagerly).

Per padded shape ``(Bp, Cp)`` the first ``warmup`` batches run the same step eagerly (real training steps: they
also build the lookup's per-layout metadata, which the graph then reads), the next one is captured (recorded, not
run) and replayed; every later batch of that shape costs five input copies and one replay. All graphs share
one memory pool (replays are sequential; the loss is cloned out). Graphs are dropped and recaptured, into a
fresh pool, when the optimizer's state is no longer the tensors they captured (a ``load_state_dict``). The dense
gradients come from ``torch.autograd.grad`` (never ``.grad``) and the lookup's backward runs from the pooled output's gradient, so no
parameter's ``AccumulateGrad`` node (which outlives a step, on the stream it was made on) is part of a step.

With key-value tables the lookup has two kernels. The padding then puts the features in kernel order and pads
every feature to one id count ``C`` (``StepPadding(per_feature=True)``, a multiple of ``Bp / 16``), so each
kernel's ids are a fixed slice and the lookup splits them by host counts it is handed (``length_per_key``),
with no read. :meth:`StepGraphs.prefetch_after_step` (a pipeline stage on its own stream) maps the key-value
slice of the next batch to cache slots: its device survey issued on its own stream right after the current
step's replay is launched (running beside it), its one host sync and row moves at the start of the next step
(``complete=False``, then ``complete_prefetch()``); the captured
key-value forward reads its slots from static buffers, which the kernel's ``replaying()`` fills before each
replay and releases after it. Graphs are recorded again when the
key-value cache's tensors change (``captured_buffers()``: the scratch pool grew).

What the replay does not do: fbgemm's host-side ``step`` / ``timestep`` counters of the TBE module are not
advanced (read only by UVM-cache and stats-reporter modes, which the direct path does not take); the input is not
range-checked on the device (the data sources make ids in range: synthetic ids modulo the rows, TSV hashes
modulo the rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from examples.dlrm.data import DLRMBatch, make_features
from examples.dlrm.dense_graphs import pad_rows
from examples.dlrm.dense_step import adagrad_update
from examples.dlrm.model import DLRM
from kt_regroup import KeyedTensor
from ssd_tbe_adapter import KeyValueEmbeddingBags
from vbe_lookup import GroupedVBELookup, VBEFeatures

__all__ = ["PaddedBatch", "StepGraphs", "StepPadding", "step_graph_blocker"]

# Id capacities are multiples of Bp * F / 16: at most ~6% of a one-hot batch is padding ids.
_ID_QUANTA_PER_BUCKET = 16


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PaddedBatch:
    """A batch padded to a captured shape; fits pipeline-stages' ``Pipelineable``.

    Attributes:
        batch: ``Bp`` samples (the first ``rows`` real), its sparse features ``Cp`` ids, feature -> sample.
        weight: ``[Bp]`` float32 loss weights: ``1 / rows`` on the real samples, 0 on the padding.
        rows: real samples.
        kv_inputs: per key-value kernel, the ``(ids, offsets)`` :meth:`StepGraphs.prefetch` handed it (the
            replay hands the same tensors to ``replaying``); empty before the prefetch.
        bag_offsets: the bags' offsets of each run of features :class:`StepPadding` was given (``bag_offsets``),
            one after the other (each ``[features * Bp + 1]``, from 0), worked out with the padding on the host,
            so the step launches nothing for them; ``None`` without such runs.
    """

    batch: DLRMBatch
    weight: torch.Tensor
    rows: int
    bag_offsets: torch.Tensor | None = None
    # Per key-value kernel: the ids and offsets its prefetch saw (StepGraphs.prefetch), on the device.
    kv_inputs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    @property
    def batch_size(self) -> int:
        """Real samples (what the trainer counts)."""
        return self.rows

    @property
    def shape_key(self) -> tuple[int, int]:
        """``(Bp, Cp)``: the captured shape this batch replays."""
        return self.batch.batch_size, self.batch.sparse_features.values().numel()

    def to(self, device: torch.device, non_blocking: bool = False) -> PaddedBatch:
        """This batch on ``device`` (copies issued on the current stream)."""
        return PaddedBatch(
            batch=self.batch.to(device, non_blocking=non_blocking),
            weight=self.weight.to(device, non_blocking=non_blocking),
            rows=self.rows,
            bag_offsets=None
            if self.bag_offsets is None
            else self.bag_offsets.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as used on ``stream`` (no-op for CPU tensors)."""
        self.batch.record_stream(stream)
        if self.weight.is_cuda:
            self.weight.record_stream(stream)
        if self.bag_offsets is not None and self.bag_offsets.is_cuda:
            self.bag_offsets.record_stream(stream)
        for ids, offsets in self.kv_inputs:
            ids.record_stream(stream)
            offsets.record_stream(stream)

    def pin_memory(self) -> PaddedBatch:
        """This batch in pinned host memory."""
        return PaddedBatch(
            batch=self.batch.pin_memory(),
            weight=self.weight.pin_memory(),
            rows=self.rows,
            bag_offsets=None if self.bag_offsets is None else self.bag_offsets.pin_memory(),
        )


@dataclass(frozen=True, slots=True)
class StepPadding:
    """Pads host batches to the shapes :class:`StepGraphs` captures (picklable: runs in DataLoader workers).

    Args:
        buckets: padded batch sizes, ascending; a batch of ``B`` samples goes to the smallest one ``> B`` (at
            least one padding sample holds the padding ids).
        keys: the feature order of the padded batch (the lookup's kernels' order, so that each kernel's
            features are one run); ``None`` keeps the batch's order.
        per_feature: pad every feature to the same id count ``C`` (a multiple of ``Bp / 16``), so that the
            ids of each kernel lie at fixed places (``Cp = F * C``) and a lookup over several kernels splits
            them without reading counts; otherwise only the total is padded.
        bag_offsets: runs of features ``(first, count)`` (positions in the padded order) whose bags' offsets
            the padded batch carries (:attr:`PaddedBatch.bag_offsets`): the key-value kernels' features, whose
            prefetch needs its offsets (worked out here, off the step, instead of by device ops in it).
    """

    buckets: tuple[int, ...]
    keys: tuple[str, ...] | None = None
    per_feature: bool = False
    bag_offsets: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"`buckets` is {self.buckets}, expected ascending distinct sizes >= 1")
        for first, count in self.bag_offsets:
            if first < 0 or count < 1:
                raise ValueError(
                    f"`bag_offsets` holds ({first}, {count}), expected (first >= 0, count >= 1) runs of features"
                )

    def __call__(self, batch: DLRMBatch) -> PaddedBatch:
        """``batch`` (on the host) padded: see the module docstring.

        Raises:
            ValueError: ``batch`` has as many samples as the largest bucket or more, or its features are not
                ``keys``.
        """
        rows = batch.batch_size
        padded = next((b for b in self.buckets if b > rows), None)
        if padded is None:
            raise ValueError(
                f"batch of {rows} samples needs a padded size above it; the largest is {self.buckets[-1]}"
            )
        keys, values, lengths = self._in_order(batch)
        num_features = len(keys)
        n = values.numel()
        real_per_feature = lengths.sum(1)
        pad_bags = padded - rows  # per feature
        if self.per_feature:
            quantum = max(1, padded // _ID_QUANTA_PER_BUCKET)
            most = int(real_per_feature.max()) if num_features else 0
            per_feature = max(quantum, -(-most // quantum) * quantum)
            pad_per_feature = per_feature - real_per_feature
            capacity = per_feature * num_features
        else:
            quantum = max(1, padded * num_features // _ID_QUANTA_PER_BUCKET)
            capacity = max(quantum, -(-n // quantum) * quantum)
            extra = capacity - n
            total_bags = num_features * pad_bags
            pad_per_feature = torch.full((num_features,), extra // total_bags, dtype=lengths.dtype) * pad_bags
            pad_per_feature += (
                (torch.arange(total_bags) < extra % total_bags).view(num_features, pad_bags).sum(1)
            )
        # The padding ids spread evenly over each feature's padding bags, so no bag gets a long tail.
        column = torch.arange(pad_bags)
        pad_lengths = (pad_per_feature // pad_bags)[:, None] + (
            column[None, :] < (pad_per_feature % pad_bags)[:, None]
        ).to(lengths.dtype)
        new_lengths = torch.cat([lengths, pad_lengths], dim=1)
        # Each real id moves right by the padding ids of the features before its own.
        shift = torch.cumsum(pad_per_feature, 0) - pad_per_feature
        feature_of_id = torch.repeat_interleave(torch.arange(num_features), real_per_feature)
        new_values = torch.zeros(capacity, dtype=values.dtype)
        new_values[torch.arange(n) + shift[feature_of_id]] = values
        weight = torch.zeros(padded, dtype=torch.float32)
        weight[:rows] = 1.0 / max(rows, 1)
        return PaddedBatch(
            batch=DLRMBatch(
                dense_features=pad_rows(batch.dense_features, padded),
                sparse_features=make_features(new_values, new_lengths.reshape(-1), padded, keys),
                labels=pad_rows(batch.labels, padded),
            ),
            weight=weight,
            rows=rows,
            bag_offsets=self._bag_offsets(new_lengths),
        )

    def _bag_offsets(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """Each run's bags' offsets (from 0) of the padded ``[F, Bp]`` lengths, one run after the other."""
        if not self.bag_offsets:
            return None
        if max(first + count for first, count in self.bag_offsets) > lengths.shape[0]:
            raise ValueError(
                f"`bag_offsets` {self.bag_offsets} reach past the batch's {lengths.shape[0]} features"
            )
        zero = torch.zeros(1, dtype=torch.int64)
        runs = [
            lengths[first : first + count].reshape(-1).to(torch.int64) for first, count in self.bag_offsets
        ]
        return torch.cat([torch.cat([zero, torch.cumsum(run, 0)]) for run in runs])

    def _in_order(self, batch: DLRMBatch) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """The batch's keys, ids and ``[F, B]`` lengths, its features put in ``keys`` order."""
        sparse = batch.sparse_features
        keys = list(sparse.keys())
        values, lengths = sparse.values(), sparse.lengths().view(len(keys), batch.batch_size)
        if self.keys is None or tuple(keys) == self.keys:
            return keys, values, lengths
        if sorted(keys) != sorted(self.keys):
            raise ValueError(f"the batch's features {keys} are not the padding's `keys` {list(self.keys)}")
        order = torch.tensor([keys.index(k) for k in self.keys])
        per_feature = lengths.sum(1)
        old_start = torch.cumsum(per_feature, 0) - per_feature
        moved = per_feature[order]
        new_start = torch.empty_like(old_start)
        new_start[order] = torch.cumsum(moved, 0) - moved
        feature_of_id = torch.repeat_interleave(torch.arange(len(keys)), per_feature)
        positions = torch.arange(values.numel()) - old_start[feature_of_id] + new_start[feature_of_id]
        reordered = torch.empty_like(values)
        reordered[positions] = values
        return list(self.keys), reordered, lengths[order]


def step_graph_blocker(model: DLRM, *, world_size: int, device: torch.device) -> str | None:
    """Why the whole step cannot be one graph here (``None``: it can)."""
    if device.type != "cuda":
        return f"device is {device.type} (CUDA graphs need CUDA)"
    if world_size != 1:
        return f"a world of {world_size} ranks (the input and output dists' collectives and their host sync)"
    lookup = getattr(model.sparse_arch, "lookup", None)
    if not isinstance(lookup, GroupedVBELookup):
        return "the sparse module has no local GroupedVBELookup"
    for group, path in zip(lookup.groups, lookup.fbgemm_paths, strict=True):
        if isinstance(group.kernel, KeyValueEmbeddingBags):
            if not group.kernel.cache_on_device:
                return "a key-value kernel without the device-managed cache (its forward does host work)"
        elif path != "direct":
            return (
                f"a kernel that is not an fbgemm TBE called directly ({path or type(group.kernel).__name__})"
            )
    if lookup.check_indices in ("always", "deferred"):
        return (
            f"the lookup checks ids with check_indices={lookup.check_indices!r} (a host read or module state)"
        )
    return None


class _Captured:
    """One graph: its static inputs, its loss output, and the tensors whose identity it relies on."""

    def __init__(self, batch: PaddedBatch, relied_on: list[torch.Tensor]) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.inputs = tuple(t.clone() for t in _inputs(batch))
        self.loss = torch.empty(0)
        self.relied_on = relied_on
        self.layout: object = None

    def load(self, batch: PaddedBatch) -> None:
        for static, given in zip(self.inputs, _inputs(batch), strict=True):
            static.copy_(given, non_blocking=True)


def _inputs(batch: PaddedBatch) -> tuple[torch.Tensor, ...]:
    b = batch.batch
    return b.dense_features, b.sparse_features.values(), b.sparse_features.lengths(), b.labels, batch.weight


class StepGraphs:
    """``step(batch) -> loss``: a whole training step, replayed from a CUDA graph per padded shape.

    Args:
        model: the DLRM, its sparse module a world of one (``model.sparse_arch.lookup`` serves every feature).
        optimizer: the dense Adagrad (``lr_decay == weight_decay == 0``); its step counters advance per step
            through its step wrapper, so step hooks fire.
        capture: record graphs (CUDA); ``False`` runs every step eagerly (the same ops, for CPU tests).
        warmup: eager steps per padded shape before its capture.
        max_graphs: shapes beyond this many run eagerly.
    """

    def __init__(
        self,
        model: DLRM,
        optimizer: torch.optim.Adagrad,
        *,
        capture: bool = True,
        warmup: int = 1,
        max_graphs: int = 64,
    ) -> None:
        lookup = getattr(model.sparse_arch, "lookup", None)
        if not isinstance(lookup, GroupedVBELookup):
            raise ValueError("`model.sparse_arch` has no `lookup` (a GroupedVBELookup serving every feature)")
        if warmup < 1:
            raise ValueError(
                f"`warmup` is {warmup}, expected >= 1 (the lookup builds its per-layout metadata eagerly)"
            )
        self.model = model
        self.optimizer = optimizer
        self.lookup = lookup
        # With several kernels the batch's features come in kernel order, every feature padded to one id
        # count, so each kernel's ids are one fixed slice (StepPadding(per_feature=True)).
        if len(lookup.groups) > 1:
            order = tuple(name for group in lookup.groups for name in group.features)
            if sorted(order) != sorted(model.sparse_feature_names):
                raise ValueError(
                    f"the lookup's kernels serve {sorted(order)}, the model has {sorted(model.sparse_feature_names)}"
                )
            self.feature_order: tuple[str, ...] = order
        else:
            self.feature_order = tuple(model.sparse_feature_names)
        self.per_feature = len(lookup.groups) > 1
        self._kv: list[tuple[KeyValueEmbeddingBags, int, int]] = []  # kernel, first feature, features
        # prefetch_after_step's prefetches not issued yet: (kernels' inputs, Bp, stream)
        self._deferred: deque[tuple[tuple[tuple[torch.Tensor, torch.Tensor], ...], int, Any]] = deque()
        first = 0
        for group in lookup.groups:
            if isinstance(group.kernel, KeyValueEmbeddingBags):
                self._kv.append((group.kernel, first, len(group.features)))
            first += len(group.features)
        self.capture = capture
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.replays = 0
        self.eager_steps = 0
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._seen: Counter[tuple[int, int]] = Counter()
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        # Eager steps and captures on one side stream (the documented way to warm up a capture).
        self._stream = torch.cuda.Stream() if capture else None  # type: ignore[no-untyped-call]  # untyped in torch

    def padding(self, buckets: Sequence[int]) -> StepPadding:
        """The padding of the batches this step takes (feature order, per-feature id counts, the key-value
        kernels' bags' offsets)."""
        return StepPadding(
            tuple(buckets),
            keys=self.feature_order,
            per_feature=self.per_feature,
            bag_offsets=tuple((first, features) for _, first, features in self._kv),
        )

    @property
    def prefetches(self) -> bool:
        """Whether batches should go through :meth:`prefetch` (there are key-value kernels)."""
        return bool(self._kv)

    def prefetch(self, batch: PaddedBatch) -> PaddedBatch:
        """Prefetch the key-value rows of ``batch`` (on the device) on the current stream; returns it with the ids
        and offsets each kernel's prefetch saw."""
        inputs = self._kv_inputs(batch)
        self._prefetch_now(inputs, batch.batch.batch_size)
        return dataclasses.replace(batch, kv_inputs=inputs)

    def prefetch_after_step(self, batch: PaddedBatch) -> PaddedBatch:
        """A pipeline's prefetch stage: :meth:`prefetch`, its work issued on the current stream around the next
        :meth:`step`'s replay (its survey right after the replay is launched, running beside it on the GPU; its
        one sync and row moves at the start of the step after), or at the start of the step of ``batch``
        itself if that comes first."""
        inputs = self._kv_inputs(batch)
        stream = torch.cuda.current_stream() if inputs and inputs[0][0].is_cuda else None
        self._deferred.append((inputs, batch.batch.batch_size, stream))
        return dataclasses.replace(batch, kv_inputs=inputs)

    def _prefetch_now(self, inputs: tuple[tuple[torch.Tensor, torch.Tensor], ...], padded: int) -> None:
        for (kernel, _, features), (ids, offsets) in zip(self._kv, inputs, strict=True):
            kernel.prefetch(ids, offsets, [[padded]] * features)

    def _run_deferred(self, through: PaddedBatch | None) -> None:
        """The deferred prefetches, in order: up to and including ``through``'s (if it is deferred), or all."""
        if through is not None and not any(entry[0] is through.kv_inputs for entry in self._deferred):
            return
        while self._deferred:
            inputs, padded, stream = self._deferred.popleft()
            with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                self._prefetch_now(inputs, padded)
            if through is not None and inputs is through.kv_inputs:
                return

    def _kv_inputs(self, batch: PaddedBatch) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per key-value kernel, its slice of the batch's ids (every feature holds ``C`` of them) and its bags'
        offsets: the ids the lookup hands that kernel (the same memory, so its forward finds the prefetch)."""
        if batch.kv_inputs or not self._kv:
            return batch.kv_inputs
        sparse = batch.batch.sparse_features
        values, lengths = sparse.values(), sparse.lengths()
        padded = batch.batch.batch_size
        per_feature = values.numel() // len(self.feature_order)
        out = []
        at = 0  # where the next run's offsets start in batch.bag_offsets
        for _, first, features in self._kv:
            ids = values[first * per_feature : (first + features) * per_feature]
            if batch.bag_offsets is not None:  # worked out with the padding (this step's padding())
                offsets = batch.bag_offsets[at : at + features * padded + 1]
                at += features * padded + 1
            else:
                bag_lengths = lengths[first * padded : (first + features) * padded]
                offsets = torch.nn.functional.pad(torch.cumsum(bag_lengths, 0), (1, 0))
            out.append((ids, offsets))
        return tuple(out)

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        """``(Bp, Cp)`` of every graph held."""
        return sorted(self._graphs)

    def step(self, batch: PaddedBatch) -> torch.Tensor:
        """Train on ``batch`` (on the model's device); returns its loss (a new tensor, not synced).

        A batch with key-value rows that did not go through :meth:`prefetch` is prefetched here first (before
        the graphs' check: assigning slots may grow the key-value cache, which the graphs hold by address)."""
        if self._kv and not batch.kv_inputs:
            batch = self.prefetch(batch)
        # This batch's prefetch, issued behind the last replay: its sync and row moves (before the graphs are
        # checked: the moves may grow the cache). Nothing to do when none was issued.
        for kernel, _, _ in self._kv:
            kernel.complete_prefetch()
        self._run_deferred(batch)  # its own prefetch, if it is still deferred
        try:
            return self._step(batch)
        finally:
            self._run_deferred(None)  # the later batches' prefetches, behind this step's work

    def _start_next(self) -> None:
        """Issue the survey of the first deferred prefetch (CUDA) right after this step's replay was launched,
        on the prefetch's own stream: the survey (a chain of small kernels) runs beside the replay on the GPU,
        and its one host sync and row moves wait for the next :meth:`step`, when the host has done the
        pipeline's other work (so the sync finds the survey done). Issued before the replay, the survey ran
        ahead of it instead of beside it, and the sync right after the launch kept the host from the next
        batch until the survey was done (H200 trace, 2026-12-03)."""
        if not self._deferred or self._deferred[0][2] is None:
            return
        inputs, padded, stream = self._deferred.popleft()
        with torch.cuda.stream(stream):
            for (kernel, _, features), (ids, offsets) in zip(self._kv, inputs, strict=True):
                kernel.prefetch(ids, offsets, [[padded]] * features, complete=False)

    def _step(self, batch: PaddedBatch) -> torch.Tensor:
        key = batch.shape_key
        captured = self._graphs.get(key)
        if captured is not None and not self._still_valid(captured):
            self._graphs.clear()
            # A fresh pool for the graphs recorded from now on: tensors first allocated under a capture (the
            # key-value kernel's static slot buffers) outlive its graph, and a private pool whose graphs are
            # all gone but whose blocks are still held cannot be captured into again (an internal assert of
            # the caching allocator, met on the H200 when a tiny cache grew twice).
            self._pool = torch.cuda.graph_pool_handle()
            captured = None
        if captured is None:
            seen = self._seen[key]
            self._seen[key] += 1
            if not self.capture or seen < self.warmup or len(self._graphs) >= self.max_graphs:
                loss = self._eager(batch)
                self._start_next()
                self.eager_steps += 1
                _count_step(self.optimizer)
                return loss
            captured = self._record(batch)
        captured.load(batch)
        with contextlib.ExitStack() as replaying:  # each key-value kernel's slots staged for the replay
            for (kernel, _, features), (ids, offsets) in zip(self._kv, self._kv_inputs(batch), strict=True):
                replaying.enter_context(kernel.replaying(ids, offsets, [[batch.batch.batch_size]] * features))
            captured.graph.replay()
            self._start_next()  # the next batch's survey, while this one's rows are still held
        self.replays += 1
        _count_step(self.optimizer)
        return captured.loss.clone()

    def _relied_on(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        cache = [t for kernel, _, _ in self._kv for t in kernel.captured_buffers()]
        return [state[p]["sum"] for p in self._params] + cache

    def _still_valid(self, captured: _Captured) -> bool:
        now = self._relied_on()
        return len(now) == len(captured.relied_on) and all(
            a is b for a, b in zip(now, captured.relied_on, strict=True)
        )

    def _eager(self, batch: PaddedBatch) -> torch.Tensor:
        if self._stream is None:
            return self._train(*_inputs(batch))
        current = torch.cuda.current_stream()
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            loss = self._train(*_inputs(batch))
        current.wait_stream(self._stream)
        for tensor in _inputs(batch):
            tensor.record_stream(self._stream)
        return loss

    def _record(self, batch: PaddedBatch) -> _Captured:
        captured = _Captured(batch, self._relied_on())
        # The graph reads the lookup's per-layout state by address: keep it alive past the lookup's cache.
        captured.layout = self.lookup.keep_layout(
            self._features(captured.inputs[1], captured.inputs[2], batch.batch.batch_size)
        )
        torch.cuda.synchronize()  # once per shape: the eager steps' work is done before the capture starts
        # No cyclic garbage collection during the capture: a dropped graph destroyed then voids the capture.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(captured.graph, pool=self._pool, stream=self._stream):
                captured.loss = self._train(*captured.inputs)
        finally:
            if collecting:
                gc.enable()
        self._graphs[batch.shape_key] = captured
        return captured

    def _features(self, values: torch.Tensor, lengths: torch.Tensor, padded: int) -> VBEFeatures:
        names = self.feature_order
        # Per-feature padding: every feature holds values.numel() / F ids, known here without a read.
        per_key = [values.numel() // len(names)] * len(names) if self.per_feature else None
        return VBEFeatures(
            keys=list(names),
            values=values,
            lengths=lengths,
            stride_per_key_per_rank=[[padded]] * len(names),
            length_per_key=per_key,
        )

    def _train(
        self,
        dense: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        labels: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """The step's device work (eager, or recorded under a capture): forward, backward, dense update."""
        padded = dense.shape[0]
        features = self._features(values, lengths, padded)
        model = self.model
        looked_up = self.lookup(features)
        pooled = looked_up.values()
        grouped = model.regrouped(model.bottom(dense), _local_pooled(looked_up, padded))
        loss: torch.Tensor = model.head(grouped, labels, weight)
        # The dense gradients returned, not accumulated into `.grad`: a parameter's AccumulateGrad node
        # outlives a step and runs on the stream it was made on, which a capture would not record. The
        # lookup's backward (the kernels' fused updates) then runs from the pooled output's gradient.
        *dense_grads, pooled_grad = torch.autograd.grad(loss, [*self._params, pooled])
        torch.autograd.backward(pooled, pooled_grad)
        with torch.no_grad():
            adagrad_update(self.optimizer, dense_grads)
        return loss.detach()


def _local_pooled(out: Any, padded: int) -> KeyedTensor:
    """A one-rank lookup output (feature -> sample -> dim) as a ``[Bp, sum(D)]`` KeyedTensor."""
    dims: Sequence[int] = out.dims()
    values: torch.Tensor = out.values()
    if len(set(dims)) == 1:
        dim = dims[0]
        pooled = values.view(len(dims), padded, dim).transpose(0, 1).reshape(padded, len(dims) * dim)
    else:
        blocks = values.split_with_sizes([padded * d for d in dims])
        pooled = torch.cat([b.view(padded, d) for b, d in zip(blocks, dims, strict=True)], dim=1)
    return KeyedTensor(keys=list(out.keys()), length_per_key=list(dims), values=pooled)


@torch.optim.Optimizer.profile_hook_step
def _count_step(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's step counters + 1, through its step wrapper (its hooks fire, as for ``step()``)."""
    steps = [optimizer.state[p]["step"] for group in optimizer.param_groups for p in group["params"]]
    torch._foreach_add_(steps, 1.0)
