"""The MLflow logger CLI runs share: one process that keeps MLflow imported, beside the local server.

MLflow's SQL store costs every CLI run ~1 s of imports and opening (sqlalchemy, alembic, MLflow's
store) for the one run it logs: a third of a cache hit. Once a CLI run has used the shared local
Prefect server (``evalfleet.server``), it starts this logger (``python -m evalfleet.mlflow_logger``)
in a session of its own, if none of its code runs yet. Later CLI runs hand it the evaluation to log
and wait for its answer. The logger forks a worker per request, which takes on the run's working
directory, umask and environment and runs the very ``tracking.log_or_queue`` the run would have
run (same retries, same queue under the results folder), then sends back its outputs and log
lines and exits: requests run side by side, and no state of one (an open store) reaches the
next. The run is logged (or queued) before the CLI prints its summary, as before; only the imports
moved.

It is used only where nothing can differ: by the CLI (``opted_in``), for a SQLite store under a
path, by a logger of the same code (``code_key``: evalfleet's source, MLflow and its site-packages,
the interpreter), recorded in ``$EVALFLEET_HOME/mlflow-logger.json`` (mode 0600) and answering on
its Unix socket (abstract, so no path length limit). A peer must be this user, in this mount
namespace and root, in the same working folder, and show the record's token, which only a reader
of the home has. Anything else logs in-process as before. A reply lost after the request went out
(the worker died) first adopts the run it may have logged, by request id
(``tracking.log_or_queue(adopt=True)``): one evaluation never becomes two MLflow runs.

``evalfleet server stop`` stops the logger with the server; a logger whose record names another
process exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evalfleet import tracking
from evalfleet.environ import current_umask
from evalfleet.server import alive, command_line, evalfleet_home, terminate, write_private_json

logger = logging.getLogger(__name__)

#: Set to ``off`` to log every evaluation in its own process (and start no logger).
SWITCH_ENV = "EVALFLEET_MLFLOW_LOGGER"
RECORD_NAME = "mlflow-logger.json"
#: Seconds between a logger's checks that it is still the recorded one and its home still exists.
CHECK_EVERY_S = 30.0
_HEADER = struct.Struct("!Q")
_opted_in = False


class LoggerError(Exception):
    """What the shared logger raised while logging (``tracking.log_or_queue`` could not even queue)."""


class _NotSent(Exception):
    """No request reached the logger: the run may log in-process as if there were none."""


class _Lost(Exception):
    """The request reached the logger, which died before answering: it may have logged the run."""


@dataclass(frozen=True)
class LoggerRecord:
    """What ``mlflow-logger.json`` records about the running logger."""

    pid: int
    key: str
    """``code_key`` of the code it runs."""
    started: float
    address: str | None = None
    """Its abstract socket's name, once it listens (None while it starts)."""
    token: str | None = None


@contextlib.contextmanager
def opted_in() -> Iterator[None]:
    """Let this block's evaluations use (and start) the shared logger: the CLI's run."""
    global _opted_in
    before, _opted_in = _opted_in, os.environ.get(SWITCH_ENV, "on") != "off"
    try:
        yield
    finally:
        _opted_in = before


def record_path() -> Path:
    """Where the running logger is recorded."""
    return evalfleet_home() / RECORD_NAME


def code_key() -> str:
    """What must match for a logger to log as this process would: code, MLflow, interpreter.

    MLflow's folder's parent (site-packages) changes on any install or upgrade there: a new
    sqlalchemy or alembic under the same MLflow version is other code too.
    """
    import importlib.util

    from evalfleet.provenance import code_version

    spec = importlib.util.find_spec("mlflow")
    installed = ""
    if spec is not None and spec.origin:
        with contextlib.suppress(OSError):
            installed = str(Path(spec.origin).parents[1].stat().st_mtime_ns)
    return "|".join([code_version("evalfleet")[1], code_version("mlflow")[1], installed, sys.executable])


def read_record() -> LoggerRecord | None:
    """The recorded logger, or None (no record, or an unreadable one)."""
    try:
        data = json.loads(record_path().read_text())
        return LoggerRecord(pid=int(data["pid"]), key=str(data["key"]), started=float(data["started"]),
                            address=data.get("address"), token=data.get("token"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(record: LoggerRecord) -> None:
    write_private_json(record_path(), asdict(record))


def is_logger(pid: int) -> bool:
    """Whether ``pid`` runs this logger (a recycled pid must never be signalled)."""
    return "evalfleet.mlflow_logger" in command_line(pid)


def usable() -> LoggerRecord | None:
    """The logger this process hands its runs to: opted in, same code, listening. None otherwise."""
    if not _opted_in:
        return None
    record = read_record()
    if record is None or record.address is None or not alive(record.pid):
        return None
    return record if record.key == code_key() else None


def ensure_started() -> None:
    """Start a logger of this code unless one runs or starts (opted-in runs only); never raises.

    Called once a CLI run has used the shared local server. A logger of other code is stopped:
    the home's runs are this code's now.
    """
    if not _opted_in:
        return
    from evalfleet.server import EVALFLEET_HOME_ENV, locked, read_state

    try:
        key = code_key()
        with locked():
            server = read_state()
            if server is None or not alive(server.pid):  # stopped meanwhile: it goes with it
                return
            record = read_record()
            if record is not None and alive(record.pid) and is_logger(record.pid):
                if record.key == key:
                    return
                terminate(record.pid, grace_s=5.0)
            home = evalfleet_home().resolve()  # a relative home is the caller's, not the logger's
            with open(home / "mlflow-logger.log", "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "evalfleet.mlflow_logger"], stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=home,
                    env={**os.environ, "PYTHONPATH": _import_path(), EVALFLEET_HOME_ENV: str(home)})
            _write_record(LoggerRecord(pid=proc.pid, key=key, started=time.time()))
    except Exception as err:  # noqa: BLE001 - runs log in-process without it
        logger.debug("could not start the shared MLflow logger: %s", err)


def _import_path() -> str:
    """``PYTHONPATH`` that imports this evalfleet first, whatever the logger's working directory."""
    here = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def stop() -> LoggerRecord | None:
    """Stop the recorded logger and remove its record (the caller holds the server's lock)."""
    record = read_record()
    if record is None:
        return None
    if alive(record.pid) and is_logger(record.pid):
        terminate(record.pid, grace_s=5.0)
    record_path().unlink(missing_ok=True)
    return record


def describe() -> str:
    """One line for ``evalfleet server status``."""
    record = read_record()
    if record is None or not alive(record.pid):
        return "mlflow   no shared logger (CLI runs log MLflow in their own process)"
    state = "listening" if record.address else "starting"
    mine = "" if record.key == code_key() else " (other code: this code's runs log in-process)"
    return f"mlflow   shared logger pid {record.pid}, {state}{mine}"


# -- the client ------------------------------------------------------------------------------------

def log_or_queue(
    output: Path, tracking_uri: str, experiment: str, report: dict[str, Any],
    params: dict[str, Any], artifacts: list[Path], run_name: str, attempts: int = tracking.LOG_ATTEMPTS,
) -> dict[str, str]:
    """``tracking.log_or_queue``, run by the shared logger when this process may use one."""
    record = usable() if tracking_uri.startswith("sqlite:///") else None
    adopt = False
    if record is not None:
        request = {"output": str(Path(output).resolve()), "tracking_uri": tracking_uri,
                   "experiment": experiment, "report": report,
                   "params": {k: str(v) for k, v in params.items()},
                   "artifacts": [str(Path(a).resolve()) for a in artifacts], "run_name": run_name,
                   "attempts": attempts}
        try:
            return _ask(record, request)
        except _NotSent as why:
            logger.debug("shared MLflow logger not reached (%s): logging here", why)
        except _Lost as why:
            logger.warning("the shared MLflow logger (pid %d) died while logging (%s): logging here, "
                           "adopting the run it may have logged", record.pid, why)
            adopt = True
    return tracking.log_or_queue(output, tracking_uri, experiment, report, params, artifacts,
                                 run_name, attempts=attempts, adopt=adopt)


def _caller() -> dict[str, Any]:
    """What the logger's worker takes on as this run's: folder (and its identity), umask, environment.

    The umask is read from ``/proc`` (setting it to read it would race this process's threads).
    """
    try:
        cwd = os.getcwd()
        here = os.stat(cwd)
        umask = current_umask()
    except (OSError, ValueError, IndexError) as err:
        raise _NotSent(f"this process's folder or umask cannot be read: {err}") from err
    return {"cwd": cwd, "cwd_id": [here.st_dev, here.st_ino], "umask": umask, "environ": dict(os.environ)}


def _ask(record: LoggerRecord, request: dict[str, Any]) -> dict[str, str]:
    message = {"token": record.token, **_caller(), "request": request}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.settimeout(2.0)
            sock.connect("\0" + str(record.address))
            _send(sock, message)
        except OSError as err:
            raise _NotSent(f"{type(err).__name__}: {err}") from err
        frames = _Frames(sock)
        try:  # the worker forked for this request names itself before it reads the request
            worker = int(frames.next(lambda: alive(record.pid), "the logger")["worker"])
        except _Lost as err:
            raise _NotSent(str(err)) from err
        answer = frames.next(lambda: alive(worker), f"its worker (pid {worker})")
    finally:
        sock.close()
    for name, level, text in answer.get("logs", []):
        logging.getLogger(name).log(int(level), "%s", text)
    if "refused" in answer:
        raise _NotSent(answer["refused"])
    if "raised" in answer:
        raise LoggerError(answer["raised"])
    return {str(k): str(v) for k, v in answer["outputs"].items()}


class _Frames:
    """Frames read off the logger's socket, each waited for while who sends it lives.

    No time limit: logging in-process waits for the store as long as it takes, and so does this.
    A limit was a run reported "neither logged nor queued" that the logger logged later.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""
        sock.settimeout(1.0)

    def next(self, lives: Callable[[], bool], who: str) -> dict[str, Any]:
        while True:
            if len(self.data) >= _HEADER.size:
                size = _HEADER.size + _HEADER.unpack_from(self.data)[0]
                if len(self.data) >= size:
                    frame, self.data = self.data[_HEADER.size:size], self.data[size:]
                    answer: dict[str, Any] = json.loads(frame)
                    return answer
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                if not lives():
                    raise _Lost(f"{who} exited without answering") from None
                continue
            except OSError as err:
                raise _Lost(f"{type(err).__name__}: {err}") from err
            if not chunk:
                raise _Lost(f"{who} closed the connection after {len(self.data)} bytes")
            self.data += chunk


def _send(sock: socket.socket, payload: dict[str, Any]) -> None:
    body = json.dumps(payload, default=str).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _receive(sock: socket.socket) -> dict[str, Any]:
    head = _exactly(sock, _HEADER.size)
    payload: dict[str, Any] = json.loads(_exactly(sock, _HEADER.unpack(head)[0]))
    return payload


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the peer closed after {n - left} of {n} bytes")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# -- the logger ------------------------------------------------------------------------------------

class _Captured(logging.Handler):
    """The log lines a request's logging emits, sent back to the CLI run that asked."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.name, record.levelno, record.getMessage()))


def _peer_refusal(conn: socket.socket) -> str | None:
    """Why the connected process may not have its runs logged here; None when it may.

    The same user, seeing the same files: another mount namespace or root (a private /tmp, a
    container sharing the home) would have its paths opened in this process's view of the disk.
    """
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        return f"another user (uid {uid})"
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
            return "another mount namespace"
        theirs, mine = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError as err:
        return f"its view of the files cannot be checked: {err}"
    if (theirs.st_dev, theirs.st_ino) != (mine.st_dev, mine.st_ino):
        return "another root directory"
    return None


def handle(message: dict[str, Any], token: str) -> dict[str, Any]:
    """One request, in a worker forked for it: ``tracking.log_or_queue`` as the asking run would run it.

    The worker takes on the run's working directory (the same folder, checked by its identity),
    umask and environment, and exits after: no state of one run reaches the next.
    """
    if not isinstance(message.get("token"), str) or not secrets.compare_digest(message["token"], token):
        return {"refused": "wrong token"}
    try:
        os.chdir(message["cwd"])
        here = os.stat(".")
    except OSError as err:
        return {"refused": f"its working directory is not here: {err}"}
    if [here.st_dev, here.st_ino] != list(message["cwd_id"]):
        return {"refused": f"its working directory {message['cwd']} is another folder here"}
    os.umask(int(message["umask"]))
    os.environ.clear()
    os.environ.update(message["environ"])
    req = message["request"]
    captured = _Captured()
    root = logging.getLogger()
    root.addHandler(captured)
    root.setLevel(logging.INFO)
    try:
        outputs = tracking.log_or_queue(
            Path(req["output"]), req["tracking_uri"], req["experiment"], req["report"],
            req["params"], [Path(a) for a in req["artifacts"]], req["run_name"],
            attempts=int(req.get("attempts", tracking.LOG_ATTEMPTS)))
        answer: dict[str, Any] = {"outputs": outputs}
    except Exception as err:  # noqa: BLE001 - the asking run reports it as its own
        answer = {"raised": f"{type(err).__name__}: {err}"}
    finally:
        root.removeHandler(captured)
    answer["logs"] = [line for line in captured.lines if line[1] >= logging.INFO]
    return answer


def _work(conn: socket.socket, token: str) -> None:
    """A forked worker's life: name itself, check the peer, read the request, answer."""
    _send(conn, {"worker": os.getpid()})
    conn.settimeout(30.0)
    message = _receive(conn)
    conn.settimeout(None)
    why = _peer_refusal(conn)
    _send(conn, {"refused": why} if why else handle(message, token))


def _warmed_up() -> bool:
    """Log one run into a throwaway store, so what MLflow imports on first use is imported here.

    Each worker would import it again (~0.1 s of a run). The store is forgotten after
    (``_fresh_stores``): nothing of it reaches a worker. False when a thread was left running.
    """
    import tempfile
    import threading

    try:
        with tempfile.TemporaryDirectory(prefix="evalfleet-warm-up-") as folder:
            report = {"request_id": "warm-up", "policy_sha256": "0" * 64, "env_id": "warm-up",
                      "isolation": "inprocess", "harness_fault": False, "alarms": [], "failures": {},
                      "returns": {"mean": 0.0, "std": 0.0, "var": 0.0, "stderr": 0.0, "iqm": 0.0,
                                  "median": 0.0, "min": 0.0, "max": 0.0,
                                  "ci": {"low": 0.0, "high": 0.0}},
                      "lengths": {"mean": 0.0}, "episodes": 1, "failure_rate": 0.0, "coverage": 1.0,
                      "scored": 1, "policy_failure_rate": 0.0, "harness_failure_rate": 0.0,
                      "steps_per_second": 0.0, "episodes_per_second": 0.0, "cache": {"reused": 0},
                      "timings": {}}
            note = Path(folder) / "warm-up.txt"
            note.write_text("warm-up\n")
            tracking.log_evaluation(tracking.default_tracking_uri(Path(folder)), "warm-up", report,
                                    {"warm": "up"}, [note], "warm-up")
            _fresh_stores()
    except Exception as err:  # noqa: BLE001 - the workers import it themselves
        logger.warning("warm-up failed (%s: %s); workers import what it would have", type(err).__name__, err)
    if threading.active_count() > 1:
        logger.warning("threads left running after the warm-up (%s): not serving",
                       [t.name for t in threading.enumerate()])
        return False
    return True


def _fresh_stores() -> None:
    """Forget MLflow's cached stores and engines: a worker opens its store anew."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    for engine in list(SqlAlchemyStore._engine_map.values()):
        engine.dispose()
    SqlAlchemyStore._engine_map.clear()
    _tracking_store_registry._get_store_with_resolved_uri.cache_clear()


def serve() -> None:
    """The logger's loop: a worker forked per request, until its record names another process.

    The logger itself only imports MLflow and forks: each request's worker starts from that
    state, so requests run side by side (a store that hangs holds up its own run only).
    """
    tracking.telemetry_off()  # its telemetry thread would also make forking unsafe
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - what the runs no longer import
    import mlflow.tracking  # noqa: F401

    from evalfleet.server import locked

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if not _warmed_up():
        return  # a thread was left running: forking workers is unsafe, runs log in-process
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped as they exit
    home = evalfleet_home()
    token, address = secrets.token_hex(32), f"evalfleet-mlflow-{secrets.token_hex(12)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + address)
    sock.listen(64)
    with locked():
        record = read_record()
        if record is None or record.pid != os.getpid():
            return  # replaced (or stopped) while it started
        _write_record(LoggerRecord(pid=os.getpid(), key=code_key(), started=record.started,
                                   address=address, token=token))
    sock.settimeout(CHECK_EVERY_S)
    while True:
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            current = read_record()
            if not home.exists() or current is None or current.pid != os.getpid():
                return
            continue
        try:
            child = os.fork()
        except OSError as err:  # the asking run logs in its own process
            logger.warning("could not fork a worker: %s", err)
            conn.close()
            continue
        if child == 0:  # the worker
            code = 0
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _work(conn, token)
            except BaseException as err:  # noqa: BLE001 - the asking run sees the connection end
                logger.warning("dropped a request: %s: %s", type(err).__name__, err)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        conn.close()


if __name__ == "__main__":
    serve()
