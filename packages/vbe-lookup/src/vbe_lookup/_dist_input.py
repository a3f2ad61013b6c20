"""Input distribution: send every id of the local batch to the rank holding its row (one path for all).

Table-wise is row-wise with one shard, so a single bucketization serves both, and pooled and sequence
lookups share it (a sequence lookup reads the same features as bags of one id).

Phases (all collectives through :class:`~vbe_lookup._dist_comm.Communicator`, with timeouts):

1. ``start``: host checks of the input (O(F), skipped for a known key order); on the device, bucketize
   ids to ``(destination rank, slot)`` and put them in send order. With every table in one shard
   (table-wise), a key goes whole to one ``(rank, slot)``: the send order is a permutation of the keys'
   blocks built from the ids per key and the bucketized lengths are the input's, reordered by key (no sort).
   Otherwise one binary search over every shard's first row (O(N log K)), a stable sort by it (the order
   inside a bag is kept), and the bucketized lengths ``[rank, slot, sample]`` by scatter-adds into known
   sizes. A fixed-size *header* all-to-all (status, batch size, weight flags, ids sent, step number, ids per
   slot) and one ``.tolist()`` of it are the only host sync of the step; a bad input or a rank out of step
   is reported to every rank here. Then ONE all-to-all of the lengths and the ids (per peer: its lengths,
   then its ids; every split is known from the header) is launched. On CPU (gloo) the lengths and ids ride
   with the header in one all-to-all within per-pair capacities, and ``start`` only launches it: reading
   the header, the checks and the error reports move to ``wait`` (on every rank alike), so a pipeline's
   start does not wait for its peers while they still run the previous batch.
2. ``wait``: wait for it, all-to-all the weights (if any) with explicit splits, and reorder
   ``source → slot → sample`` into VBE's ``slot (feature) → source → sample`` with an index built on the
   device from the received header.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import torch
from torch import Tensor

from vbe_lookup._dist_comm import _DONE, Communicator
from vbe_lookup._features import VBEFeatures
from vbe_lookup._sharding_errors import CollectiveOrderError, PeerRankError, UnknownFeatureError
from vbe_lookup._sharding_plan import ShardingLayout
from vbe_lookup.errors import BatchLayoutError, IndexOutOfRangeError, InvalidFeaturesError, VBELookupError

__all__ = ["DistributedFeatures", "InputDist", "InputDistHandle", "PendingRead", "SourceContext"]

_INT64_MAX = torch.iinfo(torch.int64).max
# status, batch size, has weights, weights require grad, ids sent, step, skipped backward, payload overflow
_HEADER_FIXED = 8
_STEP = 5
_SKIPPED = 6
_OVERFLOW = 7
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
        inverse_perm: ``[N]`` int64: position in the send buffer of each original id (device); ``None`` on
            a group of one whose module does not ask for the ids' order (pooled) and whose input is in
            slot order (then it would be ``arange(N)``).
        sorted_segment: ``[N]`` int64: ``rank * S_max + slot`` of each id in send order (device); ``None``
            when the module does not ask for the ids' order on a group of one (pooled).
        sent: ``[W][S_d]`` host ids sent to each rank for each of its slots.
        ids_per_feature: ``[F_global]`` host number of local ids per global feature.
        sent_counts: ``[W * S_max]`` int64 ids sent per padded segment ``rank * S_max + slot`` (device).
    """

    batch_size: int
    keys: tuple[str, ...]
    key_index: Tensor
    lengths: Tensor
    inverse_perm: Tensor | None
    sorted_segment: Tensor | None
    sent: tuple[tuple[int, ...], ...]
    ids_per_feature: tuple[int, ...]
    sent_counts: Tensor


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
            if t is not None and t.is_cuda:
                t.record_stream(stream)


class InputDistHandle:
    """An input dist in flight; pass it to ``wait_input_dist`` once.

    On CUDA (and on a group of one) the header is read and the lengths-and-ids all-to-all is running; on
    CPU (gloo) the one all-to-all of the header with the lengths and ids is running and ``wait`` reads it.
    """

    __slots__ = ("_state", "done")

    def __init__(self, state: _Launched | _Deferred) -> None:
        self._state = state
        self.done = False


@dataclass(slots=True, kw_only=True, eq=False)
class _Launched:
    """An input dist whose header is read: the lengths (and ids) all-to-all is running."""

    lengths_out: Tensor
    lengths_work: Any
    send_values: Tensor
    send_weights: Tensor | None
    weights_present: bool
    weights_need_grad: bool
    sent_per_rank: list[int]
    received_per_rank: list[int]
    received: tuple[tuple[int, ...], ...]  # [W][S_me]
    received_counts: Tensor  # [W, S_me] int64 device: the same counts, for device-side index math
    received_batch: Tensor  # [W] int64 device: each source's batch size
    ids_per_slot: tuple[int, ...]  # [S_me] ids received per slot (all sources)
    batch_size_per_rank: tuple[int, ...]
    source: SourceContext
    # A group of one: the host read still to make (then ``received``, ``ids_per_slot`` and the source's host
    # counts are filled by ``wait``).
    pending_read: PendingRead | None = None
    # Several ranks: ``lengths_out`` holds, per source rank, its lengths then its ids (one all-to-all,
    # ``lengths_work``), these sizes in that order; empty: ``lengths_out`` holds only lengths.
    merged_sizes: tuple[int, ...] = ()
    # CPU: the received ids, which came with the header (``lengths_out`` then holds the lengths).
    values_out: Tensor | None = None


@dataclass(slots=True, kw_only=True, eq=False)
class PendingRead:
    """The checks' terms and the ids per input key of a group of one, on their way to the host.

    Attributes:
        flat: ``[F_in + 3]`` int64: ids per input key, then the smallest length, the smallest id and the
            id range term (see ``id_limit``): pinned host memory being filled by a non-blocking copy (CUDA),
            or the CPU tensor itself. The last three are 0 where there is no length or no id.
        ready: The event recorded after that copy (``None`` on CPU).
        values: The local ids (for the error report).
        lengths: The local lengths (for the error report).
        num_ids: ``N``, the number of local ids (the lengths must sum to it).
        id_limit: Every id is in its table's range when it is non-negative and the range term is below this:
            the rows of every key's table with the largest id as the term (every key's table has as many
            rows), or 0 with the largest ``id - rows of its key's table`` as the term.
        layout: The group of one's view of this input key order.
    """

    flat: Tensor
    ready: torch.cuda.Event | None
    values: Tensor
    lengths: Tensor
    num_ids: int
    id_limit: int
    layout: _AloneLayout

    def status(self, host: list[int]) -> int:
        """The input's status (``_OK``, ``_BAD_LENGTHS`` or ``_BAD_IDS``) from ``flat`` read to the host."""
        num_in = len(host) - 3
        lengths_min, ids_min, id_term = host[num_in:]
        if lengths_min < 0 or sum(host[:num_in]) != self.num_ids:
            return _BAD_LENGTHS
        if self.num_ids and (ids_min < 0 or id_term >= self.id_limit):
            return _BAD_IDS
        return _OK


class InputDist:
    """The input all-to-all of one sharded module (metadata cached on the device at construction)."""

    def __init__(self, layout: ShardingLayout, comm: Communicator, *, id_order: bool = True) -> None:
        self.layout = layout
        self.comm = comm
        # Whether the output dist reads each id's place in the send order (``SourceContext.inverse_perm`` and
        # ``sorted_segment``: a sequence output does, a pooled one does not); a group of one skips them if not.
        self.id_order = id_order
        self.world = layout.world_size
        self.rank = comm.rank
        self.slot_counts = [len(r.slots) for r in layout.ranks]
        self.s_max = max(1, *self.slot_counts)
        self.header_size = _HEADER_FIXED + self.s_max
        self.my_slots = layout.ranks[self.rank].slots
        self.my_keys = tuple(layout.features[s.feature] for s in self.my_slots)
        self.feature_index = {f: i for i, f in enumerate(layout.features)}

        num_features = len(layout.features)
        world, s_max = self.world, self.s_max
        slot_of = {(s.feature, r): j for r, rl in enumerate(layout.ranks) for j, s in enumerate(rl.slots)}
        # Every feature's rows laid end to end in one global row space; the shards' first rows there are
        # one sorted boundary list, so bucketizing an id is one binary search: O(N log K) time, O(N)
        # memory, whatever the number of shards (no [N, K] comparison).
        feature_base: list[int] = []
        bounds: list[int] = []
        shard_rank: list[int] = []
        shard_slot: list[int] = []
        shard_row0: list[int] = []
        rows: list[int] = []
        acc = 0
        for f in range(num_features):
            t = layout.feature_table[f]
            feature_base.append(acc)
            rows.append(layout.tables[t].num_embeddings)
            for shard in layout.shards[t]:
                bounds.append(acc + shard.row_start)
                shard_rank.append(shard.rank)
                shard_slot.append(slot_of[(f, shard.rank)])
                shard_row0.append(shard.row_start)
            acc += layout.tables[t].num_embeddings
        # Padded segment (rank * S_max + slot) → compact (rank, slot) index and global feature (F: padding).
        compact = [0] * (world * s_max)
        seg_feature = [num_features] * (world * s_max)
        k = 0
        for d, rl in enumerate(layout.ranks):
            for j, slot in enumerate(rl.slots):
                compact[d * s_max + j] = k
                seg_feature[d * s_max + j] = slot.feature
                k += 1
        self.num_compact = k
        dev = comm.device

        def on_dev(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev)

        self._feature_base = on_dev(feature_base)
        self._bounds = on_dev(bounds)
        self._shard_rank = on_dev(shard_rank)
        self._shard_slot = on_dev(shard_slot)
        self._shard_row0 = on_dev(shard_row0)
        self._rows = on_dev(rows)
        self._compact = on_dev(compact)
        self._seg_feature = on_dev(seg_feature)
        self._key_cache: dict[tuple[str, ...], Tensor] = {}
        self._recv_len_cache: dict[tuple[int, ...], Tensor] = {}
        self._stride_cache: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
        self._alone_cache: dict[tuple[str, ...], _AloneLayout] = {}
        self._batch_cache: dict[int, Tensor] = {}
        # Every table in one shard (table-wise, or a group of one): ids bucketize by key, without a sort.
        self._table_wise = all(len(shards) == 1 and shards[0].row_start == 0 for shards in layout.shards)
        self._table_wise_cache: dict[tuple[str, ...], _TableWiseLayout] = {}
        # CPU (gloo): lengths and ids travel with the header, within per-pair capacities (see start()).
        self._payload_caps = _PayloadCaps(self.world) if dev.type == "cpu" else None
        self._step = 0  # input dists started; every rank sends it in the header and checks the others'

    # -- phase 1 ---------------------------------------------------------------------------------
    def start(self, features: Any) -> InputDistHandle:
        """Validate, bucketize, exchange headers (reporting errors on every rank), launch the lengths.

        On CPU (gloo) the header travels with the lengths and ids in one all-to-all that is only launched
        here: ``wait`` reads it, checks every rank's status and step, and raises there (on every rank) for
        bad input, so a pipeline's start never waits for a peer.
        """
        dev = self.comm.device
        world = self.world
        step = self._step
        self._step += 1
        local_error: VBELookupError | None = None
        # A dropped training output whose backward never ran still owes its peers the backward
        # all-to-alls: send zeros now (so no peer takes this header for a gradient), then report it.
        owed = len(self.comm.catch_up_skipped_backward())
        try:
            keys, values, lengths, weights, batch = self._check(features)
        except VBELookupError as err:
            local_error = err
        if local_error is not None:
            header = torch.zeros((world, self.header_size), dtype=torch.int64, device=dev)
            header[:, 0] = _BAD_INPUT
            header[:, _STEP] = step
            header[:, _SKIPPED] = owed
            if self._payload_caps is not None:  # the peers send their payload with the header
                return InputDistHandle(
                    self._launch_with_payload(header, [[] for _ in range(world)], None, local_error, step)
                )
            recv = self.comm.all_to_all(
                header.flatten(), [self.header_size] * world, [self.header_size] * world, "input dist header"
            )
            self._raise_rejected(recv.view(world, self.header_size), step, local_error)

        if self.comm.alone:
            return InputDistHandle(self._start_alone(step, keys, values, lengths, weights, batch))
        key_index = self._key_index(keys)
        if self._table_wise:
            buckets = self._buckets_table_wise(keys, values, lengths, weights, batch)
        else:
            buckets = self._buckets_by_shard(key_index, values, lengths, weights, batch)
        counts = buckets.counts.view(world, self.s_max)
        status = buckets.status
        header = torch.empty((world, self.header_size), dtype=torch.int64, device=dev)
        header[:, 0] = status
        header[:, 1] = batch
        header[:, 2] = int(weights is not None)
        header[:, 3] = int(weights is not None and weights.requires_grad and torch.is_grad_enabled())
        header[:, 4] = counts.sum(1)
        header[:, _STEP] = step
        header[:, _SKIPPED] = owed
        header[:, _HEADER_FIXED:] = counts
        send_len_sizes = [self.slot_counts[d] * batch for d in range(world)]
        outgoing = _Outgoing(
            step=step,
            keys=keys,
            values=values,
            lengths=lengths,
            weights=weights,
            batch=batch,
            key_index=key_index,
            buckets=buckets,
            header=header,
            counts=counts,
            send_len_sizes=send_len_sizes,
        )
        caps = self._payload_caps
        if caps is None:
            header[:, _OVERFLOW] = 0
            recv = self.comm.all_to_all(
                header.flatten(), [self.header_size] * world, [self.header_size] * world, "input dist header"
            )
            return InputDistHandle(self._settle(outgoing, recv.view(world, self.header_size), []))
        # CPU: the lengths and ids ride with the header, in one all-to-all (reading the counts here is no
        # device sync). Each (sender, receiver) pair has a capacity both ends know; a payload that does not
        # fit goes in a second all-to-all, which every rank makes when any rank flags one.
        sent_now = counts.sum(1).tolist()
        payload = [send_len_sizes[d] + sent_now[d] for d in range(world)]
        fits = [payload[d] <= caps.send[d] for d in range(world)]
        pieces: list[list[Tensor]] = [[] for _ in range(world)]
        send_len: tuple[Tensor, ...] = ()
        send_ids: tuple[Tensor, ...] = ()
        if int(status) != _OK:  # bad input: no payload (the counts may not match the ids); all raise
            fits = [True] * world
        else:
            send_len = torch.split(buckets.send_lengths, send_len_sizes)
            send_ids = torch.split(buckets.send_values, sent_now)
            pieces = [[send_len[d], send_ids[d]] if fits[d] else [] for d in range(world)]
        header[:, _OVERFLOW] = int(not all(fits))
        outgoing = replace(
            outgoing,
            payload=payload,
            fits=fits,
            send_len=send_len,
            send_ids=send_ids,
            recv_caps=tuple(caps.recv),
        )
        return InputDistHandle(self._launch_with_payload(header, pieces, outgoing, None, step))

    def _settle(self, out: _Outgoing, recv_rows: Tensor, recv_parts: list[Tensor]) -> _Launched:
        """Read the exchanged headers (the step's one host sync): check every rank's status and step,
        then launch the lengths-and-ids all-to-all (CUDA) or take them from ``recv_parts`` (CPU)."""
        dev = self.comm.device
        world = self.world
        caps = self._payload_caps
        buckets, counts, header = out.buckets, out.counts, out.header
        send_values, send_weights = buckets.send_values, buckets.send_weights
        my_slots = self.slot_counts[self.rank]
        received_counts = recv_rows[:, _HEADER_FIXED : _HEADER_FIXED + my_slots]
        num_features = len(self.layout.features)
        ids_per_feature_dev = torch.zeros(num_features + 1, dtype=torch.int64, device=dev).index_add_(
            0, self._seg_feature, counts.reshape(-1)
        )[:num_features]
        # The only host sync of the step: what we send, what we receive, and two sums derived from them.
        flat = torch.cat(
            [header.flatten(), recv_rows.reshape(-1), received_counts.sum(0), ids_per_feature_dev]
        ).tolist()
        size = world * self.header_size
        mine = [flat[d * self.header_size : (d + 1) * self.header_size] for d in range(world)]
        theirs = [flat[size + d * self.header_size : size + (d + 1) * self.header_size] for d in range(world)]
        ids_per_slot = tuple(flat[2 * size : 2 * size + my_slots])
        ids_per_feature = tuple(flat[2 * size + my_slots :])
        if caps is not None:
            recv_payload = [my_slots * row[1] + row[4] for row in theirs]
            # Against the capacities this exchange was launched with (a settle in between may have grown them).
            included = [recv_payload[s] <= out.recv_caps[s] for s in range(world)]
            self._grow_caps(out.payload, theirs)  # before any error is raised: every rank keeps in step
        self._check_steps(out.step, [row[_STEP] for row in theirs], [row[_SKIPPED] for row in theirs])
        statuses = [row[0] for row in theirs]
        if any(statuses):
            self._report_bad_input(statuses, out.keys, out.values, out.lengths, out.batch, out.key_index)

        sent = tuple(
            tuple(row[_HEADER_FIXED : _HEADER_FIXED + self.slot_counts[d]]) for d, row in enumerate(mine)
        )
        received = tuple(tuple(row[_HEADER_FIXED : _HEADER_FIXED + my_slots]) for row in theirs)
        batch_per_rank = tuple(row[1] for row in theirs)
        weights_present = any(row[2] for row in theirs)
        weights_need_grad = any(row[3] for row in theirs)
        if weights_present and send_weights is None:
            send_weights = torch.ones(out.values.numel(), dtype=torch.float32, device=dev)
        if send_weights is not None:
            send_weights = send_weights.to(torch.float32)

        source = SourceContext(
            batch_size=out.batch,
            keys=out.keys,
            key_index=out.key_index,
            lengths=out.lengths,
            inverse_perm=buckets.inverse_perm,
            sorted_segment=buckets.sorted_segment,
            sent=sent,
            ids_per_feature=ids_per_feature,
            sent_counts=counts.reshape(-1),
        )
        sent_ids = [row[4] for row in mine]
        received_ids = [row[4] for row in theirs]
        recv_len_sizes = [my_slots * b for b in batch_per_rank]
        send_len_sizes = out.send_len_sizes
        values_out: Tensor | None = None
        if caps is not None:
            if any(row[_OVERFLOW] for row in theirs):  # every rank sees every flag: all of them make it
                fits, payload = out.fits, out.payload
                late_sizes = [0 if included[src] else recv_payload[src] for src in range(world)]
                late_send = [
                    t for d in range(world) if not fits[d] for t in (out.send_len[d], out.send_ids[d])
                ]
                late = self.comm.all_to_all(
                    torch.cat(late_send) if late_send else out.values.new_zeros(0),
                    late_sizes,
                    [0 if fits[d] else payload[d] for d in range(world)],
                    "input dist lengths and ids",
                )
                late_parts = torch.split(late, late_sizes)
            blocks = [
                recv_parts[s][: recv_payload[s]] if included[s] else late_parts[s] for s in range(world)
            ]
            pairs = [torch.split(blocks[s], [recv_len_sizes[s], received_ids[s]]) for s in range(world)]
            merged_out, merged_work = torch.cat([pair[0] for pair in pairs]), _DONE
            values_out = torch.cat([pair[1] for pair in pairs])
            merged_sizes: tuple[int, ...] = ()
        else:
            # Lengths and ids in ONE all-to-all (every split is known from the header): per peer rank,
            # its lengths [slot, sample] then its ids, both int64.
            send_len = torch.split(buckets.send_lengths, send_len_sizes)
            send_ids = torch.split(send_values, sent_ids)
            merged = torch.cat([part for d in range(world) for part in (send_len[d], send_ids[d])])
            merged_sizes = tuple(size for d in range(world) for size in (recv_len_sizes[d], received_ids[d]))
            merged_out, merged_work = self.comm.start_all_to_all(
                merged,
                [recv_len_sizes[d] + received_ids[d] for d in range(world)],
                [send_len_sizes[d] + sent_ids[d] for d in range(world)],
            )
        return _Launched(
            lengths_out=merged_out,
            lengths_work=merged_work,
            send_values=send_values,
            send_weights=send_weights,
            weights_present=weights_present,
            weights_need_grad=weights_need_grad,
            sent_per_rank=sent_ids,
            received_per_rank=received_ids,
            received=received,
            received_counts=received_counts,
            received_batch=recv_rows[:, 1],
            ids_per_slot=ids_per_slot,
            batch_size_per_rank=batch_per_rank,
            source=source,
            merged_sizes=merged_sizes,
            values_out=values_out,
        )

    def _raise_rejected(self, recv_hdr: Tensor, step: int, error: VBELookupError) -> NoReturn:
        """This rank rejected its input (``error``): check the steps, then raise on every rank."""
        rows = recv_hdr[:, [0, _STEP, _SKIPPED]].tolist()
        self._check_steps(step, [row[1] for row in rows], [row[2] for row in rows])
        self._raise_errors([row[0] for row in rows], str(error), error)
        raise AssertionError("unreachable")  # _raise_errors always raises when status is bad

    def _launch_with_payload(
        self,
        header: Tensor,
        pieces: list[list[Tensor]],
        outgoing: _Outgoing | None,
        error: VBELookupError | None,
        step: int,
    ) -> _Deferred:
        """Launch one all-to-all of ``[header | payload pieces | padding]`` per peer, each ``H + capacity``
        long (CPU); ``_read_deferred`` reads it."""
        caps = self._payload_caps
        assert caps is not None  # CPU only
        h = self.header_size
        parts: list[Tensor] = []
        for d in range(self.world):
            parts.append(header[d])
            used = sum(t.numel() for t in pieces[d])
            parts.extend(pieces[d])
            parts.append(caps.padding(caps.send[d] - used))
        splits = [h + c for c in caps.recv]
        received, work = self.comm.start_all_to_all(torch.cat(parts), splits, [h + c for c in caps.send])
        return _Deferred(
            received=received, work=work, splits=splits, outgoing=outgoing, error=error, step=step
        )

    def _read_deferred(self, deferred: _Deferred) -> _Launched:
        """Wait for the CPU's header-and-payload all-to-all and settle it (raising for bad input anywhere).

        Per source rank it holds ``H`` header elements, then ``capacity`` elements: the source's lengths
        and ids if they fit, then padding.
        """
        self.comm.wait(deferred.work, "input dist header and ids")
        per_source = torch.split(deferred.received, deferred.splits)
        h = self.header_size
        recv_rows = torch.stack([p[:h] for p in per_source])
        if deferred.outgoing is None:
            assert deferred.error is not None  # a rejected local input sends no payload
            self._grow_caps([0] * self.world, recv_rows.tolist())
            self._raise_rejected(recv_rows, deferred.step, deferred.error)
        return self._settle(deferred.outgoing, recv_rows, [p[h:] for p in per_source])

    def _grow_caps(self, payload: list[int], theirs: list[list[int]]) -> None:
        """Grow each pair's capacity past a payload that did not fit, the same way at both ends."""
        caps = self._payload_caps
        assert caps is not None  # CPU only
        my_slots = self.slot_counts[self.rank]
        for d in range(self.world):
            if payload[d] > caps.send[d]:
                caps.send[d] = _capacity(payload[d])
        for s, row in enumerate(theirs):
            size = my_slots * row[1] + row[4]
            if size > caps.recv[s]:
                caps.recv[s] = _capacity(size)

    def _buckets_by_shard(
        self, key_index: Tensor, values: Tensor, lengths: Tensor, weights: Tensor | None, batch: int
    ) -> _Buckets:
        """Any plan (row-wise shards included): bucketize every id by one binary search over the shards'
        first rows, then a stable sort by destination ``(rank, slot)``."""
        dev = self.comm.device
        world, s_max = self.world, self.s_max
        n = values.numel()
        bags = key_index.numel() * batch
        ends = torch.cumsum(lengths, 0)
        positions = torch.arange(n, device=dev)
        bag = torch.searchsorted(ends, positions, right=True).clamp_(max=max(bags - 1, 0))
        kpos = torch.div(bag, max(batch, 1), rounding_mode="floor")
        sample = bag - kpos * batch
        g = key_index[kpos] if n else torch.zeros(0, dtype=torch.int64, device=dev)
        shard = self._bucketize(g, values)
        segment = self._shard_rank[shard] * s_max + self._shard_slot[shard]
        local_ids = values - self._shard_row0[shard]
        perm = torch.sort(segment, stable=True).indices
        sorted_segment = segment[perm]
        inverse_perm = torch.empty_like(perm)
        inverse_perm[perm] = positions
        send_values = local_ids[perm]
        send_weights = None if weights is None else weights[perm]
        # Counts by scatter-add into known sizes: no `bincount` (on CUDA it reads min and max back).
        ones = torch.ones_like(segment)
        counts = torch.zeros(world * s_max, dtype=torch.int64, device=dev).scatter_add_(0, segment, ones)
        # Bucketized lengths in send order [rank, slot < S_rank, sample]: compact segment * B + sample.
        per_bag_key = self._compact[segment] * batch + sample
        send_lengths = torch.zeros(self.num_compact * batch, dtype=torch.int64, device=dev).scatter_add_(
            0, per_bag_key, ones
        )
        bad_ids = ((values < 0) | (values >= self._rows[g])).any()
        bad_lengths = (ends[-1] != n) if bags else torch.full((), n != 0, dtype=torch.bool, device=dev)
        return _Buckets(
            send_values=send_values,
            send_weights=send_weights,
            send_lengths=send_lengths,
            counts=counts,
            inverse_perm=inverse_perm,
            sorted_segment=sorted_segment,
            status=_status(bad_lengths | (lengths < 0).any(), bad_ids),
        )

    def _buckets_table_wise(
        self,
        keys: tuple[str, ...],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        batch: int,
    ) -> _Buckets:
        """Every table in one shard: each input key goes whole to one ``(rank, slot)``, so the send order is
        a permutation of the keys' blocks (built from the ids per key, as a group of one does): no binary
        search per id, no sort, and the bucketized lengths are the input's, reordered by key."""
        dev = self.comm.device
        n = values.numel()
        num_in = len(keys)
        tw = self._table_wise_layout(keys)
        per_key = (
            lengths.view(num_in, batch).sum(1)
            if batch
            else torch.zeros(num_in, dtype=torch.int64, device=dev)
        )
        positions = torch.arange(n, device=dev)
        key_ends = torch.cumsum(per_key, 0)
        # Key of every id; clamped, so that bad lengths (reported through the header) stay in bounds.
        kpos = torch.searchsorted(key_ends, positions, right=True).clamp_(max=max(num_in - 1, 0))
        compact_counts = per_key[tw.key_of_compact]  # [K] ids per (rank, slot), send order
        dst_start = (torch.cumsum(compact_counts, 0) - compact_counts)[tw.compact_of_key]
        shift = dst_start - (key_ends - per_key)
        inverse_perm = (shift[kpos] + positions).clamp_(0, max(n - 1, 0)) if n else positions
        send_values = torch.empty_like(values).scatter_(0, inverse_perm, values)
        send_weights = (
            None if weights is None else torch.empty_like(weights).scatter_(0, inverse_perm, weights)
        )
        sorted_segment = torch.empty_like(kpos).scatter_(0, inverse_perm, tw.segment_of_key[kpos])
        counts = torch.zeros(self.world * self.s_max, dtype=torch.int64, device=dev).index_copy_(
            0, tw.segment_of_compact, compact_counts
        )
        send_lengths = lengths.view(num_in, batch)[tw.key_of_compact].reshape(-1) if batch else lengths
        if n:
            bad_ids = ((values < 0) | (values >= tw.rows[kpos])).any()
            bad_lengths = key_ends[-1] != n if num_in else torch.ones((), dtype=torch.bool, device=dev)
        else:
            bad_ids = torch.zeros((), dtype=torch.bool, device=dev)
            bad_lengths = per_key.sum() != 0
        return _Buckets(
            send_values=send_values,
            send_weights=send_weights,
            send_lengths=send_lengths,
            counts=counts,
            inverse_perm=inverse_perm,
            sorted_segment=sorted_segment,
            status=_status(bad_lengths | (lengths < 0).any(), bad_ids),
        )

    def _table_wise_layout(self, keys: tuple[str, ...]) -> _TableWiseLayout:
        """Per input key order (cached): the key of each destination ``(rank, slot)`` and back."""
        cached = self._table_wise_cache.get(keys)
        if cached is None:
            if len(self._table_wise_cache) >= _MAX_CACHE:
                self._table_wise_cache.clear()
            layout = self.layout
            where = {k: i for i, k in enumerate(keys)}  # every feature is there once (checked)
            key_of_compact: list[int] = []
            segment_of_compact: list[int] = []
            for d, rl in enumerate(layout.ranks):
                for j, slot in enumerate(rl.slots):
                    key_of_compact.append(where[layout.features[slot.feature]])
                    segment_of_compact.append(d * self.s_max + j)
            compact_of_key = [0] * len(keys)
            for c, key in enumerate(key_of_compact):
                compact_of_key[key] = c
            rows = [layout.tables[layout.feature_table[self.feature_index[k]]].num_embeddings for k in keys]
            dev = self.comm.device
            cached = _TableWiseLayout(
                rows=_on(rows, dev),
                key_of_compact=_on(key_of_compact, dev),
                compact_of_key=_on(compact_of_key, dev),
                segment_of_compact=_on(segment_of_compact, dev),
                segment_of_key=_on([segment_of_compact[c] for c in compact_of_key], dev),
            )
            self._table_wise_cache[keys] = cached
        return cached

    # -- phase 2 ---------------------------------------------------------------------------------
    def wait(self, handle: InputDistHandle, anchor: Tensor | None) -> DistributedFeatures:
        """Finish: ids and weights all-to-all, then reorder to feature → source → sample."""
        if handle.done:
            raise InvalidFeaturesError("`handle` was already passed to `wait_input_dist` once")
        state = handle._state
        if isinstance(state, _Deferred):
            handle.done = True  # its all-to-all is read once, whether or not a rank's input was bad
            state = handle._state = self._read_deferred(state)
        if state.pending_read is not None:
            self._finish_alone(state)  # raises for bad input, the handle kept for another try
        handle.done = True
        return self._assemble(state, anchor)

    def _assemble(self, handle: _Launched, anchor: Tensor | None) -> DistributedFeatures:
        """The ids (and weights) all-to-all of a launched input dist, reordered to feature → source → sample."""
        comm = self.comm
        if handle.values_out is not None:  # the ids came with the header (CPU)
            values_out, values_work = handle.values_out, None
        elif handle.merged_sizes:  # lengths and ids came in one all-to-all, launched by start()
            values_out, values_work = self._split_merged(handle), None
        else:
            values_out, values_work = comm.start_all_to_all(
                handle.send_values, handle.received_per_rank, handle.sent_per_rank
            )
        recv_weights: Tensor | None = None
        weights_work: Any = None
        if handle.weights_present:
            assert handle.send_weights is not None  # set in start() whenever weights_present
            if handle.weights_need_grad:
                if values_work is not None:
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
        if values_work is not None:
            comm.wait(handle.lengths_work, "input dist lengths")
            comm.wait(values_work, "input dist ids")
        if weights_work is not None:
            comm.wait(weights_work, "input dist weights")

        num_slots = self.slot_counts[self.rank]
        if self.comm.alone:  # already feature → sample (its own ids, one source): nothing to transpose
            features = VBEFeatures._built(
                self.my_keys,
                values_out,
                handle.lengths_out,
                self._stride(handle.batch_size_per_rank, num_slots),
                recv_weights,
                tuple(handle.ids_per_slot),
            )
            return DistributedFeatures(
                features=features,
                ids_per_slot_per_rank=tuple(zip(*handle.received, strict=True)),
                batch_size_per_rank=handle.batch_size_per_rank,
                weights_need_grad=handle.weights_need_grad,
                source=handle.source,
            )
        lengths = handle.lengths_out[self._recv_len_index(handle.batch_size_per_rank, handle.received_batch)]
        # ids arrive source → slot; VBE wants slot → source: one jagged permutation of segments, built on
        # the device from the received header (no host lists, no host-to-device copy).
        counts = handle.received
        total = sum(handle.received_per_rank)
        values = values_out
        weights = recv_weights
        if total > 0:
            index = _segment_transpose(handle.received_counts, total)
            values = values_out[index]
            if recv_weights is not None:
                weights = recv_weights[index]
        length_per_key = handle.ids_per_slot
        stride = self._stride(handle.batch_size_per_rank, num_slots)
        features = VBEFeatures._built(self.my_keys, values, lengths, stride, weights, tuple(length_per_key))
        return DistributedFeatures(
            features=features,
            ids_per_slot_per_rank=tuple(zip(*counts, strict=True)),
            batch_size_per_rank=handle.batch_size_per_rank,
            weights_need_grad=handle.weights_need_grad,
            source=handle.source,
        )

    def _split_merged(self, handle: _Launched) -> Tensor:
        """Wait for the one lengths-and-ids all-to-all; leave the lengths in ``handle.lengths_out`` and
        return the ids (both source-major, as two separate all-to-alls would have left them)."""
        self.comm.wait(handle.lengths_work, "input dist lengths and ids")
        parts = torch.split(handle.lengths_out, list(handle.merged_sizes))
        handle.lengths_out = torch.cat(parts[0::2])
        return torch.cat(parts[1::2])

    def _start_alone(
        self,
        step: int,
        keys: tuple[str, ...],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        batch: int,
    ) -> _Launched:
        """``start`` on a group of one: every id stays here, in its own shard (row 0 on), so there is
        nothing to bucketize. The checks are a few reductions whose results join the ids per key in the
        step's one host read (lengths: the smallest one and their sum; ids: the smallest one and the largest
        one, or the largest excess over its key's table when the tables differ in rows), judged on the host
        with the same status codes as the header. For an input key order other than the slot order, one
        scatter puts the features in slot order, the order inside a bag kept as the stable sort keeps it.
        All of it is device work of fixed shapes that bad input cannot push out of bounds; the host read
        (the step's one sync) is only issued here (into pinned memory, with an event) and made by
        :meth:`wait`, so that a pipeline's start never blocks the host."""
        dev = self.comm.device
        n = values.numel()
        num_in = len(keys)
        bags = num_in * batch
        key_index = self._key_index(keys)
        alone = self._alone_layout(keys)
        order, slot_of_key = alone.order, alone.slot_of_key
        per_key = (
            lengths.view(num_in, batch).sum(1)
            if batch
            else torch.zeros(num_in, dtype=torch.int64, device=dev)
        )
        # Each id's input key: for the gather into slot order, for the ids' order a sequence output reads, and
        # for the id range check when the keys' tables differ in rows. Clamped: bad lengths stay in bounds.
        positions: Tensor | None = None
        kpos: Tensor | None = None
        key_ends: Tensor | None = None
        if order is not None or self.id_order or (n and alone.same_rows is None):
            positions = torch.arange(n, device=dev)
            kpos = positions
            if n:
                key_ends = torch.cumsum(per_key, 0)
                kpos = torch.searchsorted(key_ends, positions, right=True).clamp_(max=max(num_in - 1, 0))
        tail: list[Tensor] = [per_key]
        tail.append(lengths.amin(0, keepdim=True) if bags else per_key.new_zeros(1))
        id_limit = 0
        if not n:
            tail.append(per_key.new_zeros(2))
        elif alone.same_rows is not None:
            tail.extend(torch.aminmax(values, dim=0, keepdim=True))
            id_limit = alone.same_rows
        else:
            assert kpos is not None  # computed above whenever the tables differ in rows
            tail.append(values.amin(0, keepdim=True))
            tail.append((values - alone.rows[kpos]).amax(0, keepdim=True))
        flat = torch.cat(tail)
        ready: torch.cuda.Event | None = None
        if flat.is_cuda:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            ready.record()
            flat = host

        counts = per_key if order is None else per_key[order]  # [S] ids per slot (device)
        inverse_perm = sorted_segment = None
        if order is None:  # the input is in slot order already
            send_values, send_lengths, send_weights = values, lengths, weights
            if self.id_order:
                inverse_perm, sorted_segment = positions, kpos
        else:
            # Both computed above for a key order to gather.
            assert positions is not None
            assert kpos is not None
            # Each id's place in slot order; clamped, so that bad lengths (reported by wait) stay in bounds.
            src_start = (key_ends if key_ends is not None else torch.cumsum(per_key, 0)) - per_key
            dst_start = (torch.cumsum(counts, 0) - counts)[slot_of_key]
            inverse_perm = ((dst_start - src_start)[kpos] + positions).clamp_(0, max(n - 1, 0))
            send_values = torch.empty_like(values).scatter_(0, inverse_perm, values)
            send_weights = (
                None if weights is None else torch.empty_like(weights).scatter_(0, inverse_perm, weights)
            )
            send_lengths = lengths.view(num_in, batch)[order].reshape(-1) if batch else lengths
            if self.id_order:
                sorted_segment = torch.empty_like(kpos).scatter_(0, inverse_perm, slot_of_key[kpos])
        if counts.numel() == self.s_max:
            sent_counts = counts
        else:
            sent_counts = torch.zeros(self.s_max, dtype=torch.int64, device=dev)
            sent_counts[: counts.numel()] = counts
        if send_weights is not None:
            send_weights = send_weights.to(torch.float32)
        need_grad = weights is not None and weights.requires_grad and torch.is_grad_enabled()
        source = SourceContext(
            batch_size=batch,
            keys=keys,
            key_index=key_index,
            lengths=lengths,
            inverse_perm=inverse_perm,
            sorted_segment=sorted_segment,
            sent=(),  # host counts: filled by wait()
            ids_per_feature=(),
            sent_counts=sent_counts,
        )
        del step  # every rank is at the same step: there is no other rank
        lengths_out, lengths_work = self.comm.start_all_to_all(send_lengths, [send_lengths.numel()], [bags])
        return _Launched(
            lengths_out=lengths_out,
            lengths_work=lengths_work,
            send_values=send_values,
            send_weights=send_weights,
            weights_present=weights is not None,
            weights_need_grad=need_grad,
            sent_per_rank=[n],
            received_per_rank=[n],
            received=(),
            received_counts=counts.view(1, -1),
            received_batch=self._batch_tensor(batch),
            ids_per_slot=(),
            batch_size_per_rank=(batch,),
            source=source,
            pending_read=PendingRead(
                flat=flat,
                ready=ready,
                values=values,
                lengths=lengths,
                num_ids=n,
                id_limit=id_limit,
                layout=alone,
            ),
        )

    def _batch_tensor(self, batch: int) -> Tensor:
        """``[1]`` int64 ``batch`` on the device (cached per batch size: no fill kernel per step)."""
        cached = self._batch_cache.get(batch)
        if cached is None:
            if len(self._batch_cache) >= _MAX_CACHE:
                self._batch_cache.clear()
            cached = torch.full((1,), batch, dtype=torch.int64, device=self.comm.device)
            self._batch_cache[batch] = cached
        return cached

    def _finish_alone(self, handle: _Launched) -> None:
        """The host read ``_start_alone`` issued: raise for bad input, fill the handle's host counts."""
        pending = handle.pending_read
        assert pending is not None  # only called for a handle of _start_alone
        if pending.ready is not None:
            pending.ready.synchronize()  # the step's one host sync (long done when a forward ran since)
        flat = pending.flat.tolist()
        src = handle.source
        status = pending.status(flat)
        if status:
            batch = src.batch_size
            self._report_bad_input([status], src.keys, pending.values, pending.lengths, batch, src.key_index)
        alone = pending.layout
        ids_per_slot = alone.ids_per_slot(flat)
        handle.received = (ids_per_slot,)
        handle.ids_per_slot = ids_per_slot
        handle.source = SourceContext(
            batch_size=src.batch_size,
            keys=src.keys,
            key_index=src.key_index,
            lengths=src.lengths,
            inverse_perm=src.inverse_perm,
            sorted_segment=src.sorted_segment,
            sent=(ids_per_slot,),
            ids_per_feature=alone.ids_per_feature(flat),
            sent_counts=src.sent_counts,
        )
        handle.pending_read = None

    def _alone_layout(self, keys: tuple[str, ...]) -> _AloneLayout:
        """What a group of one needs per input key order (cached): see :class:`_AloneLayout`."""
        cached = self._alone_cache.get(keys)
        if cached is None:
            if len(self._alone_cache) >= _MAX_CACHE:
                self._alone_cache.clear()
            layout = self.layout
            where = {k: i for i, k in enumerate(keys)}
            slot_keys = [where[k] for k in self.my_keys]
            slot_of_key = [0] * len(keys)
            for slot, key in enumerate(slot_keys):
                slot_of_key[key] = slot
            rows = [layout.tables[layout.feature_table[self.feature_index[k]]].num_embeddings for k in keys]
            dev = self.comm.device
            cached = _AloneLayout(
                rows=_on(rows, dev),
                same_rows=rows[0] if rows and rows.count(rows[0]) == len(rows) else None,
                order=None if slot_keys == list(range(len(keys))) else _on(slot_keys, dev),
                slot_of_key=_on(slot_of_key, dev),
                # The host read starts with the ids of input key 0, 1, ...; every feature is there (checked).
                ids_per_slot=_picker(slot_keys),
                ids_per_feature=_picker([where[f] for f in layout.features]),
            )
            self._alone_cache[keys] = cached
        return cached

    # -- helpers ---------------------------------------------------------------------------------
    def _check(self, features: Any) -> tuple[tuple[str, ...], Tensor, Tensor, Tensor | None, int]:
        """Host-side checks of the local batch; returns keys, int64 values, int64 lengths, weights, B."""
        try:
            if isinstance(features, VBEFeatures):  # its own tuples and tensors: no list copies
                keys, values, lengths = features._keys, features._values, features._lengths
                weights = features._weights
            else:
                keys = tuple(features.keys())
                values = features.values()
                lengths = features.lengths()
                weights = features.weights_or_none()
            batch = _uniform_batch_size(features)
            stride = None if batch is not None else features.stride_per_key_per_rank()
        except AttributeError as err:
            raise InvalidFeaturesError(
                f"`features` must be KeyedJaggedTensorLike (keys, values, lengths, weights_or_none, "
                f"stride_per_key_per_rank), got {type(features).__name__}: {err}"
            ) from err
        # O(F) with sets and dicts (no `in tuple` scans), and skipped entirely for a key order seen before.
        if keys not in self._key_cache:
            self._check_keys(keys)
        if stride is not None:
            if any(len(row) != 1 for row in stride) or len({row[0] for row in stride}) > 1:
                raise BatchLayoutError(
                    f"`features` must be a local batch with one batch size for every key "
                    f"(stride_per_key_per_rank [[B]] * F), got {stride}"
                )
            batch = int(stride[0][0]) if stride else 0
        assert batch is not None  # from the uniform stride or the check just above

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
        # `.to` only where it converts: a no-op `.to` still costs its argument parsing.
        if values.dtype != torch.int64:
            values = values.to(torch.int64)
        if lengths.dtype != torch.int64:
            lengths = lengths.to(torch.int64)
        return keys, values, lengths, weights, batch

    def _check_keys(self, keys: tuple[str, ...]) -> None:
        """Every key is served, none is missing, none repeats: O(F) set and dict work."""
        known = self.feature_index
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise UnknownFeatureError(
                f"`features` has key(s) {', '.join(f'`{k}`' for k in unknown)} that no table of the plan "
                f"serves (known features: {', '.join(self.layout.features)})"
            )
        given = set(keys)
        missing = [f for f in self.layout.features if f not in given]
        if missing:
            raise UnknownFeatureError(
                f"`features` lacks feature(s) {', '.join(f'`{k}`' for k in missing)} of the module's tables "
                f"(got keys: {', '.join(keys) or 'none'})"
            )
        if len(given) != len(keys):
            raise InvalidFeaturesError(f"`features` repeats keys: {list(keys)}")

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

    def _bucketize(self, g: Tensor, values: Tensor) -> Tensor:
        """``[N]`` flat shard index of every id (feature ``g``, row ``values``): one binary search each.

        Out-of-range ids land in some shard (they are reported through the header before any use).
        """
        global_row = self._feature_base[g] + values
        return (torch.searchsorted(self._bounds, global_row, right=True) - 1).clamp_(min=0)

    def _stride(self, batch_per_rank: tuple[int, ...], num_slots: int) -> tuple[tuple[int, ...], ...]:
        """``[S][W]`` VBE strides of the distributed features (cached per batch-size layout)."""
        cached = self._stride_cache.get(batch_per_rank)
        if cached is None:
            if len(self._stride_cache) >= _MAX_CACHE:
                self._stride_cache.clear()
            cached = (tuple(int(b) for b in batch_per_rank),) * num_slots
            self._stride_cache[batch_per_rank] = cached
        return cached

    def _recv_len_index(self, batch_per_rank: tuple[int, ...], batch_dev: Tensor) -> Tensor:
        """Gather index turning received lengths ``source → slot → sample`` into ``slot → source → sample``.

        Built once per batch-size layout, on the device from the received header (``batch_dev``: ``[W]``
        batch sizes), in O(S * W) device work and no host loop.
        """
        cached = self._recv_len_cache.get(batch_per_rank)
        if cached is None:
            if len(self._recv_len_cache) >= _MAX_CACHE:
                self._recv_len_cache.clear()
            num_slots = self.slot_counts[self.rank]
            total = num_slots * sum(batch_per_rank)
            cached = _segment_transpose(batch_dev[:, None].expand(self.world, num_slots), total)
            self._recv_len_cache[batch_per_rank] = cached
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

    def _check_steps(self, step: int, steps: list[int], skipped: list[int]) -> None:
        """Every rank at the same step, and no rank alone in skipping a backward; else raise everywhere.

        Each rank receives every rank's step and skip count, so all of them raise together, before any
        other collective. Every rank skipping (outputs of a grad-mode forward dropped everywhere, as in an
        evaluation without ``no_grad``) is consistent and no error: the owed collectives were exchanged
        as zeros on every rank and no table was updated.
        """
        if any(s != step for s in steps):
            raise CollectiveOrderError(
                f"rank {self.rank}: the ranks are at different steps of this module's input dist (step per "
                f"rank: {steps}; this rank: {step}); a rank called `forward`/`start_input_dist` more often "
                "than the others or skipped a step's `backward`, so the collectives no longer pair up"
            )
        if any(skipped) and not all(skipped):
            culprits = [r for r, n in enumerate(skipped) if n]
            what = (
                f"rank(s) {', '.join(map(str, culprits))} dropped the output of an earlier training step "
                "without running `backward` while the other ranks ran theirs; the skipped backward "
                "collectives were sent as zeros, so the other ranks' tables got no gradient from those "
                "ranks for that step. When training, every rank must run backward on a loss that depends "
                "on the module's output (or every rank runs the forward under `torch.no_grad()`)"
            )
            if self.rank in culprits:
                raise CollectiveOrderError(f"rank {self.rank}: {what}")
            raise PeerRankError(f"rank {self.rank}: {what}")

    def _report_bad_input(
        self,
        statuses: list[int],
        keys: tuple[str, ...],
        values: Tensor,
        lengths: Tensor,
        batch: int,
        key_index: Tensor,
    ) -> None:
        """Some rank's status is bad: describe this rank's problem (host syncs are fine here) and raise."""
        message = ""
        error: VBELookupError | None = None
        if statuses[self.rank] == _BAD_IDS:
            message = self._describe_bad_ids(keys, values, lengths, batch, key_index)
            error = IndexOutOfRangeError(message)
        elif statuses[self.rank] == _BAD_LENGTHS:
            low = int(lengths.min()) if lengths.numel() else 0
            message = (
                f"`lengths` of the local batch sum to {int(lengths.sum())} (min {low}) but `values` holds "
                f"{values.numel()} ids; expected non-negative lengths summing to the number of ids"
            )
            error = BatchLayoutError(message)
        self._raise_errors(statuses, message, error)

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


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Buckets:
    """The local ids bucketized by destination ``(rank, slot)``, in send order (all on the device).

    Attributes:
        send_values: ``[N]`` shard-local ids, rank → slot → (input order).
        send_weights: ``[N]`` their weights, or ``None``.
        send_lengths: ``[K * B]`` lengths of the ids sent, compact ``(rank, slot)`` → sample.
        counts: ``[W * S_max]`` ids sent per padded segment ``rank * S_max + slot``.
        inverse_perm: ``[N]`` position in the send order of each input id.
        sorted_segment: ``[N]`` padded segment of each id in send order.
        status: ``[]`` int64 status of the input (``_OK``, ``_BAD_IDS`` or ``_BAD_LENGTHS``).
    """

    send_values: Tensor
    send_weights: Tensor | None
    send_lengths: Tensor
    counts: Tensor
    inverse_perm: Tensor
    sorted_segment: Tensor
    status: Tensor


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _TableWiseLayout:
    """A table-wise plan's view of one input key order (every feature goes whole to one ``(rank, slot)``).

    Attributes:
        rows: ``[F_in]`` rows of each input key's table.
        key_of_compact: ``[K]`` the input key of each compact ``(rank, slot)``, in send order.
        compact_of_key: ``[F_in]`` the compact ``(rank, slot)`` of each input key.
        segment_of_compact: ``[K]`` padded segment ``rank * S_max + slot`` of each compact one.
        segment_of_key: ``[F_in]`` padded segment of each input key.
    """

    rows: Tensor
    key_of_compact: Tensor
    compact_of_key: Tensor
    segment_of_compact: Tensor
    segment_of_key: Tensor


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Outgoing:
    """What ``start`` built for the header exchange, kept for reading its answer (see ``_settle``).

    ``payload``, ``fits``, ``send_len``, ``send_ids`` and ``recv_caps`` are the CPU's: per peer, the int64
    elements of its lengths and ids, whether they fit its capacity, the two pieces themselves, and the
    receive capacities the exchange was launched with.
    """

    step: int
    keys: tuple[str, ...]
    values: Tensor
    lengths: Tensor
    weights: Tensor | None
    batch: int
    key_index: Tensor
    buckets: _Buckets
    header: Tensor
    counts: Tensor
    send_len_sizes: list[int]
    payload: list[int] = field(default_factory=list)
    fits: list[bool] = field(default_factory=list)
    send_len: tuple[Tensor, ...] = ()
    send_ids: tuple[Tensor, ...] = ()
    recv_caps: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _Deferred:
    """CPU: the header-and-payload all-to-all in flight, read by ``wait`` (a pipeline's start does not block).

    Attributes:
        received: Its receive buffer, per source rank ``header + capacity`` int64 elements.
        work: Its work handle.
        splits: The per-source sizes of ``received``.
        outgoing: What this rank sent, or ``None`` when its own input was rejected (``error``).
        error: This rank's own input error, raised by ``wait`` after every rank has read every status.
        step: This rank's input dist count at ``start``.
    """

    received: Tensor
    work: Any
    splits: list[int]
    outgoing: _Outgoing | None
    error: VBELookupError | None
    step: int


class _PayloadCaps:
    """Per peer rank, the payload capacity (int64 elements after the header) of the input dist's one
    all-to-all, in each direction. Both ends of a pair grow it from the same header values, so they agree
    without a collective of their own."""

    def __init__(self, world: int) -> None:
        self.send = [0] * world
        self.recv = [0] * world
        self._zeros = torch.zeros(0, dtype=torch.int64)

    def padding(self, size: int) -> Tensor:
        """``size`` int64 zeros (a view of one buffer kept for this)."""
        if size > self._zeros.numel():
            self._zeros = torch.zeros(_capacity(size), dtype=torch.int64)
        return self._zeros[:size]


def _capacity(size: int) -> int:
    """A capacity for ``size`` elements: a quarter more, rounded up to 256 (batch sizes and ids vary)."""
    return (size + size // 4 + 255) // 256 * 256


def _status(bad_lengths: Tensor, bad_ids: Tensor) -> Tensor:
    """Device-side status (no host sync, no host-to-device copy): bad lengths win over bad ids."""
    return torch.where(bad_lengths, _BAD_LENGTHS, torch.where(bad_ids, _BAD_IDS, _OK))


def _uniform_batch_size(features: Any) -> int | None:
    """The local batch size without building ``stride_per_key_per_rank()`` when the input says it is uniform.

    :class:`~vbe_lookup.VBEFeatures` keeps its strides as tuples; a torchrec ``KeyedJaggedTensor`` that
    is not variable-stride answers ``stride()`` (its strides would be rebuilt as lists on every call).
    ``None``: read and check ``stride_per_key_per_rank()``.
    """
    if isinstance(features, VBEFeatures):
        stride = features._stride
        # tuple.count compares rows in C: no Python loop per feature.
        if stride and len(stride[0]) == 1 and stride.count(stride[0]) == len(stride):
            return stride[0][0]
        return None
    variable = getattr(features, "variable_stride_per_key", None)
    if callable(variable) and not variable() and callable(getattr(features, "stride", None)):
        return int(features.stride())
    return None


def _segment_transpose(counts: Tensor, total: int) -> Tensor:
    """Gather index reordering segments from ``source → slot`` to ``slot → source`` (device, no sync).

    Args:
        counts: ``[W, S]`` int64 segment lengths, laid out source-major (row ``w`` is source ``w``).
        total: ``counts.sum()``, known on the host.

    Returns:
        ``[total]`` int64: position in the source-major buffer of each element of the slot-major one.
    """
    flat = counts.reshape(-1)
    src_start = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().reshape(-1)
    seg_len = counts.t().reshape(-1)
    dst_start = torch.cumsum(seg_len, 0) - seg_len
    index = torch.repeat_interleave(src_start - dst_start, seg_len, output_size=total)
    return index + torch.arange(total, device=counts.device)


def _describe(obj: object) -> str:
    if isinstance(obj, Tensor):
        return f"{obj.dtype} tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__


_Reader = Callable[[list[int]], tuple[int, ...]]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class _AloneLayout:
    """A group of one's view of one input key order.

    Attributes:
        rows: ``[F_in]`` rows of each input key's table (device).
        same_rows: The rows of every input key's table when they all have as many (the id range check is
            then the largest id against it, no per-id key), else ``None``.
        order: ``[S]`` the input key of each slot (device); ``None`` when the input is in slot order.
        slot_of_key: ``[F_in]`` the slot of each input key (device).
        ids_per_slot: picks the ids per slot out of the host read.
        ids_per_feature: picks the ids per global feature out of the host read.
    """

    rows: Tensor
    same_rows: int | None
    order: Tensor | None
    slot_of_key: Tensor
    ids_per_slot: _Reader
    ids_per_feature: _Reader


def _picker(positions: list[int]) -> _Reader:
    """``values -> tuple(values[p] for p in positions)``, in C (``operator.itemgetter``)."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        only = positions[0]
        return lambda values: (values[only],)
    getter = operator.itemgetter(*positions)
    return lambda values: tuple(getter(values))


def _on(values: list[int] | tuple[int, ...], device: torch.device) -> Tensor:
    """A small int64 index on ``device`` (built on the host once per layout, then cached by the caller)."""
    return torch.tensor(values, dtype=torch.int64).to(device)
