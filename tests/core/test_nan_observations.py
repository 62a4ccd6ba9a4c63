"""An env's NaN observation ends its episode as the env's error, before any policy sees it.

Fed on, a torch policy's logits turned NaN and the episode ended as ``policy_error``: the env's
fault counted in the policy's headline, with its partial return. A callable acting on the other
elements played on, and the return came out as if nothing had happened, with no alarm.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.core.episodes import run_in_process
from tests.core.nan_envs import ENV_ID, Linear


@pytest.fixture(scope="module")
def linear_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    path = Path(tmp_path_factory.mktemp("nan")) / "linear.pt"
    torch.jit.save(torch.jit.script(Linear()), str(path))
    return str(path)


@pytest.mark.parametrize("policy", ["torch", "callable"])
def test_a_nan_observation_is_the_envs_error_at_its_step(policy: str, linear_policy: str) -> None:
    ref = linear_policy if policy == "torch" else "tests.core.nan_envs:first_action"
    table = run_in_process(ENV_ID, ref, 40, slots=7).to_pylist()
    broken = [r for r in table if r["end_reason"] != "terminated"]
    assert 5 < len(broken) < 35  # about half the seeds
    for row in broken:
        assert row["end_reason"] == "env_error"
        assert row["error"] == ("observation has NaN at step 5 (element(s) [1] of 3): the env "
                                "produced no state to act on")
        assert row["length"] == 5
    assert all(r["return"] == 20.0 for r in table if r["end_reason"] == "terminated")


def test_a_nan_observation_at_reset_is_the_envs_error_before_any_step(linear_policy: str) -> None:
    table = run_in_process(ENV_ID, linear_policy, 20, kwargs={"at_reset": True}).to_pylist()
    broken = [r for r in table if r["end_reason"] != "terminated"]
    assert broken and all(r["end_reason"] == "env_error" and r["length"] == 0 for r in broken)
    assert broken[0]["error"].startswith("observation has NaN at reset (element(s) [1] of 3)")
