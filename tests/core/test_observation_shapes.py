"""An observation of another shape than the observation space's ends its episode as ``env_error``.

Written into the runner's float32 rows, numpy broadcast a shape-``(1,)`` observation into every
element of a ``(4,)`` row (and took a ``(1, 4)`` one as ``(4,)``): the policy acted on values the
env never produced, at every isolation level, with no error (the planted ``ShapeShift`` scored a
mean 189.9 against 179.1 in a plain loop, exit 0). Checked here through the worker's own entry
(``execute_shard``, which knows the observation space), in-process and in a sandbox, and in the
replays, which must end the same episodes at the same step. And an observation of the right shape
keeps it on its way: a Discrete space's int (shape ``()``) crossed the sandbox wire as ``(1,)``,
and a sandboxed replay was told no shape for it (the policy got ``(B, 1)`` rows, not ``(B,)``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from evalfleet import cluster, pipeline
from evalfleet.envspec import resolve_env
from evalfleet.models import EvalRequest
from evalfleet.planning import plan_shards
from evalfleet.policy import LoadedPolicy
from evalfleet.replay import ReplaySandbox, record_episodes, replay_inputs
from evalfleet.worker import execute_shard
from tests.core import quirky_envs as qe

LEVELS = ["inprocess", pytest.param("process", marks=pytest.mark.slow)]
TAIL = (": an observation of another shape than the observation space's is never broadcast or "
        "reshaped to fit it")


def _worker_rows(kwargs: dict[str, Any], n: int, slots: int, isolation: str, env: str = qe.SHAPE_SHIFT,
                 policy: str = "tests.core.quirky_envs:sum2") -> list[dict[str, Any]]:
    """Rows of one shard run by the worker's entry point in this process (no Dask)."""
    request = EvalRequest.build(env=env, env_kwargs=kwargs, policy=policy, episodes=n,
                                concurrency=slots, seed=0, isolation=isolation)
    received = pipeline.receive(request)
    handle = cluster.distribute(received.artifact, None, "cpu", True)
    [shard] = plan_shards(request.request_id, 0, range(n), slots, 1).shards
    return execute_shard(shard, handle, request, isolation).sort_by("episode_index").to_pylist()


def _plain(kwargs: dict[str, Any], seed: int) -> tuple[float, int, tuple[int, ...] | None, str]:
    """(return, length, odd shape or None, when) of a plain loop stopped at the first odd shape."""
    env = gym.make(qe.SHAPE_SHIFT, disable_env_checker=True, **kwargs)
    obs, _ = env.reset(seed=seed)
    if np.shape(obs) != (4,):
        return 0.0, 0, np.shape(obs), "at reset"
    total, length = 0.0, 0
    while True:
        obs, reward, terminated, truncated, _ = env.step(int(qe.sum2(np.asarray(obs, np.float32)[None])[0]))
        if terminated or truncated:
            return total + float(reward), length + 1, None, ""
        if np.shape(obs) != (4,):  # the step that returned it is not counted, as a raising step
            return total, length, np.shape(obs), f"at step {length + 1}"
        total, length = total + float(reward), length + 1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kwargs", [{}, {"extra_axis": True}, {"at_reset": True}],
                         ids=["one-element", "extra-axis", "at-reset"])
def test_an_observation_of_another_shape_is_the_envs_error(level: str, kwargs: dict[str, Any]) -> None:
    rows = _worker_rows(kwargs, 12, 4, level)
    odd = 0
    for row in rows:
        ret, length, shape, when = _plain(kwargs, row["seed"])
        assert (row["return"], row["length"]) == (ret, length), row["episode_index"]
        assert shape is not None  # every episode meets one before its end
        odd += when == "at reset"
        assert row["end_reason"] == "env_error"
        assert row["error"] == f"observation of shape {shape} {when}, expected (4,){TAIL}"
    assert (odd > 0) == bool(kwargs.get("at_reset"))


@pytest.mark.parametrize("level", LEVELS)
def test_replays_end_the_same_episodes_at_the_same_step(level: str) -> None:
    import pyarrow as pa

    from evalfleet.records import EPISODE_SCHEMA

    kwargs = {"at_reset": True}
    table = pa.Table.from_pylist(_worker_rows(kwargs, 8, 4, "inprocess"), EPISODE_SCHEMA)
    episodes, expected, reasons = replay_inputs(table, list(range(8)))
    sandbox = None
    if level != "inprocess":
        env = resolve_env(qe.SHAPE_SHIFT, kwargs, None)
        sandbox = ReplaySandbox(level, 60.0, env.fingerprint.as_dict(), obs_shape=(4,))
    policy = LoadedPolicy(qe.sum2, gym.spaces.Discrete(2), is_torch=False, deterministic=True,
                          device="cpu")
    result = record_episodes(qe.SHAPE_SHIFT, kwargs, None, policy, episodes, video_dir=None,
                             trajectories=True, expected=expected, end_reasons=reasons,
                             sandbox=sandbox)
    assert result.mismatches == ()
    for replayed, row in zip(result.episodes, table.to_pylist(), strict=True):
        assert replayed.end_reason == "env_error"
        assert row["error"] in (replayed.error or "")  # a sandbox's names its exception type


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
