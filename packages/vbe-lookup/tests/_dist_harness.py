"""Multi-process test harness: spawn ``world_size`` ranks with a process group, bounded in time.

Workers live in importable modules (this folder is put on ``sys.path``; spawned children inherit it), run
with one thread each, and return picklable results through a queue. A run that exceeds its deadline is
killed and reported as a failure, never left hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def require_no_process_group() -> None:
    """Fail (not skip) when a process group is already initialized here: an earlier test leaked it."""
    import pytest

    if dist.is_initialized():
        pytest.fail(
            "a process group leaked from an earlier test in this process (each test that creates one destroys it)"
        )


@contextlib.contextmanager
def one_rank_gloo() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    require_no_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 150.0,
    pg_timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return each rank's result.

    A port taken by another process between :func:`free_port` and the store's bind is retried once
    with a new port.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or the run exceeded ``timeout_s``.
    """
    try:
        return _run_once(fn, world_size, args, backend, timeout_s, pg_timeout_s)
    except AssertionError as err:
        if "address already in use" not in str(err).lower():
            raise
    return _run_once(fn, world_size, args, backend, timeout_s, pg_timeout_s)


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    backend: str,
    timeout_s: float,
    pg_timeout_s: float,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]  # untyped, not re-exported
        _entry,
        args=(fn, world_size, port, backend, pg_timeout_s, results, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    collected: dict[int, tuple[str, Any]] = {}
    try:
        while len(collected) < world_size:
            while not results.empty():
                rank, status, value = results.get()
                collected[rank] = (status, value)
            if len(collected) == world_size:
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"distributed run of {fn.__name__} exceeded {timeout_s:.0f}s; ranks done: {sorted(collected)}"
                )
            if all(not p.is_alive() for p in procs.processes):
                time.sleep(0.5)  # let the last results arrive through the pipe
                if results.empty():
                    codes = [p.exitcode for p in procs.processes]
                    raise AssertionError(f"ranks exited without a result (exit codes {codes})")
            time.sleep(0.05)
    finally:
        for p in procs.processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if p.is_alive() else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [collected[r][1] for r in range(world_size)]
