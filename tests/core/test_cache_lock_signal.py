"""A wait on a cache lock ends on SIGTERM and Ctrl-C, with a message and a non-zero exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalfleet.cache import EpisodeCache

ROOT = Path(__file__).resolve().parents[2]
KEY = "c" * 64

# The real CLI entry (argument parsing, signal handling, exit codes) with an evaluation that
# needs the key the test holds: the shape of a second identical request, or of a baseline.
WAITER = f"""
import sys
from pathlib import Path
from evalfleet.cache import EpisodeCache
from evalfleet.cli import EXAMPLE_POLICY, run_cli

def evaluate(request):
    print("waiting", flush=True)
    with EpisodeCache(Path(sys.argv[1])).exclusive({KEY!r}):
        raise AssertionError("the lock was held by the test")

raise SystemExit(run_cli(evaluate, ["--policy", EXAMPLE_POLICY, "--output", sys.argv[1]]))
"""


# The same wait inside a Prefect flow run, whose engine installs its own SIGTERM handler.
FLOW_WAITER = WAITER.replace("def evaluate(request):", """
from prefect import flow

@flow
def evaluate(request):""")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_process_waiting_on_a_cache_lock_stops_on_a_signal(tmp_path, sig, code):
    _wait_and_signal(tmp_path, WAITER, sig, code, within=5.0)


@pytest.mark.slow
def test_a_flow_waiting_on_a_cache_lock_stops_on_sigterm(prefect_server, tmp_path):
    _wait_and_signal(tmp_path, FLOW_WAITER, signal.SIGTERM, 143, within=10.0)


def _wait_and_signal(tmp_path: Path, script: str, sig: int, code: int, within: float) -> None:
    cache = EpisodeCache(tmp_path)
    with cache.exclusive(KEY):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        # A job started in the background by a non-interactive shell inherits SIGINT ignored, and
        # Python then keeps ignoring it: the waiter gets the disposition an interactive user has.
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_default_signals)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # log lines may come first
                if line.strip() == "waiting":
                    break
            lock = tmp_path / f".{KEY}.lock"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # until it has the lock file open: it waits
                if str(lock) in _open_files(proc.pid):
                    break
                time.sleep(0.05)
            time.sleep(1.5)  # from opening the lock file to announcing the wait, on a loaded machine
            sent = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=within + 20)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == code, err
    assert took < within
    name = signal.Signals(sig).name
    assert f"evalfleet: stopped by {name} while waiting for cache key {KEY[:12]} held by pid " \
        f"{os.getpid()}" in err, err
    assert "is being computed by another evaluation" in err  # the wait was announced


def _open_files(pid: int) -> set[str]:
    """The paths ``pid`` has open (an fd closed while we look is skipped)."""
    paths = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            continue
    return paths


def _default_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their defaults, whatever this process has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
