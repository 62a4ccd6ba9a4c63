"""SIGKILL a Dask worker in the middle of an evaluation: no episode is lost, the table is unchanged.

Runs the real flow (``flows.eval.evaluate``) against a real Prefect API and a local cluster built
by evalfleet's own code, at the ``process`` level so the killed worker also had a fork server and
sandboxes, which must die with it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest

from evalfleet.cluster import client_for, fleet_cluster
from evalfleet.models import EvalRequest
from evalfleet.records import OUTCOME_COLUMNS

from . import faulty_envs as fe

pytestmark = pytest.mark.slow

SERVER_MODULE = "evalfleet.sandbox.forkserver"


def sandbox_tree(pid: int) -> list[psutil.Process]:
    """The fork servers and sandboxes below process ``pid``."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [k for k in kids if _is_sandbox(k)]


def _is_sandbox(proc: psutil.Process) -> bool:
    try:
        return SERVER_MODULE in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def table_of(report: Any) -> list[dict[str, Any]]:
    table = pq.read_table(report.outputs["episodes"]).sort_by("episode_index")
    return table.select(list(OUTCOME_COLUMNS)).to_pylist()


def test_sigkill_worker_mid_evaluation(prefect_server: str, tmp_path: Path) -> None:
    from flows.eval import evaluate

    with fleet_cluster(None, 2) as address:
        client = client_for(address)
        base = dict(env="CartPole-v1", policy=f"{fe.__name__}:balance", episodes=240,
                    concurrency=24, isolation="process", dask_address=address, seed=11,
                    episode_timeout_s=60.0)
        undisturbed = evaluate(EvalRequest.build(**base, output=tmp_path / "undisturbed"))

        victim = sorted(client.run(os.getpid).values())[0]
        killed: dict[str, Any] = {}

        def kill_when_busy() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                tree = sandbox_tree(victim)
                if len(tree) > 5:  # the fork server and several sandboxes: a shard is running
                    time.sleep(0.5)
                    killed["tree"] = sandbox_tree(victim)
                    os.kill(victim, signal.SIGKILL)
                    killed["at"] = time.monotonic()
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        disturbed = evaluate(EvalRequest.build(**base, output=tmp_path / "disturbed"))
        killer.join()

    assert "at" in killed, "the victim never ran a shard"
    assert disturbed.episodes == undisturbed.episodes == 240
    assert table_of(disturbed) == table_of(undisturbed)
    assert disturbed.failures == undisturbed.failures
    # The killed worker's fork server and sandboxes died with it (parent-death signals).
    time.sleep(1.0)
    survivors = [p for p in killed["tree"] if p.is_running() and
                 p.status() != psutil.STATUS_ZOMBIE]
    assert survivors == [], f"orphaned sandbox processes: {survivors}"
