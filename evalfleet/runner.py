"""Stage 4's hot path: run a shard's episodes over a fixed number of env slots.

Each slot holds one env instance. A slot takes the next episode index of the shard, resets its env
with exactly that episode's ledger seed, and steps until the env terminates or truncates; the
episode's return is the float64 sum of the env's rewards. Every step, the observations of all
active slots go through ONE batched policy call. No vector-env autoreset is involved, so no reset
step can leak into a return or a length, and the set of episodes is fixed by index before running.
"""

from __future__ import annotations

import contextvars
import heapq
import logging
import math
import threading
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
from evalfleet.records import MAX_COUNTED_ACTIONS, EpisodeRecord
from evalfleet.redaction import Redactor
from evalfleet.sandbox.slots import (
    SUCCESS_KEYS,
    BatchEnvSlots,
    EnvSlots,
    SlotOutcome,
    error_text,
    is_finite,
    may_overflow,
    obs_shape_error,
    overflow_text,
)
from evalfleet.seeds import action_rng
from evalfleet.stats import MAX_ABS_VALUE

logger = logging.getLogger(__name__)

#: Default bound, in seconds, of one batched policy forward (``EvalRequest.policy_timeout_s``).
DEFAULT_POLICY_TIMEOUT_S = 30.0
#: The first forward of a shard may take this many times the bound: it pays one-off costs (CUDA
#: context and cuBLAS/cuDNN set-up, TorchScript's profiling runs, lazy modules, first page-ins).
FIRST_FORWARD_FACTOR = 4.0
#: Default fresh-sandbox retries of an episode a harness failure ended (``EvalRequest.retry_budget``).
DEFAULT_RETRY_BUDGET = 2


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
        a = _box_check_dtype(space, actions)
        if a.shape[1:] != space.shape:
            return np.ones(a.shape[0], dtype=bool)
        flat = a.reshape(a.shape[0], -1)
        low, high = _accepted_bounds(space)
        ok = np.isfinite(flat).all(axis=1) & (flat >= low).all(axis=1) & (flat <= high).all(axis=1)
        if np.issubdtype(space.dtype, np.integer):  # 2.7 in an integer Box is no action of it
            ok &= (flat == np.round(flat)).all(axis=1)
        return np.asarray(~ok, dtype=bool)
    return np.array([not space.contains(x) for x in actions], dtype=bool)


def _box_check_dtype(space: spaces.Box, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``actions`` in the dtype a Box's bounds are checked in: a float Box's own, else float64.

    A float32 or float16 Box's action is checked as the env gets it (``_in_bounds`` casts it):
    checked in float64 first, a callable's 0.7 lay above the Box(-0.7, 0.7) bound float32 stores
    (0.699999988) and ended its episode as ``invalid_action``, though the env got exactly its
    bound; and a finite 1e39 passed, to reach a float32 env as inf (blamed on the env).
    """
    if space.dtype.kind != "f" or space.dtype == np.float64:
        return np.asarray(actions, dtype=np.float64)
    a = np.asarray(actions)
    if a.dtype == space.dtype:  # a torch policy's float32 rows for a float32 Box: no copy
        return a
    with np.errstate(over="ignore"):  # past the dtype's range: inf, refused by the caller
        return a.astype(space.dtype)


def _accepted_bounds(space: spaces.Box) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """The bounds, flat, an action of ``space`` must lie within; a float64 Box's widened to float32.

    Inference runs in float32 (``policy.INFERENCE_DTYPE``): for a bound float32 cannot hold (0.1),
    the action nearest to it that a torch policy can output (0.10000000149) lies just outside,
    and a saturated action ended its episode as the policy's ``invalid_action``. Such an action is
    clipped to the exact bound before the env gets it (``_in_bounds``); one further out is invalid.
    """
    low = np.broadcast_to(space.low, space.shape).reshape(-1)
    high = np.broadcast_to(space.high, space.shape).reshape(-1)
    if space.dtype == np.float64:
        with np.errstate(over="ignore"):  # a bound beyond float32's range: none output reaches it
            low32, high32 = low.astype(np.float32), high.astype(np.float32)
        low = np.where(np.isfinite(low32), np.minimum(low, low32), low)
        high = np.where(np.isfinite(high32), np.maximum(high, high32), high)
    return low, high


def _in_bounds(space: spaces.Box, actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``actions`` as a new array of ``space``'s dtype; a float64 Box's clipped to its exact bounds.

    Always a copy the envs may write to. An env may change the action it is given in place
    (``np.clip(a, lo, hi, out=a)``), and a policy's output may be a view of its own weights with
    every row the same bytes (a constant policy's ``buffer.expand(B, 1)``, shared with numpy
    on CPU): handed over as is, one env's write changed the policy and the other rows' actions,
    so returns depended on the slot count. A sandbox gets a pickled copy; so does this process.
    """
    if space.dtype == np.float64:
        return np.clip(np.asarray(actions, dtype=np.float64), space.low, space.high)  # a new array
    return np.array(actions, dtype=space.dtype)


def _flag(value: float) -> bool | None:
    """An info success flag (a float from ``scalar_info``): NaN is no answer, not a success."""
    return None if value != value else bool(value)


def _to_env_action(space: spaces.Space[Any], action: Any) -> Any:
    if isinstance(space, spaces.Discrete):
        return int(action)
    if isinstance(space, spaces.Box):
        return _in_bounds(space, action)
    return action


def _batch_actions(space: spaces.Space[Any], actions: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Valid actions in the array form ``step_batch`` takes (see ``BatchEnvSlots``)."""
    if isinstance(space, spaces.Discrete):
        return np.asarray(actions).astype(np.int64)
    if isinstance(space, spaces.Box):
        return _in_bounds(space, actions)
    return np.array(actions)  # a copy, as ``_in_bounds``'s


def _step_via_many(
    slots: EnvSlots,
    step_slots: npt.NDArray[np.intp],
    actions: npt.NDArray[Any],
    space: spaces.Space[Any],
    obs_out: npt.NDArray[np.float32],
    lengths: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.float64], dict[int, SlotOutcome]]:
    """``step_batch``'s result computed through the protocol's ``step_many``.

    ``lengths``: each slot's steps so far (the error text of an observation of the wrong shape
    names its step).
    """
    slot_list = step_slots.tolist()
    outcomes = slots.step_many(slot_list, [_to_env_action(space, a) for a in actions])
    rewards = np.zeros(len(slot_list), dtype=np.float64)
    ended: dict[int, SlotOutcome] = {}
    row_shape = obs_out.shape[1:]
    for pos, (slot, out) in enumerate(zip(slot_list, outcomes, strict=True)):
        if out.failure is None:
            rewards[pos] = out.reward
            if not (out.terminated or out.truncated):
                try:
                    # Exactly the row's shape: assigned, a (1,) observation was broadcast into
                    # every element of the row (the sandbox sends the env's own shape).
                    shape = np.shape(out.obs)
                    if shape != row_shape:
                        ended[pos] = SlotOutcome(failure=EndReason.ENV_ERROR.value, error=obs_shape_error(
                            shape, row_shape, f"at step {int(lengths[slot]) + 1}"))
                        continue
                    obs_out[slot] = out.obs
                    if may_overflow(out.obs):
                        text = overflow_text(obs_out[slot], out.obs, f"at step {int(lengths[slot]) + 1}")
                        if text is not None:
                            ended[pos] = SlotOutcome(failure=EndReason.ENV_ERROR.value, error=text)
                except Exception as err:
                    ended[pos] = SlotOutcome(failure=EndReason.ENV_ERROR.value,
                                             error=_obs_error(out.obs, obs_out, err))
                continue
        ended[pos] = out
    return rewards, ended


def nan_text(row: npt.NDArray[np.float32], at: str) -> str | None:
    """Why an observation row with a NaN cannot be acted on (``at``: 'at reset', 'at step 3'), or None."""
    nan = np.isnan(row.ravel())
    if not nan.any():
        return None
    return (f"observation has NaN {at} (element(s) {np.flatnonzero(nan)[:8].tolist()} of "
            f"{nan.size}): the env produced no state to act on")


def return_text(value: float, steps: int) -> str:
    """Why a return of finite rewards is the env's ``invalid_reward`` (past ``MAX_ABS_VALUE``)."""
    return (f"return {float(value)!r} after step {int(steps)} exceeds {MAX_ABS_VALUE:g} in magnitude "
            "(each reward was finite; their sum cannot be aggregated): rescale the rewards")


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
    retry_budget: int = DEFAULT_RETRY_BUDGET,
    retry_backoff_s: float = 0.0,
    obs_shape: tuple[int, ...] | None = None,
) -> list[EpisodeRecord]:
    """Run ``episodes`` (``(index, seed)`` pairs) on ``slots``; one record per episode.

    A failure ends only its own episode: the slot's env is rebuilt and takes the next index.
    Infrastructure failures (timeout, crash, OOM of a sandbox) are retried with the same seed on
    a fresh sandbox, up to ``retry_budget`` times (none unless ``retry_infrastructure``), the
    k-th retry not before ``retry_backoff_s * 2**(k-1)`` seconds (other slots go on meanwhile);
    the row says how often (``retried``) and why the last failed attempt ended
    (``retry_reason``). Env errors are deterministic for a seed: never retried. A policy that raises ends
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

    ``obs_shape`` is the observation space's shape (None: the first reset's). An observation of
    any other shape, at a reset or a step, ends its episode as ``env_error`` (the step is not
    counted): it is never broadcast into the row the policy reads.
    """
    return ShardRun(episodes, slots, policy, ctx, retry_infrastructure=retry_infrastructure,
                    on_episode=on_episode, policy_timeout_s=policy_timeout_s,
                    retry_budget=retry_budget, retry_backoff_s=retry_backoff_s,
                    obs_shape=obs_shape).run()


class ShardRun:
    """One shard in progress: the episodes left, what each slot runs, and the rows so far.

    ``run_shard`` builds one and calls ``run``. The per-slot state is array-shaped (a row per
    slot, meaningful while ``live[slot]``); ``reset`` starts episodes on free slots, ``forward``
    is one policy call under the watch, ``act`` gets actions for the live rows (splitting a
    failing batch), ``step`` applies them and accounts rewards, ``finish`` ends one episode.
    """

    def __init__(
        self,
        episodes: list[tuple[int, int]],
        slots: EnvSlots,
        policy: LoadedPolicy,
        ctx: EpisodeContext,
        *,
        retry_infrastructure: bool,
        on_episode: Callable[[EpisodeRecord], None] | None,
        policy_timeout_s: float | None,
        retry_budget: int = DEFAULT_RETRY_BUDGET,
        retry_backoff_s: float = 0.0,
        obs_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.slots = slots
        self.ctx = ctx
        self.space = policy.action_space
        self.deterministic = policy.deterministic
        self._act = policy.act
        self.retry_infrastructure = retry_infrastructure
        self.on_episode = on_episode
        # inf is no bound (a wait of inf seconds overflows the platform's time_t).
        self.policy_timeout_s = (None if policy_timeout_s is not None and policy_timeout_s == math.inf
                                 else policy_timeout_s)
        self.retry_budget = retry_budget if retry_infrastructure else 0
        self.retry_backoff_s = retry_backoff_s
        # Per episode index: (retries so far, end reason of the last failed attempt).
        self.attempts: dict[int, tuple[int, str]] = {}
        # Retries waiting out their backoff: (due on the monotonic clock, index, seed).
        self.delayed: list[tuple[float, int, int]] = []
        n = self.n = slots.n
        # Slots per sandbox (slot s in sandbox s // group). Above 1, a sandbox's death ends its
        # neighbours' episodes too: retries then run alone in a sandbox (``_solo_first``), and
        # ``held`` maps a sandbox to its retry's slot, or to None while it drains for one.
        self.group = max(1, int(getattr(slots, "envs_per_sandbox", 1)))
        self.held: dict[int, int | None] = {}
        self._step_batch = slots.step_batch if isinstance(slots, BatchEnvSlots) else None
        self.pending: deque[tuple[int, int, bool]] = deque((i, s, False) for i, s in episodes)
        self.records: list[EpisodeRecord] = []
        self._scrub = Redactor()  # the worker's secrets, read once per shard
        # The episode each slot runs (meaningful while live[slot]).
        self.live = np.zeros(n, dtype=bool)
        self.ep_index = [0] * n
        self.ep_seed = [0] * n
        self.ep_started = [0.0] * n
        self.ep_retried = [False] * n
        self.ep_rng: list[np.random.Generator | None] = [None] * n
        self.ret = np.zeros(n, dtype=np.float64)
        self.length = np.zeros(n, dtype=np.int64)
        # Extremes of the rewards of non-final steps and how many steps sat exactly on them (the
        # clip-boundary audit; a final step's reward is often a terminal bonus of its own kind).
        self.rmin = np.full(n, np.inf)
        self.rmax = np.full(n, -np.inf)
        self.nmin = np.zeros(n, dtype=np.int64)
        self.nmax = np.zeros(n, dtype=np.int64)
        # (n, *obs_shape): from the observation space, else once the first reset tells the shape.
        self.obs: npt.NDArray[np.float32] | None = (
            None if obs_shape is None else np.zeros((n, *obs_shape), dtype=np.float32))
        # Per-slot action counts of a small Discrete space (the history's action-shift alarms).
        space = self.space
        self.acounts: npt.NDArray[np.int64] | None = None
        self._astart = 0
        if isinstance(space, spaces.Discrete) and int(space.n) <= MAX_COUNTED_ACTIONS:
            self.acounts = np.zeros((n, int(space.n)), dtype=np.int64)
            self._astart = int(space.start)
        self.watch = _ForwardWatch()
        # The bound of the next forward (the first one's is larger), and of every later one.
        bound = self.policy_timeout_s
        self._bound: float | None = None if bound is None else bound * FIRST_FORWARD_FACTOR
        self._later_bound = bound

    # -- the shard as a whole ------------------------------------------------------------------

    def run(self) -> list[EpisodeRecord]:
        """Run every episode; with a policy bound, in a thread watched from this one."""
        if self.policy_timeout_s is None:
            self.run_episodes()
            return self.records
        watch, timeout_s = self.watch, self.policy_timeout_s
        outcome: list[BaseException] = []
        done = threading.Event()

        def shard_thread() -> None:
            try:
                self.run_episodes()
            except _Abandoned:
                return
            except BaseException as err:  # handed to the calling thread
                outcome.append(err)
            done.set()

        # The context travels along: Dask's get_worker() (progress events) reads a context variable.
        thread = threading.Thread(target=contextvars.copy_context().run, args=(shard_thread,),
                                  name=f"evalfleet-shard-{self.ctx.worker}", daemon=True)
        thread.start()
        wait_s = timeout_s
        try:
            while not done.wait(wait_s):
                with watch.lock:
                    now, deadline = time.monotonic(), watch.deadline
                    if deadline is not None and now >= deadline:
                        watch.abandoned = True
                        break
                wait_s = timeout_s if deadline is None else deadline - now
        except BaseException:  # Ctrl-C or SIGTERM while waiting: the thread stops at its next forward
            with watch.lock:
                watch.abandoned = True
            thread.join(timeout=1.0)
            raise
        if watch.abandoned:
            self.give_up()
            return self.records
        thread.join()
        if outcome:
            raise outcome[0]
        return self.records

    def run_episodes(self) -> None:
        """Step every live slot until no episode is left: forward, step, refill freed slots."""
        live = self.live
        self.reset(list(range(min(self.n, len(self.pending))))[::-1])
        everyone = np.arange(self.n)
        while live.any() or self.await_retries():
            all_live = bool(live.all())
            order = everyone if all_live else np.flatnonzero(live)  # ascending: the row order
            buf = self.obs
            if buf is None:  # every live slot stored an observation, so this never happens
                raise RuntimeError("live slots without an observation buffer")
            freed: list[int] = []
            got = self.act(order, buf if all_live else buf[order], freed)
            if got is not None:
                self.step(*got, buf, freed)
            if freed:
                self.reset(freed)

    def give_up(self) -> None:
        """The watcher's end of a hung forward: the shard thread is inside the policy for good."""
        ctx, bound, rows = self.ctx, self.watch.bound, self.watch.rows
        self.release_retries(all_of_them=True)
        for slot in np.flatnonzero(self.live).tolist():
            self.finish(slot, EndReason.POLICY_TIMEOUT.value,
                        f"policy forward did not return within {bound:g} s (a batch of {rows} "
                        f"rows, at step {int(self.length[slot])} of this episode); the shard's "
                        "other episodes were ended without another call into the policy", {})
        for index, seed, _ in self.pending:
            self._emit(EpisodeRecord(
                request_id=ctx.request_id, policy_sha256=ctx.policy_sha256, env_id=ctx.env_id,
                env_spec_hash=ctx.env_spec_hash, episode_index=index, seed=seed,
                # Never played: no return to score (NaN leaves it out, and coverage drops).
                episode_return=float("nan"), length=0, end_reason=EndReason.POLICY_TIMEOUT.value,
                error=f"not run: a policy forward in this shard did not return within {bound:g} s",
                success=None, wall_seconds=0.0, worker=ctx.worker, sandbox="not-started",
                isolation=self.slots.isolation, retried=self.attempts.get(index, (0, None))[0],
                metrics={}, nonfinal_reward_min=None, nonfinal_reward_max=None,
                nonfinal_steps_at_min=0, nonfinal_steps_at_max=0,
                retry_reason=self.attempts.get(index, (0, None))[1]))
        self.pending.clear()
        logger.warning("policy forward hung for %g s on a batch of %d rows; shard of %s ended "
                       "as policy_timeout", bound, rows, ctx.worker)

    # -- one episode's start and end -------------------------------------------------------------

    def reset(self, free: list[int]) -> None:
        """Reset free slots with the next indices until each holds a live episode or work runs out."""
        pending = self.pending
        self.release_retries()
        waiting: list[tuple[int, int, bool]] = []
        if self.group > 1:
            free, waiting = self._solo_first()
        while free and pending:
            batch = []
            while free and pending:
                index, seed, retried = pending.popleft()
                slot = free.pop()
                self._begin(slot, index, seed, retried)
                batch.append((slot, seed))
            free.extend(self._reset_batch(batch))
        if waiting:
            pending.extendleft(reversed(waiting))

    def _begin(self, slot: int, index: int, seed: int, retried: bool) -> None:
        """Make ``slot`` hold episode ``index`` from its start (its env is reset next)."""
        self.ep_index[slot], self.ep_seed[slot], self.ep_retried[slot] = index, seed, retried
        self.ep_rng[slot] = None if self.deterministic else action_rng(seed)
        self.ep_started[slot] = time.perf_counter()
        self.ret[slot] = 0.0
        self.length[slot] = 0
        self.rmin[slot], self.rmax[slot], self.nmin[slot], self.nmax[slot] = (np.inf, -np.inf, 0, 0)
        if self.acounts is not None:
            self.acounts[slot] = 0
        self.live[slot] = True

    def _reset_batch(self, batch: list[tuple[int, int]]) -> list[int]:
        """Reset the ``(slot, seed)`` of ``batch``; the slots whose reset ended their episode."""
        failed = []
        for (slot, _), out in zip(batch, self.slots.reset_many(batch), strict=True):
            error = out.error if out.failure is not None else self._store_obs(slot, out.obs)
            if error is not None or out.failure is not None:
                self.finish(slot, out.failure or EndReason.ENV_ERROR.value, error, {})
                failed.append(slot)
        return failed

    def _solo_first(self) -> tuple[list[int], list[tuple[int, int, bool]]]:
        """Start the queued retries each alone in a sandbox; the free slots left, the retries left.

        A retry shares no sandbox: the crash that ended it may have been a neighbour's, and a
        crasher's retry among others ended them too (each retry of an env that crashes its
        sandbox took its co-hosted retries down with it, so healthy episodes ran out of
        retries). A retry that finds no empty sandbox waits, and the sandbox with the fewest
        episodes under way takes no new one until it is empty.
        """
        g, live, held, pending = self.group, self.live, self.held, self.pending
        for b in [b for b, s in held.items() if s is None]:
            del held[b]  # drains are chosen again below, for the retries still waiting
        n_boxes = -(-self.n // g)
        empty = [b for b in range(n_boxes - 1, -1, -1)
                 if b not in held and not live[b * g:(b + 1) * g].any()]
        batch: list[tuple[int, int]] = []
        waiting: list[tuple[int, int, bool]] = []
        while pending and pending[0][2]:
            index, seed, retried = pending.popleft()
            if not empty:
                waiting.append((index, seed, retried))
                continue
            slot = empty.pop() * g
            held[slot // g] = slot
            self._begin(slot, index, seed, retried)
            batch.append((slot, seed))
        self._reset_batch(batch)
        for _ in waiting:
            open_boxes = [b for b in range(n_boxes) if b not in held]
            if not open_boxes:
                break
            held[min(open_boxes, key=lambda b: int(live[b * g:(b + 1) * g].sum()))] = None
        free = [s for s in range(self.n - 1, -1, -1) if not live[s] and s // g not in held]
        return free, waiting

    def finish(self, slot: int, reason: str, error: str | None, info: dict[str, float]) -> None:
        """End ``slot``'s episode: requeue it (an infrastructure failure, once) or emit its row."""
        self.live[slot] = False
        if self.held and self.held.get(slot // self.group) == slot:
            del self.held[slot // self.group]  # a retry's sandbox takes other episodes again
        if self.schedule_retry(slot, reason):
            return
        retried, retry_reason = self.attempts.get(self.ep_index[slot], (0, None))
        ctx, scrub = self.ctx, self._scrub
        nmin, nmax = self.nmin[slot], self.nmax[slot]
        success = next((_flag(info[k]) for k in SUCCESS_KEYS if k in info), None)
        self._emit(EpisodeRecord(
            request_id=ctx.request_id,
            policy_sha256=ctx.policy_sha256,
            env_id=ctx.env_id,
            env_spec_hash=ctx.env_spec_hash,
            episode_index=self.ep_index[slot],
            seed=self.ep_seed[slot],
            episode_return=float(self.ret[slot]),
            length=int(self.length[slot]),
            end_reason=reason,
            error=scrub.optional(error),  # secrets never leave the worker in a row
            success=success,
            wall_seconds=time.perf_counter() - self.ep_started[slot],
            worker=ctx.worker,
            sandbox=self.slots.sandbox_name(slot),
            isolation=self.slots.isolation,
            retried=retried,
            metrics=scrub.keys({k: v for k, v in info.items() if k not in SUCCESS_KEYS}),
            nonfinal_reward_min=float(self.rmin[slot]) if nmin else None,
            nonfinal_reward_max=float(self.rmax[slot]) if nmax else None,
            nonfinal_steps_at_min=int(nmin),
            nonfinal_steps_at_max=int(nmax),
            action_counts=self.acounts[slot].tolist() if self.acounts is not None else None,
            retry_reason=retry_reason,
        ))

    # -- infrastructure retries ------------------------------------------------------------------

    def schedule_retry(self, slot: int, reason: str) -> bool:
        """Queue ``slot``'s episode again after a harness failure, within the budget; True if queued.

        The slot's sandbox was replaced when it failed, so the retry runs on a fresh one, with
        the same seed, after a backoff that doubles per attempt. With several envs per sandbox,
        an episode's first attempt shared its sandbox, whose death may be a neighbour's doing:
        that failure is not charged to the budget (its retries run alone, and are).
        """
        if not EndReason(reason).is_infrastructural or not self.retry_budget:
            return False
        index = self.ep_index[slot]
        count = self.attempts.get(index, (0, ""))[0]
        free = 1 if self.group > 1 else 0
        if count >= self.retry_budget + free:
            return False
        self.attempts[index] = (count + 1, reason)
        due = time.monotonic() + self.retry_backoff_s * 2 ** max(0, count - free)
        heapq.heappush(self.delayed, (due, index, self.ep_seed[slot]))
        return True

    def release_retries(self, all_of_them: bool = False) -> None:
        """Move retries whose backoff is over (or all of them) to the front of the queue."""
        now = time.monotonic()
        while self.delayed and (all_of_them or self.delayed[0][0] <= now):
            _, index, seed = heapq.heappop(self.delayed)
            self.pending.appendleft((index, seed, True))

    def await_retries(self) -> bool:
        """With no episode live, wait out the next retry's backoff and start it; True if one runs."""
        while self.delayed and not self.live.any():
            wait = self.delayed[0][0] - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.reset(list(range(self.n))[::-1])
        return bool(self.live.any())

    def _emit(self, record: EpisodeRecord) -> None:
        self.records.append(record)
        if self.on_episode is not None:
            self.on_episode(record)

    def _store_obs(self, slot: int, obs: Any) -> str | None:
        """Write ``slot``'s reset observation into the buffer; the error text if it cannot be acted on."""
        if self.obs is None:
            first = np.asarray(obs, dtype=np.float32)
            self.obs = np.zeros((self.n, *first.shape), dtype=np.float32)
        try:
            shape = np.shape(obs)
            if shape != self.obs.shape[1:]:  # never broadcast (see ``_step_via_many``)
                return obs_shape_error(shape, self.obs.shape[1:], "at reset")
            self.obs[slot] = obs
        except Exception as err:
            return _obs_error(obs, self.obs, err)
        row = self.obs[slot]
        nan = nan_text(row, "at reset")
        return overflow_text(row, obs, "at reset") if nan is None and may_overflow(obs) else nan

    # -- one step of every live slot -------------------------------------------------------------

    def forward(self, rows: npt.NDArray[np.intp], obs: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """One policy call under the watch: the watcher may give the shard up while it runs."""
        rngs = None if self.deterministic else [self.ep_rng[s] for s in rows.tolist()]
        bound, watch = self._bound, self.watch
        if bound is not None:
            watch.bound = bound
            watch.rows = len(rows)
            watch.deadline = time.monotonic() + bound
        try:
            actions = self._act(obs, rngs)
        finally:
            if bound is not None:
                with watch.lock:
                    if watch.abandoned:
                        raise _Abandoned
                    watch.deadline = None
                self._bound = self._later_bound
        if len(actions) != len(rows):
            raise ValueError(f"policy returned {len(actions)} actions for {len(rows)} rows")
        return actions

    def _shaped_forward(self, rows: npt.NDArray[np.intp], obs: npt.NDArray[np.float32]
                        ) -> npt.NDArray[Any]:
        """``forward``, raising when the actions' rows are not of the action space's shape."""
        actions = self.forward(rows, obs)
        want = self.space.shape
        if want is not None and np.shape(actions)[1:] != want:
            raise ValueError(f"policy returned actions of shape {np.shape(actions)} for {len(rows)} "
                             f"row(s); {self.space} takes one action of shape {want} per row")
        return actions

    def act(self, order: npt.NDArray[np.intp], batch_obs: npt.NDArray[np.float32],
            freed: list[int]) -> tuple[npt.NDArray[np.intp], npt.NDArray[Any]] | None:
        """Actions of the rows ``order``: one forward, or on its failure the bisection.

        Rows whose single-row forward raises end as ``policy_error`` (their slots go to
        ``freed``); returned are the rows that got an action and their actions, None if none did.
        """
        try:
            actions = self.forward(order, batch_obs)
        except _Abandoned:
            raise
        except Exception:
            # Find the rows that make it raise; the others keep their sub-batch's actions, which
            # must have one shape to be joined: a row whose action is of another shape is a row
            # the policy failed (joined unchecked, it failed the whole evaluation).
            ok, split_actions, errors = _split_forward(self._shaped_forward, order, batch_obs)
            for pos, text in sorted(errors.items()):
                self.finish(int(order[pos]), EndReason.POLICY_ERROR.value, text, {})
                freed.append(int(order[pos]))
            if split_actions is None:
                return None
            actions, order = split_actions, order[ok]
        if batch_obs is self.obs and np.may_share_memory(actions, batch_obs):
            actions = np.array(actions)  # the buffer is rewritten while the actions are applied
        return order, actions

    def step(self, order: npt.NDArray[np.intp], actions: npt.NDArray[Any],
             buf: npt.NDArray[np.float32], freed: list[int]) -> None:
        """Apply ``actions`` to the slots ``order``: invalid ones end, the rest step the envs.

        Observations land in ``buf``; returns, lengths and the reward audit are updated, and
        every episode that ended (terminated, truncated, failed, non-finite reward) is finished.
        """
        space, length, ret = self.space, self.length, self.ret
        bad = _invalid_actions(space, actions)
        step_idx = order
        if bad.any():
            for k in np.flatnonzero(bad).tolist():
                text = f"action {np.asarray(actions[k]).tolist()!r} not in {space}"
                self.finish(int(order[k]), EndReason.INVALID_ACTION.value, text, {})
                freed.append(int(order[k]))
            step_idx, actions = order[~bad], actions[~bad]
        if not len(step_idx):
            return
        if self.acounts is not None:  # each slot steps at most once per call: no repeated pairs
            self.acounts[step_idx, np.asarray(actions).astype(np.int64) - self._astart] += 1
        if self._step_batch is not None:
            rewards, ended = self._step_batch(step_idx, _batch_actions(space, actions), buf)
        else:
            rewards, ended = _step_via_many(self.slots, step_idx, actions, space, buf, length)
        finite = np.isfinite(rewards)
        if not ended and finite.all():
            if len(step_idx) == self.n:  # every slot stepped: whole-array updates
                np.add(length, 1, out=length)  # the shard's arrays, updated in place
                np.add(ret, rewards, out=ret)
                self._track(None, rewards)
            else:
                length[step_idx] += 1
                ret[step_idx] += rewards
                self._track(step_idx, rewards)
            self._returns_out_of_range(step_idx, freed)
            self._nan_observations(step_idx, buf, freed)
            return
        counted = finite.copy()  # finite rewards of steps the episode goes on after
        counted[list(ended)] = False
        self._track(step_idx[counted], rewards[counted])
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
                self.finish(s, out.failure, out.error, {})
                freed.append(s)
                continue
            length[s] += 1
            reward = float(rewards[pos])
            if not is_finite(reward):
                self.finish(s, EndReason.INVALID_REWARD.value,
                            f"reward {reward!r} at step {int(length[s])}", {})
                freed.append(s)
                continue
            ret[s] += reward
            if out is not None:
                if abs(ret[s]) > MAX_ABS_VALUE:
                    self.finish(s, EndReason.INVALID_REWARD.value, return_text(ret[s], length[s]), {})
                else:
                    reason = EndReason.TERMINATED if out.terminated else EndReason.TRUNCATED
                    self.finish(s, reason.value, None, out.info)
                freed.append(s)
        self._returns_out_of_range(step_idx[self.live[step_idx]], freed)
        self._nan_observations(step_idx[self.live[step_idx]], buf, freed)

    def _returns_out_of_range(self, rows: npt.NDArray[np.intp], freed: list[int]) -> None:
        """End as ``invalid_reward`` the episodes of ``rows`` whose return left the statistics' range.

        Each reward was finite, but a return above ``MAX_ABS_VALUE`` in magnitude (or a sum that
        overflowed to inf) cannot be aggregated: it stopped the whole evaluation at stage 6, after
        every episode had run, with nothing written. It is the env's failure, one row.
        """
        ret = self.ret
        if not len(rows) or (ret.max() <= MAX_ABS_VALUE and ret.min() >= -MAX_ABS_VALUE):
            return
        for s in rows[np.abs(ret[rows]) > MAX_ABS_VALUE].tolist():
            self.finish(s, EndReason.INVALID_REWARD.value, return_text(ret[s], self.length[s]), {})
            freed.append(s)

    def _nan_observations(self, rows: npt.NDArray[np.intp], buf: npt.NDArray[np.float32],
                          freed: list[int]) -> None:
        """End as ``env_error`` the episodes of ``rows`` whose new observation in ``buf`` has a NaN.

        A NaN observation is the env's fault, never a state a policy can act on: fed on, a torch
        policy's logits turned NaN and the episode ended as the *policy's* error, and a callable's
        action was whatever its arithmetic made of it, with no alarm.
        """
        if not len(rows) or not np.isnan(buf).any():  # one pass, no copy; rows only when one is there
            return
        flat = buf[rows].reshape(len(rows), -1)
        for pos in np.flatnonzero(np.isnan(flat).any(axis=1)).tolist():
            s = int(rows[pos])
            self.finish(s, EndReason.ENV_ERROR.value,
                        nan_text(flat[pos], f"at step {int(self.length[s])}"), {})
            freed.append(s)

    def _track(self, idx: npt.NDArray[np.intp] | None, rewards: npt.NDArray[np.float64]) -> None:
        """Fold finite rewards of the slots ``idx`` into the audit (None: every slot, whole arrays)."""
        rmin, rmax, nmin, nmax = self.rmin, self.rmax, self.nmin, self.nmax
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
