"""Planted envs for the recording checks: 'tests.flows.render_envs:RenderBroken-v0' and friends."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from tests.flows.user_envs import WarehouseEnv


class RenderBrokenEnv(WarehouseEnv):
    """Declares rgb_array rendering, but its renderer's dependency is missing."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, width: int = 20, render_mode: str | None = None) -> None:
        super().__init__(width)
        self.render_mode = render_mode

    def render(self) -> Any:
        """Fail the way a missing renderer dependency does."""
        raise gym.error.DependencyNotInstalled("plantedrenderlib is not installed")


gym.register("RenderBroken-v0", entry_point=RenderBrokenEnv, max_episode_steps=60)


class RenderDiesLaterEnv(WarehouseEnv):
    """Renders the first frames, then its renderer breaks at the third step."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, width: int = 20, render_mode: str | None = None) -> None:
        super().__init__(width)
        self.render_mode = render_mode
        self._steps = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the step count too."""
        self._steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Count steps, for the renderer to break on."""
        self._steps += 1
        return super().step(action)

    def render(self) -> Any:
        """A grey frame, until step 3."""
        if self._steps >= 3:
            raise RuntimeError("renderer lost its context")
        return np.full((32, 48, 3), 128, dtype=np.uint8)


gym.register("RenderDiesLater-v0", entry_point=RenderDiesLaterEnv, max_episode_steps=60)


class SlowEnv(WarehouseEnv):
    """Every step takes half a second: an evaluation of it waits on the run stage for minutes."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Sleep, then step."""
        import time

        time.sleep(0.5)
        return super().step(action)


gym.register("Slow-v0", entry_point=SlowEnv, max_episode_steps=60)
