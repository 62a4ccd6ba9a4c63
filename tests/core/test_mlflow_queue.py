"""An MLflow store unreachable at stage 7 loses nothing: the run is retried, queued, flushed later."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from evalfleet.tracking import flush_pending, log_or_queue, pending_dir

REPORT = {
    "request_id": "r-queued", "policy_sha256": "ab" * 32, "env_id": "CartPole-v1",
    "isolation": "inprocess", "harness_fault": False, "alarms": [], "failures": {},
    "returns": {"mean": 1.0, "std": 0.0, "var": 0.0, "stderr": 0.0, "ci": {"low": 1.0, "high": 1.0},
                "iqm": 1.0, "median": 1.0, "min": 1.0, "max": 1.0},
    "lengths": {"mean": 10.0}, "episodes": 4, "failure_rate": 0.0, "coverage": 1.0, "scored": 4,
    "policy_failure_rate": 0.0, "harness_failure_rate": 0.0, "steps_per_second": 1.0,
    "episodes_per_second": 1.0, "cache": {"reused": 0}, "timings": {"run_episodes": 0.1},
}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_store_is_retried_then_queued_and_flushed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # ours are under test, not MLflow's
    report_json = tmp_path / "report.json"
    report_json.write_text(json.dumps({"outputs": {"episodes": "x", "mlflow_error": "planted"}}))
    down = f"http://127.0.0.1:{closed_port()}"  # loopback, nothing listening
    t0 = time.monotonic()
    out = log_or_queue(tmp_path, down, "exp", REPORT, {"episodes": 4}, [report_json], "run",
                       wait_s=(0.01, 0.02))
    assert time.monotonic() - t0 < 120
    assert "mlflow_run_id" not in out and "Connection" in out["mlflow_error"]
    queued = Path(out["mlflow_queued"])
    assert queued.parent == pending_dir(tmp_path).resolve() and queued.name == "r-queued.json"

    still = flush_pending(tmp_path)  # the store is still down: stays queued
    assert len(still) == 1 and "error" in still[0] and queued.exists()

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the store is back (here: moved)
    [done] = flush_pending(tmp_path, store)
    assert done["request_id"] == "r-queued" and not queued.exists()
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=store).get_run(done["mlflow_run_id"])
    assert run.data.metrics["eval/reward"] == 1.0 and run.data.params["episodes"] == "4"
    outputs = json.loads(report_json.read_text())["outputs"]
    assert outputs["mlflow_run_id"] == done["mlflow_run_id"] and "mlflow_queued" not in outputs
    # Logged now: no 'mlflow_error' beside the run id (read as a failure); what queued it is kept.
    assert "mlflow_error" not in outputs and outputs["mlflow_queued_after"] == "planted"


def test_unwritable_store_path_is_queued(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    out = log_or_queue(tmp_path, f"sqlite:///{blocker / 'mlflow.db'}", "exp", REPORT, {}, [], "run",
                       attempts=2, wait_s=(0.01, 0.02))
    assert "mlflow_queued" in out
    blocker.unlink()
    blocker.mkdir()
    [done] = flush_pending(tmp_path)  # the queued URI itself works now
    assert "mlflow_run_id" in done, done


@pytest.mark.parametrize("attempts", [3])
def test_a_reachable_store_logs_at_once(tmp_path: Path, attempts: int) -> None:
    out = log_or_queue(tmp_path, f"sqlite:///{tmp_path / 'm.db'}", "exp", REPORT, {}, [], "run",
                       attempts=attempts)
    assert set(out) == {"mlflow_uri", "mlflow_run_id"}
    assert not pending_dir(tmp_path).exists()


def test_a_retried_log_leaves_no_half_logged_runs_nor_repeated_trainer_points(tmp_path: Path) -> None:
    """An artifact the store cannot take fails the log after its run was created: each of the
    three attempts left a RUNNING evaluation run of step 7 (to the history's reader, three more
    evaluations of that checkpoint) and logged eval/reward into the trainer's run again."""
    from evalfleet.tracking import mlflow_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow_client(uri)
    trainer = client.create_run(client.create_experiment("trainer")).info.run_id
    report = dict(REPORT, training_run_id=trainer, step=7, request_id="r-half")
    gone = tmp_path / "gone.parquet"  # listed, never written: its upload fails
    out = log_or_queue(tmp_path, uri, "evalfleet", report, {"episodes": 4}, [gone], "run",
                       attempts=3, wait_s=(0.01, 0.02))
    assert "mlflow_queued" in out
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`evalfleet.training_run_id` = '{trainer}'")
    assert runs == []
    assert client.get_metric_history(trainer, "eval/reward") == []
    gone.write_bytes(b"now it exists")
    [flushed] = flush_pending(tmp_path, uri)
    assert "mlflow_run_id" in flushed, flushed
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              f"tags.`evalfleet.training_run_id` = '{trainer}'")
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert [(m.step, m.value) for m in client.get_metric_history(trainer, "eval/reward")] == [(7, 1.0)]


def test_a_deleted_experiment_is_no_store_to_wait_for(tmp_path: Path) -> None:
    # Before, the run was queued as for a store that is down, retried with waits, and the
    # evaluation exited 0; no flush could ever log it.
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store)
    client.delete_experiment(client.create_experiment("gone"))
    t0 = time.monotonic()
    out = log_or_queue(tmp_path, store, "gone", REPORT, {}, [], "run", wait_s=(5.0, 5.0))
    assert time.monotonic() - t0 < 5.0  # tried once: no wait between pointless attempts
    assert out["mlflow_permanent"].startswith("its experiment is deleted in the store: restore it")
    assert Path(out["mlflow_queued"]).exists()  # kept: restored, a flush logs it
    client.restore_experiment(client.get_experiment_by_name("gone").experiment_id)
    [done] = flush_pending(tmp_path)
    assert "mlflow_run_id" in done, done


def test_two_flushes_of_one_queue_at_once_log_a_queued_run_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: while one flush logs the queued run, another flush of the same queue runs (here a
    thread; two processes alike). Before, both logged it: two MLflow runs of one evaluation."""
    import threading

    from mlflow.tracking import MlflowClient

    from evalfleet import tracking

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    out = log_or_queue(tmp_path, f"sqlite:///{blocker / 'm.db'}", "exp", REPORT, {}, [], "run",
                       attempts=1, wait_s=(0.01, 0.02))
    assert "mlflow_queued" in out
    real, second = tracking.log_evaluation, []

    def log_while_another_flushes(*args: object, **kwargs: object) -> str:
        if not second:  # the first flush, mid-log: the second one starts and ends meanwhile
            thread = threading.Thread(target=lambda: second.append(flush_pending(tmp_path, store)))
            second.append(None)
            thread.start()
            thread.join(timeout=120)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tracking, "log_evaluation", log_while_another_flushes)
    [first] = flush_pending(tmp_path, store)
    assert "mlflow_run_id" in first, first
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.`evalfleet.request_id` = 'r-queued'")
    assert [r.info.run_id for r in runs] == [first["mlflow_run_id"]]  # before: two runs
    assert second[1] == [{"pending": first["pending"], "error": tracking.BUSY, "busy": "true"}]
    assert flush_pending(tmp_path, store) == []  # nothing left queued


def test_a_flush_that_waits_finds_the_run_another_logged_meanwhile_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A history read waits for a queued run another process is logging (``wait_s``): once it is
    logged there is nothing left to do, and the earlier step is in the store, not queued."""
    import threading

    from evalfleet import tracking

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    log_or_queue(tmp_path, f"sqlite:///{blocker / 'm.db'}", "exp", REPORT, {}, [], "run",
                 attempts=1, wait_s=(0.01, 0.02))
    real, waiter = tracking.log_evaluation, []

    def log_while_another_waits(*args: object, **kwargs: object) -> str:
        if not waiter:
            waiter.append(threading.Thread(
                target=lambda: waiter.append(flush_pending(tmp_path, store, wait_s=60))))
            waiter[0].start()
            time.sleep(0.5)  # the other flush is waiting for this one's lock now
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tracking, "log_evaluation", log_while_another_waits)
    [first] = flush_pending(tmp_path, store)
    waiter[0].join(timeout=120)
    assert "mlflow_run_id" in first and waiter[1] == []
