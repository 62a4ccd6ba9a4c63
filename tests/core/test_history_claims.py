"""Two checkpoints of one training run evaluated at once: the later step waits for the earlier.

Stage 7 read the run's history as MLflow held it. Steps 1 (good) and 2 (bad) triggered together
each read a history without the other: step 2 was ``first``, tagged best, and ``--gate`` passed
it. Now each evaluation of a step holds a claim until its MLflow run is logged, and a later step's
verdict waits for the earlier claims; one still held after the wait is no verdict (exit 6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evalfleet import claims
from evalfleet.cli import EXIT_GATE_UNDECIDED, EXIT_OK, EXIT_REGRESSION, gate
from evalfleet.history import checkpoints
from evalfleet.models import EvalRequest
from evalfleet.pipeline import history_claim, with_history
from tests.core import courier
from tests.core.test_history import (  # noqa: F401 - the fixture
    _table,
    checkpoint_request,
    evaluate_checkpoint,
    judge_checkpoint,
    log_checkpoint,
    store,
)

URI = "sqlite:///nowhere.db"


def test_a_claim_is_held_for_its_block_and_only_earlier_steps_count(tmp_path: Path) -> None:
    with claims.claimed(tmp_path, URI, "run", 3, "r3") as path:
        assert path is not None and json.loads(path.read_text())["pid"] == os.getpid()
        assert [c["request_id"] for c in claims.earlier_in_flight(tmp_path, URI, "run", 4)] == ["r3"]
        assert claims.earlier_in_flight(tmp_path, URI, "run", 3) == []  # not earlier
        assert claims.earlier_in_flight(tmp_path, URI, "other-run", 4) == []
        assert claims.earlier_in_flight(tmp_path, "sqlite:///other.db", "run", 4) == []
    assert claims.earlier_in_flight(tmp_path, URI, "run", 4) == []
    with claims.claimed(tmp_path, URI, None, 3, "no-run") as none:
        assert none is None


def test_a_claim_of_a_dead_process_or_a_day_old_one_is_stale(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path = claims.take(tmp_path, URI, "run", 1, "gone")
    assert path is not None
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": int(dead.stdout)}))
    assert claims.earlier_in_flight(tmp_path, URI, "run", 2) == []
    assert not path.exists()  # removed
    old = claims.take(tmp_path, URI, "run", 1, "old")
    assert old is not None
    old.write_text(json.dumps({**json.loads(old.read_text()), "host": "elsewhere",
                               "started": time.time() - claims.STALE_AFTER_S - 1}))
    assert claims.earlier_in_flight(tmp_path, URI, "run", 2) == []


def test_the_wait_ends_when_the_earlier_step_is_released(tmp_path: Path) -> None:
    path = claims.take(tmp_path, URI, "run", 1, "r1")
    assert path is not None
    timer = threading.Timer(0.5, claims.release, args=(path,))
    timer.start()
    t0 = time.monotonic()
    assert claims.wait_for_earlier(tmp_path, URI, "run", 2, timeout_s=30) == []
    assert 0.4 < time.monotonic() - t0 < 10
    path = claims.take(tmp_path, URI, "run", 1, "r1")
    assert [c["request_id"] for c in claims.wait_for_earlier(tmp_path, URI, "run", 2, timeout_s=0.3)] \
        == ["r1"]


def test_an_earlier_step_in_flight_leaves_the_verdict_undecided_and_the_gate_fails_closed(
        store: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    report = evaluate_checkpoint(store, "careless", 2, run="in-flight")  # as step 2 was: "first"
    assert report.history["verdict"] == "first"
    step1 = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careful", output=store,
                        training_run_id="in-flight", step=1, request_id="step-1",
                        mlflow_uri=f"sqlite:///{store / 'mlflow.db'}")
    step3 = step1.model_copy(update={"step": 3, "request_id": "step-3",
                                     "policy": "tests.core.courier:careless"})
    monkeypatch.setenv(claims.WAIT_ENV, "0.5")
    with history_claim(step1):  # step 1 is being evaluated (here: by this process) meanwhile
        judged = with_history(step3, report.model_copy(update={"history": None, "alarms": []}),
                              _table("careless"))
    assert judged.history["verdict"] is None
    assert "earlier checkpoints of training run 'in-flight' are still being evaluated: step 1 " \
           "(request step-1, pid" in judged.history["error"]
    assert judged.alarms[0].startswith("history_unavailable: ")
    assert gate(judged) == EXIT_GATE_UNDECIDED
    assert "still being evaluated" in capsys.readouterr().err
    # Once step 1 is released, step 3 is judged as before.
    again = with_history(step3, report.model_copy(update={"history": None, "alarms": []}),
                         _table("careless"))
    assert again.history["verdict"] is not None and gate(again) == EXIT_OK


def _judged(store: Path, policy: str, step: int, run: str):  # noqa: F811
    """(request, report) of a verdict made on the store's history as it is, not logged yet."""
    request = checkpoint_request(store, policy, step, run=run)
    return request, judge_checkpoint(store, request, policy, _table(policy))


def _later_best_undecided(store: Path, run: str, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """Steps 1 (careful, the best) and 2 (middling) both judged best against step 0: the next
    verdict fails closed until step 2 is judged again, then step 1 is the best."""
    after = evaluate_checkpoint(store, "middling", 3, run=run)
    h = after.history
    assert (h["verdict"], h["compared_with"], h["best_step"]) == ("no_paired_episodes", None, None)
    assert h["unsettled_best"] == {"late_steps": [1], "stale_steps": [2]}
    [line] = [a for a in after.alarms if a.startswith("history_")]
    assert line.startswith("history_out_of_order: checkpoints of this training run were evaluated "
                           "out of step order: step 1 after step 2.")
    assert gate(after) == EXIT_GATE_UNDECIDED
    capsys.readouterr()
    # Step 2 judged again (same weights) is judged with step 1: a regression; then step 4 too.
    again = evaluate_checkpoint(store, "middling", 2, run=run, request_id=f"{run}-middling-2-b")
    assert (again.history["verdict"], again.history["best_step"]) == ("regression", 1)
    assert gate(again) == EXIT_REGRESSION
    last = evaluate_checkpoint(store, "middling", 4, run=run)
    assert (last.history["verdict"], last.history["compared_with"]["step"]) == ("regression", 1)
    assert gate(last) == EXIT_REGRESSION


def test_a_later_step_judged_before_an_earlier_one_was_logged_did_not_see_it(store, capsys):  # noqa: F811
    # Planted (the audit's two Evaluators of one training run, without timing): step 2's verdict
    # (middling, new_best against step 0) is made; step 1 (careful, the real best) is judged and
    # logged; only then is step 2 logged. Before, step 2 counted as having seen step 1 because it
    # was logged after it: both tagged best, step 3 (middling) was not_distinguishable against
    # step 2 and the gate passed it (exit 0) against a best it is significantly worse than.
    run = "judged-before-logged"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    assert evaluate_checkpoint(store, "careless", 0, run=run).history["verdict"] == "first"
    request2, step2 = _judged(store, "middling", 2, run)
    assert step2.history["verdict"] == "new_best"
    step1 = evaluate_checkpoint(store, "careful", 1, run=run)  # step 2 is not logged: nothing late
    assert (step1.history["verdict"], step1.history["best_step"]) == ("new_best", 1)
    log_checkpoint(store, request2, step2, _table("middling"))
    found = {c.step: c for c in checkpoints(uri, run)}
    assert found[1].start_time < found[2].start_time  # logged in step order all the same
    _later_best_undecided(store, run, capsys)
    # What each verdict read is tagged on its run: step 2 read step 0 only.
    assert [(s, c.best, c.seen) for s, c in found.items()] == [(0, True, "none"), (1, True, "0"),
                                                             (2, True, "0")]


def test_a_later_steps_claim_says_its_verdict_was_made_without_the_earlier_one(store, capsys):  # noqa: F811
    # The same, with both evaluations holding their claims (one output folder): step 1 learns
    # from step 2's claim that step 2 was judged without it. Before, claims of later steps were
    # ignored: step 1 was new_best, tagged best, and its gate passed with no alarm.
    run = "judged-claims"
    uri = f"sqlite:///{store / 'mlflow.db'}"
    evaluate_checkpoint(store, "careless", 0, run=run)
    request2 = checkpoint_request(store, "middling", 2, run=run)
    with history_claim(request2) as claim2:
        step2 = judge_checkpoint(store, request2, "middling", _table("middling"))
        assert claim2 is not None
        marked = json.loads(claim2.read_text())  # the verdict is made, having read step 0
        request1 = checkpoint_request(store, "careful", 1, run=run)
        with history_claim(request1):
            step1 = judge_checkpoint(store, request1, "careful", _table("careful"))
            h = step1.history
            assert (h["verdict"], h["best_step"], h.get("later_steps")) == ("new_best", 0, [2])
            [line] = [a for a in step1.alarms if a.startswith("history_out_of_order: ")]
            assert line.startswith("history_out_of_order: step 1 was evaluated after later "
                                   "checkpoints of this training run were judged (step 2)")
            assert gate(step1) == EXIT_GATE_UNDECIDED
            log_checkpoint(store, request1, step1, _table("careful"))
        log_checkpoint(store, request2, step2, _table("middling"))
    found = {c.step: c for c in checkpoints(uri, run)}
    assert [(s, c.verdict, c.best) for s, c in found.items()] == [
        (0, "first", True), (1, "new_best", False), (2, "new_best", True)]
    _later_best_undecided(store, run, capsys)
    assert (marked["step"], marked["seen_steps"]) == (2, "0")


def test_the_steps_a_verdict_read_are_tagged_compactly_and_read_back() -> None:
    from evalfleet.history import decode_steps, encode_steps, saw_step

    assert encode_steps(range(0, 1_000_000, 1000)) == "0:999000:1000"
    assert encode_steps([]) == "none" and decode_steps("none") == (frozenset(), None)
    text = encode_steps([0, 5, 7, 9, 11, 20, 21])
    assert text == "0,5:11:2,20,21"
    assert decode_steps(text) == (frozenset({0, 5, 7, 9, 11, 20, 21}), None)
    assert saw_step(text, 9) and not saw_step(text, 8) and not saw_step(text, 1)
    # Too many irregular steps for a tag: the lowest are left out, and unknown below the floor.
    steps = [i * i for i in range(2000)]
    long = encode_steps(steps, budget=500)
    assert len(long) <= 500 and long.startswith("from ")
    kept, floor = decode_steps(long)
    assert floor is not None and kept == {s for s in steps if s >= floor}
    assert saw_step(long, floor - 1) and saw_step(long, steps[-1]) and not saw_step(long, steps[-1] - 1)
    assert saw_step(None, 3) and saw_step("garbage", 3)  # no tag: decided by logging time
