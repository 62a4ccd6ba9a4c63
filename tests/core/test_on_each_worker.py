"""A worker lost while a task runs once on each worker is skipped, not waited for for ever."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from distributed import Client, LocalCluster

from evalfleet.cluster import on_each_worker

pytestmark = pytest.mark.slow


def slow_pid(seconds: float) -> int:
    """This worker's pid, after ``seconds``."""
    time.sleep(seconds)
    return os.getpid()


@pytest.mark.timeout(180)
def test_a_worker_killed_during_on_each_worker_is_skipped():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        pids = client.run(os.getpid)
        victim_addr, victim = sorted(pids.items())[0]
        threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
        t0 = time.monotonic()
        # Before: the task pinned to the killed worker waited for it for ever (the soak's hang).
        results = on_each_worker(lc.scheduler_address, slow_pid, 4.0)
        assert time.monotonic() - t0 < 60
        assert results == [p for a, p in sorted(pids.items()) if a != victim_addr]
