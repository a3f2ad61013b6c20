"""Victim choice of the device cache: each missing row gets the best slot of a small group of its table's
slots, with work proportional to the batch, not to the cache.

Table ``t`` owns the slots ``[base_t, base_t + C_t)`` as a ring with a hand. A batch's ``m_t`` misses of that
table, ranked ``r = 0 .. m_t - 1``, look at disjoint groups of ``K_t = min(GROUP, C_t // m_t)`` consecutive
slots after the hand (miss ``r``: ring positions ``hand_t + r K_t + j``, ``j < K_t``); each takes the group's
lowest-priority slot that is not protected, and the hand moves past the groups. Priority as an aged LFU: free
slots first, then fewest uses, then least recently used (``(uses, last tick)``); protected: used at or after
the ``protect`` tick (rows of batches in flight) or held by this batch's hits. The misses whose group had
nothing to give (every slot protected) then take the table's other choosable slots in slot order (one running
count over the regions, no sort), so a miss goes to the scratch pool only when its table has fewer choosable
slots than misses, as with an exact choice.

So a miss costs ``K_t`` reads plus elementwise work over the slots: a sampled LFU (as Redis's sampled LRU), which keeps the hot rows
(a group holds a hot row's slot only when all ``K_t`` are hotter), and exact when one group covers the region
(a batch that misses fewer than ``C_t / GROUP`` rows of a table with ``C_t <= GROUP`` slots). The groups are
disjoint, so the misses choose in parallel: one Triton launch on CUDA, the same choice in torch ops elsewhere.
"""

from __future__ import annotations

import torch

from ssd_tbe_adapter._row_moves import moves_on_device

__all__ = ["GROUP", "VictimTables", "choose_victims"]

GROUP = 16  # the widest group a miss looks at
TICK_BITS = 40  # last-use ticks stay far below 2**40
MAX_USES = (1 << 20) - 1
NEVER = 1 << 62  # priority of a protected slot (never a victim): above every (uses, tick) key


class VictimTables:
    """The per-table ring state on ``device``: ``bases``, ``capacities`` (int64 ``[T]``) and the hands."""

    def __init__(self, capacities: list[int], device: torch.device) -> None:
        self.bases = torch.tensor(
            [sum(capacities[:t]) for t in range(len(capacities))], dtype=torch.int64, device=device
        )
        self.capacities = torch.tensor(capacities, dtype=torch.int64, device=device)
        self.ends = self.bases + self.capacities
        self.region = sum(capacities)
        self.hands = torch.zeros(len(capacities), dtype=torch.int64, device=device)


def choose_victims(
    rings: VictimTables,
    tables: torch.Tensor,
    miss: torch.Tensor,
    protect: torch.Tensor,
    stamp: torch.Tensor,
    uses: torch.Tensor,
    valid: torch.Tensor,
    held: torch.Tensor,
    trash: int,
) -> torch.Tensor:
    """The region slot each miss takes (``[N]`` int64, ``-1``: none, the scratch pool's), advancing the hands.

    ``tables``: ``[N]`` ascending (a survey's unique pairs), ``miss``: ``[N]`` bool, ``protect``: 0-dim int64,
    ``stamp``/``uses``/``valid``/``held``: per slot ``[S + 1]`` (``held``: this batch's hits). No sync, fixed
    shapes: capturable."""
    n, device = tables.numel(), tables.device
    count = rings.capacities.numel()
    # Misses per table from the running miss count at each table's first pair (pairs sorted by table).
    before = torch.zeros(n + 1, dtype=torch.int64, device=device)
    before[1:] = torch.cumsum(miss, 0)
    first_of_table = torch.searchsorted(tables, torch.arange(count + 1, device=device))
    misses_before = before.index_select(0, first_of_table)
    per_table = misses_before[1:] - misses_before[:-1]
    width = (rings.capacities // per_table.clamp(min=1)).clamp_(1, GROUP)
    ring = rings.capacities.clamp(min=1)
    rank = before[:-1] - misses_before.index_select(0, tables)  # of each miss within its table
    width_of = width.index_select(0, tables)
    grouped = miss & ((rank + 1) * width_of <= rings.capacities.index_select(0, tables))
    first = rings.hands.index_select(0, tables) + rank * width_of
    if device.type == "cuda" and moves_on_device(device):  # Triton importable
        from ssd_tbe_adapter._victims_kernel import pick

        chosen = pick(first, width_of, grouped, tables, rings, stamp, uses, valid, held, protect)
    else:
        chosen = _pick(first, width_of, grouped, tables, rings, stamp, uses, valid, held, protect, trash)
    rings.hands.copy_((rings.hands + per_table * width) % ring)
    return _second_chance(rings, chosen, tables, miss, first_of_table, protect, stamp, held, trash)


def _second_chance(
    rings: VictimTables,
    chosen: torch.Tensor,
    tables: torch.Tensor,
    miss: torch.Tensor,
    first_of_table: torch.Tensor,
    protect: torch.Tensor,
    stamp: torch.Tensor,
    held: torch.Tensor,
    trash: int,
) -> torch.Tensor:
    """``chosen`` with the misses that got nothing placed in their table's choosable slots that no miss took,
    in slot order: the ``q``-th such miss of table ``t`` takes the ``q``-th such slot of its region, if any."""
    n, region, device = tables.numel(), rings.region, tables.device
    failed = miss & (chosen < 0)
    taken = torch.zeros(stamp.numel(), dtype=torch.bool, device=device)
    taken.index_fill_(0, torch.where(chosen >= 0, chosen, trash), True)
    left = (stamp[:region] < protect) & ~held[:region] & ~taken[:region]
    running = torch.zeros(region + 1, dtype=torch.int64, device=device)
    running[1:] = torch.cumsum(left, 0)
    before = torch.zeros(n + 1, dtype=torch.int64, device=device)
    before[1:] = torch.cumsum(failed, 0)
    rank = before[:-1] - before.index_select(0, first_of_table).index_select(0, tables)
    start = running.index_select(0, rings.bases)
    room = running.index_select(0, rings.ends) - start
    placed = failed & (rank < room.index_select(0, tables))
    # The first running count past start + rank is one past the slot that holds it.
    slot = torch.searchsorted(running, start.index_select(0, tables) + rank + 1) - 1
    return torch.where(placed, slot, chosen)


def _pick(
    first: torch.Tensor,
    width: torch.Tensor,
    grouped: torch.Tensor,
    tables: torch.Tensor,
    rings: VictimTables,
    stamp: torch.Tensor,
    uses: torch.Tensor,
    valid: torch.Tensor,
    held: torch.Tensor,
    protect: torch.Tensor,
    trash: int,
) -> torch.Tensor:
    """:func:`choose_victims`'s groups in torch ops (``[N, GROUP]``): the first lowest-priority choosable slot."""
    offsets = torch.arange(GROUP, device=first.device)
    ring = rings.capacities.clamp(min=1).index_select(0, tables)
    position = (first[:, None] + offsets) % ring[:, None]
    live = grouped[:, None] & (offsets < width[:, None])
    slot = torch.where(live, rings.bases.index_select(0, tables)[:, None] + position, trash)
    last = stamp[slot]
    key = torch.where(valid[slot], (uses[slot].clamp(max=MAX_USES) << TICK_BITS) + last, -1)
    key = torch.where(live & (last < protect) & ~held[slot], key, NEVER)
    best, at = key.min(1)
    return torch.where(best < NEVER, slot.gather(1, at[:, None])[:, 0], -1)
