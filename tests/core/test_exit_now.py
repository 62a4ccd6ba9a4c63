"""``exit_now``: the CLI's exit keeps everything an orderly exit writes, only faster."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_threads_atexit_handlers_logs_and_streams_finish_before_the_exit_code(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, logging, sys, threading, time
        from pathlib import Path
        from evalfleet.cli import exit_now

        out = Path({str(tmp_path)!r})
        log = logging.getLogger("exit-test")
        log.addHandler(logging.FileHandler(out / "log.txt"))
        log.warning("logged before the exit")
        atexit.register(lambda: (out / "atexit.txt").write_text("ran"))

        def late():
            time.sleep(0.5)
            (out / "thread.txt").write_text("joined")

        threading.Thread(target=late).start()
        sys.stdout.write("buffered, no newline")
        exit_now(7)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "logged before the exit\n"


def test_an_idle_thread_pool_does_not_hang_the_exit(tmp_path):
    """An idle pool's worker (MLflow's artifact uploader, after a refused ``sha256:`` baseline)
    waits for work until the pool's exit hook tells it to stop: joined without it, it hung the
    CLI's exit after the error was printed, in 3 of 5 runs."""
    script = textwrap.dedent("""
        from concurrent.futures import ThreadPoolExecutor
        from evalfleet.cli import exit_now

        pool = ThreadPoolExecutor(2)
        assert pool.submit(lambda: 41 + 1).result() == 42
        print("error printed", flush=True)
        exit_now(2)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "error printed\n"), done.stderr
