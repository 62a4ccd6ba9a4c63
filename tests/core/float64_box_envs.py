"""A planted env whose Box actions are float64 with bounds float32 cannot hold (+-0.1).

``tests.core.float64_box_envs:F64Reach-v0``: a point moves toward a target by the action, and a
step earns ``1 - distance``. An action outside the space is refused by the env itself (raises),
so one that reached it unclipped is an ``env_error``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "tests.core.float64_box_envs:F64Reach-v0"


class F64ReachEnv(gym.Env[np.ndarray, np.ndarray]):
    """Reach a target in [-1, 1] with steps of at most 0.1 (a float64 Box)."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Box(-0.1, 0.1, (1,), np.float64)

    def __init__(self) -> None:
        self.x, self.target = 0.0, 0.0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.x, self.target = 0.0, float(self.np_random.uniform(-1.0, 1.0))
        return np.array([self.x, self.target], np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.x += float(action[0])
        return np.array([self.x, self.target], np.float32), 1.0 - abs(self.x - self.target), False, False, {}


if "F64Reach-v0" not in gym.registry:
    gym.register(id="F64Reach-v0", entry_point=F64ReachEnv, max_episode_steps=20)


def past_the_rounding(obs: np.ndarray) -> np.ndarray:
    """Float32 actions one step past float32(0.1): beyond the bound's rounding, not at it."""
    return np.full((len(obs), 1), np.nextafter(np.float32(0.1), np.float32(1.0)), dtype=np.float32)
