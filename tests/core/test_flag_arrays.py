"""An env whose ``terminated`` or ``truncated`` has no truth value fails its episode, not the run.

In-process, the flag's truth value was taken outside the ``try`` that makes an env's fault its
episode's ``env_error``: a two-element array failed the whole evaluation (exit 1, "The truth
value of an array with more than one element is ambiguous", no env, seed or step named), where
a sandbox made each such episode an ``env_error`` row. Now it is that row at every level.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from evalfleet import cluster, pipeline
from evalfleet.models import EvalRequest
from evalfleet.planning import plan_shards
from evalfleet.sandbox.base import InProcessSlots
from evalfleet.worker import execute_shard
from tests.core.flag_envs import BAD_STEP, ENV_ID, TwoFlagsEnv

AMBIGUOUS = "ValueError: The truth value of an array with more than one element is ambiguous"
COLUMNS = ("episode_index", "seed", "return", "length", "end_reason")


def _rows(which: str, isolation: str, n: int = 12, slots: int = 4) -> list[dict[str, Any]]:
    """Rows of one shard run by the worker's entry point in this process (no Dask)."""
    request = EvalRequest.build(env=ENV_ID, env_kwargs={"which": which}, policy="tests.core.flag_envs:zeros",
                                episodes=n, concurrency=slots, seed=0, isolation=isolation)
    received = pipeline.receive(request)
    handle = cluster.distribute(received.artifact, None, "cpu", True)
    [shard] = plan_shards(request.request_id, 0, range(n), slots, 1).shards
    return execute_shard(shard, handle, request, isolation).sort_by("episode_index").to_pylist()


@pytest.mark.parametrize("which", ["terminated", "truncated"])
def test_a_flag_of_two_elements_is_the_envs_error_in_process(which: str) -> None:
    rows = _rows(which, "inprocess")
    bad = [r for r in rows if r["end_reason"] != "terminated"]
    assert 2 <= len(bad) <= 10  # about half the seeds
    for row in bad:  # the step that returned it is not counted, as a step that raised
        assert (row["end_reason"], row["length"], row["return"]) == ("env_error", BAD_STEP - 1, 3.0)
        assert row["error"].startswith(AMBIGUOUS)
    assert all((r["length"], r["return"]) == (10, 10.0) for r in rows if r["end_reason"] == "terminated")


def test_step_many_makes_it_the_slots_env_error_too() -> None:
    slots = InProcessSlots(lambda: TwoFlagsEnv("truncated"), 1)
    seed = next(s for s in range(100) if np.random.default_rng(s).integers(2))  # an odd draw
    try:
        assert slots.reset(0, seed).failure is None
        outs = [slots.step_many([0], [0])[0] for _ in range(BAD_STEP)]
    finally:
        slots.close()
    assert [o.failure for o in outs] == [None] * (BAD_STEP - 1) + ["env_error"]
    assert (outs[-1].error or "").startswith(AMBIGUOUS)
    assert [type(o.terminated) for o in outs[:-1]] == [bool] * (BAD_STEP - 1)


@pytest.mark.slow
def test_every_isolation_level_gives_the_same_rows() -> None:
    here, there = (_rows("terminated", level, 8, 3) for level in ("inprocess", "process"))
    assert [[r[c] for c in COLUMNS] for r in there] == [[r[c] for c in COLUMNS] for r in here]
    assert {r["end_reason"] for r in here} == {"terminated", "env_error"}
