"""The fork server and the sandbox processes it forks (this module runs OUTSIDE the worker).

One fork server per worker process and level, started with ``python -m
evalfleet.sandbox.forkserver`` (inside bubblewrap for the ``bwrap`` level). It imports numpy,
gymnasium and the env's modules once, then forks one sandbox per request, so sandboxes share those
pages copy-on-write and start in milliseconds. It never imports torch: the policy stays in the
worker.

Control channel (worker ↔ server): a SOCK_SEQPACKET socketpair; requests are pickles, answers
JSON (see :mod:`evalfleet.sandbox.wire`). A ``spawn`` request carries one end of a fresh
socketpair (SCM_RIGHTS): the sandbox talks to the worker directly over it, so stepping 500
sandboxes costs no hop through the server. The server is the sandboxes' parent and the only
process that can reap them, so every kill goes through it (under bubblewrap the worker cannot even
see the sandboxes' pids).

The server confines itself before it imports any env module (``process`` level: a network namespace of
its own where permitted; both levels: the socket filter) and dies with its worker (parent-death
signal, and end of file on the control channel).

A sandbox: a pid namespace of its own where the machine permits it (with a user namespace of its
own unless the server is root at ``process`` level), as three processes: a host the server kills
and reaps, the namespace's init, and the sandbox proper, whose end the host mirrors. The sandbox
proper has its own process group, a fresh network namespace (where permitted), its own folder as
cwd/HOME/TMPDIR, an allow-listed environment (the server itself starts with one too), an IPC
namespace of its own (where permitted; always in the jail), rlimits (RLIMIT_NPROC counted for it
alone under a uid or user namespace of its own), at the ``process`` level under a root worker a uid
of its own keeping only CAP_DAC_READ_SEARCH, otherwise no capabilities, at the ``process`` level a
Landlock ruleset where the kernel has one (it opens only what the bwrap jail would bind and writes
only its own folder, ``file_rules``), at the ``bwrap`` level a mount namespace with a fresh
``/tmp`` and ``/dev/shm`` of its own (the jail's outlive this evaluation), death with its parent,
and a seccomp filter (sockets: AF_UNIX only; signals: its own pid namespace but never its init, or
only itself without one; no ptrace; under the worker's own uid at ``process`` level no chmod,
chown, utime or xattr change). When an episode ends and no other is under way in it, it kills every
other process of its namespace.

It serves reset/step requests for ``envs_per_sandbox`` env instances until its socket closes. An
exception in the env is answered as ``env_error`` (MemoryError as ``oom``); the broken env is
dropped and rebuilt at its next reset, and the sandbox goes on serving. It is replaced only when
it dies or is killed.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import pickle
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from evalfleet.redaction import redact
from evalfleet.sandbox import limits as lim
from evalfleet.sandbox import wire
from evalfleet.sandbox.bwrap import SYSTEM_PATHS, jail_binds, module_neighbours, package_paths
from evalfleet.sandbox.isolation import import_project_envs
from evalfleet.sandbox.slots import error_text, scalar_info
from evalfleet.seeds import fresh_global_rng

#: Added to a PermissionError of a Landlock-confined sandbox: what it may open, and how to widen it.
CONFINED_HINT = (" [process sandboxes open only what running the env needs; grant a path with "
                 "--sandbox-read / --sandbox-write]")


def confined_hint(path: str | None) -> str:
    """``CONFINED_HINT``, naming ``path`` (the refused one, absolute) in the flags when known.

    A data file in a subfolder of the env module's folder, say, is refused now that the folder
    is not granted whole: the row's error (and stage 1's) says which flag reads it.
    """
    if not path:
        return CONFINED_HINT
    where = redact(path)
    return (" [process sandboxes open only what running the env needs: --sandbox-read "
            f"{where} lets it read this path, --sandbox-write {where} write it]")

#: Exit status of a sandbox whose own code failed before serving (never an env's exception).
EXIT_SETUP = 70
_CONTROL_BUF = 4 * 1024 * 1024
#: How long a kill waits for a sandbox whose channel closed to finish exiting on its own.
_EXIT_GRACE_S = 2.0


def _send(sock: socket.socket, payload: dict[str, Any]) -> None:
    sock.send(json.dumps(payload).encode())


class _Server:
    def __init__(self, control: socket.socket, level: str, cgroup_fd: int | None = None
                 ) -> None:
        self.control = control
        self.level = level
        # A pids cgroup folder (v1) the worker made for this server: one child cgroup per
        # sandbox, pids.max its process cap. Where RLIMIT_NPROC does not bind (uid 0 outside).
        self.cgroup_fd = cgroup_fd
        self.cgroups: dict[int, str] = {}  # sandbox host pid -> its cgroup's name
        self.stale_cgroups: list[str] = []  # cgroups not yet empty when their sandbox was reaped
        # Never an evaluation's environment (its --sandbox-env values): the worker sends a
        # sandbox its own over the sandbox's socket, after the fork (``_receive_environment``).
        self.makers: dict[str, Callable[[], Any]] = {}
        self.files: dict[str, lim.FileRules] = {}  # token -> what its sandboxes may open
        self.children: dict[int, str] = {}
        self.serial = 0
        self.base = tempfile.mkdtemp(prefix="evalfleet-sandboxes-")
        os.chmod(self.base, 0o711)  # sandboxes under other uids reach their own folder, list none
        os.environ["HOME"] = self.base  # the worker's home is none of env code's business
        self.root = os.geteuid() == 0
        # Root at ``process`` level enters pid namespaces by CAP_SYS_ADMIN; everyone else (a
        # non-root worker; any worker inside the bwrap jail, capabilities dropped) needs a user
        # namespace per sandbox, which is also what makes RLIMIT_NPROC count per sandbox.
        self.new_user = not (self.root and level == "process")
        found = _check_sandbox_namespaces(self.new_user)
        # "nocap": namespaces work, but RLIMIT_NPROC does not bind (uid 0 outside is exempt).
        self.pidns_error = None if found == "nocap" else found
        self.nproc_counted = found is None and self.new_user
        # Each sandbox's own IPC namespace: with its pid namespace, else unshared in the sandbox
        # (a root worker's process level; in the jail, with its fresh /tmp, which it requires).
        self.ipcns_error = (None if self.pidns_error is None or level == "bwrap"
                            else _in_child(lambda: lim.unshare_ipc() or ""))

    def process_cap(self, limits: lim.SandboxLimits) -> str | None:
        """How the sandboxes' process cap holds, or None where it does not (as hello reports)."""
        if self.level == "process" and self.root and limits.drop_privileges:
            return f"RLIMIT_NPROC={limits.processes} under a uid of its own per sandbox"
        if self.nproc_counted:
            return f"RLIMIT_NPROC={limits.processes} counted in a user namespace per sandbox"
        if self.cgroup_fd is not None:
            return f"pids.max={limits.processes} in a pids cgroup per sandbox"
        return None

    def _cgroup_for(self, name: str, limits: lim.SandboxLimits) -> int | None:
        """A fresh pids cgroup ``name`` capped at ``limits.processes``: its cgroup.procs, open."""
        if self.cgroup_fd is None or self.nproc_counted:
            return None
        os.mkdir(name, dir_fd=self.cgroup_fd)
        cap = os.open(f"{name}/pids.max", os.O_WRONLY, dir_fd=self.cgroup_fd)
        try:
            os.write(cap, str(limits.processes).encode())
        finally:
            os.close(cap)
        return os.open(f"{name}/cgroup.procs", os.O_WRONLY, dir_fd=self.cgroup_fd)

    def _remove_cgroups(self, names: list[str]) -> None:
        """Remove the cgroups in ``names`` that are empty; keep the others for a later try."""
        if self.cgroup_fd is None:
            return
        for name in [*self.stale_cgroups, *names]:
            try:
                os.rmdir(name, dir_fd=self.cgroup_fd)
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: its namespace is still being torn down
                if name not in self.stale_cgroups:
                    self.stale_cgroups.append(name)
                continue
            if name in self.stale_cgroups:
                self.stale_cgroups.remove(name)

    def prepare(self, token: str, maker_blob: bytes, sys_path: list[str], preload: list[str],
                packages: tuple[str, ...] = (), data: tuple[str, ...] = ()) -> dict[str, Any]:
        for entry in sys_path:
            if entry not in sys.path:
                sys.path.append(entry)
        if self.level == "process":
            self.files[token] = file_rules(packages, data)
        failed = {}
        for name in preload:
            try:
                if name == "envs" or name.startswith("envs."):
                    # Only this project's: an ``envs`` first on the path runs nothing here.
                    import_project_envs(name)
                else:
                    importlib.import_module(name)
            except Exception as err:  # reported; the sandbox's own make() decides if it matters
                failed[name] = f"{type(err).__name__}: {err}"
        try:
            self.makers[token] = pickle.loads(maker_blob)
        except Exception as err:
            return {"ok": False, "error": f"cannot load the env maker: {type(err).__name__}: {err}",
                    "imports": failed}
        gc.collect()
        gc.freeze()  # GC passes in sandboxes would otherwise write to (and copy) shared pages
        return {"ok": True, "imports": failed}

    def spawn(self, token: str, k: int, limits: lim.SandboxLimits, netns: bool, fd: int
              ) -> dict[str, Any]:
        maker = self.makers[token]
        files = self.files.get(token)
        self.serial += 1
        folder = os.path.join(self.base, f"sbx-{self.serial}")
        os.mkdir(folder, 0o700)
        uid = None
        if self.level == "process" and self.root and limits.drop_privileges:
            uid = limits.uid_base + (os.getpid() % 16384) * 4096 + self.serial % 4096
            os.chown(folder, uid, uid)
        server_pid = os.getpid()
        pidns = self.pidns_error is None
        cgroup = f"sbx-{self.serial}"
        procs = self._cgroup_for(cgroup, limits)
        pid = os.fork()
        if pid == 0:
            code = EXIT_SETUP
            try:
                if procs is not None:
                    os.write(procs, b"0")  # join before anything else: every descendant too
                    os.close(procs)
                self.control.close()
                self._keep_only(token)
                # In the jail, a /tmp of its own: the jail's outlives this evaluation.
                fresh_tmp = self.level == "bwrap"
                if pidns:
                    code = _namespace_host(fd, maker, k, limits, folder, uid, netns, server_pid,
                                           self.new_user, files, fresh_tmp)
                else:
                    code = _sandbox_main(fd, maker, k, limits, folder, uid, netns, server_pid,
                                         own_pidns=False, own_user=False, files=files,
                                         fresh_tmp=fresh_tmp)
            finally:
                os._exit(code)
        os.close(fd)
        if procs is not None:
            os.close(procs)
            self.cgroups[pid] = cgroup
        self.children[pid] = folder
        return {"pid": pid, "uid": uid}

    def _keep_only(self, token: str) -> None:
        """In a freshly forked sandbox: forget every other evaluation this server serves.

        Its memory is a copy of the server's, which env code can walk (frames, ``gc``): other
        evaluations' makers (env ids, kwargs) and file rules go before any env code runs. Their
        environments never were here (see ``_receive_environment``). Residual: bytes the server
        freed (earlier requests' pickles) may linger in the copied heap until reused; they hold
        no environment, only makers' ids and kwargs, which the request's owner chose to send.
        """
        self.makers = {token: self.makers[token]}
        self.files = {t: rules for t, rules in self.files.items() if t == token}
        self.children, self.cgroups, self.stale_cgroups = {}, {}, []
        gc.collect()

    def cpu(self, pids: list[int]) -> dict[str, Any]:
        """CPU seconds each sandbox ``pids`` (hosts) has used, with all its descendants.

        Read from ``/proc`` here, outside the sandbox: its threads, its children and what they
        reaped (``utime + stime + cutime + cstime`` of every process under its host). None for
        a pid that is not a live sandbox of this server.
        """
        tick = os.sysconf("SC_CLK_TCK")
        kids: dict[int, list[int]] = {}
        spent: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    data = fh.read()
                fields = data[data.rindex(b")") + 2:].split()
                pid = int(name)
                kids.setdefault(int(fields[1]), []).append(pid)
                spent[pid] = sum(int(f) for f in fields[11:15])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
        seconds: list[float | None] = []
        for pid in pids:
            if pid not in self.children:
                seconds.append(None)
                continue
            total, stack = 0, [pid]
            while stack:
                p = stack.pop()
                total += spent.get(p, 0)
                stack.extend(kids.get(p, ()))
            seconds.append(total / tick)
        return {"seconds": seconds}

    def kill(self, pids: list[int], exiting: tuple[int, ...] = ()) -> dict[str, Any]:
        # ``exiting``: sandboxes whose channel closed. A host mirrors its sandbox's end a moment
        # after it; killing it first would turn a SIGSEGV or an out-of-memory exit into SIGKILL.
        ended: dict[int, int] = {}
        deadline = time.monotonic() + _EXIT_GRACE_S
        for pid in exiting:
            while pid in self.children and time.monotonic() < deadline:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    ended[pid] = status
                    break
                time.sleep(0.001)
        for pid in pids:
            if pid not in self.children or pid in ended:
                continue
            for target in (-pid, pid):  # the group; the pid too, in case setpgid has not run yet
                try:
                    os.kill(target, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        statuses: list[int | None] = []
        for pid in pids:
            folder = self.children.pop(pid, None)
            if folder is None:
                statuses.append(None)
                continue
            status = ended[pid] if pid in ended else os.waitpid(pid, 0)[1]
            statuses.append(status)
            shutil.rmtree(folder, ignore_errors=True)
        self._remove_cgroups([self.cgroups.pop(pid) for pid in pids if pid in self.cgroups])
        return {"statuses": statuses}

    def shutdown(self) -> None:
        self.kill(list(self.children))
        for _ in range(100):  # namespaces end within milliseconds of their init
            if not self.stale_cgroups:
                break
            time.sleep(0.01)
            self._remove_cgroups([])
        shutil.rmtree(self.base, ignore_errors=True)

    def loop(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.control, _CONTROL_BUF, 1)
            except ConnectionError:
                return
            if not msg:
                return  # the worker closed the channel or died
            request = pickle.loads(msg)
            op = request[0]
            try:
                if op == "spawn":
                    _, token, k, limits, netns = request
                    answer = self.spawn(token, k, limits, netns, fds[0])
                elif op == "kill":
                    answer = self.kill(request[1], *request[2:])
                elif op == "cpu":
                    answer = self.cpu(request[1])
                elif op == "prepare":
                    answer = self.prepare(*request[1:])
                elif op == "forget":
                    self.makers.pop(request[1], None)
                    self.files.pop(request[1], None)
                    answer = {"ok": True}
                else:
                    answer = {"error": f"unknown request {op!r}"}
            except Exception as err:
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                answer = {"error": f"{type(err).__name__}: {err}"}
            _send(self.control, answer)


def file_rules(packages: Iterable[str], data: Iterable[str] = ()) -> lim.FileRules:
    """What a ``process`` sandbox of an env from ``packages`` may read: the bwrap jail's binds.

    ``packages``: what the request names (``process.env_modules``: evalfleet's envs and the env
    id's ``module:`` prefix), never what the env reports of itself. ``data``: files and folders
    its kwargs name (``process.env_data_files``), read too.

    The system folders, the interpreter's, the site-packages and the packages of evalfleet and of
    the env (``jail_binds``; of a single-file module, its file and, one by one, the files beside it
    that its key covers: ``bwrap.module_neighbours``, regular files only, opened without following
    a symlink), beside the ``sys.path`` folders, listed only: never the rest of a project checkout,
    a home, the results or a secret file, even under a root worker's CAP_DAC_READ_SEARCH.
    """
    data, binds = tuple(data), jail_binds(packages)
    # The files beside a single-file module: granted as the regular files they are, never
    # through a symlink (one may be put there after they were listed).
    found = package_paths(["evalfleet", *packages])
    beside = {n for path in found if os.path.isfile(path) for n in module_neighbours(path)
              if n != path}
    files = tuple(p for p in binds if p in beside and p not in data)
    read = (*[p for p in SYSTEM_PATHS if os.path.exists(p)],
            *[p for p in binds if p not in files], *data)
    listed = tuple(dict.fromkeys(
        os.path.realpath(entry) for entry in sys.path
        if entry and os.path.isabs(entry) and os.path.isdir(entry)))
    return lim.FileRules(read=tuple(dict.fromkeys(read)), listed=listed, files=files)


def serve(fd: int, level: str, parent: int, cgroup_fd: int | None = None) -> None:
    """Fork-server main: confine itself, pre-import, say hello, then answer requests."""
    control = socket.socket(fileno=fd)
    lim.set_parent_death_signal(parent if level == "process" else os.getppid())
    netns_error = lim.unshare_network() if level == "process" else None
    lim.install_socket_filter()
    # numpy and gymnasium are imported (through .base) before any fork: shared copy-on-write.
    server = _Server(control, level, cgroup_fd)
    gc.collect()
    gc.freeze()
    _send(control, {"pid": os.getpid(), "level": level, "netns": netns_error is None,
                    "netns_error": netns_error, "uid": os.geteuid(), "folder": server.base,
                    "pidns": server.pidns_error is None, "pidns_error": server.pidns_error,
                    "ipcns": server.ipcns_error is None, "ipcns_error": server.ipcns_error,
                    "process_cap": server.process_cap(lim.SandboxLimits())})
    try:
        server.loop()
    finally:
        server.shutdown()


def _recv_frame(sock: socket.socket, buf: bytearray) -> bytes | None:
    while True:
        frames = wire.split_frames(buf)
        if frames:
            if len(frames) > 1 or buf:
                raise wire.ProtocolError("more than one request in flight")
            return frames[0]
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        buf.extend(chunk)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data.extend(chunk)
    return bytes(data)


def _receive_environment(sock: socket.socket) -> dict[str, str] | None:
    """The sandbox's environment: the first frame the worker sends on its socket (JSON).

    Sent to this sandbox alone after the fork, so the fork server, which serves every
    evaluation of its worker, never holds one evaluation's granted variables (``--sandbox-env``)
    for another's sandboxes to find in the memory they inherit.
    """
    # Exactly one frame: whatever follows (the first request) stays on the socket for ``serve``.
    head = _recv_exactly(sock, 4)
    size = int.from_bytes(head or b"", "little")
    if head is None or size > wire.MAX_FRAME:
        return None
    body = _recv_exactly(sock, size)
    if body is None:
        return None
    environment = json.loads(body)
    if not isinstance(environment, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in environment.items()):
        raise wire.ProtocolError("the sandbox's environment is not a str -> str mapping")
    return environment


def _check_sandbox_namespaces(new_user: bool) -> str | None:
    """Can a sandbox get a pid namespace of its own here? None, or why not (tried in a child)."""
    def probe() -> str:
        msg = lim.enter_sandbox_namespaces(new_user=new_user) or ""
        if msg:
            return msg
        child = os.fork()
        if child == 0:
            os._exit(_count_capped_forks() if os.getpid() == 1 else 99)
        _, status = os.waitpid(child, 0)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 99
        return "the first child was not the namespace's init" if code == 99 else "" if code == 0 else "nocap"

    return _in_child(probe)


def _check_private_tmp() -> str | None:
    """Can a jail's sandbox get a ``/tmp`` of its own (``lim.private_tmp``)? None, or why not.

    Tried in a child, as a sandbox would: a file the jail's ``/tmp`` holds must be out of its
    sight, its own ``/tmp`` writable and ``/dev`` not.
    """
    marker = tempfile.mkstemp(prefix="evalfleet-jail-tmp-")[1]

    def probe() -> str:
        lim.private_tmp(tempfile.mkdtemp(), new_user=True)
        with open("/tmp/evalfleet-own-tmp", "w"):
            pass
        problems = [f"{marker} is still in sight" if os.path.exists(marker) else "",
                    "/dev is writable" if os.access("/dev", os.W_OK) else ""]
        return "; ".join(p for p in problems if p)

    try:
        return _in_child(probe)
    finally:
        os.unlink(marker)


def _in_child(probe: Callable[[], str]) -> str | None:
    """``probe()`` in a forked child (it may change what the child is): its text, or None if empty.

    An exception in the probe is its text; the child exits at once, whatever it entered.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        msg = "probe child failed"
        try:
            os.close(r)
            msg = probe()
        except BaseException as err:  # noqa: B036 -- reported to the server
            msg = f"{type(err).__name__}: {err}"
        finally:
            os.write(w, msg.encode()[:400])
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        text = fh.read().decode()
    os.waitpid(pid, 0)
    return text or None


def _count_capped_forks() -> int:
    """0 if RLIMIT_NPROC=3 stops this namespace's 4th process, else 1 (uid 0 is exempt)."""
    resource.setrlimit(resource.RLIMIT_NPROC, (3, 3))
    kids = []
    try:
        for _ in range(6):
            kid = os.fork()
            if kid == 0:
                time.sleep(5)
                os._exit(0)
            kids.append(kid)
    except OSError:
        pass
    for kid in kids:
        os.kill(kid, signal.SIGKILL)
        os.waitpid(kid, 0)
    return 0 if len(kids) < 6 else 1


def _namespace_host(fd: int, maker: Callable[[], Any], k: int, limits: lim.SandboxLimits,
                    folder: str, uid: int | None, netns: bool, server_pid: int,
                    new_user: bool, files: lim.FileRules | None = None,
                    fresh_tmp: bool = False) -> int:
    """The process the server knows as the sandbox: a pid namespace, its init, the sandbox.

    Three processes: this host (in the server's namespace, the one the server kills and reaps),
    the namespace's init (reaps orphans; when the sandbox proper dies it exits, and the kernel
    kills whatever is left in the namespace) and the sandbox proper (pid 2, runs the env; not
    init itself, since init ignores the signals an env may send itself). The host ends as the
    sandbox did: same exit status, or the same signal, so the worker classifies it as before.
    """
    os.setpgid(0, 0)  # the host and the init: one group, killed together by the server
    lim.set_parent_death_signal(server_pid)
    error = lim.enter_sandbox_namespaces(new_user=new_user)
    if error is not None:  # checked at start-up; a failure now is the setup's
        return EXIT_SETUP
    init = os.fork()
    if init == 0:
        code = EXIT_SETUP
        try:
            code = _namespace_init(fd, maker, k, limits, folder, uid, netns, new_user, files,
                                   fresh_tmp)
        finally:
            os._exit(code)
    os.close(fd)
    _, status = os.waitpid(init, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 0
    if not sig and 128 < code <= 128 + 64:
        sig = code - 128  # the init's encoding of "the sandbox died from signal sig"
    if sig:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        return 128 + sig
    return code


def _namespace_init(fd: int, maker: Callable[[], Any], k: int, limits: lim.SandboxLimits,
                    folder: str, uid: int | None, netns: bool, new_user: bool,
                    files: lim.FileRules | None = None, fresh_tmp: bool = False) -> int:
    """Pid 1 of a sandbox's namespace: fork the sandbox, reap everything, exit when it does."""
    lim.set_parent_death_signal(0)  # its parent lives outside the namespace: getppid() is 0
    child = os.fork()
    if child == 0:
        code = EXIT_SETUP
        try:
            code = _sandbox_main(fd, maker, k, limits, folder, uid, netns, 1,
                                 own_pidns=True, own_user=new_user, files=files,
                                 fresh_tmp=fresh_tmp)
        finally:
            os._exit(code)
    os.close(fd)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return EXIT_SETUP
        if pid == child:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def _sandbox_main(fd: int, maker: Callable[[], Any], k: int, limits: lim.SandboxLimits,
                  folder: str, uid: int | None, netns: bool, parent: int,
                  *, own_pidns: bool, own_user: bool,
                  files: lim.FileRules | None = None, fresh_tmp: bool = False) -> int:
    """Confine this freshly forked process, then serve env requests until the socket closes.

    ``files`` (``process`` level): what it may open besides its folder (``lim.restrict_files``).
    ``fresh_tmp`` (``bwrap`` level): a ``/tmp`` and ``/dev/shm`` of its own (``lim.private_tmp``),
    so nothing an env writes outlives its sandbox in the jail, which later evaluations reuse.
    Its environment is the first frame on its socket (``_receive_environment``). A confinement
    ``limits.required`` names that it cannot apply ends it with ``lim.unconfined_status``.
    """
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.closerange(3, fd)
    os.closerange(fd + 1, 1 << 20)
    missing = [] if own_pidns else ["pidns"]  # what held of ``lim.MECHANISMS``: all the others
    # A user namespace of its own may make a network namespace too.
    if not (netns or own_user) or lim.unshare_network() is not None:
        missing.append("netns")
    if fresh_tmp:  # raises where it cannot be had: the env never runs with the jail's /tmp
        lim.private_tmp(folder, new_user=not own_user)  # and its IPC namespace, if not own_pidns
        own_user = True  # its capabilities over that user namespace are dropped below
    elif not own_pidns and lim.unshare_ipc() is not None:  # else its host gave it one already
        missing.append("ipcns")  # a root worker's works (others here have no user namespace)
    os.chdir(folder)
    fresh_global_rng()  # not the server's numpy state; before Landlock and seccomp below
    sock = socket.socket(fileno=fd)
    environment = _receive_environment(sock)
    if environment is None:
        return 0  # the worker closed the channel before sending it
    # Exactly the allow-listed environment the worker prepared (evalfleet.sandbox.environment).
    os.environ.clear()
    os.environ.update(environment, HOME=folder, TMPDIR=folder)
    tempfile.tempdir = folder
    # RLIMIT_NPROC counts this sandbox alone under a uid or a user namespace of its own.
    lim.apply_rlimits(limits, own_uid=uid is not None or own_user)
    if uid is not None:
        lim.drop_privileges(uid)
    elif own_user:
        lim.drop_all_capabilities()
    lim.set_parent_death_signal(parent)  # after setuid, which clears it
    confined = files is not None and lim.restrict_files(files, folder, limits) is None
    if not confined:
        missing.append("landlock")
    # What the evaluation's level promises (the probe the report states) and this sandbox could
    # not apply: it refuses before any env code runs (a worker without Landlock, say, ran it
    # unconfined under a report that said Landlock held). The worker names what is missing.
    lacking = [name for name in limits.required or () if name in missing]
    if lacking:
        return lim.unconfined_status(lacking)
    # Under the worker's own uid (a non-root worker's process level) it owns every file of the
    # worker's: their mode, owner, times and xattrs are not its to change (Landlock has no right
    # for these). Under a uid of its own the kernel refuses it; in the jail the binds are
    # read-only and /tmp its own.
    lim.install_sandbox_filter(own_pidns, refuse_metadata=files is not None and uid is None)
    lim.arm_cpu_budget(limits.cpu_seconds_per_episode)
    return _Sandbox(maker, k, limits, own_pidns, confined).serve(sock)


def _permission_error(err: BaseException) -> PermissionError | None:
    """``err`` if a PermissionError, else the first one it was raised from or while handling.

    Stage 1 makes the env inside ``envspec.env_facts``, which re-raises any failure as an
    ``EnvSpecError``; an env may wrap one in its own error too.
    """
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None or isinstance(seen, PermissionError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Sandbox:
    def __init__(self, maker: Callable[[], Any], k: int, limits: lim.SandboxLimits,
                 own_pidns: bool, confined: bool = False) -> None:
        self.maker = maker
        self.confined = confined  # Landlock: it opens only what running the env needs
        self.envs: list[Any] = [None] * k
        self.limits = limits
        self.own_pidns = own_pidns
        self.active: set[int] = set()  # slots with an episode under way

    def _episode_over(self, i: int) -> None:
        """Slot ``i``'s episode ended: with no other under way, kill every descendant left."""
        self.active.discard(i)
        if self.own_pidns and not self.active:
            lim.kill_namespace_others()

    def _drop(self, i: int) -> None:
        env, self.envs[i] = self.envs[i], None
        if env is not None:
            try:
                env.close()
            except Exception:  # a broken env may fail to close; it is rebuilt anyway
                pass

    def _failure(self, i: int, err: BaseException) -> wire.Result:
        self._drop(i)
        self._episode_over(i)
        if isinstance(err, MemoryError):
            gc.collect()
            return wire.Result(wire.OOM, error=f"MemoryError (address-space limit "
                                               f"{self.limits.address_space_bytes} bytes)")
        text = error_text(err)
        refused = _permission_error(err) if self.confined else None
        if refused is not None:
            name = refused.filename
            name = os.fsdecode(name) if isinstance(name, (str, bytes)) else None
            text = f"{text}{confined_hint(os.path.abspath(name) if name else None)}"
        return wire.Result(wire.ENV_ERROR, error=text)

    def reset(self, i: int, seed: int) -> wire.Result:
        self._episode_over(i)  # a slot reset mid-episode ends that episode too
        self.active.add(i)
        lim.arm_cpu_budget(self.limits.cpu_seconds_per_episode)
        env = self.envs[i]
        if env is None:
            env = self.envs[i] = self.maker()
        obs, info = env.reset(seed=seed)
        return wire.Result(wire.OK, obs, info=scalar_info(info))

    def describe(self, i: int, _: Any) -> wire.Result:
        """The env's ``facts()`` (``envspec.env_facts``) as JSON bytes.

        For stage 1 and workers that must not import the env's code (``resolve_env_for``).
        """
        lim.arm_cpu_budget(self.limits.cpu_seconds_per_episode)
        facts: Callable[[], Any] = getattr(self.maker, "facts")  # noqa: B009 - an EnvMaker's
        text = json.dumps(facts()).encode()
        return wire.Result(wire.OK, np.frombuffer(text, dtype=np.uint8))

    def step(self, i: int, action: Any) -> wire.Result:
        env = self.envs[i]
        if env is None:
            return wire.Result(wire.ENV_ERROR, error="env was not reset")
        obs, reward, terminated, truncated, info = env.step(action)
        done = bool(terminated or truncated)
        if done:
            self._episode_over(i)
        return wire.Result(wire.OK, obs, float(reward), bool(terminated), bool(truncated),
                           scalar_info(info) if done else None)

    def serve(self, sock: socket.socket) -> int:
        buf = bytearray()
        while True:
            body = _recv_frame(sock, buf)
            if body is None:
                return 0
            op, items = pickle.loads(body)
            handlers: dict[str, Callable[[int, Any], wire.Result]] = {
                "reset": self.reset, "describe": self.describe, "step": self.step}
            handler = handlers[op]
            parts = []
            try:
                for i, arg in items:
                    t0 = time.monotonic()
                    try:
                        result = handler(i, arg)
                        result.seconds = time.monotonic() - t0
                        # Encoding inside the try: an unsendable observation is the env's error.
                        parts.append(wire.encode_result(result))
                    except BaseException as err:  # noqa: B036 -- SystemExit in an env is an error
                        result = self._failure(i, err)
                        result.seconds = time.monotonic() - t0
                        parts.append(wire.encode_result(result))
                sock.sendall(wire.pack_results(parts))
            except MemoryError:
                return lim.EXIT_OOM


def main(argv: list[str]) -> None:
    """``python -m evalfleet.sandbox.forkserver FD LEVEL PARENT_PID [PIDS_CGROUP_DIR_FD]``."""
    fd, level, parent = int(argv[0]), argv[1], int(argv[2])
    serve(fd, level, parent, int(argv[3]) if len(argv) > 3 else None)


if __name__ == "__main__":
    main(sys.argv[1:])
