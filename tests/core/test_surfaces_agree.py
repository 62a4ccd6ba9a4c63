"""Every surface of one evaluation tells the story its report.json and its history tell.

Planted cases on the real stores (``tests.core.test_history``'s ``evaluate_checkpoint``: stage 7's
history step and the real MLflow logging into a SQLite store), on the ``Courier`` env.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pytest
from mlflow.tracking import MlflowClient

from evalfleet.cli import EXIT_OK, run_history
from evalfleet.history import checkpoints, report_curve_row
from evalfleet.summary import summary_text
from tests.core.test_history import _table, evaluate_checkpoint


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow store and cache for the module; every test keeps to its own training run ids."""
    return tmp_path_factory.mktemp("surfaces")


def _set(table: pa.Table, name: str, values: dict[int, object]) -> pa.Table:
    """``table`` with column ``name`` set to ``values`` at those rows."""
    i = table.schema.get_field_index(name)
    column = table.column(name).to_pylist()
    for row, value in values.items():
        column[row] = value
    return table.set_column(i, table.schema.field(i), pa.array(column, table.schema.field(i).type))


def _faulted(policy: str, lost: int = 3) -> pa.Table:
    """``policy``'s episodes with the first ``lost`` of 40 lost to the harness (a harness fault)."""
    return _set(_table(policy), "end_reason", dict.fromkeys(range(lost), "env_error"))


def test_a_harness_fault_is_never_the_best_checkpoint_on_any_surface(store, tmp_path, capsys):
    """Step 2 (careful, 3 of 40 episodes lost to the harness: coverage 92.5%) beats step 1 on
    its 37 scored pairs. Before, it was new_best with ``best_step`` 2 in report.json, tagged
    ``evalfleet.best=true`` and ``eval/best_step`` 2 in MLflow, starred in ``evalfleet history``,
    while the history that judged step 3 skipped it (a harness fault) for step 1."""
    import torch

    from evalfleet.client import Evaluator
    from evalfleet.review import report_page

    uri = f"sqlite:///{store / 'mlflow.db'}"
    first = evaluate_checkpoint(store, "careless", 1, run="faulted-best")
    faulted = evaluate_checkpoint(store, "careful", 2, run="faulted-best", table=_faulted("careful"))
    assert faulted.harness_fault and faulted.coverage == 37 / 40
    h = faulted.history
    assert h["verdict"] == "new_best" and h["compared_with"]["step"] == 1
    assert (h["best_step"], h["best_policy_sha256"]) == (1, first.policy_sha256)
    assert h["best_withheld"] == ["harness_fault"]
    assert "; best checkpoint: step 1 (this one is never the best: harness_fault)" in summary_text(faulted)
    page = report_page(faulted, [], {}, tmp_path / "report.html").read_text()
    assert "Best checkpoint: step 1" in page and "never the best: harness_fault" in page
    assert report_curve_row(faulted.model_dump(mode="json"))["best"] is False
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("evalfleet").experiment_id],
                               "tags.`evalfleet.request_id` = 'faulted-best-careful-2-0'")
    assert run.data.tags["evalfleet.best"] == "false"
    assert run.data.tags["evalfleet.best_step"] == "1"
    assert run.data.tags["evalfleet.best_withheld"] == "harness_fault"
    assert run.data.metrics["eval/best_step"] == 1
    assert [(c.step, c.best) for c in checkpoints(uri, "faulted-best")] == [(1, True), (2, False)]
    args = argparse.Namespace(training_run_id="faulted-best", output=str(store), mlflow_uri=None,
                              plot=None, json=False)
    capsys.readouterr()
    assert run_history(args) == EXIT_OK
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:3]]
    assert [(r[0], r[7], "*" in r) for r in rows] == [("1", "first", True), ("2", "new_best", False)]
    # The history judges step 3 against step 1, as every surface now says.
    later = evaluate_checkpoint(store, "careful", 3, run="faulted-best")
    assert (later.history["compared_with"]["step"], later.history["best_step"]) == (1, 3)
    reports = iter([first, faulted])
    with Evaluator(env="CartPole-v1", num_episodes=4, output=tmp_path / "ev",
                   runner=lambda request: next(reports)) as ev:
        results = [ev.evaluate(torch.nn.Linear(4, 2), step=s) for s in (1, 2)]
    assert [r["eval/best_step"] for r in results] == [1, 1]
    assert (ev.best_step, ev.best_policy_sha256) == (1, first.policy_sha256)


def test_a_first_checkpoint_that_is_a_harness_fault_is_no_best(store, tmp_path):
    """Before, a faulted first checkpoint was ``best_step`` 1 everywhere (``Evaluator.best_step``
    too) while the next step's history said no earlier checkpoint was trusted."""
    import torch

    from evalfleet.client import Evaluator

    uri = f"sqlite:///{store / 'mlflow.db'}"
    faulted = evaluate_checkpoint(store, "careful", 1, run="faulted-first", table=_faulted("careful"))
    h = faulted.history
    assert (h["verdict"], h["best_step"], h["best_policy_sha256"]) == ("first", None, None)
    assert h["best_withheld"] == ["harness_fault"]
    assert ("no best checkpoint under this protocol (this one is never the best: harness_fault)"
            in summary_text(faulted))
    [cp] = checkpoints(uri, "faulted-first")
    assert cp.best is False and cp.withheld
    later = evaluate_checkpoint(store, "careless", 2, run="faulted-first")
    assert (later.history["verdict"], later.history["best_step"]) == ("no_paired_episodes", None)
    reports = iter([faulted, later])
    with Evaluator(env="CartPole-v1", num_episodes=4, output=tmp_path / "ev",
                   runner=lambda request: next(reports)) as ev:
        results = [ev.evaluate(torch.nn.Linear(4, 2), step=s) for s in (1, 2)]
    assert [r["eval/best_step"] for r in results] == [None, None]
    assert ev.best_step is None


def test_failures_that_flatter_a_checkpoint_keep_the_earlier_best_in_its_report(store):
    """One episode the policy ended with a return above the completed ones' (the README:
    ``history.best_step`` stays the earlier best, ``best_withheld`` names the alarm). Before,
    only the MLflow tag said so: report.json, ``eval/best_step`` and the result said step 2."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    first = evaluate_checkpoint(store, "careless", 1, run="flattered")
    table = _set(_set(_table("careful"), "end_reason", {0: "policy_error"}), "return", {0: 50.0})
    flattered = evaluate_checkpoint(store, "careful", 2, run="flattered", table=table)
    assert any(a.startswith("policy_failures_flatter:") for a in flattered.alarms)
    h = flattered.history
    assert h["verdict"] == "new_best"
    assert (h["best_step"], h["best_policy_sha256"]) == (1, first.policy_sha256)
    assert h["best_withheld"] == ["history_pairs_policy_flatter", "policy_failures_flatter"]
    [run] = [c for c in checkpoints(uri, "flattered") if c.step == 2]
    assert run.metrics["eval/best_step"] == 1 and run.best is False


def _stage_7(output: Path, request_id: str, *, callback_url: str | None = None):
    """Stage 7 of an evaluation of ``careless`` (no training run) with its review: plots and page
    (its replays planted as failed, which is a note, not an alarm)."""
    from types import SimpleNamespace

    import tests.core.courier as courier
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import feed_back
    from evalfleet.report import aggregate
    from evalfleet.review_replays import ReviewReplays

    table = _table("careless")
    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careless",
                          episodes=table.num_rows, output=output, cache_dir=output / "cache",
                          request_id=request_id, callback_url=callback_url)
    report = aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                       policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "miss", "key": "ab" * 32}, run_seconds=1.0)
    collected = SimpleNamespace(table=table, fresh=table,
                                replays=ReviewReplays("cpu", error="RuntimeError: planted"))
    return feed_back(request, None, report, collected)  # type: ignore[arg-type]


def _shown(page: str) -> list[str]:
    """The alarm boxes of a report page, by name."""
    import html
    import re

    return [html.unescape(a).split(":", 1)[0]
            for a in re.findall(r'<div class="alarm"><strong>ALARM</strong> ([^<]*)</div>', page)]


def test_an_alarm_raised_after_mlflow_logged_the_run_reaches_the_page_and_its_artifacts(
        tmp_path, monkeypatch):
    """The trainer's callback is refused (nothing listens on its port): ``output_missing`` comes
    after the page was rendered and the MLflow run logged. Before, report.json, the Prefect state
    and the run's tags had it, while report.html (the file and MLflow's copy) and MLflow's
    report.json did not: the page showed only the alarms of the review."""
    import json
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "surfaces-callback-secret")
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", f"127.0.0.1:{port}")
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "1")
    final = _stage_7(tmp_path, "late-callback", callback_url=f"http://127.0.0.1:{port}/cb")
    names = [a.split(":", 1)[0] for a in final.alarms]
    assert names[-1] == "output_missing" and "mlflow_alarms_error" not in final.outputs
    assert json.loads(Path(final.outputs["report"]).read_text())["alarms"] == final.alarms
    assert _shown(Path(final.outputs["report_html"]).read_text()) == names
    client = MlflowClient(final.outputs["mlflow_uri"])
    run = client.get_run(final.outputs["mlflow_run_id"])
    assert run.data.tags["evalfleet.alarm.output_missing"] == "true"
    copies = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "copies")))
    assert json.loads((copies / "report.json").read_text())["alarms"] == final.alarms
    assert _shown((copies / "report.html").read_text()) == names


def test_an_mlflow_run_that_cannot_be_logged_is_an_alarm_on_the_page(tmp_path, monkeypatch):
    """The experiment is deleted in the store (planted: the answer ``log_or_queue`` gives then).
    Before, report.json had ``output_missing: the MLflow run ...`` and the page did not."""
    import evalfleet.pipeline as pipeline

    queued = {"mlflow_error": "MlflowException: planted", "mlflow_queued": str(tmp_path / "q.json"),
              "mlflow_permanent": "its experiment is deleted in the store (planted)"}
    monkeypatch.setattr(pipeline, "log_or_queue", lambda *args, **kwargs: dict(queued))
    final = _stage_7(tmp_path, "late-mlflow")
    assert final.alarms[-1].startswith("output_missing: the MLflow run: its experiment is deleted")
    assert _shown(Path(final.outputs["report_html"]).read_text()) == [
        a.split(":", 1)[0] for a in final.alarms]


def test_a_harness_fault_just_past_the_threshold_never_reads_as_the_threshold(tmp_path, capsys):
    """6 of 119 episodes lost to the harness: coverage 94.96%, 5.04% unscored. Before, the alarm
    said "5.0% ... (> 5%, coverage 95.0%)", as did the CLI's exit message and the Prefect state,
    while the summary said 94.96%: the fault stood on a number equal to its threshold."""
    import tests.core.courier as courier
    from evalfleet.cli import EXIT_HARNESS_FAULT, build_parser, run_eval
    from evalfleet.models import EvalRequest
    from evalfleet.report import aggregate
    from flows.api_ledger import final_state

    table = _table("careless")
    table = pa.concat_tables([table, table, table]).slice(0, 119)
    table = _set(table, "episode_index", {i: i for i in range(119)})
    table = _set(table, "end_reason", dict.fromkeys(range(6), "env_error"))
    request = EvalRequest(env=courier.ENV_ID, policy="tests.core.courier:careless", episodes=119,
                          output=tmp_path)
    report = aggregate(request, table, env_spec={"env_id": courier.ENV_ID}, env_spec_hash="spec",
                       policy={"sha256": "cd" * 32}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "miss", "key": "cd" * 32}, run_seconds=1.0)
    assert report.harness_fault and report.scored == 113
    [alarm] = [a for a in report.alarms if a.startswith("harness_failures:")]
    assert alarm.startswith("harness_failures: 5.04% of episodes could not be scored (env_error=6; "
                            "> 5%, coverage 94.96%)")
    assert "coverage              94.96% (113/119 episodes scored)" in summary_text(report)
    assert final_state(report).message.startswith("coverage 94.96%; harness_failures: 5.04% ")
    args = build_parser().parse_args(["--policy", "tests.core.courier:careless",
                                      "--output", str(tmp_path)])
    capsys.readouterr()
    assert run_eval(lambda request: report, args) == EXIT_HARNESS_FAULT
    assert ("evalfleet: harness fault: more than 5% of episodes failed in the harness (coverage "
            "94.96%)") in capsys.readouterr().err
    # Away from the threshold the texts keep one decimal (the summary's figure, rounded).
    from evalfleet.summary import percent_beyond

    assert [percent_beyond(s, 0.95) for s in (113 / 119, 0.9, 1 - 1 / 2001, 1.0)] == [
        "94.96%", "90.0%", ">99.9%", "100.0%"]
    assert percent_beyond(0.0500004, 0.05) == "5.00004%"
