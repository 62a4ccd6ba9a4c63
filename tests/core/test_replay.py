"""Replays reproduce the evaluated episodes exactly; trajectories, videos and mismatch flags."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pyarrow.parquet as pq
import pytest
from gymnasium import spaces

import tests.flows.user_envs  # noqa: F401  registers Warehouse-v0 (non-representable rewards)
from evalfleet.envspec import env_thunk
from evalfleet.policy import LoadedPolicy
from evalfleet.records import records_to_table
from evalfleet.replay import action_summary, record_episodes, replay_inputs, trajectory_schema
from evalfleet.review import choose_episodes
from evalfleet.runner import EpisodeContext, run_shard
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.seeds import SeedLedger

CTX = EpisodeContext("req", "sha", "env", "spec", "w0")


def _balance(obs):
    """CartPole: push toward the side the pole leans to (angle + angular velocity)."""
    return (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)


def _run(env_id, policy, n, slots=4, kwargs=None, seed=0):
    ledger = SeedLedger(seed)
    backend = InProcessSlots(env_thunk(env_id, kwargs or {}, None), slots)
    try:
        records = run_shard([(i, ledger.seed(i)) for i in range(n)], backend, policy, CTX)
    finally:
        backend.close()
    return records_to_table(records).sort_by("episode_index")


def _callable(fn, space, deterministic=True, is_torch=False):
    return LoadedPolicy(fn, space, is_torch=is_torch, deterministic=deterministic, device="cpu")


def _replay_all(env_id, policy, table, kwargs=None, **options):
    episodes, expected, reasons = replay_inputs(table, table.column("episode_index").to_pylist())
    return record_episodes(env_id, kwargs or {}, None, policy, episodes, video_dir=None,
                           trajectories=True, expected=expected, end_reasons=reasons, **options)


def _episode_sums(trajectories):
    sums = {}
    for row in trajectories.to_pylist():  # in step order, summed as the runner sums
        sums[row["episode_index"]] = sums.get(row["episode_index"], 0.0) + row["reward"]
    return sums


@pytest.mark.parametrize(
    "env_id,fn",
    [("CartPole-v1", _balance), ("tests.flows.user_envs:Warehouse-v0", tests.flows.user_envs.toward_goal)],
)
def test_replays_reproduce_run_shard_exactly(env_id, fn):
    policy = _callable(fn, spaces.Discrete(2))
    table = _run(env_id, policy, 12)
    result = _replay_all(env_id, policy, table)

    assert result.reproducible and result.mismatches == ()
    recorded = {r["episode_index"]: (r["return"], r["length"]) for r in table.to_pylist()}
    replayed = {e.episode_index: (e.episode_return, e.length) for e in result.episodes}
    assert replayed == recorded  # bit for bit
    assert all(e.matches for e in result.episodes)
    sums = _episode_sums(result.trajectories)
    assert sums == {i: ret for i, (ret, _) in recorded.items()}
    steps = result.trajectories.group_by("episode_index").aggregate([("step", "count")]).to_pydict()
    assert dict(zip(steps["episode_index"], steps["step_count"], strict=True)) == {
        i: n for i, (_, n) in recorded.items()
    }


def test_trajectory_table_rows_and_parquet_round_trip(tmp_path):
    policy = _callable(_balance, spaces.Discrete(2))
    table = _run("CartPole-v1", policy, 3)
    result = _replay_all("CartPole-v1", policy, table)
    traj = result.trajectories
    assert traj.schema.equals(trajectory_schema(spaces.Discrete(2)), check_metadata=False)
    first = traj.slice(0, 1).to_pylist()[0]
    assert first["step"] == 0 and len(first["obs"]) == 4 and first["action"] in (0, 1)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=first["seed"])
    assert first["obs"] == [float(x) for x in obs]  # the observation the action was chosen from
    last_rows = [r for r in traj.to_pylist() if r["terminated"] or r["truncated"]]
    assert len(last_rows) == 3
    pq.write_table(traj, tmp_path / "trajectories.parquet")
    assert pq.read_table(tmp_path / "trajectories.parquet").equals(traj)


def test_stochastic_policies_replay_with_the_episode_seeded_generator():
    def logits(obs):
        return np.stack([obs[:, 2] * 5, -obs[:, 2] * 5], axis=1)

    policy = _callable(logits, spaces.Discrete(2), deterministic=False, is_torch=True)
    table = _run("CartPole-v1", policy, 8, slots=3)
    result = _replay_all("CartPole-v1", policy, table)
    assert result.reproducible, result.mismatches


def test_a_mismatch_is_reported_not_raised():
    policy = _callable(_balance, spaces.Discrete(2))
    table = _run("CartPole-v1", policy, 2)
    row = table.to_pylist()[1]
    expected = {0: (0.5, 3), 1: (row["return"], row["length"])}
    episodes = [(0, table.to_pylist()[0]["seed"]), (1, row["seed"])]
    result = record_episodes("CartPole-v1", {}, None, policy, episodes, video_dir=None,
                             trajectories=False, expected=expected)
    assert not result.reproducible and len(result.mismatches) == 1
    assert result.mismatches[0].startswith("episode 0 (seed ")
    assert "recorded 0.5 over 3 steps" in result.mismatches[0]
    assert [e.matches for e in result.episodes] == [False, True]
    assert result.trajectories.num_rows == 0  # not asked for
    assert result.actions["kind"] == "Discrete" and result.actions["steps"] == sum(
        e.length for e in result.episodes
    )
    assert any("non-determinism" in note for note in result.notes())


class _Flaky(gym.Env):
    """Box actions; raises in step for about a quarter of the seeds; renders nothing."""

    observation_space = spaces.Box(-5, 5, (3,), np.float32)
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t, self._bad = 0, int(self.np_random.integers(0, 4)) == 0
        return self.np_random.normal(size=3).astype(np.float32), {}

    def step(self, action):
        self._t += 1
        if self._bad and self._t == 4:
            raise RuntimeError(f"boom at step {self._t}")
        reward = float(-np.sum(np.square(action))) + float(self.np_random.random())
        obs = self.np_random.normal(size=3).astype(np.float32)
        return obs, reward, self._t >= 8, False, {"t": self._t, "label": "not a scalar"}


gym.register("evalfleet-test/Flaky-v0", entry_point=_Flaky, max_episode_steps=20)


def _box_policy():
    return _callable(lambda o: np.clip(o[:, :2], -1, 1), spaces.Box(-1, 1, (2,), np.float32))


def test_failed_episodes_replay_to_the_same_failure_and_videos_are_skipped_with_a_reason(tmp_path):
    policy = _box_policy()
    table = _run("evalfleet-test/Flaky-v0", policy, 20)
    assert "env_error" in table.column("end_reason").to_pylist()
    chosen = choose_episodes(table, 6, seed=0)
    episodes, expected, reasons = replay_inputs(table, chosen)
    result = record_episodes("evalfleet-test/Flaky-v0", {}, None, policy, episodes,
                             video_dir=tmp_path / "videos", trajectories=True, expected=expected,
                             end_reasons=reasons)
    assert result.reproducible, result.mismatches
    failed = [e for e in result.episodes if e.end_reason == "env_error"]
    assert failed and all(e.error.startswith("RuntimeError: boom at step 4") for e in failed)
    assert result.videos == {}
    assert set(result.video_skipped) == set(chosen)
    assert "does not declare the 'rgb_array' render mode" in result.video_skipped[chosen[0]]

    info = result.trajectories.column("info").to_pylist()[0]
    assert info == [("t", 1.0)]  # scalar info entries only
    summary = action_summary(result.trajectories, policy.action_space)
    assert summary["samples"].shape == (result.trajectories.num_rows, 2)
    assert np.array_equal(summary["samples"], result.actions["samples"])
    assert summary["episodes"] == len(chosen)


def test_recorded_infrastructure_failures_are_not_replayed_in_process():
    policy = _callable(_balance, spaces.Discrete(2))
    ledger = SeedLedger(0)
    result = record_episodes(
        "CartPole-v1", {}, None, policy, [(0, ledger.seed(0)), (1, ledger.seed(1))],
        video_dir=None, trajectories=True, end_reasons={0: "crashed", 1: "terminated"},
    )
    assert [e.episode_index for e in result.episodes] == [1]
    assert "crashed" in result.skipped[0]
    assert set(result.trajectories.column("episode_index").to_pylist()) == {1}


def _connect_four_first_legal(obs):
    return np.argmax(obs[:, :7] == 0, axis=1).astype(np.int64)


def test_gif_video_of_a_connect_four_episode(tmp_path):
    from PIL import Image, ImageSequence

    policy = _callable(_connect_four_first_legal, spaces.Discrete(7))
    ledger = SeedLedger(0)
    result = record_episodes("evalfleet/ConnectFour-v0", {}, None, policy, [(3, ledger.seed(3))],
                             video_dir=tmp_path, trajectories=True, fps=4, video_format="gif")
    episode = result.episodes[0]
    video = result.videos[3]
    assert video == episode.video and video.parent == tmp_path
    assert video.name == f"episode-000003-seed-{ledger.seed(3)}.gif"
    with Image.open(video) as gif:
        assert gif.size == (320, 240)
        durations = [frame.info["duration"] for frame in ImageSequence.Iterator(gif)]
    assert len(durations) == episode.length + 1  # the reset frame, then one per step
    assert durations[0] == 250 and durations[-1] >= 1000  # 4 fps; the outcome is held
    assert not list(tmp_path.glob(".*tmp*"))


def test_mp4_video_when_imageio_ffmpeg_is_installed(tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    policy = _callable(_connect_four_first_legal, spaces.Discrete(7))
    result = record_episodes("evalfleet/ConnectFour-v0", {}, None, policy, [(0, SeedLedger(0).seed(0))],
                             video_dir=tmp_path, trajectories=False, fps=None)
    video = result.videos[0]
    assert video.suffix == ".mp4"
    frames, seconds = imageio_ffmpeg.count_frames_and_secs(str(video))
    assert frames == result.episodes[0].length + 1 + 2  # plus the last frame held for 1 s
    assert seconds == pytest.approx(frames / 2)  # at the env's render_fps of 2


def test_bad_arguments_are_rejected():
    policy = _callable(_balance, spaces.Discrete(2))
    with pytest.raises(ValueError, match="Unknown video_format 'avi'"):
        record_episodes("CartPole-v1", {}, None, policy, [], video_dir=Path("."),
                        trajectories=False, video_format="avi")
    with pytest.raises(KeyError, match="not in the episode table"):
        replay_inputs(_run("CartPole-v1", policy, 2), [5])


class _Drawn(gym.Env):
    """Renders a grey level per step; with ``broken=True`` render() raises from step 3 on."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}
    observation_space = spaces.Box(0, 100, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, render_mode=None, broken=False, steps=30):
        self.render_mode, self.broken, self.steps = render_mode, broken, steps

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self._t += 1
        return (np.array([self._t], np.float32), float(self.np_random.random()),
                self._t >= self.steps, False, {})

    def render(self):
        if self.broken and self._t >= 3:
            raise RuntimeError("display lost")
        return np.full((21, 31, 3), (self._t * 7) % 256, dtype=np.uint8)  # odd sizes on purpose


gym.register("evalfleet-test/Drawn-v0", entry_point=_Drawn, max_episode_steps=1000)


def test_a_render_failure_mid_episode_keeps_the_replay_and_drops_the_video(tmp_path):
    policy = _callable(lambda o: np.zeros(len(o), np.int64), spaces.Discrete(2))
    table = _run("evalfleet-test/Drawn-v0", policy, 2, kwargs={"broken": True})
    episodes, expected, reasons = replay_inputs(table, [0, 1])
    result = record_episodes("evalfleet-test/Drawn-v0", {"broken": True}, None, policy, episodes,
                             video_dir=tmp_path, trajectories=True, expected=expected,
                             end_reasons=reasons, video_format="gif")
    assert result.reproducible and result.videos == {}
    assert result.video_skipped[0].startswith("render failed at step 3: RuntimeError: display lost")
    assert result.trajectories.num_rows == 60
    assert list(tmp_path.iterdir()) == []  # no half-written files left behind


@pytest.mark.parametrize("video_format", ["gif", "mp4"])
def test_long_episodes_and_odd_frame_sizes(tmp_path, monkeypatch, video_format):
    from PIL import Image, ImageSequence

    if video_format == "mp4":
        pytest.importorskip("imageio_ffmpeg")
    monkeypatch.setattr("evalfleet.video.MAX_GIF_FRAMES", 16)
    policy = _callable(lambda o: np.zeros(len(o), np.int64), spaces.Discrete(2))
    result = record_episodes("evalfleet-test/Drawn-v0", {"steps": 100}, None, policy, [(0, 1)],
                             video_dir=tmp_path, trajectories=False, video_format=video_format)
    video = result.videos[0]
    assert video.suffix == f".{video_format}" and video.stat().st_size > 0
    if video_format == "gif":
        with Image.open(video) as gif:
            assert gif.size == (31, 21)
            durations = [frame.info["duration"] for frame in ImageSequence.Iterator(gif)]
        # 101 frames thinned to a stride of 8 (13 frames) plus the final frame, held for 1 s.
        assert len(durations) == 14 and durations[0] == 800 and durations[-1] == 1000


def test_videos_and_trajectories_for_subsets_of_one_replay(tmp_path):
    policy = _callable(lambda o: np.zeros(len(o), np.int64), spaces.Discrete(2))
    episodes = [(i, 100 + i) for i in range(4)]
    result = record_episodes("evalfleet-test/Drawn-v0", {"steps": 5}, None, policy, episodes,
                             video_dir=tmp_path, trajectories=True, video_format="gif",
                             video_for=[2], trajectories_for=[1, 2, 3])
    assert set(result.videos) == {2} and result.video_skipped == {}
    assert set(result.trajectories.column("episode_index").to_pylist()) == {1, 2, 3}
    assert result.actions["steps"] == 20 and result.actions["episodes"] == 4
