"""A float32 action at a float64 Box's bound is the bound, not the policy's ``invalid_action``.

Inference is float32: for bounds of +-0.1, a bounded torch policy (``tanh(...) * 0.1``) saturates
at float32(0.1) = 0.10000000149011612, just outside the space. Every such action ended its
episode at once as ``invalid_action``, scored by the policy with the return so far: with positive
rewards the mean fell with no alarm. Such actions are now clipped to the exact bound; anything
further out stays invalid.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from evalfleet.envspec import env_thunk, resolve_env
from evalfleet.policy import LoadedPolicy, load_policy, receive_policy
from evalfleet.records import records_to_table
from evalfleet.runner import EpisodeContext, _batch_actions, _invalid_actions, _to_env_action, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger
from tests.core.float64_box_envs import ENV_ID

SPACE = gym.spaces.Box(-0.1, 0.1, (1,), np.float64)
AT_HIGH, AT_LOW = float(np.float32(0.1)), float(np.float32(-0.1))  # 0.10000000149011612


class _Clamped(torch.nn.Module):
    """A proportional controller bounded as trained policies are (tanh times the bound)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(100.0 * (x[:, 1:2] - x[:, 0:1])) * 0.1


def _run(policy: LoadedPolicy, n: int) -> list[dict[str, object]]:
    ledger = SeedLedger(0)
    box = InProcessSlots(env_thunk(ENV_ID, {}, None), 4)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(n)], box, policy,
                            EpisodeContext("r", "sha", ENV_ID, "s", "w"))
    finally:
        box.close()
    return records_to_table(records).sort_by("episode_index").to_pylist()


def test_a_float32_action_at_a_float64_bound_is_accepted_and_clipped_to_it() -> None:
    actions = np.array([[AT_HIGH], [AT_LOW], [0.05]])
    assert AT_HIGH > 0.1 and AT_LOW < -0.1  # outside the exact bounds
    assert _invalid_actions(SPACE, actions).tolist() == [False, False, False]
    assert _batch_actions(SPACE, actions).tolist() == [[0.1], [-0.1], [0.05]]
    assert _to_env_action(SPACE, actions[0]).tolist() == [0.1]
    assert SPACE.contains(_to_env_action(SPACE, actions[0]))
    past = float(np.nextafter(np.float32(0.1), np.float32(1.0)))  # 0.10000000894069672
    assert _invalid_actions(SPACE, np.array([[past], [0.1000001], [-past]])).tolist() == [True, True, True]
    # A float32 Box's bounds are float32 already: nothing widened there.
    box32 = gym.spaces.Box(-0.1, 0.1, (1,), np.float32)
    assert _invalid_actions(box32, np.array([[AT_HIGH], [past]])).tolist() == [False, True]


def test_a_saturated_torch_policy_plays_its_episodes_out(tmp_path: Path) -> None:
    path = tmp_path / "clamp.pt"
    torch.jit.save(torch.jit.script(_Clamped()), str(path))
    resolved = resolve_env(ENV_ID, {}, None)
    art = receive_policy(str(path), None, resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    rows = _run(policy, 12)
    assert [r["end_reason"] for r in rows] == ["truncated"] * 12
    assert [r["length"] for r in rows] == [20] * 12
    # The same episodes by hand, each saturated action moved onto the bound.
    env, saturated = gym.make(ENV_ID), 0
    for row in rows:
        obs, _ = env.reset(seed=row["seed"])
        total, done = 0.0, False
        while not done:
            out = policy.act(np.asarray(obs, dtype=np.float32)[None])[0].astype(np.float64)
            saturated += int(abs(out[0]) == AT_HIGH)
            obs, reward, terminated, truncated, _ = env.step(np.clip(out, -0.1, 0.1))
            total += float(reward)
            done = terminated or truncated
        assert row["return"] == total, f"episode {row['episode_index']}"
    assert saturated >= 12  # every episode starts far from its target: at the bound


def test_an_action_past_the_bounds_float32_rounding_stays_invalid() -> None:
    resolved = resolve_env(ENV_ID, {}, None)
    art = receive_policy("tests.core.float64_box_envs:past_the_rounding", None,
                         resolved.observation_space, resolved.action_space)
    policy = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    rows = _run(policy, 4)
    assert [(r["end_reason"], r["length"]) for r in rows] == [("invalid_action", 0)] * 4
    assert rows[0]["error"] == "action [0.10000000894069672] not in Box(-0.1, 0.1, (1,), float64)"


@pytest.mark.parametrize("bound", [0.7, 1e300])
def test_other_bounds_accept_only_their_float32_rounding(bound: float) -> None:
    space = gym.spaces.Box(-bound, bound, (1,), np.float64)
    with np.errstate(over="ignore"):
        at = float(np.float32(bound)) if np.isfinite(np.float32(bound)) else bound
    assert not _invalid_actions(space, np.array([[at], [-at]])).any()
    assert _invalid_actions(space, np.array([[np.nextafter(max(at, bound), np.inf)]])).all()
