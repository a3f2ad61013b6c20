"""Every environment variable ``ssd_tbe_adapter`` reads, in one place (listed in the README).

Nothing else in the package touches ``os.environ``: a module asks its :class:`EnvVar` here, at the moment it
needs the value (a test checks both, and that the README names every variable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DISABLE_FBGEMM", "ENV_VARS", "EnvVar"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvVar:
    """One environment variable: its name, the value used when it is unset, and what it does."""

    name: str
    default: str
    meaning: str

    def get(self) -> str:
        """The current value (read now, not cached), stripped; ``default`` when unset or empty."""
        return os.environ.get(self.name, "").strip() or self.default


DISABLE_FBGEMM = EnvVar(
    name="SSD_TBE_ADAPTER_DISABLE_FBGEMM",
    default="",
    meaning="`1`: never import fbgemm-gpu (the benchmark drops its fbgemm TBE baseline, the mixed TBE test "
    "skips); read once, at the first fbgemm question.",
)

ENV_VARS = (DISABLE_FBGEMM,)
