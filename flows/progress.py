"""Progress while episodes run: a Prefect progress artifact, and a bar on an interactive terminal."""

from __future__ import annotations

import contextvars
import datetime
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from evalfleet.cluster import client_for
from evalfleet.console import QUIET_ENV
from evalfleet.models import EvalRequest
from evalfleet.progress import ProgressTracker, topic
from flows.api_ledger import best_effort, key_part

logger = logging.getLogger(__name__)

UPDATE_EVERY_S = 1.0


def progress_key(request_id: str) -> str:
    """The key of an evaluation's progress artifact: ``progress-<request id>``.

    A request id may hold capitals, ``.`` and ``_`` (``my_run.1`` was refused as a key after the
    cluster had started): ``key_part`` makes it fit, hashed when it had to change.
    """
    return f"progress-{key_part(request_id)}"


@contextmanager
def watch(request: EvalRequest, address: str | None) -> Iterator[ProgressTracker]:
    """Follow the workers' progress events until the block ends."""
    tracker = ProgressTracker(total=request.max_episodes or request.episodes)
    if address is None:
        yield tracker
        return
    client = client_for(address)
    name = topic(request.request_id)
    client.subscribe_topic(name, tracker.handle)
    artifact_id = None
    key = progress_key(request.request_id)
    with best_effort("the progress artifact"):  # the UI's, never the evaluation's
        artifact_id = create_progress_artifact(
            0.0, key=key, description=f"episodes of {request.env} done (of {tracker.total})",
        )

    def show(snap: dict[str, float]) -> None:
        if artifact_id is not None:
            with best_effort("progress updates"):
                update_progress_artifact(artifact_id, min(100.0, 100.0 * snap["done"] / tracker.total))
        if bar is not None:
            bar.update(snap)

    bar = EpisodeBar(tracker.total) if sys.stderr.isatty() and not os.environ.get(QUIET_ENV) else None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(UPDATE_EVERY_S):
            show(tracker.snapshot())

    # The thread must see this flow's Prefect settings (API URL), not the process-wide defaults.
    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(loop,), name="evalfleet-progress", daemon=True)
    thread.start()
    try:
        yield tracker
    finally:
        stop.set()
        thread.join(5)
        try:
            try:
                client.unsubscribe_topic(name)
            except Exception as err:  # a lost scheduler: the run stage's own error says so
                logger.warning("could not unsubscribe from progress events: %s", err)
            snap = tracker.snapshot()
            show(snap)
        finally:
            if bar is not None:  # always give the terminal back (cursor, redirected output)
                bar.close()
        get_run_logger().info("%d episodes run, %d failed, %.0f episodes/s",
                              snap["done"], snap["failed"], snap["episodes_per_s"])


class EpisodeBar:
    """The terminal bar: episodes done of total, failures, episodes/s and ETA (rich.progress).

    Fed with ``ProgressTracker.snapshot()`` values by ``watch``'s update thread, so the rate and
    ETA are the tracker's (the ones the flow logs at the end), not re-estimated by rich.
    """

    def __init__(self, total: int, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("episodes"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TextColumn("{task.fields[rate]:.0f} episodes/s"),
            TextColumn("ETA {task.fields[eta]}"),
            console=console if console is not None else Console(stderr=True),
            auto_refresh=False,  # watch() redraws once per update
        )
        self._task = self._progress.add_task("episodes", total=total, failed=0, rate=0.0, eta="?")
        self._progress.start()

    def update(self, snap: dict[str, float]) -> None:
        """Show one snapshot (``done``, ``failed``, ``episodes_per_s``, ``eta_s``)."""
        eta = snap["eta_s"]
        self._progress.update(
            self._task, completed=int(snap["done"]), failed=int(snap["failed"]),
            rate=snap["episodes_per_s"],
            eta="?" if math.isnan(eta) else str(datetime.timedelta(seconds=round(eta))),
        )
        self._progress.refresh()

    def close(self) -> None:
        """Leave the last state on the terminal and end the line."""
        self._progress.stop()
