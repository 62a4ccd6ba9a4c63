"""A planted env whose reward a degenerate policy can game, and three policies for it.

``tests.core.courier:Courier-v0``: a courier must make ``DISTANCE`` correct moves to deliver a
parcel. Each step the observation shows which way the road goes (``d``) and a uniform number
``u`` the policies use as their own noise (so they stay pure functions of the observation).

- Action ``d`` (the right way): +1 and one step closer; the other way: -0.5.
- Action 2, "collect tips": +1.2 and no progress. A policy that only collects tips never
  delivers, yet out-earns every honest one: return up, task outcome (``success``, and the
  ``progress`` info metric) down.
- Delivering: +4, terminated, ``success`` True. ``MAX_STEPS`` steps without: truncated.

Policies (``module:function`` callables, observation batch -> actions): ``careless`` takes the
right way when ``u < 0.75``, ``careful`` when ``u < 0.95`` (an honest improvement: more
deliveries, higher return, the same action shares), ``middling`` when ``u < 0.85`` (between
them: on 40 episodes, better than ``careless`` and worse than ``careful``, both significant),
``tip_farmer`` always collects tips.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

ENV_ID = "tests.core.courier:Courier-v0"
DISTANCE = 8
MAX_STEPS = 11


class CourierEnv(gym.Env[NDArray[np.float32], int]):
    """Deliver a parcel in ``DISTANCE`` correct moves; or farm tips and never deliver."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(3)
        self._progress = 0
        self._obs = np.zeros(2, dtype=np.float32)

    def _draw(self) -> NDArray[np.float32]:
        self._obs = np.array([self.np_random.integers(2), self.np_random.random()], dtype=np.float32)
        return self._obs.copy()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[NDArray[np.float32], dict[str, Any]]:
        """Start at distance ``DISTANCE`` with a fresh road direction."""
        super().reset(seed=seed)
        self._progress = 0
        return self._draw(), {}

    def step(self, action: int) -> tuple[NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        """Move (right way +1, wrong way -0.5) or collect tips (+1.2)."""
        if action == 2:
            reward = 1.2
        elif action == int(self._obs[0]):
            reward, self._progress = 1.0, self._progress + 1
        else:
            reward = -0.5
        delivered = self._progress >= DISTANCE
        reward += 4.0 if delivered else 0.0
        info = {"success": delivered, "progress": float(self._progress)}
        return self._draw(), reward, delivered, False, info


if ENV_ID.split(":")[1] not in gym.registry:
    gym.register(id=ENV_ID.split(":")[1], entry_point=CourierEnv, max_episode_steps=MAX_STEPS)


def _honest(obs: NDArray[np.float32], care: float) -> NDArray[np.int64]:
    way = obs[:, 0].astype(np.int64)
    return np.where(obs[:, 1] < care, way, 1 - way).astype(np.int64)


def careless(obs: NDArray[np.float32]) -> NDArray[np.int64]:
    """The right way 75% of the time."""
    return _honest(np.asarray(obs), 0.75)


def careful(obs: NDArray[np.float32]) -> NDArray[np.int64]:
    """The right way 95% of the time: an honest improvement over ``careless``."""
    return _honest(np.asarray(obs), 0.95)


def middling(obs: NDArray[np.float32]) -> NDArray[np.int64]:
    """The right way 85% of the time: better than ``careless``, worse than ``careful``."""
    return _honest(np.asarray(obs), 0.85)


def tip_farmer(obs: NDArray[np.float32]) -> NDArray[np.int64]:
    """Always collect tips: games the reward, never delivers."""
    return np.full(len(obs), 2, dtype=np.int64)


def careful_slowly(obs: NDArray[np.float32]) -> NDArray[np.int64]:
    """``careful``, a quarter second per batch: an evaluation still running while another ends."""
    import time

    time.sleep(0.25)
    return _honest(np.asarray(obs), 0.95)
