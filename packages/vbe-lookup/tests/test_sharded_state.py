"""``sharded_state_dict()`` with torch.distributed.checkpoint: saved by 2 ranks, loaded by 3 under another plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import _sharded_state_workers


@pytest.mark.distributed
def test_dcp_checkpoint_of_two_ranks_reshards_onto_three(tmp_path: Path) -> None:
    """Table-wise and row-wise shards (weights and row-wise Adagrad momenta) saved by a 2-rank subgroup load
    bit-exactly into a 3-rank plan that moves tables and splits the row-wise table over other ranks."""
    reports = _dist_harness.run_ranks(
        _sharded_state_workers.save_on_two_load_on_three, 3, str(tmp_path / "ckpt"), timeout_s=240
    )
    assert [r["mismatched"] for r in reports] == [[], [], []]
    assert reports[0]["saved_keys"] == []  # rank 0 was not in the saving group
    saved = set(reports[1]["saved_keys"]) | set(reports[2]["saved_keys"])
    assert {"t2.weight", "t2.momentum"} <= set(reports[1]["saved_keys"]) & set(reports[2]["saved_keys"])
    assert saved == {f"t{i}.{k}" for i in range(4) for k in ("weight", "momentum")}
    assert set(reports[1]["loaded_keys"]) == set()  # the 3-rank plan gives rank 1 no table
