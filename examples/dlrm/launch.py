"""The main job: ``python -m examples.dlrm.launch`` trains the DLRM on 2 processes (CPU, gloo) via torchrun.

It names a run folder (``runs/dlrm-<UTC timestamp>`` unless ``--out`` is given), then starts
``torchrun --standalone --nproc-per-node N -m examples.dlrm.train --out <folder> ...`` through
``torch.distributed.run`` in this process. Arguments it does not know go to the workers
(``python -m examples.dlrm.train --help`` lists them). ``--resume <folder>`` continues a run from its checkpoint.
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
    args, worker_args = parser.parse_known_args(argv)
    if args.resume is not None:
        out = args.resume
        if not (out / "checkpoint").is_dir():
            parser.error(f"`--resume` names {out}, which has no checkpoint/ folder")
        worker_args = [*worker_args, "--resume"]
    else:
        out = args.out if args.out is not None else run_folder(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    print(f"run folder: {out}", file=sys.stderr)

    # One intra-op thread per worker: the workers share the machine's cores.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    from torch.distributed import run as torchrun

    start = time.perf_counter()
    torchrun.main(
        [
            "--standalone",
            "--nproc-per-node",
            str(args.nproc_per_node),
            "-m",
            "examples.dlrm.train",
            "--out",
            str(out),
            *worker_args,
        ]
    )
    print(f"main job finished in {time.perf_counter() - start:.1f} s; outputs in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
