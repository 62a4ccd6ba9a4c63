"""Gymnasium environments for evalfleet's three use cases, registered on import.

| id                          | class            | max_episode_steps |
|-----------------------------|------------------|-------------------|
| ``evalfleet/Recommend-v0``   | RecommendEnv     | 100               |
| ``evalfleet/Inventory-v0``   | InventoryEnv     | 90 (= horizon)    |
| ``evalfleet/ConnectFour-v0`` | ConnectFourEnv   | 42 (never reached)|

Registration is idempotent: re-importing or reloading this package leaves the registry as is
instead of overriding (and warning about) an existing spec.
"""

from __future__ import annotations

import gymnasium

from envs.connect_four import ConnectFourEnv
from envs.inventory import InventoryEnv
from envs.recommend import RecommendEnv

__all__ = ["ConnectFourEnv", "InventoryEnv", "RecommendEnv", "ENV_IDS"]

_MAX_EPISODE_STEPS: dict[str, tuple[str, int]] = {
    "evalfleet/Recommend-v0": ("envs.recommend:RecommendEnv", 100),
    "evalfleet/Inventory-v0": ("envs.inventory:InventoryEnv", 90),
    "evalfleet/ConnectFour-v0": ("envs.connect_four:ConnectFourEnv", 42),
}
ENV_IDS: tuple[str, ...] = tuple(_MAX_EPISODE_STEPS)


def _register() -> None:
    for env_id, (entry_point, max_episode_steps) in _MAX_EPISODE_STEPS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(
                id=env_id, entry_point=entry_point, max_episode_steps=max_episode_steps
            )


_register()
