"""A real ``prefect server start`` on 127.0.0.1 for tests: started, waited for, killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx


class PrefectServer:
    """``prefect server start`` on ``port`` with its database under ``home`` (its PREFECT_HOME)."""

    def __init__(self, home: Path, port: int) -> None:
        self.home, self.port = home, port
        self.url = f"http://127.0.0.1:{port}/api"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[str] | None = None
        self.starts = 0

    def start(self, timeout: float = 240.0) -> str:
        """Start it and wait until it answers (a loaded 2-core machine can take minutes)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log_path = self.home / f"server.{self.starts}.log"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed by stop()
        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                   PREFECT_API_URL=self.url)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(self.port)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"prefect server not healthy after {timeout:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server and everything it started (its own session)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close_log()

    def stop(self) -> None:
        """Stop it the polite way (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
