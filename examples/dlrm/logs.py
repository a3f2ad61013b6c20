"""What a run tells while it trains: rank-aware ``logging``, a tqdm progress bar and a metrics stream.

- :func:`setup_logging`: one handler on stderr whose lines carry the rank (``[rank 1]``); ranks other than 0
  log warnings and errors only, unless ``all_ranks``.
- :class:`MetricsWriter` (rank 0): one JSON object per line in ``metrics.jsonl`` for every training step
  (``{"kind": "train", "step", "loss", "samples", "step_seconds", "qps", "phase_ms", "kv_hit_rate",
  "kv_forward_hit_rate"}``; hit rates over all ranks since the start) and every evaluation (``{"kind": "eval", "step", "auc", "ne", "loss", "ctr",
  "samples"}``); the same scalars go to TensorBoard event files under ``tensorboard/`` when the
  ``tensorboard`` package is installed (optional: ``pip install tensorboard``).
- :func:`progress_bar`: a tqdm bar on rank 0 with the running loss, QPS and the last eval AUC.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["MetricsWriter", "progress_bar", "setup_logging"]

LOGGER_NAME = "examples.dlrm"


def setup_logging(rank: int, *, level: int = logging.INFO, all_ranks: bool = False) -> logging.Logger:
    """Configure the ``examples.dlrm`` logger for this rank and return it (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        if getattr(handler, "_dlrm", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._dlrm = True  # type: ignore[attr-defined]  # marks our handler so a second call replaces it
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 or all_ranks else max(level, logging.WARNING))
    logger.propagate = False
    return logger


def _finite(value: Any) -> Any:
    """JSON has no NaN: NaN and infinities become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


class MetricsWriter:
    """Appends metric records to ``path`` (JSON lines) and, when available, to TensorBoard.

    Args:
        path: the JSON-lines file (appended to: a resumed run continues the same file).
        tensorboard_dir: folder of the TensorBoard event files; None: no TensorBoard.
        enabled: False on ranks other than 0 (they write nothing).
    """

    def __init__(self, path: Path, *, tensorboard_dir: Path | None = None, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self._file = path.open("a", encoding="utf-8") if enabled else None
        self._tb: Any = None
        if enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is an optional extra
                self._tb = None
            else:
                self._tb = SummaryWriter(log_dir=str(tensorboard_dir))

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are written."""
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (``kind`` and ``step`` keys plus scalars or dicts of scalars)."""
        if self._file is None:
            return
        self._file.write(json.dumps(_finite(record), sort_keys=True) + "\n")
        if self._tb is not None:
            step = int(record["step"])
            prefix = str(record.get("kind", "train"))
            for key, value in record.items():
                if key in ("kind", "step"):
                    continue
                if isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            self._tb.add_scalar(f"{prefix}/{key}/{sub}", v, step)
                elif isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)

    def flush(self) -> None:
        """Make the records written so far visible to readers."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the file (and the TensorBoard writer)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _NoBar:
    """The part of tqdm's interface the trainer uses, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, postfix: dict[str, str], refresh: bool = True) -> None:
        del postfix, refresh

    def close(self) -> None:
        """Nothing to close."""


def progress_bar(total: int, initial: int, *, enabled: bool) -> Any:
    """A tqdm bar over the training steps on stderr (``disable`` on ranks other than 0; tqdm is unannotated).

    Without tqdm (a bare GPU image) a bar that shows nothing: the per-step metrics still go to metrics.jsonl.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        logging.getLogger(LOGGER_NAME).warning("tqdm is not installed: no progress bar")
        return _NoBar()
    return tqdm(
        total=total,
        initial=initial,
        disable=not enabled,
        desc="train",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
    )
