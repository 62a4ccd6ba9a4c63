"""Episode progress while shards run: workers publish counts, the driver aggregates them.

Workers publish through Dask's structured events (``Worker.log_event``: non-blocking, no client
round trip), at most every ``PUBLISH_EVERY_S`` per shard plus once at the end of the shard.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from evalfleet.models import EndReason
from evalfleet.records import EpisodeRecord

PUBLISH_EVERY_S = 0.5


def topic(request_id: str) -> str:
    """The Dask event topic of one evaluation."""
    return f"evalfleet-progress-{request_id}"


def shard_publisher(
    request_id: str, shard_id: int, publish: Callable[[str, dict[str, Any]], None]
) -> tuple[Callable[[EpisodeRecord], None], Callable[[], None]]:
    """``(on_episode, flush)`` for one shard: counts episodes and failures, publishes throttled."""
    state = {"done": 0, "failed": 0, "last": 0.0}
    name = topic(request_id)

    def send() -> None:
        publish(name, {"shard": shard_id, "done": state["done"], "failed": state["failed"]})
        state["last"] = time.monotonic()

    def on_episode(record: EpisodeRecord) -> None:
        state["done"] += 1
        state["failed"] += EndReason(record.end_reason).is_failure
        if time.monotonic() - state["last"] >= PUBLISH_EVERY_S:
            send()

    return on_episode, send


class ProgressTracker:
    """Sums the latest counts per shard; ``total`` is the episodes of the whole evaluation."""

    def __init__(self, total: int, already_done: int = 0) -> None:
        self.total = total
        self.base = already_done
        self._shards: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.started = time.monotonic()

    def handle(self, event: Any) -> None:
        """Dask topic handler: ``event`` is ``(timestamp, message)``."""
        message = event[1] if isinstance(event, tuple) else event
        with self._lock:
            self._shards[int(message["shard"])] = (int(message["done"]), int(message["failed"]))

    def snapshot(self) -> dict[str, float]:
        """Episodes done, failures, rate and ETA right now."""
        with self._lock:
            done = self.base + sum(d for d, _ in self._shards.values())
            failed = sum(f for _, f in self._shards.values())
        elapsed = time.monotonic() - self.started
        rate = (done - self.base) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        return {"done": done, "total": self.total, "failed": failed, "episodes_per_s": rate,
                "eta_s": eta}
