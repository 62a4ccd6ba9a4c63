"""The feed-back lane yields the CPU: stage 7 of one evaluation must not slow the next's episodes."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from flows.warm import LANE_NICENESS, FeedBackLane


def _niceness() -> tuple[int, str]:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.current_thread().name


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is a Linux notion")
def test_the_lane_thread_runs_below_the_callers_priority_and_prefects_loop_does_not():
    from prefect._internal.concurrency.threads import get_global_loop

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    lane = FeedBackLane()
    try:
        nice, name = lane._pool.submit(_niceness).result(timeout=30)
    finally:
        lane.close()
    assert name.startswith("evalfleet-feed-back")
    assert nice == min(19, mine + LANE_NICENESS), (nice, mine)
    # Prefect's process-wide loop (the driver's own API calls) keeps the caller's priority,
    # even where the lane was the first to need it.
    loop_thread = get_global_loop().thread
    assert os.getpriority(os.PRIO_PROCESS, loop_thread.native_id) == mine
    # The caller itself is untouched.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
