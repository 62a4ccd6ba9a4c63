"""Planted envs whose Box actions are float32 or float16, with bounds those dtypes round down.

``tests.core.float32_box_envs:Steer07-v0``: steer a point toward a target with actions in a
float32 ``Box(-0.7, 0.7)`` (stored as +-0.699999988); each step earns ``1 + |a|``, 10 steps. The
env refuses (raises) an action outside its space, so one that reached it out of bounds is an
``env_error``. ``Steer16-v0`` is the same with a float16 ``Box(-0.1, 0.1)`` (+-0.0999756), and
``SteerFree-v0`` with a float32 ``Box(-inf, inf)``: its reward is the action, so an action that
reached it as inf would be an ``invalid_reward``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

STEER07, STEER16, STEER_FREE = (f"tests.core.float32_box_envs:{name}-v0"
                                for name in ("Steer07", "Steer16", "SteerFree"))


class SteerEnv(gym.Env[np.ndarray, np.ndarray]):
    """A point moves by the action toward a target in [-3, 3]; 1 + |a| per step."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)

    def __init__(self, bound: float = 0.7, dtype: str = "float32") -> None:
        self.action_space = gym.spaces.Box(-bound, bound, (1,), np.dtype(dtype))
        self.x, self.target, self.t = 0.0, 0.0, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.x, self.target, self.t = 0.0, float(self.np_random.uniform(-3.0, 3.0)), 0
        return np.array([self.x, self.target], np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.t += 1
        self.x += float(action[0])
        reward = (1.0 + abs(float(action[0]))) if np.isfinite(self.action_space.high[0]) else float(action[0])
        return np.array([self.x, self.target], np.float32), reward, self.t >= 10, False, {}


for _name, _kwargs in (("Steer07-v0", {}), ("Steer16-v0", {"bound": 0.1, "dtype": "float16"}),
                       ("SteerFree-v0", {"bound": np.inf})):
    if _name not in gym.registry:
        gym.register(id=_name, entry_point=SteerEnv, kwargs=_kwargs, max_episode_steps=50)


def steer07(obs: np.ndarray) -> np.ndarray:
    """A numpy (float64) gain controller that clips to the nominal bound 0.7: it often saturates."""
    obs = np.asarray(obs, dtype=np.float64)
    return np.clip(obs[:, 1:2] - obs[:, 0:1], -0.7, 0.7)


def huge_far(obs: np.ndarray) -> np.ndarray:
    """1e39 (finite in float64, past float32's range) where the target is beyond 1, else 0.5."""
    obs = np.asarray(obs, dtype=np.float64)
    return np.where(obs[:, 1:2] > 1.0, 1e39, 0.5)


class Steer16(torch.nn.Module):
    """A torch (float32) controller bounded at 0.1: saturated, it outputs float32(0.1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x[:, 1:2] - x[:, 0:1], -0.1, 0.1)


def out_of_bounds(obs: np.ndarray) -> np.ndarray:
    """5.0 for every row: outside the Box, so every episode ends at its first step."""
    return np.full((len(obs), 1), 5.0)
