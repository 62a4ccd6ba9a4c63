"""A return the statistics cannot aggregate ends its episode as the env's ``invalid_reward``.

Each reward was finite, so the runner's per-step check let the sum grow past 1e100 (or overflow
to inf): stage 6 then refused the returns, after every episode had run, with exit 2 ("nothing
was spawned") and no Parquet or report.json in the output folder.
"""

from __future__ import annotations

import pytest

from evalfleet.models import EvalRequest
from evalfleet.report import aggregate
from tests.core.episodes import run_in_process
from tests.core.overflow_envs import ENV_ID


@pytest.mark.parametrize(("kwargs", "at_step"), [
    ({}, 2),                                # 6e99 + 6e99: past 1e100 on the second step
    ({"steps": 2}, 2),                      # ... on the episode's last step
    ({"scale": 1.5e308}, 1),                # finite, past the range at once (twice: inf)
    ({"scale": -1e300}, 1),                 # one reward past the range, negative
])
def test_a_return_past_the_range_is_one_invalid_reward_row(kwargs, at_step):
    table = run_in_process(ENV_ID, "tests.core.overflow_envs:zeros", 40, kwargs=kwargs, slots=7)
    rows = table.to_pylist()
    broken = [r for r in rows if r["end_reason"] != "terminated"]
    assert 5 < len(broken) < 35  # the odd seeds, about half
    for row in broken:
        assert row["end_reason"] == "invalid_reward"
        assert row["length"] == at_step
        assert row["error"].startswith(f"return {row['return']!r} after step {at_step} exceeds "
                                       "1e+100 in magnitude")
    steps = kwargs.get("steps", 10)
    assert all(r["return"] == steps and r["length"] == steps for r in rows if r not in broken)
    # Stage 6 aggregates the rest: the broken rows are harness failures with an alarm.
    request = EvalRequest(env=ENV_ID, policy="tests.core.overflow_envs:zeros", episodes=40)
    report = aggregate(request, table, env_spec={"env_id": ENV_ID}, env_spec_hash="s",
                       policy={"sha256": "0" * 64}, isolation="inprocess", timings={"run": 1.0},
                       cache={"status": "miss"}, run_seconds=1.0)
    assert report.mean == steps and report.scored == 40 - len(broken)
    assert report.failures == {"invalid_reward": len(broken)}
