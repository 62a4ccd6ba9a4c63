"""Local Dask workers die with the process that started them.

``fleet_cluster`` starts its ``LocalCluster`` workers with this module as a Dask preload: each
worker watches its parent (the driver, where the nannies live) and, once the driver is gone
(its parent pid changes: the driver was SIGKILLed, OOM-killed, or crashed), kills its own
children (fork servers and sandboxes) and exits. Without it a worker busy in a shard outlives
the driver until its scheduler connection times out, and a shard's sandboxes with it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import psutil

logger = logging.getLogger(__name__)

#: Seconds between two looks at the parent pid.
WATCH_INTERVAL_S = 0.25
#: Exit status of a worker that ended because its driver died.
ORPHANED_EXIT = 70

_started: set[int] = set()


def kill_descendants(pid: int | None = None) -> int:
    """SIGKILL every descendant of ``pid`` (this process by default); returns how many."""
    try:
        kids = psutil.Process(pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return 0
    for kid in kids:
        try:
            kid.kill()
        except psutil.Error:
            pass
    return len(kids)


def watch_parent(interval_s: float = WATCH_INTERVAL_S) -> threading.Thread | None:
    """Start the watch in this process (once): exit with the children when the parent dies."""
    if os.getpid() in _started:
        return None
    _started.add(os.getpid())
    parent = os.getppid()

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        kill_descendants()
        os._exit(ORPHANED_EXIT)

    thread = threading.Thread(target=loop, name="evalfleet-lifeline", daemon=True)
    thread.start()
    return thread


def dask_setup(worker: Any) -> None:
    """Dask preload hook: start the parent watch in the worker process."""
    watch_parent()
