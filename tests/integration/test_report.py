"""What the trainer shows and writes: metrics.jsonl, rank-aware logs, the summary table, the plot, the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.dlrm.launch import run_folder
from examples.dlrm.logs import MetricsWriter, setup_logging
from examples.dlrm.report import format_table, plot_history, smooth


def test_metrics_writer_appends_json_lines_without_nan(tmp_path: Path) -> None:
    """Records go to metrics.jsonl one per line (appended on reopen, as a resumed run does); NaN becomes null."""
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write({"kind": "train", "step": 1, "loss": 0.5, "phase_ms": {"forward": 2.0}})
    with MetricsWriter(path) as writer:
        writer.write({"kind": "eval", "step": 2, "auc": float("nan")})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {"kind": "train", "step": 1, "loss": 0.5, "phase_ms": {"forward": 2.0}},
        {"kind": "eval", "step": 2, "auc": None},
    ]


def test_metrics_writer_of_another_rank_writes_nothing(tmp_path: Path) -> None:
    """A disabled writer (ranks other than 0) creates no file."""
    with MetricsWriter(tmp_path / "m.jsonl", enabled=False) as writer:
        writer.write({"kind": "train", "step": 1})
    assert not (tmp_path / "m.jsonl").exists()


def test_logging_names_the_rank_and_quiets_other_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 logs INFO with `[rank 0]` in the line; rank 1 only warnings unless all ranks are asked for."""
    logger = setup_logging(0)
    logger.info("hello")
    assert "[rank 0] INFO examples.dlrm: hello" in capsys.readouterr().err
    logger = setup_logging(1)
    logger.info("quiet")
    logger.warning("loud")
    err = capsys.readouterr().err
    assert "quiet" not in err
    assert "[rank 1] WARNING" in err
    setup_logging(1, all_ranks=True).info("now")
    assert "[rank 1] INFO" in capsys.readouterr().err
    assert len(logger.handlers) == 1


def test_format_table_aligns_columns_and_formats_numbers() -> None:
    """A Markdown table with padded columns; floats get 3 decimals and thousands separators."""
    text = format_table([["forward", 12.3456], ["backward", 1234567.0]], ["phase", "ms"])
    lines = text.splitlines()
    assert lines[0] == "| phase    | ms        |"
    assert lines[2] == "| forward  | 12.346    |"
    assert lines[3] == "| backward | 1,234,567 |"


def test_smooth_is_a_trailing_mean() -> None:
    """The moving average uses the last `window` points (fewer at the start)."""
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_plot_history_writes_a_png(tmp_path: Path) -> None:
    """The loss/QPS plot is a PNG file (matplotlib is in the test requirements)."""
    path = tmp_path / "loss_qps.png"
    assert plot_history(path, [1, 2, 3], [0.7, 0.6, 0.5], [100.0, 120.0, 110.0], "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_history_with_evaluations_adds_the_auc_panel(tmp_path: Path) -> None:
    """With evaluations the PNG has a third panel (held-out AUC), so it is taller than the two-panel one."""
    two, three = tmp_path / "two.png", tmp_path / "three.png"
    args = ([1, 2, 3], [0.7, 0.6, 0.5], [100.0, 120.0, 110.0], "t")
    assert plot_history(two, *args)
    assert plot_history(three, *args, eval_steps=[2, 3], eval_loss=[0.6, 0.55], eval_auc=[0.6, 0.7])

    def height(png: Path) -> int:
        return int.from_bytes(png.read_bytes()[20:24], "big")  # IHDR height

    assert height(three) > height(two)


def test_run_folder_names_a_new_timestamped_folder(tmp_path: Path) -> None:
    """`runs/dlrm-<UTC time>`; a name already taken gets a suffix."""
    first = run_folder(tmp_path)
    assert first.name.startswith("dlrm-")
    assert not first.exists()
    first.mkdir()
    second = run_folder(tmp_path)
    assert second != first
    assert second.name.startswith(first.name) or second.name > first.name
