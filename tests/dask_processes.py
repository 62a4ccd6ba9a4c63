"""A Dask cluster evalfleet did not start: ``dask scheduler`` and ``dask worker`` processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def external_cluster(workers: int = 2, name: str | None = None, prefix: tuple[str, ...] = ()
                     ) -> Iterator[str]:
    """A scheduler on 127.0.0.1 and ``workers`` one-thread workers; yields its address.

    ``prefix``: a command the workers' ``dask worker`` command line is run through.
    """
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = os.path.join(os.path.dirname(sys.executable), "dask")
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        time.sleep(1.0)
        procs.append(subprocess.Popen(
            [*prefix, dask, "worker", address, "--nthreads", "1", "--nworkers", str(workers),
             "--no-dashboard", *(["--name", name] if name else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield address
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
