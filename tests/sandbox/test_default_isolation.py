"""Under the DEFAULT settings a segfaulting env costs rows, not workers; lost workers rejoin.

``auto`` (the default) runs envs that ship with neither gymnasium nor evalfleet in ``process``
sandboxes, so the planted env that segfaults on ~10% of seeds ends as ``crashed`` rows while
the evaluation completes. A worker that joins mid-evaluation gets the policy too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from evalfleet.cluster import client_for, fleet_cluster
from evalfleet.models import EvalRequest
from evalfleet.records import OUTCOME_COLUMNS

from . import faulty_envs as fe

pytestmark = pytest.mark.slow


def test_segfaulting_env_under_default_settings(prefect_server: str, tmp_path: Path) -> None:
    from flows.eval import evaluate

    request = EvalRequest.build(env=fe.env_id("Segfault"), policy=f"{fe.__name__}:balance",
                                episodes=40, concurrency=8, workers=2, seed=5,
                                output=tmp_path / "out")
    assert request.isolation == "auto"
    report = evaluate(request)

    assert report.isolation == "process"
    table = pq.read_table(report.outputs["episodes"]).sort_by("episode_index").to_pylist()
    assert len(table) == 40
    faulty = [r for r in table if fe.is_faulty(r["seed"])]
    healthy = [r for r in table if not fe.is_faulty(r["seed"])]
    assert faulty and healthy
    for row in faulty:
        assert row["end_reason"] == "crashed", row
        assert "SIGSEGV" in row["error"]
        assert row["retried"] == 2
    for row in healthy:
        assert row["end_reason"] in ("terminated", "truncated") and row["error"] is None, row
    assert {r["isolation"] for r in table} == {"process"}
    assert report.failures == {"crashed": len(faulty)}


def test_worker_killed_mid_evaluation_inprocess(prefect_server: str, tmp_path: Path,
                                                example_policy: str) -> None:
    """SIGKILL a worker while shards run at ``inprocess``: the evaluation completes, every row
    equals an undisturbed run's, and the replacement worker runs shards with the policy."""
    from flows.eval import evaluate

    with fleet_cluster(None, 2) as address:
        client = client_for(address)
        base = dict(env=fe.env_id("SlowStep"), policy=example_policy, episodes=48, concurrency=4,
                    isolation="inprocess", dask_address=address, seed=3, max_steps=150)
        undisturbed = evaluate(EvalRequest.build(**base, output=tmp_path / "undisturbed"))
        before = client.run(os.getpid)
        victim = sorted(before.values())[0]
        killed: dict[str, Any] = {}

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if sum(len(v) for v in client.processing().values()) >= 2:
                    time.sleep(0.3)
                    os.kill(victim, signal.SIGKILL)
                    killed["at"] = time.monotonic()
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        disturbed = evaluate(EvalRequest.build(**base, output=tmp_path / "disturbed"))
        killer.join()
        after = client.run(os.getpid)

    assert "at" in killed, "no shard was running when the killer looked"
    assert victim not in after.values() and len(after) == 2  # the nanny replaced the worker
    assert disturbed.episodes == 48 and disturbed.completed == 48 and disturbed.failures == {}

    def outcomes(report: Any) -> list[dict[str, Any]]:
        table = pq.read_table(report.outputs["episodes"]).sort_by("episode_index")
        return table.select(list(OUTCOME_COLUMNS)).to_pylist()

    assert outcomes(disturbed) == outcomes(undisturbed)


def test_worker_joining_later_receives_the_policy(example_policy: str) -> None:
    """A worker that replaces a killed one, after stage 3, runs a shard of a file policy."""
    from evalfleet import cluster, pipeline
    from evalfleet.planning import plan_shards
    from evalfleet.worker import execute_shard

    request = EvalRequest.build(env="CartPole-v1", policy=example_policy, episodes=6,
                                concurrency=3, isolation="inprocess", max_steps=50)
    received = pipeline.receive(request)
    with fleet_cluster(None, 2) as address:
        client = client_for(address)
        handle = cluster.distribute(received.artifact, address, "cpu", True)
        pids = client.run(os.getpid)
        victim = sorted(pids.values())[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 90
        new: list[str] = []
        while time.monotonic() < deadline and not new:
            time.sleep(0.2)
            workers = set(client.scheduler_info(n_workers=-1)["workers"])
            new = sorted(workers - set(pids))
        assert len(new) == 1, "the nanny did not replace the killed worker"
        [shard] = plan_shards(request.request_id, 0, range(6), 3, 1).shards
        future = client.submit(execute_shard, shard, handle, request, "inprocess",
                               workers=new, allow_other_workers=False, pure=False)
        table = future.result(timeout=120)
        cluster.release(handle, address)
    assert table.num_rows == 6
    assert set(table.column("end_reason").to_pylist()) <= {"terminated", "truncated"}


def test_failed_run_stage_leaves_no_shard_behind(prefect_server: str, tmp_path: Path,
                                                 example_policy: str) -> None:
    """Explicit ``inprocess`` with a segfaulting env: the evaluation fails (``WorkerKilled``, Dask's
    KilledWorker named), and no shard of it is left queued to start, after the policy is
    released, on a new worker."""
    from flows.eval import evaluate

    def leftovers(dask_scheduler: Any) -> list[str]:
        return [str(k) for k, ts in dask_scheduler.tasks.items()
                if "run_episodes" in str(k) and ts.state not in ("memory", "erred", "released",
                                                                   "forgotten")]

    with fleet_cluster(None, 2) as address:
        client = client_for(address)
        request = EvalRequest.build(env=fe.env_id("Segfault"), policy=example_policy,
                                    episodes=160, concurrency=32, isolation="inprocess",
                                    dask_address=address, seed=1, output=tmp_path / "out")
        with pytest.raises(Exception, match=r"shard \d of \d \(episodes \d+-\d+, \d+ of them\) killed "
                                            "every Dask worker that ran it|died while running"):
            evaluate(request)
        deadline = time.monotonic() + 15
        left = client.run_on_scheduler(leftovers)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = client.run_on_scheduler(leftovers)
    assert left == [], f"shards still queued or running after the evaluation failed: {left}"
