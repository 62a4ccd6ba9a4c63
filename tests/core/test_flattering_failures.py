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


def test_failures_on_the_hardest_seeds_that_flatter_only_paired_hold_the_gate(capsys):
    """The new checkpoint breaks at step 170 of the old one's 40 longest episodes (~190 steps).

    Its partial returns (-170) sit below its completed episodes' mean (~-150), so the unpaired
    check is silent; paired with the old checkpoint's full returns on the same seeds (~-190) they
    gain ~20 each, and the other pairs are equal: all of the "improvement" is the breaking.
    """
    from evalfleet.history import alarm_lines

    rng = np.random.default_rng(1)
    lengths = np.round(rng.normal(150, 20, N)).astype(int)
    hard = np.argsort(lengths)[-40:]
    assert lengths[hard].min() > 170
    old = _table(-lengths.astype(float), ["terminated"] * N, lengths, "b")
    new_returns, new_lengths, reasons = -lengths.astype(float), lengths.copy(), ["terminated"] * N
    for i in hard:
        new_returns[i], new_lengths[i], reasons[i] = -170.0, 170, "policy_error"
    new = _table(new_returns, reasons, new_lengths, "n")
    report = _report(new, 200)
    assert not any(a.startswith("policy_failures_flatter:") for a in report.alarms)
    first = Checkpoint("run", 100, "req", "b" * 64, None, "proto", {"eval/episodes": N}, "first",
                       True, False)
    history = assess(new, step=200, seed=0, earlier=[first], episodes=lambda cp: old)
    assert history["verdict"] == "new_best"  # by the numbers alone
    sides = history["comparison"]["one_side_failed"]
    assert sides["new"]["n"] == 40 and sides["new"]["gain"] > 15 and sides["baseline"]["n"] == 0
    assert sides["both_completed"] == {"n": N - 40, "mean_diff": 0.0}
    (alarm,) = [a for a in alarm_lines(history) if a.startswith("history_pairs_policy_flatter:")]
    assert "on 40 pairs where only this policy was ended by its policy" in alarm
    assert "over the 960 pairs both completed the mean difference is +0" in alarm
    judged = report.model_copy(update={"history": history, "alarms": alarm_lines(history)})
    assert gate(judged) == EXIT_GATE_UNDECIDED
    assert "history_pairs_policy_flatter" in capsys.readouterr().err


def test_a_checkpoint_that_completed_nothing_is_alarmed_and_never_the_best():
    from evalfleet.history import best_checkpoint

    lengths = np.full(N, 30)
    broken = _table(-lengths.astype(float), ["policy_error"] * N, lengths, "n")
    (alarm,) = [a for a in _report(broken, 200).alarms if a.startswith("policy_failures_flatter:")]
    assert f"all {N} scored episodes were ended by the policy" in alarm
    good = Checkpoint("run", 100, "a", "a" * 64, None, "proto", {"eval/reward": -150.0}, "first",
                      True, False)
    crashed = Checkpoint("run", 200, "b", "b" * 64, None, "proto", {"eval/reward": -30.0}, "new_best",
                         True, False, alarms=("policy_failures_flatter",))
    assert best_checkpoint([good, crashed]) is good


def test_a_harness_fault_never_passes_the_gate(capsys):
    """With --allow-failures a harness fault exits 0, but its verdict must not pass a gate."""
    rng = np.random.default_rng(4)
    lengths = np.round(rng.normal(150, 20, N)).astype(int)
    returns, reasons = -lengths.astype(float), ["terminated"] * N
    old = _table(returns, reasons, lengths, "b")
    for i in np.argsort(lengths)[-N // 10:]:  # the hardest tenth never ran: the harness crashed
        returns[i], lengths[i], reasons[i] = float("nan"), 0, "crashed"
    new = _table(returns, reasons, lengths, "n")
    report = _report(new, 200)
    assert report.harness_fault and report.coverage == 0.9
    verdict, code = _gated(new, old, report)
    assert verdict in ("new_best", "not_distinguishable")  # what passed before
    assert code == EXIT_GATE_UNDECIDED
    assert "harness fault (coverage 90.00%" in capsys.readouterr().err
