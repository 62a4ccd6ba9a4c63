"""Tests of the reference policies: the batch contract, determinism, and heuristic beats random."""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
import pytest

import envs  # noqa: F401  (registers the environments)
from envs import connect_four as c4
from envs import reference_policies as rp

Policy = Callable[[np.ndarray], np.ndarray]

POLICIES: dict[str, tuple[str, Policy, Policy]] = {
    "recommend": ("evalfleet/Recommend-v0", rp.recommend_random, rp.recommend_heuristic),
    "inventory": ("evalfleet/Inventory-v0", rp.inventory_random, rp.inventory_heuristic),
    "connect_four": ("evalfleet/ConnectFour-v0", rp.connect_four_random, rp.connect_four_heuristic),
}
ALL_POLICIES = [
    pytest.param(env_id, policy, id=policy.__name__)
    for env_id, random_policy, heuristic in POLICIES.values()
    for policy in (random_policy, heuristic)
]


def observation_batch(env_id: str, size: int = 64) -> np.ndarray:
    """Observations from a few short random-action episodes."""
    env = gym.make(env_id)
    rng = np.random.default_rng(0)
    observations: list[np.ndarray] = []
    obs, _ = env.reset(seed=0)
    while len(observations) < size:
        observations.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))  # type: ignore[attr-defined]
        if terminated or truncated:
            obs, _ = env.reset()
    return np.stack(observations)


def mean_return(env_id: str, policy: Policy, episodes: int = 100) -> float:
    env = gym.make(env_id)
    returns = []
    for seed in range(episodes):
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(int(policy(obs[None])[0]))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


@pytest.mark.parametrize(("env_id", "policy"), ALL_POLICIES)
def test_policy_returns_one_valid_action_per_row(env_id: str, policy: Policy) -> None:
    batch = observation_batch(env_id)
    actions = policy(batch)
    assert actions.shape == (len(batch),)
    assert np.issubdtype(actions.dtype, np.integer)
    action_space = gym.make(env_id).action_space
    assert all(action_space.contains(np.int64(a)) for a in actions)


@pytest.mark.parametrize(("env_id", "policy"), ALL_POLICIES)
def test_policy_is_a_pure_function_of_each_row(env_id: str, policy: Policy) -> None:
    batch = observation_batch(env_id)
    global_state = np.random.get_state()
    actions = policy(batch)
    after = np.random.get_state()
    assert all(np.array_equal(x, y) for x, y in zip(global_state, after, strict=True)), (
        "the global numpy RNG was used"
    )
    assert np.array_equal(policy(batch), actions)
    assert np.array_equal(policy(batch[::-1]), actions[::-1])
    assert np.array_equal(np.concatenate([policy(batch[i : i + 1]) for i in range(5)]), actions[:5])


@pytest.mark.parametrize(("env_id", "policy"), ALL_POLICIES)
def test_single_observation_without_batch_axis_is_rejected(env_id: str, policy: Policy) -> None:
    obs, _ = gym.make(env_id).reset(seed=0)
    with pytest.raises(ValueError, match="batch"):
        policy(obs)


def test_random_policies_spread_over_the_actions() -> None:
    for env_id, random_policy, _ in POLICIES.values():
        actions = random_policy(observation_batch(env_id, size=200))
        assert len(np.unique(actions)) >= 5, env_id


@pytest.mark.parametrize("policy", [rp.connect_four_random, rp.connect_four_heuristic])
def test_connect_four_policies_take_board_shaped_batches_and_never_play_full_columns(
    policy: Policy,
) -> None:
    board = np.zeros((c4.ROWS, c4.COLUMNS), dtype=np.float32)
    board[:, [2, 3, 4]] = np.array([[1, -1, 1], [-1, 1, -1]] * 3, dtype=np.float32)  # full
    actions = policy(np.stack([board] * 8))
    assert actions.shape == (8,)
    assert not np.isin(actions, [2, 3, 4]).any()


def heuristic_move(*rows: str) -> int:
    values = {"x": 1.0, "o": -1.0, ".": 0.0}
    board = np.array([[values[ch] for ch in row] for row in rows], dtype=np.float32)
    return int(rp.connect_four_heuristic(board.reshape(1, -1))[0])


def test_connect_four_heuristic_wins_then_blocks_then_plays_safe_centre() -> None:
    top = (".......",) * 3
    assert heuristic_move(*top, "x.....o", "x.....o", "x.....o") == 0  # win beats blocking
    assert heuristic_move(*top, "......o", "......o", "x.x...o") == 6  # block
    assert heuristic_move(*top, ".......", ".......", ".......") == 3  # centre
    # Column 3 would let the opponent complete row 1 on top of it: the centre-most safe is 2.
    assert heuristic_move(*top, ".......", "....ooo", "xx..xxo") == 2


@pytest.mark.parametrize(
    ("name", "margin"),
    [("recommend", 40.0), ("inventory", 2_000.0), ("connect_four", 0.3)],
)
def test_heuristic_beats_random_by_a_margin(name: str, margin: float) -> None:
    env_id, random_policy, heuristic = POLICIES[name]
    random_mean = mean_return(env_id, random_policy)
    heuristic_mean = mean_return(env_id, heuristic)
    assert heuristic_mean > random_mean + margin, (heuristic_mean, random_mean)


@pytest.mark.parametrize(("env_id", "policy"), ALL_POLICIES)
def test_use_case_rewards_raise_no_clip_alarm(env_id: str, policy: Policy) -> None:
    from evalfleet.audit import clipped_reward_alarm, step_rewards
    from evalfleet.envspec import env_thunk, resolve_env
    from evalfleet.policy import load_policy, receive_policy
    from evalfleet.records import records_to_table
    from evalfleet.runner import EpisodeContext, run_shard
    from evalfleet.sandbox.base import InProcessSlots
    from evalfleet.seeds import SeedLedger

    resolved = resolve_env(env_id, {}, None)
    art = receive_policy(f"envs.reference_policies:{policy.__name__}", None,
                         resolved.observation_space, resolved.action_space)
    loaded = load_policy(art.format, art.payload, None, art.source, resolved.action_space)
    ledger = SeedLedger(0)
    records = run_shard([(i, ledger.seed(i)) for i in range(60)],
                        InProcessSlots(env_thunk(env_id, {}, None), 16), loaded,
                        EpisodeContext("r", art.sha256, env_id, "s", "w"))
    summary = step_rewards(records_to_table(records))
    assert summary is not None and summary["steps"] > 0
    assert clipped_reward_alarm(summary) is None, summary
