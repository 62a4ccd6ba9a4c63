"""Envs whose returns show how the runner draws random numbers and converts actions.

``module:id`` forms (``env_id``) import in any process, sandboxes included.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import WrapperSpec

STEPS = 100


def env_id(name: str) -> str:
    """``module:evalfleet-test/Name-v0``: importable in any process."""
    return f"{__name__}:evalfleet-test/{name}-v0"


class _Blank(gym.Env[np.ndarray, Any]):
    """Two zero observations, reset by seed: what differs is each subclass's ``step``."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space: gym.spaces.Space[Any] = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}


class CoinFlip(_Blank):
    """Each step flips a coin with the env's own ``np_random``; reward 1 when the action matches."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        coin = int(self.np_random.random() >= 0.5)
        return np.zeros(2, np.float32), float(int(action) == coin), False, False, {}


class GlobalNoise(_Blank):
    """An old-style env: its rewards come from numpy's global RNG, which ``reset(seed=)`` leaves be."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(2, np.float32), float(np.random.uniform()), False, False, {}


class NoisyBeyond(_Blank):
    """Reproducible on the seeds in ``clean`` (5 per episode); elsewhere its rewards come from
    numpy's global RNG: an audit that re-runs only clean seeds passes, replays of the rest differ."""

    def __init__(self, clean: list[int] | None = None) -> None:
        self.clean = set(clean or ())
        self.noisy = True

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        self.noisy = seed not in self.clean
        return super().reset(seed=seed, options=options)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        reward = float(np.random.uniform()) if self.noisy else 1.0
        return np.zeros(2, np.float32), reward, False, False, {}


class IntegerBox(_Blank):
    """An integer ``Box`` action; the reward is the action it gets."""

    action_space = gym.spaces.Box(0, 3, (1,), np.int64)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(2, np.float32), float(np.asarray(action).sum()), False, False, {}


class ArrayInfo(_Blank):
    """Ends at its first step, its final info's numbers as 0-d arrays (a 0-d tensor's ``.numpy()``)."""

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        info = {"is_success": np.array(True), "score": np.array(2.5),
                "vector": np.array([1.0, 2.0])}
        return np.zeros(2, np.float32), 1.0, True, False, info


class CarriedOver(_Blank):
    """An instance carries state from one episode to the next (as a ``NormalizeObservation``
    wrapper's statistics do): 3 to 7 steps drawn from the seed, each worth 1, and 1 more on an
    instance that served an episode before. Reproducible only on a fresh instance per episode."""

    def __init__(self) -> None:
        self.served = 0

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        self.bonus, self.served = float(self.served > 0), self.served + 1
        self.left = int(self.np_random.integers(3, 8))
        return obs, info

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.left -= 1
        return np.zeros(2, np.float32), 1.0 + self.bonus, self.left <= 0, False, {}


for _name, _steps in (("CoinFlip", STEPS), ("GlobalNoise", 5), ("NoisyBeyond", 5), ("IntegerBox", 5),
                      ("ArrayInfo", 5), ("CarriedOver", 10)):
    gym.register(id=f"evalfleet-test/{_name}-v0", entry_point=f"{__name__}:{_name}",
                 max_episode_steps=_steps)


def uniform_logits(obs: np.ndarray) -> np.ndarray:
    """Logits of a coin: sampled, it matches an independent coin half the time."""
    return np.zeros((len(obs), 2), np.float32)


def first_action(obs: np.ndarray) -> np.ndarray:
    """Action 0 for every row of a ``Discrete`` space."""
    return np.zeros(len(obs), np.int64)


def fractional(obs: np.ndarray) -> np.ndarray:
    """2.7 for an integer Box: no action of it."""
    return np.full((len(obs), 1), 2.7)


def whole(obs: np.ndarray) -> np.ndarray:
    """2.0 for an integer Box, as floats: an action of it."""
    return np.full((len(obs), 1), 2.0)


# CartPole behind a NormalizeObservation wrapper registered with the spec: the wrapper's running
# statistics live in the env instance, so an episode's observations depend on the episodes that
# instance ran before it.
gym.register(id="evalfleet-test/NormalizedCartPole-v0",
             entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
             max_episode_steps=500,
             additional_wrappers=(WrapperSpec("NormalizeObservation",
                                              "gymnasium.wrappers:NormalizeObservation",
                                              {"epsilon": 1e-8}),))


def normalized_threshold(obs: np.ndarray) -> np.ndarray:
    """Acts on the scale of the normalised observation: its returns follow the running statistics."""
    obs = np.asarray(obs)
    return (obs[:, 2] + 0.3 * obs[:, 3] + 0.2 * obs[:, 0] > 0.05).astype(np.int64)
