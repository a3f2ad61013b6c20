"""Two real gloo processes: sparse data dist + prefetch stages, and uneven exhaustion (bounded by a timeout)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_dist_workers.py")
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def launch(tmp_path: Path, world: int = 2) -> list[dict[str, Any]]:
    """Run WORLD worker processes; kill them all and fail if they do not finish within TIMEOUT_S."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), str(world), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"the workers did not finish within {TIMEOUT_S} s (hang)")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} failed:\n{outputs[rank]}"
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch of 2 gloo processes runs every scenario (process start-up dominates on small machines)."""
    return launch(tmp_path_factory.mktemp("dist"))


@pytest.mark.distributed
def test_sparse_dist_and_prefetch_stages_with_real_all_to_all(results: list[dict[str, Any]]) -> None:
    """Each forward uses its own batch's all-to-all'd ids (prefetched first); outputs match the full table."""
    for rank, result in enumerate(r["sdd"] for r in results):
        assert result["seen"] == list(range(7)), rank
        assert result["correct"], rank
        assert result["starts"] == 7, rank  # one input dist per batch, none from the forward itself
        assert result["plain_forwards"] == 0, rank
        assert result["prefetched_batches"] == 7, rank
        assert result["in_flight"] == 0, rank


@pytest.mark.distributed
def test_uneven_exhaustion_stops_all_ranks_at_the_same_step(results: list[dict[str, Any]]) -> None:
    """Rank 0 has 5 batches, rank 1 has 3: with an exhaustion group both stop after 3, no hang."""
    uneven = [r["uneven"] for r in results]
    assert uneven[0]["seen"] == [0, 1, 2]
    assert uneven[1]["seen"] == [0, 1, 2]
    assert all(result["correct"] for result in uneven)
    assert all(result["plain_forwards"] == 0 for result in uneven)
    assert all(result["in_flight"] == 0 for result in uneven)
