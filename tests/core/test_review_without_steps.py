"""A Box-action evaluation whose replayed episodes have no step still gets its plots and page.

The action plot reshaped the replays' ``(0, dims)`` samples before it looked for "no steps":
numpy cannot size the ``-1`` of an empty array, so the review failed (exit 5, "cannot reshape
array of size 0 into shape (0,newaxis)") and left no plots and no report.html, in just the
evaluation (a policy that fails every episode at once) a user opens them to debug.
"""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np

from evalfleet.models import EvalRequest
from evalfleet.pipeline import receive, review
from evalfleet.plots import PLOT_FILES, plot_figures
from evalfleet.replay import action_summary, trajectory_schema
from evalfleet.report import aggregate
from tests.core.episodes import run_in_process
from tests.core.float32_box_envs import STEER07

POLICY = "tests.core.float32_box_envs:out_of_bounds"


def test_a_box_summary_of_no_steps_is_an_empty_action_plot() -> None:
    space = gym.spaces.Box(-0.7, 0.7, (2,), np.float32)
    actions = action_summary(trajectory_schema(space).empty_table(), space)
    assert actions["samples"].shape == (0, 2) and actions["steps"] == 0
    figures = plot_figures(run_in_process(STEER07, POLICY, 4, slots=2), actions=actions)
    assert [t.get_text() for t in figures["actions"].axes[0].texts] == ["no steps replayed"]


def test_the_review_writes_its_plots_and_page_when_no_replayed_episode_has_a_step(
    tmp_path: Path,
) -> None:
    request = EvalRequest.build(env=STEER07, policy=POLICY, episodes=12, concurrency=4, device="cpu",
                                isolation="inprocess")
    received = receive(request)
    table = run_in_process(STEER07, POLICY, 12, slots=4)
    assert set(table.column("end_reason").to_pylist()) == {"invalid_action"}
    assert set(table.column("length").to_pylist()) == {0}
    report = aggregate(request, table, env_spec=received.env_spec, env_spec_hash="spec",
                       policy={"sha256": "ab" * 32}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "miss"}, run_seconds=1.0)
    _, files, _ = review(request, received, report, table, tmp_path)
    names = sorted(str(p.relative_to(tmp_path)) for p in files)
    plots = ("returns", "lengths", "return_by_episode", "actions")
    assert names == sorted([*(f"plots/{PLOT_FILES[k]}" for k in plots), "report.html"])
    assert all(p.stat().st_size > 0 for p in files)
    page = (tmp_path / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 4  # the action plot among them
