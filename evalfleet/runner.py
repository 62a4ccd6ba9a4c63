"""Stage 4's hot path: run a shard's episodes over a fixed number of env slots.

Each slot holds one env instance. A slot takes the next episode index of the shard, resets its env
with exactly that episode's ledger seed, and steps until the env terminates or truncates; the
episode's return is the float64 sum of the env's rewards. Every step, the observations of all
active slots go through ONE batched policy call. No vector-env autoreset is involved, so no reset
step can leak into a return or a length, and the set of episodes is fixed by index before running.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from evalfleet.models import EndReason
from evalfleet.policy import LoadedPolicy
from evalfleet.records import EpisodeRecord
from evalfleet.sandbox.base import EnvSlots, error_text, is_finite

logger = logging.getLogger(__name__)

#: ``info`` keys read as the episode's success flag, in order (SB3 uses ``is_success``).
SUCCESS_KEYS = ("success", "is_success")


@dataclass(frozen=True)
class EpisodeContext:
    """Constant columns of every row a shard produces."""

    request_id: str
    policy_sha256: str
    env_id: str
    env_spec_hash: str
    worker: str


@dataclass(slots=True)
class _Active:
    index: int
    seed: int
    started: float
    ret: float = 0.0
    length: int = 0
    retried: bool = False
    rng: np.random.Generator | None = None


def _invalid_actions(space: spaces.Space[Any], actions: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Per-row mask of actions outside the space (vectorised for Discrete and Box)."""
    if isinstance(space, spaces.Discrete):
        a = np.asarray(actions)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            if a.ndim == 1 and np.issubdtype(a.dtype, np.floating):
                ok = np.isfinite(a) & (a == np.round(a)) & (a >= space.start) & (a < space.start + space.n)
                return np.asarray(~ok, dtype=bool)
            return np.ones(len(a), dtype=bool)
        return np.asarray((a < space.start) | (a >= space.start + space.n), dtype=bool)
    if isinstance(space, spaces.Box):
        a = np.asarray(actions, dtype=np.float64)
        if a.shape[1:] != space.shape:
            return np.ones(a.shape[0], dtype=bool)
        flat = a.reshape(a.shape[0], -1)
        low = np.broadcast_to(space.low, space.shape).reshape(-1)
        high = np.broadcast_to(space.high, space.shape).reshape(-1)
        ok = np.isfinite(flat).all(axis=1) & (flat >= low).all(axis=1) & (flat <= high).all(axis=1)
        return np.asarray(~ok, dtype=bool)
    return np.array([not space.contains(x) for x in actions], dtype=bool)


def _to_env_action(space: spaces.Space[Any], action: Any) -> Any:
    if isinstance(space, spaces.Discrete):
        return int(action)
    if isinstance(space, spaces.Box):
        return np.asarray(action, dtype=space.dtype)
    return action


def run_shard(
    episodes: list[tuple[int, int]],
    slots: EnvSlots,
    policy: LoadedPolicy,
    ctx: EpisodeContext,
    *,
    retry_infrastructure: bool = True,
    on_episode: Callable[[EpisodeRecord], None] | None = None,
) -> list[EpisodeRecord]:
    """Run ``episodes`` (``(index, seed)`` pairs) on ``slots``; one record per episode.

    A failure ends only its own episode: the slot's env is rebuilt and takes the next index.
    Infrastructure failures (timeout, crash, OOM of a sandbox) are retried once with the same
    seed when ``retry_infrastructure``; the row then says ``retried``.
    """
    space = policy.action_space
    pending: deque[tuple[int, int, bool]] = deque((i, s, False) for i, s in episodes)
    active: dict[int, _Active] = {}
    obs_buf: dict[int, Any] = {}
    records: list[EpisodeRecord] = []

    def finish(slot: int, reason: str, error: str | None, info: dict[str, float]) -> None:
        ep = active.pop(slot)
        obs_buf.pop(slot, None)
        if (
            retry_infrastructure
            and not ep.retried
            and EndReason(reason).is_infrastructural
        ):
            pending.appendleft((ep.index, ep.seed, True))
            return
        success = next((bool(info[k]) for k in SUCCESS_KEYS if k in info), None)
        record = EpisodeRecord(
            request_id=ctx.request_id,
            policy_sha256=ctx.policy_sha256,
            env_id=ctx.env_id,
            env_spec_hash=ctx.env_spec_hash,
            episode_index=ep.index,
            seed=ep.seed,
            episode_return=ep.ret,
            length=ep.length,
            end_reason=reason,
            error=error,
            success=success,
            wall_seconds=time.perf_counter() - ep.started,
            worker=ctx.worker,
            sandbox=slots.sandbox_name(slot),
            isolation=slots.isolation,
            retried=ep.retried,
            metrics={k: v for k, v in info.items() if k not in SUCCESS_KEYS},
        )
        records.append(record)
        if on_episode is not None:
            on_episode(record)

    def fill(free: list[int]) -> None:
        # Reset free slots with the next indices until each holds a live episode or work runs out.
        while free and pending:
            batch = []
            while free and pending:
                index, seed, retried = pending.popleft()
                slot = free.pop()
                rng = None if policy.deterministic else np.random.default_rng(seed)
                active[slot] = _Active(index, seed, time.perf_counter(), retried=retried, rng=rng)
                batch.append((slot, seed))
            for (slot, _), out in zip(batch, slots.reset_many(batch), strict=True):
                if out.failure is not None:
                    finish(slot, out.failure, out.error, {})
                    free.append(slot)
                else:
                    obs_buf[slot] = out.obs

    fill(list(range(min(slots.n, len(pending))))[::-1])
    while active:
        order = sorted(active)
        batch_obs = np.stack([np.asarray(obs_buf[s], dtype=np.float32) for s in order])
        try:
            rngs = None if policy.deterministic else [active[s].rng for s in order]
            actions = policy.act(batch_obs, rngs)  # type: ignore[arg-type]
            if len(actions) != len(order):
                raise ValueError(f"policy returned {len(actions)} actions for {len(order)} rows")
        except Exception as err:
            text = error_text(err)
            for s in order:
                finish(s, EndReason.POLICY_ERROR.value, text, {})
            fill(order)
            continue
        bad = _invalid_actions(space, actions)
        step_slots, step_actions, freed = [], [], []
        for k, s in enumerate(order):
            if bad[k]:
                text = f"action {np.asarray(actions[k]).tolist()!r} not in {space}"
                finish(s, EndReason.INVALID_ACTION.value, text, {})
                freed.append(s)
            else:
                step_slots.append(s)
                step_actions.append(_to_env_action(space, actions[k]))
        outcomes = slots.step_many(step_slots, step_actions)
        for s, out in zip(step_slots, outcomes, strict=True):
            ep = active[s]
            if out.failure is not None:
                finish(s, out.failure, out.error, {})
                freed.append(s)
                continue
            ep.length += 1
            if not is_finite(out.reward):
                finish(s, EndReason.INVALID_REWARD.value,
                       f"reward {out.reward!r} at step {ep.length}", {})
                freed.append(s)
                continue
            ep.ret += out.reward
            if out.terminated or out.truncated:
                reason = EndReason.TERMINATED if out.terminated else EndReason.TRUNCATED
                finish(s, reason.value, None, out.info)
                freed.append(s)
            else:
                obs_buf[s] = out.obs
        if freed:
            fill(freed)
    return records

