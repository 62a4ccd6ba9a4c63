"""Fork bombs, CPU burners and daemons, run by a NON-ROOT worker, and a root one (issue 14, item 3).

Each case runs ``tests.sandbox.hostile_run`` in a subprocess as an unprivileged user: the test
user ``evalfleet-test`` (created with ``useradd`` when the tests run as root, as in CI), or the
current user when it is not root. Per level (``process``, ``bwrap``) and env:

- fork bomb: stopped by the per-sandbox process cap (``SandboxLimits.processes``) → ``env_error``
  whose text names the failed fork; the healthy episodes are untouched;
- CPU burner (a busy loop in ``step``): ``timeout`` by the episode's wall clock (2 s), retried
  once, killed; the rest finish, the run's wall time stays bounded;
- daemon (double fork, own session, burns CPU): the episode ends normally, and no process of the
  daemon is left after the run (its pid namespace died with the sandbox, or it was killed when
  its episode ended).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from . import faulty_envs as fe
from .hostile_run import EPISODES, PROCESSES

pytestmark = pytest.mark.slow

USER = "evalfleet-test"
PROJECT = Path(__file__).resolve().parents[2]


def _blocking_dirs(user: str, path: str) -> list[Path]:
    """Ancestors of ``path`` that ``user`` (not owner, not in group) cannot traverse."""
    info = pwd.getpwnam(user)
    out = []
    for parent in reversed(Path(path).parents):
        st = parent.stat()
        if st.st_uid != info.pw_uid and not st.st_mode & stat.S_IXOTH:
            out.append(parent)
    return out


@pytest.fixture(scope="module")
def as_user() -> Iterator[list[str]]:
    """The command prefix that runs a command as a non-root user (and what it needs, readable)."""
    if os.geteuid() != 0:
        yield []
        return
    if shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: cannot start a non-root worker")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                               "/usr/sbin/nologin", USER], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot create the test user {USER!r}: {made.stderr.strip()}")
    # The interpreter may live under a private home (pyenv under /root): let the test user
    # traverse (not list) the folders in the way while the tests run, then restore them.
    opened = {d: d.stat().st_mode for p in (os.path.realpath(sys.executable), str(PROJECT),
                                            sys.prefix) for d in _blocking_dirs(USER, p)}
    for d, mode in opened.items():
        d.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    try:
        yield ["runuser", "-u", USER, "--"]
    finally:
        for d, mode in opened.items():
            d.chmod(stat.S_IMODE(mode))


def run_hostile(as_user: list[str], level: str, env: str, marker: str | None = None
                ) -> dict[str, Any]:
    marker = marker or f"evalfleet-test-daemon-{uuid.uuid4().hex}"
    home = tempfile.mkdtemp(prefix="evalfleet-test-home-")
    os.chmod(home, 0o777)
    env_vars = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
                "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([*as_user, "env", "-i", *(f"{k}={v}" for k, v in env_vars.items()),
                               sys.executable, "-m", "tests.sandbox.hostile_run", level, env,
                               marker], cwd=PROJECT, capture_output=True, text=True, timeout=400)
    finally:
        for proc in psutil.process_iter(["cmdline"]):  # never leave a daemon behind
            if marker in (proc.info["cmdline"] or []):
                proc.kill()
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hello"]["pidns"], out["hello"]
    return out


def split(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    faulty = [r for r in rows if fe.is_faulty(r["seed"])]
    healthy = [r for r in rows if not fe.is_faulty(r["seed"])]
    assert len(rows) == EPISODES and faulty and healthy
    for r in healthy:
        assert r["end_reason"] in ("terminated", "truncated") and not r["retried"], r
    return faulty, healthy


@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_fork_bomb_is_capped(as_user: list[str], level: str) -> None:
    out = run_hostile(as_user, level, "ForkBomb")
    assert "user namespace per sandbox" in (out["hello"]["process_cap"] or ""), out["hello"]
    _assert_bomb_stopped(out)


@pytest.mark.skipif(os.geteuid() != 0, reason="the root-worker case needs root")
@pytest.mark.parametrize(("level", "cap"), [("process", "uid of its own"),
                                            ("bwrap", "pids cgroup per sandbox")])
def test_fork_bomb_is_capped_under_a_root_worker(level: str, cap: str) -> None:
    out = run_hostile([], level, "ForkBomb")
    assert cap in (out["hello"]["process_cap"] or ""), out["hello"]
    _assert_bomb_stopped(out)


def _assert_bomb_stopped(out: dict[str, Any]) -> None:
    faulty, _ = split(out["rows"])
    for r in faulty:
        assert r["end_reason"] == "env_error", r
        assert "fork bomb stopped after" in r["error"], r["error"]
        assert "Resource temporarily unavailable" in r["error"], r["error"]
        forks = int(r["error"].split("stopped after ")[1].split()[0])
        assert forks < PROCESSES, r["error"]
    assert out["left_after_run"] == []


@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_cpu_burner_times_out(as_user: list[str], level: str) -> None:
    out = run_hostile(as_user, level, "CpuBurner")
    faulty, _ = split(out["rows"])
    for r in faulty:
        assert (r["end_reason"], r["retried"]) == ("timeout", 2), r
        assert "2.0 s" in r["error"] and "killed" in r["error"], r["error"]
    # Two burners (and their retries) at 2 s each, the rest ~1 s: far below a stuck run.
    assert out["wall_s"] < 60, out["wall_s"]


@pytest.mark.parametrize("root", [False, True], ids=["nonroot", "root"])
@pytest.mark.parametrize("level", ["process", "bwrap"])
def test_daemon_does_not_outlive_its_sandbox(as_user: list[str], level: str, root: bool) -> None:
    if root and os.geteuid() != 0:
        pytest.skip("the root-worker case needs root")
    out = run_hostile([] if root else as_user, level, "Daemon")
    faulty, _ = split(out["rows"])
    for r in faulty:
        assert r["end_reason"] in ("terminated", "truncated"), r
        assert r["metrics"].get("daemon_started") == 1.0, "the daemon really started"
    assert out["left_after_run"] == [], "a daemon outlived its episode"
    assert out["left_after_shutdown"] == []


@pytest.mark.parametrize("root", [False, True], ids=["nonroot", "root"])
def test_a_process_sandbox_changes_no_metadata_of_the_workers_files(as_user: list[str],
                                                                     root: bool) -> None:
    """chmod, utime, setxattr and chown of a worker's file it cannot open are refused.

    Landlock has no right for them: under a non-root worker a sandbox (the worker's uid) made
    the worker's 0600 cache entry world-writable and reset its times, exit 0. seccomp refuses
    them now, in its own folder too (seccomp cannot tell paths apart): an env there cannot
    chmod, utime (``shutil.copy2``, ``Path.touch`` of a file that exists) or chown either.
    Under a root worker the sandbox's own uid owns none of the worker's files, and its own
    folder is untouched by the filter.
    """
    if root and os.geteuid() != 0:
        pytest.skip("the root-worker case needs root")
    folder = Path(tempfile.mkdtemp(prefix="evalfleet-test-meta-", dir="/var/tmp"))
    try:
        folder.chmod(0o755)
        target = folder / "cache-entry.json"
        target.write_text("{}")
        target.chmod(0o600)
        os.utime(target, (1_000_000_000, 1_000_000_000))
        if as_user and not root:  # the worker's own file
            owner = pwd.getpwnam(USER)
            os.chown(target, owner.pw_uid, owner.pw_gid)
        before = target.stat()
        out = run_hostile([] if root else as_user, "process", "Metadata", marker=str(target))
        rows = out["rows"]
        assert all(r["end_reason"] == "terminated" for r in rows), rows[0]
        changes = ("chmod", "utime", "setxattr", "chown")
        for r in rows:
            assert {c: r["metrics"][f"target_{c}"] for c in changes} == dict.fromkeys(changes, 0.0)
            # Its own folder: free under a root worker, refused too under a non-root one.
            own = 1.0 if root else 0.0
            assert (r["metrics"]["own_chmod"], r["metrics"]["own_utime"]) == (own, own), r
        after = target.stat()
        assert (stat.S_IMODE(after.st_mode), after.st_mtime, after.st_uid, after.st_gid) == (
            0o600, 1_000_000_000, before.st_uid, before.st_gid)
        assert os.listxattr(target) == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
