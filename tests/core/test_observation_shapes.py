"""Observations keep their shape on their way to the policy, in a sandbox as in-process.

A Discrete observation space's int observation (shape ``()``) crossed the sandbox wire as a
``(1,)`` array, and a sandboxed replay was told no shape for it: the policy got ``(B, 1)`` rows
where in-process it got ``(B,)``. Run through the worker's own entry (``execute_shard``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import pytest

from evalfleet import cluster, pipeline
from evalfleet.models import EvalRequest
from evalfleet.planning import plan_shards
from evalfleet.policy import LoadedPolicy
from evalfleet.replay import record_episodes, replay_inputs
from evalfleet.worker import execute_shard
from tests.core import quirky_envs as qe


def _worker_rows(kwargs: dict[str, Any], n: int, slots: int, isolation: str, env: str = qe.SHAPE_SHIFT,
                 policy: str = "tests.core.quirky_envs:sum2") -> list[dict[str, Any]]:
    """Rows of one shard run by the worker's entry point in this process (no Dask)."""
    request = EvalRequest.build(env=env, env_kwargs=kwargs, policy=policy, episodes=n,
                                concurrency=slots, seed=0, isolation=isolation)
    received = pipeline.receive(request)
    handle = cluster.distribute(received.artifact, None, "cpu", True)
    [shard] = plan_shards(request.request_id, 0, range(n), slots, 1).shards
    return execute_shard(shard, handle, request, isolation).sort_by("episode_index").to_pylist()


@pytest.mark.slow
def test_a_discrete_observation_keeps_its_shape_in_a_sandbox() -> None:
    # The wire made FrozenLake's int observation (shape ()) a (1,) array: the policy got (B, 1)
    # rows in a sandbox, (B,) in-process, and one answering in its input's shape ended every
    # episode as its own invalid_action at process level, none in-process.
    columns = ("episode_index", "seed", "return", "length", "end_reason", "error")
    here, there = (_worker_rows({}, 8, 3, level, "FrozenLake-v1", "tests.core.quirky_envs:lake")
                   for level in ("inprocess", "process"))
    assert [[r[c] for c in columns] for r in there] == [[r[c] for c in columns] for r in here]
    assert {r["end_reason"] for r in here} == {"terminated"}


@pytest.mark.slow
def test_a_sandboxed_replay_gives_a_discrete_observation_its_shape() -> None:
    # FrozenLake's observation is one int (shape ()): the replay's sandbox was told no shape, so
    # the policy got (1, 1) rows instead of (1,), and a policy answering in its input's shape
    # ended every replay as invalid_action at step 0: a replay_nondeterminism false alarm.
    import pyarrow as pa

    from evalfleet.records import EPISODE_SCHEMA
    from evalfleet.review_replays import replay_sandbox

    request = EvalRequest.build(env="FrozenLake-v1", policy="tests.core.quirky_envs:lake",
                                episodes=6, concurrency=3, seed=0, isolation="process")
    sandbox = replay_sandbox(request, "process")
    rows = _worker_rows({}, 6, 3, "inprocess", "FrozenLake-v1", "tests.core.quirky_envs:lake")
    assert {r["end_reason"] for r in rows} <= {"terminated", "truncated"}
    table = pa.Table.from_pylist(rows, EPISODE_SCHEMA)
    episodes, expected, reasons = replay_inputs(table, list(range(6)))
    policy = LoadedPolicy(qe.lake, gym.spaces.Discrete(4), is_torch=False, deterministic=True,
                          device="cpu")
    result = record_episodes("FrozenLake-v1", {}, None, policy, episodes, video_dir=None,
                             trajectories=True, expected=expected, end_reasons=reasons,
                             sandbox=sandbox)
    assert result.mismatches == ()
    assert [(e.episode_return, e.length) for e in result.episodes] == [
        (r["return"], r["length"]) for r in rows]
