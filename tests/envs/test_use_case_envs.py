"""Tests of the three use-case environments: API conformance, determinism, and each env's rules."""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

import envs
from envs import connect_four as c4
from envs.connect_four import ConnectFourEnv
from envs.inventory import InventoryEnv
from envs.recommend import RecommendEnv

ENV_IDS = list(envs.ENV_IDS)
FRAME_SHAPE = (240, 320, 3)


def legal_actions(env_id: str, obs: np.ndarray, n: int) -> np.ndarray:
    """Actions worth sampling: non-full columns for Connect Four (long games), all otherwise."""
    if env_id == "evalfleet/ConnectFour-v0":
        return np.flatnonzero(obs[: c4.COLUMNS] == 0)
    return np.arange(n)


def rollout(env: gym.Env[Any, Any], env_id: str, seed: int, steps: int) -> list[tuple[Any, ...]]:
    """Step ``env`` for ``steps`` steps (resetting at episode ends) with seeded random actions."""
    actions_rng = np.random.default_rng(1234)
    obs, info = env.reset(seed=seed)
    trajectory: list[tuple[Any, ...]] = [("reset", obs, info)]
    n = int(env.action_space.n)  # type: ignore[attr-defined]
    for _ in range(steps):
        action = int(actions_rng.choice(legal_actions(env_id, obs, n)))
        obs, reward, terminated, truncated, info = env.step(action)
        trajectory.append((action, obs, reward, terminated, truncated, info))
        if terminated or truncated:
            obs, info = env.reset()
            trajectory.append(("reset", obs, info))
    return trajectory


def relevant_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    # check_env always notes that a wrapped env is not the raw one; anything else is ours to fix.
    return [
        str(w.message)
        for w in caught
        if "is different from the unwrapped version" not in str(w.message)
    ]


@pytest.mark.parametrize("env_id", ENV_IDS)
@pytest.mark.parametrize("render_mode", [None, "rgb_array"])
def test_check_env_passes_without_warnings(env_id: str, render_mode: str | None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = gym.make(env_id, render_mode=render_mode)
        check_env(env.unwrapped)
        check_env(env)
    assert relevant_warnings(caught) == []


def test_registration_is_idempotent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(envs)
        importlib.reload(envs)
    expected = {
        "evalfleet/Recommend-v0": ("envs.recommend:RecommendEnv", 100),
        "evalfleet/Inventory-v0": ("envs.inventory:InventoryEnv", 90),
        "evalfleet/ConnectFour-v0": ("envs.connect_four:ConnectFourEnv", 42),
    }
    for env_id, (entry_point, max_steps) in expected.items():
        spec = gym.spec(env_id)
        assert (spec.entry_point, spec.max_episode_steps) == (entry_point, max_steps)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_spaces_and_dtypes(env_id: str) -> None:
    env = gym.make(env_id)
    assert isinstance(env.action_space, spaces.Discrete)
    assert isinstance(env.observation_space, spaces.Box)
    assert env.observation_space.dtype == np.float32
    assert len(env.observation_space.shape) == 1
    obs, _ = env.reset(seed=0)
    assert obs.dtype == np.float32 and obs in env.observation_space
    obs, reward, terminated, truncated, _ = env.step(env.action_space.sample())
    assert obs.dtype == np.float32 and obs in env.observation_space
    assert isinstance(reward, float)
    assert isinstance(terminated, bool) and isinstance(truncated, bool)


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_same_seed_gives_identical_rollouts(env_id: str) -> None:
    first = rollout(gym.make(env_id), env_id, seed=7, steps=300)
    second = rollout(gym.make(env_id), env_id, seed=7, steps=300)
    assert len(first) == len(second)
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a[0] == b[0], f"action differs at step {step}"
        assert np.array_equal(a[1], b[1]), f"observation differs at step {step}"
        assert repr(a[2:]) == repr(b[2:]), f"reward/termination/info differs at step {step}"


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_different_seeds_give_different_episodes(env_id: str) -> None:
    def first_episode(seed: int) -> str:
        trajectory = rollout(gym.make(env_id), env_id, seed=seed, steps=120)
        end = next(i for i, t in enumerate(trajectory) if i > 0 and t[0] == "reset")
        return repr([(t[0], t[1].tolist(), t[2:]) for t in trajectory[:end]])

    episodes = {first_episode(seed) for seed in range(8)}
    assert len(episodes) >= 6


@pytest.mark.parametrize("env_id", ENV_IDS)
def test_render_returns_readable_frames(env_id: str) -> None:
    env = gym.make(env_id, render_mode="rgb_array")
    rollout(env, env_id, seed=3, steps=10)
    frame = env.render()
    assert isinstance(frame, np.ndarray)
    assert frame.shape == FRAME_SHAPE and frame.dtype == np.uint8
    assert len(np.unique(frame.reshape(-1, 3), axis=0)) > 3


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (ConnectFourEnv, {"opponent": "minimax"}),
        (ConnectFourEnv, {"opponent_depth": 5}),
        (InventoryEnv, {"lead_time": -1}),
        (InventoryEnv, {"seasonality": 1.0}),
        (RecommendEnv, {"n_items": 3, "n_features": 5}),
        (RecommendEnv, {"render_mode": "human"}),
    ],
)
def test_bad_arguments_name_the_value(
    factory: Callable[..., gym.Env[Any, Any]], kwargs: dict[str, Any]
) -> None:
    value = list(kwargs.values())[0]
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        factory(**kwargs)


# --- Connect Four -----------------------------------------------------------------------------


def board_from_rows(*rows: str) -> np.ndarray:
    """6x7 board from top-to-bottom strings of 'x' (agent), 'o' (opponent) and '.' (empty)."""
    assert len(rows) == c4.ROWS
    values = {"x": 1.0, "o": -1.0, ".": 0.0}
    return np.array([[values[ch] for ch in row] for row in rows], dtype=np.float32)


def stones(*cells: tuple[int, int]) -> int:
    """Bitboard of ``(row from bottom, column)`` cells."""
    return sum(1 << (col * (c4.ROWS + 1) + row) for row, col in cells)


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 2), (1, 2), (2, 2), (3, 2)],  # vertical
        [(4, 1), (4, 2), (4, 3), (4, 4)],  # horizontal
        [(0, 0), (1, 1), (2, 2), (3, 3)],  # diagonal /
        [(5, 2), (4, 3), (3, 4), (2, 5)],  # diagonal \
    ],
)
def test_four_in_a_row_is_detected(cells: list[tuple[int, int]]) -> None:
    assert c4.has_four(stones(*cells))
    assert not c4.has_four(stones(*cells[:3]))
    # Lines must not wrap from the top of one column into the next.
    assert not c4.has_four(stones((4, 0), (5, 0), (0, 1), (1, 1)))


@pytest.mark.parametrize(
    ("rows", "column"),
    [
        ((".......", ".......", ".......", ".......", "......o", "xxx..oo"), 3),
        ((".......", ".......", ".......", "x......", "xo.....", "xo....o"), 0),
        ((".......", ".......", ".......", "..xo...", ".xxo...", "xoox..o"), 3),
    ],
    ids=["horizontal", "vertical", "diagonal"],
)
def test_planted_win_ends_with_reward_one(rows: tuple[str, ...], column: int) -> None:
    env = ConnectFourEnv()
    env.reset(seed=0, options={"board": board_from_rows(*rows)})
    _, reward, terminated, truncated, info = env.step(column)
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info == {"outcome": "win", "success": True}


def test_full_board_without_a_line_is_a_draw() -> None:
    # Colour of (row from bottom r, column c) = (r // 2 + c) % 2 has no four in any direction.
    board = np.zeros((c4.ROWS, c4.COLUMNS), dtype=np.float32)
    for r in range(c4.ROWS):
        for c in range(c4.COLUMNS):
            board[c4.ROWS - 1 - r, c] = 1.0 if (r // 2 + c) % 2 else -1.0
    board[0, 0] = 0.0  # the agent fills the last cell
    env = ConnectFourEnv()
    env.reset(seed=0, options={"board": board})
    obs, reward, terminated, truncated, info = env.step(0)
    assert not (obs == 0).any()
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info == {"outcome": "draw", "success": False}


def test_illegal_move_terminates_with_minus_one() -> None:
    rows = ("x......", "o......", "x......", "o......", "x......", "o......")
    env = ConnectFourEnv()
    obs, _ = env.reset(seed=0, options={"board": board_from_rows(*rows)})
    after, reward, terminated, truncated, info = env.step(0)
    assert (reward, terminated, truncated) == (-1.0, True, False)
    assert info == {"outcome": "illegal", "success": False}
    assert np.array_equal(obs, after)


@pytest.mark.parametrize("seed", range(5))
def test_depth_two_opponent_blocks_a_threat(seed: int) -> None:
    rows = (".......", ".......", ".......", ".......", "......o", "xx....o")
    env = ConnectFourEnv(opponent_depth=2)
    env.reset(seed=seed, options={"board": board_from_rows(*rows)})
    obs, reward, terminated, _, _ = env.step(2)  # three in a row: threatens column 3
    assert (reward, terminated) == (0.0, False)
    assert obs.reshape(c4.ROWS, c4.COLUMNS)[-1, 3] == -1.0


@pytest.mark.parametrize("seed", range(5))
def test_depth_two_opponent_takes_an_immediate_win(seed: int) -> None:
    rows = (".......", ".......", ".......", "......o", "......o", "x.x.x.o")
    env = ConnectFourEnv(opponent_depth=2)
    env.reset(seed=seed, options={"board": board_from_rows(*rows)})
    # The agent now threatens columns 1 and 5, but the opponent wins first in column 6.
    obs, reward, terminated, _, info = env.step(3)
    assert (reward, terminated, info["outcome"]) == (-1.0, True, "loss")
    assert obs.reshape(c4.ROWS, c4.COLUMNS)[2, 6] == -1.0


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_search_opponent_beats_random_play(depth: int) -> None:
    env = ConnectFourEnv(opponent_depth=depth)
    rng = np.random.default_rng(0)
    losses = 0
    for seed in range(20):
        obs, _ = env.reset(seed=seed)
        while True:
            obs, reward, terminated, _, _ = env.step(int(rng.choice(np.flatnonzero(obs[:7] == 0))))
            if terminated:
                losses += reward < 0
                break
    assert losses >= 18


@pytest.mark.parametrize(
    ("board", "problem"),
    [
        (np.ones(5), "42 cells"),
        (
            board_from_rows(".......", ".......", ".......", ".......", "x......", "......."),
            "floats",
        ),
        (
            board_from_rows(".......", ".......", ".......", ".......", ".......", "xx....o"),
            "must equal",
        ),
        (board_from_rows(".......", ".......", ".......", ".......", "......o", "xxxxooo"), "won"),
    ],
)
def test_unplayable_board_option_is_rejected(board: np.ndarray, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ConnectFourEnv().reset(options={"board": board})


# --- Inventory ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("on_hand", "pipeline", "order_level", "price_level", "quantity", "price"),
    [
        (30, [15, 0], 2, 2, 20, 12.0),  # stock left over: holding cost
        (3, [0, 0], 0, 0, 0, 8.0),  # cheap and nearly empty: lost sales, no ordering cost
    ],
)
def test_inventory_profit_is_revenue_minus_costs(
    on_hand: int,
    pipeline: list[int],
    order_level: int,
    price_level: int,
    quantity: int,
    price: float,
) -> None:
    env = InventoryEnv(lead_time=2, demand_scale=20.0)
    env.reset(seed=0, options={"on_hand": on_hand, "pipeline": pipeline})
    obs, reward, _, _, info = env.step(3 * order_level + price_level)

    stock = on_hand + pipeline[0]
    demand = info["demand"]
    sales = min(demand, stock)
    lost = demand - sales
    ordering = (10.0 + 5.0 * quantity) if quantity else 0.0  # fixed 10.00 + 5.00 per unit
    expected = price * sales - ordering - 0.1 * (stock - sales) - 2.0 * lost
    assert (info["arrived"], info["sales"], info["lost_sales"]) == (pipeline[0], sales, lost)
    assert lost > 0 if on_hand == 3 else stock - sales > 0
    assert reward == pytest.approx(expected, abs=1e-9)
    parts = info["revenue"] - info["ordering_cost"] - info["holding_cost"] - info["stockout_cost"]
    assert reward == pytest.approx(parts, abs=1e-9)
    assert obs[0] == np.float32((stock - sales) / 20.0)


@pytest.mark.parametrize("lead_time", [0, 1, 4])
def test_orders_arrive_after_exactly_lead_time_days(lead_time: int) -> None:
    env = InventoryEnv(lead_time=lead_time)
    env.reset(seed=1, options={"on_hand": 0, "pipeline": [0] * lead_time})
    arrivals = []
    for day in range(lead_time + 3):
        order_level = 4 if day == 0 else 0  # 4 * demand_scale = 80 units on day 0 only
        obs, _, _, _, info = env.step(3 * order_level + 1)
        arrivals.append(info["arrived"])
        if day == 0:
            assert obs[1] == (4.0 if lead_time else 0.0)
    assert arrivals == [0] * lead_time + [80, 0, 0]


@pytest.mark.parametrize("horizon", [90, 12])
def test_last_day_reports_profit_stockouts_and_success(horizon: int) -> None:
    env = gym.make("evalfleet/Inventory-v0", horizon=horizon)
    env.reset(seed=5)
    total, stockout_days, days = 0.0, 0, 0
    terminated = truncated = False
    info: dict[str, Any] = {}
    while not (terminated or truncated):
        _, reward, terminated, truncated, info = env.step(3 * 2 + 1)
        total += float(reward)
        stockout_days += info["lost_sales"] > 0
        days += 1
        assert ("success" in info) == truncated
    assert (days, terminated) == (horizon, False)
    assert info["profit"] == pytest.approx(total)
    assert info["stockout_days"] == stockout_days
    threshold = env.unwrapped.profit_threshold  # type: ignore[attr-defined]
    assert info["success"] == (stockout_days == 0 and info["profit"] > threshold)


def test_bad_reset_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="pipeline"):
        InventoryEnv(lead_time=3).reset(options={"pipeline": [1, 2]})


# --- Recommend ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_bored_user_churns_with_terminated(seed: int) -> None:
    env = gym.make("evalfleet/Recommend-v0")
    env.reset(seed=seed)
    churn_probabilities = []
    terminated = truncated = False
    while not (terminated or truncated):
        _, reward, terminated, truncated, info = env.step(0)  # the same item, again and again
        churn_probabilities.append(info["churn_probability"])
        assert reward == info["watch_time"] and (float(reward) > 0) == info["clicked"]
    assert terminated and not truncated
    assert churn_probabilities[-1] > churn_probabilities[0]


def test_catalogue_is_fixed_by_catalogue_seed() -> None:
    env, twin, other = (
        RecommendEnv(catalogue_seed=3),
        RecommendEnv(catalogue_seed=3),
        RecommendEnv(catalogue_seed=4),
    )
    env.reset(seed=0)
    topics = env.item_topics.copy()
    env.reset(seed=1)
    assert np.array_equal(env.item_topics, topics)
    assert np.array_equal(env.item_topics, twin.item_topics)
    assert not np.array_equal(env.item_topics, other.item_topics)
    # Documented layout the heuristic relies on: item i is dominated by topic i % n_features.
    assert np.array_equal(env.item_topics.argmax(axis=1), np.arange(env.n_items) % env.n_features)
