"""Checkpoints of a training run being evaluated now: a later step's verdict waits for them.

Stage 7 judges a checkpoint against the run's earlier ones as MLflow holds them. Two steps
evaluated at once (two webhook triggers, two CLI runs) each read a history without the other:
the later, worse step was ``first`` and ``--gate`` passed it. So every evaluation of a training
run's step holds a claim file from its start until its MLflow run is logged (or queued):
``OUTPUT/history-claims/<run key>/<step>-<request id>.json``. Before it reads the history, an
evaluation waits until no claim of an earlier step is left (``wait_for_earlier``); one still
there after the wait leaves the verdict undecided (``HistoryIncomplete``: an alarm, and
``--gate`` exits 6). A claim whose process is gone (same host) or that is a day old is stale
and ignored.

An earlier step can also start after a later one's verdict was made (its history read), while
the later one's MLflow run is not logged yet: the later verdict was made without it, and neither
saw the other. Once its history is read, an evaluation writes what it read into its claim
(``mark_judged``, after the read); an earlier step reads the claims of later steps before its
own read (``later_judged``): a later step judged without it makes it late
(``history.assess``'s ``judged_in_flight``). Its own MLflow run records the same
(``history.TAG_SEEN``), so a later verdict finds the late step however the claims went.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from evalfleet.errors import RequestError
from evalfleet.storage import write_json

logger = logging.getLogger(__name__)

#: How long stage 7 waits for earlier steps in flight (seconds); overridden by this variable.
WAIT_ENV = "EVALFLEET_HISTORY_WAIT_S"
DEFAULT_WAIT_S = 600.0
#: A claim older than this is a leftover (a host that went down), not an evaluation.
STALE_AFTER_S = 24 * 3600.0
_POLL_S = 0.25


def claim_dir(output: Path, tracking_uri: str, training_run_id: str) -> Path:
    """The claims of one training run in one MLflow store, under ``output``."""
    key = hashlib.sha256(f"{tracking_uri}\0{training_run_id}".encode()).hexdigest()[:24]
    return Path(output) / "history-claims" / key


def claim_path(output: Path, tracking_uri: str, training_run_id: str, step: int,
               request_id: str) -> Path:
    """The claim file of one evaluation of ``step``."""
    return claim_dir(output, tracking_uri, training_run_id) / f"{step:012d}-{request_id}.json"


@contextmanager
def claimed(output: Path, tracking_uri: str, training_run_id: str | None, step: int | None,
            request_id: str) -> Iterator[Path | None]:
    """Hold the claim of this evaluation of ``step`` while the block runs (nothing without a run)."""
    path = take(output, tracking_uri, training_run_id, step, request_id)
    try:
        yield path
    finally:
        if path is not None:
            release(path)


def take(output: Path, tracking_uri: str, training_run_id: str | None, step: int | None,
         request_id: str) -> Path | None:
    """Write the claim of this evaluation; its path (None without a training run and a step)."""
    if training_run_id is None or step is None:
        return None
    path = claim_path(output, tracking_uri, training_run_id, step, request_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json({"training_run_id": training_run_id, "step": step, "request_id": request_id,
                "pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, path)
    return path


def release(path: Path) -> None:
    """Remove a claim (again is fine)."""
    path.unlink(missing_ok=True)


def mark_judged(path: Path | None, seen_steps: str) -> None:
    """Record in this evaluation's claim that its verdict was made, having read ``seen_steps``.

    ``seen_steps``: ``history.encode_steps`` of the earlier steps its history read held. Written
    after the read (an earlier step that sees the mark knows the read is over); nothing when the
    claim is not held (already released, or an evaluation without one).
    """
    if path is None:
        return
    try:  # the claim's owner marks it, before it releases it: the file is not made anew
        claim = json.loads(path.read_text())
        write_json({**claim, "judged": time.time(), "seen_steps": seen_steps}, path)
    except (OSError, ValueError) as err:  # the verdict stands; its MLflow run records the same
        logger.warning("could not mark the claim %s as judged: %s", path, err)


def earlier_in_flight(output: Path, tracking_uri: str, training_run_id: str, step: int
                      ) -> list[dict[str, Any]]:
    """Live claims of steps before ``step``; stale ones of this host are removed."""
    return _live(output, tracking_uri, training_run_id, lambda other: other < step)


def later_judged(output: Path, tracking_uri: str, training_run_id: str, step: int
                 ) -> list[dict[str, Any]]:
    """Live claims of steps after ``step`` whose verdicts were made (``mark_judged``).

    Each has its ``seen_steps``: the caller asks whether the verdict read ``step``
    (``history.saw_step``). Read before this evaluation's own history read: a later step that
    released its claim before this was logged, and this read finds it in MLflow.
    """
    return [c for c in _live(output, tracking_uri, training_run_id, lambda other: other > step)
            if "judged" in c]


def _live(output: Path, tracking_uri: str, training_run_id: str, wanted: Callable[[int], bool]
          ) -> list[dict[str, Any]]:
    """Live claims of the steps ``wanted`` keeps; stale ones of this host are removed."""
    live = []
    folder = claim_dir(output, tracking_uri, training_run_id)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            claim = json.loads(path.read_text())
            other = int(claim["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or removed meanwhile
        if not wanted(other):
            continue
        if _stale(claim):
            path.unlink(missing_ok=True)
            continue
        live.append(claim)
    return live


def _stale(claim: dict[str, Any]) -> bool:
    if time.time() - float(claim.get("started", 0)) > STALE_AFTER_S:
        return True
    if claim.get("host") != socket.gethostname():
        return False  # another host's process: its age is all that can be judged
    try:
        os.kill(int(claim["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


def wait_s() -> float:
    """``$EVALFLEET_HISTORY_WAIT_S`` in seconds (``DEFAULT_WAIT_S`` unset); a bad one is a ``RequestError``.

    Stage 1 reads it (``pipeline.history_claim``): read first in stage 7, '10m' failed the run
    after its episodes, with a bare ValueError naming no variable, exit 1 and no report.
    """
    raw = os.environ.get(WAIT_ENV)
    if raw is None:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise RequestError(
            f"{WAIT_ENV}={raw!r}: expected a finite number of seconds >= 0 (how long a training "
            "run's checkpoint waits for earlier steps being evaluated before its verdict), e.g. "
            f"600 or 0.5; unset it for {DEFAULT_WAIT_S:g}.")
    return value


def wait_for_earlier(output: Path, tracking_uri: str, training_run_id: str, step: int,
                     timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Wait until no earlier step of the run is in flight; the claims still there at the timeout."""
    if timeout_s is None:
        timeout_s = wait_s()
    deadline = time.monotonic() + timeout_s
    busy = earlier_in_flight(output, tracking_uri, training_run_id, step)
    if busy:
        logger.warning("step %d of training run %r waits for %s to be logged before its verdict "
                       "(up to %g s)", step, training_run_id, describe(busy), timeout_s)
    while busy and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        busy = earlier_in_flight(output, tracking_uri, training_run_id, step)
    return busy


def describe(claims: list[dict[str, Any]]) -> str:
    """``step 3 (request r, pid 12 on host h, running 40 s)``, joined."""
    now = time.time()
    return ", ".join(
        f"step {c.get('step')} (request {c.get('request_id')}, pid {c.get('pid')} on "
        f"{c.get('host')}, running {now - float(c.get('started', now)):.0f} s)" for c in claims)
