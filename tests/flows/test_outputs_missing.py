"""An output asked for and not produced fails the run loudly: never a log line and exit 0.

Planted, with real components: an MLflow store that can neither be written nor queued for (the
CLI exits 5), a trainer callback nobody answers and an ``on_result`` that raises (the
``Evaluator``'s fast path returns the numbers first; ``flush()`` and ``shutdown()`` raise what
its background stage 7 could not produce), and a callback that could never be signed or sent
(refused at stage 1, before anything is spawned).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from evalfleet.cli import EXAMPLE_POLICY, EXIT_OUTPUT_MISSING, run_cli
from evalfleet.client import Evaluator
from evalfleet.errors import OutputsMissing, RequestError
from evalfleet.models import EvalRequest
from evalfleet.pipeline import receive
from flows.eval import evaluate
from flows.local_runner import LocalFlowRunner

pytestmark = pytest.mark.slow


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mlp() -> torch.nn.Module:
    """A CartPole policy (module level: the state_dict's factory)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_cli_exits_5_when_the_mlflow_run_is_neither_logged_nor_queued(prefect_server, tmp_path,
                                                                       capsys, monkeypatch):
    import socket

    out = tmp_path / "out"
    out.mkdir()
    (out / "mlflow-pending").write_text("a file where the queue's folder goes\n")
    # A store that is down (loopback, nothing listening): a local store that can never be made
    # is refused at stage 1 now, so the failure to log comes from the network.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        store = f"http://127.0.0.1:{s.getsockname()[1]}"
    code = run_cli(evaluate, ["--episodes", "4", "--concurrency", "4", "--output", str(out),
                              "--mlflow-uri", store, "--no-audit", "--quiet"])
    err = capsys.readouterr().err
    assert code == EXIT_OUTPUT_MISSING, err
    assert "outputs asked for are missing: the MLflow run (neither logged nor queued)" in err
    [report_json] = (out / "runs").glob("*/report.json")
    report = json.loads(report_json.read_text())
    assert [a for a in report["alarms"] if a.startswith("output_missing: the MLflow run")]
    assert (report_json.parent / "episodes.parquet").exists()  # the numbers are kept


def test_a_callback_that_could_never_be_sent_is_refused_at_stage_1(monkeypatch, tmp_path):
    request = EvalRequest.build(env="CartPole-v1", policy=EXAMPLE_POLICY, episodes=4, output=tmp_path,
                                callback_url="http://127.0.0.1:9/cb")
    monkeypatch.delenv("EVALFLEET_CALLBACK_SECRET", raising=False)
    with pytest.raises(RequestError, match="EVALFLEET_CALLBACK_SECRET is not set in this process"):
        receive(request)
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "k")
    monkeypatch.delenv("EVALFLEET_ALLOWED_HOSTS", raising=False)  # loopback is not allowed then
    with pytest.raises(RequestError, match=r"callback_url 'http://127.0.0.1:9/cb' cannot be reached"):
        receive(request)
    metadata = request.model_copy(update={"callback_url": "http://169.254.169.254/latest"})
    with pytest.raises(RequestError, match="cannot be reached from here"):
        receive(metadata)  # refused on the parsed address: nothing is ever connected to
    from evalfleet.suite import load_suite
    from flows.suite import evaluate_suite

    suite = load_suite(Path(__file__).resolve().parents[2] / "examples" / "suite.toml")
    with pytest.raises(RequestError, match="callback_url 'http://127.0.0.1:9/cb' cannot be reached"):
        evaluate_suite(suite, request)  # the suite's report would go there: refused first


def test_flush_and_shutdown_raise_what_the_fast_path_could_not_produce(prefect_server, tmp_path,
                                                                      monkeypatch):
    port = closed_port()
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "k")
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", f"127.0.0.1:{port}")
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "1")

    def on_result(result: dict) -> None:
        raise RuntimeError("the trainer's logger is down")

    runner = LocalFlowRunner(workers=1)
    ev = Evaluator(env="CartPole-v1", policy_factory=mlp, num_episodes=4, concurrency=4,
                   output=tmp_path / "out", runner=runner, on_result=on_result, audit=False,
                   callback_url=f"http://127.0.0.1:{port}/cb")
    try:
        first = ev.evaluate(mlp(), step=1)["report"]
        assert first.outputs["feed_back"] == "pending"  # the numbers came first
        with pytest.raises(OutputsMissing) as raised:
            ev.flush(timeout=300)
        text = str(raised.value)
        assert f"{first.request_id}: the callback to the trainer: failed after 1 attempt" in text
        assert "on_result raised for step 1: RuntimeError: the trainer's logger is down" in text
        final = ev.final_report(first.request_id).result()
        assert final.missing_outputs and final.missing_outputs[0].startswith(
            "the callback to the trainer: failed after 1 attempt")
        on_disk = json.loads(Path(final.outputs["report"]).read_text())
        assert on_disk["alarms"] == final.alarms
        ev.flush()  # each problem is raised once

        second = ev.evaluate(mlp(), step=2)["report"]
        with pytest.raises(TimeoutError, match="still running after 0 s"):
            ev.flush(timeout=0)  # stage 7 of the second evaluation has not run yet
    except BaseException:
        ev.shutdown(wait=False)
        raise
    with pytest.raises(OutputsMissing) as raised:
        ev.shutdown()
    assert f"{second.request_id}: the callback to the trainer" in str(raised.value)
    assert "on_result raised for step 2" in str(raised.value)


def test_flush_raises_an_alarm_stage_7_found_after_the_numbers_went_back(prefect_server, tmp_path):
    """Videos asked for, and the renderer breaks in stage 7's replays: the full flow says
    ``recording_incomplete`` and a harness fault; the fast path returned neither, and ``flush()``
    raised nothing, so the trainer never heard of it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    runner = LocalFlowRunner(workers=1)
    ev = Evaluator(env="tests.flows.render_envs:RenderDiesLater-v0", num_episodes=6,
                   concurrency=6, record_video=2, output=tmp_path / "out", runner=runner)
    try:
        fast = ev.evaluate(net, step=1)
        assert fast["eval/harness_fault"] is False  # what the trainer got first
        with pytest.raises(OutputsMissing) as raised:
            ev.flush(timeout=300)
        text = str(raised.value)
        # A missing recording is a missing output (report.missing_outputs), named as such.
        assert f"{fast['report'].request_id}: recording_incomplete: wrote" in text
        assert "the evaluation is a harness fault (the returned result said not)" in text
        final = ev.final_report(fast["report"].request_id).result()
        assert final.harness_fault
    finally:
        ev.shutdown(wait=False)


def test_a_failed_review_is_an_alarm_in_the_mlflow_run_as_in_report_json(prefect_server, tmp_path,
                                                                         monkeypatch):
    # Before, report.json and the exit code said the review's outputs were missing, while the
    # MLflow run (its alarm tags and its copy of report.json) said nothing: `evalfleet history`
    # and any dashboard on the store showed a clean evaluation.
    from mlflow.tracking import MlflowClient

    import evalfleet.plots

    def broken(*args, **kwargs):
        raise OSError("planted: the plots folder cannot be written")

    monkeypatch.setattr(evalfleet.plots, "render_plots", broken)  # stage 7 runs in this process
    out, rid = tmp_path / "out", "reviewfails0001"
    request = EvalRequest.build(policy=EXAMPLE_POLICY, episodes=8, concurrency=8, workers=1,
                                output=out, request_id=rid, audit=False, cache="off")
    report = evaluate(request)
    missing = [a for a in report.alarms if a.startswith("output_missing: the review")]
    assert len(missing) == 1, report.alarms
    assert json.loads(Path(report.outputs["report"]).read_text())["alarms"] == report.alarms
    client = MlflowClient(report.outputs["mlflow_uri"])
    run = client.get_run(report.outputs["mlflow_run_id"])
    assert run.data.tags.get("evalfleet.alarm.output_missing") == "true"
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, "report.json",
                                                       str(tmp_path))).read_text())
    assert logged["alarms"] == report.alarms
