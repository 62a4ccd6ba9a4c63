"""Replaying chosen episodes: per-step trajectories, videos and a determinism check.

An episode is fully identified by its seed: the runner resets a fresh env with exactly that seed
and the policy is a function of the observation (plus, when sampling, a generator seeded with the
same seed). Replaying it here therefore reproduces the evaluated episode step for step, so the
trajectory table and the video show the episode that was scored, not a lookalike. Replays compare
their return and length with the recorded ones; a difference is a non-determinism signal (an env
that leaks state across resets, a policy that depends on batch composition) and is reported in
the result rather than raised.

Replays run in the calling process, one env at a time, stepping the env directly. They are meant
for a handful of episodes (``--record-trajectories K``, ``--record-video K``), not for scoring.
Frames are written by ``evalfleet.video`` (MP4/GIF writer, frame rendering, encoder probe).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import pyarrow as pa
from gymnasium import spaces

from evalfleet.envspec import make_env
from evalfleet.framing import RenderFailed, framed_thunk, offscreen, unpack
from evalfleet.models import EndReason
from evalfleet.policy import LoadedPolicy

# The runner's own action checks, so a replay fails exactly where the evaluated episode failed.
from evalfleet.runner import _invalid_actions, _to_env_action, nan_text, return_text
from evalfleet.sandbox.base import EnvSlots, SlotOutcome, error_text, open_slots, scalar_info
from evalfleet.sandbox.limits import SandboxLimits
from evalfleet.sandbox.slots import obs_shape_error, overflow_text
from evalfleet.seeds import action_rng
from evalfleet.stats import MAX_ABS_VALUE

# The video writer lived here: its names stay importable from this module (``X as X`` re-exports).
from evalfleet.video import DEFAULT_FPS as DEFAULT_FPS
from evalfleet.video import HOLD_LAST_S as HOLD_LAST_S
from evalfleet.video import MAX_GIF_FPS as MAX_GIF_FPS
from evalfleet.video import MAX_GIF_FRAMES as MAX_GIF_FRAMES
from evalfleet.video import RenderError, VideoSink, mp4_available, render_frame
from evalfleet.video import probe_encoder as probe_encoder

__all__ = [
    "ReplayResult",
    "ReplaySandbox",
    "ReplayedEpisode",
    "action_summary",
    "probe_encoder",
    "probe_rendering",
    "record_episodes",
    "replay_inputs",
    "trajectory_schema",
]

logger = logging.getLogger(__name__)

#: Recorded end reasons whose episodes are not replayed in-process: the sandbox that ran them
#: hung, crashed or ran out of memory, and so could the calling process.
UNSAFE_TO_REPLAY = frozenset(
    {EndReason.TIMEOUT.value, EndReason.CRASHED.value, EndReason.OOM.value}
)


def trajectory_schema(action_space: spaces.Space[Any]) -> pa.Schema:
    """The Arrow schema of a trajectory table for ``action_space``.

    One row per step ``t`` of a replayed episode: ``obs`` is the observation the action was
    chosen from (flattened, float64 so float64 envs lose nothing), ``action`` the action taken
    (int64 for Discrete, flattened float64 list for Box), then the step's ``reward`` (raw, so a
    non-finite reward that ended the episode shows as such), ``terminated``, ``truncated`` and
    the scalar entries of the step's ``info``. Summing ``reward`` over an episode's rows gives
    its return (for episodes that ended normally).
    """
    action = pa.int64() if isinstance(action_space, spaces.Discrete) else pa.list_(pa.float64())
    return pa.schema(
        [
            pa.field("episode_index", pa.int64(), nullable=False),
            pa.field("seed", pa.uint64(), nullable=False),
            pa.field("step", pa.int64(), nullable=False),
            pa.field("obs", pa.list_(pa.float64()), nullable=False),
            pa.field("action", action, nullable=False),
            pa.field("reward", pa.float64(), nullable=False),
            pa.field("terminated", pa.bool_(), nullable=False),
            pa.field("truncated", pa.bool_(), nullable=False),
            pa.field("info", pa.map_(pa.string(), pa.float64())),
        ],
        metadata={"evalfleet.trajectory_schema_version": "1", "evalfleet.action_space": str(action_space)},
    )


@dataclass(frozen=True)
class ReplayedEpisode:
    """One replayed episode and how it compares with the evaluated one."""

    episode_index: int
    """Index of the episode in the evaluation."""
    seed: int
    """Its ledger seed (the reset seed)."""
    episode_return: float
    """float64 sum of the rewards of the replay (up to a failure)."""
    length: int
    """Steps taken, counted the way the runner counts them."""
    end_reason: str
    """How the replay ended (an ``EndReason`` value)."""
    error: str | None
    """Error text of a failed replay."""
    expected: tuple[float, int] | None
    """Recorded ``(return, length)``, when given."""
    matches: bool | None
    """True when return, length (and end reason, when given) equal the recorded ones; None when
    nothing was recorded to compare with."""
    video: Path | None = None
    """The episode's video, if one was written."""


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`record_episodes` produced."""

    trajectories: pa.Table
    """One row per step of every replayed episode (``trajectory_schema``); empty when
    trajectories were not asked for."""
    videos: dict[int, Path]
    """Episode index → MP4 or GIF file."""
    episodes: tuple[ReplayedEpisode, ...]
    """Every replayed episode, in the order asked."""
    actions: dict[str, Any]
    """Action distribution over every replayed step (``action_summary``'s format)."""
    mismatches: tuple[str, ...] = ()
    """One line per episode whose replay differs from the recorded outcome (non-determinism)."""
    interrupted: dict[int, str] = field(default_factory=dict)
    """Episodes whose replay a clock or the infrastructure ended (``CLOCKED``: its sandbox
    crashed, ran out of memory or time) where the recorded one did not end so, with why: not
    compared, no video, no trajectory rows (the recording is incomplete, not a finding)."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Episodes not replayed at all, with why."""
    video_skipped: dict[int, str] = field(default_factory=dict)
    """Episodes replayed without a video, with why (env cannot render, writer failed, ...)."""
    trajectory_episodes: tuple[int, ...] = ()
    """Episodes replayed for their trajectory, a 0-step one (a failure at its first step) too:
    it has no rows and is no shortfall."""

    @property
    def reproducible(self) -> bool:
        """True when every compared replay matched its recorded outcome."""
        return not self.mismatches

    def notes(self) -> list[str]:
        """Human-readable findings for the report page (mismatches first)."""
        out = [f"replay mismatch (non-determinism): {m}" for m in self.mismatches]
        reasons = sorted(set(self.video_skipped.values()))
        out += [f"videos skipped: {r}" for r in reasons]
        out += [f"episode {i} not replayed: {r}" for i, r in sorted(self.skipped.items())]
        out += [f"episode {i} not replayed whole: {r}" for i, r in sorted(self.interrupted.items())]
        return out


def replay_inputs(
    table: pa.Table, indices: Sequence[int]
) -> tuple[list[tuple[int, int]], dict[int, tuple[float, int]], dict[int, str]]:
    """``(episodes, expected, end_reasons)`` for :func:`record_episodes` from the episode table.

    Keeps the order of ``indices``; raises ``KeyError`` naming an index not in the table.
    """
    rows = {
        int(r["episode_index"]): r
        for r in table.select(["episode_index", "seed", "return", "length", "end_reason"]).to_pylist()
    }
    missing = [i for i in indices if i not in rows]
    if missing:
        raise KeyError(f"episode indices {missing!r} are not in the episode table")
    episodes = [(int(i), int(rows[i]["seed"])) for i in indices]
    expected = {int(i): (float(rows[i]["return"]), int(rows[i]["length"])) for i in indices}
    reasons = {int(i): str(rows[i]["end_reason"]) for i in indices}
    return episodes, expected, reasons


def action_summary(
    trajectories: pa.Table,
    action_space: spaces.Space[Any],
    *,
    note: str | None = None,
) -> dict[str, Any]:
    """The action distribution of a trajectory table, in the format ``render_plots`` takes.

    Discrete: ``{"kind": "Discrete", "counts": [n per action], "start": ...}``; Box:
    ``{"kind": "Box", "samples": array (steps, dims), "low": ..., "high": ...}``; both with
    ``steps`` and ``episodes``. The episode table has no per-step actions, hence replays.
    Replayed episodes over-represent the extremes and failures (see ``choose_episodes``); pass a
    ``note`` to say so on the plot.
    """
    column = trajectories.column("action")
    episodes = len(set(trajectories.column("episode_index").to_pylist())) if trajectories.num_rows else 0
    if isinstance(action_space, spaces.Discrete):
        values = np.asarray(column.to_numpy(), dtype=np.int64) - int(action_space.start)
        counts = np.bincount(values[(values >= 0) & (values < int(action_space.n))],
                             minlength=int(action_space.n))
        return _summary_discrete(counts, int(action_space.start), episodes, note)
    if isinstance(action_space, spaces.Box):
        dims = int(np.prod(action_space.shape)) if action_space.shape else 1
        flat = column.combine_chunks().flatten() if trajectories.num_rows else pa.array([], pa.float64())
        samples = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(-1, dims)
        return _summary_box(samples, action_space, episodes, note)
    raise TypeError(
        f"action_summary supports Discrete and Box action spaces (got {action_space}); "
        "summarise other spaces yourself."
    )


def _summary_discrete(
    counts: npt.NDArray[np.int64], start: int, episodes: int, note: str | None
) -> dict[str, Any]:
    return {"kind": "Discrete", "counts": [int(c) for c in counts], "start": start,
            "steps": int(counts.sum()), "episodes": episodes, "note": note}


def _summary_box(
    samples: npt.NDArray[np.float64], space: spaces.Box, episodes: int, note: str | None
) -> dict[str, Any]:
    return {"kind": "Box", "samples": samples, "low": space.low.reshape(-1).astype(np.float64),
            "high": space.high.reshape(-1).astype(np.float64), "steps": int(samples.shape[0]),
            "episodes": episodes, "note": note}


# ---------------------------------------------------------------------------------------------
# Replaying


@dataclass
class _Episode:
    index: int
    seed: int
    ret: float = 0.0
    length: int = 0
    reason: str = EndReason.TRUNCATED.value
    error: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    actions: list[Any] = field(default_factory=list)


def _flat(x: Any) -> list[float]:
    return [float(v) for v in np.asarray(x, dtype=np.float64).reshape(-1)]


def _open_env(
    env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None, render: bool
) -> gym.Env[Any, Any]:
    if not render:
        return make_env(env_id, dict(env_kwargs), max_steps, render_mode=None)
    with offscreen():  # pygame (the classic-control renderer) draws off-screen; there is no display
        return make_env(env_id, dict(env_kwargs), max_steps, render_mode="rgb_array")



def _probe_rendering(
    env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None, seed: int
) -> str | None:
    """None when the env renders rgb_array frames, else why not."""
    try:
        plain = _open_env(env_id, env_kwargs, max_steps, render=False)
        modes = list(plain.metadata.get("render_modes") or [])
        _close(plain)
    except Exception as err:
        return f"{env_id} cannot be made ({error_text(err)})"
    if "rgb_array" not in modes:
        return f"{env_id} does not declare the 'rgb_array' render mode (its render_modes: {modes})"
    try:
        env = _open_env(env_id, env_kwargs, max_steps, render=True)
    except Exception as err:
        return f"{env_id} cannot be made with render_mode='rgb_array' ({error_text(err)})"
    try:
        env.reset(seed=seed)
        render_frame(env)
    except RenderError as err:
        return f"{env_id} could not render an rgb_array frame ({err})"
    except Exception as err:
        return f"{env_id} could not be reset for a render check ({error_text(err)})"
    finally:
        _close(env)
    return None


@dataclass(frozen=True)
class ReplaySandbox:
    """Replay inside sandboxes of this level, as the evaluated episodes ran (process, bwrap)."""

    level: str
    """'process' or 'bwrap'."""
    episode_timeout_s: float
    """The evaluation's episode budget (rendering adds to a step's time, not to the budget's)."""
    env_spec: dict[str, Any]
    """The env's fingerprint (what the fork server preloads)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """The evaluation's sandbox limits."""
    obs_shape: tuple[int, ...] | None = None
    """The observation space's shape (observations cross the sandbox flat)."""
    fps: float | None = None
    """The env's ``render_fps``, as its sandbox described it (videos' frame rate)."""
    env_allow: tuple[str, ...] = ()
    """The variables the evaluation grants its sandboxes (``--sandbox-env``): replays see them too."""

    def open(self, env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None,
             render: bool) -> EnvSlots:
        """One slot whose env packs observation and frame (``evalfleet.framing``)."""
        make = functools.partial(make_env, env_id, dict(env_kwargs), max_steps)
        return open_slots(self.level, framed_thunk(make, render), 1,
                          episode_timeout_s=self.episode_timeout_s, env_spec=self.env_spec,
                          limits=self.limits, env_allow=self.env_allow)


def _framed(out: SlotOutcome, shape: tuple[int, ...] | None
            ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.uint8] | None]:
    try:
        return unpack(out.obs, shape)
    except ValueError as err:
        raise RenderError(f"the sandbox sent a malformed frame ({err})") from err


def _slot_failure(ep: _Episode, out: SlotOutcome) -> bool:
    """True (and ``ep`` ended) when the sandbox reported a failure; render failures raise."""
    if out.failure is None:
        return False
    if out.error and out.error.startswith(RenderFailed.__name__):
        raise RenderError(out.error)
    ep.reason, ep.error = out.failure, out.error
    return True


#: What one replayed step of an env gives: next observation, reward, terminated, truncated, the
#: ``info`` items to record, and a rendered frame (None when no video is recorded).
_Step = tuple[Any, float, bool, bool, list[tuple[str, Any]], "npt.NDArray[np.uint8] | None"]


def _replay_loop(
    ep: _Episode, policy: LoadedPolicy, keep_rows: bool, sink: VideoSink | None,
    reset: Callable[[], tuple[Any, npt.NDArray[np.uint8] | None] | None],
    step: Callable[[Any], _Step | None],
    render: Callable[[], npt.NDArray[np.uint8]] | None = None,
    shape: tuple[int, ...] | None = None,
) -> None:
    """Run one episode the way ``run_shard`` does, recording steps and frames.

    ``reset``/``step`` drive the env where it lives (in this process, or in a sandbox); they end
    ``ep`` and return None on an env failure. A step's frame comes with it (a sandbox packs it) or,
    with ``render``, is rendered once the step is counted. The policy sees the observation as the runner's
    float32 buffer row holds it, and every failure ends the episode at the same step with the same
    return and length as in the runner. ``shape``: the observation space's (None: the reset's);
    an observation of another shape is an ``env_error``, as in the runner.
    """
    space = policy.action_space
    discrete = isinstance(space, spaces.Discrete)
    rng = None if policy.deterministic else action_rng(ep.seed)
    first = reset()
    if first is None:
        return
    obs, frame = first
    try:
        got = np.shape(obs)
        if shape is not None and got != shape:
            ep.reason, ep.error = EndReason.ENV_ERROR.value, obs_shape_error(got, shape, "at reset")
            return
        row = np.zeros(np.asarray(obs, dtype=np.float32).shape, dtype=np.float32)
        row[...] = obs
    except Exception as err:
        ep.reason, ep.error = EndReason.ENV_ERROR.value, error_text(err)
        return
    # The runner's checks, at the same steps: replayed on, a NaN observation or a return past
    # MAX_ABS_VALUE went on where its row ended, and a deterministic env was reported as
    # irreproducible (replay_nondeterminism), its table dropped.
    nan = nan_text(row, "at reset") or overflow_text(row, obs, "at reset")
    if nan is not None:
        ep.reason, ep.error = EndReason.ENV_ERROR.value, nan
        return
    if sink is not None and frame is not None:
        sink.add(frame)
    while True:
        try:
            action = policy.act(row[None].copy(), None if rng is None else [rng])
            if len(action) != 1:
                raise ValueError(f"policy returned {len(action)} actions for 1 rows")
        except Exception as err:
            ep.reason, ep.error = EndReason.POLICY_ERROR.value, error_text(err)
            return
        if _invalid_actions(space, action)[0]:
            ep.reason = EndReason.INVALID_ACTION.value
            ep.error = f"action {np.asarray(action[0]).tolist()!r} not in {space}"
            return
        env_action = _to_env_action(space, action[0])
        # What the row records is read before the env steps: an env may update the observation
        # array it returned in place (the row held the NEXT observation) or change the action
        # array it is given (the row and the action plot held the changed one). A sandbox gets
        # and sends copies; here the env holds the very arrays.
        taken = int(env_action) if discrete else np.array(env_action, copy=True)
        acted_on = _flat(obs) if keep_rows else []
        stepped = step(env_action)
        if stepped is None:
            return
        next_obs, reward, terminated, truncated, info, frame = stepped
        if not (terminated or truncated):
            try:
                got = np.shape(next_obs)
                if got != row.shape:  # never broadcast, as in the runner
                    ep.reason = EndReason.ENV_ERROR.value
                    ep.error = obs_shape_error(got, row.shape, f"at step {ep.length + 1}")
                    return
                row[...] = next_obs  # as the runner's buffer does: a misfit is an env_error
            except Exception as err:
                ep.reason, ep.error = EndReason.ENV_ERROR.value, error_text(err)
                return
            over = overflow_text(row, next_obs, f"at step {ep.length + 1}")  # not counted, as there
            if over is not None:
                ep.reason, ep.error = EndReason.ENV_ERROR.value, over
                return
        ep.length += 1
        ep.actions.append(taken)
        if keep_rows:
            ep.rows.append({
                "episode_index": ep.index,
                "seed": ep.seed,
                "step": ep.length - 1,
                "obs": acted_on,
                "action": taken if discrete else _flat(taken),
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "info": info,
            })
        if sink is not None and frame is None and render is not None:
            frame = render()
        if sink is not None and frame is not None:
            sink.add(frame)
        if not math.isfinite(reward):
            ep.reason, ep.error = EndReason.INVALID_REWARD.value, f"reward {reward!r} at step {ep.length}"
            return
        ep.ret += reward
        if abs(ep.ret) > MAX_ABS_VALUE:
            ep.reason, ep.error = EndReason.INVALID_REWARD.value, return_text(ep.ret, ep.length)
            return
        if terminated or truncated:
            ep.reason = (EndReason.TERMINATED if terminated else EndReason.TRUNCATED).value
            return
        nan = nan_text(row, f"at step {ep.length}")
        if nan is not None:
            ep.reason, ep.error = EndReason.ENV_ERROR.value, nan
            return
        obs = next_obs


def _replay_one_sandboxed(
    slots: EnvSlots, policy: LoadedPolicy, ep: _Episode, keep_rows: bool,
    sink: VideoSink | None, shape: tuple[int, ...] | None,
) -> None:
    """``_replay_loop`` with the env in a sandbox (frames come packed with the observation).

    A sandbox sends ``info`` only with an episode's last step, so only that step's is recorded.
    """
    def reset() -> tuple[Any, npt.NDArray[np.uint8] | None] | None:
        out = slots.reset(0, ep.seed)
        return None if _slot_failure(ep, out) else _framed(out, shape)

    def step(action: Any) -> _Step | None:
        out = slots.step_many([0], [action])[0]
        if _slot_failure(ep, out):
            return None
        next_obs, frame = _framed(out, shape)
        return (next_obs, float(out.reward), out.terminated, out.truncated,
                list(out.info.items()), frame)

    _replay_loop(ep, policy, keep_rows, sink, reset, step, shape=shape)


def _replay_one(
    env: gym.Env[Any, Any], policy: LoadedPolicy, ep: _Episode, keep_rows: bool,
    sink: VideoSink | None,
) -> None:
    """``_replay_loop`` with the env in this process."""
    def reset() -> tuple[Any, npt.NDArray[np.uint8] | None] | None:
        try:
            obs, _ = env.reset(seed=ep.seed)
        except Exception as err:
            ep.reason, ep.error = EndReason.ENV_ERROR.value, error_text(err)
            return None
        return obs, (render_frame(env) if sink is not None else None)

    def step(action: Any) -> _Step | None:
        try:
            next_obs, raw_reward, raw_terminated, raw_truncated, info = env.step(action)
            reward = float(raw_reward)
            terminated, truncated = bool(raw_terminated), bool(raw_truncated)  # as the runner's
        except Exception as err:
            ep.reason, ep.error = EndReason.ENV_ERROR.value, error_text(err)
            return None
        items = list(scalar_info(info).items()) if isinstance(info, dict) else []
        return next_obs, reward, terminated, truncated, items, None

    space_shape = env.observation_space.shape
    _replay_loop(ep, policy, keep_rows, sink, reset, step, lambda: render_frame(env),
                 None if space_shape is None else tuple(space_shape))


def _finish_video(ep: _Episode, sink: VideoSink | None) -> tuple[_Episode, Path | None, str | None]:
    """Write a replayed episode's video (if one was recorded); returns it and why not."""
    if sink is None:
        return ep, None, None
    try:
        return ep, sink.write(), None
    except Exception as err:
        sink.abort()
        return ep, None, f"writing the video failed: {error_text(err)}"


#: End reasons set by a clock (a sandbox's wall-clock limits, a hung policy forward) or by the
#: infrastructure: a replay runs until its own limits, so its length says nothing of determinism.
CLOCKED = frozenset({*UNSAFE_TO_REPLAY, EndReason.POLICY_TIMEOUT.value})


def _interrupted(ep: _Episode, recorded_reason: str | None) -> str | None:
    """Why the replay of ``ep`` was cut short by the harness, not the env; None when it was not.

    A replay whose own sandbox crashed, ran out of memory or time (or whose policy forward hung)
    where the recorded episode did not end so says nothing of determinism: a sandbox killed from
    outside (a fork server stopped under it) was a ``replay_nondeterminism`` alarm that also
    dropped the correct cache entry.
    """
    if ep.reason not in CLOCKED or recorded_reason is None or recorded_reason in CLOCKED:
        return None  # nothing recorded to cut short, or a recorded failure replayed as one
    why = f": {ep.error}" if ep.error else ""
    return (f"its replay ended {ep.reason} at step {ep.length}{why} (the harness, not the env; "
            f"recorded {recorded_reason}): not compared, no recording")


def _compare(
    ep: _Episode, expected: tuple[float, int] | None, recorded_reason: str | None
) -> tuple[bool | None, str | None]:
    if expected is None or recorded_reason in CLOCKED:  # not compared: see ``CLOCKED``
        return None, None
    if _interrupted(ep, recorded_reason):  # the replay's own clock or sandbox ended it
        return None, None
    ret, length = expected
    same = ep.ret == ret and ep.length == length  # exact: returns are replayable bit for bit
    if recorded_reason is not None:
        same = same and ep.reason == recorded_reason
    if same:
        return True, None
    got = f"{ep.ret!r} over {ep.length} steps ({ep.reason})"
    want = f"{ret!r} over {length} steps" + (f" ({recorded_reason})" if recorded_reason else "")
    return False, f"episode {ep.index} (seed {ep.seed}): replayed {got}, recorded {want}"


def _run_episode_sandboxed(
    sandbox: ReplaySandbox, env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None,
    policy: LoadedPolicy, index: int, seed: int, keep_rows: bool, video: Path | None, fps: float,
    shape: tuple[int, ...] | None,
) -> tuple[_Episode, Path | None, str | None]:
    """``_run_episode`` in a fresh sandbox of ``sandbox.level``."""
    ep = _Episode(index, seed)
    slots = sandbox.open(env_id, env_kwargs, max_steps, render=video is not None)
    sink = VideoSink(video, fps) if video is not None else None
    try:
        _replay_one_sandboxed(slots, policy, ep, keep_rows, sink, shape)
    except RenderError as err:
        if sink is not None:
            sink.abort()
        problem = f"render failed at step {ep.length}: {err}"
        slots.close()
        ep, _, _ = _run_episode_sandboxed(sandbox, env_id, env_kwargs, max_steps, policy, index,
                                          seed, keep_rows, None, fps, shape)
        return ep, None, problem
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    finally:
        slots.close()
    return _finish_video(ep, sink)


def probe_rendering(
    env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None, seed: int,
    sandbox: ReplaySandbox | None = None,
) -> str | None:
    """None when the env renders an rgb_array frame after a reset (in ``sandbox``), else why not."""
    if sandbox is None:
        return _probe_rendering(env_id, env_kwargs, max_steps, seed)
    try:
        slots = sandbox.open(env_id, env_kwargs, max_steps, render=True)
    except Exception as err:
        return f"no {sandbox.level} sandbox for the render check ({error_text(err)})"
    try:
        out = slots.reset(0, seed)
        if out.failure is not None:
            return (f"{env_id} could not be reset and rendered in a {sandbox.level} sandbox "
                    f"({out.failure}: {out.error})")
        _, frame = unpack(out.obs)
        if frame is None:
            return f"{env_id} rendered no frame in a {sandbox.level} sandbox"
    except Exception as err:
        return f"{env_id} could not render in a {sandbox.level} sandbox ({error_text(err)})"
    finally:
        slots.close()
    return None


def _run_episode(
    env_id: str, env_kwargs: Mapping[str, Any], max_steps: int | None, policy: LoadedPolicy,
    index: int, seed: int, keep_rows: bool, video: Path | None, fps: int | None,
) -> tuple[_Episode, Path | None, str | None]:
    """Replay one episode in a fresh env; returns it, its video (if written) and why not."""
    ep = _Episode(index, seed)
    try:
        env = _open_env(env_id, env_kwargs, max_steps, render=video is not None)
    except Exception as err:
        ep.reason, ep.error = EndReason.ENV_ERROR.value, error_text(err)
        return ep, None, "the env could not be made"
    sink = None
    if video is not None:
        sink = VideoSink(video, float(fps or env.metadata.get("render_fps") or DEFAULT_FPS))
    try:
        _replay_one(env, policy, ep, keep_rows, sink)
    except RenderError as err:
        # Rendering broke mid-episode: replay again without it, so the trajectory stays whole.
        if sink is not None:
            sink.abort()
        problem = f"render failed at step {ep.length}: {err}"
        ep, _, _ = _run_episode(env_id, env_kwargs, max_steps, policy, index, seed, keep_rows, None, fps)
        return ep, None, problem
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    finally:
        _close(env)
    return _finish_video(ep, sink)



def _close(env: gym.Env[Any, Any]) -> None:
    try:
        env.close()
    except Exception as err:  # a broken env may fail to close; its result stands
        logger.debug("closing %s failed: %s", env, err)


def record_episodes(
    env_id: str,
    env_kwargs: Mapping[str, Any],
    max_steps: int | None,
    policy: LoadedPolicy,
    episodes: Sequence[tuple[int, int]],
    *,
    video_dir: Path | None,
    trajectories: bool,
    fps: int | None = None,
    expected: Mapping[int, tuple[float, int]] | None = None,
    end_reasons: Mapping[int, str] | None = None,
    video_format: str = "auto",
    video_for: Collection[int] | None = None,
    trajectories_for: Collection[int] | None = None,
    sandbox: ReplaySandbox | None = None,
) -> ReplayResult:
    """Replay ``episodes`` (``(index, seed)`` pairs); record steps and videos.

    - ``trajectories``: keep every step in ``result.trajectories`` (``trajectory_schema``).
    - ``video_dir``: render each episode with ``render_mode="rgb_array"`` and write
      ``episode-{index:06d}-seed-{seed}.mp4`` (imageio-ffmpeg installed) or ``.gif`` (Pillow) at
      ``fps`` (default: the env's ``render_fps``). Envs that cannot render get no videos and a
      reason in ``result.video_skipped``; a failed episode's video ends at the failure.
    - ``expected``: recorded ``(return, length)`` by index; every replay is compared exactly and
      differences are listed in ``result.mismatches``. ``end_reasons`` (recorded end reason by
      index) adds the end reason to the comparison and skips episodes recorded as ``timeout``,
      ``crashed`` or ``oom`` (replaying those could hang or kill this process) and
      ``policy_timeout`` (the policy's forward hung); episodes a clock ended (``CLOCKED``) are
      not compared.
    - ``video_format``: ``"auto"``, ``"mp4"`` or ``"gif"``.
    - ``video_for`` / ``trajectories_for``: the episode indices that get a video / trajectory
      rows (default: all of ``episodes``), so ``--record-video 3 --record-trajectories 10`` is
      one replay of 10 episodes. Every replayed episode counts in ``result.actions``.
    - ``sandbox``: step the env in a sandbox of that level (the policy stays here, as in the
      runner; frames come back packed with the observation). Episodes recorded as ``timeout``,
      ``crashed`` or ``oom`` are then replayed too: the sandbox contains them. Trajectory rows
      carry ``info`` only at an episode's last step (a sandbox sends no more).
      Without it, the env runs in this process.

    Never raises for an episode's failure: it becomes the replay's end reason, as in the runner.
    """
    if video_format not in ("auto", "mp4", "gif"):
        raise ValueError(f"Unknown video_format {video_format!r}. Choose 'auto', 'mp4' or 'gif'.")
    if fps is not None and fps <= 0:
        raise ValueError(f"'fps' must be a positive integer or None (got {fps!r}).")
    if video_format == "mp4" and video_dir is not None and not mp4_available():
        raise ValueError("video_format='mp4' needs imageio-ffmpeg: pip install imageio-ffmpeg, or use 'gif'.")
    expected = dict(expected or {})
    end_reasons = dict(end_reasons or {})
    suffix = ".mp4" if video_format == "mp4" or (video_format == "auto" and mp4_available()) else ".gif"

    skipped: dict[int, str] = {}
    todo: list[tuple[int, int]] = []
    for index, seed in episodes:
        reason = end_reasons.get(index)
        if reason == EndReason.POLICY_TIMEOUT.value:  # the policy runs here: it would hang here
            skipped[index] = ("recorded as policy_timeout: its policy forward did not return; "
                              "not replayed (the forward would hang this process too)")
            continue
        # A sandbox contains a hang or a crash, but replaying one costs its whole timeout: only
        # for an episode whose video or trajectory was asked for.
        recorded = (video_for is not None and index in video_for) or (
            trajectories and (trajectories_for is None or index in trajectories_for))
        if reason in UNSAFE_TO_REPLAY and (sandbox is None or not recorded):
            skipped[index] = (
                f"recorded as {reason} in its sandbox; not replayed in-process (it could hang or "
                "kill this process). Reproduce it with the same seed under isolation='process'."
                if sandbox is None else
                f"recorded as {reason}; replayed only when its video or trajectory is asked for"
            )
        else:
            todo.append((index, seed))

    render_problem: str | None = None
    if video_dir is not None and todo and (video_for is None or set(video_for) & {i for i, _ in todo}):
        render_problem = probe_rendering(env_id, env_kwargs, max_steps, todo[0][1], sandbox)
        if render_problem:
            logger.warning("videos skipped: %s", render_problem)
        else:
            video_dir = Path(video_dir)
            video_dir.mkdir(parents=True, exist_ok=True)
    rendering = video_dir is not None and render_problem is None

    rows: list[dict[str, Any]] = []
    actions: list[Any] = []
    videos: dict[int, Path] = {}
    video_skipped: dict[int, str] = {}
    replayed: list[ReplayedEpisode] = []
    mismatches: list[str] = []
    interrupted: dict[int, str] = {}
    wants_video = set(video_for) if video_for is not None else {i for i, _ in todo}
    wants_rows = set(trajectories_for) if trajectories_for is not None else {i for i, _ in todo}
    shape = sandbox.obs_shape if sandbox is not None else None
    # The sandboxed env's frame rate as it described itself: never made here to ask it.
    sandbox_fps = float(fps or sandbox.fps or DEFAULT_FPS) if sandbox else 0.0
    for index, seed in todo:
        target = None
        if rendering and video_dir is not None and index in wants_video:
            target = Path(video_dir) / f"episode-{index:06d}-seed-{seed}{suffix}"
        keep_rows = trajectories and index in wants_rows
        if sandbox is not None:
            ep, video, problem = _run_episode_sandboxed(
                sandbox, env_id, env_kwargs, max_steps, policy, index, seed, keep_rows, target,
                sandbox_fps, shape)
        else:
            ep, video, problem = _run_episode(
                env_id, env_kwargs, max_steps, policy, index, seed, keep_rows, target, fps
            )
        cut = _interrupted(ep, end_reasons.get(index))
        if cut:  # its video and rows end where the harness did: no recording of the episode
            logger.warning("replay of episode %d not whole: %s", index, cut)
            interrupted[index] = cut
            if video is not None:
                video.unlink(missing_ok=True)
                video, problem = None, cut
            ep.rows = []
        if video is not None:
            videos[index] = video
        elif video_dir is not None and index in wants_video:
            video_skipped[index] = problem or render_problem or "no frames were rendered"
        matches, mismatch = _compare(ep, expected.get(index), end_reasons.get(index))
        if mismatch:
            mismatches.append(mismatch)
            logger.warning("replay mismatch: %s", mismatch)
        rows.extend(ep.rows)
        actions.extend(ep.actions)
        replayed.append(ReplayedEpisode(ep.index, ep.seed, ep.ret, ep.length, ep.reason, ep.error,
                                        expected.get(index), matches, video))

    space = policy.action_space
    schema = trajectory_schema(space)
    table = pa.Table.from_pylist(rows, schema=schema) if rows else schema.empty_table()
    if isinstance(space, spaces.Discrete):
        counts = np.bincount(np.asarray(actions, dtype=np.int64) - int(space.start), minlength=int(space.n))
        summary = _summary_discrete(counts, int(space.start), len(replayed), None)
    elif isinstance(space, spaces.Box):
        dims = int(np.prod(space.shape)) if space.shape else 1
        samples = np.asarray(actions, dtype=np.float64).reshape(-1, dims)
        summary = _summary_box(samples, space, len(replayed), None)
    else:
        summary = {"kind": type(space).__name__, "steps": len(actions), "episodes": len(replayed)}
    return ReplayResult(
        trajectories=table,
        videos=videos,
        episodes=tuple(replayed),
        actions=summary,
        mismatches=tuple(mismatches),
        interrupted=interrupted,
        skipped=skipped,
        video_skipped=video_skipped,
        trajectory_episodes=tuple(e.episode_index for e in replayed if trajectories
                                  and e.episode_index in wants_rows
                                  and e.episode_index not in interrupted),
    )
