"""An action of a float32 or float16 Box is checked as the env gets it: in the Box's dtype.

The bounds check compared the policy's output in float64 with the bounds the Box stores. A float32
Box(-0.7, 0.7) stores 0.699999988, so a numpy policy's 0.7 (given to the env as exactly that
bound) ended its episode as the policy's ``invalid_action``, scored with its partial return and no
alarm; a torch policy's float32(0.1) did the same in a float16 Box(-0.1, 0.1). And a finite 1e39
passed for a float32 Box(-inf, inf), to reach the env as inf: the env's ``invalid_reward``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from evalfleet.runner import _batch_actions, _invalid_actions
from tests.core.episodes import run_in_process
from tests.core.float32_box_envs import STEER07, STEER16, STEER_FREE, Steer16, steer07


def _oracle(env_id: str, act: Callable[[np.ndarray], np.ndarray],
            seeds: list[int]) -> tuple[list[float], int]:
    """Returns of a plain gymnasium loop that gives the env each action in the Box's dtype.

    Also how many of the actions sat on a bound of the Box (as it stores them).
    """
    env = gym.make(env_id)
    space = env.action_space
    out, at_bound = [], 0
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            action = np.asarray(act(np.asarray(obs, np.float32)[None]))[0].astype(space.dtype)
            at_bound += int(action[0] in (space.low[0], space.high[0]))
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + float(reward), terminated or truncated
        out.append(total)
    return out, at_bound


def test_an_action_is_valid_when_the_box_holds_it_in_its_dtype() -> None:
    box = gym.spaces.Box(-0.7, 0.7, (1,), np.float32)
    assert float(box.high[0]) < 0.7  # float32 rounds the bound down
    past = float(np.nextafter(np.float32(0.7), np.float32(1.0)))  # the next float32 up: outside
    acts = np.array([[0.7], [-0.7], [0.70000001], [past], [np.nan]])
    assert _invalid_actions(box, acts).tolist() == [False, False, False, True, True]
    assert _batch_actions(box, acts[:2]).tolist() == [[box.high[0]], [box.low[0]]]
    half = gym.spaces.Box(-0.1, 0.1, (1,), np.float16)
    torch_like = np.array([[0.1], [-0.1], [0.2]], np.float32)  # float32(0.1) > float16(0.1)
    assert _invalid_actions(half, torch_like).tolist() == [False, False, True]
    # Finite in float64, inf once cast: the policy's invalid action, never the env's input.
    free = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    assert _invalid_actions(free, np.array([[1e39, 0.0], [-1e39, 0.0], [3e38, 0.0]])).tolist() == [
        True, True, False]


def test_a_saturated_numpy_policy_plays_its_float32_box_episodes_out() -> None:
    table = run_in_process(STEER07, "tests.core.float32_box_envs:steer07", 40, slots=8).to_pylist()
    assert [r["end_reason"] for r in table] == ["terminated"] * 40
    assert [r["length"] for r in table] == [10] * 40
    returns, at_bound = _oracle(STEER07, steer07, [r["seed"] for r in table])
    assert [r["return"] for r in table] == returns
    assert at_bound > 40  # the saturated actions that ended episodes as invalid_action


def test_a_saturated_torch_policy_plays_its_float16_box_episodes_out(tmp_path: Path) -> None:
    path = tmp_path / "steer16.pt"
    torch.jit.save(torch.jit.script(Steer16()), str(path))
    table = run_in_process(STEER16, str(path), 20, slots=4).to_pylist()
    assert [r["end_reason"] for r in table] == ["terminated"] * 20
    assert [r["length"] for r in table] == [10] * 20
    policy = Steer16()
    returns, at_bound = _oracle(STEER16, lambda x: policy(torch.from_numpy(x)).numpy(),
                                [r["seed"] for r in table])
    assert [r["return"] for r in table] == returns
    assert at_bound > 20


def test_an_action_past_float32s_range_is_the_policys_invalid_action() -> None:
    table = run_in_process(STEER_FREE, "tests.core.float32_box_envs:huge_far", 30, slots=4).to_pylist()
    far = [r for r in table if r["end_reason"] != "terminated"]
    assert 3 < len(far) < 20  # targets beyond 1: about a third
    for row in far:
        assert row["end_reason"] == "invalid_action"
        assert row["error"] == "action [1e+39] not in Box(-inf, inf, (1,), float32)"
        assert row["length"] == 0 and row["return"] == 0.0
    assert all(r["return"] == 5.0 and r["length"] == 10 for r in table if r["end_reason"] == "terminated")
