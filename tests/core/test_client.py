"""The in-loop ``Evaluator``'s own bookkeeping, with planted runners (no cluster, no server).

What its runner's background stage 7 could not produce and what ``on_result`` raised reach the
trainer from ``flush()``/``shutdown()``: never a log line only, never a dead thread.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from evalfleet.client import Evaluator
from evalfleet.errors import OutputsMissing
from tests.integration.policies import mlp

FACTORY = "tests.integration.policies:mlp"


def report_runner(request: Any) -> Any:
    """A runner returning what ``result_from_report`` reads of a report: mean 1.0 over 8 episodes."""
    return SimpleNamespace(mean=1.0, coverage=1.0, ci=(0.5, 1.5), lengths={"mean": 10.0},
                           steps_per_second=100.0, episodes=8, scored=8, failure_rate=0.0,
                           policy_failure_rate=0.0, history=None, alarms=[], harness_fault=False,
                           outputs={}, policy_sha256="0" * 64)


class SlowStage7:
    """A runner whose ``close()`` (stage 7) outlasts the caller's timeout, then misses a callback."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, request: Any) -> Any:
        return report_runner(request)

    def close(self) -> None:
        self.release.wait(timeout=30)
        raise OutputsMissing("r1: the callback to the trainer: failed after 5 attempts")


@pytest.mark.parametrize("again", ["flush", "shutdown"])
def test_shutdown_with_stage_7_still_running_raises_and_a_later_call_raises_what_it_missed(
        tmp_path: Path, again: str) -> None:
    # shutdown(timeout) logged a warning and returned; the OutputsMissing stored later was
    # raised by nobody (a second shutdown() and flush() returned normally).
    runner = SlowStage7()
    ev = Evaluator(output=tmp_path, policy_factory=FACTORY, runner=runner)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"^the evaluator is still running after 0.5 s \(evaluations, "
                       r"or their stage 7: .*call shutdown\(\) or flush\(\) again"):
        ev.shutdown(timeout=0.5)
    assert time.perf_counter() - t0 < 5
    runner.release.set()
    with pytest.raises(OutputsMissing, match=r"^r1: the callback to the trainer: failed after 5 attempts$"):
        getattr(ev, again)(timeout=30)
    assert not ev._thread.is_alive()
    ev.shutdown()  # each problem is raised once
    ev.flush()


def test_an_on_result_raising_systemexit_neither_kills_the_evaluator_nor_goes_unsaid(
        tmp_path: Path) -> None:
    # The thread died: wait() said "still running" forever, pending stayed 1 (EvaluatorBusy on
    # every later trigger) and shutdown() returned normally.
    def on_result(result: dict[str, Any]) -> None:
        sys.exit(f"target reward reached at step {result['eval/step']}")

    ev = Evaluator(output=tmp_path, policy_factory=FACTORY, runner=report_runner, on_result=on_result)
    try:
        ev.trigger_eval(mlp(), step=0)
        first = ev.wait(timeout=10)
        assert first is not None and (first["eval/step"], first["eval/reward"]) == (0, 1.0)
        assert ev.pending == 0 and ev._thread.is_alive()
        ev.trigger_eval(mlp(), step=1)  # busy_policy='error': nothing is pending any more
        second = ev.wait(timeout=10)
        assert second is not None and second["eval/step"] == 1
        with pytest.raises(OutputsMissing) as raised:
            ev.flush()
        assert str(raised.value) == (
            "results were returned, but not everything asked for with them was produced: "
            "on_result raised for step 0: SystemExit: target reward reached at step 0; "
            "on_result raised for step 1: SystemExit: target reward reached at step 1")
        ev.trigger_eval(mlp(), step=2)
        third = ev.wait(timeout=10)
        assert third is not None and third["eval/step"] == 2
    except BaseException:
        ev.shutdown(wait=False)
        raise
    with pytest.raises(OutputsMissing, match=r"produced: on_result raised for step 2: SystemExit: "
                       r"target reward reached at step 2$"):
        ev.shutdown(timeout=10)  # steps 0 and 1 were raised by flush() already
