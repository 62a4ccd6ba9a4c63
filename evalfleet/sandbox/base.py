"""The in-process backend (``InProcessSlots``) and ``open_slots``, which picks a backend by level.

The shared types live in :mod:`evalfleet.sandbox.slots` and are re-exported here for the modules
that import them from this one; the sandbox-process backend is :mod:`evalfleet.sandbox.process`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from evalfleet.errors import IsolationUnavailable
from evalfleet.sandbox.limits import SandboxLimits
from evalfleet.sandbox.native_cartpole import NativeCartPoles
from evalfleet.sandbox.process import ProcessSlots
from evalfleet.sandbox.slots import (
    WIDE_FLOATS,
    EnvSlots,
    SlotOutcome,
    error_text,
    is_finite,
    obs_shape_error,
    overflow_text,
    scalar_info,
)

__all__ = ["NATIVE_VECTOR_ENV", "EnvSlots", "InProcessSlots", "SlotOutcome", "error_text",
           "is_finite", "open_slots", "scalar_info"]

#: Environment variable read when ``InProcessSlots(native_vector=None)``: ``0`` = env instances.
NATIVE_VECTOR_ENV = "EVALFLEET_NATIVE_VECTOR"


def _env_failure(err: Exception) -> SlotOutcome:
    """The outcome of an env call that raised ``err``: ``oom`` for a MemoryError, else ``env_error``.

    A MemoryError is no fact of the env's seed: in a sandbox it is ``oom`` (retried, never
    cached), and in-process it was an ``env_error``, cached and served as a hit ever after.
    """
    if isinstance(err, MemoryError):
        return SlotOutcome(failure="oom", error=f"{error_text(err)} (in the worker process)")
    return SlotOutcome(failure="env_error", error=error_text(err))


def _peel(env: gym.Env[Any, Any]) -> tuple[gym.Env[Any, Any], int | None]:
    """The env under ``gym.make``'s outer ``TimeLimit`` and ``OrderEnforcing``, and the step cap.

    Only those two exact wrapper types are peeled, and at most one ``TimeLimit``; peeling stops
    at the first other wrapper, which keeps everything under it (``TimeLimit`` included).
    """
    inner: gym.Env[Any, Any] = env
    limit: int | None = None
    while True:
        kind = type(inner)
        if kind is gym.wrappers.TimeLimit and limit is None:
            cap = getattr(inner, "_max_episode_steps", None)
            if not isinstance(cap, int):
                return inner, limit
            limit = cap
        elif kind is not gym.wrappers.OrderEnforcing:
            return inner, limit
        inner = inner.env  # type: ignore[attr-defined]


class InProcessSlots:
    """Env instances inside the worker process: trusted envs, fastest, no containment.

    What keeps the per-step cost near a bare loop's:

    - ``gym.make``'s outer ``TimeLimit`` and ``OrderEnforcing`` wrappers are peeled off each
      instance and their job done here: steps are counted per slot and ``truncated`` is set at
      the same ``max_episode_steps`` (and the runner never steps before a reset). Any other
      wrapper, and a ``TimeLimit`` under one, stays in place.
    - ``step_batch`` (the runner's fast path) steps many slots with arrays in and out.
    - A plain registered CartPole (``CartPole-v0/v1`` without render mode, subclass or changed
      parameters) runs as one native ``CartPoleVectorEnv`` (``native_vector=True``,
      :mod:`evalfleet.sandbox.native_cartpole`): each slot still starts from
      ``CartPoleEnv.reset(seed=...)`` with exactly its seed, and a self-check once per process
      proves the vector steps bit-identical to the scalar env's on this machine (otherwise: env
      instances). ``native_vector=None`` reads ``EVALFLEET_NATIVE_VECTOR``
      (``0`` turns it off, e.g. to measure the instance path).
    """

    isolation = "inprocess"

    def __init__(
        self, make: Callable[[], gym.Env[Any, Any]], n: int, *, native_vector: bool | None = None
    ) -> None:
        if native_vector is None:
            native_vector = os.environ.get(NATIVE_VECTOR_ENV, "1") != "0"
        self._make = make
        self.n = n
        self._envs: list[gym.Env[Any, Any] | None] = [None] * n
        self._steps: list[Callable[[Any], tuple[Any, Any, Any, Any, dict[str, Any]]] | None] = (
            [None] * n)
        self._limits: list[int | None] = [None] * n
        self._elapsed: list[int] = [0] * n
        self._discrete = True
        self._native: NativeCartPoles | None = None
        if native_vector and n > 0:
            try:
                probe = make()
            except Exception:  # the failure is reported by the slot's first reset
                return
            self._native = NativeCartPoles.open(probe, *_peel(probe), n)
            if self._native is None:
                self._envs[0] = probe
                self._discrete = isinstance(probe.action_space, gym.spaces.Discrete)

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Reset one env with its ledger seed; an exception becomes an ``env_error`` outcome."""
        if self._native is not None:
            return self._native.reset(slot, seed)
        self._steps[slot] = None
        try:
            env = self._envs[slot]
            if env is None:
                env = self._envs[slot] = self._make()
                self._discrete = isinstance(env.action_space, gym.spaces.Discrete)
            inner, self._limits[slot] = _peel(env)
            obs, info = inner.reset(seed=seed)
        except Exception as err:
            self._discard(slot)
            return _env_failure(err)
        self._elapsed[slot] = 0
        self._steps[slot] = inner.step
        # A copy: the runner stores it only once every slot of the batch is reset, and an env may
        # return one array it rewrites (shared by its instances: a global buffer), so a slot
        # acted on another slot's reset. Once per episode; a sandbox's reply is a copy too.
        return SlotOutcome(obs=obs.copy() if isinstance(obs, np.ndarray) else obs,
                           info=scalar_info(info))

    def reset_many(self, items: Sequence[tuple[int, int]]) -> list[SlotOutcome]:
        """Reset each ``(slot, seed)`` in turn."""
        return [self.reset(slot, seed) for slot, seed in items]

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """Step each slot in turn."""
        if self._native is not None:
            return self._native.step_many(slots, actions)
        out = []
        for slot, action in zip(slots, actions, strict=True):
            step = self._steps[slot]
            if step is None:
                out.append(SlotOutcome(failure="env_error", error="env was not reset"))
                continue
            try:
                obs, reward, terminated, truncated, info = step(action)
                reward = float(reward)
                # In the try: an array of 2 has no truth value, and that is the env's error
                terminated, truncated = bool(terminated), bool(truncated)
            except Exception as err:
                self._discard(slot)
                out.append(_env_failure(err))
                continue
            elapsed = self._elapsed[slot] = self._elapsed[slot] + 1
            limit = self._limits[slot]
            if limit is not None and elapsed >= limit:
                truncated = True
            out.append(
                SlotOutcome(
                    obs=obs.copy() if isinstance(obs, np.ndarray) else obs,  # as ``reset``'s
                    reward=reward,
                    terminated=terminated,
                    truncated=truncated,
                    info=scalar_info(info) if (terminated or truncated) else {},
                )
            )
        return out

    def step_batch(
        self, slots: npt.NDArray[np.intp], actions: npt.NDArray[Any], obs_out: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
        """Step ``slots`` (one action row each), as ``step_many`` would, with arrays in and out.

        ``actions``: int64 indices for a ``Discrete`` space (each env gets ``int(a)``), else rows
        of the space's dtype (each env gets its row). The observation of every row whose episode
        goes on is written to ``obs_out[slot]``; returned are the float64 rewards (one per row)
        and, keyed by row position, the outcome of every row that terminated, truncated or failed.
        An observation whose shape is not exactly ``obs_out``'s row shape is an ``env_error``.
        """
        if self._native is not None:
            return self._native.step_batch(slots, actions, obs_out)
        env_actions = actions.tolist() if self._discrete else [np.asarray(a) for a in actions]
        rewards = [0.0] * len(env_actions)
        ended: dict[int, SlotOutcome] = {}
        steps, limits, elapsed = self._steps, self._limits, self._elapsed
        row_shape = obs_out.shape[1:]
        ndarray, wide_floats = np.ndarray, WIDE_FLOATS
        wide: list[tuple[int, int, Any]] = []  # rows written from values float32 may not hold
        for pos, slot in enumerate(slots.tolist()):
            step = steps[slot]
            if step is None:
                ended[pos] = SlotOutcome(failure="env_error", error="env was not reset")
                continue
            try:
                obs, reward, terminated, truncated, info = step(env_actions[pos])
                reward = rewards[pos] = float(reward)
                # Truth values in the try: an array of 2 has none, and that is the env's error (it
                # failed the whole evaluation here, and was an env_error row in a sandbox).
                if terminated or truncated:
                    terminated, truncated, done = bool(terminated), bool(truncated), True
                else:
                    done = False
            except Exception as err:
                self._discard(slot)
                ended[pos] = _env_failure(err)
                continue
            count = elapsed[slot] = elapsed[slot] + 1
            limit = limits[slot]
            if limit is not None and count >= limit:
                truncated = done = True
            if done:
                ended[pos] = SlotOutcome(reward=reward, terminated=bool(terminated),
                                         truncated=truncated, info=scalar_info(info))
                continue
            try:
                # Exactly the row's shape: assigned, numpy broadcast a (1,) observation into every
                # element of a (4,) row. The common case costs one attribute and a tuple compare.
                array = type(obs) is ndarray
                if (obs.shape if array else np.shape(obs)) != row_shape:
                    ended[pos] = SlotOutcome(failure="env_error", error=obs_shape_error(
                        np.shape(obs), row_shape, f"at step {count}"))
                    continue
                obs_out[slot] = obs
                if (obs.dtype in wide_floats) if array else type(obs) is not int:  # ``may_overflow``
                    wide.append((pos, slot, obs))
            except Exception as err:
                shape = getattr(obs, "shape", type(obs).__name__)
                ended[pos] = SlotOutcome(
                    failure="env_error",
                    error=f"observation {shape} does not fit the observation rows of shape "
                    f"{obs_out.shape[1:]}: {error_text(err)}"[:500])
        # One look over the rows a float64 observation was written to; row by row only at an inf.
        if wide and np.isinf(obs_out[[slot for _, slot, _ in wide]]).any():
            for pos, slot, obs in wide:
                text = overflow_text(obs_out[slot], obs, f"at step {elapsed[slot]}")
                if text is not None:
                    ended[pos] = SlotOutcome(failure="env_error", error=text)
        return np.array(rewards, dtype=np.float64), ended

    def _discard(self, slot: int) -> None:
        env, self._envs[slot] = self._envs[slot], None
        self._steps[slot] = None
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
        if self._native is not None:
            self._native.close()
            self._native = None
        for slot in range(self.n):
            self._discard(slot)


def open_slots(
    isolation: str,
    make: Callable[[], gym.Env[Any, Any]],
    n: int,
    *,
    episode_timeout_s: float,
    env_spec: dict[str, Any],
    envs_per_sandbox: int = 1,
    limits: SandboxLimits | None = None,
    env_allow: Sequence[str] = (),
) -> EnvSlots:
    """Open ``n`` slots at ``isolation``; never silently less isolation than asked.

    ``inprocess``: env instances in this process (``envs_per_sandbox``, ``limits`` and the
    timeout do not apply). ``process`` / ``bwrap``: ``ceil(n / envs_per_sandbox)`` sandbox
    processes with ``limits`` (default :class:`SandboxLimits`), episodes killed after
    ``episode_timeout_s`` of wall clock, seeing the allow-listed environment plus ``env_allow``
    (:mod:`evalfleet.sandbox.environment`). A level this machine cannot provide raises
    ``IsolationUnavailable`` naming what is missing.
    """
    if isolation == "inprocess":
        return InProcessSlots(make, n)
    if isolation in ("process", "bwrap"):
        # The fork server refuses to start without its level's must-haves (seccomp, the jail),
        # so a worker needs no probe of its own.
        return ProcessSlots(make, n, level=isolation, episode_timeout_s=episode_timeout_s,
                            env_spec=env_spec, envs_per_sandbox=envs_per_sandbox, limits=limits,
                            env_allow=env_allow)
    raise IsolationUnavailable(
        f"Unknown isolation {isolation!r}. Choose 'inprocess', 'process' or 'bwrap' (a resolved "
        "level: 'auto' is resolved by resolve_isolation before slots are opened)."
    )
