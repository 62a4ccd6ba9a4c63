"""A planted env whose observation turns NaN on some seeds, and a policy that cannot tell.

``tests.core.nan_envs:Sensor-v0``: 20 steps of +1; on odd seeds (by the reset's draw) the
observation's second element is NaN from step 5 on (a broken sensor); with ``at_reset=True``
it is NaN from the reset.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

ENV_ID = "tests.core.nan_envs:Sensor-v0"


class SensorEnv(gym.Env[np.ndarray, int]):
    """+1 per step for 20 steps; half the seeds' observations go NaN."""

    observation_space = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, at_reset: bool = False) -> None:
        self.at_reset = at_reset
        self.broken, self.t = False, 0

    def _obs(self) -> np.ndarray:
        obs = np.array([1.0, 0.5, -0.5], np.float32)
        if self.broken and (self.at_reset or self.t >= 5):
            obs[1] = np.nan
        return obs

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.broken, self.t = bool(self.np_random.integers(2)), 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return self._obs(), 1.0, self.t >= 20, False, {}


if "Sensor-v0" not in gym.registry:
    gym.register(id="Sensor-v0", entry_point=SensorEnv, max_episode_steps=50)


class Linear(torch.nn.Module):
    """Logits linear in the observation: a NaN in it makes every logit NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.layer(obs)


def first_action(obs: np.ndarray) -> np.ndarray:
    """A callable that acts on the first element only: a NaN elsewhere goes unnoticed."""
    return (np.asarray(obs)[:, 0] > 2).astype(np.int64)
