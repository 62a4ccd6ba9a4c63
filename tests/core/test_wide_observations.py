"""A finite observation float32 cannot hold is the env's error, not an inf the policy acts on.

Observations reach the policy in float32 rows. A float64 element past float32's range (1e39) was
written there as inf: a torch policy's logits had no finite maximum and every such episode was
the policy's ``policy_error``, and a callable acting on the other elements played on as if nothing
had happened. Now the episode ends as ``env_error`` naming the element, at the step that returned
it (not counted, as an observation of the wrong shape). An inf the env gives is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import pyarrow as pa
import pytest
import torch

from evalfleet import cluster, pipeline
from evalfleet.models import EvalRequest
from evalfleet.planning import plan_shards
from evalfleet.policy import LoadedPolicy
from evalfleet.records import EPISODE_SCHEMA
from evalfleet.replay import record_episodes, replay_inputs
from evalfleet.worker import execute_shard
from tests.core.episodes import run_in_process
from tests.core.wide_obs_envs import BAD_STEP, ENV_ID, Tiny, first_element

POLICIES = "tests.core.wide_obs_envs"
TEXT = ("observation exceeds float32's range {at} (element(s) [1] of 3: 1e+39): finite, past "
        "+-3.4e38, they would reach the policy as inf")


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("wide")) / "tiny.pt"
    torch.jit.save(torch.jit.script(Tiny()), str(path))
    return str(path)


def _rows(kwargs: dict[str, Any], isolation: str, n: int = 12, slots: int = 4) -> list[dict[str, Any]]:
    """Rows of one shard run by the worker's entry point in this process (no Dask)."""
    request = EvalRequest.build(env=ENV_ID, env_kwargs=kwargs, policy=f"{POLICIES}:first_element",
                                episodes=n, concurrency=slots, seed=0, isolation=isolation)
    received = pipeline.receive(request)
    handle = cluster.distribute(received.artifact, None, "cpu", True)
    [shard] = plan_shards(request.request_id, 0, range(n), slots, 1).shards
    return execute_shard(shard, handle, request, isolation).sort_by("episode_index").to_pylist()


@pytest.mark.parametrize("policy", ["torch", "callable"])
def test_a_value_past_float32s_range_is_the_envs_error_at_its_step(policy: str, tiny_policy: str) -> None:
    ref = tiny_policy if policy == "torch" else f"{POLICIES}:first_element"
    table = run_in_process(ENV_ID, ref, 40, slots=7).to_pylist()
    broken = [r for r in table if r["end_reason"] != "terminated"]
    assert 5 < len(broken) < 35  # about half the seeds
    for row in broken:
        assert (row["end_reason"], row["length"], row["return"]) == ("env_error", BAD_STEP - 1, 4.0)
        assert row["error"] == TEXT.format(at=f"at step {BAD_STEP}")
    assert all(r["return"] == 20.0 for r in table if r["end_reason"] == "terminated")


def test_at_reset_and_beside_an_inf_the_env_gives() -> None:
    table = run_in_process(ENV_ID, f"{POLICIES}:first_element", 20,
                           kwargs={"at_reset": True, "inf_elem": True}).to_pylist()
    broken = [r for r in table if r["end_reason"] != "terminated"]
    assert 2 < len(broken) < 18
    for row in broken:
        assert (row["end_reason"], row["length"]) == ("env_error", 0)
        assert row["error"] == TEXT.format(at="at reset")
    # The third element is inf on every seed, as the env gave it: those episodes play out.
    assert all(r["length"] == 20 for r in table if r["end_reason"] == "terminated")


def test_replays_end_the_same_episodes_at_the_same_step() -> None:
    table = pa.Table.from_pylist(_rows({"inf_elem": True}, "inprocess", 8, 4), EPISODE_SCHEMA)
    assert "env_error" in table.column("end_reason").to_pylist()
    episodes, expected, reasons = replay_inputs(table, list(range(8)))
    policy = LoadedPolicy(first_element, gym.spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    result = record_episodes(ENV_ID, {"inf_elem": True}, None, policy, episodes, video_dir=None,
                             trajectories=True, expected=expected, end_reasons=reasons)
    assert result.mismatches == ()
    for replayed, row in zip(result.episodes, table.to_pylist(), strict=True):
        assert (replayed.end_reason, replayed.error) == (row["end_reason"], row["error"])


@pytest.mark.slow
def test_a_sandbox_gives_the_same_rows() -> None:
    columns = ("episode_index", "seed", "return", "length", "end_reason", "error")
    here, there = (_rows({}, level, 8, 3) for level in ("inprocess", "process"))
    assert [[r[c] for c in columns] for r in there] == [[r[c] for c in columns] for r in here]
    assert {r["end_reason"] for r in here} == {"terminated", "env_error"}
