"""The DLRM trainer's command line: bad flags are one ``error:`` line, and the multi-host torchrun command works.

The multi-host test starts the launcher twice on this machine as two "hosts" of one job (``--nnodes 1:2`` with
a c10d rendezvous on a local port, one process each, a shared run folder), exactly as on two machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.dlrm.errors import ArgumentError, CheckpointError, DLRMError
from examples.dlrm.harness import free_port
from examples.dlrm.train import parse_args, validate

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--steps", "4", "--batch-size", "16", "--min-batch-size", "8", "--embedding-dim", "8",
    "--bottom-layers", "16", "--top-layers", "16", "--max-rows", "200", "--kv-max-rows", "10000",
    "--cache-rows", "32", "--kv-store", "memory", "--eval-batches", "1", "--data-workers", "0",
    "--no-progress", "--log-every", "2",
]  # fmt: skip


def _tsv(path: Path, lines: int = 20) -> Path:
    row = "\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26])
    path.write_text("\n".join([row] * lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (
            ["--data", "{tmp}/missing.tsv"],
            ArgumentError,
            r"`--data` names '.*missing.tsv', which is not a file",
        ),
        (["--eval-data", "{tmp}/nope.tsv"], ArgumentError, r"`--eval-data` names"),
        (
            ["--eval-every", "5", "--eval-batches", "0"],
            ArgumentError,
            r"no held-out data \(`--eval-batches` is 0\)",
        ),
        (["--eval-fraction", "0.2"], ArgumentError, r"`--eval-fraction` .* but no `--data` is given"),
        (
            ["--data", "{tmp}/day.tsv", "--eval-fraction", "0", "--eval-every", "2"],
            ArgumentError,
            r"`--eval-fraction` is 0 and no `--eval-data`",
        ),
        (["--resume"], CheckpointError, r"holds no checkpoint"),
        (["--steps", "0"], ArgumentError, r"`--steps` is 0, expected >= 1"),
        (
            ["--batch-size", "64"],
            ArgumentError,
            r"`--min-batch-size` is 128, expected 0..`--batch-size` \(64\)",
        ),
    ],
    ids=[
        "unknown-data",
        "unknown-eval-data",
        "eval-without-batches",
        "fraction-without-data",
        "tsv-eval-without-held-out",
        "resume-without-checkpoint",
        "zero-steps",
        "min-batch-above-batch",
    ],
)
def test_bad_flags_raise_the_trainers_error(
    tmp_path: Path, args: list[str], error: type[DLRMError], message: str
) -> None:
    """Each bad option is caught before any process group exists, by a DLRMError naming the flag."""
    _tsv(tmp_path / "day.tsv")
    argv = ["--out", str(tmp_path / "run"), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    with pytest.raises(error, match=message):
        validate(parse_args(argv))


def test_resume_from_an_old_format_checkpoint_is_refused(tmp_path: Path) -> None:
    """A folder with the old per-rank torch.save files names the format, not a missing file."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "rank0.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"old per-rank torch\.save format"):
        validate(parse_args(["--out", str(tmp_path), "--resume"]))


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    "module", ["examples.dlrm.launch", "examples.dlrm.train"], ids=["launcher", "worker"]
)
def test_a_bad_flag_is_one_line_without_traceback(tmp_path: Path, module: str) -> None:
    """The main job (and a bare worker) print `error: ...` once and exit with status 2."""
    done = _run(["-m", module, "--out", str(tmp_path / "run"), "--data", str(tmp_path / "missing.tsv")])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: `--data` names {str(tmp_path / 'missing.tsv')!r}, which is not a file"]


def test_a_crashing_worker_leaves_its_traceback_in_the_elastic_error_file(tmp_path: Path) -> None:
    """`@record` on the worker's main: an unexpected error (a malformed TSV line) is written to the file torchrun
    names in TORCHELASTIC_ERROR_FILE, with the message and the traceback."""
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n", encoding="utf-8")
    error_file = tmp_path / "error.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TORCHELASTIC_ERROR_FILE": str(error_file),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.dlrm.train",
            "--out",
            str(tmp_path / "run"),
            "--data",
            str(bad),
            *TINY,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    message = json.loads(error_file.read_text())["message"]
    assert "line 1 has 3 tab-separated fields" in message["message"]
    assert "Traceback" in message["extraInfo"]["py_callstack"]


@pytest.mark.distributed
def test_two_hosts_through_the_c10d_rendezvous(tmp_path: Path) -> None:
    """`--nnodes 1:2 --rdzv-endpoint` on two "hosts" forms one 2-rank world that trains and evaluates."""
    out = tmp_path / "run"
    port = free_port()
    host = [
        "-m", "examples.dlrm.launch", "--nnodes", "1:2", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dlrm-test", "--out", str(out), *TINY,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, *host],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(outputs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 4
    assert summary["eval_auc"] == summary["evals"][-1]["auc"]
