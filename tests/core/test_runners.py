"""How the Evaluator's default runner is found: an entry point, read from installed metadata.

Each test plants a real ``*.dist-info`` folder on ``sys.path`` under a group of its own, so
``importlib.metadata`` finds it exactly as it finds an installed package's entry points.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from evalfleet import runners
from evalfleet.client import EvaluationFailed, Evaluator
from evalfleet.errors import EnvSpecError, EvalfleetError, PolicyError, RequestError
from evalfleet.models import EvalRequest
from tests.integration.policies import mlp

GROUP = "evalfleet.test-runners"


def plant(root: Path, monkeypatch: pytest.MonkeyPatch, entries: dict[str, str]) -> None:
    """A distribution whose ``[GROUP]`` entry points are ``entries``, and use that group."""
    info = root / "planted_runners-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: planted-runners\nVersion: 0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(runners, "RUNNER_GROUP", GROUP)


def factory(workers: int, dask_address: str | None) -> Any:
    """A runner factory: the runner reports what it was built with."""
    return lambda request: (workers, dask_address, request)


def test_the_local_entry_point_is_found_and_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    plant(tmp_path, monkeypatch, {"local": f"{__name__}:factory", "other": "x.y:z"})
    entry = runners.find_runner()
    assert (entry.name, entry.value) == ("local", f"{__name__}:factory")
    runner = runners.load_runner(entry, 3, "tcp://127.0.0.1:1")
    assert runner("req") == (3, "tcp://127.0.0.1:1", "req")  # type: ignore[arg-type]


def test_a_missing_runner_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    plant(tmp_path, monkeypatch, {"other": "x.y:z"})
    with pytest.raises(runners.RunnerNotFound, match=r"no evaluation runner 'local' .* \['other'\]"
                       r".*pip install -e \..*runner=") as info:
        runners.find_runner()
    assert isinstance(info.value, EvalfleetError)


def test_an_entry_point_that_is_no_factory_is_refused(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    plant(tmp_path, monkeypatch, {"local": f"{__name__}:GROUP"})
    with pytest.raises(runners.RunnerNotFound, match="must name a callable .*got str"):
        runners.load_runner(runners.find_runner(), 2, None)


def test_evalfleet_registers_the_flow_runner() -> None:
    """The project's own metadata: pyproject.toml names the flow layer's runner as 'local'."""
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    entry_points = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    value = entry_points[runners.RUNNER_GROUP][runners.LOCAL_RUNNER]
    module, _, name = value.partition(":")
    assert value == "flows.local_runner:LocalFlowRunner"
    __import__(module)
    assert callable(getattr(sys.modules[module], name))


def failing_factory(workers: int, dask_address: str | None) -> Any:
    """A runner that fails, naming what it was built with (no cluster, no server)."""
    def run(request: Any) -> Any:
        raise RuntimeError(f"planted runner: step {request.step}, workers={workers}, "
                           f"address={dask_address}")
    return run


def test_the_evaluator_runs_the_registered_runner(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    plant(tmp_path / "site", monkeypatch, {"local": f"{__name__}:failing_factory"})
    with Evaluator(policy_factory="tests.integration.policies:mlp", output=tmp_path / "out",
                   workers=3, dask_address="tcp://127.0.0.1:9") as ev:
        with pytest.raises(EvaluationFailed,
                           match="planted runner: step 5, workers=3, address=tcp://127.0.0.1:9"):
            ev.evaluate(mlp(), step=5, timeout=60)


def test_an_evaluator_without_a_runner_fails_before_starting(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    plant(tmp_path / "site", monkeypatch, {})
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(runners.RunnerNotFound, match="no evaluation runner 'local'"):
        Evaluator(output=tmp_path / "out")
    assert "evalfleet-evaluator" not in {t.name for t in threading.enumerate()} - before
    # A runner passed explicitly needs no registration.
    Evaluator(output=tmp_path / "out", runner=lambda request: pytest.fail("not run")).shutdown()


def test_the_evaluators_outcome_metric_works_and_every_calls_step_is_validated(tmp_path: Path
                                                                             ) -> None:
    # The template was checked with step None, so outcome_metric (which needs a step) was always
    # refused; and a call's step was copied in unchecked: 'abc' reached the runner.
    seen: list[Any] = []
    with Evaluator(policy_factory="tests.integration.policies:mlp", output=tmp_path / "out",
                   training_run_id="r1", outcome_metric="profit",
                   runner=lambda request: seen.append(request) or pytest.fail("stop")) as ev:
        for bad, message in (("abc", r"'step': Input should be a valid integer"),
                             (-5, r"'step' must be a training step >= 0 \(got -5\)")):
            with pytest.raises(RequestError, match=message):
                ev.trigger_eval(mlp(), step=bad)  # type: ignore[arg-type]
        assert seen == []


def test_an_evaluator_with_a_training_run_refuses_a_call_without_its_step(tmp_path: Path) -> None:
    # It ran, tagged with the run and no step: no history, no verdict, and no word of it.
    with Evaluator(policy_factory="tests.integration.policies:mlp", output=tmp_path / "out",
                   training_run_id="r1", runner=lambda request: pytest.fail("ran")) as ev:
        with pytest.raises(RequestError, match=r"'training_run_id' \('r1'\) and 'step' \(None\) "
                           r"go together"):
            ev.trigger_eval(mlp())
    # Without a training run, a step only labels the result (eval/step): accepted.
    seen: list[Any] = []

    def runner(request: Any) -> Any:
        seen.append(request)
        raise RuntimeError("stop")

    with Evaluator(policy_factory="tests.integration.policies:mlp", output=tmp_path / "out",
                   runner=runner) as ev:
        ev.trigger_eval(mlp(), step=3)
        with pytest.raises(Exception, match="stop"):
            ev.wait(timeout=60)
    assert [(r.training_run_id, r.step) for r in seen] == [(None, 3)]


def test_the_first_call_of_a_local_runner_refuses_an_unknown_env_before_a_cluster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.local_runner as local

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a server or cluster was started for a bad request")

    monkeypatch.setattr(local, "prefect_api", refuse)
    monkeypatch.setattr(local, "fleet_cluster", refuse)
    runner = local.LocalFlowRunner(workers=1)
    with pytest.raises(EnvSpecError, match=r"unknown env id 'NoSuchEnv-v0'"):
        runner(EvalRequest.build(env="NoSuchEnv-v0", policy="x.pt", output=tmp_path))
    runner.close()


@pytest.mark.parametrize(("factory", "message"), [
    ("no_such_module_x1:build", "policy_factory 'no_such_module_x1:build': cannot import module"),
    ("tests.integration.policies:no_such_fn", "module 'tests.integration.policies' has no 'no_such_fn'"),
    ("tests.core.test_runners:HERE", "policy_factory 'tests.core.test_runners:HERE' is not callable"),
])
def test_a_factory_that_cannot_build_fails_at_construction(tmp_path: Path, factory: str,
                                                           message: str) -> None:
    """It was accepted, and the first evaluation failed at stage 1 in the trainer's loop."""
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(PolicyError, match=re.escape(message)):
        Evaluator(policy_factory=factory, output=tmp_path / "out")
    assert {t.name for t in threading.enumerate()} == before  # no thread started


HERE = "not a function"
