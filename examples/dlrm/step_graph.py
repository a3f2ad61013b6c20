"""The whole training step as one CUDA graph replay, on a world of one rank with every table in one fbgemm TBE.

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
one memory pool (replays are sequential; the loss is cloned out). Graphs are dropped and recaptured when the
optimizer's state is no longer the tensors they captured (a ``load_state_dict``). The dense gradients come from
``torch.autograd.grad`` (never ``.grad``) and the lookup's backward runs from the pooled output's gradient, so no
parameter's ``AccumulateGrad`` node (which outlives a step, on the stream it was made on) is part of a step.

What the replay does not do: fbgemm's host-side ``step`` / ``timestep`` counters of the TBE module are not
advanced (read only by UVM-cache and stats-reporter modes, which the direct path does not take); the input is not
range-checked on the device (the data sources make ids in range: synthetic ids modulo the rows, TSV hashes
modulo the rows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from examples.dlrm.data import DLRMBatch, make_features
from examples.dlrm.dense_graphs import pad_rows
from examples.dlrm.dense_step import adagrad_update
from examples.dlrm.model import DLRM
from kt_regroup import KeyedTensor
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
    """

    batch: DLRMBatch
    weight: torch.Tensor
    rows: int

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
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every tensor as used on ``stream`` (no-op for CPU tensors)."""
        self.batch.record_stream(stream)
        if self.weight.is_cuda:
            self.weight.record_stream(stream)

    def pin_memory(self) -> PaddedBatch:
        """This batch in pinned host memory."""
        return PaddedBatch(batch=self.batch.pin_memory(), weight=self.weight.pin_memory(), rows=self.rows)


@dataclass(frozen=True, slots=True)
class StepPadding:
    """Pads host batches to the shapes :class:`StepGraphs` captures (picklable: runs in DataLoader workers).

    Args:
        buckets: padded batch sizes, ascending; a batch of ``B`` samples goes to the smallest one ``> B`` (at
            least one padding sample holds the padding ids).
    """

    buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"`buckets` is {self.buckets}, expected ascending distinct sizes >= 1")

    def __call__(self, batch: DLRMBatch) -> PaddedBatch:
        """``batch`` (on the host) padded: see the module docstring.

        Raises:
            ValueError: ``batch`` has as many samples as the largest bucket or more.
        """
        rows = batch.batch_size
        padded = next((b for b in self.buckets if b > rows), None)
        if padded is None:
            raise ValueError(
                f"batch of {rows} samples needs a padded size above it; the largest is {self.buckets[-1]}"
            )
        sparse = batch.sparse_features
        keys = sparse.keys()
        num_features = len(keys)
        values, lengths = sparse.values(), sparse.lengths().view(num_features, rows)
        n = values.numel()
        quantum = max(1, padded * num_features // _ID_QUANTA_PER_BUCKET)
        capacity = max(quantum, -(-n // quantum) * quantum)
        # The padding ids spread evenly over the padding bags (feature-major), so no bag gets a long tail.
        pad_bags = num_features * (padded - rows)
        extra = capacity - n
        pad_lengths = torch.full((pad_bags,), extra // pad_bags, dtype=lengths.dtype)
        pad_lengths[: extra % pad_bags] += 1
        pad_lengths = pad_lengths.view(num_features, padded - rows)
        new_lengths = torch.cat([lengths, pad_lengths], dim=1)
        # Each real id moves right by the padding ids of the features before its own.
        real_per_feature = lengths.sum(1)
        pad_per_feature = pad_lengths.sum(1)
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
        )


def step_graph_blocker(model: DLRM, *, world_size: int, device: torch.device) -> str | None:
    """Why the whole step cannot be one graph here (``None``: it can)."""
    if device.type != "cuda":
        return f"device is {device.type} (CUDA graphs need CUDA)"
    if world_size != 1:
        return f"a world of {world_size} ranks (the input and output dists' collectives and their host sync)"
    lookup = getattr(model.sparse_arch, "lookup", None)
    if not isinstance(lookup, GroupedVBELookup):
        return "the sparse module has no local GroupedVBELookup"
    if len(lookup.groups) != 1:
        return f"{len(lookup.groups)} kernels on the rank (splitting the ids between them needs host counts)"
    if lookup.fbgemm_paths[0] != "direct":
        return f"the rank's kernel is not an fbgemm TBE called directly ({lookup.fbgemm_paths[0]})"
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

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        """``(Bp, Cp)`` of every graph held."""
        return sorted(self._graphs)

    def step(self, batch: PaddedBatch) -> torch.Tensor:
        """Train on ``batch`` (on the model's device); returns its loss (a new tensor, not synced)."""
        key = batch.shape_key
        captured = self._graphs.get(key)
        if captured is not None and not self._still_valid(captured):
            self._graphs.clear()
            captured = None
        if captured is None:
            seen = self._seen[key]
            self._seen[key] += 1
            if not self.capture or seen < self.warmup or len(self._graphs) >= self.max_graphs:
                loss = self._eager(batch)
                self.eager_steps += 1
                _count_step(self.optimizer)
                return loss
            captured = self._record(batch)
        captured.load(batch)
        captured.graph.replay()
        self.replays += 1
        _count_step(self.optimizer)
        return captured.loss.clone()

    def _relied_on(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        return [state[p]["sum"] for p in self._params]

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
        with torch.cuda.graph(captured.graph, pool=self._pool, stream=self._stream):
            captured.loss = self._train(*captured.inputs)
        self._graphs[batch.shape_key] = captured
        return captured

    def _features(self, values: torch.Tensor, lengths: torch.Tensor, padded: int) -> VBEFeatures:
        names = self.model.sparse_feature_names
        return VBEFeatures(
            keys=names, values=values, lengths=lengths, stride_per_key_per_rank=[[padded]] * len(names)
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
