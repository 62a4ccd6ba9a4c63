"""The local Prefect server that evaluations share: started on first use, found again after.

With no ``PREFECT_API_URL``, the first evaluation starts ``prefect server start`` on 127.0.0.1 in
its own session (it outlives the evaluation), with its own ``PREFECT_HOME`` under the evalfleet
home (``$EVALFLEET_HOME``, default ``~/.evalfleet``), and records it in ``server.json``
(url, port, pid, start time). Later evaluations read that file and reuse the server after a
health check; a record whose process is gone, or that stopped answering, is replaced. A file lock
makes concurrent first runs start one server. ``evalfleet server status|stop`` reads and ends it.

This module starts the server as a subprocess and never imports Prefect.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from evalfleet.errors import ServerError

#: Seconds a new server may take to answer its health check (a fresh database on a loaded machine).
START_TIMEOUT_S = 180.0
#: ``local`` (default): with no PREFECT_API_URL, evaluations use the shared local server, started
#: on first use. ``ephemeral``: each evaluation starts a server of its own, stopped after it.
SERVER_MODE_ENV = "EVALFLEET_SERVER"
#: Where evalfleet keeps its local state (default ``~/.evalfleet``).
EVALFLEET_HOME_ENV = "EVALFLEET_HOME"
#: The port a new server tries first (Prefect's own default), then any free one.
PREFERRED_PORT = 4200


@dataclass(frozen=True)
class ServerState:
    """What ``server.json`` records about the running local server."""

    url: str
    """The API URL, ``http://127.0.0.1:PORT/api``."""
    port: int
    """The TCP port on 127.0.0.1."""
    pid: int
    """Process id of ``prefect server start`` (also its process group: it runs in its own session)."""
    started: float
    """Unix time the server was started."""
    prefect_home: str
    """The server's ``PREFECT_HOME`` (its database lives there)."""

    @property
    def uptime_s(self) -> float:
        """Seconds since the server was started."""
        return max(0.0, time.time() - self.started)


def evalfleet_home() -> Path:
    """Per-user directory of evalfleet's local state: ``$EVALFLEET_HOME`` or ``~/.evalfleet``."""
    return Path(os.environ.get(EVALFLEET_HOME_ENV) or Path.home() / ".evalfleet")


def state_path() -> Path:
    """Where the running server is recorded."""
    return evalfleet_home() / "server.json"


def read_state() -> ServerState | None:
    """The recorded server, or None when there is no record (or an unreadable one)."""
    try:
        data = json.loads(state_path().read_text())
        return ServerState(url=str(data["url"]), port=int(data["port"]), pid=int(data["pid"]),
                           started=float(data["started"]), prefect_home=str(data["prefect_home"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def healthy(url: str, timeout: float = 1.0) -> bool:
    """Whether the Prefect API at ``url`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as reply:  # noqa: S310 - loopback
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reaped now
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def command_line(pid: int) -> list[str]:
    """The arguments ``pid`` was started with ([] when it cannot be read)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []
    return [a.decode(errors="replace") for a in argv]


def is_prefect_server(pid: int) -> bool:
    """Whether ``pid`` runs ``prefect server start`` (a recycled pid must never be signalled)."""
    words = command_line(pid)
    return "prefect" in words and "server" in words


def write_private_json(path: Path, data: object) -> None:
    """Write ``data`` as JSON to ``path`` whole (a rename), readable by this user only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(data) + "\n")
    os.replace(tmp, path)


@contextmanager
def locked() -> Iterator[None]:
    """Hold the home's lock: one process at a time reads, starts or stops the server."""
    home = evalfleet_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _port() -> int:
    for port in (PREFERRED_PORT, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise ServerError("no free TCP port on 127.0.0.1 for the local Prefect server")


#: Settings that point Prefect's server at a database of the user's own (then none is seeded).
DATABASE_URL_ENVS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


def database_template() -> Path | None:
    """The packaged empty database of the installed Prefect version, or None if there is none.

    ``evalfleet/data/prefect-<version>.db.gz``: a new server's SQLite database as that Prefect
    version leaves it after its first start (every schema migration run, its block types
    registered), made by ``python -m evalfleet.server template``. Prefect's version is read from
    its package metadata: this module never imports Prefect.
    """
    from importlib import metadata
    from importlib.resources import files

    try:
        version = metadata.version("prefect")
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(files("evalfleet") / "data" / f"prefect-{version}.db.gz"))
    return path if path.is_file() else None


def seed_database(prefect_home: Path) -> bool:
    """Give a new server home its database from ``database_template()``; True if it did.

    A new Prefect server runs every schema migration of its history and registers its block
    types before it answers: ~5.5 of the ~10 s of a first start here. From the template it runs
    none (Prefect still checks, and registers any block type the template lacks). An existing
    database is never touched, nor one configured elsewhere; without a template, or if anything
    fails, Prefect builds the database as it always does.
    """
    from evalfleet.storage import create_new

    database = prefect_home / "prefect.db"
    template = database_template()
    if template is None or database.exists() or any(os.environ.get(k) for k in DATABASE_URL_ENVS):
        return False

    def unpack(tmp: str) -> None:
        with gzip.open(template, "rb") as packed, open(tmp, "wb") as out:
            shutil.copyfileobj(packed, out)

    try:
        return create_new(database, unpack)
    except (OSError, EOFError) as err:  # a damaged template: Prefect migrates a new database
        print(f"evalfleet: Prefect database template {template} not used: {err}", file=sys.stderr)
        return False


def build_database_template(folder: Path) -> Path:
    """Start a server in a scratch home, stop it, and pack its database as the template."""
    import sqlite3
    import tempfile
    from contextlib import closing
    from importlib import metadata

    from evalfleet.storage import atomic_write

    saved = os.environ.get(EVALFLEET_HOME_ENV)
    with tempfile.TemporaryDirectory(prefix="evalfleet-template-") as scratch:
        os.environ[EVALFLEET_HOME_ENV] = scratch
        try:
            with locked():
                state = _spawn(seed=False)  # Prefect makes this database itself
            wait_healthy(state)
            stop_server()
        finally:
            if saved is None:
                os.environ.pop(EVALFLEET_HOME_ENV, None)
            else:
                os.environ[EVALFLEET_HOME_ENV] = saved
        database = Path(scratch) / "prefect" / "prefect.db"
        with closing(sqlite3.connect(database)) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.execute("PRAGMA journal_mode=DELETE")
            db.execute("VACUUM")
        out = folder / f"prefect-{metadata.version('prefect')}.db.gz"

        def pack(tmp: str) -> None:
            with open(database, "rb") as raw, open(tmp, "wb") as out_file, \
                    gzip.GzipFile(fileobj=out_file, mode="wb", compresslevel=9, mtime=0) as packed:
                shutil.copyfileobj(raw, packed)

        return atomic_write(out, pack)


def _spawn(seed: bool = True) -> ServerState:
    home = evalfleet_home()
    prefect_home = home / "prefect"
    prefect_home.mkdir(parents=True, exist_ok=True)
    if seed:
        seed_database(prefect_home)
    port = _port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_LOGGING_SETTINGS_PATH")}
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    with open(home / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=home)
    state = ServerState(url=f"http://127.0.0.1:{port}/api", port=port, pid=proc.pid,
                        started=time.time(), prefect_home=str(prefect_home))
    tmp = state_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    tmp.replace(state_path())
    return state


def terminate(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid``'s process group (its own session), then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def mark_used() -> None:
    """Note that this process's evaluation used the shared local server (``take_used``)."""
    global _used
    _used = True


def take_used() -> bool:
    """Whether an evaluation of this process used the shared local server since the last call."""
    global _used
    used, _used = _used, False
    return used


_used = False


def claim_server() -> tuple[ServerState, bool]:
    """The local server to use, started if there is none: ``(state, answering_now)``.

    Returns at once after spawning (the URL is fixed), so the caller can start other work while
    the server boots, then call ``wait_healthy``. A record whose process is gone, or one still not
    answering ``START_TIMEOUT_S`` after it was started, is replaced.
    """
    with locked():
        state = read_state()
        if state is not None and alive(state.pid):
            if healthy(state.url):
                return state, True
            if state.uptime_s < START_TIMEOUT_S:  # another process started it: still booting
                return state, False
            if is_prefect_server(state.pid):  # hung: replace it (a recycled pid is left alone)
                terminate(state.pid)
        return _spawn(), False


def wait_healthy(state: ServerState, timeout: float = START_TIMEOUT_S) -> ServerState:
    """Block until ``state``'s server answers; raise ``ServerError`` with its log if it cannot."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if healthy(state.url):
            return state
        if not alive(state.pid):
            break
        time.sleep(0.2)
    log = evalfleet_home() / "server.log"
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise ServerError(
        f"the local Prefect server (pid {state.pid}, {state.url}) did not answer within "
        f"{timeout:.0f} s; its log ends: {tail.strip()!r}. Stop it with 'evalfleet server stop' "
        "and retry, or set PREFECT_API_URL to a server of your own")


def ensure_server(timeout: float = START_TIMEOUT_S) -> ServerState:
    """The running local server, started and waited for if needed."""
    state, ready = claim_server()
    return state if ready else wait_healthy(state, timeout)


def stop_server() -> ServerState | None:
    """Stop the recorded server (the shared MLflow logger and fork server too), remove their records.

    Returns the server stopped (None: nothing recorded).
    """
    from evalfleet import mlflow_logger, warm_forkserver

    with locked():
        mlflow_logger.stop()
        warm_forkserver.stop()
        state = read_state()
        if state is None:
            return None
        if alive(state.pid) and is_prefect_server(state.pid):
            terminate(state.pid)
        state_path().unlink(missing_ok=True)
        return state


def server_command(action: str) -> int:
    """``evalfleet server status|start|stop``: print what it did; returns the exit code."""
    if action == "start":
        from evalfleet import mlflow_logger

        state = ensure_server()
        print(f"local Prefect server at {state.url} (pid {state.pid})")
        with mlflow_logger.opted_in():  # the shared MLflow logger of the CLI's runs, with it
            mlflow_logger.ensure_started()
    elif action == "stop":
        stopped = stop_server()
        print(f"stopped the local Prefect server at {stopped.url} (pid {stopped.pid})" if stopped
              else f"no local Prefect server recorded in {state_path()}")
    else:
        from evalfleet import mlflow_logger, warm_forkserver

        print(describe())
        print(mlflow_logger.describe())
        print(warm_forkserver.describe())
        recorded = read_state()
        return 0 if recorded is not None and alive(recorded.pid) else 1
    return 0


def describe() -> str:
    """``evalfleet server status``: url, pid, uptime and health of the recorded server."""
    state = read_state()
    if state is None:
        return f"no local Prefect server recorded in {state_path()}"
    if not alive(state.pid):
        return f"not running (stale record of pid {state.pid} in {state_path()}; replaced on next use)"
    up = int(state.uptime_s)
    answers = "healthy" if healthy(state.url) else "NOT answering"
    return (f"url      {state.url}\npid      {state.pid}\nuptime   {up // 3600}h{up % 3600 // 60:02d}m"
            f"{up % 60:02d}s\nhealth   {answers}\nhome     {state.prefect_home}")


if __name__ == "__main__":  # python -m evalfleet.server template: (re)make the packaged template
    if sys.argv[1:] != ["template"]:
        sys.exit("usage: python -m evalfleet.server template")
    print(build_database_template(Path(__file__).resolve().parent / "data"))
