"""A planted env that tries to carry the worker's secrets out: in errors and in ``info``.

``Leak`` is CartPole-v1 that, on faulty seeds (see ``faulty_envs.is_faulty``), raises at step
``FAULT_STEP`` an exception whose text lists every environment variable it sees (secret-like
names first, so the error's 500-character cut does not hide them), and that on every episode's
last step puts one ``info`` entry per variable, named ``NAME=VALUE``. ``Names`` reports, in its
reset ``info``, one ``var:NAME`` entry per variable it sees; ``HashOrder`` what string hashing
decides in its process (the first of a ``set`` of names) and the hash seed its children get.
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from evalfleet.redaction import SECRET_NAME

from .faulty_envs import _Faulty


def env_id(name: str) -> str:
    """``module:evalfleet-test/Name-v0``: importable in any process."""
    return f"{__name__}:evalfleet-test/{name}-v0"


def environment_text() -> str:
    """Every variable of this process as ``NAME=VALUE``, secret-like names first."""
    items = sorted(os.environ.items(), key=lambda kv: (not SECRET_NAME.search(kv[0]), kv[0]))
    return " ".join(f"{k}={v}" for k, v in items)


class Leak(_Faulty):
    """CartPole that tries to leak ``os.environ`` through its errors and its ``info``."""

    def fault(self, reward: float) -> float:
        raise RuntimeError(f"leaking {environment_text()}")

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if terminated or truncated or self._t >= 200:
            info = {**info, **{f"{k}={v}": 1.0 for k, v in os.environ.items()}}
        return obs, reward, terminated, truncated or self._t >= 200, info


class Names(CartPoleEnv):
    """Healthy CartPole whose reset ``info`` names every environment variable it sees."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, **{f"var:{k}": 1.0 for k in os.environ},
                     "home_is_cwd": float(os.environ.get("HOME") == os.getcwd())}


class Recon(CartPoleEnv):
    """Healthy CartPole that searches the memory it inherited from its fork server.

    At reset it walks its call stack up to the fork server's frames and puts in its ``info``
    one ``seen:TEXT`` entry per string it finds in their locals and in the server object's state
    (an evaluation's env ids, environments, granted variables), and the number of env makers
    the server object holds as ``makers``.
    """

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        import sys

        obs, info = super().reset(seed=seed, options=options)
        seen: set[str] = set()
        makers = 0.0

        def walk(value: Any, depth: int = 0) -> None:
            if depth > 4:
                return
            if isinstance(value, str):
                seen.add(value[:200])
            elif isinstance(value, bytes):
                seen.add(value[:4000].decode("latin-1"))
            elif isinstance(value, dict):
                for k, v in value.items():
                    walk(k, depth + 1)
                    walk(v, depth + 1)
            elif isinstance(value, list | tuple | set):
                for v in value:
                    walk(v, depth + 1)
            elif hasattr(value, "__dict__") and depth < 2:
                walk(vars(value), depth + 1)

        frame = sys._getframe()
        while frame is not None:
            for name, value in frame.f_locals.items():
                if name == "self" and type(value).__name__ == "_Server":
                    makers = float(len(getattr(value, "makers", {})))
                walk(value)
            frame = frame.f_back
        return obs, {**info, **{f"seen:{t}": 1.0 for t in seen}, "makers": makers}


class NeedsData(CartPoleEnv):
    """Healthy CartPole that needs ``MY_ENV_DATA_DIR`` (a granted variable) when it is made."""

    def __init__(self, render_mode: str | None = None) -> None:
        if "MY_ENV_DATA_DIR" not in os.environ:
            raise RuntimeError("MY_ENV_DATA_DIR is not set: where is my data?")
        super().__init__(render_mode=render_mode)


class HashOrder(CartPoleEnv):
    """Healthy CartPole whose action menu is a ``set`` of names: its order is string hashing's.

    Its reset ``info``: ``first`` (the menu's first name, by its index in ``ITEMS``), ``hash``
    (of one name) and ``seed`` (``PYTHONHASHSEED`` as its child processes get it; -1 if unset).
    """

    ITEMS = ("apple", "banana", "cherry", "date", "elder", "fig", "grape", "kiwi")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        menu = list(set(self.ITEMS))
        hash_seed = os.environ.get("PYTHONHASHSEED", "-1")
        return obs, {**info, "first": float(self.ITEMS.index(menu[0])),
                     "hash": float(hash("evalfleet") % 1_000_003),
                     "seed": float(hash_seed) if hash_seed.lstrip("-").isdigit() else -2.0}


for _name in ("Leak", "Names", "Recon", "NeedsData", "HashOrder"):
    gym.register(id=f"evalfleet-test/{_name}-v0", entry_point=f"{__name__}:{_name}",
                 max_episode_steps=500)
