"""The Prefect server dies mid-evaluation: the result is complete all the same, and says what was lost.

Real components: a ``prefect server start`` of its own (SIGKILLed and started again on the same
port and database), the CLI in a subprocess, a local Dask cluster, MLflow's SQLite store.

1. The server is killed once a shard has persisted and started again at once: the evaluation
   exits 0 with every episode in Parquet, the cache and MLflow (what the UI lacks, if anything,
   is named in its report); the flow run ends Completed on the new server (by Prefect's own
   retries, or, if the new server took longer than those, by the next evaluation).
2. The server is killed and stays down until the evaluation has ended: the same, with the flow
   run's final state queued; the next evaluation's reaper records it Completed (not Crashed).

Before: the first failed call (the progress artifact's update) failed the flow; the CLI exited 1
with "the evaluation failed: ConnectError" and wrote no Parquet, no cache entry, no MLflow run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from evalfleet.cache import EpisodeCache
from evalfleet.tracking import default_tracking_uri
from tests.prefect_servers import PrefectServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EPISODES, SHARD = 96, 8


def cli(output: Path, seed: int) -> list[str]:
    return [sys.executable, "flows/eval.py", "--env", "tests.sandbox.faulty_envs:evalfleet-test/SlowStep-v0",
            "--policy", "tests.sandbox.faulty_envs:balance", "--episodes", str(EPISODES),
            "--concurrency", "4", "--max-steps", "60", "--shard-episodes", str(SHARD),
            "--seed", str(seed), "--workers", "2", "--output", str(output), "--quiet"]


def free_loopback_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_killing_server(server: PrefectServer, output: Path, seed: int, env: dict[str, str],
                       restart: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI; SIGKILL the server once a shard has persisted (and start it again)."""
    driver = subprocess.Popen(cli(output, seed), cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 400
    while not list(output.glob("cache/*/*/shards/*.parquet")):
        if driver.poll() is not None:
            out, err = driver.communicate()
            pytest.fail(f"the evaluation ended before a shard persisted: {out[-2000:]} {err[-3000:]}")
        assert time.monotonic() < deadline, "no shard persisted in time"
        time.sleep(0.05)
    server.kill()
    killed = time.time()
    if restart:
        server.start()
    out, err = driver.communicate(timeout=600)
    return subprocess.CompletedProcess(driver.args, driver.returncode, out, err), killed


def flow_run_state(url: str, request_id: str) -> tuple[str, str]:
    """(state type, message) of the evaluation's flow run on the server at ``url``."""
    import httpx

    runs = httpx.post(f"{url}/flow_runs/filter", json={"limit": 50}, timeout=10).json()
    [run] = [r for r in runs if r["name"].endswith(request_id)]
    return run["state_type"], run["state"]["message"] or ""


def check_result(output: Path, proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    """The evaluation exited 0 with Parquet, the cache, report.json and MLflow complete."""
    import mlflow

    assert proc.returncode == 0, proc.stderr[-4000:]
    [report_path] = output.glob("runs/*/report.json")
    report = json.loads(report_path.read_text())
    outputs = report["outputs"]
    assert pq.read_metadata(outputs["episodes"]).num_rows == EPISODES
    assert report["episodes"] == EPISODES and report["coverage"] == 1.0
    key = report["cache"]["key"]
    assert EpisodeCache(output / "cache").lookup(key, range(EPISODES)).status == "hit"
    run = mlflow.MlflowClient(default_tracking_uri(output)).get_run(outputs["mlflow_run_id"])
    assert run.data.metrics["eval/reward"] == pytest.approx(report["returns"]["mean"])
    if "prefect_lost" in outputs:  # in the summary too, not only in a file
        assert "prefect_lost" in proc.stdout and "are complete" in outputs["prefect_lost"]
    return report


def test_a_prefect_server_restart_costs_the_ui_not_the_result(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.reaper import reap_dead_drivers

    server = PrefectServer(tmp_path / "prefect-home", free_loopback_port())
    home = tmp_path / "evalfleet-home"
    env = dict(os.environ, PREFECT_API_URL=server.url, EVALFLEET_HOME=str(home),
               PYTHONPATH=str(ROOT))
    server.start()
    try:
        # 1. Killed and started again at once, while the run stage goes on.
        proc, killed = run_killing_server(server, tmp_path / "restart", 1, env, restart=True)
        report = check_result(tmp_path / "restart", proc)  # Prefect's client retried meanwhile

        # 2. Killed, and down until the evaluation has ended: fewer retries keep the test short.
        proc2, _ = run_killing_server(server, tmp_path / "down", 2, dict(
            env, PREFECT_CLIENT_MAX_RETRIES="1"), restart=False)
        report2 = check_result(tmp_path / "down", proc2)
        lost2 = str(report2["outputs"]["prefect_lost"])  # type: ignore[index]
        assert "the flow run's final state (Completed; queued" in lost2, lost2
        assert "the summary artifact" in lost2 and "the report artifact" in lost2
        assert "prefect_lost" in proc2.stdout
        [pending] = (home / "prefect-pending").glob("*.json")

        server.start()  # back on the same port and database: the next evaluation's reaper runs
        saved = os.environ.get("EVALFLEET_HOME")
        os.environ["EVALFLEET_HOME"] = str(home)
        try:
            with temporary_settings(updates={PREFECT_API_URL: server.url}):
                reap_dead_drivers()
        finally:
            if saved is None:
                os.environ.pop("EVALFLEET_HOME", None)
            else:
                os.environ["EVALFLEET_HOME"] = saved
        assert not pending.exists()
        state, message = flow_run_state(server.url, str(report2["request_id"]))
        assert (state, "recorded late by the next evaluation" in message) == ("COMPLETED", True)
        state, message = flow_run_state(server.url, str(report["request_id"]))
        assert state == "COMPLETED", (state, message, killed)
    finally:
        server.stop()
