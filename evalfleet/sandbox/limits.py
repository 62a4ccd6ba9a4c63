"""Resource limits and confinement steps applied inside sandbox processes.

:class:`SandboxLimits` holds every limit and timeout of the ``process`` and ``bwrap`` levels, each
with its documented default; ``as_dict()`` is what the report prints. The functions below run in
the fork server or in a freshly forked sandbox, never in the worker: they change the calling
process for good (rlimits, seccomp, namespaces, uid).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import resource
import signal
import socket
import stat
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from evalfleet.errors import RequestError

if TYPE_CHECKING:  # the fork server imports this module; it needs no pydantic models
    from evalfleet.models import EvalRequest

MiB = 1024 * 1024
GiB = 1024 * MiB

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_ST_RELATIME = 4096

#: Exit status of a sandbox that ran out of memory and could not even report it.
EXIT_OOM = 86

#: Confinement a sandbox applies itself where the machine allows it (the probe's names):
#: Landlock file rules (``process`` level), a network, pid and IPC namespace of its own.
MECHANISMS = ("landlock", "netns", "pidns", "ipcns")
#: Exit status of a sandbox that refused to run env code, plus one bit per ``MECHANISMS`` entry
#: it was required to have and could not (``SandboxLimits.required``).
EXIT_UNCONFINED = 100


def unconfined_status(missing: list[str]) -> int:
    """The exit status of a sandbox that lacks ``missing`` (names in ``MECHANISMS``)."""
    return EXIT_UNCONFINED + sum(1 << MECHANISMS.index(name) for name in missing)


def unconfined_missing(status: int) -> list[str]:
    """What a sandbox that exited with ``status`` lacked; empty for any other status."""
    bits = status - EXIT_UNCONFINED
    if not 0 < bits < 1 << len(MECHANISMS):
        return []
    return [name for i, name in enumerate(MECHANISMS) if bits >> i & 1]


@dataclass(frozen=True)
class SandboxLimits:
    """Limits and timeouts of one sandbox process (``process`` and ``bwrap`` levels)."""

    address_space_bytes: int = 1 * GiB
    """RLIMIT_AS: virtual memory of a sandbox. Hitting it raises MemoryError in the env → ``oom``."""

    cpu_seconds_per_episode: int = 120
    """RLIMIT_CPU (soft), re-armed at every reset: CPU seconds one episode may use. A backstop for
    the wall-clock timeout (an env that runs threads can burn more CPU than wall time); breaking it
    ends the sandbox with SIGXCPU → ``timeout``."""

    open_files: int = 256
    """RLIMIT_NOFILE: open file descriptors per sandbox."""

    file_size_bytes: int = 64 * MiB
    """RLIMIT_FSIZE: largest file a sandbox may write (a bigger write fails with EFBIG)."""

    processes: int = 64
    """RLIMIT_NPROC: processes and threads of one sandbox (its own helper processes included).
    It holds where the kernel counts them per sandbox: under a uid of its own (``process`` level,
    root worker), or in a user namespace of its own (a non-root worker, and ``bwrap`` under a
    non-root worker). Uid 0 is exempt, so a root worker's ``bwrap`` sandboxes get ``pids.max``
    in a pids cgroup each instead; the fork server reports which held as ``process_cap``. A fork
    past it fails with EAGAIN."""

    step_timeout_s: float = 10.0
    """Wall clock a sandbox has to answer one step (capped by the episode's deadline)."""

    reset_timeout_s: float = 30.0
    """Wall clock a sandbox has to answer a reset, env construction included (capped likewise)."""

    start_timeout_s: float = 60.0
    """Wall clock for a fork server to start and import the env's modules."""

    drop_privileges: bool = True
    """``process`` level, when the worker runs as root: run each sandbox under a uid of its own
    (no capabilities, cannot signal other sandboxes or write root-owned files)."""

    uid_base: int = 1_000_000_000
    """First uid of the range sandbox uids are taken from (no passwd entries are needed)."""

    readable: tuple[str, ...] = ()
    """``process`` level: paths its sandboxes may also read beneath (an env's data outside its
    package), beside what the bwrap jail would bind (``restrict_files``)."""

    writable: tuple[str, ...] = ()
    """``process`` level: paths its sandboxes may also write beneath, beside their own folder."""

    required: tuple[str, ...] | None = None
    """Confinement (``MECHANISMS``) each sandbox must have in force before any env code runs:
    one that cannot apply it refuses (exits ``unconfined_status``), and its episodes end as
    ``crashed``, naming the worker and what it lacks, never as rows computed unconfined. The
    driver sends what its probe found for the level (``isolation.promised``), which the report's
    manifest states; None: this process's own probe's, taken when slots open."""

    def __post_init__(self) -> None:
        for name in ("address_space_bytes", "cpu_seconds_per_episode", "open_files",
                     "file_size_bytes", "processes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise RequestError(f"'{name}' must be a positive integer (got {value!r}).")
        for name in ("step_timeout_s", "reset_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise RequestError(f"'{name}' must be > 0 seconds (got {value!r}).")
        unknown = set(self.required or ()) - set(MECHANISMS)
        if unknown:
            raise RequestError(f"'required' names unknown mechanisms {sorted(unknown)} "
                               f"(known: {', '.join(MECHANISMS)}).")
        for name in ("readable", "writable"):
            for path in getattr(self, name):
                if not isinstance(path, str) or not os.path.isabs(path):
                    raise RequestError(f"'{name}' paths must be absolute (got {path!r}).")
        if self.address_space_bytes < 256 * MiB:
            raise RequestError(
                f"'address_space_bytes' must be at least 256 MiB (got {self.address_space_bytes!r}):"
                " a sandbox forked from a server with numpy and gymnasium maps ~200 MiB at start."
            )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for the report's manifest."""
        return asdict(self)


def sandbox_limits(request: EvalRequest, required: tuple[str, ...] | None = None
                   ) -> SandboxLimits:
    """The request's sandbox limits (defaults documented in ``SandboxLimits``).

    ``required``: the confinement each sandbox must have (``SandboxLimits.required``).
    """
    return SandboxLimits(address_space_bytes=request.sandbox_memory_mb * MiB,
                         step_timeout_s=request.step_timeout_s,
                         readable=tuple(request.sandbox_read), writable=tuple(request.sandbox_write),
                         required=None if required is None else tuple(required))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def unshare_network() -> str | None:
    """Move the calling process into a new, empty network namespace; None, or why not."""
    if _libc().unshare(_CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    return None


def unshare_ipc() -> str | None:
    """Move the calling process into a new IPC namespace; None, or why not.

    SysV shared memory, semaphores and message queues, and POSIX message queues, live in the
    IPC namespace, not in a file Landlock or a fresh ``/tmp`` covers: a segment one sandbox left
    there reached the sandboxes of later evaluations (and outlived the CLI run). Needs
    CAP_SYS_ADMIN over this process's user namespace.
    """
    if _libc().unshare(_CLONE_NEWIPC) != 0:
        return f"unshare(CLONE_NEWIPC) failed: {os.strerror(ctypes.get_errno())}"
    return None


def enter_sandbox_namespaces(*, new_user: bool) -> str | None:
    """A new pid namespace for this process's next child, an IPC namespace of its own now.

    And a user namespace, if ``new_user``. The next child becomes the namespace's init: when it
    dies, the kernel kills every process left in the namespace, daemons that left the process
    group and session included. The IPC namespace (``unshare_ipc``) is the caller's at once, its
    descendants' with it, and gone with the last of them. A user namespace (needed where the
    caller lacks CAP_SYS_ADMIN) maps only the caller's own uid and gid, and makes the kernel
    count RLIMIT_NPROC for this sandbox alone. None, or why not.
    """
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWPID | _CLONE_NEWIPC | (_CLONE_NEWUSER if new_user else 0)
    if _libc().unshare(flags) != 0:
        what = "CLONE_NEWUSER|CLONE_NEWPID|CLONE_NEWIPC" if new_user else "CLONE_NEWPID|CLONE_NEWIPC"
        return f"unshare({what}) failed: {os.strerror(ctypes.get_errno())}"
    if new_user:
        try:
            _map_own_ids(uid, gid)
        except OSError as err:
            return f"cannot map the sandbox's uid in its user namespace: {err}"
    return None


def _map_own_ids(uid: int, gid: int) -> None:
    """In a user namespace just entered: map ``uid`` and ``gid`` (the caller's, outside) alone."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    libc = _libc()
    if libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                  ctypes.c_ulong(flags), data and data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_points_under(root: str) -> list[str]:
    """The outermost mount points strictly beneath ``root`` in this process's mount namespace."""
    found: list[str] = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            # Field 5 is the mount point, with space, tab, newline and backslash as \ooo.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point.startswith(root.rstrip("/") + "/"):
                found.append(point)
    kept: list[str] = []
    for point in sorted(set(found), key=lambda p: (len(p), p)):
        if not any(point.startswith(k + "/") for k in kept):
            kept.append(point)  # a mount beneath one kept comes along with it (MS_REC)
    return kept


def private_tmp(folder: str, *, new_user: bool) -> None:
    """Give this process a mount namespace of its own: a fresh, empty ``/tmp`` and ``/dev/shm``.

    For a sandbox forked in a bwrap jail. The jail, its tmpfs ``/tmp`` and its ``/dev`` serve
    every later evaluation of the worker's envs from the same packages: a file one sandbox left
    there (an env caching a level it generated) was read by the sandboxes of later evaluations,
    with other kwargs, and changed their returns. Here each sandbox gets its own, gone with it.
    The jail's binds beneath ``/tmp`` (``bwrap.rebinds_under_tmp``: a virtual environment or a
    module kept under ``/tmp``) are bound again, read-only as they were; ``folder`` (the
    sandbox's own, made by the server in the jail's ``/tmp``) is made again, empty; the jail's
    ``/dev`` is made read-only (its devices stay usable: each is a mount of its own).

    Needs CAP_SYS_ADMIN over this process's user namespace, as in a sandbox's own one;
    ``new_user``: enter one first, with an IPC namespace of its own (a sandbox without a pid
    namespace has neither; with one, ``enter_sandbox_namespaces`` gave it both). Raises
    ``OSError`` where it cannot be had: such a sandbox never runs env code.
    """
    libc = _libc()
    if new_user:
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWIPC) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER|CLONE_NEWNS|CLONE_NEWIPC) "
                                              f"failed: {os.strerror(ctypes.get_errno())}")
        _map_own_ids(uid, gid)
    elif libc.unshare(_CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed: "
                                          f"{os.strerror(ctypes.get_errno())}")
    # Nothing mounted from here on reaches the jail's namespace (or another sandbox's).
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    # Open before the new tmpfs hides them; bound again from the open descriptors.
    keep = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in _mount_points_under("/tmp")]
    try:
        _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
        for path, fd in keep:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, exist_ok=True)
            else:  # a single-file module: a file to bind onto
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
            # A bind keeps the flags of its source: read-only, and locked so by the kernel.
            _mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
    finally:
        for _, fd in keep:
            os.close(fd)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.path.isdir("/dev/shm"):
        _mount("tmpfs", "/dev/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=1777")
    # Remounting must repeat the flags the jail's namespace locked (nosuid, nodev, atime).
    flags = os.statvfs("/dev").f_flag
    kept = flags & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_NOATIME | _MS_NODIRATIME)
    atime = _MS_RELATIME if flags & _ST_RELATIME else 0 if flags & _MS_NOATIME else _MS_STRICTATIME
    _mount(None, "/dev", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | kept | atime)


def drop_all_capabilities() -> None:
    """Clear every capability (the ones a new user namespace grants over its own namespaces)."""
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    if _libc().capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")


def kill_namespace_others(timeout_s: float = 5.0) -> int:
    """SIGKILL every process of this pid namespace but its init and the caller; reap them.

    For the sandbox process of a pid namespace of its own: its descendants are exactly the other
    processes there. Orphans are reaped by the namespace's init, the caller's children here.
    Returns how many rounds of kill it took (0: there was nothing to kill).
    """
    rounds = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(-1, 0)
        except ProcessLookupError:
            return rounds
        rounds += 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        while True:  # zombies answer kill(-1, 0) until reaped
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        time.sleep(0.001 * min(rounds, 20))
    return rounds


def set_parent_death_signal(expected_parent: int) -> None:
    """Be SIGKILLed when the parent dies; exit now if it already has (the race after fork)."""
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(1)


def apply_rlimits(limits: SandboxLimits, *, own_uid: bool) -> None:
    """Set the sandbox's rlimits (soft = hard, so an unprivileged sandbox cannot raise them).

    ``own_uid``: the kernel counts RLIMIT_NPROC for this sandbox alone (a uid or a user namespace
    of its own), so the process cap is set; otherwise it would count the worker's processes too.
    """
    fixed = [
        (resource.RLIMIT_AS, limits.address_space_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_CORE, 0),
    ]
    if own_uid:
        fixed.append((resource.RLIMIT_NPROC, limits.processes))
    for which, value in fixed:
        resource.setrlimit(which, (value, value))


def arm_cpu_budget(seconds: int) -> None:
    """Allow ``seconds`` more CPU time from now (RLIMIT_CPU soft limit; the hard one stays)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = int(used.ru_utime + used.ru_stime) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = spent + seconds
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


_PR_SET_KEEPCAPS = 8
_CAP_VERSION_3 = 0x20080522
_CAP_DAC_READ_SEARCH = 2


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_privileges(uid: int) -> None:
    """Become ``uid``/``uid``, no supplementary groups, one capability: CAP_DAC_READ_SEARCH.

    The capability lets the sandbox read (never write) every file, so lazy imports of a Python
    installed under a private home (e.g. pyenv under /root) still work; every other privilege of
    root is gone.
    """
    libc = _libc()
    libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    header = _CapHeader(_CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    data[0].effective = data[0].permitted = 1 << _CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")
    libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)


def install_socket_filter() -> None:
    """seccomp: socket() of any family but AF_UNIX fails with EPERM; io_uring is refused too.

    io_uring can create sockets without the socket() syscall, so it is closed as well.
    """
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    f.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(sc.ERRNO(errno.EPERM), "io_uring_setup")
    f.load()


#: Changes of a file's mode, owner, times and extended attributes. Landlock has no right for
#: them: a sandbox under the worker's own uid made the worker's cache, outputs and MLflow store
#: world-writable (chmod 0666) or reset their times, files it could neither open nor write.
METADATA_CALLS = ("chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown",
                  "fchownat", "utime", "utimes", "utimensat", "futimesat", "setxattr", "lsetxattr",
                  "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat",
                  "removexattrat", "file_setattr")
#: Those a libseccomp may not know by name, by number: the same on x86-64 and arm64 (the
#: common numbering since Linux 5.1).
_NEWER_CALLS = {"fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "file_setattr": 469}


def install_sandbox_filter(own_pidns: bool = False, refuse_metadata: bool = False) -> None:
    """Seccomp for one sandbox: the socket rules, plus it may signal and trace only itself.

    In a pid namespace of its own (``own_pidns``) every pid it can name is its own or one of its
    descendants', so signals are allowed except to the namespace's init (pid 1): the sandbox
    kills its leftovers with kill(-1). Otherwise signals go to itself only; libseccomp allows one
    comparison per argument and rule, so "pid != me" is written as two rules, pid < me and
    pid > me (unsigned, so kill(0) and negative process groups are refused).

    ``refuse_metadata``: ``METADATA_CALLS`` fail with EPERM, its own folder's files too (seccomp
    cannot tell paths apart): for a ``process`` sandbox under the worker's own uid, which owns
    the worker's files.
    """
    import platform

    import pyseccomp as sc

    me = os.getpid()
    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    f.add_rule(eperm, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(eperm, "io_uring_setup")
    for call in ("kill", "tgkill", "pidfd_open"):
        if own_pidns:
            f.add_rule(eperm, call, sc.Arg(0, sc.EQ, 1))
            continue
        f.add_rule(eperm, call, sc.Arg(0, sc.LT, me))
        f.add_rule(eperm, call, sc.Arg(0, sc.GT, me))
    for call in ("tkill", "ptrace", "process_vm_writev", "process_vm_readv"):
        f.add_rule(eperm, call)
    for call in METADATA_CALLS if refuse_metadata else ():
        try:
            f.add_rule(eperm, call)
        except OSError:  # a name this libseccomp does not know
            if call in _NEWER_CALLS and platform.machine() in ("x86_64", "aarch64"):
                f.add_rule(eperm, _NEWER_CALLS[call])
    f.load()


# Landlock (Linux >= 5.13): a process restricts, for itself and its descendants, which files it
# may open; capabilities do not lift it (CAP_DAC_READ_SEARCH included).
_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ABI1 = (1 << 13) - 1  # execute ... make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
#: Rights that apply to a file (the others only to folders).
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2

#: Devices every sandbox may open (reads; /dev/null for writes too).
DEVICE_PATHS = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

#: Read-only beside the interpreter and the env's packages: what libraries read of the CPUs and
#: of their own process (``/proc/self`` is the sandbox's own folder there, resolved when it is
#: confined; another process's, the worker's included, stays closed).
SYSTEM_INFO_PATHS = ("/sys/devices/system/cpu", "/proc/cpuinfo", "/proc/meminfo", "/proc/self")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is missing or disabled."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    found = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                         ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(0, int(found))


@dataclass(frozen=True)
class FileRules:
    """What a ``process`` sandbox may open: everything else is refused by Landlock.

    ``read``: folders (and files) read beneath: the system's, the interpreter's, the
    site-packages and the env's packages, the jail's list (``bwrap.jail_binds``). ``listed``:
    the ``sys.path`` folders they sit in, listed only (the import system lists a folder to find
    a module in it; no file beneath is readable through this). The sandbox's folder, read-write,
    is ``restrict_files``'s argument. ``files``: the files beside a single-file env module
    (``bwrap.module_neighbours``), read each as the regular file at its path, never through a
    symlink (``O_NOFOLLOW``): its folder is the env's, and a symlink there granted its target.
    """

    read: tuple[str, ...]
    listed: tuple[str, ...]
    files: tuple[str, ...] = ()


def restrict_files(rules: FileRules, folder: str, limits: SandboxLimits | None = None
                   ) -> str | None:
    """Confine this process's file access to ``rules`` and ``folder`` (read-write), for good.

    ``limits``: its ``readable`` and ``writable`` paths are granted too.

    None when in force; the reason when this kernel has no Landlock (nothing restricted then).
    Raises ``OSError`` when Landlock is there but the restriction fails: a sandbox that was to
    be confined never runs unconfined.
    """
    abi = landlock_abi()
    if abi < 1:
        return f"Landlock unavailable on this kernel ({os.uname().release})"
    handled = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0) \
        | (_FS_IOCTL_DEV if abi >= 5 else 0)
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(handled, 0, scoped)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                           ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: "
                                          f"{os.strerror(ctypes.get_errno())}")
    reading = _FS_READ_FILE | _FS_READ_DIR | _FS_EXECUTE
    grants = [(path, reading, 0) for path in (*rules.read, *SYSTEM_INFO_PATHS)]
    grants += [(path, reading, os.O_NOFOLLOW) for path in rules.files]
    grants += [(path, _FS_READ_DIR, 0) for path in rules.listed]
    grants += [(path, _FS_READ_FILE | _FS_WRITE_FILE, 0) for path in DEVICE_PATHS]
    extra = limits or SandboxLimits()
    grants += [(path, reading, 0) for path in extra.readable]
    grants += [(path, handled, 0) for path in (folder, *extra.writable)]
    try:
        for path, access, nofollow in grants:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC | nofollow)
            except OSError:
                continue  # not on this machine
            try:
                mode = os.fstat(fd).st_mode
                if nofollow and not stat.S_ISREG(mode):
                    continue  # a symlink (or other) put there since it was listed: nothing
                if not stat.S_ISDIR(mode):
                    access &= _FS_FILE_RIGHTS
                beneath = _PathBeneath(access & handled, fd)
                if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset),
                                ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(beneath), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}): "
                                                      f"{os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset),
                        ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: "
                                              f"{os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return None
