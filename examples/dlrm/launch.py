"""The main job: ``python -m examples.dlrm.launch`` trains the DLRM on 2 processes (CPU, gloo) via torchrun.

It names a run folder (``runs/dlrm-<UTC timestamp>`` unless ``--out`` is given), checks the workers' options
(a bad flag is one ``error:`` line, before any process starts), then starts
``torchrun --standalone --nproc-per-node N -m examples.dlrm.train --out <folder> ...`` through
``torch.distributed.run`` in this process. Arguments it does not know go to the workers
(``python -m examples.dlrm.train --help`` lists them). ``--resume <folder>`` continues a run from its checkpoint
(on any number of processes).

Several hosts: run the same command on every host with ``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` (one
host's address, the same on all) and a shared ``--out`` folder; the c10d rendezvous (``--rdzv-backend c10d``)
then forms one world of all hosts' processes instead of ``--standalone``'s single host.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "run_folder"]


def run_folder(root: Path) -> Path:
    """A new, not yet existing folder ``root/dlrm-YYYYmmdd-HHMMSS`` (suffixed when that name is taken)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    candidate = root / f"dlrm-{stamp}"
    n = 1
    while candidate.exists():
        n += 1
        candidate = root / f"dlrm-{stamp}-{n}"
    return candidate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.dlrm.launch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--nproc-per-node", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default runs/dlrm-<timestamp>)")
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="where new run folders go")
    parser.add_argument("--resume", type=Path, default=None, help="continue the run in this folder")
    parser.add_argument(
        "--nnodes", default=None, help="hosts, e.g. 2 or 1:2 (with --rdzv-endpoint; default: this host only)"
    )
    parser.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (several hosts)"
    )
    parser.add_argument("--rdzv-id", default="dlrm", help="rendezvous id: the same on every host of one job")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts of a failed world")
    args, worker_args = parser.parse_known_args(argv)
    if args.resume is not None:
        out = args.resume
        worker_args = [*worker_args, "--resume"]
    else:
        out = args.out if args.out is not None else run_folder(args.runs)
    if (args.nnodes is None) != (args.rdzv_endpoint is None):
        parser.error("`--nnodes` and `--rdzv-endpoint` go together (several hosts need both)")

    from examples.dlrm.errors import DLRMError
    from examples.dlrm.train import parse_args, validate

    try:
        validate(parse_args(["--out", str(out), *worker_args]))
    except DLRMError as error:
        parser.exit(2, f"error: {error}\n")
    out.mkdir(parents=True, exist_ok=True)
    print(f"run folder: {out}", file=sys.stderr)

    # One intra-op thread per worker: the workers share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    start = time.perf_counter()
    if args.rdzv_endpoint is None:
        rendezvous = ["--standalone"]
    else:
        rendezvous = [
            "--nnodes",
            str(args.nnodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            args.rdzv_endpoint,
            "--rdzv-id",
            args.rdzv_id,
        ]
    try:
        torchrun.main(
            [
                *rendezvous,
                "--nproc-per-node",
                str(args.nproc_per_node),
                "--max-restarts",
                str(args.max_restarts),
                "-m",
                "examples.dlrm.train",
                "--out",
                str(out),
                *worker_args,
            ]
        )
    except ChildFailedError as error:
        # torchrun has already shown the failing rank's traceback (and its @record error file): one line here.
        first = min(error.failures)
        failure = error.failures[first]
        print(
            f"error: worker rank {first} failed with exit code {failure.exitcode}; see above", file=sys.stderr
        )
        return 1
    print(f"main job finished in {time.perf_counter() - start:.1f} s; outputs in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
