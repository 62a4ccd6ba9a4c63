"""Paired comparison on a correlated env, audit sampling, reward integrity, round schedule."""

import numpy as np
import pyarrow as pa

import tests.flows.user_envs  # noqa: F401
from evalfleet.audit import (
    RoundSchedule,
    audit_sample,
    compare_with_baseline,
    determinism_audit,
    reward_integrity,
)
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.models import EvalRequest
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import EpisodeRecord, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger

ENV = "tests.flows.user_envs:Warehouse-v0"


def _episodes(policy_ref, n=300, seed=0):
    resolved = resolve_env(ENV, {}, None)
    art = receive_policy(policy_ref, None, resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    ledger = SeedLedger(seed)
    records = run_shard([(i, ledger.seed(i)) for i in range(n)], InProcessSlots(env_thunk(ENV, {}, None), 16),
                        policy, EpisodeContext("r", art.sha256, ENV, "s", "w"))
    return records_to_table(records).sort_by("episode_index")


def test_pairing_narrows_the_interval_on_a_correlated_env():
    new = _episodes("tests.flows.user_envs:toward_goal")
    base = _episodes("tests.flows.user_envs:toward_goal_dawdling")
    result = compare_with_baseline(new, base, seed=0, source="dawdling")
    paired = result["ci"]["high"] - result["ci"]["low"]
    unpaired = result["unpaired_ci"]["high"] - result["unpaired_ci"]["low"]
    assert result["n"] == 300
    assert paired < 0.9 * unpaired, (paired, unpaired)
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


def test_determinism_audit_reports_mismatched_seeds():
    table = records_to_table([_row(i, float(i), 10) for i in range(5)])
    rerun = records_to_table([_row(1, 1.0, 10), _row(3, 3.5, 11)])
    audit = determinism_audit(table, rerun)
    assert audit["checked"] == 2
    assert [m["seed"] for m in audit["mismatches"]] == [103]


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
    assert calm.next_episodes(table(20, 0.1)) is None
    assert calm.stop_reason == "target CI half-width reached"
    assert calm.summary()["rounds"][0]["episodes"] == 20
    fixed = RoundSchedule(EvalRequest.build(policy="x.pt", episodes=20))
    fixed.next_episodes(None)
    assert fixed.next_episodes(pa.concat_tables([table(20, 1.0)])) is None
    assert fixed.summary() is None
