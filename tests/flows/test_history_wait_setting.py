"""A bad EVALFLEET_HISTORY_WAIT_S is refused at stage 1, before anything is spawned.

Read first in stage 7, '10m' failed the evaluation after its episodes had run: "ValueError:
could not convert string to float: '10m'", exit 1, no report.json, no Parquet, and no word of
the variable.
"""

from pathlib import Path

import pytest

import flows.eval as eval_module
from evalfleet.claims import WAIT_ENV
from evalfleet.cli import run_cli
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.suite import load_suite
from flows import suite as suite_module

REFUSED = ("EVALFLEET_HISTORY_WAIT_S='10m': expected a finite number of seconds >= 0 (how long a "
           "training run's checkpoint waits for earlier steps being evaluated before its verdict)")


def refuse(*args, **kwargs):
    raise AssertionError("a server or cluster was started for a bad setting")


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (eval_module, suite_module):
        monkeypatch.setattr(module, "prefect_api", refuse)
        monkeypatch.setattr(module, "fleet_cluster", refuse)
    monkeypatch.setenv(WAIT_ENV, "10m")


def test_the_cli_refuses_a_bad_history_wait_before_anything_runs(
        no_spawn: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--episodes", "4", "--training-run-id", "probe-run", "--step", "1",
            "--output", str(tmp_path)]
    assert run_cli(eval_module.evaluate, argv) == 2
    assert f"evalfleet: error: {REFUSED}" in capsys.readouterr().err
    assert not (tmp_path / "history-claims").exists()  # not even the claim was taken


def test_evaluate_refuses_it_before_anything_runs(no_spawn: None, tmp_path: Path,
                                                  example_policy: str) -> None:
    request = EvalRequest.build(policy=example_policy, output=tmp_path, training_run_id="r", step=3)
    with pytest.raises(RequestError) as refused:
        eval_module.evaluate(request)
    assert str(refused.value).startswith(REFUSED)


def test_a_suite_of_a_training_run_refuses_it_before_anything_runs(
        no_spawn: None, tmp_path: Path, example_policy: str) -> None:
    path = tmp_path / "suite.toml"
    path.write_text('[suite]\nepisodes = 4\n[[task]]\nenv = "CartPole-v1"\n')
    base = EvalRequest.build(policy=example_policy, output=tmp_path, training_run_id="r", step=3)
    with pytest.raises(RequestError, match=r"^EVALFLEET_HISTORY_WAIT_S='10m'"):
        suite_module.evaluate_suite(load_suite(path), base)
