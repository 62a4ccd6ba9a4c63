"""Paired comparison on a correlated env, audit sampling, reward integrity, round schedule."""

import gymnasium as gym
import numpy as np
import pyarrow as pa
import pytest

import tests.flows.user_envs  # noqa: F401
from evalfleet.audit import (
    RoundSchedule,
    audit_sample,
    clipped_reward_alarm,
    compare_with_baseline,
    determinism_audit,
    reused_in_rows,
    reward_integrity,
    scored_returns,
    step_rewards,
)
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.models import EvalRequest
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger
from evalfleet.stats import mean_ci
from tests.core.episodes import run_in_process

ENV = "tests.flows.user_envs:Warehouse-v0"


def _episodes(policy_ref, n=300, seed=0, env=ENV):
    resolved = resolve_env(env, {}, None)
    art = receive_policy(policy_ref, None, resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    ledger = SeedLedger(seed)
    records = run_shard([(i, ledger.seed(i)) for i in range(n)], InProcessSlots(env_thunk(env, {}, None), 16),
                        policy, EpisodeContext("r", art.sha256, env, "s", "w"))
    return records_to_table(records).sort_by("episode_index")


def test_pairing_narrows_the_interval_on_a_correlated_env():
    new = _episodes("tests.flows.user_envs:toward_goal")
    base = _episodes("tests.flows.user_envs:toward_goal_dawdling")
    result = compare_with_baseline(new, base, seed=0, source="dawdling")
    paired = result["ci"]["high"] - result["ci"]["low"]
    unpaired = result["unpaired_ci"]["high"] - result["unpaired_ci"]["low"]
    assert result["n"] == 300
    # The paired interval is the hull of the headline's (skew-corrected t) and the t interval
    # (3% wider here than the skew-corrected t alone), and the unpaired one still the percentile
    # bootstrap (which under-covers): pairing still narrows it, to 95.4% of the unpaired width.
    assert result["ci"]["method"] == "hull of skew-corrected t (Hall) and t"
    assert paired < 0.97 * unpaired, (paired, unpaired)
    # Warehouse pays 0.1 per step, so the dawdling baseline collects more: the direct policy is worse.
    assert result["verdict"] == "worse" and result["mean_diff"] < 0
    same = compare_with_baseline(new, new, seed=0, source="itself")
    assert same["verdict"] == "not distinguishable" and same["mean_diff"] == 0.0


def test_audit_sample_is_two_percent_at_least_two_and_seeded():
    assert len(audit_sample(list(range(1000)), 0)) == 20
    assert len(audit_sample(list(range(10)), 0)) == 2
    assert audit_sample(list(range(1000)), 3) == audit_sample(list(range(1000)), 3)
    assert set(audit_sample(list(range(500, 900)), 1)) <= set(range(500, 900))


def _row(i, ret, length, reason="terminated"):
    return EpisodeRecord("r", "p", "e", "s", i, 100 + i, ret, length, reason, None, None, 0.0, "w",
                         "x", "inprocess")


def test_rows_tell_which_episodes_started_on_a_used_instance():
    """Rows from shard files bring no shards: 8 episodes on 4 in-process slots, 4..7 each took the
    instance an ended episode freed, and only there does an env carrying state across episodes
    (CarriedOver: +1 per step on a used instance) differ from a fresh instance's."""
    env, policy = "tests.core.rng_envs:evalfleet-test/CarriedOver-v0", "tests.core.rng_envs:first_action"
    shared = run_in_process(env, policy, 8, slots=4)
    fresh = run_in_process(env, policy, 8, slots=8)
    assert reused_in_rows(shared) == [4, 5, 6, 7]
    assert reused_in_rows(fresh) == []
    differ = [i for i, (a, b) in enumerate(zip(shared.column("return").to_pylist(),
                                               fresh.column("return").to_pylist(), strict=True))
              if a != b]
    assert differ == [4, 5, 6, 7]


def test_rows_after_an_env_failure_or_of_another_run_are_no_used_instance():
    def row(i, sandbox, reason="terminated", request="r", isolation="inprocess"):
        return EpisodeRecord(request, "p", "e", "s", i, 100 + i, 1.0, 3, reason, None, None, 0.0,
                             "w", sandbox, isolation)

    table = records_to_table([
        row(0, "inproc-0"), row(1, "inproc-0", "env_error"),  # discarded: 2 gets a new instance
        row(2, "inproc-0"), row(3, "inproc-0", "crashed"), row(4, "inproc-0"),
        row(5, "inproc-0", request="other"),  # another run's instance, first there
        row(6, "proc0-pid9", isolation="process"), row(7, "proc0-pid9", isolation="process"),
        row(8, "proc0-pid9", isolation="process"),
    ])
    # 1 took a used instance; 3's ending depends on the clock (no comparison); 4 follows a crash.
    assert reused_in_rows(table) == [1, 7, 8]
    assert reused_in_rows(table, per_sandbox=2) == [1, 8]  # 6 and 7 started on two fresh ones


def test_determinism_audit_reports_mismatched_seeds():
    table = records_to_table([_row(i, float(i), 10) for i in range(5)])
    rerun = records_to_table([_row(1, 1.0, 10), _row(3, 3.5, 11)])
    audit = determinism_audit(table, rerun)
    assert audit["checked"] == 2
    assert [m["seed"] for m in audit["mismatches"]] == [103]


def test_a_policy_timeout_on_either_run_is_no_determinism_mismatch():
    # A hung forward depends on the clock: its episode (or a never-run one, no return) may finish
    # when re-run, and two never-run rows (NaN returns) are not "different" episodes either.
    table = records_to_table([_row(0, 5.0, 10), _row(1, float("nan"), 0, "policy_timeout"),
                              _row(2, 3.0, 4, "policy_timeout"), _row(3, 2.0, 10)])
    rerun = records_to_table([_row(0, 5.0, 10), _row(1, float("nan"), 0, "policy_timeout"),
                              _row(2, 7.0, 10), _row(3, float("nan"), 0, "policy_timeout")])
    audit = determinism_audit(table, rerun)
    assert (audit["checked"], audit["skipped"], audit["mismatches"]) == (1, 3, [])


def test_constant_returns_over_varying_lengths_are_flagged():
    gamed = records_to_table([_row(i, 7.0, 5 + i) for i in range(12)])
    assert reward_integrity(gamed) and reward_integrity(gamed)[0].startswith("constant_returns")
    capped = records_to_table([_row(i, 500.0, 500, "truncated") for i in range(12)])
    assert reward_integrity(capped) == []


def test_round_schedule_grows_until_target_or_cap():
    req = EvalRequest.build(policy="x.pt", episodes=20, target_ci_halfwidth=0.5, max_episodes=200)
    rng = np.random.default_rng(0)

    def table(n, scale):
        return records_to_table([_row(i, float(rng.normal(0, scale)), 10) for i in range(n)])

    sched = RoundSchedule(req)
    assert sched.next_episodes(None) == 20
    nxt = sched.next_episodes(table(20, 10.0))
    assert nxt == 200  # std 10 needs ~1,500 episodes for ±0.5: capped
    assert sched.next_episodes(table(200, 10.0)) is None and sched.stop_reason == "max episodes reached"
    calm = RoundSchedule(req)
    calm.next_episodes(None)
    # Narrow enough at 20, but no early stop below min_stop_episodes(5 looks) = 90 episodes.
    assert calm.next_episodes(table(20, 0.1)) == 90
    assert calm.next_episodes(table(90, 0.1)) is None
    assert calm.stop_reason == "target CI half-width reached"
    assert [r["episodes"] for r in calm.summary()["rounds"]] == [20, 90]
    fixed = RoundSchedule(EvalRequest.build(policy="x.pt", episodes=20))
    fixed.next_episodes(None)
    assert fixed.next_episodes(pa.concat_tables([table(20, 1.0)])) is None
    assert fixed.summary() is None


def test_a_first_round_with_no_spread_never_stops_the_evaluation():
    # Issue 13: 16 episodes of a 0/1 reward without a success gave the CI [0, 0], half-width 0,
    # and adaptive evaluation stopped at once; the truth could be p = 0.1 (18.5% likely).
    req = EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=0.05, max_episodes=2000)
    sched = RoundSchedule(req)
    assert sched.next_episodes(None) == 16
    assert sched.next_episodes(records_to_table([_row(i, 0.0, 10) for i in range(16)])) == 32
    assert sched.stop_reason == ""
    first = sched.rounds[0]
    assert first["low"] < 0.1 < first["high"] and first["halfwidth"] > 0.05


def test_returns_equal_up_to_rounding_have_no_spread_and_never_stop_the_evaluation():
    # 15 returns of 0.3 and one of 0.1 + 0.2 (0.30000000000000004) were "spread": the interval
    # was 3e-17 wide and adaptive mode stopped after the first round.
    req = EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=0.01, max_episodes=2000)
    sched = RoundSchedule(req)
    assert sched.observe(np.array([0.3] * 15 + [0.1 + 0.2]), 16) == 32
    assert sched.stop_reason == "" and sched.rounds[0]["halfwidth"] > 0.01
    # Returns that differ at their own scale still count as spread.
    small = RoundSchedule(EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=1e-6,
                                            max_episodes=2000))
    assert small.observe(np.array([1e-9] * 8 + [2e-9] * 8), 16) == 99  # the minimum count
    assert small.rounds[0]["went_on"] == "minimum 99 episodes before an early stop"
    assert small.observe(np.array([1e-9] * 50 + [2e-9] * 49), 99) is None
    assert small.stop_reason == "target CI half-width reached"


def test_adaptive_looks_are_bonferroni_adjusted_and_bounded():
    req = EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=0.05, max_episodes=2000)
    sched = RoundSchedule(req)
    assert sched.looks == 8  # 16 -> 32 -> ... -> 2048 >= 2000: at most 8 looks
    assert sched.look_level == pytest.approx(1 - 0.05 / 8)
    x = (np.random.default_rng(1).random(2000) < 0.1).astype(float)
    n, seen = sched.next_episodes(None), []
    while n is not None:
        seen.append(n)
        n = sched.observe(x[:n], n)
    assert all(b >= 2 * a or b == 2000 for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) <= sched.looks
    summary = sched.summary()
    assert summary["per_look_level"] == pytest.approx(0.99375) and summary["max_looks"] == 8
    assert summary["ci"]["level"] == 0.95
    assert summary["ci"]["method"] == (
        "hull of clopper-pearson and t (two values), Bonferroni over 8 looks "
        "(per-look level 0.99375)")
    last = summary["rounds"][-1]
    assert (summary["ci"]["low"], summary["ci"]["high"]) == (last["low"], last["high"])
    # The reported interval is the per-look one, wider than an unadjusted 95% interval.
    plain = mean_ci(x[: seen[-1]], seed=0)
    assert summary["ci"]["high"] - summary["ci"]["low"] > plain.high - plain.low
    if summary["stop_reason"] == "target CI half-width reached":
        assert last["halfwidth"] <= 0.05


def test_an_adaptive_run_never_stops_before_a_rare_large_return_could_have_shown():
    """Returns 0 + N(0, 0.01), and 500 one time in ten (true mean 50): the first 16 had no 500,
    spread enough to count, and a 95% interval of [-0.018, 0.009]; the run stopped there, exit 0."""
    from evalfleet.report import aggregate
    from evalfleet.summary import summary_rows

    rng = np.random.default_rng(1)
    x = 500.0 * (rng.random(2000) < 0.1) + rng.normal(0.0, 0.01, 2000)
    x[:16] = rng.normal(0.0, 0.01, 16)  # planted: the first round saw no 500
    req = EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=25.0, max_episodes=2000)
    sched = RoundSchedule(req)
    assert sched.next_episodes(None) == 16
    assert sched.observe(x[:16], 16) == 99  # narrow (the target is 25), but too few to stop
    first = sched.rounds[0]
    assert first["halfwidth"] < 0.1 and first["high"] < 1.0
    assert first["went_on"] == "minimum 99 episodes before an early stop"
    from evalfleet.audit import P_RARE, min_stop_episodes

    assert (sched.looks, P_RARE) == (8, 0.05)
    assert sched.min_stop == min_stop_episodes(8) == 99  # ceil(log(0.05 / 8) / log(0.95))
    assert 0.95 ** 98 > 0.05 / 8 >= 0.95 ** 99
    n, seen = 99, [16, 99]
    while n is not None:
        n = sched.observe(x[:n], n)
        seen += [n] if n is not None else []
    assert sched.stop_reason == "target CI half-width reached" and seen[-1] >= 99
    assert sched.interval is not None and sched.interval.low <= 50.0 <= sched.interval.high
    assert sched.rounds[-1]["went_on"] is None
    summary = sched.summary()
    assert summary["min_episodes_to_stop"] == 99 and "rarer one can still be missed" in summary["stop_rule"]

    # The report's summary says why the run went on.
    table = records_to_table([_row(i, float(x[i]), 10) for i in range(seen[-1])])
    report = aggregate(req, table, env_spec={"env_id": ENV}, env_spec_hash="spec",
                       policy={"sha256": "ab" * 32}, isolation="inprocess", timings={},
                       cache={"status": "miss"}, run_seconds=1.0)
    rows = {r["metric"]: r["value"] for r in summary_rows(report.model_copy(update={"adaptive": summary}))}
    assert rows["adaptive"].endswith(": target CI half-width reached; went on after round 1: "
                                     "minimum 99 episodes before an early stop"), rows["adaptive"]


def test_an_adaptive_run_capped_below_the_minimum_runs_to_its_cap():
    req = EvalRequest.build(policy="x.pt", episodes=16, target_ci_halfwidth=25.0, max_episodes=40)
    sched = RoundSchedule(req)
    x = np.random.default_rng(2).normal(0.0, 0.01, 40)
    assert sched.observe(x[:16], 16) == 40
    assert sched.observe(x, 40) is None and sched.stop_reason == "max episodes reached"
    assert sched.min_stop == 80  # 3 looks (16, 32, 64 >= 40)


def test_scored_returns_keep_policy_failures_and_drop_harness_failures():
    table = records_to_table([_row(0, 1.0, 10), _row(1, 2.0, 10, "invalid_action"),
                              _row(2, 3.0, 10, "crashed"), _row(3, 4.0, 10, "truncated")])
    assert scored_returns(table).tolist() == [1.0, 2.0, 4.0]


def _stepped(i, length, lo, hi, at_lo, at_hi, reason="terminated"):
    row = _row(i, 0.0, length, reason)
    row.nonfinal_reward_min, row.nonfinal_reward_max = lo, hi
    row.nonfinal_steps_at_min, row.nonfinal_steps_at_max = at_lo, at_hi
    return row


def test_step_rewards_combine_episode_extremes_exactly():
    table = records_to_table([
        _stepped(0, 11, -1.0, 1.0, 3, 2),   # 10 non-final steps: 3 on -1, 2 on +1
        _stepped(1, 21, -0.5, 1.0, 1, 4),   # its minimum is not the global one: its 1 step is not counted
        _stepped(2, 1, None, None, 0, 0),   # one step only: no non-final step
        _stepped(3, 31, -1.0, 0.9, 6, 1, reason="env_error"),  # failed: left out
    ])
    summary = step_rewards(table)
    assert summary == {"steps": 30, "min": -1.0, "max": 1.0, "at_min_fraction": 3 / 30,
                       "at_max_fraction": 6 / 30, "between_fraction": 21 / 30}
    assert step_rewards(records_to_table([_stepped(0, 1, None, None, 0, 0)])) is None


def test_clip_alarm_needs_mass_on_nonzero_extremes_and_values_between():
    base = {"steps": 1000, "min": -1.0, "max": 1.0}
    clipped = clipped_reward_alarm({**base, "at_min_fraction": 0.15, "at_max_fraction": 0.16,
                                    "between_fraction": 0.69})
    assert clipped is not None and clipped.startswith("reward_clipped: of 1000 non-final steps, ")
    assert "15.0% exactly the min -1.0 and 16.0% exactly the max 1.0" in clipped
    # A two-valued reward (e.g. -1 per step, +1 on some steps) has nothing between: not clipping.
    assert clipped_reward_alarm({**base, "at_min_fraction": 0.7, "at_max_fraction": 0.3,
                                 "between_fraction": 0.0}) is None
    # A sparse reward, 0 on most steps, is not clipped at 0.
    assert clipped_reward_alarm({"steps": 1000, "min": 0.0, "max": 5.3, "at_min_fraction": 0.9,
                                 "at_max_fraction": 0.001, "between_fraction": 0.099}) is None
    # Few steps on the extremes: a continuous reward.
    assert clipped_reward_alarm({**base, "at_min_fraction": 0.001, "at_max_fraction": 0.001,
                                 "between_fraction": 0.998}) is None
    assert clipped_reward_alarm({**base, "min": 1.0, "at_min_fraction": 1.0, "at_max_fraction": 1.0,
                                 "between_fraction": 0.0}) is None  # constant per-step reward


def _nonfinal_extremes(policy, seed, env_id):
    env = gym.make(env_id)
    obs, _ = env.reset(seed=seed)
    rewards, done = [], False
    while not done:
        action = int(policy.act(np.asarray(obs, np.float32)[None])[0])
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(float(reward))
        done = terminated or truncated
    inner = np.array(rewards[:-1])
    if not inner.size:
        return None, None, 0, 0
    return (float(inner.min()), float(inner.max()), int((inner == inner.min()).sum()),
            int((inner == inner.max()).sum()))


def test_clipped_reward_is_flagged_and_the_runner_counts_exactly():
    table = _episodes("tests.flows.user_envs:toward_goal", n=200, env="ClippedWarehouse-v0")
    summary = step_rewards(table)
    assert summary["min"] == -1.0 and summary["max"] == 1.0
    assert 0.25 < summary["at_min_fraction"] + summary["at_max_fraction"] < 0.40  # N(0,1) beyond ±1
    alarms = reward_integrity(table)
    assert [a.split(":")[0] for a in alarms] == ["reward_clipped"], alarms
    # Each row's extremes and counts are what stepping the env by hand gives.
    resolved = resolve_env("ClippedWarehouse-v0", {}, None)
    art = receive_policy("tests.flows.user_envs:toward_goal", None, resolved.observation_space,
                         resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    for row in table.slice(0, 25).to_pylist():
        got = (row["nonfinal_reward_min"], row["nonfinal_reward_max"], row["nonfinal_steps_at_min"],
               row["nonfinal_steps_at_max"])
        assert got == _nonfinal_extremes(policy, row["seed"], "ClippedWarehouse-v0"), row["episode_index"]
    # The same env without the clip: no alarm.
    assert reward_integrity(_episodes("tests.flows.user_envs:toward_goal", n=200)) == []


def test_determinism_audit_counts_only_the_reruns_it_compared():
    table = records_to_table([_row(i, float(i), 10) for i in range(3)])
    crashed = records_to_table([_row(0, float("nan"), 0, "crashed"), _row(1, float("nan"), 0, "oom")])
    audit = determinism_audit(table, crashed)
    assert audit == {"checked": 0, "mismatches": [], "skipped": 2}
    from evalfleet.audit import determinism_audit_alarm

    assert determinism_audit_alarm(audit) == (
        "determinism_audit_incomplete: the determinism audit compared no episode (all 2 re-run "
        "episodes ended in an infrastructure failure (timeout, crash, oom) on one of the two "
        "runs); the env's determinism is unchecked: re-run the evaluation with --refresh, or look "
        "at the workers' failures first")
    # One compared, one crashed: counted apart, and no alarm.
    mixed = records_to_table([_row(0, 0.0, 10), _row(2, float("nan"), 0, "timeout")])
    assert determinism_audit(table, mixed) == {"checked": 1, "mismatches": [], "skipped": 1}
    assert determinism_audit_alarm(determinism_audit(table, mixed)) is None
    # An original that crashed says nothing either: no mismatch against its clean re-run.
    first_crashed = records_to_table([_row(0, float("nan"), 0, "crashed"), _row(1, 1.0, 10)])
    assert determinism_audit(first_crashed, records_to_table([_row(0, 0.0, 10)])) == {
        "checked": 0, "mismatches": [], "skipped": 1}
    assert determinism_audit_alarm(None) is None  # not asked for


def test_an_audit_skipped_for_policy_timeouts_says_so():
    # Policy timeouts were called "an infrastructure failure (timeout, crash, oom)".
    from evalfleet.audit import determinism_audit_alarm

    table = records_to_table([_row(i, float(i), 10) for i in range(3)])
    hung = records_to_table([_row(0, 0.0, 3, "policy_timeout"), _row(1, 1.0, 4, "policy_timeout")])
    audit = determinism_audit(table, hung)
    assert audit == {"checked": 0, "mismatches": [], "skipped": 2, "skipped_policy_timeout": 2}
    assert ("(all 2 re-run episodes ended in a policy timeout (the policy's forward did not "
            "return in time) on one of the two runs)") in determinism_audit_alarm(audit)
    mixed = records_to_table([_row(0, 0.0, 3, "policy_timeout"), _row(1, float("nan"), 0, "oom")])
    assert ("(all 2 re-run episodes ended 1 in an infrastructure failure (timeout, crash, oom) and "
            "1 in a policy timeout (the policy's forward did not return in time) on one of the two "
            "runs)") in determinism_audit_alarm(determinism_audit(table, mixed))


def test_unmatched_pairs_are_counted_and_raise_an_alarm():
    from evalfleet.audit import unmatched_pairs_alarm

    new = records_to_table([_row(i, float(i % 7), 10) for i in range(20)])
    base = records_to_table([_row(i, float(i % 5), 10) for i in range(20) if i % 4])
    c = compare_with_baseline(new, base, seed=0, source="sha256:ee")
    assert (c["n"], c["dropped_unmatched"], c["dropped_harness_failures"]) == (15, 5, 0)
    assert unmatched_pairs_alarm(c) == (
        "baseline_pairs_unmatched: 5 episodes had no row of the baseline (sha256:ee) on the same "
        "index and seed and were left out of the paired comparison (15 pairs left): its verdict "
        "may be biased; evaluate the baseline on the same seeds and episode count (pass its "
        "policy file)")
    assert unmatched_pairs_alarm(compare_with_baseline(new, new, seed=0, source="x")) is None


def test_a_comparison_needs_min_pairs_for_a_verdict():
    new = records_to_table([_row(i, r, 10) for i, r in enumerate([101.0, 97.0, 104.0])])
    base = records_to_table([_row(i, r, 10) for i, r in enumerate([100.0, 96.5, 103.0])])
    c = compare_with_baseline(new, base, seed=0, source="prev")
    assert c["verdict"] == "too few pairs" and c["n"] == 3
    assert c["note"] == "3 paired episodes: a verdict needs at least 10"
    one = compare_with_baseline(new.slice(0, 1), base.slice(0, 1), seed=0, source="prev")
    assert (one["verdict"], one["note"]) == ("too few pairs",
                                             "1 paired episodes: a verdict needs at least 10")
