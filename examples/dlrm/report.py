"""What the trainer writes at the end: a summary table and a PNG plot of loss, held-out AUC and QPS."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["format_table", "plot_history", "smooth"]


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
    path: Path,
    steps: Sequence[int],
    losses: Sequence[float],
    qps: Sequence[float],
    title: str,
    *,
    eval_steps: Sequence[int] = (),
    eval_loss: Sequence[float] = (),
    eval_auc: Sequence[float] = (),
) -> bool:
    """Write a PNG: training loss (raw and smoothed) with the held-out loss, the held-out AUC (when there are
    evaluations) and the QPS per step; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = 3 if eval_steps else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels + 0.8), sharex=True)
    ax_loss, ax_qps = axes[0], axes[-1]
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
    ax_loss.plot(
        steps, smooth(losses, 20), color="tab:blue", linewidth=1.8, label="train loss (moving avg 20)"
    )
    if eval_steps:
        ax_loss.plot(eval_steps, eval_loss, "o-", color="tab:red", linewidth=1.5, label="held-out loss")
        ax_auc = axes[1]
        ax_auc.plot(eval_steps, eval_auc, "o-", color="tab:purple", linewidth=1.5, label="held-out AUC")
        ax_auc.axhline(0.5, color="gray", linestyle="--", linewidth=0.8, label="random model")
        ax_auc.set_ylabel("AUC")
        ax_auc.legend(loc="lower right")
        ax_auc.grid(alpha=0.3)
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
