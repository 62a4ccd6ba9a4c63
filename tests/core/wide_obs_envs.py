"""A planted env whose float64 observation holds a finite value past float32's range on some seeds.

``tests.core.wide_obs_envs:Wide-v0``: a float64 ``Box(-inf, inf, (3,))``, 20 steps of +1; on odd
seeds (by the reset's draw) the observation's second element is 1e39 (finite in float64, inf in
float32) from step 5 on, or from the reset with ``at_reset=True``. With ``inf_elem=True`` the
third element is inf on every seed: a value the env gives, which is left alone.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from tests.core.nan_envs import SensorEnv, first_action

ENV_ID = "tests.core.wide_obs_envs:Wide-v0"
BAD_STEP = 5


class WideEnv(SensorEnv):
    """+1 per step for 20 steps; half the seeds' observations leave float32's range."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float64)

    def __init__(self, at_reset: bool = False, inf_elem: bool = False) -> None:
        super().__init__(at_reset)
        self.inf_elem = inf_elem

    def _obs(self) -> np.ndarray:
        big = self.broken and (self.at_reset or self.t >= BAD_STEP)
        return np.array([1.0, 1e39 if big else 0.5, np.inf if self.inf_elem else -0.5], np.float64)


if "Wide-v0" not in gym.registry:
    gym.register(id="Wide-v0", entry_point=WideEnv, max_episode_steps=50)


class Tiny(torch.nn.Module):
    """Logits with a weight of 1e-30 on the wide element: in float64 its 1e39 is a logit of 1e9."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        w = torch.tensor([[0.1, 1e-30, 0.0], [-0.1, -1e-30, 0.0]])
        return obs @ w.T


#: A callable that acts on the first element only: an inf elsewhere goes unnoticed.
first_element = first_action
