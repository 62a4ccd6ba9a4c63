"""A CartPole that counts its instances (``tests.core.counted_envs:Counted-v0``).

A subclass, so the native vector path leaves it alone: every slot is an instance of it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

COUNTED = "tests.core.counted_envs:Counted-v0"


class Counted(CartPoleEnv):
    """CartPole; ``Counted.made`` counts the instances built in this process."""

    made = 0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        type(self).made += 1


if "Counted-v0" not in gym.registry:
    gym.register(id="Counted-v0", entry_point=Counted, max_episode_steps=60)
