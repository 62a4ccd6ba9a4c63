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
from evalfleet.cli import EXIT_GATE_UNDECIDED, EXIT_OK, gate
from evalfleet.models import EvalRequest
from evalfleet.pipeline import history_claim, with_history
from tests.core import courier
from tests.core.test_history import _table, evaluate_checkpoint, store  # noqa: F401 - the fixture

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
