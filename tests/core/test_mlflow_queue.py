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


# ------------------------------------------------- a flush while the evaluation is still in stage 7


@pytest.fixture(scope="module")
def late_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The MLflow store a flush logs queued runs into (one per module: creating one costs seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('late') / 'mlflow.db'}"


def stage_7_queued(output: Path, request_id: str, monkeypatch: pytest.MonkeyPatch, *,
                   callback: str | None, flush_during: str, store: str) -> object:
    """Stage 7 of an evaluation of the Courier env whose MLflow store fails (the run is queued),
    with ``evalfleet mlflow flush --mlflow-uri store`` planted during it: ``"queueing"`` right
    after the run was queued, or ``"callback"`` while the trainer holds the callback, which
    answers ``callback`` (an outcome of ``send_report_callback``); ``"never"``: not during it."""
    from types import SimpleNamespace

    import evalfleet.callback
    import evalfleet.pipeline as pipeline
    import tests.core.courier as courier
    from evalfleet import tracking
    from evalfleet.models import EvalRequest
    from evalfleet.report import aggregate
    from tests.core.test_history import _table

    def queue_then_flush(*args: object, **kwargs: object) -> dict[str, str]:
        fast = {**kwargs, "attempts": 1, "wait_s": (0.01, 0.02)}
        out = tracking.log_or_queue(*args, **fast)  # type: ignore[arg-type]
        assert "mlflow_queued" in out, out
        if flush_during == "queueing":
            assert [r["request_id"] for r in flush_pending(output, store)] == [request_id]
        return out

    def trainer_slow_to_answer(url: str, report: dict[str, object], **kwargs: object) -> str:
        if flush_during == "callback":
            assert [r["request_id"] for r in flush_pending(output, store)] == [request_id]
        assert callback is not None
        return callback

    monkeypatch.setattr(pipeline, "log_or_queue", queue_then_flush)
    monkeypatch.setattr(evalfleet.callback, "send_report_callback", trainer_slow_to_answer)
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", "127.0.0.1")
    blocker = output / "blocker"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("a file where the store's folder should be")
    table = _table("careless")
    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careless",
                          episodes=table.num_rows, output=output, cache_dir=output / "cache",
                          request_id=request_id, mlflow_uri=f"sqlite:///{blocker / 'm.db'}",
                          callback_url="http://127.0.0.1:9/cb" if callback else None)
    report = aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                       policy={"sha256": "cd" * 32}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "hit", "key": "cd" * 32}, run_seconds=1.0)
    collected = SimpleNamespace(table=table, fresh=table.slice(0, 0), replays=None, resumed=0)  # no review
    return pipeline.feed_back(request, None, report, collected)  # type: ignore[arg-type]


@pytest.mark.parametrize(("flush_during", "callback"), [
    ("callback", "delivered: HTTP 200 after 1 attempt (8.00 s)"),
    ("callback", "failed after 1 attempt: HTTP 503"),
    ("queueing", None),
])
def test_a_flush_during_stage_7_keeps_its_run_in_report_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_store: str, flush_during: str,
        callback: str | None) -> None:
    """Planted: 'evalfleet mlflow flush' logs the queued run while stage 7 still runs. It wrote
    the run id into report.json; then stage 7 rewrote report.json from memory: 'mlflow_queued',
    naming the removed queue file, and no run id, for good (no later flush found anything)."""
    from mlflow.tracking import MlflowClient

    request_id = f"flushed-{flush_during}-{bool(callback and callback.startswith('failed'))}"
    final = stage_7_queued(tmp_path, request_id, monkeypatch, callback=callback,
                           flush_during=flush_during, store=late_store)
    on_disk = json.loads((tmp_path / "runs" / request_id / "report.json").read_text())
    outputs = on_disk["outputs"]
    client = MlflowClient(tracking_uri=late_store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               f"tags.`evalfleet.request_id` = '{request_id}'")
    assert outputs["mlflow_run_id"] == run.info.run_id and outputs["mlflow_uri"] == late_store
    assert "mlflow_queued" not in outputs and "mlflow_error" not in outputs
    assert outputs["mlflow_queued_after"].startswith("FileExistsError") and outputs["mlflow_logged_late"]
    assert final.outputs == outputs and final.alarms == on_disk["alarms"]  # type: ignore[attr-defined]
    assert flush_pending(tmp_path, late_store) == []  # logged once, nothing left queued
    if callback is not None:
        assert outputs["callback"] == callback
    if callback is not None and callback.startswith("failed"):  # the late alarm reaches that run
        assert on_disk["alarms"][-1].startswith("output_missing: the callback to the trainer: failed")
        tags = client.get_run(run.info.run_id).data.tags
        assert tags["evalfleet.alarm.output_missing"] == "true"


def test_a_run_flushed_after_stage_7_carries_the_final_reports_alarms_and_tags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_store: str) -> None:
    """Planted: the run is queued, then the callback fails (an ``output_missing`` alarm), and the
    store comes back after stage 7 ended. The flush logged the report as it was queued: no
    ``evalfleet.alarm.output_missing`` tag and ``eval/alarm_count`` one short of report.json's."""
    from mlflow.tracking import MlflowClient

    from evalfleet.tracking import alarm_tag, history_tags

    final = stage_7_queued(tmp_path, "flushed-after", monkeypatch,
                           callback="failed after 1 attempt: HTTP 503", flush_during="never",
                           store=late_store)
    assert "mlflow_queued" in final.outputs  # type: ignore[attr-defined]
    [done] = flush_pending(tmp_path, late_store)
    on_disk = json.loads((tmp_path / "runs" / "flushed-after" / "report.json").read_text())
    assert on_disk["outputs"]["mlflow_run_id"] == done["mlflow_run_id"]  # report.json names it
    assert on_disk["alarms"][-1].startswith("output_missing: the callback to the trainer: failed")
    run = MlflowClient(tracking_uri=late_store).get_run(done["mlflow_run_id"])
    tags = run.data.tags
    assert {t for t in tags if t.startswith("evalfleet.alarm.")} == {alarm_tag(a) for a in on_disk["alarms"]}
    assert run.data.metrics["eval/alarm_count"] == len(on_disk["alarms"]) > 0
    assert history_tags(on_disk).items() <= tags.items()
    assert tags["evalfleet.harness_fault"] == str(on_disk["harness_fault"]).lower()


@pytest.mark.parametrize("flushed", ["after the CLI exited", "before --report was written"])
def test_the_report_copy_names_the_run_a_flush_logs_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_store: str, flushed: str) -> None:
    """Planted: the CLI's evaluation queues its MLflow run (the store fails) and writes --report;
    'evalfleet mlflow flush' logs the run later (or while the CLI was about to write the copy).
    Before, report.json named the run and the --report copy still said 'mlflow_error' and
    'mlflow_queued' (a queue file then gone), with no run id, for good."""
    from evalfleet.cli import build_parser, run_eval

    request_id = "copied-" + flushed.split()[0]
    final = stage_7_queued(tmp_path, request_id, monkeypatch, callback=None, flush_during="never",
                           store=late_store)
    queued = Path(final.outputs["mlflow_queued"])  # type: ignore[attr-defined]
    assert queued.exists()
    copy = tmp_path / "copies" / "rq.json"

    def evaluate(request: object) -> object:
        if flushed.startswith("before"):
            assert [r["request_id"] for r in flush_pending(tmp_path, late_store)] == [request_id]
        return final

    args = build_parser().parse_args(["--policy", "tests.core.courier:careless",
                                      "--output", str(tmp_path), "--report", str(copy)])
    run_eval(evaluate, args)  # type: ignore[arg-type]
    if flushed.startswith("after"):
        assert "mlflow_queued" in json.loads(copy.read_text())["outputs"]  # as it was at exit
        [done] = flush_pending(tmp_path, late_store)
        assert done["request_id"] == request_id
    on_disk = json.loads((tmp_path / "runs" / request_id / "report.json").read_text())
    outputs = json.loads(copy.read_text())["outputs"]
    assert outputs.get("mlflow_run_id") == on_disk["outputs"]["mlflow_run_id"]
    assert outputs == on_disk["outputs"]
    assert "mlflow_queued" not in outputs and "mlflow_error" not in outputs
    assert outputs["mlflow_queued_after"].startswith("FileExistsError") and outputs["mlflow_logged_late"]
    assert not queued.exists() and flush_pending(tmp_path, late_store) == []


def test_a_flush_leaves_a_report_copy_path_that_holds_another_evaluation_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_store: str) -> None:
    """The --report path was reused by a later evaluation before the flush: that one's report is
    not this run's to update."""
    from evalfleet.cli import write_report

    final = stage_7_queued(tmp_path, "copy-reused", monkeypatch, callback=None, flush_during="never",
                           store=late_store)
    copy = tmp_path / "rq.json"
    write_report(str(copy), final)
    later = {"request_id": "a-later-one", "outputs": {"mlflow_error": "its own", "mlflow_queued": "x"}}
    copy.write_text(json.dumps(later))
    [done] = flush_pending(tmp_path, late_store)
    assert done["request_id"] == "copy-reused" and json.loads(copy.read_text()) == later
