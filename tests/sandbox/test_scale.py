"""2000 episodes with 500 sandbox processes alive at once, through the real flow.

A sampler thread counts the live sandboxes (children of every fork server) through the run and
measures their unique memory (USS) once 500 are up. Prints the figures the issue asks for.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import psutil
import pytest

from evalfleet.cli import EXAMPLE_POLICY
from evalfleet.models import EvalRequest
from evalfleet.sandbox.forkclient import SERVER_COMMAND

pytestmark = pytest.mark.slow

EPISODES = 2000
CONCURRENCY = 500
SERVER_CMD = SERVER_COMMAND
MAX_USS = 15 * 1024 * 1024


def fork_servers() -> list[psutil.Process]:
    """This test's fork servers (sandboxes share their command line; their parent is a server)."""
    procs = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.cmdline()[:len(SERVER_CMD)] == SERVER_CMD:
                procs[proc.pid] = proc
        except psutil.Error:
            continue
    out = []
    for proc in procs.values():
        try:
            if proc.ppid() not in procs:
                out.append(proc)
        except psutil.Error:  # exited while we looked (hosts, inits and sandboxes come and go)
            continue
    return out


def live_sandboxes() -> list[psutil.Process]:
    out = []
    for server in fork_servers():
        try:
            out.extend(c for c in server.children() if c.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            continue
    return out


class Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.counts: list[tuple[float, int]] = []
        self.uss: list[int] = []
        self.server_uss: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            boxes = live_sandboxes()
            self.counts.append((time.monotonic(), len(boxes)))
            if len(boxes) == CONCURRENCY and not self.uss:
                for proc in boxes:
                    try:  # a sandbox in a pid namespace is a host, its init and the sandbox
                        tree = [proc, *proc.children(recursive=True)]
                        self.uss.append(sum(p.memory_full_info().uss for p in tree))
                    except psutil.Error:
                        continue
                for proc in fork_servers():
                    try:
                        self.server_uss.append(proc.memory_full_info().uss)
                    except psutil.Error:
                        continue
            time.sleep(0.1)


def test_2000_episodes_500_sandboxes(prefect_server: str, tmp_path: Path) -> None:
    from flows.eval import evaluate

    request = EvalRequest.build(policy=EXAMPLE_POLICY, episodes=EPISODES,
                                concurrency=CONCURRENCY, isolation="process", workers=2,
                                output=tmp_path, seed=3)
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    try:
        report = evaluate(request)
    finally:
        sampler.stop.set()
        sampler.join()
    wall = time.perf_counter() - t0

    counts = [n for _, n in sampler.counts]
    assert report.completed == EPISODES and report.isolation == "process"
    assert max(counts) == CONCURRENCY, f"peak {max(counts)} sandboxes, {CONCURRENCY} asked"
    assert len(sampler.uss) >= CONCURRENCY * 0.9
    median_uss = statistics.median(sampler.uss)
    assert median_uss <= MAX_USS, f"median USS {median_uss / 2**20:.1f} MiB per sandbox"
    full = [i for i, n in enumerate(counts) if n == CONCURRENCY]
    assert all(n == CONCURRENCY for n in counts[full[0] : full[-1] + 1]), (
        "once all 500 were up, none was missing until the shards ran out of work")
    busy = [n for n in counts if n > 0]
    at_full = sum(n == CONCURRENCY for n in busy) / len(busy)
    t_start = sampler.counts[0][0]
    timeline = " ".join(f"{t - t_start:.0f}s:{n}" for t, n in sampler.counts[::50])
    print(f"\nsandboxes alive over time: {timeline}")
    print(f"2000x500 process: wall {wall:.1f} s (run stage {report.timings['run_episodes']:.1f}"
          f" s), {report.env_steps} steps, {report.steps_per_second:.0f} steps/s; peak "
          f"{max(counts)} sandboxes, at 500 in {at_full:.0%} of busy samples; USS per sandbox "
          f"median {median_uss / 2**20:.2f} MiB, max {max(sampler.uss) / 2**20:.2f} MiB, total "
          f"{sum(sampler.uss) / 2**20:.0f} MiB; fork servers "
          f"{[round(u / 2**20, 1) for u in sampler.server_uss]} MiB")
