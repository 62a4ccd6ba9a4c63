"""Errors once an evaluation has begun: named for what happened, and not exit 2 (a bad request)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from distributed.scheduler import KilledWorker

from evalfleet.cli import EXIT_BAD_REQUEST, EXIT_STOPPED_MIDWAY, run_cli
from evalfleet.errors import ClusterLost, RequestError
from evalfleet.models import Shard
from tasks.run_episodes import worker_killed


@pytest.mark.parametrize("error,code", [
    (ClusterLost("the Dask scheduler was lost during the run stage"), EXIT_STOPPED_MIDWAY),
    (RequestError("--episodes must be positive"), EXIT_BAD_REQUEST),
])
def test_an_error_after_the_start_is_no_bad_request(error, code, capsys, example_policy,
                                                     tmp_path) -> None:
    # ClusterLost (workers lost after shards had finished) exited 2, "bad request (nothing was
    # spawned)": a caller fixed a request that was fine instead of running it again.
    def evaluate(request):
        raise error

    assert run_cli(evaluate, ["--policy", example_policy, "--episodes", "4",
                              "--output", str(tmp_path)]) == code
    assert f"evalfleet: error: {error}" in capsys.readouterr().err


def test_a_shard_that_kills_its_workers_is_named_with_what_to_do() -> None:
    # Passed on as is: "KilledWorker: Attempted to run task 'run_episodes-…' on 4 different
    # workers", exit 1, nothing about the policy or which episodes.
    plan = [Shard(shard_id=i, episode_indices=list(range(8 * i, 8 * i + 8)),
                  seeds=list(range(8)), slots=8) for i in range(5)]
    err = KilledWorker("run_episodes-3f2a", SimpleNamespace(address="tcp://127.0.0.1:4000"),
                       allowed_failures=3)
    killed = worker_killed(err, 2, plan, finished=2)
    assert killed is not None
    text = str(killed)
    assert text.startswith("shard 3 of 5 (episodes 16-23, 8 of them) killed every Dask worker "
                           "that ran it (4 workers, then Dask gave up)"), text
    assert "The policy always runs in the worker" in text and "--isolation process" in text
    assert "2 finished shards are persisted in the cache" in text
    assert worker_killed(ValueError("no"), 2, plan, finished=2) is None
