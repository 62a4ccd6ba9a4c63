"""An env that reuses its observation array or changes its action array records what happened.

Found in-process only: a trajectory row read the observation and the action after ``step`` had
run, so an env that updates one observation array in place recorded the NEXT observation, and
one that scales its action in place recorded the scaled action (also in the action plot). A
constant policy's output (a view of its own buffer, every row the same bytes) was handed to the
envs as is: an env scaling its action rewrote the policy's weights and every other row's action,
so returns depended on the slot count. An observation array shared by instances made slots act
on another slot's reset. ``process`` isolation copies everything across the wire and was right;
each case here is checked against a plain loop, in-process and in a sandbox.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import LoadedPolicy, load_policy, receive_policy
from evalfleet.records import records_to_table
from evalfleet.replay import ReplaySandbox, record_episodes, replay_inputs
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox import open_slots
from evalfleet.seeds import SeedLedger
from tests.core import quirky_envs as qe

LEVELS = ["inprocess", pytest.param("process", marks=pytest.mark.slow)]


def _loaded(env_id: str, ref: str) -> LoadedPolicy:
    resolved = resolve_env(env_id, {}, None)
    art = receive_policy(ref, None, resolved.observation_space, resolved.action_space)
    return load_policy(art.format, art.payload, None, art.source, resolved.action_space)


def _episodes(env_id: str, policy: LoadedPolicy, n: int, slots: int, level: str = "inprocess"
              ) -> list[dict[str, Any]]:
    resolved = resolve_env(env_id, {}, None)
    ledger = SeedLedger(0)
    box = open_slots(level, env_thunk(env_id, {}, None), slots, episode_timeout_s=60.0,
                     env_spec=resolved.fingerprint.as_dict())
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(n)], box, policy,
                            EpisodeContext("r", "s", env_id, "h", "w"))
    finally:
        box.close()
    return records_to_table(records).sort_by("episode_index").to_pylist()


def _plain(env_id: str, fn: Any, seed: int) -> list[tuple[list[float], Any, float]]:
    """(observation acted on, action given, reward) per step, each read BEFORE the env stepped."""
    env = gym.make(env_id, disable_env_checker=True)
    obs, _ = env.reset(seed=seed)
    discrete = isinstance(env.action_space, gym.spaces.Discrete)
    steps = []
    while True:
        acted = [float(v) for v in np.asarray(obs, np.float64).ravel()]
        action = np.asarray(fn(np.asarray(obs, np.float32)[None]))[0]
        given = int(action) if discrete else [float(v) for v in np.asarray(action, np.float64).ravel()]
        obs, reward, terminated, truncated, _ = env.step(
            int(action) if discrete else np.array(action, dtype=env.action_space.dtype))
        steps.append((acted, given, float(reward)))
        if terminated or truncated:
            return steps


def _replayed(env_id: str, policy: LoadedPolicy, table: list[dict[str, Any]], level: str
              ) -> tuple[dict[int, list[tuple[list[float], Any, float]]], dict[str, Any], tuple[str, ...]]:
    import pyarrow as pa

    from evalfleet.records import EPISODE_SCHEMA

    episodes, expected, reasons = replay_inputs(pa.Table.from_pylist(table, EPISODE_SCHEMA),
                                                [r["episode_index"] for r in table])
    sandbox = None
    if level != "inprocess":
        env = resolve_env(env_id, {}, None)
        sandbox = ReplaySandbox(level, 60.0, env.fingerprint.as_dict(),
                                obs_shape=tuple(env.observation_space.shape))
    result = record_episodes(env_id, {}, None, policy, episodes, video_dir=None, trajectories=True,
                             expected=expected, end_reasons=reasons, sandbox=sandbox)
    rows: dict[int, list[tuple[list[float], Any, float]]] = {}
    for row in result.trajectories.to_pylist():
        rows.setdefault(row["seed"], []).append((row["obs"], row["action"], row["reward"]))
    return rows, result.actions, result.mismatches


@pytest.mark.parametrize("level", LEVELS)
def test_trajectory_rows_hold_the_observation_acted_on_though_the_env_reuses_its_array(level):
    policy = _loaded(qe.ALIAS_OBS, "tests.core.quirky_envs:sign0")
    table = _episodes(qe.ALIAS_OBS, policy, 3, slots=2)
    rows, actions, mismatches = _replayed(qe.ALIAS_OBS, policy, table, level)
    assert mismatches == ()
    plain = {r["seed"]: _plain(qe.ALIAS_OBS, qe.sign0, r["seed"]) for r in table}
    assert sum(len(p) for p in plain.values()) > 30
    assert rows == plain  # every step: the observation the action was chosen from
    given = [a for steps in plain.values() for _, a, _ in steps]
    assert actions["counts"] == [given.count(0), given.count(1)]
    # And the episode rows, which the runner fills from its own copy of each observation.
    assert [r["return"] for r in table] == [sum(s[2] for s in plain[r["seed"]]) for r in table]


@pytest.mark.parametrize("level", LEVELS)
def test_trajectory_rows_and_action_plot_hold_the_action_given_though_the_env_changes_it(level):
    policy = _loaded(qe.MUT_ACT, "tests.core.quirky_envs:box1")
    table = _episodes(qe.MUT_ACT, policy, 3, slots=2)
    rows, actions, mismatches = _replayed(qe.MUT_ACT, policy, table, level)
    assert mismatches == ()
    plain = {r["seed"]: _plain(qe.MUT_ACT, qe.box1, r["seed"]) for r in table}
    assert rows == plain  # the policy's action, not the half the env left of it
    given = [a for seed in rows for _, a, _ in plain[seed]]
    assert actions["samples"].ravel().tolist() == [v for a in given for v in a]
    assert [r["return"] for r in table] == [sum(s[2] for s in plain[r["seed"]]) for r in table]


@pytest.fixture(scope="module")
def constant_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("const")) / "constant.pt"
    torch.jit.save(torch.jit.script(qe.ConstantAction(0.8)), str(path))
    return str(path)


@pytest.mark.parametrize("level", LEVELS)
def test_an_env_changing_its_action_changes_no_other_row_and_not_the_policy(level, constant_policy):
    # Each step the env gets 0.8 and moves by 0.4, whatever the slot count or isolation level.
    policy = _loaded(qe.MUT_ACT, constant_policy)
    plain = [sum(s[2] for s in _plain(qe.MUT_ACT, lambda b: np.full((len(b), 1), 0.8, np.float32),
                                      int(seed)))
             for seed in SeedLedger(0).seeds(range(8))]
    for slots in (1, 4):
        table = _episodes(qe.MUT_ACT, policy, 8, slots, level)
        assert [r["return"] for r in table] == plain, f"{slots} slots"
    out = policy.act(np.zeros((3, 2), np.float32))
    assert out.ravel().tolist() == pytest.approx([0.8] * 3)  # its buffer was never written to


def test_instances_sharing_one_observation_array_each_act_on_their_own_reset():
    policy = _loaded(qe.SHARED_OBS, "tests.core.quirky_envs:first_positive")
    table = _episodes(qe.SHARED_OBS, policy, 12, slots=4)
    # The policy picks the right action every step when it sees the env's own observation.
    assert [r["return"] for r in table] == [6.0] * 12
