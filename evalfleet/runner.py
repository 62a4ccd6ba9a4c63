"""Stage 4's hot path: run a shard's episodes over a fixed number of env slots.

Each slot holds one env instance. A slot takes the next episode index of the shard, resets its env
with exactly that episode's ledger seed, and steps until the env terminates or truncates; the
episode's return is the float64 sum of the env's rewards. Every step, the observations of all
active slots go through ONE batched policy call. No vector-env autoreset is involved, so no reset
step can leak into a return or a length, and the set of episodes is fixed by index before running.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from gymnasium import spaces

from evalfleet.models import EndReason
from evalfleet.policy import LoadedPolicy
from evalfleet.records import EpisodeRecord
from evalfleet.redaction import Redactor
from evalfleet.sandbox.base import EnvSlots, SlotOutcome, error_text, is_finite

logger = logging.getLogger(__name__)

#: ``info`` keys read as the episode's success flag, in order (SB3 uses ``is_success``).
SUCCESS_KEYS = ("success", "is_success")

#: Default bound, in seconds, of one batched policy forward (``EvalRequest.policy_timeout_s``).
DEFAULT_POLICY_TIMEOUT_S = 30.0
#: The first forward of a shard may take this many times the bound: it pays one-off costs (CUDA
#: context and cuBLAS/cuDNN set-up, TorchScript's profiling runs, lazy modules, first page-ins).
FIRST_FORWARD_FACTOR = 4.0


class _Abandoned(Exception):
    """Raised in a shard thread whose forward returned after the shard was given up on."""


class _ForwardWatch:
    """The deadline of the forward in flight, shared by the shard thread and its watcher.

    The shard thread sets ``deadline`` before each forward (a plain store) and clears it under
    ``lock`` right after; the watcher sets ``abandoned`` under ``lock`` only while a deadline has
    passed. So once ``abandoned`` is set, the shard thread is inside the policy and never touches
    the shard's state again: the watcher owns it.
    """

    __slots__ = ("lock", "deadline", "bound", "rows", "abandoned")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadline: float | None = None
        self.bound = 0.0
        self.rows = 0
        self.abandoned = False


@dataclass(frozen=True)
class EpisodeContext:
    """Constant columns of every row a shard produces."""

    request_id: str
    policy_sha256: str
    env_id: str
    env_spec_hash: str
    worker: str


def _invalid_actions(space: spaces.Space[Any], actions: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Per-row mask of actions outside the space (vectorised for Discrete and Box)."""
    if isinstance(space, spaces.Discrete):
        a = np.asarray(actions)
        if a.dtype == np.int64 and a.ndim == 1:  # the common case, without dtype inspection
            return np.asarray((a < space.start) | (a >= space.start + space.n), dtype=bool)
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


@runtime_checkable
class BatchEnvSlots(EnvSlots, Protocol):
    """``EnvSlots`` that also step many slots with arrays in and out: the runner's fast path.

    ``step_batch(slots, actions, obs_out)`` steps each slot of ``slots`` (ascending slot numbers)
    with its row of ``actions`` — int64 action indices for a ``Discrete`` space (each env gets
    ``int(a)``), rows of the space's dtype for a ``Box`` space (each env gets the row array) —
    exactly as ``step_many`` would. It writes the observation of every row whose episode goes on
    into ``obs_out[slot]`` and returns the float64 rewards (one per row) and, keyed by row
    position, a ``SlotOutcome`` for every row that terminated, truncated or failed.
    """

    def step_batch(
        self,
        slots: npt.NDArray[np.intp],
        actions: npt.NDArray[Any],
        obs_out: npt.NDArray[np.float32],
    ) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
        """Step ``slots`` with ``actions``; observations into ``obs_out``, rewards and ends out."""


def _batch_actions(space: spaces.Space[Any], actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Valid actions in the array form ``step_batch`` takes (see ``BatchEnvSlots``)."""
    if isinstance(space, spaces.Discrete):
        return np.asarray(actions).astype(np.int64)
    if isinstance(space, spaces.Box):
        return np.asarray(actions, dtype=space.dtype)
    return np.asarray(actions)


def _step_via_many(
    slots: EnvSlots,
    step_slots: npt.NDArray[np.intp],
    actions: npt.NDArray[Any],
    space: spaces.Space[Any],
    obs_out: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
    """``step_batch``'s result computed through the protocol's ``step_many``."""
    slot_list = step_slots.tolist()
    outcomes = slots.step_many(slot_list, [_to_env_action(space, a) for a in actions])
    rewards = np.zeros(len(slot_list), dtype=np.float64)
    ended: dict[int, SlotOutcome] = {}
    for pos, (slot, out) in enumerate(zip(slot_list, outcomes, strict=True)):
        if out.failure is None:
            rewards[pos] = out.reward
            if not (out.terminated or out.truncated):
                try:
                    obs_out[slot] = out.obs
                except Exception as err:
                    ended[pos] = SlotOutcome(failure=EndReason.ENV_ERROR.value,
                                             error=_obs_error(out.obs, obs_out, err))
                continue
        ended[pos] = out
    return rewards, ended


def _obs_error(obs: Any, obs_out: npt.NDArray[np.float32], err: BaseException) -> str:
    shape = getattr(obs, "shape", type(obs).__name__)
    return (f"observation {shape} does not fit the shard's float32 observation rows of shape "
            f"{obs_out.shape[1:]}: {error_text(err)}")[:500]


def _split_forward(
    forward: Callable[[npt.NDArray[np.intp], npt.NDArray[np.float32]], npt.NDArray[Any]],
    rows: npt.NDArray[np.intp],
    obs: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[Any] | None, dict[int, str]]:
    """Retry a failed forward on halves, down to single rows.

    Returns the mask of rows that got an action, their actions (in row order; None when none
    did) and the error text of every row whose single-row forward raised, keyed by position.
    """
    done: list[tuple[int, npt.NDArray[Any]]] = []
    errors: dict[int, str] = {}
    spans = [(0, len(rows))]
    while spans:
        lo, hi = spans.pop()
        mid = (lo + hi) // 2
        for a, b in ((lo, mid), (mid, hi)):
            try:
                done.append((a, forward(rows[a:b], obs[a:b])))
            except _Abandoned:
                raise
            except Exception as err:
                if b - a == 1:
                    errors[a] = error_text(err)
                else:
                    spans.append((a, b))
    ok = np.ones(len(rows), dtype=bool)
    ok[list(errors)] = False
    if not done:
        return ok, None, errors
    done.sort(key=lambda item: item[0])
    return ok, np.concatenate([np.asarray(acts) for _, acts in done]), errors


def run_shard(
    episodes: list[tuple[int, int]],
    slots: EnvSlots,
    policy: LoadedPolicy,
    ctx: EpisodeContext,
    *,
    retry_infrastructure: bool = True,
    on_episode: Callable[[EpisodeRecord], None] | None = None,
    policy_timeout_s: float | None = DEFAULT_POLICY_TIMEOUT_S,
) -> list[EpisodeRecord]:
    """Run ``episodes`` (``(index, seed)`` pairs) on ``slots``; one record per episode.

    A failure ends only its own episode: the slot's env is rebuilt and takes the next index.
    Infrastructure failures (timeout, crash, OOM of a sandbox) are retried once with the same
    seed when ``retry_infrastructure``; the row then says ``retried``. A policy that raises ends
    only the episodes whose observation makes it raise (the batch is split down to single rows);
    their rows keep the return and length up to that step.

    ``policy_timeout_s`` bounds each policy forward (the shard's first: ``FIRST_FORWARD_FACTOR``
    times that). The episodes then run in a thread of their own while the calling thread
    watches the deadline. A forward past it cannot be stopped (Python cannot kill a thread): the
    thread is abandoned inside the policy, and the shard ends without another call into the
    policy, which may still be running, hold a lock or a GPU stream, and hang again. Every live
    episode ends as ``policy_timeout`` with its return and length so far; every episode not yet
    started is a ``policy_timeout`` row of length 0 saying it was not run. So a shard takes at
    most its normal time plus one bound. None: no bound, everything in the calling thread.

    Per step the work is array-shaped: observations live in one preallocated float32 buffer (a
    row per slot), returns and lengths in float64/int64 arrays, and only the rows whose episode
    ended are handled one by one. Backends with ``step_batch`` (``BatchEnvSlots``) are stepped
    through it; any other ``EnvSlots`` through ``step_many``.
    """
    space = policy.action_space
    deterministic = policy.deterministic
    act = policy.act
    n = slots.n
    step_batch = slots.step_batch if isinstance(slots, BatchEnvSlots) else None
    pending: deque[tuple[int, int, bool]] = deque((i, s, False) for i, s in episodes)
    records: list[EpisodeRecord] = []
    scrub = Redactor()  # the worker's secrets, read once per shard
    # The episode each slot runs (meaningful while live[slot]).
    live = np.zeros(n, dtype=bool)
    ep_index = [0] * n
    ep_seed = [0] * n
    ep_started = [0.0] * n
    ep_retried = [False] * n
    ep_rng: list[np.random.Generator | None] = [None] * n
    ret = np.zeros(n, dtype=np.float64)
    length = np.zeros(n, dtype=np.int64)
    # Extremes of the rewards of non-final steps and how many steps sat exactly on them (the
    # clip-boundary audit; a final step's reward is often a terminal bonus of its own kind).
    rmin = np.full(n, np.inf)
    rmax = np.full(n, -np.inf)
    nmin = np.zeros(n, dtype=np.int64)
    nmax = np.zeros(n, dtype=np.int64)
    watch = _ForwardWatch()
    bounds = (None if policy_timeout_s is None
              else [policy_timeout_s * FIRST_FORWARD_FACTOR, policy_timeout_s])

    def track(idx: npt.NDArray[np.intp] | None, rewards: npt.NDArray[np.float64]) -> None:
        # Finite rewards of the slots ``idx`` (None: every slot, whole-array operations).
        if idx is None:
            below, above = rewards < rmin, rewards > rmax
            if below.any():
                rmin[below], nmin[below] = rewards[below], 0
            if above.any():
                rmax[above], nmax[above] = rewards[above], 0
            nmin[:] += rewards == rmin
            nmax[:] += rewards == rmax
            return
        lo, hi = np.minimum(rmin[idx], rewards), np.maximum(rmax[idx], rewards)
        nmin[idx] = np.where(lo < rmin[idx], 0, nmin[idx]) + (rewards == lo)
        nmax[idx] = np.where(hi > rmax[idx], 0, nmax[idx]) + (rewards == hi)
        rmin[idx], rmax[idx] = lo, hi
    obs_rows: list[npt.NDArray[np.float32]] = []  # the (n, *obs_shape) buffer, once known

    def emit(record: EpisodeRecord) -> None:
        records.append(record)
        if on_episode is not None:
            on_episode(record)

    def finish(slot: int, reason: str, error: str | None, info: dict[str, float]) -> None:
        live[slot] = False
        retried = ep_retried[slot]
        if retry_infrastructure and not retried and EndReason(reason).is_infrastructural:
            pending.appendleft((ep_index[slot], ep_seed[slot], True))
            return
        success = next((bool(info[k]) for k in SUCCESS_KEYS if k in info), None)
        emit(EpisodeRecord(
            request_id=ctx.request_id,
            policy_sha256=ctx.policy_sha256,
            env_id=ctx.env_id,
            env_spec_hash=ctx.env_spec_hash,
            episode_index=ep_index[slot],
            seed=ep_seed[slot],
            episode_return=float(ret[slot]),
            length=int(length[slot]),
            end_reason=reason,
            error=scrub.optional(error),  # secrets never leave the worker in a row
            success=success,
            wall_seconds=time.perf_counter() - ep_started[slot],
            worker=ctx.worker,
            sandbox=slots.sandbox_name(slot),
            isolation=slots.isolation,
            retried=retried,
            metrics=scrub.keys({k: v for k, v in info.items() if k not in SUCCESS_KEYS}),
            nonfinal_reward_min=float(rmin[slot]) if nmin[slot] else None,
            nonfinal_reward_max=float(rmax[slot]) if nmax[slot] else None,
            nonfinal_steps_at_min=int(nmin[slot]),
            nonfinal_steps_at_max=int(nmax[slot]),
        ))

    def store_obs(slot: int, obs: Any) -> str | None:
        if not obs_rows:
            first = np.asarray(obs, dtype=np.float32)
            obs_rows.append(np.zeros((n, *first.shape), dtype=np.float32))
        try:
            obs_rows[0][slot] = obs
        except Exception as err:
            return _obs_error(obs, obs_rows[0], err)
        return None

    def fill(free: list[int]) -> None:
        # Reset free slots with the next indices until each holds a live episode or work runs out.
        while free and pending:
            batch = []
            while free and pending:
                index, seed, retried = pending.popleft()
                slot = free.pop()
                ep_index[slot], ep_seed[slot], ep_retried[slot] = index, seed, retried
                ep_rng[slot] = None if deterministic else np.random.default_rng(seed)
                ep_started[slot] = time.perf_counter()
                ret[slot] = 0.0
                length[slot] = 0
                rmin[slot], rmax[slot], nmin[slot], nmax[slot] = np.inf, -np.inf, 0, 0
                live[slot] = True
                batch.append((slot, seed))
            for (slot, _), out in zip(batch, slots.reset_many(batch), strict=True):
                error = out.error if out.failure is not None else store_obs(slot, out.obs)
                if error is not None or out.failure is not None:
                    finish(slot, out.failure or EndReason.ENV_ERROR.value, error, {})
                    free.append(slot)

    def forward(rows: npt.NDArray[np.intp], obs: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        # One policy call under the watch: the watcher may give the shard up while it runs.
        rngs = None if deterministic else [ep_rng[s] for s in rows.tolist()]
        if bounds is not None:
            watch.bound = bounds[0]
            watch.rows = len(rows)
            watch.deadline = time.monotonic() + bounds[0]
        try:
            actions = act(obs, rngs)
        finally:
            if bounds is not None:
                with watch.lock:
                    if watch.abandoned:
                        raise _Abandoned
                    watch.deadline = None
                bounds[0] = bounds[1]
        if len(actions) != len(rows):
            raise ValueError(f"policy returned {len(actions)} actions for {len(rows)} rows")
        return actions

    def loop() -> None:
        fill(list(range(min(n, len(pending))))[::-1])
        everyone = np.arange(n)
        while live.any():
            all_live = bool(live.all())
            order = everyone if all_live else np.flatnonzero(live)  # ascending: the row order
            buf = obs_rows[0]
            batch_obs = buf if all_live else buf[order]
            freed: list[int] = []
            try:
                actions = forward(order, batch_obs)
            except _Abandoned:
                raise
            except Exception:
                # Find the rows that make it raise; the others keep their sub-batch's actions.
                ok, split_actions, errors = _split_forward(forward, order, batch_obs)
                for pos, text in sorted(errors.items()):
                    finish(int(order[pos]), EndReason.POLICY_ERROR.value, text, {})
                    freed.append(int(order[pos]))
                if split_actions is None:
                    fill(freed)
                    continue
                actions, order = split_actions, order[ok]
            if batch_obs is buf and np.may_share_memory(actions, buf):
                actions = np.array(actions)  # the buffer is rewritten while the actions are applied
            bad = _invalid_actions(space, actions)
            step_idx = order
            if bad.any():
                for k in np.flatnonzero(bad).tolist():
                    text = f"action {np.asarray(actions[k]).tolist()!r} not in {space}"
                    finish(int(order[k]), EndReason.INVALID_ACTION.value, text, {})
                    freed.append(int(order[k]))
                step_idx, actions = order[~bad], actions[~bad]
            if len(step_idx):
                if step_batch is not None:
                    rewards, ended = step_batch(step_idx, _batch_actions(space, actions), buf)
                else:
                    rewards, ended = _step_via_many(slots, step_idx, actions, space, buf)
                finite = np.isfinite(rewards)
                if not ended and finite.all():
                    if len(step_idx) == n:  # every slot stepped: whole-array updates
                        np.add(length, 1, out=length)  # the shard's arrays, updated in place
                        np.add(ret, rewards, out=ret)
                        track(None, rewards)
                    else:
                        length[step_idx] += 1
                        ret[step_idx] += rewards
                        track(step_idx, rewards)
                else:
                    counted = finite.copy()  # finite rewards of steps the episode goes on after
                    counted[list(ended)] = False
                    track(step_idx[counted], rewards[counted])
                    nonfinite = np.flatnonzero(~finite)
                    special = sorted(set(ended).union(nonfinite.tolist()))
                    regular = np.ones(len(step_idx), dtype=bool)
                    regular[special] = False
                    length[step_idx[regular]] += 1
                    ret[step_idx[regular]] += rewards[regular]
                    for pos in special:
                        s = int(step_idx[pos])
                        out = ended.get(pos)
                        if out is not None and out.failure is not None:
                            finish(s, out.failure, out.error, {})
                            freed.append(s)
                            continue
                        length[s] += 1
                        reward = float(rewards[pos])
                        if not is_finite(reward):
                            finish(s, EndReason.INVALID_REWARD.value,
                                   f"reward {reward!r} at step {int(length[s])}", {})
                            freed.append(s)
                            continue
                        ret[s] += reward
                        if out is not None:
                            reason = EndReason.TERMINATED if out.terminated else EndReason.TRUNCATED
                            finish(s, reason.value, None, out.info)
                            freed.append(s)
            if freed:
                fill(freed)

    if bounds is None:
        loop()
        return records

    def give_up() -> None:
        # The watcher's end of a hung forward: the shard thread is inside the policy for good.
        bound, rows = watch.bound, watch.rows
        for slot in np.flatnonzero(live).tolist():
            finish(slot, EndReason.POLICY_TIMEOUT.value,
                   f"policy forward did not return within {bound:g} s (a batch of {rows} rows, "
                   f"at step {int(length[slot])} of this episode); the shard's other episodes "
                   "were ended without another call into the policy", {})
        for index, seed, retried in pending:
            emit(EpisodeRecord(
                request_id=ctx.request_id, policy_sha256=ctx.policy_sha256, env_id=ctx.env_id,
                env_spec_hash=ctx.env_spec_hash, episode_index=index, seed=seed,
                episode_return=0.0, length=0, end_reason=EndReason.POLICY_TIMEOUT.value,
                error=f"not run: a policy forward in this shard did not return within {bound:g} s",
                success=None, wall_seconds=0.0, worker=ctx.worker, sandbox="not-started",
                isolation=slots.isolation, retried=retried, metrics={},
                nonfinal_reward_min=None, nonfinal_reward_max=None,
                nonfinal_steps_at_min=0, nonfinal_steps_at_max=0))
        pending.clear()
        logger.warning("policy forward hung for %g s on a batch of %d rows; shard of %s ended "
                       "as policy_timeout", bound, rows, ctx.worker)

    outcome: list[BaseException] = []
    done = threading.Event()

    def shard_thread() -> None:
        try:
            loop()
        except _Abandoned:
            return
        except BaseException as err:  # handed to the calling thread
            outcome.append(err)
        done.set()

    # The context travels along: Dask's get_worker() (progress events) reads a context variable.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(shard_thread,),
                              name=f"evalfleet-shard-{ctx.worker}", daemon=True)
    thread.start()
    wait_s = policy_timeout_s
    try:
        while not done.wait(wait_s):
            with watch.lock:
                now, deadline = time.monotonic(), watch.deadline
                if deadline is not None and now >= deadline:
                    watch.abandoned = True
                    break
            wait_s = policy_timeout_s if deadline is None else deadline - now
    except BaseException:  # Ctrl-C or SIGTERM while waiting: the thread stops at its next forward
        with watch.lock:
            watch.abandoned = True
        thread.join(timeout=1.0)
        raise
    if watch.abandoned:
        give_up()
        return records
    thread.join()
    if outcome:
        raise outcome[0]
    return records
