"""What the cache key names must stay as it was while the episodes run, or nothing is kept.

The key is computed once, at stage 1, from the env's and policy's code and the files the env's
kwargs name. An edit during the run (a ``git pull``, a job regenerating a scenario file) made
later episodes run other inputs; their rows were stored under the key of the inputs before, and
the same request run again on those inputs was a hit with the mixed table (mean 354 for a truth
of 200), with no alarm anywhere.
"""

from __future__ import annotations

import json

import pytest

from evalfleet.cache import EpisodeCache
from evalfleet.cli import EXIT_HARNESS_FAULT, run_cli
from evalfleet.models import EvalRequest
from flows.eval import evaluate
from tests.flows.drift_envs import ENV_ID
from tests.flows.test_recording_flow import flow_run_state

pytestmark = pytest.mark.slow


def test_a_scenario_file_rewritten_during_the_run_is_an_alarm_and_nothing_is_cached(
        prefect_server, tmp_path, capsys, monkeypatch):
    gain = tmp_path / "gain.txt"
    gain.write_text("1.0")
    # The file becomes 2.0 at the 12th reset: episodes after it earn twice as much.
    monkeypatch.setenv("DRIFT_REWRITE_AFTER", "12")
    args = ["--env", ENV_ID, "--policy", "tests.flows.drift_envs:zeros", "--episodes", "40",
            "--concurrency", "4", "--workers", "1", "--isolation", "inprocess", "--no-audit",
            "--shard-episodes", "10", "--output", str(tmp_path / "out"), "--quiet",
            "--allow-failures",  # about coverage: it never waives numbers that mix two inputs
            "--report", str(tmp_path / "report.json"),
            "--env-kwargs", json.dumps({"gain_file": str(gain)})]
    assert run_cli(evaluate, args) == EXIT_HARNESS_FAULT
    assert "evalfleet: harness fault: inputs_changed: " in capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["harness_fault"] is True
    [alarm] = [a for a in report["alarms"] if a.startswith("inputs_changed:")]
    assert f"the file {gain}" in alarm and "nothing of this evaluation was cached" in alarm
    assert 10.0 < report["returns"]["mean"] < 20.0  # the mix, reported as such
    state = flow_run_state(f"{report['env_id']}-{report['request_id']}")  # the Prefect UI's word
    assert (state.type.value, state.name) == ("COMPLETED", "Harness fault")
    assert state.message.startswith("coverage 100.0%; ") and "inputs_changed: " in state.message
    key = report["cache"]["key"]
    cache = EpisodeCache(tmp_path / "out" / "cache")
    assert cache.lookup(key, range(40)).stored.num_rows == 0 and not cache.shard_files(key)
    # The file as it was, left alone: the same request is a miss, and its numbers are the file's.
    gain.write_text("1.0")
    monkeypatch.delenv("DRIFT_REWRITE_AFTER")
    again = evaluate(EvalRequest.build(
        env=ENV_ID, policy="tests.flows.drift_envs:zeros", episodes=40, concurrency=4, workers=1,
        isolation="inprocess", audit=False, shard_episodes=10, output=tmp_path / "out",
        env_kwargs={"gain_file": str(gain)}))
    assert again.cache["key"] == key
    assert again.cache["status"] == "miss" and again.mean == 10.0
    assert not [a for a in again.alarms if a.startswith("inputs_changed")]
    capsys.readouterr()
