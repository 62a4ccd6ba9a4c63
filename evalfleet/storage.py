"""Writing results: the episode table as Parquet and the report as JSON, atomically."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from evalfleet.records import EPISODE_SCHEMA


def run_dir(output: Path, request_id: str) -> Path:
    """The folder of one evaluation's results."""
    return Path(output) / "runs" / request_id


def atomic_write(path: Path, write: Any) -> Path:
    """``write(tmp)`` into a new file beside ``path``, then put it in ``path``'s place at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a part
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def create_new(path: Path, write: Any) -> bool:
    """``write(tmp)`` into a file beside ``path``, linked in as ``path`` only if there is none yet.

    A file already there (or one another process put there meanwhile) is never replaced; readers
    never see a part. True when this call created ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_episodes(table: pa.Table, path: Path) -> Path:
    """Write the episode table (``EPISODE_SCHEMA``) to ``path`` as Parquet."""
    table = table.cast(EPISODE_SCHEMA)
    return atomic_write(Path(path), lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def write_table(table: pa.Table, path: Path) -> Path:
    """Write any Arrow table to ``path`` as Parquet, atomically."""
    return atomic_write(Path(path), lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def read_episodes(path: Path) -> pa.Table:
    """Read an episode table written by ``write_episodes``."""
    return pq.read_table(path, schema=EPISODE_SCHEMA)


def json_safe(data: Any) -> Any:
    """``data`` with every float that is not finite (NaN, ±inf) as None: strict JSON.

    Python writes them as ``NaN``/``Infinity``, which JSON has not: a trainer's parser (Go's,
    JavaScript's, ``jq``) rejects the whole document, and Starlette refuses to send it (a 500).
    A report with no scored episode has NaN statistics.
    """
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(v) for v in data]
    return data


@contextlib.contextmanager
def report_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the folder of report ``path`` while it is read and rewritten.

    Stage 7 (and serve's failure hook) and ``evalfleet mlflow flush`` (recording a late MLflow
    run) each rewrite one evaluation's report.json; unlocked, the later write from what it read
    before lost the other's. The folder is locked, not the file, as each write replaces the file.
    """
    import fcntl

    fd = os.open(Path(path).parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_json(data: dict[str, Any], path: Path) -> Path:
    """Write ``data`` as indented, strict JSON (``json_safe``)."""
    text = json.dumps(json_safe(data), indent=2, sort_keys=True, default=str, allow_nan=False)
    return atomic_write(Path(path), lambda tmp: Path(tmp).write_text(text + "\n"))
