"""The shipped example suite through the flow, on a small episode budget, and bad suites."""

import json
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterName,
)

from evalfleet.aggregates import aggregate, probability_of_improvement
from evalfleet.cli import run_cli
from evalfleet.models import EvalRequest
from evalfleet.pipeline import receive
from evalfleet.storage import read_episodes
from evalfleet.suite import load_suite, task_scores
from flows import suite as suite_module
from flows.eval import evaluate
from flows.reaper import DRIVER_TAG, driver_tag
from flows.suite import evaluate_suite

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "suite.toml"
EPISODES = 4


def refuse(*args, **kwargs):
    raise AssertionError("something was spawned")


@pytest.mark.slow
def test_example_suite_runs_each_task_as_its_own_cached_evaluation(prefect_server, tmp_path,
                                                                   monkeypatch):
    suite = load_suite(EXAMPLE)
    suite = suite.model_copy(update={
        "reps": 500, "tasks": [t.model_copy(update={"episodes": EPISODES}) for t in suite.tasks]})
    base = EvalRequest.build(policy="envs.suite_policies:heuristic",
                             baseline="envs.suite_policies:random", seed=3, concurrency=8,
                             output=tmp_path / "out", request_id="suitetest")
    report = evaluate_suite(suite, base)

    # One report per task, cached under the key the same single evaluation has.
    assert [t["name"] for t in report.tasks] == [t.name for t in suite.tasks]
    for task, row in zip(suite.tasks, report.tasks, strict=True):
        single = EvalRequest.build(policy=base.policy, env=task.env, env_kwargs=task.env_kwargs,
                                   episodes=EPISODES, seed=3, output=tmp_path / "out")
        assert row["episodes"] == EPISODES and row["cache"] == "miss"
        assert row["report"] and Path(row["report"]).exists()
        assert json.loads(Path(row["report"]).read_text())["cache"]["key"] == receive(single).cache_key

    # The aggregates are evalfleet.aggregates over the tasks' normalised scores.
    scores = [task_scores(t, read_episodes(Path(r["report"]).with_name("episodes.parquet")))
              for t, r in zip(suite.tasks, report.tasks, strict=True)]
    assert report.aggregates == aggregate(scores, seed=3, reps=500, gamma=suite.gamma)
    assert report.normalised and report.baseline is not None
    assert report.probability_of_improvement is not None
    theirs = [task_scores(t, read_episodes(tmp_path / "out" / "runs" / f"suitetest-t{i:02d}-baseline"
                                           / "episodes.parquet"))
              for i, t in enumerate(suite.tasks)]
    assert report.baseline["task_means"] == [float(s.mean()) for s in theirs]
    assert report.probability_of_improvement == probability_of_improvement(scores, theirs, seed=3,
                                                                           reps=500)

    # Files: JSON, page with the three figures, plots.
    out = report.outputs
    page = Path(out["report_html"]).read_text()
    assert page.count("data:image/png;base64,") == 3 and "Probability of improvement" in page
    assert Path(out["report"]).exists()

    # One flow run; its task runs named per task; the policy distributed once per policy.
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[f"suite-use-cases-{base.request_id}"])))
        assert len(runs) == 1
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])), limit=200)
        names = [t.name for t in task_runs]
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"suite-{report.policy_sha256[:12]}"])))
        # Every task's own table + report artifacts (policy's and baseline's), sent from stage 7.
        per_task = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[runs[0].id])), limit=200)
    assert sorted(a.type for a in per_task if a.key and a.key.startswith("eval-")) == (
        ["markdown"] * (2 * len(suite.tasks)) + ["table"] * (2 * len(suite.tasks)))
    # The flow run names its driver (the reaper ends it Crashed if the driver is killed); its
    # task runs carry no tag (each would cost a tag concurrency slot).
    assert [t for t in runs[0].tags if t.startswith(DRIVER_TAG)] == [driver_tag()]
    assert not [t for t in task_runs if any(x.startswith(DRIVER_TAG) for x in t.tags)]
    # One task run per stage for all the tasks (per policy), each named after the tasks it covers.
    for task in suite.tasks:
        assert any(n.startswith("run-episodes[") and task.name in n for n in names)
        assert len([n for n in names if n.startswith("feed-back[") and task.name in n]) == 2
    assert len([n for n in names if n.startswith("feed-back[")]) == 2  # policy + baseline
    assert len([n for n in names if n.startswith("distribute-policy")]) == 2  # policy + baseline
    assert "aggregate-suite" in "".join(names)
    assert artifacts and "P(improvement over baseline)" in str(artifacts[0].data)

    # MLflow: the suite's parent run; each task's run nested under it.
    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(tracking_uri=out["mlflow_uri"])
    parent = mlflow.get_run(out["mlflow_run_id"])
    assert parent.data.metrics["suite/iqm"] == pytest.approx(report.aggregates["iqm"]["point"])
    for row in report.tasks:
        child = mlflow.get_run(row["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == out["mlflow_run_id"]
        assert child.data.tags["evalfleet.suite_task"] == row["name"]
        assert {"episodes.parquet", "report.json"} <= {
            a.path for a in mlflow.list_artifacts(row["mlflow_run_id"])}
    # The figures drawn on a worker come back as the suite's plot files and parent artifacts.
    assert {a.path for a in mlflow.list_artifacts(out["mlflow_run_id"])} == {
        "suite_performance_profile.png", "suite_aggregate_intervals.png", "suite_task_scores.png",
        "report.html", "suite_report.json"}
    assert all(Path(out[f"plot_{k}"]).read_bytes().startswith(b"\x89PNG")
               for k in ("performance_profile", "aggregate_intervals", "task_scores"))

    # Again: every task (and the baseline's) is a cache hit; nothing is spawned, same numbers.
    monkeypatch.setattr(suite_module, "fleet_cluster", refuse)
    again = evaluate_suite(suite, base.model_copy(update={"request_id": "suitetest2"}))
    assert [t["cache"] for t in again.tasks] == ["hit"] * len(suite.tasks)
    assert again.aggregates == report.aggregates


def test_bad_suites_fail_before_anything_is_spawned(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite_module, "fleet_cluster", refuse)
    monkeypatch.setattr(suite_module, "prefect_api", refuse)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[task]]\nenv = "evalfleet/Inventory-v0"\nepisodes = 5\ngrid = { demand_scale = [] }\n')
    argv = ["--suite", str(bad), "--policy", "envs.suite_policies:heuristic", "--output", str(tmp_path)]
    assert run_cli(evaluate, argv, evaluate_suite) == 2
    assert "'grid.demand_scale' must be a non-empty list" in capsys.readouterr().err

    # An env kwarg the env rejects, and a policy that does not fit a task's spaces: stage 1 of
    # every task runs before the cluster or the Prefect server.
    bad.write_text('[[task]]\nenv = "evalfleet/Inventory-v0"\nepisodes = 5\n'
                   'grid = { demand_scale = [20.0, 0.5] }\n')
    assert run_cli(evaluate, argv, evaluate_suite) == 2
    assert "demand_scale" in capsys.readouterr().err
    bad.write_text('[[task]]\nenv = "evalfleet/Inventory-v0"\nepisodes = 5\n')
    assert run_cli(evaluate, ["--suite", str(bad), "--output", str(tmp_path)], evaluate_suite) == 2
    assert "policy" in capsys.readouterr().err.lower()

    # Two tasks that are the same evaluation would wait on their own cache lock.
    bad.write_text('[[task]]\nname = "a"\nenv = "evalfleet/Inventory-v0"\nepisodes = 5\n'
                   '[[task]]\nname = "b"\nenv = "evalfleet/Inventory-v0"\nepisodes = 5\n')
    assert run_cli(evaluate, argv, evaluate_suite) == 2
    assert "suite tasks 'a' and 'b' are the same evaluation" in capsys.readouterr().err


@pytest.mark.parametrize("options,named", [
    (["--env", "Acrobot-v1"], "--env"),
    (["--episodes", "500"], "--episodes"),  # the default typed out is still an option given
    (["--episodes", "50", "--env", "Acrobot-v1", "--max-steps", "10", "--env-kwargs", '{"foo": 1}'],
     "--env, --env-kwargs, --episodes, --max-steps"),
])
def test_options_the_suite_sets_are_refused_with_it(tmp_path, monkeypatch, capsys, options, named):
    # Each was ignored, exit 0: the tasks ran the suite file's env, kwargs, episodes and step cap.
    monkeypatch.setattr(suite_module, "fleet_cluster", refuse)
    monkeypatch.setattr(suite_module, "prefect_api", refuse)
    path = tmp_path / "suite.toml"
    path.write_text('[suite]\nepisodes = 8\n[[task]]\nname = "cp"\nenv = "CartPole-v1"\n')
    argv = ["--suite", str(path), "--output", str(tmp_path / "out"), *options]
    assert run_cli(evaluate, argv, refuse) == 2
    err = capsys.readouterr().err
    assert f"evalfleet: error: {named} cannot be used with --suite: the suite file '{path}' sets each " \
           "task's env, env kwargs, episodes and step cap, so they would be ignored" in err


def test_sandbox_options_are_refused_for_a_suite_whose_every_task_runs_in_process(
        tmp_path, monkeypatch, capsys):
    # --step-timeout 3 --sandbox-memory-mb 2000 on a CartPole suite: accepted and ignored, exit 0.
    monkeypatch.setattr(suite_module, "fleet_cluster", refuse)
    monkeypatch.setattr(suite_module, "prefect_api", refuse)
    path = tmp_path / "suite.toml"
    path.write_text('[suite]\nepisodes = 8\n[[task]]\nenv = "CartPole-v1"\n[[task]]\nenv = "CartPole-v0"\n')
    argv = ["--suite", str(path), "--output", str(tmp_path / "out"), "--step-timeout", "3",
            "--sandbox-memory-mb", "2000"]
    assert run_cli(evaluate, argv, evaluate_suite) == 2
    assert ("--sandbox-memory-mb, --step-timeout apply to process/bwrap sandboxes, but every task of "
            "this suite runs its env in-process (isolation 'auto' for 'CartPole-v1', 'CartPole-v0'): "
            "they would do nothing") in capsys.readouterr().err


def test_sandbox_options_serve_a_suite_with_a_task_in_a_sandbox(tmp_path):
    """One set of options serves every task: an in-process task beside a sandboxed one is no
    reason to refuse them."""
    from types import SimpleNamespace

    from evalfleet.pipeline import check_suite_sandbox_options

    base = EvalRequest.build(policy="envs.suite_policies:random", step_timeout_s=3.0, output=tmp_path)
    tasks = [(base, SimpleNamespace(isolation="inprocess")), (base, SimpleNamespace(isolation="process"))]
    check_suite_sandbox_options(base, tasks)
    check_suite_sandbox_options(EvalRequest.build(policy=base.policy, output=tmp_path), tasks[:1])
