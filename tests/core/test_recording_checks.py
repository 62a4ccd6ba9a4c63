"""Stage 1 refuses a recording it cannot make; replays on another device never raise a false alarm."""

from pathlib import Path

import pytest

from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.pipeline import CROSS_DEVICE_RTOL, Received, cross_device, receive
from evalfleet.replay import ReplayedEpisode, ReplayResult, probe_encoder, trajectory_schema

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
BROKEN = "tests.flows.render_envs:RenderBroken-v0"


def _request(**fields):
    base = dict(policy=POLICY, episodes=4, concurrency=2, device="cpu")
    base.update(fields)
    return EvalRequest.build(**base)


def test_the_default_env_can_be_recorded():
    """pygame (classic control's renderer) and the MP4 encoder are installed."""
    assert probe_encoder() is None
    received = receive(_request(record_video=2))
    assert received.isolation == "inprocess"


def test_a_renderer_that_fails_is_refused_naming_what_is_missing():
    with pytest.raises(RequestError) as err:
        receive(_request(env=BROKEN, policy="tests.flows.user_envs:toward_goal", record_video=1))
    text = str(err.value)
    assert text.startswith("--record-video 1 cannot be honoured: ")
    assert BROKEN in text and "plantedrenderlib is not installed" in text
    assert "drop --record-video" in text
    # Without a recording asked for, the same env is fine.
    receive(_request(env=BROKEN, policy="tests.flows.user_envs:toward_goal"))


@pytest.mark.slow
def test_the_render_check_runs_in_a_sandbox_of_the_evaluations_level():
    with pytest.raises(RequestError) as err:
        receive(_request(env=BROKEN, policy="tests.flows.user_envs:toward_goal", record_video=1,
                         isolation="process"))
    text = str(err.value)
    assert "in a process sandbox" in text and "plantedrenderlib is not installed" in text
    receive(_request(record_video=1, isolation="process"))  # CartPole renders in a sandbox


def _result(replayed, recorded):
    episodes = tuple(
        ReplayedEpisode(i, i, got[0], got[1], "truncated", None, want, got == want)
        for i, (got, want) in enumerate(zip(replayed, recorded, strict=True)))
    mismatches = tuple(f"episode {e.episode_index}" for e in episodes if not e.matches)
    return ReplayResult(trajectory_schema_table(), {}, episodes, {}, mismatches)


def trajectory_schema_table():
    from gymnasium import spaces

    return trajectory_schema(spaces.Discrete(2)).empty_table()


def _received(device):
    return Received(artifact=None, env_spec={}, env_spec_hash="", isolation="inprocess",  # type: ignore[arg-type]
                    cache_key="", cache_ingredients={}, seconds=0.0, device=device)


def test_replay_on_another_device_is_compared_within_a_tolerance_not_alarmed():
    near = 100.0 * (1 + CROSS_DEVICE_RTOL / 2)
    result = _result([(near, 100), (37.0, 37)], [(100.0, 100), (80.0, 80)])
    alarms, notes = cross_device(result, "cpu", _received("cuda"))
    assert alarms == []
    assert notes == ["replays ran on cpu, episodes on cuda: 1 of 2 replays differ beyond the "
                     f"cross-device tolerance (rtol {CROSS_DEVICE_RTOL:g}); not a determinism alarm"]
    same, _ = cross_device(result, "cuda", _received("cuda"))
    assert same == ["replay_nondeterminism: 2 replayed episodes differ from their rows"]
    assert cross_device(_result([(5.0, 5)], [(5.0, 5)]), "cpu", _received("cuda")) == ([], [])


@pytest.mark.slow
@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_replay_in_a_sandbox_equals_the_in_process_replay(level, tmp_path):
    """Same steps, rewards and frames count whether the env runs here or in a sandbox."""
    import imageio_ffmpeg

    from evalfleet.envspec import resolve_env
    from evalfleet.policy import load_policy
    from evalfleet.replay import ReplaySandbox, record_episodes
    from evalfleet.sandbox.isolation import resolve_isolation

    try:
        resolve_isolation(level)
    except Exception as err:  # this machine does not allow the level: nothing to compare
        pytest.skip(f"{level} unavailable: {err}")
    env = resolve_env("CartPole-v1", {}, 80)
    policy = load_policy("torchscript", Path(POLICY).read_bytes(), None, POLICY, env.action_space,
                         device="cpu", deterministic=True)
    episodes = [(0, 11), (1, 12)]
    here = record_episodes("CartPole-v1", {}, 80, policy, episodes, video_dir=tmp_path / "here",
                           trajectories=True, video_for=[0])
    sandbox = ReplaySandbox(level, 60.0, env.fingerprint.as_dict(),
                            obs_shape=tuple(env.observation_space.shape), fps=env.render_fps)
    assert env.render_fps == 50.0  # as CartPole states it: the sandboxed env is not made here
    there = record_episodes("CartPole-v1", {}, 80, policy, episodes, video_dir=tmp_path / "there",
                            trajectories=True, video_for=[0], sandbox=sandbox)
    assert [(e.episode_return, e.length, e.end_reason) for e in there.episodes] == [
        (e.episode_return, e.length, e.end_reason) for e in here.episodes]
    assert there.trajectories.drop(["info"]).equals(here.trajectories.drop(["info"]))
    assert list(there.videos) == [0] and not there.video_skipped

    def frames(path):
        reader = imageio_ffmpeg.read_frames(str(path))
        next(reader)
        return sum(1 for _ in reader)

    assert frames(there.videos[0]) == frames(here.videos[0])


def test_rendering_here_leaves_this_processes_environment_as_it_was(monkeypatch, tmp_path):
    """A stage-1 render check and an in-process replay with video set SDL_VIDEODRIVER=dummy for
    good in the driver and the kept workers: the environment a later sandboxed evaluation is keyed
    and given (its cache key, its history protocol: ``protocol_changed``, gate exit 6) changed."""
    import os

    from evalfleet.cache import env_environment, environment_digest
    from evalfleet.envspec import resolve_env
    from evalfleet.policy import load_policy
    from evalfleet.replay import record_episodes

    monkeypatch.delenv("SDL_VIDEODRIVER", raising=False)
    monkeypatch.delenv("SDL_AUDIODRIVER", raising=False)
    before = environment_digest(env_environment("process", []))
    receive(_request(record_video=1))  # stage 1's render check, in this process
    env = resolve_env("CartPole-v1", {}, 40)
    policy = load_policy("torchscript", Path(POLICY).read_bytes(), None, POLICY, env.action_space,
                         device="cpu", deterministic=True)
    out = record_episodes("CartPole-v1", {}, 40, policy, [(0, 11)], video_dir=tmp_path,
                          trajectories=False, video_for=[0])
    assert list(out.videos) == [0] and out.videos[0].stat().st_size > 0  # it rendered
    assert "SDL_VIDEODRIVER" not in os.environ and "SDL_AUDIODRIVER" not in os.environ
    assert environment_digest(env_environment("process", [])) == before
    # A value the user set is theirs, before and after.
    monkeypatch.setenv("SDL_VIDEODRIVER", "x11")
    record_episodes("CartPole-v1", {}, 40, policy, [(0, 11)], video_dir=tmp_path / "again",
                    trajectories=False, video_for=[0])
    assert os.environ["SDL_VIDEODRIVER"] == "x11" and "SDL_AUDIODRIVER" not in os.environ
