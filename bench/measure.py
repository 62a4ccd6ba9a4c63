"""What a trial measures about itself: wall clock, CPU time and peak RSS of its process tree."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil


def _tree(root: psutil.Process, extra: list[int]) -> list[psutil.Process]:
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    for pid in extra:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    return procs


def tree_rss(pid: int | None = None, extra: list[int] | None = None) -> int:
    """Sum of the RSS of ``pid`` (default: this process), its descendants and ``extra`` trees."""
    total = 0
    for p in _tree(psutil.Process(pid or os.getpid()), extra or []):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def tree_cpu(pid: int | None = None, extra: list[int] | None = None) -> float:
    """User+system CPU seconds of the live processes of the tree (children that exited: not)."""
    total = 0.0
    for p in _tree(psutil.Process(pid or os.getpid()), extra or []):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


@dataclass
class Window:
    """One measured window: wall seconds, peak tree RSS (bytes), tree CPU seconds."""

    wall_s: float = 0.0
    peak_rss: int = 0
    cpu_s: float = 0.0
    samples: int = 0
    marks: dict[str, float] = field(default_factory=dict)


@contextmanager
def window(extra_pids: list[int] | None = None, period_s: float = 0.05, discover_s: float = 0.5
           ) -> Iterator[Window]:
    """Measure the enclosed block: a thread samples the RSS of the whole process tree.

    The tree is re-discovered every ``discover_s`` (listing descendants reads every process of
    the machine); the RSS of the known processes is read every ``period_s``. CPU time is the
    tree's CPU at the end minus at the start, plus children reaped meanwhile
    (``RUSAGE_CHILDREN``), so short-lived helpers are counted too.
    """
    import resource

    extra = list(extra_pids or [])
    out = Window()
    stop = threading.Event()
    root = psutil.Process(os.getpid())

    def sample() -> None:
        procs: list[psutil.Process] = []
        found = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now - found >= discover_s:
                procs, found = _tree(root, extra), now
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    continue
            out.peak_rss = max(out.peak_rss, total)
            out.samples += 1
            stop.wait(period_s)

    def cpu_now() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return tree_cpu(extra=extra) + kids.ru_utime + kids.ru_stime

    thread = threading.Thread(target=sample, name="bench-rss", daemon=True)
    cpu0 = cpu_now()
    t0 = time.perf_counter()
    thread.start()
    try:
        yield out
    finally:
        out.wall_s = time.perf_counter() - t0
        stop.set()
        thread.join()
        out.peak_rss = max(out.peak_rss, tree_rss(extra=extra))
        out.cpu_s = max(0.0, cpu_now() - cpu0)
