"""What the trainer shows and writes: progress lines, the summary table, the plot, the run folder's name."""

from __future__ import annotations

import io
from pathlib import Path

from examples.dlrm.launch import run_folder
from examples.dlrm.report import ProgressBar, format_table, plot_history, smooth


def test_progress_bar_prints_a_line_every_n_steps_off_a_terminal() -> None:
    """Without a terminal the bar prints one line per `every` steps and at the last step, with loss and QPS."""
    out = io.StringIO()
    bar = ProgressBar(10, every=4, stream=out)
    for step in range(1, 11):
        bar.update(step, 0.5, 1234.0)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split("]")[1].split()[0] for line in lines] == ["4/10", "8/10", "10/10"]
    assert "loss 0.5000" in lines[0]
    assert "1,234 samples/s" in lines[0]


def test_progress_bar_of_another_rank_prints_nothing() -> None:
    """A disabled bar (ranks other than 0) writes nothing."""
    out = io.StringIO()
    bar = ProgressBar(3, every=1, stream=out, enabled=False)
    bar.update(1, 0.1, 1.0)
    bar.close()
    assert out.getvalue() == ""


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


def test_run_folder_names_a_new_timestamped_folder(tmp_path: Path) -> None:
    """`runs/dlrm-<UTC time>`; a name already taken gets a suffix."""
    first = run_folder(tmp_path)
    assert first.name.startswith("dlrm-")
    assert not first.exists()
    first.mkdir()
    second = run_folder(tmp_path)
    assert second != first
    assert second.name.startswith(first.name) or second.name > first.name
