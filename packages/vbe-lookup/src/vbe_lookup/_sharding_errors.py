"""Errors of the sharded modules; all derive from :class:`vbe_lookup.errors.VBELookupError`."""

from __future__ import annotations

from vbe_lookup.errors import VBELookupError

__all__ = [
    "CollectiveOrderError",
    "CollectiveTimeoutError",
    "PeerRankError",
    "ShardingPlanError",
    "UnknownFeatureError",
]


class ShardingPlanError(VBELookupError, ValueError):
    """The tables, the plan and the process group do not fit together (checked at construction)."""


class UnknownFeatureError(VBELookupError, KeyError):
    """The input names a feature that no table of the plan serves, or lacks one the module needs."""

    def __str__(self) -> str:
        # KeyError quotes its argument; show the sentence as written.
        return str(self.args[0]) if self.args else ""


class PeerRankError(VBELookupError, RuntimeError):
    """Another rank rejected its input or plan; raised on every rank so that no rank waits forever."""


class CollectiveTimeoutError(VBELookupError, TimeoutError):
    """A collective did not complete within the module's ``timeout`` (a peer is stuck, gone or desynced)."""


class CollectiveOrderError(VBELookupError, RuntimeError):
    """The ranks are out of step: one skipped a training step's ``backward`` or called ``forward`` more often.

    Detected through the step number every rank sends in the input dist's header (and, for a skipped
    backward, on the rank that skipped it), so that no collective pairs with the wrong one on a peer.
    """
