"""The Evaluator with a suite: the suite is checked at construction and runs through runner.suite."""

from pathlib import Path
from typing import Any

import pytest
import torch

from evalfleet.client import Evaluator
from evalfleet.errors import OutputsMissing, SuiteError
from evalfleet.suite import Suite, SuiteReport

SUITE = '[suite]\nepisodes = 3\n[[task]]\nenv = "CartPole-v1"\ngrid = { max_episode_steps = [20, 30] }\n'
EST = {"point": 0.5, "ci": [0.25, 0.75]}


class SuiteRunner:
    def __init__(self) -> None:
        self.calls: list[tuple[Suite, Any]] = []

    def __call__(self, request: Any) -> Any:
        raise AssertionError("a suite must not run as a single evaluation")

    def suite(self, suite: Suite, request: Any) -> SuiteReport:
        self.calls.append((suite, request))
        return SuiteReport(suite=suite.name, request_id=request.request_id, policy_sha256="ab" * 32,
                           normalised=False, tasks=[{}, {}], gamma=1.0, profile={},
                           aggregates={k: EST for k in ("mean", "median", "iqm", "optimality_gap")})


def test_suite_goes_to_the_runner_suite_method(tmp_path: Path) -> None:
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    runner = SuiteRunner()
    with Evaluator(output=tmp_path, runner=runner, suite=path) as ev:
        result = ev.evaluate(torch.nn.Sequential(torch.nn.Linear(4, 2)), step=7, timeout=120)
    assert result["eval/reward"] == 0.5 and result["eval/step"] == 7
    assert result["eval/suite/iqm_ci_low"] == 0.25 and result["eval/suite/tasks"] == 2
    suite, request = runner.calls[0]
    assert [t.name for t in suite.tasks] == ["CartPole-v1[max_episode_steps=20]",
                                             "CartPole-v1[max_episode_steps=30]"]
    assert request.step == 7 and request.policy.endswith(".pt")


def test_bad_suite_fails_at_construction_and_plain_runners_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[task]]\nenv = 'CartPole-v1'\n")
    with pytest.raises(SuiteError, match="'episodes' is missing"):
        Evaluator(output=tmp_path, runner=lambda r: None, suite=bad)
    bad.write_text(SUITE)
    with pytest.raises(SuiteError, match="cannot run suites"):  # at construction, not every trigger
        Evaluator(output=tmp_path, runner=lambda r: None, suite=bad)


@pytest.mark.parametrize("arguments,named", [
    ({"env": "Acrobot-v1"}, "'env'"),
    ({"num_episodes": 100}, "'num_episodes'"),  # the default typed out is still an argument given
    ({"env": "Acrobot-v1", "num_episodes": 50, "max_steps": 10, "env_kwargs": {"foo": 1}},
     "'env', 'num_episodes', 'env_kwargs', 'max_steps'"),
])
def test_arguments_the_suite_sets_are_refused_at_construction(tmp_path: Path, arguments, named) -> None:
    # Evaluator(suite=..., env="Acrobot-v1", num_episodes=50, max_steps=10) ran the suite file's
    # envs and budgets without a word.
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    with pytest.raises(SuiteError, match=rf"^{named} cannot be used with 'suite': the suite file "
                       rf"'{path}' sets each task's env, env kwargs, episodes and step cap"):
        Evaluator(output=tmp_path, runner=SuiteRunner(), suite=path, **arguments)
    with Evaluator(output=tmp_path, runner=SuiteRunner(), suite=path, seed=3) as ev:
        assert ev._template.env == "CartPole-v1" and ev._template.episodes == 100


class FaultyRunner(SuiteRunner):
    """A suite whose task is a harness fault, and whose MLflow parent run was not logged."""

    def suite(self, suite: Suite, request: Any) -> SuiteReport:
        report = super().suite(suite, request)
        rid = request.request_id
        return report.model_copy(update={"harness_fault": True, "coverage": 0.883, "alarms": [
            f"{rid}-t00: harness_failures: 11.7% of episodes could not be scored",
            "task_coverage: task 'flaky' scored 53 of 60 episodes (coverage 88.3%)",
            f"{rid}-t01: output_missing: the MLflow run: MlflowException: unreachable",
            "output_missing: the suite's MLflow parent run: MlflowException: unreachable"]})


def test_a_suite_results_harness_fault_alarms_and_missing_outputs_reach_the_caller(tmp_path: Path) -> None:
    # The CLI exited 3 (harness fault) and 5 (no MLflow run) on such a suite; the Evaluator's
    # result had no eval/harness_fault nor eval/alarms, and flush() and shutdown() raised nothing.
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)
    ev = Evaluator(output=tmp_path, runner=FaultyRunner(), suite=path)
    result = ev.evaluate(torch.nn.Sequential(torch.nn.Linear(4, 2)), step=2, timeout=120)
    assert result["eval/harness_fault"] is True and result["eval/coverage"] == 0.883
    assert result["eval/alarms"] == ["harness_failures", "task_coverage", "output_missing"]
    with pytest.raises(OutputsMissing, match=r"suite (\w+) \(step 2\): \1-t01: the MLflow run: "
                       r"MlflowException: unreachable; the suite's MLflow parent run: MlflowExc"):
        ev.flush()
    ev.shutdown()  # raised once
    clean = Evaluator(output=tmp_path, runner=SuiteRunner(), suite=path)
    result = clean.evaluate(torch.nn.Sequential(torch.nn.Linear(4, 2)), step=2, timeout=120)
    assert (result["eval/harness_fault"], result["eval/alarms"]) == (False, [])
    clean.flush()
    clean.shutdown()


def test_metrics_fn_is_refused_with_a_suite(tmp_path: Path) -> None:
    # metrics_fn was never called with a suite: its keys were missing from every result, silently.
    path = tmp_path / "suite.toml"
    path.write_text(SUITE)

    def metrics_fn(table: Any) -> dict[str, float]:
        return {"eval/custom": 1.0}

    with pytest.raises(SuiteError, match=r"^'metrics_fn' cannot be used with 'suite' \(got <function "
                       r".*metrics_fn.*>\): it computes metrics from one evaluation's episode table, "
                       r"and a suite has one per task\. Drop it; .* read each task's table in "
                       r"on_result: evalfleet\.storage\.read_episodes\(Path\(row\['episodes_file'\]\)\)"):
        Evaluator(output=tmp_path, runner=SuiteRunner(), suite=path, metrics_fn=metrics_fn)
    with Evaluator(output=tmp_path, runner=SuiteRunner(), env="CartPole-v1", metrics_fn=metrics_fn) as ev:
        assert ev.metrics_fn is metrics_fn  # a single evaluation's, as before
