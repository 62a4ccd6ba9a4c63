"""A planted env whose scenario file another job rewrites while an evaluation runs.

``tests.flows.drift_envs:FileGain-v0``: 10 steps, each rewarded by the number in the file its
``gain_file`` kwarg names (read at every reset). With ``$DRIFT_REWRITE_AFTER`` set to n, the
n-th reset in a process writes ``2.0`` into that file, as a job regenerating scenario files would
(an environment variable, which the cache key does not name: the same request runs without it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "tests.flows.drift_envs:FileGain-v0"
_resets = {"n": 0}


class FileGainEnv(gym.Env[np.ndarray, int]):
    """+gain per step for 10 steps; the gain is read from ``gain_file`` at each reset."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, gain_file: str = "") -> None:
        self.path = Path(gain_file)
        self.rewrite_after = int(os.environ.get("DRIFT_REWRITE_AFTER", "0"))
        self.gain, self.t = 1.0, 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        _resets["n"] += 1
        if self.rewrite_after and _resets["n"] == self.rewrite_after:
            self.path.write_text("2.0")
        self.gain, self.t = float(self.path.read_text()), 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.zeros(2, np.float32), self.gain, self.t >= 10, False, {}


if "FileGain-v0" not in gym.registry:
    gym.register(id="FileGain-v0", entry_point=FileGainEnv, max_episode_steps=50)


def zeros(obs: np.ndarray) -> np.ndarray:
    """Action 0 for every row."""
    return np.zeros(len(obs), dtype=np.int64)
