"""The CLI's MLflow logger process logs what ``log_or_queue`` logs in-process, or hands the job back."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from evalfleet import tracking
from evalfleet.tracking import StoreLogger, log_or_queue, pending_dir, start_store_logger
from tests.core.test_mlflow_queue import REPORT


@pytest.fixture(autouse=True)
def no_logger_left() -> object:
    yield
    tracking.stop_store_logger()


def _run(uri: str, run_id: str) -> tuple[str, dict[str, float], dict[str, str], dict[str, str], list[str]]:
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("evalfleet.")}
    return (run.info.status, run.data.metrics, run.data.params, tags,
            sorted(a.path for a in client.list_artifacts(run_id)))


def test_the_logger_process_logs_the_run_the_caller_would(tmp_path: Path) -> None:
    report = dict(REPORT, alarms=["low_coverage: planted"])
    artifact = tmp_path / "report.json"
    artifact.write_text(json.dumps(report))
    here, there = f"sqlite:///{tmp_path / 'here.db'}", f"sqlite:///{tmp_path / 'there.db'}"
    plain = log_or_queue(tmp_path / "a", here, "exp", report, {"episodes": 4}, [artifact], "run")

    start_store_logger()
    child = tracking._store_logger
    assert child is not None
    out = log_or_queue(tmp_path / "b", there, "exp", report, {"episodes": 4}, [artifact], "run")
    assert tracking._store_logger is None  # one job: taken
    assert child._proc.wait(30) == 0
    assert set(out) == {"mlflow_uri", "mlflow_run_id"} and out["mlflow_uri"] == there
    assert _run(there, out["mlflow_run_id"]) == _run(here, plain["mlflow_run_id"])
    status, metrics, params, tags, files = _run(there, out["mlflow_run_id"])
    assert status == "FINISHED" and metrics["eval/reward"] == 1.0 and params["episodes"] == "4"
    assert tags["evalfleet.alarm.low_coverage"] == "true" and files == ["report.json"]


def test_a_store_the_logger_cannot_reach_is_queued_as_in_process(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    start_store_logger()
    out = log_or_queue(tmp_path, f"sqlite:///{blocker / 'mlflow.db'}", "exp", REPORT, {}, [], "run",
                       attempts=2, wait_s=(0.01, 0.02))
    assert "mlflow_run_id" not in out and out["mlflow_error"]
    queued = Path(out["mlflow_queued"])
    assert queued.parent == pending_dir(tmp_path).resolve()
    entry = json.loads(queued.read_text())
    assert entry["report"] == REPORT and entry["run_name"] == "run"


def test_a_logger_gone_before_its_job_hands_it_back(tmp_path: Path) -> None:
    start_store_logger()
    child = tracking._store_logger
    assert child is not None
    child._proc.kill()
    child._proc.wait(30)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    out = log_or_queue(tmp_path, uri, "exp", REPORT, {}, [], "run")  # logged here instead
    assert _run(uri, out["mlflow_run_id"])[0] == "FINISHED"


def test_a_logger_that_dies_with_the_job_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:
    helper = StoreLogger()
    proc = helper._proc
    assert proc.stdin is not None and proc.stdout is not None

    # The job is taken, then the process is killed before it answers.
    real_readline = proc.stdout.readline
    calls = []

    def readline() -> str:
        line = real_readline()
        calls.append(line)
        if len(calls) == 1:
            os.kill(proc.pid, signal.SIGKILL)
        return line

    proc.stdout.readline = readline  # type: ignore[method-assign]
    job = {"output": str(tmp_path), "tracking_uri": f"sqlite:///{tmp_path / 'm.db'}",
           "experiment": "exp", "report": REPORT, "params": {}, "artifacts": [], "run_name": "run",
           "attempts": 1, "wait_s": [0.01, 0.02]}
    with pytest.raises(RuntimeError, match="ended with -9 and no answer"):
        helper.run(job)
    assert calls[0].strip() == "taken"


def test_an_unused_logger_is_stopped(tmp_path: Path) -> None:
    start_store_logger()
    child = tracking._store_logger
    assert child is not None
    tracking.stop_store_logger()
    assert tracking._store_logger is None and child._proc.poll() is not None
