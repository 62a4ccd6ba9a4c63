"""A mean the step cap cut short is visible: the report counts how completed episodes ended.

Planted case: CartPole-v1 under the bundled example policy, capped at 40 steps (every episode
reaches the cap) and at 500 steps with a policy that always pushes left (every episode falls).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from evalfleet.cli import EXAMPLE_POLICY
from evalfleet.envspec import resolve_env
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.report import aggregate
from evalfleet.summary import summary_text
from evalfleet.tracking import flatten_metrics
from tests.core.episodes import run_in_process

ENV = "CartPole-v1"


def always_left(obs: np.ndarray) -> np.ndarray:
    return np.zeros(len(obs), dtype=np.int64)


def _report(policy_ref: str, cap: int | None, n: int = 30, kwargs: dict[str, int] | None = None
            ) -> tuple[pa.Table, EvalReport]:
    table = run_in_process(ENV, policy_ref, n, kwargs=kwargs, cap=cap, slots=8)
    resolved = resolve_env(ENV, kwargs or {}, cap)
    request = EvalRequest(env=ENV, policy=policy_ref, episodes=n, seed=0, max_steps=cap)
    report = aggregate(request, table, env_spec=resolved.fingerprint.as_dict(),
                       env_spec_hash="spec", policy={"sha256": "ab" * 32}, isolation="inprocess",
                       timings={"run": 1.0}, cache={"status": "miss"}, run_seconds=1.0)
    return table, report


def test_every_episode_cut_by_the_step_cap_is_counted_and_printed():
    table, report = _report(EXAMPLE_POLICY, cap=40)
    assert set(table.column("length").to_pylist()) == {40}
    assert report.endings == {"terminated": 0, "truncated": 30, "at_step_cap": 30, "step_cap": 40}
    assert "0 terminated, 30 truncated (30 at the step cap 40)" in summary_text(report)
    assert report.model_dump(mode="json")["endings"]["at_step_cap"] == 30
    metrics = flatten_metrics(report.model_dump(mode="json"))
    assert (metrics["eval/endings/truncated"], metrics["eval/endings/at_step_cap"]) == (30, 30)


def test_episodes_that_end_on_their_own_are_terminated_not_capped():
    table, report = _report(f"{__name__}:always_left", cap=None)
    assert max(table.column("length").to_pylist()) < 20
    assert report.endings == {"terminated": 30, "truncated": 0, "at_step_cap": 0, "step_cap": 500}
    assert "30 terminated, 0 truncated (0 at the step cap 500)" in summary_text(report)


def test_a_step_cap_given_as_an_env_kwarg_is_the_cap_the_report_names():
    # gym.make applies the kwarg 'max_episode_steps' (the episodes end at 40); the manifest and
    # the endings named the registered 500, so no episode read as cut by the cap.
    assert resolve_env(ENV, {"max_episode_steps": 91}, None).fingerprint.as_dict()[
        "max_episode_steps"] == 91
    table, report = _report(EXAMPLE_POLICY, cap=None, kwargs={"max_episode_steps": 40})
    assert set(table.column("length").to_pylist()) == {40}
    assert report.endings == {"terminated": 0, "truncated": 30, "at_step_cap": 30, "step_cap": 40}
