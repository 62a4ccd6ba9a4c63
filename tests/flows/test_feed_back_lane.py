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


def test_a_failed_stage_7_is_raised_by_close_even_when_its_noting_is_slow(example_policy, tmp_path,
                                                                         monkeypatch):
    """``drain()`` must see a failure whatever the lane thread does between the failure and its note.

    ``concurrent.futures`` wakes a waiter before it runs done-callbacks: a failure noted in one
    (here slowed by 0.2 s, as a descheduled nice-19 thread would be) was read after ``drain()``
    had returned clean, so ``Evaluator.shutdown()`` raised nothing for a report.json never written.
    """
    import time
    from types import SimpleNamespace

    import flows.warm as warm
    from evalfleet.errors import OutputsMissing
    from evalfleet.models import EvalRequest

    def failing(request):
        time.sleep(0.1)  # past submit(): a future done before it would run its callbacks there
        raise OSError("No space left on device: report.json")

    noted = warm.FeedBackLane._check

    def slow_check(self, *args):
        time.sleep(0.2)
        return noted(self, *args)

    monkeypatch.setattr(warm, "recorded_feed_back", failing)
    monkeypatch.setattr(warm, "_waiting", {})
    monkeypatch.setattr(warm.FeedBackLane, "_check", slow_check)
    request = EvalRequest.build(env="CartPole-v1", policy=example_policy, episodes=4,
                                output=str(tmp_path))
    lane = FeedBackLane()
    future = lane.submit(request, None, SimpleNamespace(alarms=[], harness_fault=False), None)
    with pytest.raises(OutputsMissing) as raised:
        lane.close()  # what Evaluator.shutdown() ends with
    assert isinstance(future.exception(), OSError)
    assert f"{request.request_id}: stage 7 failed (OSError: No space left on device: report.json" \
        in str(raised.value)
    assert lane._problems == []  # raised once, not left for a drain that never comes
