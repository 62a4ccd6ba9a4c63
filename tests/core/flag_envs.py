"""A planted env whose ``terminated`` or ``truncated`` is sometimes an array of two flags.

``tests.core.flag_envs:TwoFlags-v0``: 10 steps of +1, then terminated; on odd seeds (by the
reset's draw) the flag named by ``which`` is ``np.array([done, done])`` from step 4 on: it has
no truth value, so the step is the env's error.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "tests.core.flag_envs:TwoFlags-v0"
BAD_STEP = 4


class TwoFlagsEnv(gym.Env[np.ndarray, int]):
    """+1 per step for 10 steps; half the seeds' flags become arrays of two."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, which: str = "terminated") -> None:
        self.which = which
        self.odd, self.t = False, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.odd, self.t = bool(self.np_random.integers(2)), 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, Any, Any, dict[str, Any]]:
        self.t += 1
        flags: dict[str, Any] = {"terminated": self.t >= 10, "truncated": False}
        if self.odd and self.t >= BAD_STEP:
            flags[self.which] = np.array([flags[self.which]] * 2)
        return np.zeros(2, np.float32), 1.0, flags["terminated"], flags["truncated"], {}


if "TwoFlags-v0" not in gym.registry:
    gym.register(id="TwoFlags-v0", entry_point=TwoFlagsEnv, max_episode_steps=50)


def zeros(obs: np.ndarray) -> np.ndarray:
    """Action 0 for every row."""
    return np.zeros(len(obs), dtype=np.int64)
