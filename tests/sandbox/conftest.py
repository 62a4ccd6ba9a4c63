"""Fixtures of the sandbox tests: a Dask cluster, a TCP listener, a folder sandboxes may not write.

The Prefect server comes from the session fixture ``prefect_server`` in ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from evalfleet.sandbox.forkclient import shutdown_fork_servers


@pytest.fixture(scope="session", autouse=True)
def _stop_fork_servers() -> Iterator[None]:
    yield
    shutdown_fork_servers()


@pytest.fixture(scope="module")
def dask_address() -> Iterator[str]:
    """A local cluster built by evalfleet's own code (2 non-daemonic workers, 1 thread each)."""
    from evalfleet.cluster import fleet_cluster

    with fleet_cluster(None, 2) as address:
        yield address


class Listener:
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    """A fresh listener per test."""
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture
def outside_dir() -> Iterator[Path]:
    """A root-owned 0755 folder outside any sandbox's folder and outside /tmp (bwrap hides /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="evalfleet-test-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


#: The repository's root (its packages: envs, evalfleet, tests).
PROJECT = Path(__file__).resolve().parents[2]


@pytest.fixture
def secrets(outside_dir: Path) -> Iterator[dict[str, str]]:
    """Secret files the worker can read, outside every bind: path -> content."""
    token = uuid.uuid4().hex
    home_dir = Path.home() / f".evalfleet-test-ssh-{token}"
    planted = {
        outside_dir / "other-evaluation-results.json": f"results-{token}",
        PROJECT / f".evalfleet-test-secret-{token}": f"project-{token}",
        home_dir / "id_ed25519": f"key-{token}",
    }
    home_dir.mkdir(mode=0o700)
    try:
        for path, text in planted.items():
            path.write_text(text)
        yield {str(p): t for p, t in planted.items()}
    finally:
        for path in planted:
            path.unlink(missing_ok=True)
        home_dir.rmdir()
