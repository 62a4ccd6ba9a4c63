"""The workers' fork server CLI runs share: their imports made once, kept beside the local server.

A local cluster's workers are forked from a fork server that has imported what they need (Dask,
pandas, pyarrow, Prefect, torch: ~2.6 s on one core, ``cluster.WORKER_MODULES``), and stage 1
checks the policy in a child of it. A CLI run started one of its own each time, and waited for
those imports before anything else could start: over a third of a run with the shared server up.

Once a CLI run has used the shared local server (``evalfleet.server``), it leaves such a server
behind: ``python -c "...warm_forkserver import serve..."``, in a session of its own, started with
the very environment, working folder, umask, limits, import path and preload its own fork server
had. Its imports done, it records its socket and the files of every module it imported
(``$EVALFLEET_HOME/fork-server.json``, mode 0600) and serves multiprocessing's fork-server protocol.
A later CLI run whose fork server would be the same (``key``: environment, folder, umask, limits,
user, namespaces, interpreter and its flags, import path, preload) and finds every one of those
files as it was (``manifest_current``) forks its workers and its policy check from it instead of
starting one. Its children start from the state the imports left and nothing else: the server runs
no evaluation code of its own, and each child is a fresh copy of it.

Anything else starts a private fork server as before: another environment, an edited module,
an installed package, ``EVALFLEET_WARM_WORKERS=off``, a run that is not the CLI's. The server exits
after ``EVALFLEET_WARM_WORKERS_IDLE_S`` (900 s) without use and with no child left, when its record
names another process or is gone, and with ``evalfleet server stop``. Each request carries the
run's stdout and stderr, which the child takes on (``_take_run_stdio``): what it prints reaches the
run's terminal, as from a private server. A run whose shared server is gone when it asks for a
child starts a private one then (``attach``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evalfleet.environ import current_umask
from evalfleet.server import alive, command_line, evalfleet_home, terminate, write_private_json

logger = logging.getLogger(__name__)

#: Set to ``off`` to start a private fork server for every run (and leave none behind).
SWITCH_ENV = "EVALFLEET_WARM_WORKERS"
#: Seconds without use (and with no child left) after which the server exits.
IDLE_ENV = "EVALFLEET_WARM_WORKERS_IDLE_S"
IDLE_S = 900.0
RECORD_NAME = "fork-server.json"
#: Size past which a new server starts its log (its workers' log lines) anew.
LOG_KEEP_BYTES = 10 * 2**20
#: A server a run took this recently is not replaced by one of another kind: that run may be
#: forking its workers from it right now.
REPLACE_AFTER_S = 60.0
#: Seconds between the server's checks that it is still the recorded one and still of use.
CHECK_EVERY_S = 30
#: Files read when the preload imports, beside the modules' own: Prefect's settings sources.
_SETTINGS_FILES = (".env", "prefect.toml", "pyproject.toml")
#: Variables a shell sets for itself (its last command, its depth, its previous folder): they
#: differ with how a run is started (``timeout``, ``&``, a subshell), and no library reads them.
SHELL_BOOKKEEPING = frozenset({"_", "SHLVL", "OLDPWD"})
_opted_in = False
_home: Path | None = None  # the server's: its home, as the run that left it behind named it


@dataclass(frozen=True)
class WarmRecord:
    """What ``fork-server.json`` records about the shared fork server."""

    pid: int
    key: str
    started: float
    address: str | None = None
    """Its socket's path, once its imports are done (None while it imports)."""
    manifest: dict[str, list[int]] | None = None
    """``{file: [mtime_ns, size]}`` of every module it imported (and the settings files read)."""


@contextlib.contextmanager
def opted_in() -> Iterator[None]:
    """Let this block's evaluations use (and leave behind) the shared fork server: the CLI's run."""
    global _opted_in
    before, _opted_in = _opted_in, os.environ.get(SWITCH_ENV, "on") != "off"
    try:
        yield
    finally:
        _opted_in = before


def opted_in_now() -> bool:
    """Whether this process's evaluations now may use the shared server (``opted_in``)."""
    return _opted_in


def record_path() -> Path:
    """Where the shared fork server is recorded."""
    return (_home or evalfleet_home()) / RECORD_NAME


def read_record() -> WarmRecord | None:
    """The recorded server, or None (no record, or an unreadable one)."""
    try:
        data = json.loads(record_path().read_text())
        return WarmRecord(pid=int(data["pid"]), key=str(data["key"]), started=float(data["started"]),
                          address=data.get("address"), manifest=data.get("manifest"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(record: WarmRecord) -> None:
    write_private_json(record_path(), asdict(record))


def is_warm_server(pid: int) -> bool:
    """Whether ``pid`` runs this server (a recycled pid must never be signalled)."""
    return any("evalfleet.warm_forkserver" in arg for arg in command_line(pid))


def _interpreter_flags() -> list[str]:
    """The flags this interpreter runs with, as a child of it would be given them."""
    from multiprocessing import util

    flags: list[str] = util._args_from_interpreter_flags()  # type: ignore[attr-defined]
    return flags


def key(modules: tuple[str, ...], environment: dict[str, str]) -> str:
    """What a fork server started here now with ``modules`` and ``environment`` would be.

    Everything its children inherit from it besides its imports: the environment (the whole of
    it: modules read variables when they are imported), working folder, umask, resource limits,
    user and groups, namespaces and root, cgroup, capabilities, no-new-privileges and seccomp,
    niceness, scheduling policy, CPU and memory-node affinity, OOM score, the interpreter and its
    flags, the import path, and what it preloads. Its imports are checked apart (``manifest_current``). Raises
    ``OSError`` or ``ValueError`` where ``/proc`` does not say the umask.
    """
    mask = current_umask()
    limits = {name: resource.getrlimit(getattr(resource, name))
              for name in sorted(dir(resource)) if name.startswith("RLIMIT_")}
    facts = {
        "modules": list(modules),
        "environment": sorted((k, v) for k, v in environment.items() if k not in SHELL_BOOKKEEPING),
        "cwd": os.getcwd(),
        "umask": mask, "limits": limits, "ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
        "namespace": [_inode(f"/proc/self/ns/{ns}") for ns in NAMESPACES] + [_inode("/proc/self/root")],
        "cgroup": _text("/proc/self/cgroup"), "python": sys.executable,
        "flags": _interpreter_flags(), "path": list(sys.path),
        "privileges": _inherited_status(), "oom_score_adj": _text("/proc/self/oom_score_adj"),
        "scheduling": [os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0),
                       sorted(os.sched_getaffinity(0))],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


#: Namespaces a child inherits from its fork server (each one's identity is in the key).
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "user", "cgroup")
#: What ``/proc/self/status`` says a child inherits besides ids: capabilities, no-new-privileges,
#: seccomp filters, allowed CPUs and memory nodes. A run started with fewer privileges (``capsh``,
#: ``setpriv``, a seccomp filter) must not have its workers forked with the server's.
_STATUS_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp",
                  "Seccomp_filters", "Cpus_allowed_list", "Mems_allowed_list")


def _inherited_status() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _text("/proc/self/status").splitlines():
        name, _, value = line.partition(":")
        if name in _STATUS_FIELDS:
            out[name] = value.strip()
    return out


def _inode(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def _text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def manifest(files: list[str]) -> dict[str, list[int]]:
    """``{file: [mtime_ns, size]}`` for ``files`` (``[-1, -1]``: absent)."""
    out: dict[str, list[int]] = {}
    for name in files:
        try:
            st = os.stat(name)
            out[name] = [st.st_mtime_ns, st.st_size]
        except OSError:
            out[name] = [-1, -1]
    return out


def manifest_current(recorded: dict[str, list[int]]) -> bool:
    """Whether every file the server imported (or read settings from) is as it was then."""
    return manifest(list(recorded)) == recorded


def _imported_files() -> list[str]:
    """The files of every module imported in this process, and the settings files Prefect read.

    With the whole tree of each package not installed here (a source checkout's): a worker
    judges such code stale once any file of it is newer than its import (``stale_code``).
    """
    from evalfleet.provenance import source_trees

    files = {os.path.abspath(f) for m in list(sys.modules.values())
             if isinstance(f := getattr(m, "__file__", None), str)}
    tops = {name.partition(".")[0] for name in list(sys.modules)}
    files.update(os.path.abspath(p) for p in source_trees(tops))
    files.update(os.path.abspath(name) for name in _SETTINGS_FILES)
    prefect_home = os.environ.get("PREFECT_HOME") or os.path.expanduser("~/.prefect")
    files.add(os.path.join(prefect_home, "profiles.toml"))
    return sorted(files)


# -- the driver's side ------------------------------------------------------------------------------

def usable(wanted: str) -> WarmRecord | None:
    """The shared server whose ``key`` is ``wanted``, ready and current, or None (start one)."""
    if not _opted_in:
        return None
    record = read_record()
    if (record is None or record.address is None or record.manifest is None
            or not alive(record.pid) or not is_warm_server(record.pid)):
        return None
    if record.key != wanted or not manifest_current(record.manifest):
        return None
    with contextlib.suppress(OSError):
        os.utime(record_path())  # in use: not idle (``serve``)
        return record
    return None


def ensure_started(modules: tuple[str, ...], environment: dict[str, str], wanted: str, cwd: str) -> None:
    """Leave a shared server of this run's kind behind unless one runs (opted-in runs only).

    ``modules``, ``environment``, ``wanted`` (its ``key``) and ``cwd``: the run's own fork server's,
    as they were when it started. A recorded server of another kind is stopped when none of its
    children is left, and kept otherwise (another run's workers are its children). Never raises:
    runs start a private fork server without it.
    """
    if not _opted_in:
        return
    from evalfleet.server import locked, read_state

    try:
        with locked():
            server = read_state()
            if server is None or not alive(server.pid):  # stopped meanwhile: it goes with it
                return
            record = read_record()
            if record is not None and alive(record.pid) and is_warm_server(record.pid):
                if record.key == wanted and (record.manifest is None
                                             or manifest_current(record.manifest)):
                    return
                if _children(record.pid) or _used_within(REPLACE_AFTER_S):
                    return  # another run's (or one attaching now): its workers are its children
                terminate(record.pid, grace_s=5.0)
            spawn(modules, environment, wanted, cwd)
    except Exception as err:  # noqa: BLE001 - runs start a private fork server without it
        logger.debug("could not leave a shared fork server behind: %s", err)


def _used_within(seconds: float) -> bool:
    """Whether a run took the recorded server for its own in the last ``seconds`` (``usable``)."""
    try:
        return time.time() - record_path().stat().st_mtime < seconds
    except OSError:
        return False


def spawn(modules: tuple[str, ...], environment: dict[str, str], wanted: str, cwd: str) -> int:
    """Start the shared server (``serve``) and record it; returns its pid (the caller holds the lock)."""
    home = evalfleet_home().resolve()
    spec = {"home": str(home), "modules": list(modules), "key": wanted}
    log_path = home / "fork-server.log"
    # Its workers' lines of every run that used it: started anew past LOG_KEEP_BYTES.
    mode = "wb" if log_path.exists() and log_path.stat().st_size > LOG_KEEP_BYTES else "ab"
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if mode == "wb" else os.O_APPEND)
    with os.fdopen(os.open(log_path, flags, 0o600), mode) as log:  # this user's only
        proc = subprocess.Popen(
            [sys.executable, *_interpreter_flags(), "-c",
             "from evalfleet.warm_forkserver import serve; serve()", json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=environment, cwd=cwd)
    _write_record(WarmRecord(pid=proc.pid, key=wanted, started=time.time()))
    return proc.pid


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (every process's parent read: no kernel option needed)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children() if alive(c.pid)]
    except psutil.Error:
        return []


def stop() -> WarmRecord | None:
    """Stop the recorded server (its children with it), remove its record; the caller holds the lock."""
    record = read_record()
    if record is None:
        return None
    if alive(record.pid) and is_warm_server(record.pid):
        terminate(record.pid, grace_s=5.0)
    record_path().unlink(missing_ok=True)
    return record


def describe() -> str:
    """One line for ``evalfleet server status``."""
    record = read_record()
    if record is None or not alive(record.pid) or not is_warm_server(record.pid):
        return "workers  no shared fork server (CLI runs start their own)"
    state = "ready" if record.address else "importing"
    return f"workers  shared fork server pid {record.pid}, {state}, {len(_children(record.pid))} child(ren)"


# -- the server ------------------------------------------------------------------------------------

def serve() -> None:
    """The shared server's process: import, record, then serve multiprocessing's fork-server protocol."""
    import multiprocessing.forkserver
    import multiprocessing.util

    global _home
    spec = json.loads(sys.argv[1])
    _home = Path(spec["home"])  # not exported: its children's environment is the run's
    folder = tempfile.mkdtemp(prefix="evalfleet-fs-")  # 0700: this user's only; a short path
    address = os.path.join(folder, "s")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()

    def leave(*_: Any) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    importing = time.time_ns()
    for name in ["evalfleet.fork_main", *spec["modules"], "evalfleet.preloaded"]:
        with contextlib.suppress(ImportError):  # as multiprocessing's own server does
            __import__(name)
    mine = WarmRecord(pid=os.getpid(), key=spec["key"], started=time.time(), address=address,
                      manifest=manifest(_imported_files()))
    # A file changed while it imported: what it imported is neither the old nor the new code
    # for sure, and its workers would find their code older than the files (``stale_code``).
    if not _still_recorded(mine.pid) or any(t >= importing for t, _ in (mine.manifest or {}).values()):
        leave()
    _write_record(mine)
    idle_s = float(os.environ.get(IDLE_ENV) or IDLE_S)

    def check(*_: Any) -> None:
        if not _still_recorded(mine.pid):
            leave()
        try:
            unused = time.time() - record_path().stat().st_mtime
        except OSError:
            leave()
        if unused >= idle_s and not _children(mine.pid):
            leave()
        signal.alarm(int(max(1, min(CHECK_EVERY_S, idle_s))))

    def child() -> None:  # a worker or a check: none of the server's own handlers
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    os.register_at_fork(after_in_child=child)
    multiprocessing.util.register_after_fork(_STDIO, _take_run_stdio)
    signal.signal(signal.SIGALRM, check)
    signal.alarm(int(max(1, min(CHECK_EVERY_S, idle_s))))
    alive_r, _alive_w = os.pipe()  # never at EOF: the server outlives the runs it serves
    multiprocessing.forkserver.main(listener.detach(), alive_r, [])


class _Stdio:
    """What ``multiprocessing.util.register_after_fork`` holds (a weak reference) for the hook."""


_STDIO = _Stdio()


def _take_run_stdio(_: object) -> None:
    """In a child of the shared server: stdout and stderr are the run's, sent last (``attach``).

    Runs when the child starts its target (multiprocessing's after-fork hooks), after what the
    run sent was unpickled by position: the two extra descriptors are then left out.
    """
    import multiprocessing.forkserver

    server: Any = multiprocessing.forkserver._forkserver
    fds = server._inherited_fds
    if not fds or len(fds) < 2:
        return
    for fd, target in zip(fds[-2:], (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    del fds[-2:]


def _still_recorded(pid: int) -> bool:
    record = read_record()
    return record is not None and record.pid == pid


# -- attached: this process's multiprocessing fork server is the shared one --------------------------

def attach(record: WarmRecord, start_private: Callable[[], None]) -> None:
    """Make multiprocessing's fork server in this process the shared one ``record`` names.

    Each child is sent this process's stdout and stderr (``_take_run_stdio``): what env and
    policy code print, and the workers' log lines, reach the run's terminal as they would from a
    private server. ``start_private``: what starts a private server instead, should the shared
    one be gone when a child is asked for (killed, out of memory): multiprocessing would start
    one anew; a run must never wait on a server that is not there.
    """
    import multiprocessing.forkserver
    from multiprocessing import resource_tracker

    server: Any = multiprocessing.forkserver._forkserver  # private: its address, pid and alive fd
    server._forkserver_address = record.address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)  # the children's: unused
    server._forkserver_pid = record.pid
    connect = type(server).connect_to_new_process

    def ensure_running() -> None:  # ``waitpid`` would fail: the shared one is not our child
        if not alive(record.pid) or not is_warm_server(record.pid):
            detach()
            start_private()
            return
        resource_tracker.ensure_running()

    def connect_with_stdio(fds: Sequence[int]) -> tuple[int, int]:
        if "ensure_running" not in vars(server):  # fell back to a private server
            return connect(server, fds)  # type: ignore[no-any-return]
        return connect(server, [*fds, 1, 2])  # type: ignore[no-any-return]

    server.ensure_running = ensure_running
    multiprocessing.forkserver.connect_to_new_process = connect_with_stdio  # what Popen calls


def attached() -> bool:
    """Whether this process's fork server is the shared one (``attach``)."""
    import multiprocessing.forkserver

    return "ensure_running" in vars(multiprocessing.forkserver._forkserver)


def detach() -> None:
    """Forget the shared server in this process (it runs on); the next cluster starts anew."""
    import multiprocessing.forkserver

    server: Any = multiprocessing.forkserver._forkserver
    if "ensure_running" not in vars(server):
        return
    del server.ensure_running
    multiprocessing.forkserver.connect_to_new_process = server.connect_to_new_process
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
