"""A user's own env, reachable as 'tests.flows.user_envs:Warehouse-v0' without touching evalfleet.

Rewards are 0.1 per step (plus a seed-dependent bonus), so returns are sums of non-representable
floats: a harness that rounds or re-sums in another order would change them.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class WarehouseEnv(gym.Env[np.ndarray, int]):
    """Move a picker left/right; the episode ends when it reaches a seed-dependent shelf."""

    def __init__(self, width: int = 20) -> None:
        self.width = width
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._pos = 0
        self._goal = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._pos / self.width, self._goal / self.width], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._pos = int(self.np_random.integers(0, self.width))
        self._goal = int(self.np_random.integers(0, self.width))
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._pos = max(0, min(self.width - 1, self._pos + (1 if action == 1 else -1)))
        noise = float(self.np_random.random()) * 0.01
        done = self._pos == self._goal
        reward = 0.1 + noise + (1.0 if done else 0.0)
        return self._obs(), reward, done, False, {"success": done} if done else {}


def toward_goal(obs: np.ndarray) -> np.ndarray:
    """Callable policy: step toward the goal (goal > pos ⇒ right)."""
    return (obs[:, 1] > obs[:, 0]).astype(np.int64)


gym.register("Warehouse-v0", entry_point=WarehouseEnv, max_episode_steps=60)


def toward_goal_dawdling(obs: np.ndarray) -> np.ndarray:
    """A worse callable policy: steps away from the goal on every third cell."""
    right = obs[:, 1] > obs[:, 0]
    cell = np.rint(obs[:, 0] * 20).astype(np.int64)
    return np.where(cell % 3 == 0, ~right, right).astype(np.int64)


class FlakyEnv(WarehouseEnv):
    """Uses the global numpy RNG instead of ``self.np_random``: not reproducible from its seed."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed)
        self._goal = int(np.random.randint(0, self.width))  # noqa: NPY002 - the planted bug
        return self._obs(), info


gym.register("Flaky-v0", entry_point=FlakyEnv, max_episode_steps=60)


class ClippedWarehouseEnv(WarehouseEnv):
    """A continuous per-step reward clipped to [-1, 1]: about 32% of steps sit on a boundary."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        obs, _, done, truncated, info = super().step(action)
        reward = float(np.clip(self.np_random.normal(0.0, 1.0), -1.0, 1.0))
        return obs, reward, done, truncated, info


gym.register("ClippedWarehouse-v0", entry_point=ClippedWarehouseEnv, max_episode_steps=60)
