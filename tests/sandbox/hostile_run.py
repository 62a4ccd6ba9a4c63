"""Runs one hostile env in ProcessSlots and prints what happened as JSON (for test_hostile).

``python -m tests.sandbox.hostile_run LEVEL ENV MARKER``: started by the tests as a non-root
user. Prints the rows, the wall time, the processes carrying ``MARKER`` in their argv left
after the run (before and after the slots are closed), and the fork server's hello.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import psutil

from evalfleet.sandbox.forkclient import fork_server, shutdown_fork_servers
from evalfleet.sandbox.limits import SandboxLimits

from . import faulty_envs as fe
from .test_process_slots import run_direct

PROCESSES = 32
EPISODES = 20
SLOTS = 4


def marked(marker: str) -> list[int]:
    """Pids of live processes with ``marker`` in their argv."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}  # this script's argv carries it too
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.pid in mine:
            continue
        try:
            if marker in (proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def main(level: str, env: str, marker: str) -> dict[str, Any]:
    """Run ``env`` at ``level``; what the tests assert on."""
    kwargs = {"marker": marker} if env in ("Daemon", "Metadata") else {}
    limits = SandboxLimits(processes=PROCESSES)
    t0 = time.monotonic()
    records, _ = run_direct(level, fe.env_id(env), EPISODES, SLOTS, kwargs=kwargs, limits=limits,
                            timeout_s=2.0)
    wall = time.monotonic() - t0
    left_closed = marked(marker)
    hello = dict(fork_server(level, 60).hello)
    shutdown_fork_servers()
    rows = [{"episode_index": r.episode_index, "seed": r.seed, "end_reason": r.end_reason,
             "error": r.error, "length": r.length, "retried": r.retried,
             "metrics": dict(r.metrics)} for r in records]
    return {"rows": rows, "wall_s": wall, "left_after_run": left_closed,
            "left_after_shutdown": marked(marker), "hello": hello}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
