"""Input distribution: send every id of the local batch to the rank holding its row (one path for all).

Table-wise is row-wise with one shard, so a single bucketization serves both, and pooled and sequence
lookups share it (a sequence lookup reads the same features as bags of one id).

Phases (all collectives through :class:`~vbe_lookup._dist_comm.Communicator`, with timeouts):

1. ``start``: host checks of the input; on the device, bucketize ids to ``(destination rank, slot)``,
   stable-sort them by it (the order inside a bag is kept), count ids per ``(rank, slot)`` and build the
   bucketized lengths ``[rank, slot, sample]``. A fixed-size *header* all-to-all (status, batch size,
   weight flags, ids per slot) is the only host sync; a bad input on any rank is reported to every rank
   here. Then the lengths all-to-all is launched.
2. ``wait``: wait for the lengths, all-to-all the ids and weights with explicit splits, and reorder
   ``source → slot → sample`` into VBE's ``slot (feature) → source → sample``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vbe_lookup._dist_comm import Communicator
from vbe_lookup._features import VBEFeatures
from vbe_lookup._sharding_errors import CollectiveOrderError, PeerRankError, UnknownFeatureError
from vbe_lookup._sharding_plan import ShardingLayout
from vbe_lookup.errors import BatchLayoutError, IndexOutOfRangeError, InvalidFeaturesError, VBELookupError

__all__ = ["DistributedFeatures", "InputDist", "InputDistHandle", "SourceContext"]

_INT64_MAX = torch.iinfo(torch.int64).max
_HEADER_FIXED = 6  # status, batch size, has weights, weights require grad, ids sent, step
_STEP = 5
_OK, _BAD_INPUT, _BAD_IDS, _BAD_LENGTHS = 0, 1, 2, 3
_MAX_CACHE = 64


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SourceContext:
    """What a rank keeps of its own local batch to assemble the owners' results into its output.

    Attributes:
        batch_size: ``B``, the local batch size (every feature has ``B`` samples; may be 0).
        keys: The input's feature names, in the input's order.
        key_index: ``[F_in]`` int64: global feature index of each input key (device).
        lengths: ``[F_in * B]`` int64 local bag lengths, input key → sample (device).
        inverse_perm: ``[N]`` int64: position in the send buffer of each original id (device).
        sorted_segment: ``[N]`` int64: ``rank * S_max + slot`` of each id in send order (device).
        sent: ``[W][S_d]`` host ids sent to each rank for each of its slots.
        ids_per_feature: ``[F_global]`` host number of local ids per global feature.
    """

    batch_size: int
    keys: tuple[str, ...]
    key_index: Tensor
    lengths: Tensor
    inverse_perm: Tensor
    sorted_segment: Tensor
    sent: tuple[tuple[int, ...], ...]
    ids_per_feature: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DistributedFeatures:
    """The ids this rank serves for one step, from every source rank, plus what the output dist needs.

    ``features`` is a :class:`~vbe_lookup.VBEFeatures` whose keys are the rank's features in kernel-group
    order, with ids local to each shard (row-wise: minus the shard's first row), laid out feature →
    source rank → sample with ``stride_per_key_per_rank()[slot][source]`` the source's batch size. The
    object itself is ``KeyedJaggedTensorLike`` (it delegates to ``features``).

    Attributes:
        features: The distributed features.
        ids_per_slot_per_rank: ``[S][W]`` host count of ids per slot from each source rank.
        batch_size_per_rank: ``[W]`` host batch size of each source rank.
        weights_need_grad: Whether some rank's weights require grad (then every rank runs the backward
            of the weights all-to-all).
        source: This rank's own local-batch context (for the output dist).
    """

    features: VBEFeatures
    ids_per_slot_per_rank: tuple[tuple[int, ...], ...]
    batch_size_per_rank: tuple[int, ...]
    weights_need_grad: bool
    source: SourceContext

    def keys(self) -> list[str]:
        """The rank's features, in kernel-group order."""
        return self.features.keys()

    def values(self) -> Tensor:
        """``[N]`` shard-local ids."""
        return self.features.values()

    def lengths(self) -> Tensor:
        """Bag lengths, feature → source rank → sample."""
        return self.features.lengths()

    def offsets(self) -> Tensor:
        """``[len(lengths) + 1]`` bag offsets."""
        return self.features.offsets()

    def weights_or_none(self) -> Tensor | None:
        """``[N]`` per-id weights or ``None``."""
        return self.features.weights_or_none()

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """``[S][W]`` batch size of each feature from each source rank."""
        return self.features.stride_per_key_per_rank()

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every CUDA tensor as used on ``stream`` (features and source context)."""
        self.features.record_stream(stream)
        for t in (
            self.source.key_index,
            self.source.lengths,
            self.source.inverse_perm,
            self.source.sorted_segment,
        ):
            if t.is_cuda:
                t.record_stream(stream)


@dataclass(slots=True, kw_only=True, eq=False)
class InputDistHandle:
    """An input dist in flight: the lengths all-to-all is running; pass it to ``wait_input_dist``."""

    lengths_out: Tensor
    lengths_work: Any
    send_values: Tensor
    send_weights: Tensor | None
    weights_present: bool
    weights_need_grad: bool
    sent_per_rank: list[int]
    received_per_rank: list[int]
    received: tuple[tuple[int, ...], ...]  # [W][S_me]
    batch_size_per_rank: tuple[int, ...]
    source: SourceContext
    done: bool = False


class InputDist:
    """The input all-to-all of one sharded module (metadata cached on the device at construction)."""

    def __init__(self, layout: ShardingLayout, comm: Communicator) -> None:
        self.layout = layout
        self.comm = comm
        self.world = layout.world_size
        self.rank = comm.rank
        self.slot_counts = [len(r.slots) for r in layout.ranks]
        self.s_max = max(1, *self.slot_counts)
        self.header_size = _HEADER_FIXED + self.s_max
        self.my_slots = layout.ranks[self.rank].slots
        self.my_keys = tuple(layout.features[s.feature] for s in self.my_slots)
        self.feature_index = {f: i for i, f in enumerate(layout.features)}

        num_features = len(layout.features)
        k_max = max(len(s) for s in layout.shards)
        slot_of = {(s.feature, r): j for r, rl in enumerate(layout.ranks) for j, s in enumerate(rl.slots)}
        starts = torch.full((num_features, k_max), _INT64_MAX, dtype=torch.int64)
        ranks = torch.zeros((num_features, k_max), dtype=torch.int64)
        slots = torch.zeros((num_features, k_max), dtype=torch.int64)
        rows = torch.zeros(num_features, dtype=torch.int64)
        for f in range(num_features):
            t = layout.feature_table[f]
            rows[f] = layout.tables[t].num_embeddings
            for k, shard in enumerate(layout.shards[t]):
                starts[f, k] = shard.row_start
                ranks[f, k] = shard.rank
                slots[f, k] = slot_of[(f, shard.rank)]
        dev = comm.device
        self._starts = starts.to(dev)
        self._ranks = ranks.to(dev)
        self._slots = slots.to(dev)
        self._rows = rows.to(dev)
        self._key_cache: dict[tuple[str, ...], Tensor] = {}
        self._send_len_cache: dict[int, Tensor] = {}
        self._recv_len_cache: dict[tuple[int, ...], Tensor] = {}
        self._step = 0  # input dists started; every rank sends it in the header and checks the others'

    # -- phase 1 ---------------------------------------------------------------------------------
    def start(self, features: Any) -> InputDistHandle:
        """Validate, bucketize, exchange headers (reporting errors on every rank), launch the lengths."""
        dev = self.comm.device
        world, s_max = self.world, self.s_max
        step = self._step
        self._step += 1
        local_error: VBELookupError | None = None
        # A dropped training output whose backward never ran still owes its peers the backward
        # all-to-alls: send zeros now (so no peer takes this header for a gradient), then report it.
        owed = self.comm.catch_up_skipped_backward()
        if owed:
            local_error = CollectiveOrderError(
                f"rank {self.rank}: the output of an earlier step was dropped without running `backward` "
                f"(owed: {', '.join(owed)}); when training, every rank must run backward on a loss that "
                "depends on the module's output, or run the forward under `torch.no_grad()`. The peers' "
                "tables got no gradient from this rank for that step"
            )
        else:
            try:
                keys, values, lengths, weights, batch = self._check(features)
            except VBELookupError as err:
                local_error = err
        if local_error is not None:
            header = torch.zeros((world, self.header_size), dtype=torch.int64, device=dev)
            header[:, 0] = _BAD_INPUT
            header[:, _STEP] = step
            recv = self.comm.all_to_all(
                header.flatten(), [self.header_size] * world, [self.header_size] * world, "input dist header"
            )
            rows = recv.view(world, self.header_size)[:, [0, _STEP]].tolist()
            self._check_steps(step, [row[1] for row in rows])
            self._raise_errors([row[0] for row in rows], str(local_error), local_error)
            raise AssertionError("unreachable")  # _raise_errors always raises when status is bad

        n = values.numel()
        num_in = len(keys)
        bags = num_in * batch
        key_index = self._key_index(keys)
        ends = torch.cumsum(lengths, 0)
        positions = torch.arange(n, device=dev)
        bag = torch.searchsorted(ends, positions, right=True).clamp_(max=max(bags - 1, 0))
        kpos = torch.div(bag, max(batch, 1), rounding_mode="floor")
        sample = bag - kpos * batch
        g = key_index[kpos] if n else torch.zeros(0, dtype=torch.int64, device=dev)
        starts = self._starts[g]  # [n, K]
        shard = ((values.unsqueeze(1) >= starts).sum(1) - 1).clamp_(min=0)
        dst = self._ranks[g, shard]
        slot = self._slots[g, shard]
        local_ids = values - starts.gather(1, shard.unsqueeze(1)).squeeze(1)
        segment = dst * s_max + slot
        perm = torch.sort(segment, stable=True).indices
        sorted_segment = segment[perm]
        inverse_perm = torch.empty_like(perm)
        inverse_perm[perm] = positions
        send_values = local_ids[perm]
        send_weights = None if weights is None else weights[perm]
        counts = torch.bincount(segment, minlength=world * s_max).view(world, s_max)
        per_bag = torch.bincount(segment * batch + sample, minlength=world * s_max * batch)
        send_lengths = per_bag[self._send_len_index(batch)]

        bad_ids = ((values < 0) | (values >= self._rows[g])).any()
        bad_lengths = (ends[-1] != n) if bags else torch.tensor(n != 0, device=dev)
        bad_lengths = bad_lengths | (lengths < 0).any()
        # Device-side status (no host sync, no host-to-device copy): bad lengths win over bad ids.
        status = (
            bad_lengths.to(torch.int64) * _BAD_LENGTHS + (bad_ids & ~bad_lengths).to(torch.int64) * _BAD_IDS
        )
        header = torch.empty((world, self.header_size), dtype=torch.int64, device=dev)
        header[:, 0] = status
        header[:, 1] = batch
        header[:, 2] = int(weights is not None)
        header[:, 3] = int(weights is not None and weights.requires_grad and torch.is_grad_enabled())
        header[:, 4] = counts.sum(1)
        header[:, _STEP] = step
        header[:, _HEADER_FIXED:] = counts
        recv = self.comm.all_to_all(
            header.flatten(), [self.header_size] * world, [self.header_size] * world, "input dist header"
        )
        # The only host sync of the input dist: what we send and what we receive.
        both = torch.cat([header.flatten(), recv]).view(2, world, self.header_size).tolist()
        mine, theirs = both[0], both[1]
        self._check_steps(step, [row[_STEP] for row in theirs])
        statuses = [row[0] for row in theirs]
        if any(statuses):
            message = ""
            if statuses[self.rank] == _BAD_IDS:
                message = self._describe_bad_ids(keys, values, lengths, batch, key_index)
            elif statuses[self.rank] == _BAD_LENGTHS:
                message = (
                    f"`lengths` of the local batch sum to {int(lengths.sum())} (min {int(lengths.min()) if bags else 0}) "
                    f"but `values` holds {n} ids; expected non-negative lengths summing to the number of ids"
                )
            error: VBELookupError | None = None
            if statuses[self.rank] == _BAD_IDS:
                error = IndexOutOfRangeError(message)
            elif statuses[self.rank] == _BAD_LENGTHS:
                error = BatchLayoutError(message)
            self._raise_errors(statuses, message, error)

        sent = tuple(
            tuple(row[_HEADER_FIXED : _HEADER_FIXED + self.slot_counts[d]]) for d, row in enumerate(mine)
        )
        received = tuple(
            tuple(row[_HEADER_FIXED : _HEADER_FIXED + self.slot_counts[self.rank]]) for row in theirs
        )
        batch_per_rank = tuple(row[1] for row in theirs)
        weights_present = any(row[2] for row in theirs)
        weights_need_grad = any(row[3] for row in theirs)
        if weights_present and send_weights is None:
            send_weights = torch.ones(n, dtype=torch.float32, device=dev)
        if send_weights is not None:
            send_weights = send_weights.to(torch.float32)

        ids_per_feature = [0] * len(self.layout.features)
        for d, rl in enumerate(self.layout.ranks):
            for j, s in enumerate(rl.slots):
                ids_per_feature[s.feature] += sent[d][j]
        source = SourceContext(
            batch_size=batch,
            keys=keys,
            key_index=key_index,
            lengths=lengths,
            inverse_perm=inverse_perm,
            sorted_segment=sorted_segment,
            sent=sent,
            ids_per_feature=tuple(ids_per_feature),
        )
        lengths_out, lengths_work = self.comm.start_all_to_all(
            send_lengths,
            [self.slot_counts[self.rank] * b for b in batch_per_rank],
            [self.slot_counts[d] * batch for d in range(world)],
        )
        return InputDistHandle(
            lengths_out=lengths_out,
            lengths_work=lengths_work,
            send_values=send_values,
            send_weights=send_weights,
            weights_present=weights_present,
            weights_need_grad=weights_need_grad,
            sent_per_rank=[row[4] for row in mine],
            received_per_rank=[row[4] for row in theirs],
            received=received,
            batch_size_per_rank=batch_per_rank,
            source=source,
        )

    # -- phase 2 ---------------------------------------------------------------------------------
    def wait(self, handle: InputDistHandle, anchor: Tensor | None) -> DistributedFeatures:
        """Finish: ids and weights all-to-all, then reorder to feature → source → sample."""
        if handle.done:
            raise InvalidFeaturesError("`handle` was already passed to `wait_input_dist` once")
        handle.done = True
        comm = self.comm
        values_out, values_work = comm.start_all_to_all(
            handle.send_values, handle.received_per_rank, handle.sent_per_rank
        )
        recv_weights: Tensor | None = None
        weights_work: Any = None
        if handle.weights_present:
            assert handle.send_weights is not None  # set in start() whenever weights_present
            if handle.weights_need_grad:
                comm.wait(handle.lengths_work, "input dist lengths")
                comm.wait(values_work, "input dist ids")
                recv_weights = comm.all_to_all_autograd(
                    handle.send_weights,
                    handle.received_per_rank,
                    handle.sent_per_rank,
                    "input dist weights",
                    anchor,
                )
            else:
                recv_weights, weights_work = comm.start_all_to_all(
                    handle.send_weights, handle.received_per_rank, handle.sent_per_rank
                )
        comm.wait(handle.lengths_work, "input dist lengths")
        comm.wait(values_work, "input dist ids")
        if weights_work is not None:
            comm.wait(weights_work, "input dist weights")

        world = self.world
        num_slots = self.slot_counts[self.rank]
        lengths = handle.lengths_out[self._recv_len_index(handle.batch_size_per_rank)]
        # ids arrive source → slot; VBE wants slot → source: one jagged permutation of segments.
        counts = handle.received
        seg_len = [counts[s][j] for j in range(num_slots) for s in range(world)]
        src_start: list[int] = []
        acc = 0
        starts_by_src = []
        for s in range(world):
            row = []
            for j in range(num_slots):
                row.append(acc)
                acc += counts[s][j]
            starts_by_src.append(row)
        src_start = [starts_by_src[s][j] for j in range(num_slots) for s in range(world)]
        total = acc
        values = handle.lengths_out.new_empty(0) if total == 0 else None
        weights = recv_weights
        if total > 0:
            dev = values_out.device
            lens = torch.tensor(seg_len, dtype=torch.int64)
            dst_start = torch.cumsum(lens, 0) - lens
            shift = (torch.tensor(src_start, dtype=torch.int64) - dst_start).to(dev, non_blocking=True)
            index = torch.repeat_interleave(shift, lens.to(dev, non_blocking=True), output_size=total)
            index += torch.arange(total, device=dev)
            values = values_out[index]
            if recv_weights is not None:
                weights = recv_weights[index]
        assert values is not None  # both branches above assign it
        length_per_key = [sum(counts[s][j] for s in range(world)) for j in range(num_slots)]
        stride = [list(handle.batch_size_per_rank) for _ in range(num_slots)]
        features = VBEFeatures(self.my_keys, values, lengths, stride, weights, length_per_key=length_per_key)
        return DistributedFeatures(
            features=features,
            ids_per_slot_per_rank=tuple(tuple(counts[s][j] for s in range(world)) for j in range(num_slots)),
            batch_size_per_rank=handle.batch_size_per_rank,
            weights_need_grad=handle.weights_need_grad,
            source=handle.source,
        )

    # -- helpers ---------------------------------------------------------------------------------
    def _check(self, features: Any) -> tuple[tuple[str, ...], Tensor, Tensor, Tensor | None, int]:
        """Host-side checks of the local batch; returns keys, int64 values, int64 lengths, weights, B."""
        try:
            keys = tuple(features.keys())
            values = features.values()
            lengths = features.lengths()
            weights = features.weights_or_none()
            stride = features.stride_per_key_per_rank()
        except AttributeError as err:
            raise InvalidFeaturesError(
                f"`features` must be KeyedJaggedTensorLike (keys, values, lengths, weights_or_none, "
                f"stride_per_key_per_rank), got {type(features).__name__}: {err}"
            ) from err
        known = set(self.feature_index)
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise UnknownFeatureError(
                f"`features` has key(s) {', '.join(f'`{k}`' for k in unknown)} that no table of the plan "
                f"serves (known features: {', '.join(self.layout.features)})"
            )
        missing = [f for f in self.layout.features if f not in keys]
        if missing:
            raise UnknownFeatureError(
                f"`features` lacks feature(s) {', '.join(f'`{k}`' for k in missing)} of the module's tables "
                f"(got keys: {', '.join(keys) or 'none'})"
            )
        if len(set(keys)) != len(keys):
            raise InvalidFeaturesError(f"`features` repeats keys: {list(keys)}")
        if any(len(row) != 1 for row in stride) or len({row[0] for row in stride}) > 1:
            raise BatchLayoutError(
                f"`features` must be a local batch with one batch size for every key (stride_per_key_per_rank "
                f"[[B]] * F), got {stride}"
            )
        batch = int(stride[0][0]) if stride else 0
        if not isinstance(values, Tensor) or values.dim() != 1 or values.is_floating_point():
            raise InvalidFeaturesError(f"`values` must be a 1-D integer tensor, got {_describe(values)}")
        if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.is_floating_point():
            raise InvalidFeaturesError(f"`lengths` must be a 1-D integer tensor, got {_describe(lengths)}")
        if lengths.numel() != len(keys) * batch:
            raise BatchLayoutError(
                f"`lengths` has {lengths.numel()} entries; expected {len(keys)} keys x batch size {batch}"
            )
        dev = self.comm.device
        if values.device != dev or lengths.device != dev:
            raise InvalidFeaturesError(
                f"`features` must be on the module's device {dev}, got values on {values.device} and lengths "
                f"on {lengths.device}"
            )
        if weights is not None and (
            not isinstance(weights, Tensor)
            or weights.shape != values.shape
            or not weights.is_floating_point()
        ):
            raise InvalidFeaturesError(
                f"`weights` must be a float tensor shaped like `values` {tuple(values.shape)}, got {_describe(weights)}"
            )
        return keys, values.to(torch.int64), lengths.to(torch.int64), weights, batch

    def _key_index(self, keys: tuple[str, ...]) -> Tensor:
        cached = self._key_cache.get(keys)
        if cached is None:
            if len(self._key_cache) >= _MAX_CACHE:
                self._key_cache.clear()
            cached = torch.tensor(
                [self.feature_index[k] for k in keys], dtype=torch.int64, device=self.comm.device
            )
            self._key_cache[keys] = cached
        return cached

    def _send_len_index(self, batch: int) -> Tensor:
        """Positions of ``[rank, slot < S_rank, sample]`` in the padded ``[W, S_max, B]`` counts."""
        cached = self._send_len_cache.get(batch)
        if cached is None:
            if len(self._send_len_cache) >= _MAX_CACHE:
                self._send_len_cache.clear()
            parts = [
                torch.arange(d * self.s_max * batch, (d * self.s_max + self.slot_counts[d]) * batch)
                for d in range(self.world)
            ]
            cached = torch.cat(parts).to(self.comm.device)
            self._send_len_cache[batch] = cached
        return cached

    def _recv_len_index(self, batch_per_rank: Sequence[int]) -> Tensor:
        """Gather index turning received lengths ``source → slot → sample`` into ``slot → source → sample``."""
        key = tuple(batch_per_rank)
        cached = self._recv_len_cache.get(key)
        if cached is None:
            if len(self._recv_len_cache) >= _MAX_CACHE:
                self._recv_len_cache.clear()
            num_slots = self.slot_counts[self.rank]
            base = []
            acc = 0
            for b in key:
                base.append(acc)
                acc += num_slots * b
            parts = [
                torch.arange(base[s] + j * key[s], base[s] + (j + 1) * key[s])
                for j in range(num_slots)
                for s in range(self.world)
            ]
            cached = (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(self.comm.device)
            self._recv_len_cache[key] = cached
        return cached

    def _describe_bad_ids(
        self, keys: tuple[str, ...], values: Tensor, lengths: Tensor, batch: int, key_index: Tensor
    ) -> str:
        """Name the first out-of-range id (error path only: host syncs are fine here)."""
        per_key = lengths.view(len(keys), batch).sum(1).tolist() if batch else [0] * len(keys)
        start = 0
        for i, k in enumerate(keys):
            ids = values[start : start + per_key[i]]
            rows = self.layout.tables[self.layout.feature_table[int(key_index[i])]].num_embeddings
            bad = ((ids < 0) | (ids >= rows)).nonzero()
            if bad.numel():
                first = int(ids[int(bad[0])])
                table = self.layout.tables[self.layout.feature_table[int(key_index[i])]].name
                return (
                    f"feature `{k}` has id {first} (and {bad.numel() - 1} more out of range) but table "
                    f"`{table}` has {rows} rows; expected ids in [0, {rows})"
                )
            start += per_key[i]
        return "`values` has ids outside their tables' range"

    def _check_steps(self, step: int, steps: list[int]) -> None:
        """Every rank must be at the same step; else raise here, on every rank, before any other collective.

        Each rank receives every rank's step, so all of them see a mismatch and raise together.
        """
        if any(s != step for s in steps):
            raise CollectiveOrderError(
                f"rank {self.rank}: the ranks are at different steps of this module's input dist (step per "
                f"rank: {steps}; this rank: {step}); a rank called `forward`/`start_input_dist` more often "
                "than the others or skipped a step's `backward`, so the collectives no longer pair up"
            )

    def _raise_errors(self, statuses: list[int], message: str, own: VBELookupError | None) -> None:
        """Every rank calls this when some status is bad: gather the messages and raise everywhere."""
        messages = self.comm.gather_messages(
            message if statuses[self.rank] else "", "input dist error report"
        )
        if own is not None and statuses[self.rank]:
            raise own
        failed = [r for r, s in enumerate(statuses) if s]
        details = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise PeerRankError(
            f"rank {self.rank}: input dist aborted because rank(s) {', '.join(map(str, failed))} rejected "
            f"their local batch: {details}"
        )


def _describe(obj: object) -> str:
    if isinstance(obj, Tensor):
        return f"{obj.dtype} tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
