"""The review's replays (stage 7): which episodes are replayed, and the replay, runnable anywhere.

``evaluate()``'s flow runs them as a task on a worker of its cluster before the workers stop
(``tasks.feed_back.replays_ahead``): a worker has the policy's libraries imported already
(torch, for a torch policy), so the driver never imports torch for them, and the policy runs on
the device its episodes ran on. Videos come back as bytes and are written by the caller
(``ReviewReplays.placed``), so a worker on another machine leaves nothing on its own disk.
Elsewhere (the warm path's stage 7, a suite) the same function runs in the calling process.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from evalfleet.envspec import resolve_env_for
from evalfleet.models import EvalRequest
from evalfleet.policy import PolicyArtifact, load_policy
from evalfleet.replay import ReplayResult, ReplaySandbox, record_episodes, replay_inputs
from evalfleet.review import choose_episodes
from evalfleet.sandbox.limits import sandbox_limits

#: Episodes replayed for the action-distribution plot when nothing more is asked for.
ACTION_SAMPLE = 16


@dataclass(frozen=True)
class ReviewReplays:
    """The review's replays: the result (videos as bytes), or why there is none."""

    device: str
    """The device the policy ran on for the replays."""
    result: ReplayResult | None = None
    """What ``record_episodes`` produced; its video paths name files that may be gone."""
    videos: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    """Episode index → (file name, contents) of each video written."""
    error: str | None = None
    """``"Type: text"`` of the failure that left no result."""
    seconds: float = 0.0
    """How long the replays took where they ran (logged by the review)."""

    def placed(self, folder: Path) -> ReplayResult:
        """The result with its videos written to ``folder / "videos"`` and named there."""
        if self.result is None:
            raise RuntimeError(f"no replays to place: {self.error}")
        paths: dict[int, Path] = {}
        for index, (name, data) in self.videos.items():
            path = folder / "videos" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            paths[index] = path
        episodes = tuple(replace(e, video=paths.get(e.episode_index)) for e in self.result.episodes)
        return replace(self.result, videos=paths, episodes=episodes)


def replay_sandbox(request: EvalRequest, isolation: str) -> ReplaySandbox | None:
    """Where replays step the env: a sandbox of the evaluation's level (None: in this process)."""
    if isolation == "inprocess":
        return None
    env = resolve_env_for(request.env, request.env_kwargs, request.max_steps, isolation,
                          sandbox_limits(request), request.episode_timeout_s,
                          request.sandbox_env_allow)
    # () too (a Discrete observation): left out, a sandboxed replay gave the policy (1, 1) rows.
    shape = tuple(env.observation_space.shape) if env.observation_space.shape is not None else None
    return ReplaySandbox(isolation, request.episode_timeout_s, env.fingerprint.as_dict(),
                         sandbox_limits(request), shape, fps=env.render_fps,
                         env_allow=tuple(request.sandbox_env_allow))


def review_replays(request: EvalRequest, artifact: PolicyArtifact, isolation: str,
                   table: pa.Table, device: str) -> ReviewReplays:
    """Replay the episodes the review shows (worst, best, failed, then a seeded sample).

    As many as the recordings asked for, at least ``ACTION_SAMPLE`` (the action-distribution
    plot); the env steps at the evaluation's isolation level, the policy runs on ``device``.
    Never raises: a failure is the returned ``error``.
    """
    t0 = time.perf_counter()
    k = max(request.record_trajectories, request.record_video, ACTION_SAMPLE)
    chosen = choose_episodes(table, k, seed=request.seed)
    try:
        episodes, expected, reasons = replay_inputs(table, chosen)
        env = resolve_env_for(request.env, request.env_kwargs, request.max_steps, isolation,
                              sandbox_limits(request), request.episode_timeout_s,
                              request.sandbox_env_allow)
        policy = load_policy(artifact.format, artifact.payload, artifact.factory, artifact.source,
                             env.action_space, device=device, deterministic=request.deterministic)
        with tempfile.TemporaryDirectory(prefix="evalfleet-videos-") as videos:
            result = record_episodes(
                request.env, request.env_kwargs, request.max_steps, policy, episodes,
                video_dir=Path(videos) if request.record_video else None,
                trajectories=request.record_trajectories > 0, expected=expected,
                end_reasons=reasons, video_for=chosen[: request.record_video],
                trajectories_for=chosen[: request.record_trajectories],
                sandbox=replay_sandbox(request, isolation),
            )
            files = {i: (p.name, p.read_bytes()) for i, p in result.videos.items()}
    except Exception as err:  # the review says so; a shortfall of recordings is an alarm there
        return ReviewReplays(device, error=f"{type(err).__name__}: {err}",
                             seconds=time.perf_counter() - t0)
    return ReviewReplays(device, result, files, seconds=time.perf_counter() - t0)
