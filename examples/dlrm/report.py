"""What the trainer shows: a progress bar on stderr, a summary table, and a PNG plot of loss and QPS."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

__all__ = ["ProgressBar", "format_table", "plot_history", "smooth"]


class ProgressBar:
    """A one-line progress bar with the running loss and QPS (plain text: no dependency on tqdm).

    On a terminal the line is redrawn in place; otherwise (a log file, CI) one line is printed every
    ``every`` steps and at the end.
    """

    def __init__(
        self, total: int | None, *, every: int = 25, stream: TextIO | None = None, enabled: bool = True
    ) -> None:
        self.total = total
        self.every = max(1, every)
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def _line(self, step: int, loss: float, qps: float) -> str:
        elapsed = time.perf_counter() - self._start
        if self.total:
            width = 30
            filled = min(width, int(width * step / self.total))
            bar = "#" * filled + "." * (width - filled)
            head = f"[{bar}] {step}/{self.total}"
        else:
            head = f"step {step}"
        return f"{head}  loss {loss:.4f}  {qps:,.0f} samples/s  {elapsed:.1f}s"

    def update(self, step: int, loss: float, qps: float) -> None:
        """Show step ``step`` (1-based) with the smoothed loss and the recent samples per second."""
        if not self.enabled:
            return
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or step == self.total:
                self.stream.write("\r" + self._line(step, loss, qps))
                self.stream.flush()
                self._last_draw = now
        elif step % self.every == 0 or step == self.total:
            self.stream.write(self._line(step, loss, qps) + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def format_table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    """A Markdown table (readable as plain text too); floats get 3 significant decimals."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 1e5 else f"{value:,.0f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in text)]) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "| " + " | ".join("-" * w for w in widths) + " |",
    ]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in text]
    return "\n".join(lines)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (shorter at the start)."""
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_history(
    path: Path, steps: Sequence[int], losses: Sequence[float], qps: Sequence[float], title: str
) -> bool:
    """Write a PNG with the training loss (raw and smoothed) and the QPS per step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_loss, ax_qps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    ax_loss.plot(steps, smooth(losses, 20), color="tab:blue", linewidth=1.8, label="loss (moving avg 20)")
    ax_loss.set_ylabel("BCE loss")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)
    ax_qps.plot(steps, qps, color="tab:green", alpha=0.3, linewidth=0.8, label="QPS")
    ax_qps.plot(steps, smooth(qps, 20), color="tab:green", linewidth=1.8, label="QPS (moving avg 20)")
    ax_qps.set_ylabel("samples / s (all ranks)")
    ax_qps.set_xlabel("step")
    ax_qps.legend(loc="lower right")
    ax_qps.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
