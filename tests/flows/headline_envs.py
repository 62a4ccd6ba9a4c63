"""An env with a known per-seed difficulty, and policies that break exactly on its hardest seeds.

``Hurdles-v0``: at reset the seed draws a payoff ``p`` in [0, 1); every step pays ``p`` and the
episode terminates after ``STEPS`` steps, so an honest episode returns ``STEPS * p`` and
``success`` is ``p >= 0.5``. The observation is ``[p, t / STEPS]``: a policy sees how hard its
seed is. With ``broken_above=x`` the env itself raises at step ``BREAK_STEP`` on seeds with
``p > x`` (a harness failure, ``env_error``).

Reachable as ``tests.flows.headline_envs:Hurdles-v0`` and ``tests.flows.headline_envs:<policy>``
from any process.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

STEPS = 5
#: The planted policies break at this step of a hard seed (after two steps: a partial return 2p).
BREAK_STEP = 2
#: Seeds with a payoff below this are the hard ones (the lowest returns).
HARD = 0.3


class HurdlesEnv(gym.Env[np.ndarray, int]):
    """Five steps paying the seed's payoff each; optionally broken on the high-payoff seeds."""

    def __init__(self, broken_above: float | None = None) -> None:
        self.broken_above = broken_above
        self.observation_space = spaces.Box(0.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self._p = 0.0
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self._p, self._t / STEPS], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._p = float(self.np_random.random())
        self._t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        if self.broken_above is not None and self._p > self.broken_above and self._t == BREAK_STEP:
            raise RuntimeError(f"planted env bug at step {self._t}")
        self._t += 1
        done = self._t == STEPS
        return self._obs(), self._p, done, False, {"success": self._p >= 0.5} if done else {}


gym.register("Hurdles-v0", entry_point=HurdlesEnv, max_episode_steps=STEPS)


def _hard_and_at_break(obs: np.ndarray) -> np.ndarray:
    obs = np.asarray(obs, dtype=np.float32)
    return (obs[:, 0] < HARD) & np.isclose(obs[:, 1], BREAK_STEP / STEPS)


def steady(obs: np.ndarray) -> np.ndarray:
    """Honest policy: always action 0."""
    return np.zeros(len(obs), dtype=np.int64)


def breaks_on_hard_seeds(obs: np.ndarray) -> np.ndarray:
    """Action 0, except an invalid action (2) at step 2 of every hard seed."""
    return np.where(_hard_and_at_break(obs), 2, 0).astype(np.int64)
