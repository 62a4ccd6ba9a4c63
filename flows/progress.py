"""Progress while episodes run: a Prefect progress artifact, and a bar on an interactive terminal."""

from __future__ import annotations

import contextvars
import math
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from evalfleet.cluster import client_for
from evalfleet.models import EvalRequest
from evalfleet.progress import ProgressTracker, topic

UPDATE_EVERY_S = 1.0


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
    artifact_id = create_progress_artifact(
        0.0, key=f"progress-{request.request_id}".lower(),
        description=f"episodes of {request.env} done (of {tracker.total})",
    )
    bar = _bar(tracker) if sys.stderr.isatty() else None
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(UPDATE_EVERY_S):
            snap = tracker.snapshot()
            update_progress_artifact(artifact_id, min(100.0, 100.0 * snap["done"] / tracker.total))
            if bar is not None:
                bar(snap)

    # The thread must see this flow's Prefect settings (API URL), not the process-wide defaults.
    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(loop,), name="evalfleet-progress", daemon=True)
    thread.start()
    try:
        yield tracker
    finally:
        stop.set()
        thread.join(5)
        client.unsubscribe_topic(name)
        snap = tracker.snapshot()
        update_progress_artifact(artifact_id, min(100.0, 100.0 * snap["done"] / tracker.total))
        if bar is not None:
            bar(snap)
            sys.stderr.write("\n")
        get_run_logger().info("%d episodes run, %d failed, %.0f episodes/s",
                              snap["done"], snap["failed"], snap["episodes_per_s"])


def _bar(tracker: ProgressTracker):  # type: ignore[no-untyped-def]
    def draw(snap: dict[str, float]) -> None:
        frac = min(1.0, snap["done"] / tracker.total)
        filled = int(30 * frac)
        eta = "?" if math.isnan(snap["eta_s"]) else f"{snap['eta_s']:.0f}s"
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {int(snap['done'])}/{tracker.total}"
                         f" episodes, {int(snap['failed'])} failed, {snap['episodes_per_s']:.0f}/s,"
                         f" ETA {eta}  ")
        sys.stderr.flush()

    return draw
