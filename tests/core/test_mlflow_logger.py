"""The shared MLflow logger: a CLI run's MLflow run, logged by a process that keeps MLflow imported."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from evalfleet import mlflow_logger, tracking
from evalfleet.server import locked
from tests.core.test_mlflow_queue import REPORT


def _report(request_id: str) -> dict:
    return {**REPORT, "request_id": request_id}


def _runs(db: Path) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def _server_recorded(home: Path) -> None:
    """A live local server's record (this process: never signalled, it runs no Prefect server)."""
    (home / "server.json").write_text(json.dumps({
        "url": "http://127.0.0.1:9/api", "port": 9, "pid": os.getpid(), "started": time.time(),
        "prefect_home": str(home / "prefect")}))


@pytest.fixture
def shared(home: Path) -> Iterator[mlflow_logger.LoggerRecord]:
    """A real logger process of this code, listening; stopped at teardown."""
    _server_recorded(home)
    try:
        with mlflow_logger.opted_in():
            mlflow_logger.ensure_started()
            deadline = time.monotonic() + 120
            while (record := mlflow_logger.usable()) is None:
                assert time.monotonic() < deadline, (home / "mlflow-logger.log").read_text()
                time.sleep(0.1)
        assert record.pid != os.getpid()
        yield record
    finally:
        with locked():
            mlflow_logger.stop()


def _not_here(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("logged in the CLI's own process")

    monkeypatch.setattr(tracking, "log_or_queue", refuse)


def test_the_logger_logs_the_run_this_process_would_have(shared, tmp_path, monkeypatch):
    here = tracking.log_or_queue(tmp_path / "a", tracking.default_tracking_uri(tmp_path / "a"), "exp",
                                 _report("r-here"), {"episodes": 4}, [], "run")
    _not_here(monkeypatch)
    with mlflow_logger.opted_in():
        there = mlflow_logger.log_or_queue(tmp_path / "b", tracking.default_tracking_uri(tmp_path / "b"),
                                           "exp", _report("r-there"), {"episodes": 4}, [], "run")
    assert set(here) == set(there) == {"mlflow_uri", "mlflow_run_id"}
    [a], [b] = _runs(tmp_path / "a" / "mlflow.db"), _runs(tmp_path / "b" / "mlflow.db")
    assert b.info.run_id == there["mlflow_run_id"] and b.info.status == "FINISHED"
    assert a.data.metrics == b.data.metrics and a.data.params == b.data.params
    volatile = {"evalfleet.request_id", "mlflow.user", "mlflow.source.name"}
    assert ({k: v for k, v in a.data.tags.items() if k not in volatile}
            == {k: v for k, v in b.data.tags.items() if k not in volatile})


def test_a_results_folder_made_again_gets_its_run_in_the_new_store(shared, tmp_path, monkeypatch):
    """A store deleted and made again between two runs: a cached engine wrote into the deleted file."""
    _not_here(monkeypatch)
    out = tmp_path / "out"
    uri = tracking.default_tracking_uri(out)
    with mlflow_logger.opted_in():
        first = mlflow_logger.log_or_queue(out, uri, "exp", _report("r-1"), {}, [], "run")
        shutil.rmtree(out)
        second = mlflow_logger.log_or_queue(out, uri, "exp", _report("r-2"), {}, [], "run")
    assert first["mlflow_run_id"] != second["mlflow_run_id"]
    assert [r.info.run_id for r in _runs(out / "mlflow.db")] == [second["mlflow_run_id"]]


def test_a_store_that_fails_is_queued_and_its_log_lines_reach_the_run(shared, tmp_path, monkeypatch, caplog):
    _not_here(monkeypatch)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    with mlflow_logger.opted_in(), caplog.at_level("ERROR"):
        out = mlflow_logger.log_or_queue(tmp_path, f"sqlite:///{blocker / 'mlflow.db'}", "exp",
                                         _report("r-down"), {}, [], "run")
    assert Path(out["mlflow_queued"]) == (tracking.pending_dir(tmp_path) / "r-down.json").resolve()
    assert Path(out["mlflow_queued"]).exists()
    assert any("queued as" in r.getMessage() and r.name == "evalfleet.tracking" for r in caplog.records)


def _message(tmp_path: Path, **changes) -> dict:  # type: ignore[no-untyped-def]
    here = os.stat(tmp_path)
    request = {"output": str(tmp_path), "tracking_uri": tracking.default_tracking_uri(tmp_path),
               "experiment": "exp", "report": _report("r-msg"), "params": {}, "artifacts": [],
               "run_name": "run"}
    return {"token": "t", "cwd": str(tmp_path), "cwd_id": [here.st_dev, here.st_ino], "umask": 0o22,
            "environ": {}, "request": request, **changes}


def test_a_caller_whose_folder_is_another_here_is_refused(tmp_path, monkeypatch):
    """A caller in a private mount view (its folder another folder here) logs in its own process."""
    monkeypatch.chdir(tmp_path)  # handle() moves to the caller's folder: this test's is restored
    other = tmp_path / "other"
    other.mkdir()
    answer = mlflow_logger.handle(_message(tmp_path, cwd=str(other)), "t")
    assert "is another folder here" in answer["refused"]
    answer = mlflow_logger.handle(_message(tmp_path, cwd=str(tmp_path / "gone")), "t")
    assert "not here" in answer["refused"]
    assert not (tmp_path / "mlflow.db").exists()


def test_a_peer_in_this_mount_view_is_accepted():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        assert mlflow_logger._peer_refusal(ours) is None


def test_the_pending_file_of_a_private_caller_stays_private(shared, tmp_path, monkeypatch):
    """The worker takes on the caller's umask: a queued run's full report is not world-readable."""
    _not_here(monkeypatch)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    before = os.umask(0o077)
    try:
        with mlflow_logger.opted_in():
            out = mlflow_logger.log_or_queue(tmp_path / "out", f"sqlite:///{blocker / 'mlflow.db'}",
                                             "exp", _report("r-private"), {}, [], "run")
    finally:
        os.umask(before)
    assert Path(out["mlflow_queued"]).stat().st_mode & 0o777 == 0o600


def test_a_caller_whose_folder_was_removed_logs_in_its_own_process(shared, tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    out = tmp_path / "out"
    with mlflow_logger.opted_in():  # as in its own process: MLflow needs a folder, so it is queued
        got = mlflow_logger.log_or_queue(out, tracking.default_tracking_uri(out), "exp",
                                         _report("r-nocwd"), {}, [], "run", attempts=1)
    assert Path(got["mlflow_queued"]) == tracking.pending_dir(out) / "r-nocwd.json"
    monkeypatch.chdir(tmp_path)
    [flushed] = tracking.flush_pending(out)  # not lost: the next flush logs it
    assert [r.info.run_id for r in _runs(out / "mlflow.db")] == [flushed["mlflow_run_id"]]


def test_a_logger_is_not_started_once_the_server_is_gone(home):
    with mlflow_logger.opted_in():
        mlflow_logger.ensure_started()  # no server recorded: `evalfleet server stop` came first
    assert mlflow_logger.read_record() is None


def test_a_wrong_token_logs_nothing(shared, tmp_path):
    request = {"output": str(tmp_path), "tracking_uri": tracking.default_tracking_uri(tmp_path),
               "experiment": "exp", "report": _report("r-forged"), "params": {}, "artifacts": [],
               "run_name": "run"}
    forged = mlflow_logger.LoggerRecord(pid=shared.pid, key=shared.key, started=0.0,
                                        address=shared.address, token="0" * 64)
    with pytest.raises(mlflow_logger._NotSent, match="wrong token"):
        mlflow_logger._ask(forged, request)
    assert not (tmp_path / "mlflow.db").exists()


def test_a_logger_of_other_code_or_not_opted_in_is_not_used(shared, tmp_path):
    assert mlflow_logger.usable() is None  # outside the CLI's run
    with mlflow_logger.opted_in():
        assert mlflow_logger.usable() == shared
        with locked():
            mlflow_logger._write_record(mlflow_logger.LoggerRecord(
                pid=shared.pid, key="other code", started=shared.started, address=shared.address,
                token=shared.token))
        assert mlflow_logger.usable() is None
        out = mlflow_logger.log_or_queue(tmp_path, tracking.default_tracking_uri(tmp_path), "exp",
                                         _report("r-other"), {}, [], "run")  # logged here
    assert [r.info.run_id for r in _runs(tmp_path / "mlflow.db")] == [out["mlflow_run_id"]]


def test_a_logger_dying_before_its_answer_leaves_one_run(home, tmp_path, monkeypatch):
    """The logger logged the run, then died: the run is adopted, not logged twice."""
    out = tmp_path / "out"
    uri = tracking.default_tracking_uri(out)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0evalfleet-test-dying-logger")
    listener.listen(1)

    def die_after_logging() -> None:
        conn, _ = listener.accept()
        mlflow_logger._send(conn, {"worker": os.getpid()})
        message = mlflow_logger._receive(conn)
        req = message["request"]
        tracking.log_or_queue(Path(req["output"]), req["tracking_uri"], req["experiment"],
                              req["report"], req["params"], [], req["run_name"])
        conn.close()  # no answer

    thread = threading.Thread(target=die_after_logging)
    thread.start()
    with locked():
        mlflow_logger._write_record(mlflow_logger.LoggerRecord(
            pid=os.getpid(), key=mlflow_logger.code_key(), started=time.time(),
            address="evalfleet-test-dying-logger", token="t"))
    with mlflow_logger.opted_in():
        got = mlflow_logger.log_or_queue(out, uri, "exp", _report("r-lost"), {}, [], "run")
    thread.join()
    listener.close()
    runs = _runs(out / "mlflow.db")
    assert [r.info.run_id for r in runs] == [got["mlflow_run_id"]]


def test_an_adopted_run_gets_the_trainer_point_its_logger_died_before(tmp_path, monkeypatch):
    uri = tracking.default_tracking_uri(tmp_path)
    client = tracking.mlflow_client(uri)
    trainer = client.create_run(tracking._experiment_id(client, uri, "train")).info.run_id
    report = {**_report("r-trainer"), "training_run_id": trainer, "step": 7}
    real = tracking.log_into_trainer_run
    monkeypatch.setattr(tracking, "log_into_trainer_run", lambda *a: 0)  # it died right before
    run_id = tracking.log_evaluation(uri, "exp", report, {}, [], "run")
    assert client.get_metric_history(trainer, "eval/reward") == []
    monkeypatch.setattr(tracking, "log_into_trainer_run", real)
    assert tracking.log_evaluation(uri, "exp", report, {}, [], "run", adopt=True) == run_id
    assert tracking.log_evaluation(uri, "exp", report, {}, [], "run", adopt=True) == run_id
    points = client.get_metric_history(trainer, "eval/reward")
    assert [(p.step, p.value) for p in points] == [(7, 1.0)]  # once, however often adopted


def test_adopting_deletes_a_run_left_unfinished(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    client = tracking.mlflow_client(uri)
    exp = tracking._experiment_id(client, uri, "exp")
    half = client.create_run(exp, tags={"evalfleet.request_id": "r-half"}).info.run_id
    run_id = tracking.log_evaluation(uri, "exp", _report("r-half"), {}, [], "run", adopt=True)
    assert run_id != half
    assert [r.info.run_id for r in _runs(tmp_path / "mlflow.db")] == [run_id]
    assert tracking.log_evaluation(uri, "exp", _report("r-half"), {}, [], "run", adopt=True) == run_id


def test_the_cli_runs_mlflow_without_its_telemetry_unless_the_user_chose(monkeypatch):
    """MLflow's telemetry sends events to its servers from any process importing it, outside CI."""
    from evalfleet.cli import run_cli
    from evalfleet.errors import RequestError

    seen: list[str | None] = []

    def evaluate(request):  # type: ignore[no-untyped-def]
        seen.append(os.environ.get("MLFLOW_DISABLE_TELEMETRY"))
        raise RequestError("planted: stop here")

    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    assert run_cli(evaluate, ["--episodes", "2"]) == 2
    assert seen == ["true"] and "MLFLOW_DISABLE_TELEMETRY" not in os.environ  # this process's own
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "false")
    assert run_cli(evaluate, ["--episodes", "2"]) == 2
    assert seen == ["true", "false"]


def test_the_logger_warms_up_single_threaded_with_telemetry_off(home, monkeypatch):
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    for name in ("PYTEST_CURRENT_TEST", "CI"):  # MLflow's own "testing" switch would hide it
        monkeypatch.delenv(name, raising=False)
    # MLflow makes its telemetry client on import, then fetches its config from the internet on a
    # thread: with telemetry off there is no client at all, so nothing is sent or tried.
    probe = ("import threading; from evalfleet import mlflow_logger as m, tracking; "
             "tracking.telemetry_off(); import mlflow; "
             "from mlflow.telemetry.client import get_telemetry_client as c; none = c() is None; "
             "ok = m._warmed_up(); print(none, ok, threading.active_count())")
    env = {k: v for k, v in os.environ.items()}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == ["True", "True", "1"], done.stderr[-2000:]
