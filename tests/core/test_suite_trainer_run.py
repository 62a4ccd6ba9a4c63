"""A suite in a training loop: what reaches the trainer's run, its history and its gate.

Planted, each failing on the version before:
- every task of a suite logged its own mean as ``eval/reward`` into the trainer's MLflow run at
  the same step (the chart showed whichever task came last, not the suite's IQM);
- the baseline's task requests kept the step, so the baseline (logged after the policy) became
  the training run's checkpoint of that step, and the next step was judged against it;
- ``--suite --gate`` exited 0 whatever the tasks' verdicts: the gate was never looked at;
- the in-loop result's ``eval/alarms`` named only the history's alarms (a harness fault gave
  ``[]``), and MLflow's ``eval/verdict`` coded "compared nothing" verdicts as 0.0, the code of
  "compared, no difference".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mlflow.tracking import MlflowClient

from evalfleet.cli import EXIT_BAD_REQUEST, run_cli
from evalfleet.client import history_result
from evalfleet.models import EvalRequest
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.seeds import SeedLedger
from evalfleet.suite import baseline_requests, parse_suite, task_requests
from evalfleet.tracking import history_metrics, log_evaluation, log_suite

SUITE = parse_suite({"suite": {"name": "two"}, "task": [{"env": "CartPole-v1", "episodes": 20},
                                               {"env": "Acrobot-v1", "episodes": 20}]})


def _table(returns: list[float], reasons: list[str] | None = None):
    ledger = SeedLedger(0)
    reasons = reasons or ["terminated"] * len(returns)
    return records_to_table([EpisodeRecord(
        request_id="r", policy_sha256="p" * 64, env_id="X-v0", env_spec_hash="h", episode_index=i,
        seed=ledger.seed(i), episode_return=float(r), length=10, end_reason=reason,
        error=None if reason == "terminated" else "planted", success=None, wall_seconds=0.0,
        worker="w", sandbox="s", isolation="inprocess") for i, (r, reason) in
        enumerate(zip(returns, reasons, strict=True))])


def _report(request: EvalRequest, table):
    return aggregate(request, table, env_spec={}, env_spec_hash="h", policy={"sha256": "p" * 64},
                     isolation="inprocess", timings={}, cache={}, run_seconds=1.0)


def test_the_trainers_run_gets_the_suites_iqm_once_not_each_tasks_mean(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    trainer = client.create_run(client.create_experiment("trainer")).info.run_id
    base = EvalRequest.build(policy="envs.suite_policies:heuristic", training_run_id=trainer,
                             step=7, output=tmp_path)
    tasks = task_requests(SUITE, base)
    assert [t.suite_task for t in tasks] == [t.name for t in SUITE.tasks]
    for request, returns in zip(tasks, ([500.0] * 20, list(-80.0 - np.arange(20))), strict=True):
        report = _report(request, _table(returns)).model_dump(mode="json")
        assert report["suite_task"] == request.suite_task
        log_evaluation(uri, "evalfleet", report, {}, [], request.request_id)
    assert client.get_metric_history(trainer, "eval/reward") == []  # the tasks logged nothing there
    suite = {"suite": "two", "policy_sha256": "p" * 64, "request_id": base.request_id,
             "harness_fault": False, "tasks": [{"name": t.name} for t in SUITE.tasks],
             "aggregates": {"iqm": {"point": 0.4, "ci": [0.3, 0.5]},
                            "mean": {"point": 0.45, "ci": [0.35, 0.55]}}}
    log_suite(uri, "evalfleet", suite, {}, [], "suite-two", training_run_id=trainer, step=7)
    logged = {k: [(m.step, m.value) for m in client.get_metric_history(trainer, k)]
              for k in ("eval/reward", "eval/reward_ci_low", "eval/suite/mean")}
    assert logged == {"eval/reward": [(7, 0.4)], "eval/reward_ci_low": [(7, 0.3)],
                      "eval/suite/mean": [(7, 0.45)]}


def test_the_baselines_task_requests_are_no_checkpoint_of_the_training_run():
    base = EvalRequest.build(policy="envs.suite_policies:heuristic",
                             baseline="envs.suite_policies:random", training_run_id="run", step=3)
    theirs = baseline_requests(task_requests(SUITE, base), base.baseline, base.baseline_factory)
    assert [(r.policy, r.step) for r in theirs] == [("envs.suite_policies:random", None)] * 2


def test_suite_with_gate_is_refused_before_anything_runs(tmp_path: Path, capsys):
    suite = tmp_path / "suite.toml"
    suite.write_text('[[task]]\nenv = "CartPole-v1"\nepisodes = 10\n')
    ran = []
    code = run_cli(lambda *a: ran.append(a), ["--suite", str(suite), "--gate",
                                              "--training-run-id", "run", "--step", "1",
                                              "--output", str(tmp_path / "out")],
                   evaluate_suite=lambda *a: ran.append(a))
    assert code == EXIT_BAD_REQUEST and ran == []
    assert "--gate compares one evaluation" in capsys.readouterr().err


def test_an_unexpected_suite_failure_is_one_paragraph_and_exit_1(tmp_path: Path, capsys):
    # Only evalfleet's own errors were caught: anything else (a malformed Dask address, a lost
    # scheduler) came out as a raw traceback of 78 lines.
    from evalfleet.cli import EXIT_FAILED

    suite = tmp_path / "suite.toml"
    suite.write_text('[[task]]\nenv = "CartPole-v1"\nepisodes = 10\n')

    def broken(*args: object) -> None:
        raise OSError("planted: the scheduler went away")

    code = run_cli(lambda *a: None, ["--suite", str(suite), "--output", str(tmp_path / "out")],
                   evaluate_suite=broken)
    err = capsys.readouterr().err
    assert code == EXIT_FAILED
    assert "OSError: planted: the scheduler went away" in err and "Traceback" not in err


def test_the_in_loop_result_names_every_alarm_of_the_report():
    request = EvalRequest.build(policy="envs.suite_policies:heuristic", episodes=20)
    report = _report(request, _table([1.0] * 10 + [0.0] * 10, ["terminated"] * 10 + ["crashed"] * 10))
    result = history_result(report)
    assert result["eval/alarms"][0] == "harness_failures" and result["eval/harness_fault"] is True


def test_verdicts_that_compared_nothing_get_no_verdict_point():
    codes = {v: history_metrics({"verdict": v}).get("eval/verdict")
             for v in ("regression", "not_distinguishable", "new_best", "no_paired_episodes",
                       "protocol_changed")}
    assert codes == {"regression": -1.0, "not_distinguishable": 0.0, "new_best": 1.0,
                     "no_paired_episodes": None, "protocol_changed": None}
