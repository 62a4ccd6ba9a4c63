"""SIGTERM ends a waiting evaluation promptly, and takes its own server and cluster with it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment carries ``marker`` (the evaluation's own PREFECT_HOME)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_sigterm_while_the_run_stage_waits(tmp_path):
    home = tmp_path / "prefect-home"
    log = tmp_path / "cli.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               EVALFLEET_SERVER="ephemeral")  # the evaluation's own server, which must go with it
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "flows/eval.py", "--env", "tests.flows.render_envs:Slow-v0",
             "--policy", "tests.flows.user_envs:toward_goal", "--episodes", "40", "-v", "--concurrency",
             "2", "--workers", "1", "--no-cache", "--output", str(tmp_path / "out")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "Task run 'distribute-policy" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        time.sleep(3)  # the run stage is waiting on its shard (40 episodes at 0.5 s a step)
        assert _processes_with(str(home)), "the evaluation's server should be running"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
        took = time.monotonic() - t0
        time.sleep(2)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = _processes_with(str(home))
        for pid in left:  # never leave them behind, whatever failed
            os.kill(pid, signal.SIGKILL)
    assert code == 143, log.read_text()[-3000:]
    assert took < 60, took
    assert not left, f"processes left behind after SIGTERM: {left}"
