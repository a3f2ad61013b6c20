"""Run a function on ``N`` gloo processes on this machine (for tests and quick checks), bounded by a timeout.

``run_world(fn, world_size, args, timeout_s)`` spawns ``world_size`` processes, each of which initialises a gloo
process group on a free local port and calls ``fn(rank, world_size, *args)``; the return value of each rank is
pickled back. A rank that raises makes the call raise with that rank's traceback; a world that does not finish
within ``timeout_s`` is killed and ``TimeoutError`` is raised: a test never hangs.
"""

from __future__ import annotations

import datetime as dt
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

__all__ = ["free_port", "run_world", "train_configs"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: str,
    collective_timeout_s: float,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=dt.timedelta(seconds=collective_timeout_s)
        )
        try:
            outcome = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, which raises it
        outcome = ("error", traceback.format_exc())
    with open(Path(results) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(outcome, handle)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its own process.

    ``fn`` must be importable by module name (spawned processes unpickle it). A world whose rendezvous port
    was taken by another process in the meantime is started again on a new port (up to 3 times).

    Raises:
        RuntimeError: a rank raised (the message holds its traceback).
        TimeoutError: the world did not finish within ``timeout_s`` (its processes are killed).
    """
    for attempt in range(3):
        try:
            return _run_world_once(fn, world_size, args, timeout_s, collective_timeout_s)
        except RuntimeError as exc:  # noqa: PERF203 (a retry loop: the exception is the point)
            if attempt == 2 or "address already in use" not in str(exc).lower():
                raise
    raise AssertionError("unreachable")


def _run_world_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout_s: float,
    collective_timeout_s: float,
) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="dlrm-world-") as results:
        context = start_processes(  # type: ignore[no-untyped-call]  # unannotated in torch
            _entry,
            args=(world_size, free_port(), fn, tuple(args), results, collective_timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size}-process world did not finish within {timeout_s:.0f} s")
        except (ProcessRaisedException, ProcessExitedException) as exc:
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        out: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(results) / f"rank{rank}.pkl"
            if not path.is_file():
                errors.append(f"rank {rank} wrote no result")
                continue
            with open(path, "rb") as handle:
                status, value = pickle.load(handle)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            out.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return out


def train_configs(rank: int, world_size: int, configs: Sequence[Any]) -> list[Any]:
    """Train each :class:`~examples.dlrm.train.TrainConfig` in turn on this rank (a ``run_world`` target).

    Returns one :class:`~examples.dlrm.train.TrainResult` per config, with the key-value rows included.
    """
    from examples.dlrm.train import train

    return [train(config, rank=rank, world_size=world_size, collect_kv_rows=True) for config in configs]
