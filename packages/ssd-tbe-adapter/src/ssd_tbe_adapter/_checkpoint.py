"""Checkpoint directories: one ``torch.save`` file per :class:`~ssd_tbe_adapter.TableChunk` plus ``manifest.json``.

Atomicity: a save writes its chunk files into a fresh temporary directory inside ``directory``, fsyncs each file
and the directory, renames it to a new generation directory ``g-<hex>``, then writes the manifest to a temporary
file, fsyncs it and renames it over ``manifest.json`` (one ``rename(2)``: the commit point), and fsyncs
``directory``. Until that rename the old manifest and its generation stay untouched, so a process killed at any
point leaves either the old checkpoint or the new one, whole; leftovers of an interrupted save are removed by the
next save. The manifest records each file's byte size, SHA-256, table and row count, so a load can check every file
before it touches the live tables.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ssd_tbe_adapter._specs import TableChunk
from ssd_tbe_adapter.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DiskFullError,
    SSDTBEAdapterError,
    StoreIOError,
)

__all__ = [
    "fsync_directory",
    "io_error",
    "read_chunks",
    "read_manifest",
    "verify_checkpoint",
    "write_checkpoint",
]

_CHECKPOINT_FORMAT = 2
_READABLE_FORMATS = (1, 2)  # format 1: chunk files beside the manifest, no checksums (read, never written)


def io_error(error: OSError, what: str) -> DiskFullError | StoreIOError:
    """The package error for an ``OSError`` raised while doing ``what`` (a phrase naming the path)."""
    if error.errno == errno.ENOSPC:
        return DiskFullError(f"no space left on device while {what}: free space and retry ({error})")
    return StoreIOError(f"I/O error while {what}: {error}")


def fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed or removed files) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_checkpoint(directory: str | Path, chunks: Iterable[TableChunk], config: dict[str, Any]) -> int:
    """Write ``chunks`` to ``directory`` atomically (see the module docstring), one file per chunk as it comes,
    then the manifest (``config``, the files with their checksums, the row count).

    Returns:
        The number of rows written.

    Raises:
        DiskFullError: the checkpoint's device is full (the previous checkpoint in ``directory`` is intact).
        StoreIOError: another I/O error (same guarantee).
    """
    path = Path(directory)
    token = uuid.uuid4().hex[:16]
    staging = path / f".tmp-{token}"
    generation = f"g-{token}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:
        raise io_error(error, f"creating checkpoint `directory` {str(path)!r}") from error
    files: list[dict[str, Any]] = []
    rows = 0
    try:
        for number, chunk in enumerate(chunks):
            name = f"chunk-{number:06d}.pt"
            buffer = io.BytesIO()
            torch.save(
                {
                    "table": chunk.table,
                    "ids": chunk.ids,
                    "weights": chunk.weights,
                    "state": chunk.optimizer_state,
                },
                buffer,
            )
            data = buffer.getvalue()
            _write_file(staging / name, data)
            files.append(
                {
                    "name": f"{generation}/{name}",
                    "table": chunk.table,
                    "rows": chunk.ids.numel(),
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            )
            rows += chunk.ids.numel()
        fsync_directory(staging)
        os.rename(staging, path / generation)
        fsync_directory(path)
        manifest = {"format": _CHECKPOINT_FORMAT, **config, "files": files, "rows": rows}
        temporary = path / f".manifest-{token}.tmp"
        _write_file(temporary, json.dumps(manifest, indent=1).encode())
        os.replace(temporary, path / "manifest.json")  # the commit point
        fsync_directory(path)
    except BaseException as error:
        # Nothing was committed: drop this save's files (the previous checkpoint is untouched).
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(path / generation, ignore_errors=True)
        with contextlib.suppress(OSError):
            (path / f".manifest-{token}.tmp").unlink()
        if isinstance(error, OSError):
            raise io_error(error, f"writing checkpoint `directory` {str(path)!r}") from error
        raise
    _remove_stale(path, generation)
    return rows


def _remove_stale(path: Path, generation: str) -> None:
    """Remove what older or interrupted saves left in ``path`` (never the committed ``generation``)."""
    for entry in path.iterdir():
        name = entry.name
        if name == generation:
            continue
        if entry.is_dir() and (name.startswith("g-") or name.startswith(".tmp-")):
            shutil.rmtree(entry, ignore_errors=True)
        elif (name.startswith(".manifest-") and name.endswith(".tmp")) or (
            name.startswith("chunk-") and name.endswith(".pt")  # a format-1 checkpoint's files
        ):
            with contextlib.suppress(OSError):
                entry.unlink()


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a :func:`write_checkpoint` directory.

    Raises:
        CheckpointNotFoundError: ``directory`` has no ``manifest.json``.
        CheckpointCorruptError: the manifest is not valid JSON or has an unknown format number.
    """
    path = Path(directory)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise CheckpointNotFoundError(f"checkpoint `directory` {str(path)!r} has no manifest.json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointCorruptError(
            f"cannot read checkpoint manifest {str(manifest_path)!r}: {error}"
        ) from error
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE_FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointCorruptError(
            f"checkpoint format {found!r} in {str(manifest_path)!r}, expected one of {_READABLE_FORMATS}"
        )
    if not isinstance(manifest.get("files"), list) or not isinstance(manifest.get("rows"), int):
        raise CheckpointCorruptError(f"checkpoint manifest {str(manifest_path)!r} lacks `files` or `rows`")
    return manifest


def _entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The file entries of a manifest (format 1 lists bare names)."""
    return [entry if isinstance(entry, dict) else {"name": entry} for entry in manifest["files"]]


def _load(path: Path, entry: dict[str, Any]) -> TableChunk:
    """Read, check and decode one chunk file (raises :class:`CheckpointCorruptError` naming it)."""
    file = path / str(entry["name"])
    try:
        data = file.read_bytes()
    except OSError as error:
        raise CheckpointCorruptError(f"cannot read checkpoint file {str(file)!r}: {error}") from error
    if "bytes" in entry and len(data) != entry["bytes"]:
        raise CheckpointCorruptError(
            f"checkpoint file {str(file)!r} has {len(data)} bytes, its manifest says {entry['bytes']} (truncated?)"
        )
    if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointCorruptError(f"checkpoint file {str(file)!r} fails its SHA-256 check (damaged)")
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        chunk = TableChunk(
            table=loaded["table"],
            ids=loaded["ids"],
            weights=loaded["weights"],
            optimizer_state=loaded["state"],
        )
    except Exception as error:  # torch.load raises EOFError, RuntimeError, pickle errors, ... on bad bytes
        raise CheckpointCorruptError(
            f"checkpoint file {str(file)!r} cannot be decoded: {type(error).__name__}: {error}"
        ) from error
    if ("table" in entry and chunk.table != entry["table"]) or (
        "rows" in entry and chunk.ids.numel() != entry["rows"]
    ):
        raise CheckpointCorruptError(
            f"checkpoint file {str(file)!r} holds {chunk.ids.numel()} rows of `{chunk.table}`, its manifest says "
            f"{entry.get('rows')} rows of `{entry.get('table')}`"
        )
    return chunk


def verify_checkpoint(
    directory: str | Path, manifest: dict[str, Any], check: Callable[[TableChunk], object]
) -> None:
    """Check every chunk of the checkpoint (size, checksum, decoding, manifest entry, then ``check(chunk)``, which
    raises :class:`~ssd_tbe_adapter.errors.SSDTBEAdapterError` for rows that do not fit the tables) and the row
    count, one chunk in memory at a time. Returning proves the whole checkpoint loadable.

    Raises:
        CheckpointCorruptError: naming the first bad file, or the row count when it differs from the manifest's.
    """
    path = Path(directory)
    rows = 0
    for entry in _entries(manifest):
        chunk = _load(path, entry)
        try:
            check(chunk)
        except SSDTBEAdapterError as error:
            raise CheckpointCorruptError(
                f"checkpoint file {str(path / str(entry['name']))!r}: {error}"
            ) from error
        rows += chunk.ids.numel()
    if rows != manifest["rows"]:
        raise CheckpointCorruptError(
            f"checkpoint {str(path)!r} holds {rows} rows, its manifest says {manifest['rows']}"
        )


def read_chunks(directory: str | Path, manifest: dict[str, Any]) -> Iterator[TableChunk]:
    """The chunks the manifest lists, loaded (and checked) one at a time."""
    path = Path(directory)
    for entry in _entries(manifest):
        yield _load(path, entry)
