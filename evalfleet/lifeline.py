"""Local Dask workers die with the process that started them.

``fleet_cluster`` starts its ``LocalCluster`` workers with this module as a Dask preload: each
worker watches the driver (where the nannies live; named by ``EVALFLEET_DRIVER_PID``) and its
own parent (the fork server it was forked from) and, once either is gone (the driver was
SIGKILLed, OOM-killed, or crashed), kills its own children (fork servers and sandboxes) and
exits. Without it a worker busy in a shard outlives the driver until its scheduler connection
times out, and a shard's sandboxes with it. The driver is watched by pid, not only as the
parent: the fork server a worker comes from outlives the driver while any worker lives.
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
#: Environment variable naming the driver's pid in a local worker.
DRIVER_PID_ENV = "EVALFLEET_DRIVER_PID"

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
    """Start the watch in this process (once): exit with the children once driver or parent go."""
    if os.getpid() in _started:
        return None
    _started.add(os.getpid())
    parent = os.getppid()
    driver = _driver()

    def alive() -> bool:
        return os.getppid() == parent and (driver is None or _running(*driver))

    def loop() -> None:
        while alive():
            time.sleep(interval_s)
        kill_descendants()
        os._exit(ORPHANED_EXIT)

    thread = threading.Thread(target=loop, name="evalfleet-lifeline", daemon=True)
    thread.start()
    return thread


def _driver() -> tuple[int, float] | None:
    """The pid and start time of the driver named by ``EVALFLEET_DRIVER_PID``; None if unnamed.

    A named driver already gone gets a start time no process has: the watch ends at once.
    """
    pid = os.environ.get(DRIVER_PID_ENV, "")
    if not pid.isdigit():
        return None
    try:
        return int(pid), psutil.Process(int(pid)).create_time()
    except psutil.Error:
        return int(pid), -1.0


def _running(pid: int, started: float) -> bool:
    """Whether process ``pid`` started at ``started`` still runs (a reused pid does not)."""
    try:
        proc = psutil.Process(pid)
        return bool(proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def dask_setup(worker: Any) -> None:
    """Dask preload hook: start the parent watch in the worker process."""
    watch_parent()
