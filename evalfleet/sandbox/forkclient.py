"""The worker's side of its fork servers: start one per level (and env packages), talk to it, stop it.

A fork server (:mod:`evalfleet.sandbox.forkserver`, a process of its own, inside bubblewrap at the
``bwrap`` level) imports the env's modules once and forks sandboxes on request. This module holds
the worker's handle on it (:class:`ForkServer`: the control socket, requests and answers, stop and
clean-up) and the per-process registry (:func:`fork_server`, :func:`shutdown_fork_servers`,
:func:`shutdown_unused_fork_servers`) that
starts a server on first use and reuses it for the next shard. What runs episodes in the sandboxes
it forks is :class:`evalfleet.sandbox.process.ProcessSlots`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import logging
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from evalfleet.errors import IsolationUnavailable
from evalfleet.sandbox.bwrap import jail_command, module_neighbours, package_paths
from evalfleet.sandbox.environment import PINNED, sandbox_environment

logger = logging.getLogger(__name__)

#: Requests pipelined to the fork server before reading answers (keeps both buffers from filling).
_SPAWN_BATCH = 32


# -- starting processes from one long-lived thread -------------------------------------------------
# PR_SET_PDEATHSIG (set by the fork server, and by bwrap's --die-with-parent) fires when the
# *thread* that started the process exits. Dask task threads may come and go, so servers are
# started from one daemon thread that lives as long as the worker process.

_launch_queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
    queue.SimpleQueue()
)
_launcher: threading.Thread | None = None
_launcher_lock = threading.Lock()


def _launcher_loop() -> None:
    while True:
        fn, fut = _launch_queue.get()
        try:
            fut.set_result(fn())
        except BaseException as err:  # noqa: B036 -- handed to the caller
            fut.set_exception(err)


def _launch(fn: Callable[[], Any]) -> Any:
    global _launcher
    with _launcher_lock:
        if _launcher is None or not _launcher.is_alive():
            _launcher = threading.Thread(target=_launcher_loop, name="evalfleet-sandbox-launcher",
                                         daemon=True)
            _launcher.start()
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    _launch_queue.put((fn, fut))
    return fut.result()


# -- the fork server, seen from the worker ---------------------------------------------------------


class ForkServerError(Exception):
    """The fork server died, hung, or answered nonsense."""


#: How a fork server starts: -P, and "/" as its working folder (``ForkServer``), so the worker's
#: folder (which a sandbox may be able to write, /tmp for one) is not where it looks first.
SERVER_COMMAND = [sys.executable, "-P", "-m", "evalfleet.sandbox.forkserver"]


class ForkServer:
    """A worker's fork server for one level, seen from the worker: start, requests, stop."""

    def __init__(self, level: str, start_timeout_s: float, packages: tuple[str, ...] = ()
                 ) -> None:
        self.level = level
        self.packages = packages
        # The files of single-file env modules the jail binds, as they are now (``fork_server``).
        self.bound = bound_module_files(packages) if level == "bwrap" else ()
        self.retired = False  # replaced in the registry; stops once no evaluation uses it
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        inner = [*SERVER_COMMAND, str(theirs.fileno()), level, str(os.getpid())]
        # A root worker's jail is uid 0 outside, exempt from RLIMIT_NPROC: the server gets a
        # pids cgroup folder of its own (an open folder, since the jail cannot see /sys) and
        # caps each sandbox with a child cgroup.
        self.cgroup = pids_cgroup_folder() if level == "bwrap" and os.geteuid() == 0 else None
        cgroup_fd = (os.open(self.cgroup, os.O_RDONLY | os.O_DIRECTORY)
                     if self.cgroup is not None else None)
        if cgroup_fd is not None:
            inner.append(str(cgroup_fd))
        # The jail shows only the package folders of evalfleet and of ``packages`` (the env's).
        command = jail_command(inner, packages=packages) if level == "bwrap" else inner
        # Never the worker's whole environment: its credentials are none of env code's business.
        # Its hash seed is every sandbox's: they are forked from it (``PINNED``).
        env = dict(sandbox_environment(), **PINNED, PYTHONDONTWRITEBYTECODE="1")
        t0 = time.perf_counter()
        try:
            self.proc: subprocess.Popen[bytes] = _launch(
                lambda: subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, start_new_session=True, cwd="/",
                    pass_fds=[theirs.fileno(), *([] if cgroup_fd is None else [cgroup_fd])])
            )
        except OSError as err:
            raise IsolationUnavailable(
                f"cannot start the {level!r} fork server ({command[0]}): {err}"
            ) from err
        finally:
            theirs.close()
            if cgroup_fd is not None:
                os.close(cgroup_fd)
        self._sock = ours
        try:
            self.hello = self._recv(start_timeout_s)
        except ForkServerError as err:
            self.stop()
            raise IsolationUnavailable(
                f"the {level!r} fork server did not start within {start_timeout_s} s: {err}. "
                "Run `python -c 'from evalfleet.sandbox.isolation import probe; print(probe())'` "
                "to see what this machine allows."
            ) from err
        self.start_seconds = time.perf_counter() - t0
        self.prepared: set[str] = set()
        #: Tokens of the slots that took this server from ``fork_server`` and have not released
        #: it (``release_fork_server``): while any is left, ``shutdown_unused_fork_servers``
        #: leaves it running.
        self.users: set[str] = set()
        logger.info("%s fork server up in %.2f s: %s", level, self.start_seconds, self.hello)

    @property
    def alive(self) -> bool:
        """True while the server process runs."""
        return self.proc.poll() is None

    def _recv(self, timeout: float) -> dict[str, Any]:
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(1 << 16)
        except TimeoutError as err:
            raise ForkServerError(f"no answer within {timeout} s") from err
        except OSError as err:
            raise ForkServerError(str(err)) from err
        if not data:
            raise ForkServerError(f"fork server exited (status {self.proc.poll()})")
        try:
            answer = json.loads(data)
        except ValueError as err:
            raise ForkServerError(f"unreadable answer {data[:80]!r}") from err
        if not isinstance(answer, dict):
            raise ForkServerError(f"unreadable answer {data[:80]!r}")
        if "error" in answer:
            raise ForkServerError(str(answer["error"]))
        return answer

    def _send(self, request: tuple[Any, ...], fd: int | None = None) -> None:
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            if fd is None:
                self._sock.sendall(blob)
            else:
                socket.send_fds(self._sock, [blob], [fd])
        except OSError as err:
            raise ForkServerError(f"fork server gone: {err}") from err

    def call(self, request: tuple[Any, ...], timeout: float) -> dict[str, Any]:
        """One request, one answer."""
        with self._lock:
            self._send(request)
            return self._recv(timeout)

    def spawn_many(self, requests: list[tuple[tuple[Any, ...], socket.socket]], timeout: float
                   ) -> list[dict[str, Any]]:
        """Fork one sandbox per ``(request, its end of the socketpair)``, pipelined."""
        out: list[dict[str, Any]] = []
        with self._lock:
            for start in range(0, len(requests), _SPAWN_BATCH):
                chunk = requests[start : start + _SPAWN_BATCH]
                for request, sock in chunk:
                    self._send(request, sock.fileno())
                out.extend(self._recv(timeout) for _ in chunk)
        return out

    def stop(self) -> None:
        """Close the channel (the server then kills its sandboxes and exits); kill if it lingers."""
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.cgroup is not None:
            _remove_cgroup_tree(self.cgroup)
        # A killed server leaves its sandbox folders behind (the hello predates any env import,
        # and the path is checked anyway before anything is removed as root).
        folder = getattr(self, "hello", {}).get("folder")
        if (self.level == "process" and isinstance(folder, str)
                and os.path.dirname(folder) == tempfile.gettempdir()
                and os.path.basename(folder).startswith("evalfleet-sandboxes-")):
            shutil.rmtree(folder, ignore_errors=True)


#: Where root workers make the pids cgroups of their bwrap fork servers (cgroup v1).
PIDS_CGROUP_ROOT = "/sys/fs/cgroup/pids/evalfleet"
_cgroup_serial = 0


def pids_cgroup_folder() -> str | None:
    """A fresh pids cgroup folder for one fork server, or None where none can be made."""
    global _cgroup_serial
    _cgroup_serial += 1
    path = os.path.join(PIDS_CGROUP_ROOT, f"worker-{os.getpid()}-{_cgroup_serial}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        logger.info("no pids cgroup for the bwrap fork server (%s): %s", path, err)
        return None
    return path


def _remove_cgroup_tree(path: str) -> None:
    """Remove a fork server's cgroup and its leftover children (empty once their tasks died)."""
    for _ in range(100):
        try:
            for name in os.listdir(path):
                if os.path.isdir(os.path.join(path, name)):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(path, name))
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    logger.warning("could not remove the pids cgroup %s (tasks still in it)", path)


_servers: dict[tuple[str, tuple[str, ...]], ForkServer] = {}
_latest: dict[str, tuple[str, tuple[str, ...]]] = {}
_retired: list[ForkServer] = []  # out of the registry, still serving an evaluation
_servers_lock = threading.Lock()


def bound_module_files(packages: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """The single-file modules' files a jail of ``packages`` binds, each with device and inode.

    A bind shows the file that was there when the jail started. One replaced since (an editor
    that saves by rename, a data file rewritten by rename), added or removed would leave a warm
    jail running what was there before, under a cache key made of what is there now.
    """
    out: list[tuple[str, int, int]] = []
    for path in package_paths(packages):
        if not os.path.isfile(path):
            continue
        for name in module_neighbours(path):
            try:
                st = os.stat(name)
            except OSError:
                continue
            out.append((name, st.st_dev, st.st_ino))
    return tuple(out)


def _server_key(level: str, packages: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    # Only a bwrap jail's view depends on the env's packages; a process server sees everything.
    if level != "bwrap":
        return level, ()
    return level, tuple(sorted({m.split(".", 1)[0] for m in packages if m}))


def fork_server(level: str, start_timeout_s: float, packages: Sequence[str] | None = None,
                user: str | None = None) -> ForkServer:
    """The fork server of ``level`` for envs from ``packages``, started on first use, reused.

    ``packages=None``: the server of ``level`` used last (started with no env packages if none).
    ``user``: the token of the slots taking it, counted until ``release_fork_server``.
    """
    idle: ForkServer | None = None
    with _servers_lock:
        key = (_latest.get(level, _server_key(level, ())) if packages is None
               else _server_key(level, packages))
        server = _servers.get(key)
        if server is not None and not server.alive:
            server.stop()
            server = None
        if server is not None and server.bound != bound_module_files(key[1]):
            # A new jail binds the files as they are now; the old one finishes its evaluations.
            logger.info("an env module's files changed: a new %s jail for %s", level, key[1])
            del _servers[key]
            server.retired = True
            if server.prepared or server.users:
                _retired.append(server)
            else:
                idle = server
            server = None
        if server is None:
            server = _servers[key] = ForkServer(level, start_timeout_s, key[1])
        _latest[level] = key
        if user is not None:
            server.users.add(user)
    if idle is not None:
        idle.stop()
    return server


def release_fork_server(server: ForkServer, token: str) -> None:
    """The evaluation ``token`` is done with ``server``: a retired one stops with its last."""
    with _servers_lock:
        server.prepared.discard(token)
        server.users.discard(token)
        done = server.retired and not server.prepared and not server.users and server in _retired
        if done:
            _retired.remove(server)
    if done:
        server.stop()


def shutdown_fork_servers() -> None:
    """Stop every fork server of this process (each kills its sandboxes first)."""
    with _servers_lock:
        servers = [*_servers.values(), *_retired]
        _servers.clear()
        _latest.clear()
        _retired.clear()
    for server in servers:
        server.stop()


def shutdown_unused_fork_servers() -> None:
    """Stop the fork servers of this process that no open slots use (their sandboxes first).

    What a runner's ``close()`` calls: another runner of the same process (a second
    ``Evaluator``) may be replaying in sandboxes of a server right now. Stopping every server
    killed them mid-episode: the replay ended ``crashed`` and was taken for non-determinism.
    A server left running here stops once unused, at a later call, or at exit.
    """
    with _servers_lock:
        unused = [s for s in [*_servers.values(), *_retired] if not s.users and not s.prepared]
        for key in [k for k, v in _servers.items() if v in unused]:
            del _servers[key]
        for level in [lv for lv, key in _latest.items() if key not in _servers]:
            del _latest[level]
        _retired[:] = [s for s in _retired if s not in unused]
    for server in unused:
        server.stop()


def discard_fork_server(server: ForkServer) -> None:
    """Take ``server`` out of the registry and stop it (the next ``fork_server`` starts a new one)."""
    with _servers_lock:
        for key in [k for k, v in _servers.items() if v is server]:
            del _servers[key]
        if server in _retired:
            _retired.remove(server)
    server.stop()


atexit.register(shutdown_fork_servers)
