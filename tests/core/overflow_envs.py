"""A planted env whose finite rewards add up past what the statistics can aggregate.

``tests.core.overflow_envs:Jackpot-v0``: ``steps`` steps of +1, then terminated; on odd seeds
(by the reset's draw) each reward is ``scale`` instead: finite, but with the default 6e99 the
return passes 1e100 at the second step (and a float64 sum of 1e308s overflows to inf).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "tests.core.overflow_envs:Jackpot-v0"


class JackpotEnv(gym.Env[np.ndarray, int]):
    """+1 per step, or ``scale`` per step on half the seeds."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, scale: float = 6e99, steps: int = 10) -> None:
        self.scale, self.steps = scale, steps
        self.jackpot, self.t = False, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.jackpot, self.t = bool(self.np_random.integers(2)), 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        reward = self.scale if self.jackpot else 1.0
        return np.zeros(2, np.float32), reward, self.t >= self.steps, False, {}


if "Jackpot-v0" not in gym.registry:
    gym.register(id="Jackpot-v0", entry_point=JackpotEnv, max_episode_steps=50)


def zeros(obs: np.ndarray) -> np.ndarray:
    """Action 0 for every row."""
    return np.zeros(len(obs), dtype=np.int64)
