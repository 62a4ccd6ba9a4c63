"""The Dask scheduler dies mid-run: a clear ``ClusterLost`` error, and every finished shard kept.

A real ``dask scheduler`` and ``dask worker`` (subprocesses on 127.0.0.1) run an evaluation of
slow-stepping CartPole; once two shards have persisted, the scheduler is SIGKILLed. The
evaluation must fail with ``ClusterLost`` naming what finished, those episodes must be in the
cache's shard files, and a re-run on a working cluster must reuse them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from evalfleet.errors import ClusterLost
from evalfleet.models import EvalRequest

from .test_resume import FIELDS, ROOT, free_loopback_port

pytestmark = pytest.mark.slow


def test_scheduler_loss_fails_clearly_and_keeps_finished_shards(prefect_server: str,
                                                                 tmp_path: Path) -> None:
    from flows.eval import evaluate

    port = free_loopback_port()
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), DASK_DISTRIBUTED__WORKER__DAEMON="False")
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
                               "127.0.0.1", "--port", str(port), "--dashboard-address", ":0"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address,
                                   "--nworkers", "2", "--nthreads", "1", "--no-dashboard"],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True))
    out = tmp_path / "out"
    fields: dict[str, Any] = dict(FIELDS, isolation="inprocess", output=out, dask_address=address)
    outcome: list[BaseException | Any] = []

    def run() -> None:
        try:
            outcome.append(evaluate(EvalRequest.build(**fields)))
        except BaseException as err:  # handed to the test thread
            outcome.append(err)

    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 300
        while len(list(out.glob("cache/*/*/shards/*.parquet"))) < 2:
            assert thread.is_alive(), outcome
            assert time.monotonic() < deadline, "no shard persisted in time"
            time.sleep(0.05)
        procs[0].send_signal(signal.SIGKILL)
        thread.join(timeout=240)
        assert not thread.is_alive(), "the evaluation hung after its scheduler died"
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    [err] = outcome
    assert isinstance(err, ClusterLost), repr(err)
    files = list(out.glob("cache/*/*/shards/*.parquet"))
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    assert len(files) >= 2 and f"their {rows} episodes are persisted in the cache" in str(err), (
        str(err), rows)
    assert "run the same request again" in str(err)
