"""Triton kernels of the hits-only survey (CUDA only, imported lazily): a batch's distinct slots, where each
lookup's slot sits among them, and the stamps and use counts of its rows, in four launches around one sort and
one scan.

The torch version (:meth:`DeviceCache._hit_survey` elsewhere) takes about 35 launches for the same: each of
them a few microseconds of a GPU that the step's own graph is using at the same time (a trace of the DLRM
trainer's key-value step showed the survey at ~65 launches on the prefetch stream, most of them these).

Every output is written into one ``[5N]`` int64 buffer in :attr:`Assignment.packed`'s layout (the touched slots,
each lookup's slot, the inverse, the order, the pairs, at ``k * N``), so no ``cat`` packs them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["HitRuns", "hit_runs"]

_BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _keys_kernel(found, keys, slots, trash, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Each lookup's slot, the trash slot where it missed: int64 (packed) and int32 (the sort's keys)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    found_slot = tl.load(found + i, mask=live, other=0)
    slot = tl.where(found_slot >= 0, found_slot, trash)
    tl.store(slots + i, slot, mask=live)
    tl.store(keys + i, slot.to(tl.int32), mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def _first_kernel(sorted_keys, first, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """1 where a sorted position starts a run of equal keys, else 0 (the keys are >= 0)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    key = tl.load(sorted_keys + i, mask=live, other=0)
    previous = tl.load(sorted_keys + i - 1, mask=live & (i > 0), other=-1)
    tl.store(first + i, (key != previous).to(tl.int64), mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def _runs_kernel(  # type: ignore[no-untyped-def]
    sorted_keys, order, pairs, inverse, starts, ends, n, BLOCK: tl.constexpr
):
    """``pairs`` (the inclusive scan of the run starts) made each sorted position's run; each lookup's run; each
    run's first sorted position and one past its last."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    key = tl.load(sorted_keys + i, mask=live, other=0)
    previous = tl.load(sorted_keys + i - 1, mask=live & (i > 0), other=-1)
    following = tl.load(sorted_keys + i + 1, mask=live & (i + 1 < n), other=-1)
    run = tl.load(pairs + i, mask=live, other=1) - 1
    tl.store(pairs + i, run, mask=live)
    lookup = tl.load(order + i, mask=live, other=0)
    tl.store(inverse + lookup, run, mask=live)
    tl.store(starts + run, i, mask=live & (key != previous))
    tl.store(ends + run, i + 1, mask=live & (key != following))


@triton.jit  # type: ignore[untyped-decorator]
def _tail_kernel(  # type: ignore[no-untyped-def]
    sorted_keys,
    starts,
    ends,
    pairs,
    inverse,
    scalars,
    padding_at,
    tick_at,
    stamp,
    uses,
    counts,
    unique_slots,
    touched,
    totals,
    trash,
    n,
    BLOCK: tl.constexpr,
):
    """Per run: its slot, its lookups (less the padding's repeats of the first lookup), and, when no lookup
    missed, its row stamped with the tick and its uses counted; past the runs, the last run's slot, 0 and
    the trash slot. ``totals``: the runs and whether any lookup missed (0 or 1)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = r < n
    runs = tl.load(pairs + n - 1) + 1
    last = tl.load(sorted_keys + n - 1).to(tl.int64)
    hits_all = last != trash  # the trash slot sorts above every slot
    padding_run = tl.load(inverse)
    padding = tl.load(scalars + padding_at)
    tick = tl.load(scalars + tick_at)
    live = in_range & (r < runs)
    start = tl.load(starts + r, mask=live, other=0)
    end = tl.load(ends + r, mask=live, other=0)
    slot = tl.where(live, tl.load(sorted_keys + start, mask=live, other=0).to(tl.int64), last)
    count = tl.where(live, end - start + tl.where(r == padding_run, padding, 0), 0)
    tl.store(counts + r, count, mask=in_range)
    tl.store(unique_slots + r, slot, mask=in_range)
    tl.store(touched + r, tl.where(live, slot, trash), mask=in_range)
    update = live & hits_all
    used = tl.load(uses + slot, mask=update, other=0)
    tl.store(uses + slot, used + count, mask=update)
    tl.store(stamp + slot, tl.zeros_like(slot) + tick, mask=update)
    two = tl.arange(0, 2)
    missed = tl.where(hits_all, 0, 1).to(tl.int64)
    tl.store(totals + two, tl.where(two == 0, runs, missed), mask=(two >= 0) & (tl.program_id(0) == 0))


@dataclass(frozen=True, slots=True)
class HitRuns:
    """What :func:`hit_runs` found over ``N`` lookups (device tensors; ``[N]`` unless said)."""

    packed: torch.Tensor  # [5N]: touched, slots, inverse, order, pairs at k * N (Assignment.packed's layout)
    counts: torch.Tensor  # lookups per run (the padding's repeats not counted), 0 past the runs
    unique_slots: torch.Tensor  # each run's slot, ascending; past the runs the last run's
    unique: torch.Tensor  # 0-dim: the runs
    misses: torch.Tensor  # 0-dim: 1 if any lookup missed, else 0

    @property
    def touched(self) -> torch.Tensor:
        """Each run's slot, the trash slot past the runs."""
        return self._field(0)

    @property
    def inverse(self) -> torch.Tensor:
        """Each lookup's run."""
        return self._field(2)

    @property
    def order(self) -> torch.Tensor:
        """The lookups sorted by slot (stable)."""
        return self._field(3)

    @property
    def pairs(self) -> torch.Tensor:
        """Each sorted position's run (ascending)."""
        return self._field(4)

    def _field(self, k: int) -> torch.Tensor:
        n = self.counts.numel()
        return self.packed[k * n : (k + 1) * n]


def hit_runs(
    found: torch.Tensor,
    trash: int,
    scalars: torch.Tensor,
    padding_at: int,
    tick_at: int,
    stamp: torch.Tensor,
    uses: torch.Tensor,
) -> HitRuns:
    """The runs of equal slots of ``N > 0`` lookups (``found``: ``[N]`` int64, each lookup's slot or ``-1``
    where it missed, which then takes the ``trash`` slot, ``0 <= slot <= trash < 2**31``): as
    ``_unique_slots`` and ``_runs`` in :mod:`~ssd_tbe_adapter._device_cache` (one stable sort of int32 keys),
    the padding's repeats of the first lookup taken off its run's count (``scalars[0, padding_at]``, minus
    their number). When no lookup missed, each run's row in ``stamp`` (``[S + 1]`` int64) takes the tick
    ``scalars[0, tick_at]`` and its ``uses`` grow by its count; with a miss neither changes. No sync;
    capturable."""
    n = found.numel()
    device = found.device
    grid = (triton.cdiv(n, _BLOCK),)
    packed = torch.empty(5 * n, dtype=torch.int64, device=device)
    touched, slots, inverse, order, pairs = packed.view(5, n).unbind(0)
    keys = torch.empty(n, dtype=torch.int32, device=device)
    _keys_kernel[grid](found, keys, slots, trash, n, BLOCK=_BLOCK)
    sorted_keys = torch.empty_like(keys)
    torch.sort(keys, stable=True, out=(sorted_keys, order))
    first = torch.empty(n, dtype=torch.int64, device=device)
    _first_kernel[grid](sorted_keys, first, n, BLOCK=_BLOCK)
    torch.cumsum(first, 0, out=pairs)
    starts = torch.empty(n, dtype=torch.int64, device=device)
    ends = torch.empty(n, dtype=torch.int64, device=device)
    _runs_kernel[grid](sorted_keys, order, pairs, inverse, starts, ends, n, BLOCK=_BLOCK)
    counts = torch.empty(n, dtype=torch.int64, device=device)
    unique_slots = torch.empty(n, dtype=torch.int64, device=device)
    totals = torch.empty(2, dtype=torch.int64, device=device)
    _tail_kernel[grid](
        sorted_keys,
        starts,
        ends,
        pairs,
        inverse,
        scalars,
        padding_at,
        tick_at,
        stamp,
        uses,
        counts,
        unique_slots,
        touched,
        totals,
        trash,
        n,
        BLOCK=_BLOCK,
    )
    return HitRuns(
        packed=packed, counts=counts, unique_slots=unique_slots, unique=totals[0], misses=totals[1]
    )
