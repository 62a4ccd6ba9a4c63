"""Planted envs that share or change arrays they hand over, or hand over the wrong ones.

Each is registered as ``tests.core.quirky_envs:<Name>-v0`` (importable in a sandbox too):

- ``AliasObs``: returns ONE internal observation array, updated in place every reset and step
  (a common C-extension idiom; gymnasium's passive checker warns about it).
- ``SharedObs``: the same, but the array is shared by every instance of the class (a global
  buffer): resetting one instance rewrites the observation another one returned.
- ``MutAct``: halves its ``Box`` action in place (``np.multiply(a, 0.5, out=a)``: scaled to its
  actuator) and moves by what is left.
- ``ShapeShift``: declares ``Box(4,)`` and returns ``np.array([0.6])`` (shape ``(1,)``) on every
  3rd step; ``at_reset=True``: also at the reset of odd seeds (by the reset's draw);
  ``extra_axis=True``: shape ``(1, 4)`` instead (numpy would also accept it into a ``(4,)`` row).
- ``InfoSuccess``: ends when ``|x0| > 2`` with ``success`` (or ``is_success``) as the ``mode``
  says: ``torch`` (0-d tensor), ``arr1`` (``np.array([win])``), ``str`` (``"yes"``/``""``) or
  ``arr2`` (two elements: no single flag).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

ALIAS_OBS = "tests.core.quirky_envs:AliasObs-v0"
SHARED_OBS = "tests.core.quirky_envs:SharedObs-v0"
MUT_ACT = "tests.core.quirky_envs:MutAct-v0"
SHAPE_SHIFT = "tests.core.quirky_envs:ShapeShift-v0"
INFO_SUCCESS = "tests.core.quirky_envs:InfoSuccess-v0"


class AliasObs(gym.Env[np.ndarray, int]):
    """One observation array for the whole episode, mutated in place; reward = its first element."""

    observation_space = spaces.Box(-100.0, 100.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self) -> None:
        self._buf = np.zeros(3, np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._buf[:] = self.np_random.uniform(-1, 1, 3)
        return self._buf, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._buf += np.float32(0.5 if action == 1 else -0.5) + self.np_random.normal(
            0, 0.1, 3).astype(np.float32)
        return self._buf, float(self._buf[0]), bool(abs(self._buf[1]) > 3), False, {}


_SHARED = np.zeros(2, np.float32)


class SharedObs(gym.Env[np.ndarray, int]):
    """Per-instance state, one observation array for every instance; +1 for the right action."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        self._t = 0
        _SHARED[:] = self._x
        return _SHARED, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        reward = 1.0 if action == int(self._x[0] > 0) else 0.0
        self._t += 1
        self._x = -self._x
        _SHARED[:] = self._x
        return _SHARED, reward, self._t >= 6, False, {}


class MutAct(gym.Env[np.ndarray, np.ndarray]):
    """Halves its action in place and moves by the half; reward = -|position|."""

    observation_space = spaces.Box(-100.0, 100.0, (2,), np.float32)
    action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return self._x.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        np.multiply(action, 0.5, out=action)  # in place: the caller's array is changed
        self._x = (self._x + action[0]).astype(np.float32)
        return self._x.copy(), -abs(float(self._x[0])), bool(abs(self._x[0]) > 5), False, {}


class ShapeShift(gym.Env[np.ndarray, int]):
    """Declares ``Box(4,)``; every 3rd step's observation has another shape (see module doc)."""

    observation_space = spaces.Box(-10.0, 10.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, at_reset: bool = False, extra_axis: bool = False) -> None:
        self.at_reset, self.extra_axis = at_reset, extra_axis

    def _odd(self, x: np.ndarray) -> np.ndarray:
        return x[None] if self.extra_axis else np.array([0.6], np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = self.np_random.uniform(-1, 1, 4).astype(np.float32)
        self._t = 0
        odd = self.at_reset and bool(self.np_random.integers(2))
        return (self._odd(self._x) if odd else self._x.copy()), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._x = (self._x + (0.3 if action else -0.2)).astype(np.float32)
        obs = self._odd(self._x) if self._t % 3 == 0 else self._x.copy()
        return obs, float(action) * self._t, bool(self._x[0] > 4 or self._t >= 30), False, {}


class InfoSuccess(gym.Env[np.ndarray, int]):
    """Ends when ``|x0| > 2``; a win when ``x1 > x0`` then, told in the final info as ``mode`` says."""

    observation_space = spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, mode: str = "arr1", key: str = "success") -> None:
        self.mode, self.key = mode, key

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._x = self.np_random.uniform(-1, 1, 2).astype(np.float32)
        return self._x.copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._x = (self._x + (0.4 if action else -0.4)).astype(np.float32)
        done = bool(abs(self._x[0]) > 2)
        info: dict[str, Any] = {}
        if done:
            win = bool(self._x[1] > self._x[0])
            info[self.key] = {"torch": lambda: torch.tensor(win), "arr1": lambda: np.array([win]),
                              "str": lambda: "yes" if win else "",
                              "arr2": lambda: np.array([win, win])}[self.mode]()
        return self._x.copy(), 1.0, done, False, info


class Breaks(gym.Env[np.ndarray, int]):
    """A deterministic env whose odd seeds break: a NaN observation at step 3 (``mode="nan"``) or
    a return past 1e100 at step 17 (``mode="huge"``: 6e98 per step); even seeds run 20 steps."""

    observation_space = spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, mode: str = "nan") -> None:
        self.mode = mode

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._odd, self._t = bool((seed or 0) % 2), 0
        return np.zeros(2, np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = np.full(2, 0.1 * self._t, np.float32)
        if self._odd and self.mode == "nan" and self._t == 3:
            obs[1] = np.nan
        reward = 6e98 if self._odd and self.mode == "huge" else 1.0
        return obs, reward, self._t >= 20, False, {}


def win_of(obs: np.ndarray) -> bool:
    """``InfoSuccess``'s flag for its last observation (what a plain loop reads)."""
    return bool(obs[1] > obs[0])


for _name, _entry, _cap in [("AliasObs-v0", AliasObs, 50), ("SharedObs-v0", SharedObs, 50),
                            ("MutAct-v0", MutAct, 30), ("ShapeShift-v0", ShapeShift, 40),
                            ("InfoSuccess-v0", InfoSuccess, 50), ("Breaks-v0", Breaks, 50)]:
    if _name not in gym.registry:
        gym.register(id=_name, entry_point=_entry, max_episode_steps=_cap)


# -- policies (callables take the float32 batch) ---------------------------------------------------


def sign0(obs: np.ndarray) -> np.ndarray:
    """1 when the observation's elements sum below 1."""
    return (np.asarray(obs).reshape(len(obs), -1).sum(axis=1) < 1.0).astype(np.int64)


def sum2(obs: np.ndarray) -> np.ndarray:
    """1 when the observation's elements sum below 2 (what a broadcast row changes)."""
    return (np.asarray(obs).reshape(len(obs), -1).sum(axis=1) < 2.0).astype(np.int64)


def box1(obs: np.ndarray) -> np.ndarray:
    """A ``Box(1,)`` action from the first element."""
    return np.tanh(np.asarray(obs, np.float32)[:, :1]).astype(np.float32)


def one(obs: np.ndarray) -> np.ndarray:
    """Always action 1."""
    return np.ones(len(obs), dtype=np.int64)


def lake(obs: np.ndarray) -> np.ndarray:
    """FrozenLake: right, or down in the last column; answers in its input's shape."""
    return ((np.asarray(obs) % 4) < 3).astype(np.int64) + 1


def first_positive(obs: np.ndarray) -> np.ndarray:
    """``SharedObs``'s right action: 1 when the first element is positive."""
    return (np.asarray(obs)[:, 0] > 0).astype(np.int64)


class ConstantAction(torch.nn.Module):
    """A constant-action baseline: its output is a view of its own buffer (``expand``).

    On CPU, ``.numpy()`` of that output shares the buffer's memory, every row the same bytes.
    """

    def __init__(self, value: float = 0.8) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((1, 1), value))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.mean.expand(obs.shape[0], 1)
