"""CartPole's native vector env as ``InProcessSlots``' fast path, with per-episode ledger seeds.

Why a module for one env: gymnasium 1.4's native vector envs cannot seed one episode. A
``vector_entry_point`` env such as ``CartPoleVectorEnv`` draws every sub-env's start state from ONE
shared ``np_random``: ``reset(seed=...)`` takes a single int (a list of seeds raises) and ignores
``options={"reset_mask": ...}`` (it resets every sub-env), and its autoreset redraws a finished
sub-env from that same generator. Per-sub-env seeds and ``reset_mask`` exist only in
``SyncVectorEnv``/``AsyncVectorEnv``, which step env instances one by one, i.e. no faster than
``InProcessSlots`` already is. So a generic "any vector entry point" path cannot give episode *i*
exactly the start state of ``ledger(base_seed, i)``; this module does it for CartPole only, by
starting each episode from the scalar env and writing that state into the vector env.

What it relies on, all of it checked at run time (any surprise turns the fast path off and the
slots run as env instances, with the same rows):

- ``CartPoleEnv.state``: the scalar env's 4-vector after ``reset(seed=...)``, the episode's start.
- ``CartPoleVectorEnv.state`` (shape ``(4, num_envs)``): a slot's column is overwritten with it.
- ``CartPoleVectorEnv.prev_done`` (private autoreset flag per sub-env): cleared at a slot's reset,
  and for sub-envs held still, so the vector env never redraws a start state of its own.
- ``CartPoleVectorEnv.steps`` (its own ``TimeLimit`` counter): zeroed at a slot's reset; the vector
  env is built with an unreachable ``max_episode_steps`` and truncation is counted here instead,
  at the scalar env's ``TimeLimit`` cap.
- ``_sutton_barto_reward`` and the physics constants (``_CARTPOLE_PARAMS``): read from the scalar
  env, passed to / compared with the vector env so both compute the same rewards and dynamics.

``native_cartpole_matches`` steps the vector env beside scalar envs once per process (and per
gymnasium version) and demands bitwise-equal observations, rewards and terminations; a layout
change in a future gymnasium fails that check rather than changing a return.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from evalfleet.sandbox.slots import SlotOutcome, error_text, scalar_info

#: ``max_episode_steps`` of the vector env: never reached, truncation is counted per slot here.
_NO_LIMIT = 2**31 - 1

#: CartPole attributes that must be equal in the scalar and the vector env (physics, reward).
_CARTPOLE_PARAMS = ("gravity", "masscart", "masspole", "total_mass", "length", "polemass_length",
                    "force_mag", "tau", "kinematics_integrator", "theta_threshold_radians",
                    "x_threshold", "_sutton_barto_reward")
_native_checks: dict[str, bool] = {}


def native_cartpole_matches() -> bool:
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


class NativeCartPoles:
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
    def open(cls, env: gym.Env[Any, Any], peeled: gym.Env[Any, Any], limit: int | None, n: int
             ) -> NativeCartPoles | None:
        """``n`` native slots like ``env``, or None unless ``env`` is a plain registered CartPole.

        ``peeled`` and ``limit``: ``env`` under ``make``'s outer ``TimeLimit`` and
        ``OrderEnforcing``, and that ``TimeLimit``'s cap (see ``InProcessSlots``).
        """
        from gymnasium.envs.classic_control.cartpole import CartPoleEnv, CartPoleVectorEnv

        inner: Any = peeled
        spec = env.spec
        if (type(inner) is not CartPoleEnv or inner is not env.unwrapped or limit is None
                or spec is None or spec.vector_entry_point is None
                or inner.render_mode is not None or not native_cartpole_matches()):
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


