"""The sandbox interface and the in-process backend."""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from evalfleet.errors import IsolationUnavailable
from evalfleet.redaction import redact
from evalfleet.sandbox.limits import SandboxLimits


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
    # Scrubbed before it is cut: a secret cut in half would no longer match.
    return redact(f"{type(err).__name__}: {err}{where}")[:500]


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


_NO_LIMIT = 2**31 - 1
#: Environment variable read when ``InProcessSlots(native_vector=None)``: ``0`` = env instances.
NATIVE_VECTOR_ENV = "EVALFLEET_NATIVE_VECTOR"


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


#: CartPole attributes that must be equal in the scalar and the vector env (physics, reward).
_CARTPOLE_PARAMS = ("gravity", "masscart", "masspole", "total_mass", "length", "polemass_length",
                    "force_mag", "tau", "kinematics_integrator", "theta_threshold_radians",
                    "x_threshold", "_sutton_barto_reward")
_native_checks: dict[str, bool] = {}


def _native_cartpole_matches() -> bool:
    """Once per process: check that native vector CartPole steps equal ``CartPoleEnv``'s bitwise.

    Sub-envs started from scalar resets are stepped side by side with scalar envs, half under
    a balancing controller (long episodes), half under random actions; observations, rewards
    and terminations must be identical. Any mismatch or error turns the native path off.
    """
    from gymnasium import __version__ as gym_version

    cached = _native_checks.get(gym_version)
    if cached is not None:
        return cached
    ok = False
    try:
        from gymnasium.envs.classic_control.cartpole import CartPoleEnv, CartPoleVectorEnv

        k, horizon = 8, 200
        vec: Any = CartPoleVectorEnv(num_envs=k, max_episode_steps=_NO_LIMIT)
        vec.reset(seed=0)
        refs: list[Any] = [CartPoleEnv() for _ in range(k)]
        for i, ref in enumerate(refs):
            ref.reset(seed=i)
            vec.state[:, i] = ref.state
        rng = np.random.default_rng(0)
        alive = np.ones(k, dtype=bool)
        obs = vec.state.T.astype(np.float32)
        ok = True
        for _ in range(horizon):
            balance = (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)
            actions = np.where(np.arange(k) % 2 == 0, balance, rng.integers(0, 2, k))
            obs, reward, terminated, _, _ = vec.step(actions)
            for i in np.flatnonzero(alive).tolist():
                o, r, term, _, _ = refs[i].step(int(actions[i]))
                if not (o.dtype == obs.dtype and np.array_equal(o, obs[i]) and r == reward[i]
                        and term == bool(terminated[i])):
                    ok = False
                alive[i] = not term
            if not (ok and alive.any()):
                break
        vec.close()
    except Exception:  # another gymnasium layout: use env instances
        ok = False
    _native_checks[gym_version] = ok
    return ok


class _NativeCartPoles:
    """``n`` CartPole slots as one native ``CartPoleVectorEnv`` whose autoreset is never used.

    A slot's reset is ``CartPoleEnv.reset(seed=...)`` of the very env ``make`` built (so the start
    state and observation are exactly the scalar env's), copied into the sub-env's state column;
    the vector env's own step counter and autoreset are disarmed for that sub-env. Truncation is
    counted here, at the ``TimeLimit``'s cap. Sub-envs without an episode step along with the
    others and are overwritten at their next reset.
    """

    def __init__(self, outer: gym.Env[Any, Any], ref: Any, vec: Any, limit: int) -> None:
        self._outer = outer
        self._ref = ref
        self._vec = vec
        self._limit = limit
        n = int(vec.num_envs)
        self._ready = np.zeros(n, dtype=bool)
        self._elapsed = np.zeros(n, dtype=np.int64)
        self._actions = np.zeros(n, dtype=np.int64)

    @classmethod
    def open(cls, env: gym.Env[Any, Any], n: int) -> _NativeCartPoles | None:
        """``n`` native slots like ``env``, or None unless ``env`` is a plain registered CartPole."""
        from gymnasium.envs.classic_control.cartpole import CartPoleEnv, CartPoleVectorEnv

        peeled, limit = _peel(env)
        inner: Any = peeled
        spec = env.spec
        if (type(inner) is not CartPoleEnv or inner is not env.unwrapped or limit is None
                or spec is None or spec.vector_entry_point is None
                or inner.render_mode is not None or not _native_cartpole_matches()):
            return None
        vec = CartPoleVectorEnv(num_envs=n, max_episode_steps=_NO_LIMIT,
                                sutton_barto_reward=bool(vars(inner)["_sutton_barto_reward"]))
        if any(getattr(vec, a) != getattr(inner, a) for a in _CARTPOLE_PARAMS):
            vec.close()
            return None
        vec.reset(seed=0)
        return cls(env, inner, vec, limit)

    def reset(self, slot: int, seed: int) -> SlotOutcome:
        """Start ``slot``'s sub-env from the scalar env's reset with exactly ``seed``."""
        try:
            obs, info = self._ref.reset(seed=seed)
            self._vec.state[:, slot] = self._ref.state
            self._vec.prev_done[slot] = False
            self._vec.steps[slot] = 0
        except Exception as err:
            self._ready[slot] = False
            return SlotOutcome(failure="env_error", error=error_text(err))
        self._ready[slot] = True
        self._elapsed[slot] = 0
        return SlotOutcome(obs=obs, info=scalar_info(info))

    def _step(
        self, slots: npt.NDArray[np.intp], actions: npt.NDArray[Any]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float64], npt.NDArray[np.bool_],
               npt.NDArray[np.bool_], dict[int, SlotOutcome]]:
        vec = self._vec
        failed: dict[int, SlotOutcome] = {}
        ready = self._ready[slots]
        if not ready.all():  # only when a caller steps a slot it did not reset
            for pos in np.flatnonzero(~ready).tolist():
                failed[pos] = SlotOutcome(failure="env_error", error="env was not reset")
            slots, actions = slots[ready], actions[ready]
        # Mid-episode sub-envs not stepped now keep their state (the vector env steps them all).
        saved = None
        if np.count_nonzero(self._ready) > len(slots):
            idle = self._ready.copy()
            idle[slots] = False
            keep = np.flatnonzero(idle)
            saved = (vec.state[:, keep].copy(), vec.steps[keep].copy())
        self._actions[slots] = actions
        try:
            obs, reward, terminated, _, _ = vec.step(self._actions)
        except Exception as err:
            self._ready[:] = False
            text = error_text(err)
            n = len(ready)
            return (np.zeros((0,), np.float32), np.zeros(n), np.zeros(n, bool), np.zeros(n, bool),
                    {pos: SlotOutcome(failure="env_error", error=text) for pos in range(n)})
        if saved is not None:
            vec.state[:, keep], vec.steps[keep] = saved
            vec.prev_done[keep] = False
        every = len(slots) == len(self._ready)  # slots is then 0..n-1: no gathers needed
        if every:
            self._elapsed += 1
        else:
            self._elapsed[slots] += 1
        rewards = (reward if every else reward[slots]).astype(np.float64)
        term = terminated if every else terminated[slots]
        trunc = (self._elapsed if every else self._elapsed[slots]) >= self._limit
        self._ready[slots[term | trunc]] = False
        if failed:  # back to one row per requested slot
            rows = np.flatnonzero(ready)
            full_r, full_te, full_tr = np.zeros(len(ready)), np.zeros(len(ready), bool), np.zeros(
                len(ready), bool)
            full_r[rows], full_te[rows], full_tr[rows] = rewards, term, trunc
            return obs, full_r, full_te, full_tr, failed
        return obs, rewards, term, trunc, failed

    def step_batch(
        self, slots: npt.NDArray[np.intp], actions: npt.NDArray[Any], obs_out: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
        """Step the sub-envs of ``slots`` at once; see ``InProcessSlots.step_batch``."""
        obs, rewards, term, trunc, ended = self._step(slots, actions)
        if len(obs):
            # Rows that ended get their observation written too: unread until the slot's reset.
            if len(slots) == len(obs):
                obs_out[...] = obs
            else:
                obs_out[slots] = obs[slots]
            for pos in np.flatnonzero(term | trunc).tolist():
                ended[pos] = SlotOutcome(reward=float(rewards[pos]), terminated=bool(term[pos]),
                                         truncated=bool(trunc[pos]))
        return rewards, dict(sorted(ended.items()))

    def step_many(self, slots: Sequence[int], actions: Sequence[Any]) -> list[SlotOutcome]:
        """The protocol's per-slot form of ``step_batch``."""
        idx = np.asarray(slots, dtype=np.intp)
        obs, rewards, term, trunc, failed = self._step(idx, np.array([int(a) for a in actions]))
        return [
            failed.get(pos) or SlotOutcome(obs=obs[slot], reward=float(rewards[pos]),
                                           terminated=bool(term[pos]), truncated=bool(trunc[pos]))
            for pos, slot in enumerate(slots)
        ]

    def close(self) -> None:
        """Close the vector env and the env ``make`` built."""
        self._vec.close()
        self._outer.close()


class InProcessSlots:
    """Env instances inside the worker process: trusted envs, fastest, no containment.

    What keeps the per-step cost near a bare loop's:

    - ``gym.make``'s outer ``TimeLimit`` and ``OrderEnforcing`` wrappers are peeled off each
      instance and their job done here: steps are counted per slot and ``truncated`` is set at
      the same ``max_episode_steps`` (and the runner never steps before a reset). Any other
      wrapper, and a ``TimeLimit`` under one, stays in place.
    - ``step_batch`` (the runner's fast path) steps many slots with arrays in and out.
    - A plain registered CartPole (``CartPole-v0/v1`` without render mode, subclass or changed
      parameters) runs as one native ``CartPoleVectorEnv`` (``native_vector=True``): each slot
      still starts from ``CartPoleEnv.reset(seed=...)`` with exactly its seed, and a self-check
      once per process proves the vector steps bit-identical to the scalar env's on this machine
      (otherwise: env instances). ``native_vector=None`` reads ``EVALFLEET_NATIVE_VECTOR``
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
        self._native: _NativeCartPoles | None = None
        if native_vector and n > 0:
            try:
                probe = make()
            except Exception:  # the failure is reported by the slot's first reset
                return
            self._native = _NativeCartPoles.open(probe, n)
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
            return SlotOutcome(failure="env_error", error=error_text(err))
        self._elapsed[slot] = 0
        self._steps[slot] = inner.step
        return SlotOutcome(obs=obs, info=scalar_info(info))

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
            except Exception as err:
                self._discard(slot)
                out.append(SlotOutcome(failure="env_error", error=error_text(err)))
                continue
            elapsed = self._elapsed[slot] = self._elapsed[slot] + 1
            limit = self._limits[slot]
            if limit is not None and elapsed >= limit:
                truncated = True
            out.append(
                SlotOutcome(
                    obs=obs,
                    reward=reward,
                    terminated=bool(terminated),
                    truncated=bool(truncated),
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
        """
        if self._native is not None:
            return self._native.step_batch(slots, actions, obs_out)
        env_actions = actions.tolist() if self._discrete else [np.asarray(a) for a in actions]
        rewards = [0.0] * len(env_actions)
        ended: dict[int, SlotOutcome] = {}
        steps, limits, elapsed = self._steps, self._limits, self._elapsed
        for pos, slot in enumerate(slots.tolist()):
            step = steps[slot]
            if step is None:
                ended[pos] = SlotOutcome(failure="env_error", error="env was not reset")
                continue
            try:
                obs, reward, terminated, truncated, info = step(env_actions[pos])
                reward = rewards[pos] = float(reward)
            except Exception as err:
                self._discard(slot)
                ended[pos] = SlotOutcome(failure="env_error", error=error_text(err))
                continue
            count = elapsed[slot] = elapsed[slot] + 1
            limit = limits[slot]
            if limit is not None and count >= limit:
                truncated = True
            if terminated or truncated:
                ended[pos] = SlotOutcome(reward=reward, terminated=bool(terminated),
                                         truncated=bool(truncated), info=scalar_info(info))
                continue
            try:
                obs_out[slot] = obs
            except Exception as err:
                shape = getattr(obs, "shape", type(obs).__name__)
                ended[pos] = SlotOutcome(
                    failure="env_error",
                    error=f"observation {shape} does not fit the observation rows of shape "
                    f"{obs_out.shape[1:]}: {error_text(err)}"[:500])
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
        from evalfleet.sandbox.process import ProcessSlots

        return ProcessSlots(make, n, level=isolation, episode_timeout_s=episode_timeout_s,
                            env_spec=env_spec, envs_per_sandbox=envs_per_sandbox, limits=limits,
                            env_allow=env_allow)
    raise IsolationUnavailable(
        f"Unknown isolation {isolation!r}. Choose 'inprocess', 'process' or 'bwrap' (a resolved "
        "level: 'auto' is resolved by resolve_isolation before slots are opened)."
    )
