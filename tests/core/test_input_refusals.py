"""Inputs that were accepted and then meant something else, or failed late: refused when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from evalfleet.claims import DEFAULT_WAIT_S, WAIT_ENV
from evalfleet.cli import cache_command, run_cli
from evalfleet.client import Evaluator
from evalfleet.errors import RequestError, SuiteError
from evalfleet.models import EvalRequest

MAX_STEP = 2**63 - 1  # int64: MLflow's steps and the episodes' 'step' column


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the request was evaluated; it should have been refused")


# ------------------------------------------------------- a step past int64


def test_a_step_past_int64_is_refused_by_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Its episodes ran, then stage 7's pa.array([step], pa.int64()) raised OverflowError: exit 1.
    argv = ["--training-run-id", "probe-big", "--step", "100000000000000000000",
            "--output", str(tmp_path)]
    assert run_cli(refuse, argv) == 2
    assert ("evalfleet: error: 'step' must be a training step from 0 to 9223372036854775807 (2^63 - 1: "
            "MLflow's steps and the episodes' 'step' column are int64; got 100000000000000000000)."
            in capsys.readouterr().err)
    assert EvalRequest.build(policy="x", training_run_id="r", step=MAX_STEP).step == MAX_STEP


def test_a_step_past_int64_is_refused_by_the_evaluator(tmp_path: Path) -> None:
    with Evaluator(output=tmp_path, runner=refuse, training_run_id="r") as ev:
        with pytest.raises(RequestError, match=r"^'step' must be a training step from 0 to "
                           rf"{MAX_STEP} .*got {MAX_STEP + 1}\)"):
            ev.evaluate(torch.nn.Sequential(torch.nn.Linear(4, 2)), step=MAX_STEP + 1, timeout=60)
        assert ev.pending == 0


# ------------------------------------------------------- max_episode_steps: true


@pytest.mark.parametrize("cap", [True, False, 0, -3, 2.5, "200"])
def test_a_max_episode_steps_kwarg_that_is_no_positive_integer_is_refused(cap: Any) -> None:
    # true was taken as a cap of 1 (a fresh key and protocol), and --max-steps 1 "agreed" with it.
    with pytest.raises(RequestError, match=r"^env_kwargs' 'max_episode_steps' must be a positive "
                       rf"integer \(got {cap!r}\): it caps every episode"):
        EvalRequest.build(policy="x", env_kwargs={"max_episode_steps": cap})
    assert EvalRequest.build(policy="x", env_kwargs={"max_episode_steps": 7}).env_kwargs == {
        "max_episode_steps": 7}
    assert EvalRequest.build(policy="x", env_kwargs={"max_episode_steps": None}).env_kwargs == {
        "max_episode_steps": None}


def test_max_episode_steps_true_with_max_steps_1_is_refused_by_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--env-kwargs", '{"max_episode_steps": true}', "--max-steps", "1", "--output", str(tmp_path)]
    assert run_cli(refuse, argv) == 2
    assert "env_kwargs' 'max_episode_steps' must be a positive integer (got True)" in capsys.readouterr().err


# ------------------------------------------------------- a suite with a runner that cannot run one


def test_a_suite_with_a_runner_without_suite_is_refused_at_construction(tmp_path: Path) -> None:
    # Accepted, it failed on every trigger_eval, in the background: the training loop learnt of
    # it at its first checkpoint, from wait().
    path = tmp_path / "suite.toml"
    path.write_text('[suite]\nepisodes = 3\n[[task]]\nenv = "CartPole-v1"\n')

    def single(request: Any) -> Any:
        raise AssertionError("never called")

    with pytest.raises(SuiteError, match=r"^the runner <function .*single.*> cannot run suites: it has "
                       r"no suite\(suite, request\) method. Use the default runner"):
        Evaluator(output=tmp_path, runner=single, suite=path)
    single.suite = lambda suite, request: None  # type: ignore[attr-defined]
    Evaluator(output=tmp_path, runner=single, suite=path).shutdown()


# ------------------------------------------------------- EVALFLEET_HISTORY_WAIT_S


@pytest.mark.parametrize("raw", ["10m", "", "-1", "nan", "inf"])
def test_a_bad_history_wait_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from evalfleet.claims import wait_s

    monkeypatch.setenv(WAIT_ENV, raw)
    with pytest.raises(RequestError, match=rf"^EVALFLEET_HISTORY_WAIT_S={raw!r}: expected a finite "
                       r"number of seconds >= 0 \(how long"):
        wait_s()


def test_the_history_wait_reads_good_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from evalfleet.claims import wait_s

    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert wait_s() == DEFAULT_WAIT_S
    for raw, value in (("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)):
        monkeypatch.setenv(WAIT_ENV, raw)
        assert wait_s() == value


def test_an_evaluator_of_a_training_run_refuses_a_bad_history_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_ENV, "10m")
    with pytest.raises(RequestError, match=r"^EVALFLEET_HISTORY_WAIT_S='10m'"):
        Evaluator(output=tmp_path, runner=refuse, training_run_id="r")
    Evaluator(output=tmp_path, runner=refuse).shutdown()  # no training run: no history, no wait


# ------------------------------------------------------- cache rm


def plant(root: Path, *keys: str) -> None:
    for key in keys:
        folder = root / key[:2] / key
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"key": key, "rows": 3, "ingredients": {}}))


def left(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/*/manifest.json"))


def test_cache_rm_refuses_an_empty_or_ambiguous_prefix(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # 'cache rm "$KEY"' with KEY unset removed every entry, exit 0.
    a1, a2, c = "ab1" + "0" * 61, "ab2" + "0" * 61, "cd3" + "0" * 61
    plant(tmp_path, a1, a2, c)
    where = ["--cache-dir", str(tmp_path)]
    for empty in ("", "  "):
        assert cache_command(["rm", empty, *where]) == 2
        assert (f"evalfleet cache rm: an empty key ({empty!r}) names no entry; nothing was removed."
                in capsys.readouterr().err)
    assert cache_command(["rm", "ab", *where]) == 2
    assert (f"evalfleet cache rm: 'ab' is the prefix of 2 entries ({a1[:16]}, {a2[:16]}); nothing "
            "was removed. Give more of the key" in capsys.readouterr().err)
    assert cache_command(["rm", "cd", "ab", *where]) == 2  # nothing removed, not even the unique one
    assert left(tmp_path) == [a1, a2, c]
    capsys.readouterr()

    assert cache_command(["rm", "ab1", c, *where]) == 0
    assert f"removed 2 entries from {tmp_path}" in capsys.readouterr().out
    assert left(tmp_path) == [a2]
    assert cache_command(["rm", "ff", *where]) == 0  # removing what is gone is no error
    assert "no entry's key starts with 'ff'" in capsys.readouterr().err
    assert cache_command(["rm", "--all", *where]) == 0 and left(tmp_path) == []
