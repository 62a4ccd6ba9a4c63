"""The terminal progress bar: what it shows for the tracker's counts."""

import io
import math

from rich.console import Console

from evalfleet.progress import ProgressTracker
from flows.progress import EpisodeBar


def test_bar_shows_done_failed_rate_and_eta():
    tracker = ProgressTracker(total=40)
    tracker.handle((0.0, {"shard": 0, "done": 7, "failed": 1}))
    tracker.handle((0.0, {"shard": 1, "done": 5, "failed": 2}))
    snap = tracker.snapshot()
    assert (snap["done"], snap["failed"]) == (12, 3)

    out = io.StringIO()
    bar = EpisodeBar(tracker.total, Console(file=out, force_terminal=True, color_system=None, width=120))
    bar.update({**snap, "episodes_per_s": 6.0, "eta_s": (40 - 12) / 6.0})
    bar.update({"done": 40, "total": 40, "failed": 3, "episodes_per_s": 8.0, "eta_s": 0.0})
    bar.close()
    text = out.getvalue()
    assert "12/40" in text and "3 failed" in text and "6 episodes/s" in text and "ETA 0:00:05" in text
    drawn = [line for line in text.replace("\r", "\n").splitlines() if "episodes/s" in line]
    last = drawn[-1]  # the final state stays on the terminal
    assert "40/40" in last and "8 episodes/s" in last and "ETA 0:00:00" in last, last


def test_bar_without_a_rate_yet():
    out = io.StringIO()
    bar = EpisodeBar(10, Console(file=out, force_terminal=True, color_system=None, width=120))
    bar.update({"done": 0, "total": 10, "failed": 0, "episodes_per_s": 0.0, "eta_s": math.nan})
    bar.close()
    assert "0/10" in out.getvalue() and "ETA ?" in out.getvalue()
