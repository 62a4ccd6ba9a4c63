"""The benchmark's smoke run (CI keeps ``bench/`` working) and the hot path's exactness.

``bench/`` is not part of the test suite; these tests run its quick mode on a few episodes, and
check what the bench's ratios rest on: evalfleet's fast paths (env instances without the
``TimeLimit``/``OrderEnforcing`` wrappers, the native vector CartPole) return exactly what
``gym.make`` envs stepped one by one return.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from evalfleet.cli import EXAMPLE_POLICY
from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import load_policy, receive_policy
from evalfleet.records import OUTCOME_COLUMNS, records_to_table
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger

CTX = EpisodeContext("req", "sha", "env", "spec", "w0")
ROOT = Path(__file__).resolve().parents[2]


def _policy(env_id="CartPole-v1", kwargs=None, deterministic=True):
    resolved = resolve_env(env_id, kwargs or {}, None)
    art = receive_policy(EXAMPLE_POLICY, None, resolved.observation_space, resolved.action_space,
                         deterministic=deterministic)
    return load_policy(art.format, art.payload, None, art.source, resolved.action_space,
                       deterministic=deterministic)


def _table(slots, policy, n):
    ledger = SeedLedger(3)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(n)], slots, policy, CTX)
    finally:
        slots.close()
    return records_to_table(records).sort_by("episode_index").select(list(OUTCOME_COLUMNS))


def _replay(policy, seed, kwargs, max_steps):
    extra = {"max_episode_steps": max_steps} if max_steps else {}
    env = gym.make("CartPole-v1", **kwargs, **extra)
    obs, _ = env.reset(seed=seed)
    total, length, terminated, truncated = 0.0, 0, False, False
    while not (terminated or truncated):
        action = policy.act(np.asarray(obs, dtype=np.float32)[None])[0]
        obs, reward, terminated, truncated, _ = env.step(int(action))
        total += float(reward)
        length += 1
    return total, length, "terminated" if terminated else "truncated"


@pytest.mark.parametrize("kwargs,max_steps,deterministic", [
    ({}, None, True), ({}, 60, True), ({"sutton_barto_reward": True}, None, True),
    ({}, 120, False),
])
def test_fast_paths_equal_gym_make_envs_bit_for_bit(kwargs, max_steps, deterministic):
    policy = _policy(kwargs=kwargs, deterministic=deterministic)
    make = env_thunk("CartPole-v1", kwargs, max_steps)
    native = InProcessSlots(make, 11, native_vector=True)
    assert native._native is not None, "a plain CartPole should take the native vector path"
    instances = _table(InProcessSlots(make, 11, native_vector=False), policy, 60)
    assert _table(native, policy, 60).equals(instances)
    if not deterministic:
        return  # the sampled actions depend on the episode's generator, not replayed here
    for row in instances.to_pylist():
        expected = _replay(policy, row["seed"], kwargs, max_steps)
        got = (row["return"], row["length"], row["end_reason"])
        assert got == expected, f"episode {row['episode_index']}"


def test_native_step_many_steps_only_the_given_slots():
    slots = InProcessSlots(env_thunk("CartPole-v1", {}, None), 4, native_vector=True)
    refs = [gym.make("CartPole-v1").unwrapped for _ in range(4)]
    for i in range(4):
        assert np.array_equal(slots.reset(i, 100 + i).obs, refs[i].reset(seed=100 + i)[0])
    for slot_ids, actions in (([0, 2], [1, 0]), ([1], [1]), ([0, 1, 2, 3], [0, 1, 1, 0])):
        outs = slots.step_many(slot_ids, actions)
        for slot, action, out in zip(slot_ids, actions, outs, strict=True):
            obs, reward, terminated, _, _ = refs[slot].step(action)
            assert np.array_equal(out.obs, obs) and out.reward == reward
            assert out.terminated == terminated, f"slot {slot}"
    slots.close()


def test_other_envs_keep_their_instances():
    slots = InProcessSlots(env_thunk("evalfleet/Inventory-v0", {}, None), 3, native_vector=True)
    assert slots._native is None
    slots.close()


def test_quick_bench_runs_as_a_module_and_evalfleet_matches_the_bare_loop(tmp_path):
    # As the README says: `python -m bench.run` from the repository root, nothing on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--no-flow", "--no-torchrl", "--no-sweep",
         "--only", "W1-2k,W3-2k", "--contenders", "bare,evalfleet_core", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "latest-quick.json").read_text())
    rows = list(result["summary"].values())
    core = [r for r in rows if r["label"].startswith("evalfleet core")]
    assert len(core) == 2 and all(r["ok"] == r["runs"] == 1 for r in core), rows
    assert all(r.get("same_returns_as_bare") for r in core), "evalfleet and the bare loop differ"
    assert all(r["ratios"].get("bare1") for r in core)
    table = (tmp_path / "table-quick.md").read_text()
    assert "### W1-2k" in table and "### Targets" in table


@pytest.mark.slow
def test_quick_bench_with_the_flow_peers_and_plot(tmp_path):
    from bench.run import main

    assert main(["--quick", "--no-torchrl", "--only", "W1-2k,W4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "latest-quick.json").read_text())
    flows = [r for r in result["summary"].values() if r["label"].startswith("evalfleet inprocess")]
    assert flows and all(r["ok"] for r in flows), flows
    assert all(r.get("same_returns_as_bare") for r in flows)
    assert (tmp_path / "throughput-quick.png").stat().st_size > 10_000
    assert any(t["target"].startswith("fixed overhead") and t["value"] is not None
               for t in result["targets"])


def test_bench_modules_leave_sys_path_alone():
    code = ("import sys; before = list(sys.path); "
            "import bench.run, bench.trial, bench.contenders, bench.plan, bench.report, bench.measure; "
            "print(sys.path == before)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]
