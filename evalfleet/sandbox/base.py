"""The sandbox interface and the in-process backend."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np

from evalfleet.errors import IsolationUnavailable


@dataclass(slots=True)
class SlotOutcome:
    """What one reset or step of one slot produced.

    ``failure`` is set (to an ``EndReason`` value) when the env could not produce a step; the
    slot's env is then unusable until ``recreate``.
    """

    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    error: str | None = None


def scalar_info(info: dict[str, Any]) -> dict[str, float]:
    """The scalar (bool/int/float) entries of an ``info`` dict, as floats."""
    out: dict[str, float] = {}
    for key, value in info.items():
        if isinstance(value, bool | int | float | np.bool_ | np.integer | np.floating):
            out[key] = float(value)
    return out


def error_text(err: BaseException) -> str:
    """``Type: message (at file:line)`` — short and groupable by signature."""
    tb = traceback.extract_tb(err.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    return f"{type(err).__name__}: {err}{where}"[:500]


class EnvSlots(Protocol):
    """``n`` env instances at one isolation level, reset and stepped by slot number."""

    isolation: str
    n: int

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Reset ``slot``'s env with exactly ``seed``."""

    def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotOutcome]:
        """Reset several ``(slot, seed)`` pairs (in parallel where the backend can)."""

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """Step several slots, one action each (in parallel where the backend can)."""

    def sandbox_name(self, slot: int) -> str:
        """A label for the sandbox hosting ``slot`` (for the episode row)."""

    def close(self) -> None:
        """Release every env instance and process."""


class InProcessSlots:
    """Env instances inside the worker process: trusted envs, fastest, no containment."""

    isolation = "inprocess"

    def __init__(self, make: Callable[[], gym.Env[Any, Any]], n: int) -> None:
        self._make = make
        self.n = n
        self._envs: list[gym.Env[Any, Any] | None] = [None] * n

    def _env(self, slot: int) -> gym.Env[Any, Any]:
        env = self._envs[slot]
        if env is None:
            env = self._envs[slot] = self._make()
        return env

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Reset one env with its ledger seed; an exception becomes an ``env_error`` outcome."""
        try:
            obs, info = self._env(slot).reset(seed=seed)
        except Exception as err:
            self._discard(slot)
            return SlotOutcome(failure="env_error", error=error_text(err))
        return SlotOutcome(obs=obs, info=scalar_info(info))

    def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotOutcome]:
        """Reset each ``(slot, seed)`` in turn."""
        return [self.reset(slot, seed) for slot, seed in items]

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """Step each slot in turn."""
        out = []
        for slot, action in zip(slots, actions, strict=True):
            env = self._envs[slot]
            if env is None:
                out.append(SlotOutcome(failure="env_error", error="env was not reset"))
                continue
            try:
                obs, reward, terminated, truncated, info = env.step(action)
            except Exception as err:
                self._discard(slot)
                out.append(SlotOutcome(failure="env_error", error=error_text(err)))
                continue
            out.append(
                SlotOutcome(
                    obs=obs,
                    reward=float(reward),
                    terminated=bool(terminated),
                    truncated=bool(truncated),
                    info=scalar_info(info) if (terminated or truncated) else {},
                )
            )
        return out

    def _discard(self, slot: int) -> None:
        env, self._envs[slot] = self._envs[slot], None
        if env is not None:
            try:
                env.close()
            except Exception:  # a broken env may fail to close; the slot is rebuilt anyway
                pass

    def sandbox_name(self, slot: int) -> str:
        """In-process slots share the worker process."""
        return f"inproc-{slot}"

    def close(self) -> None:
        """Close every env."""
        for slot in range(self.n):
            self._discard(slot)


def is_finite(x: float) -> bool:
    """True for a finite float (rewards must be)."""
    return math.isfinite(x)


def open_slots(
    isolation: str,
    make: Callable[[], gym.Env[Any, Any]],
    n: int,
    *,
    episode_timeout_s: float,
    env_spec: dict[str, Any],
    envs_per_sandbox: int = 1,
) -> EnvSlots:
    """Open ``n`` slots at ``isolation``; never silently less isolation than asked."""
    if isolation == "inprocess":
        return InProcessSlots(make, n)
    raise IsolationUnavailable(
        f"isolation {isolation!r} is not available in this build; use 'inprocess'."
    )
