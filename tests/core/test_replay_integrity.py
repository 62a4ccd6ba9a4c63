"""Replays end an episode where the runner did: a NaN observation, a return past 1e100.

Replayed on, a deterministic env's NaN observation (the runner's ``env_error`` at that step) or a
return beyond ``MAX_ABS_VALUE`` (its ``invalid_reward``) went on to the episode's end: each such
episode "differed from its row", a false ``replay_nondeterminism`` alarm that also dropped the
table from the cache, and its trajectory showed steps that never ran.
"""

from __future__ import annotations

import gymnasium as gym
import pyarrow as pa
import pytest

from evalfleet import cluster, pipeline
from evalfleet.models import EvalRequest
from evalfleet.planning import plan_shards
from evalfleet.policy import LoadedPolicy
from evalfleet.records import EPISODE_SCHEMA
from evalfleet.replay import record_episodes, replay_inputs
from evalfleet.worker import execute_shard
from tests.core import quirky_envs as qe

BREAKS = "tests.core.quirky_envs:Breaks-v0"


def _rows(mode: str, n: int) -> pa.Table:
    request = EvalRequest.build(env=BREAKS, env_kwargs={"mode": mode}, policy="tests.core.quirky_envs:sum2",
                                episodes=n, concurrency=4, seed=0, isolation="inprocess")
    received = pipeline.receive(request)
    handle = cluster.distribute(received.artifact, None, "cpu", True)
    [shard] = plan_shards(request.request_id, 0, range(n), 4, 1).shards
    rows = execute_shard(shard, handle, request, "inprocess").sort_by("episode_index").to_pylist()
    return pa.Table.from_pylist(rows, EPISODE_SCHEMA)


@pytest.mark.parametrize("mode, reason, length, error", [
    ("nan", "env_error", 3, "observation has NaN at step 3 (element(s) [1] of 2): the env produced "
                            "no state to act on"),
    ("huge", "invalid_reward", 17, "after step 17 exceeds 1e+100 in magnitude"),
])
def test_replays_of_broken_episodes_end_where_their_rows_did(mode, reason, length, error) -> None:
    table = _rows(mode, 8)
    broken = [r for r in table.to_pylist() if r["end_reason"] == reason]
    assert broken and all(r["length"] == length and error in r["error"] for r in broken)
    episodes, expected, reasons = replay_inputs(table, list(range(8)))
    policy = LoadedPolicy(qe.sum2, gym.spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    result = record_episodes(BREAKS, {"mode": mode}, None, policy, episodes, video_dir=None,
                             trajectories=True, expected=expected, end_reasons=reasons)
    assert result.mismatches == ()  # before: each broken episode, replayed to step 20
    for replayed, row in zip(result.episodes, table.to_pylist(), strict=True):
        assert (replayed.end_reason, replayed.length) == (row["end_reason"], row["length"])
    # The trajectory holds the steps that ran, no more: a broken episode's last row is its last step.
    steps = result.trajectories.to_pylist()
    for row in broken:
        assert max(r["step"] for r in steps if r["episode_index"] == row["episode_index"]) == length - 1
