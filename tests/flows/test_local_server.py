"""The shared local Prefect server: started once, found again by other processes, replaced, stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalfleet.server import alive, describe, read_state, server_command, stop_server

ROOT = Path(__file__).resolve().parents[2]
CLAIM = ("from evalfleet.server import ensure_server; s = ensure_server(); "
         "print(s.url, s.pid, flush=True)")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private EVALFLEET_HOME whose server is always stopped at teardown."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "efhome"))
    yield tmp_path / "efhome"
    stop_server()


def _record(home: Path, pid: int, port: int, started: float) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "server.json").write_text(json.dumps(
        {"url": f"http://127.0.0.1:{port}/api", "port": port, "pid": pid, "started": started,
         "prefect_home": str(home / "prefect")}))


def test_a_recycled_pid_is_never_signalled(home):
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        _record(home, other.pid, 9, time.time() - 3600)
        assert stop_server() is not None and read_state() is None  # the record goes ...
        assert other.poll() is None  # ... the process that now has its pid stays
    finally:
        other.kill()
        other.wait()


def test_a_record_of_a_dead_process_is_reported_stale(home):
    proc = subprocess.Popen(["true"])
    proc.wait()
    _record(home, proc.pid, 9, time.time())
    assert not alive(proc.pid)
    assert describe().startswith(f"not running (stale record of pid {proc.pid}")
    assert server_command("status") == 1


@pytest.mark.slow
def test_concurrent_first_runs_share_one_server_that_replaces_a_hung_one(home, capsys):
    # A recorded "server" that is alive but has not answered for far longer than a start takes
    # (its command line says "prefect server", as a real one's does).
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "prefect",
                             "server", "start"], start_new_session=True)
    _record(home, hung.pid, 9, time.time() - 3600)
    env = dict(os.environ, PYTHONPATH=str(ROOT), EVALFLEET_HOME=str(home))
    env.pop("PREFECT_API_URL", None)
    try:
        claims = [subprocess.Popen([sys.executable, "-c", CLAIM], env=env, cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for _ in range(2)]
        found = [c.communicate(timeout=300) for c in claims]
        assert all(c.returncode == 0 for c in claims), [err[-2000:] for _, err in found]
        (url_a, pid_a), (url_b, pid_b) = (out.split() for out, _ in found)
        assert (url_a, pid_a) == (url_b, pid_b)  # one server for both
        assert hung.wait(timeout=20) == -signal.SIGTERM  # the hung record's process was ended
        state = read_state()
        assert state is not None and (state.url, state.pid) == (url_a, int(pid_a))
        assert int(pid_a) != hung.pid and alive(state.pid)

        # A later process finds it again (no new pid), and status reports it.
        again = subprocess.run([sys.executable, "-c", CLAIM], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert again.stdout.split() == [url_a, pid_a], again.stderr[-2000:]
        capsys.readouterr()
        assert server_command("status") == 0
        shown = capsys.readouterr().out
        assert f"url      {url_a}" in shown and f"pid      {pid_a}" in shown and "healthy" in shown

        assert server_command("stop") == 0
        assert f"stopped the local Prefect server at {url_a}" in capsys.readouterr().out
        assert not alive(state.pid) and read_state() is None
    finally:
        if hung.poll() is None:
            hung.kill()


def test_the_evalfleet_command_has_server_status(home, capsys):
    from flows.console import main

    assert main(["server", "status"]) == 1
    assert f"no local Prefect server recorded in {home / 'server.json'}" in capsys.readouterr().out
    assert main(["server", "stop"]) == 0
    assert "no local Prefect server recorded" in capsys.readouterr().out


@pytest.mark.slow
def test_later_cli_runs_log_mlflow_through_the_shared_logger(home, tmp_path, example_policy):
    """Issue 15: a CLI run with the shared server up imports no MLflow; its run is logged all the same."""
    import re

    from mlflow.tracking import MlflowClient

    from evalfleet import mlflow_logger

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), EVALFLEET_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    args = [sys.executable, "-X", "importtime", "flows/eval.py", "--policy", example_policy,
            "--episodes", "6", "--concurrency", "3", "--workers", "1", "--output",
            str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")]
    first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    deadline = time.monotonic() + 120
    while (record := mlflow_logger.read_record()) is None or record.address is None:
        assert time.monotonic() < deadline, (home / "mlflow-logger.log").read_text()
        time.sleep(0.2)
    assert alive(record.pid) and "shared logger pid" in mlflow_logger.describe()

    hit = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert hit.returncode == 0, hit.stderr[-3000:]
    assert re.search(r"cache\s+hit \(reused 6\)", hit.stdout), hit.stdout
    imported = {m.group(1) for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", hit.stderr, re.M)}
    assert not {m for m in imported if m.split(".")[0] == "mlflow"}
    ids = re.findall(r"mlflow_run_id\s+(\w+)", first.stdout + hit.stdout)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    miss_run, hit_run = (client.get_run(i) for i in ids)
    assert hit_run.info.status == "FINISHED" and hit_run.info.run_id != miss_run.info.run_id
    assert hit_run.data.metrics["eval/reward"] == miss_run.data.metrics["eval/reward"] > 0
    assert hit_run.data.tags["evalfleet.request_id"] != miss_run.data.tags["evalfleet.request_id"]

    stop_server()
    assert not alive(record.pid) and mlflow_logger.read_record() is None


@pytest.mark.slow
def test_later_cli_runs_fork_their_workers_from_the_shared_fork_server(home, tmp_path, example_policy):
    """Issue 15: a CLI run with the shared server up imports nothing for its workers; same episodes."""
    import pyarrow.parquet as pq

    from evalfleet import warm_forkserver

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), EVALFLEET_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    args = [sys.executable, "flows/eval.py", "--policy", example_policy, "--episodes", "6",
            "--concurrency", "3", "--workers", "1", "--no-cache", "-v"]

    def run(name: str, **extra: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
        done = subprocess.run([*args, "--output", str(tmp_path / name)], cwd=ROOT, env={**env, **extra},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        table = pq.read_table(next((tmp_path / name).glob("runs/*/episodes.parquet")))
        return done, table.select(["episode_index", "seed", "return", "length"]).sort_by(
            "episode_index").to_pylist()

    first, episodes = run("first")
    deadline = time.monotonic() + 120
    while (record := warm_forkserver.read_record()) is None or record.manifest is None:
        assert time.monotonic() < deadline, (home / "fork-server.log").read_text()
        time.sleep(0.2)
    assert "workers fork from the shared fork server" not in first.stderr

    second, again = run("second")
    assert f"workers fork from the shared fork server (pid {record.pid})" in second.stderr
    assert again == episodes
    assert alive(record.pid) and not warm_forkserver._children(record.pid)  # its workers went

    off, apart = run("off", EVALFLEET_WARM_WORKERS="off")
    assert "workers fork from the shared fork server" not in off.stderr and apart == episodes

    stop_server()
    assert not alive(record.pid) and warm_forkserver.read_record() is None
