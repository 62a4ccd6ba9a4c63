"""Failures of the policy count with their partial return, which flatters where rewards are negative.

Planted: a MountainCar-like env (-1 per step, returns near -150). A new checkpoint plays as the
old one except that it raises on its 4% hardest seeds at step 1 (partial return -1). Before, its
mean rose by ~7, the paired comparison said ``better``, the history ``new_best`` and ``--gate``
passed, with no alarm (``policy_failures`` fires above 5%). Now ``policy_failures_flatter`` fires
at any count and the gate does not pass. Where rewards are positive (CartPole), failures lower the
mean and raise nothing new.
"""

from __future__ import annotations

import numpy as np

from evalfleet.cli import EXIT_GATE_UNDECIDED, EXIT_REGRESSION, gate
from evalfleet.history import Checkpoint, assess
from evalfleet.models import EvalRequest
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.report import aggregate
from evalfleet.seeds import SeedLedger

N = 1000


def _table(returns, reasons, lengths, policy: str):
    ledger = SeedLedger(0)
    return records_to_table([EpisodeRecord(
        request_id="r", policy_sha256=policy * 64, env_id="X-v0", env_spec_hash="h",
        episode_index=i, seed=ledger.seed(i), episode_return=float(returns[i]),
        length=int(lengths[i]), end_reason=reasons[i],
        error=None if reasons[i] == "terminated" else "planted", success=None, wall_seconds=0.0,
        worker="w", sandbox="s", isolation="inprocess") for i in range(N)])


def _checkpoints(cost_per_step: bool):
    """The old checkpoint's table and the new one's, which fails on the old one's 40 longest."""
    rng = np.random.default_rng(1)
    lengths = np.round(rng.normal(150, 20, N)).astype(int)
    returns = -lengths.astype(float) if cost_per_step else lengths.astype(float)
    old = _table(returns, ["terminated"] * N, lengths, "b")
    hard = np.argsort(lengths)[-40:]
    new_returns, new_lengths, reasons = returns.copy(), lengths.copy(), ["terminated"] * N
    for i in hard:
        new_returns[i], new_lengths[i], reasons[i] = (-1.0 if cost_per_step else 1.0), 1, "policy_error"
    return old, _table(new_returns, reasons, new_lengths, "n")


def _report(table, step: int):
    request = EvalRequest.build(policy="x.pt", episodes=N, training_run_id="run", step=step)
    return aggregate(request, table, env_spec={}, env_spec_hash="h", policy={"sha256": "n" * 64},
                     isolation="inprocess", timings={}, cache={}, run_seconds=1.0)


def _gated(new, old, report):
    first = Checkpoint("run", 100, "req", "b" * 64, None, "proto", {"eval/episodes": N}, "first",
                       True, False)
    history = assess(new, step=200, seed=0, earlier=[first], episodes=lambda cp: old)
    return history["verdict"], gate(report.model_copy(update={"history": history}))


def test_failures_scoring_above_the_completed_episodes_raise_an_alarm_and_hold_the_gate(capsys):
    old, new = _checkpoints(cost_per_step=True)
    report = _report(new, 200)
    assert report.mean > _report(old, 100).mean  # what the alarm is about: breaking scored higher
    (alarm,) = [a for a in report.alarms if a.startswith("policy_failures_flatter:")]
    assert "40 episodes ended by the policy" in alarm and "(mean -1)" in alarm
    assert not any(a.startswith("policy_failures:") for a in report.alarms)  # 4% < 5%
    verdict, code = _gated(new, old, report)
    assert (verdict, code) == ("new_best", EXIT_GATE_UNDECIDED)
    assert "policy_failures_flatter" in capsys.readouterr().err


def test_failures_below_the_completed_episodes_raise_nothing_new():
    old, new = _checkpoints(cost_per_step=False)
    report = _report(new, 200)
    assert report.mean < _report(old, 100).mean
    assert not any(a.startswith("policy_failures_flatter:") for a in report.alarms)
    verdict, code = _gated(new, old, report)
    assert (verdict, code) == ("regression", EXIT_REGRESSION)


def test_episodes_a_hung_forward_left_unstarted_are_not_scored():
    rng = np.random.default_rng(2)
    lengths = np.round(rng.normal(150, 20, N)).astype(int)
    returns, reasons = -lengths.astype(float), ["terminated"] * N
    for i in range(N - 40, N):  # what runner.give_up writes for a shard's pending episodes
        returns[i], lengths[i], reasons[i] = float("nan"), 0, "policy_timeout"
    report = _report(_table(returns, reasons, lengths, "h"), 1)
    assert (report.scored, report.coverage) == (N - 40, (N - 40) / N)
    assert report.mean == float(np.mean(returns[: N - 40]))
    assert any(a.startswith("policy_failure_returns_missing: 40 episodes") and "40 never started" in a
               for a in report.alarms)
