"""What a user asks to record is recorded, at every isolation level, or the run says it was not."""

import os
import re
import subprocess
import sys
from pathlib import Path

import imageio_ffmpeg
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from evalfleet.models import EvalRequest
from evalfleet.replay import HOLD_LAST_S
from evalfleet.storage import read_episodes
from flows.eval import evaluate

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _frames(path: Path) -> tuple[int, float]:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    return sum(1 for _ in reader), float(meta["fps"])


def _check_videos(report, n):
    table = read_episodes(report.outputs["episodes"])
    lengths = dict(zip(table.column("episode_index").to_pylist(),
                       table.column("length").to_pylist(), strict=True))
    videos = sorted((Path(report.outputs["folder"]) / "videos").glob("*.mp4"))
    assert len(videos) == n, videos
    for video in videos:
        assert video.stat().st_size > 0
        index = int(video.name.split("-")[1])
        frames, fps = _frames(video)
        # the reset frame, one per step, then the last frame held HOLD_LAST_S
        assert frames == lengths[index] + 1 + round(fps * HOLD_LAST_S), (video, frames)
    assert not any(a.startswith("recording_incomplete") for a in report.alarms), report.alarms


def test_default_env_records_the_videos_asked_for(prefect_server, tmp_path, example_policy):
    report = evaluate(EvalRequest.build(policy=example_policy, episodes=8, concurrency=8,
                                        max_steps=120, record_video=2, output=tmp_path / "out"))
    _check_videos(report, 2)
    assert not report.harness_fault
    state = flow_run_state(f"{report.env_id}-{report.request_id}")
    assert (state.type.value, state.name) == ("COMPLETED", "Completed")
    execution = report.manifest["execution"]
    if execution["device"] == "cpu":  # no GPU here: 'auto' fell back, and the report says so
        assert execution["device_requested"] == "auto"
        assert "no GPU" in execution["device_fallback"]


def test_videos_and_trajectories_under_process_isolation(prefect_server, tmp_path, example_policy):
    report = evaluate(EvalRequest.build(policy=example_policy, episodes=8, concurrency=4,
                                        max_steps=120, record_video=2, record_trajectories=3,
                                        isolation="process", device="cpu",
                                        output=tmp_path / "out"))
    assert report.isolation == "process"
    _check_videos(report, 2)
    rows = read_episodes(report.outputs["episodes"])
    returns = dict(zip(rows.column("episode_index").to_pylist(), rows.column("return").to_pylist(),
                       strict=True))
    steps = pq.read_table(report.outputs["trajectories"])
    grouped = steps.group_by("episode_index").aggregate([("reward", "sum"), ("step", "count")])
    assert grouped.num_rows == 3
    for index, total, count in zip(grouped.column("episode_index").to_pylist(),
                                   grouped.column("reward_sum").to_pylist(),
                                   grouped.column("step_count").to_pylist(), strict=True):
        assert total == returns[index]
        assert count == rows.filter(pc.equal(rows["episode_index"], index))["length"][0].as_py()
    assert not any(a.startswith("replay_nondeterminism") for a in report.alarms), report.alarms


def test_fewer_videos_than_asked_fail_the_run(prefect_server, tmp_path):
    """The renderer breaks after the check passed: an alarm and a harness fault, not a note."""
    report = evaluate(EvalRequest.build(
        env="tests.flows.render_envs:RenderDiesLater-v0", policy="tests.flows.user_envs:toward_goal",
        episodes=6, concurrency=6, record_video=2, output=tmp_path / "out"))
    alarm = [a for a in report.alarms if a.startswith("recording_incomplete")]
    assert alarm and re.search(r"wrote [01] of 2 videos asked for", alarm[0]), report.alarms
    assert "renderer lost its context" in alarm[0]
    assert report.harness_fault
    assert report.missing_outputs == alarm  # the API's list of what was asked and is not there
    # The Prefect UI's run list says so too: before, the run was a plain green "Completed".
    state = flow_run_state(f"{report.env_id}-{report.request_id}")
    assert (state.type.value, state.name) == ("COMPLETED", "Outputs missing")
    assert "wrote" in state.message and "of 2 videos asked for" in state.message


def flow_run_state(name: str):
    """The final state of the flow run named ``name`` on the test's Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        [run] = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    return run.state


def test_allow_failures_never_waives_a_recording_asked_for(prefect_server, tmp_path, capsys):
    # Before, --allow-failures (a coverage setting) turned 0 of 2 videos into exit 0, as the
    # exit-3 message itself suggested.
    from evalfleet.cli import EXIT_HARNESS_FAULT, run_cli

    args = ["--env", "tests.flows.render_envs:RenderDiesLater-v0", "--policy",
            "tests.flows.user_envs:toward_goal", "--episodes", "6", "--concurrency", "6",
            "--record-video", "2", "--output", str(tmp_path / "out"), "--quiet", "--allow-failures"]
    assert run_cli(evaluate, args) == EXIT_HARNESS_FAULT
    err = capsys.readouterr().err
    assert "harness fault: recording_incomplete: wrote" in err and "--allow-failures" not in err


def test_cli_refuses_a_recording_it_cannot_make(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run(
        [sys.executable, "flows/eval.py", "--env", "tests.flows.render_envs:RenderBroken-v0",
         "--policy", "tests.flows.user_envs:toward_goal", "--episodes", "4", "--record-video", "2",
         "--output", str(tmp_path / "out"), "--quiet"],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "evalfleet: error: --record-video 2 cannot be honoured" in done.stderr
    assert "plantedrenderlib is not installed" in done.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written
