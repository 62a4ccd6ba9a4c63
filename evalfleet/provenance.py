"""Which code a module runs: the version of the distribution that installed it, or its source.

A version identifies code only when the files were installed from a built distribution (a wheel
or sdist copied into site-packages), and then with the digest of the installed-file record that
distribution wrote (``record_digest``): a wheel rebuilt under the same version is other code. An
editable install (``pip install -e``), a path install (``pip install ./dir``, PEP 610
``direct_url.json`` with ``dir_info``), a module imported from a folder on ``sys.path`` that no
distribution installed (this repository's ``envs/``, a user's ``my_envs.py``), or a module that
shadows the installed copy all keep their version while their code changes. Those are identified
by the sha256 of every file of their top-level package instead (a single-file module: its own file
and the data files beside it), so an edit to any helper module or data file changes the answer.

Code reaches other packages through its imports (a factory's ``from netlib import Net``, a
callable's ``import helpers``): ``imported_code`` follows them through the source of every package
identified by its source, and answers the code version of each package it reaches.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import site
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

#: Prefix of a code version given by source rather than by a distribution's version.
SOURCE_PREFIX = "source-sha256:"
#: Between a built install's version and the digest of its installed-file record (``record_digest``).
RECORD_MARK = "+record-sha256:"
#: Between a single-file module's code digest and that of the data files beside it.
DATA_MARK = "+data-sha256:"
#: Most modules whose source ``imported_code`` reads: a bound on the walk (it is logged when hit).
MAX_IMPORTED_MODULES = 500


def _distributions() -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()``, read from a file while no install changed.

    The scan reads every installed distribution's metadata: 0.5-1 s, paid by stage 1 and by
    each fresh worker's first shard whenever a policy's or env's module is no distribution.
    Its answer is kept in ``evalfleet_home()`` under a key of the distributions found and the
    modification times of their metadata folders (``_installed_state``).
    """
    global _distributions_seen
    key = _installed_state()
    with _distributions_lock:
        if _distributions_seen is not None and _distributions_seen[0] == key:
            return _distributions_seen[1]
        value = _stored_distributions(key)
        if value is None:
            value = dict(importlib.metadata.packages_distributions())
            _store_distributions(key, value)
        _distributions_seen = (key, value)
        return value


_distributions_lock = threading.Lock()
_distributions_seen: tuple[str, dict[str, list[str]]] | None = None  # this process's last answer


def _installed_state() -> str:
    """sha256 of the metadata folders of every distribution on ``sys.path``, with their mtimes.

    Finding them lists folders only (~3 ms); installing, removing or upgrading a distribution
    adds, removes or rewrites one. Not ``sys.path`` itself: a Dask worker puts its own scratch
    folder, new at every start, on it.
    """
    state: list[tuple[str, int | None]] = []
    for dist in importlib.metadata.distributions():
        where = os.path.abspath(str(getattr(dist, "_path", "") or dist))
        try:
            state.append((where, os.stat(where).st_mtime_ns))
        except OSError:
            state.append((where, None))
    return hashlib.sha256(json.dumps([sys.version, sorted(state)]).encode()).hexdigest()


def _distributions_file(key: str) -> Path:
    from evalfleet.server import evalfleet_home

    return evalfleet_home() / "provenance" / f"distributions-{key[:32]}.json"


def _stored_distributions(key: str) -> dict[str, list[str]] | None:
    try:
        stored = json.loads(_distributions_file(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    value = stored.get("distributions")
    return value if isinstance(value, dict) else None


def _store_distributions(key: str, value: dict[str, list[str]]) -> None:
    from evalfleet.storage import atomic_write

    path = _distributions_file(key)
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(
            json.dumps({"key": key, "distributions": value})))
    except OSError as err:  # an unwritable home: scanned again by the next process
        logger.debug("could not keep the distributions scan in %s: %s", path, err)


def distribution_named_like(top: str) -> list[str]:
    """The distribution named like top-level module ``top``, when it ships that module.

    The common case (``gymnasium``, ``ale_py``...) answered without scanning every installed
    distribution; the same name the scan would give.
    """
    try:
        dist = importlib.metadata.distribution(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    tops = set((dist.read_text("top_level.txt") or "").split()) or _recorded_tops(dist)
    return [dist.metadata["Name"]] if top in tops else []


def _recorded_tops(dist: importlib.metadata.Distribution) -> set[str]:
    """The first path component (``.py`` stripped) of every file ``dist`` installed.

    Its ``RECORD`` read as CSV text: ``dist.files`` builds a path object per file, 40-60 ms for
    numpy's or prefect's, paid again for every package a policy imports.
    """
    record = dist.read_text("RECORD")
    if record is None:
        return {str(f).split("/", 1)[0].removesuffix(".py") for f in dist.files or []}
    return {row[0].split("/", 1)[0].removesuffix(".py")
            for row in csv.reader(record.splitlines()) if row}


#: A package's data files (anything but ``.py``) are keyed by their bytes up to these bounds;
#: past them by each one's relative name, size and modification time (reading gigabytes of
#: assets at every request would cost more than the evaluation).
DATA_FILES_LIMIT, DATA_BYTES_LIMIT = 2_000, 64 << 20


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: Suffixes of compiled caches, never keyed (``__pycache__`` folders neither): written by imports.
COMPILED_SUFFIXES = (".pyc", ".pyo")


def tree_files(root: Path) -> list[tuple[str, Path]]:
    """Every regular file under ``root`` by relative name, sorted; compiled caches left out.

    Symlinked folders are followed, each real folder once (a link loop ends there): the code
    reads its data through them as through any folder. ``Path.rglob`` did not enter them, and an
    edit to a package's ``levels -> /data/levels`` was a full cache hit on the old episodes.
    """
    out: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for folder, dirs, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            path = Path(folder, name)
            if path.suffix not in COMPILED_SUFFIXES and path.is_file():
                out.append((str(path.relative_to(root)), path))
    return sorted(out)


def beside_data(module: Path) -> list[tuple[str, Path]]:
    """The data files beside single-file module ``module``, by name, sorted.

    The regular files directly in its folder (no subfolder), less ``.py`` files (modules of their
    own, keyed when imported), compiled caches, dotfiles and symlinks (sandboxes are granted these
    files: a symlink's target may be any file of the machine, ``/etc/shadow`` say). A module in the
    standard library's or an install folder (``_install_folder``) has none: those folders are code
    that distributions and the interpreter's version identify, not one module's data. Listing the
    folder is one ``scandir``; past ``DATA_FILES_LIMIT`` files or ``DATA_BYTES_LIMIT`` bytes
    ``tree_digest`` keys them by size and modification time.
    """
    if _install_folder(module.parent):
        return []
    try:
        with os.scandir(module.parent) as entries:
            return sorted((e.name, Path(e.path)) for e in entries
                          if not e.name.startswith(".") and not e.name.endswith(".py")
                          and not e.name.endswith(COMPILED_SUFFIXES)
                          and e.is_file(follow_symlinks=False))
    except OSError:  # not a folder this process can list (a zip archive's member, a removed one)
        return []


@cache
def _install_folders() -> frozenset[str]:
    """The standard library's and site-packages folders of this interpreter, resolved."""
    paths = sysconfig.get_paths()
    found = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    found.update(getattr(site, "getsitepackages", list)())
    found.add(getattr(site, "getusersitepackages", str)())
    return frozenset(os.path.realpath(p) for p in found if p)


@cache
def _stdlib_folders() -> tuple[str, ...]:
    """The standard library's folders of this interpreter, resolved (its zip archive included)."""
    paths = sysconfig.get_paths()
    found = {paths.get("stdlib"), paths.get("platstdlib"),
             os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}{sys.version_info[1]}.zip")}
    return tuple(sorted(os.path.realpath(p) for p in found if p))


def in_stdlib(top: str) -> bool:
    """True when top-level module ``top`` is the standard library's, as it is found here.

    A stdlib name is not enough: a user's ``wave.py`` or ``calendar.py`` on ``sys.path`` ahead of
    the standard library runs in its place, and, left out by its name, it was never keyed (an edit
    of it was a full cache hit on the old episodes). So a stdlib name counts only when it is found
    built in, frozen, or in the standard library's folders (not a site-packages within them); one
    found nowhere (``winreg`` on Linux, imported under a ``try``) has nothing to key either.
    """
    if top not in sys.stdlib_module_names:
        return False
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: imports nothing
    except (ImportError, ValueError):
        return True
    if spec is None or spec.origin in ("built-in", "frozen"):
        return True
    where = [w for w in [*(spec.submodule_search_locations or []), spec.origin] if w]
    if not where:
        return True
    for location in where:
        real = os.path.realpath(location)
        parts = set(Path(real).parts)
        if "site-packages" in parts or "dist-packages" in parts or not any(
                real.startswith(folder + os.sep) for folder in _stdlib_folders()):
            return False
    return True


def _install_folder(folder: Path) -> bool:
    """True for the standard library's folder and a site-packages (or Debian dist-packages) one."""
    real = os.path.realpath(folder)
    return real in _install_folders() or os.path.basename(real) in ("site-packages", "dist-packages")


def _file_key(path: Path, by_content: bool) -> str:
    """A file's part of ``tree_digest``: its sha256, or ``stat:size:mtime``, or ``missing``.

    A file that cannot be read (another user's, beside a module in a shared folder) is keyed by
    its stat; one that vanished since it was listed, as missing.
    """
    if by_content or path.suffix == ".py":
        try:
            return file_sha256(path)
        except OSError:
            pass
    try:
        st = path.stat()
    except OSError:
        return "missing"
    return f"stat:{st.st_size}:{st.st_mtime_ns}"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tree_digest(files: list[tuple[str, Path]]) -> str:
    """sha256 (hex) over named files, each by its name and bytes.

    ``.py`` files always by their bytes; the others by theirs within ``DATA_FILES_LIMIT`` and
    ``DATA_BYTES_LIMIT``, else by size and modification time (so is a file that cannot be read).
    """
    data = [path for _, path in files if path.suffix != ".py"]
    by_content = (len(data) <= DATA_FILES_LIMIT
                  and sum(_size(p) for p in data) <= DATA_BYTES_LIMIT)
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode() + b"\0")
        h.update(_file_key(path, by_content).encode())
        h.update(b"\0")
    return h.hexdigest()


def _source_files(top: str) -> list[tuple[str, Path]]:
    """Every file of top-level module or package ``top`` as imported here, by relative name.

    A package's whole tree, data files included (a level map or a table beside the code shapes
    returns as the code does); a single module's own ``.py`` file (the data files beside it are
    keyed apart: ``source_digest``).
    """
    spec = importlib.util.find_spec(top)
    if spec is None:
        return []
    if spec.submodule_search_locations:  # a package (regular or namespace): all of its tree
        files: list[tuple[str, Path]] = []
        for location in spec.submodule_search_locations:
            files += tree_files(Path(location))
        return sorted(files)
    if spec.origin and spec.origin.endswith(".py"):
        return [(Path(spec.origin).name, Path(spec.origin))]
    return []


def source_trees(tops: Iterable[str]) -> list[Path]:
    """Every file of those of ``tops`` (top-level modules) not installed in this interpreter.

    What ``stale_code`` judges a source-identified package by: its whole tree, data included
    (``_source_files``). Modules in the standard library or a site-packages are left out: their
    installed version identifies them.
    """
    out: list[Path] = []
    for top in sorted(set(tops)):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue
        where = [*(spec.submodule_search_locations or [])] if spec else []
        if spec and spec.origin and not where:
            where = [spec.origin]
        if where and not any(_install_folder(Path(w).parent) for w in where):
            out += [path for _, path in _source_files(top)]
    return out


def _single_file(top: str) -> Path | None:
    """The source file of ``top`` when it is a module of one ``.py`` file, else None."""
    spec = importlib.util.find_spec(top)
    if spec is None or spec.submodule_search_locations or not (spec.origin or "").endswith(".py"):
        return None
    return Path(str(spec.origin))


def source_digest(top: str) -> str | None:
    """sha256 (hex, first 16) over the relative names and bytes of ``top``'s files (``tree_digest``).

    None when ``top`` has no Python source here (a compiled extension, a frozen module). A
    single-file module with data files beside it (``beside_data``) gets their digest after
    ``DATA_MARK``: they shape returns, so they are in every key its code version is in.
    """
    files = _source_files(top)
    if not any(path.suffix == ".py" for _, path in files):
        return None
    module = _single_file(top)
    data = beside_data(module) if module is not None else []
    code = tree_digest(files)[:16]
    return f"{code}{DATA_MARK}{tree_digest(data)[:16]}" if data else code


def _installed_from_directory(dist: importlib.metadata.Distribution) -> bool:
    """True for an editable or path install (PEP 610 ``dir_info``): its version names no code.

    Every distribution of that name on the path is asked: a source checkout's ``*.egg-info``
    (found first when the checkout is the working directory) carries no ``direct_url.json``, and
    is itself a sign of code that changes under a fixed version.
    """
    name = dist.metadata["Name"]
    for candidate in importlib.metadata.distributions(name=name) if name else [dist]:
        if str(getattr(candidate, "_path", "")).endswith(".egg-info"):
            return True
        try:
            text = candidate.read_text("direct_url.json")
            if text and "dir_info" in json.loads(text):
                return True
        except (OSError, ValueError):
            continue
    return False


def _imported_from(dist: importlib.metadata.Distribution, top: str) -> bool:
    """True when ``top`` is imported from the files ``dist`` installed (not a shadowing copy)."""
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    where: list[str | None] = list(spec.submodule_search_locations or []) or [spec.origin]
    origins = [o for o in where if o]
    base = Path(str(dist.locate_file(""))).resolve()
    return any(Path(o).resolve().is_relative_to(base) for o in origins)


#: Dist-info files that a reinstall of the same build rewrites: who installed it, whether it was
#: asked for, where from (a wheel's path or URL), and the record itself.
_RECORD_IGNORED = frozenset({"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"})
#: ``{RECORD path: ((mtime_ns, size, inode), digest)}``: each record is read once per version of it.
_records: dict[str, tuple[tuple[int, int, int], str | None]] = {}
#: ``{top-level module: RECORD path}`` of the built installs ``code_version`` identified by it.
_record_files: dict[str, Path] = {}


def _record_path(dist: importlib.metadata.Distribution) -> Path | None:
    """The ``RECORD`` file of ``dist``'s metadata folder; None for a distribution without one."""
    folder = getattr(dist, "_path", None)
    return Path(str(folder)) / "RECORD" if folder is not None else None


def record_digest(path: Path) -> str | None:
    """sha256 (hex, first 16) of an installed-file record, less what a reinstall changes alone.

    ``RECORD`` lists the sha256 of every file the distribution installed: a wheel rebuilt or
    re-fetched under the same version (a local build, ``git+...@<new commit>``, an index
    overwritten) installs other files and so another record. Left out: compiled caches (written
    at install, they carry times), files installed outside the install folder (``../../../bin``
    scripts: their first line names this interpreter) and the dist-info files in
    ``_RECORD_IGNORED``. Read once per process and version of the file (its stat); None when
    there is none.
    """
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    seen = _records.get(str(path))
    if seen is not None and seen[0] == stamp:
        return seen[1]
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    kept = []
    for line in text.splitlines():
        # A path holding a comma is quoted (CSV); the others are the text before the first comma.
        name = next(csv.reader([line]), [""])[0] if line.startswith('"') else line.split(",", 1)[0]
        parts = name.replace("\\", "/").split("/")
        if (not name or parts[0] == ".." or "__pycache__" in parts or name.endswith(COMPILED_SUFFIXES)
                or (len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] in _RECORD_IGNORED)):
            continue
        kept.append(line)
    digest = hashlib.sha256("\n".join(sorted(kept)).encode()).hexdigest()[:16]
    _records[str(path)] = (stamp, digest)
    return digest


def code_version(module: str) -> tuple[str, str]:
    """``(package, version)`` identifying the code of ``module``'s top-level package.

    A distribution installed from a built archive and actually imported from its files: its name
    and version, with the digest of its installed-file record (``"1.4.0+record-sha256:…"``,
    ``record_digest``: one small file read per process and install). Otherwise the version is
    the source digest: ``"1.2.0+source-sha256:…"`` for an editable/path install,
    ``"source-sha256:…"`` for code no distribution installed.
    """
    top = module.split(".", 1)[0]
    dists = distribution_named_like(top) or _distributions().get(top, [])
    for name in dists:
        try:
            dist = importlib.metadata.distribution(name)
            version = dist.version
        except importlib.metadata.PackageNotFoundError:
            continue
        if not _installed_from_directory(dist) and _imported_from(dist, top):
            record = _record_path(dist)
            digest = record_digest(record) if record is not None else None
            if record is None or digest is None:
                return name, version
            _record_files[top] = record
            return name, f"{version}{RECORD_MARK}{digest}"
        digest = source_digest(top)
        return name, f"{version}+{SOURCE_PREFIX}{digest}" if digest else version
    digest = source_digest(top)
    return top, f"{SOURCE_PREFIX}{digest}" if digest else "unknown"


def _module_file(name: str) -> tuple[Path, bool] | None:
    """The ``.py`` file module ``name`` runs from, and whether it is a package.

    Found without importing anything (``find_spec`` of a submodule would import its parents).
    None for a namespace package, a compiled or frozen module, and a name that is no module.
    """
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # ``__main__`` run as a script has no spec
        return None
    if spec is None:
        return None
    if not rest:
        origin = spec.origin
        if origin and origin.endswith(".py"):
            return Path(origin), bool(spec.submodule_search_locations)
        return None
    locations = [Path(p) for p in spec.submodule_search_locations or []]
    for depth, part in enumerate(rest, 1):
        portions: list[Path] = []
        for location in locations:  # the order the import system searches them in
            folder = location / part
            if (folder / "__init__.py").is_file():
                if depth == len(rest):
                    return folder / "__init__.py", True
                portions = [folder]
                break
            if (location / f"{part}.py").is_file():
                return (location / f"{part}.py", False) if depth == len(rest) else None
            if folder.is_dir():
                portions.append(folder)
        locations = portions
    return None


#: Imported module names by (module, is a package, sha256 of its source): a file's imports are
#: parsed once per process and version of the file, and kept in ``evalfleet_home()``
#: (``_stored_imports``): parsing the ~100 modules a policy's or an env's code reaches took
#: ~0.7 s of every cold stage 1, before the workers' fork server could start.
_IMPORTS: dict[tuple[str, bool, str], tuple[str, ...]] = {}
_imports_lock = threading.Lock()
_imports_loaded = False  # this process has read the stored imports into ``_IMPORTS``
_imports_new: dict[tuple[str, bool, str], tuple[str, ...]] = {}  # parsed here, not stored yet
#: Most entries the stored imports keep (a file's every version is an entry of its own).
MAX_STORED_IMPORTS = 20_000


def _imports(name: str, path: Path, is_package: bool) -> tuple[str, ...]:
    """Absolute names of the modules ``name``'s source imports.

    Wherever the import statement is (module level, inside a function, under ``if TYPE_CHECKING``);
    ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule).
    """
    try:
        source = path.read_bytes()
    except OSError:
        return ()
    key = (name, is_package, hashlib.sha256(source).hexdigest())
    with _imports_lock:
        if not _imports_loaded:
            _load_stored_imports()
        if key in _IMPORTS:
            return _IMPORTS[key]
    found = _parse_imports(source, name if is_package else name.rpartition(".")[0])
    with _imports_lock:
        if len(_IMPORTS) > MAX_STORED_IMPORTS:
            _IMPORTS.clear()
        _IMPORTS[key] = _imports_new[key] = found
    return found


def _parse_imports(source: bytes, package: str) -> tuple[str, ...]:
    """The absolute module names the import statements of ``source`` name, in ``package``."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # not Python this interpreter runs: nothing to follow
        tree = ast.Module(body=[], type_ignores=[])
    found: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(dict.fromkeys(alias.name for alias in node.names))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue  # beyond the top-level package: fails at import
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = ".".join(p for p in (anchor, base) if p)
            if base:
                found[base] = None
                found.update(dict.fromkeys(f"{base}.{alias.name}" for alias in node.names
                                           if alias.name != "*"))
    return tuple(found)


def _stored_imports_file() -> Path:
    """Where the parsed imports are kept: per interpreter (its parser decides what parses)."""
    from evalfleet.server import evalfleet_home

    tag = hashlib.sha256(sys.version.encode()).hexdigest()[:16]
    return evalfleet_home() / "provenance" / f"source-imports-{tag}.json"


def _read_stored_imports() -> dict[tuple[str, bool, str], tuple[str, ...]]:
    """The stored imports, by key; empty when there are none or they do not read."""
    try:
        rows = json.loads(_stored_imports_file().read_text())["imports"]
        return {(str(n), bool(p), str(h)): tuple(str(m) for m in found)
                for n, p, h, found in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _load_stored_imports() -> None:
    """Read the stored imports into ``_IMPORTS`` (once per process; ``_imports_lock`` held)."""
    global _imports_loaded
    _imports_loaded = True
    _IMPORTS.update(_read_stored_imports())


def _keep_imports() -> None:
    """Add the imports parsed since the last call to the stored ones (merged with the file's).

    Two processes storing at once may lose one's entries: they are parsed again next time.
    """
    from evalfleet.storage import atomic_write

    with _imports_lock:
        if not _imports_new:
            return
        new = dict(_imports_new)
        _imports_new.clear()
    stored = _read_stored_imports()
    if len(stored) + len(new) > MAX_STORED_IMPORTS:
        stored = {}
    stored.update(new)
    rows = [[n, p, h, list(found)] for (n, p, h), found in stored.items()]
    path = _stored_imports_file()
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({"imports": rows})))
    except OSError as err:  # an unwritable home: parsed again by the next process
        logger.debug("could not keep the parsed imports in %s: %s", path, err)


def _enqueue(name: str, queued: set[str], queue: deque[str]) -> None:
    """Queue module ``name`` and its parent packages (importing a.b.c runs a and a.b first)."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        module = ".".join(parts[:depth])
        if module not in queued:
            queued.add(module)
            queue.append(module)


def _walk_imports(start: str, within: str | None, limit: int) -> tuple[int, list[str]]:
    """Modules ``start``'s code reaches: (modules read, other top-level modules reached).

    Follows the imports read from the source of ``start``, its parent packages and every module
    they reach inside top-level package ``within`` (None: ``start``'s own); reads at most
    ``limit`` modules. Standard-library names are among the modules reached.
    """
    within = within or start.split(".", 1)[0]
    queued: set[str] = set()
    queue: deque[str] = deque()
    outside: dict[str, None] = {}

    def reach(name: str) -> None:
        top = name.split(".", 1)[0]
        # Standard-library names stay in the answer: whether one is the standard library's or a
        # user's module of that name depends on ``sys.path``, not on the code walked, and the
        # answer is stored (``foreign_imports``); ``imported_code`` decides with ``in_stdlib``.
        if not top or top == "__main__":
            return
        if top != within:
            outside[top] = None
            return
        _enqueue(name, queued, queue)

    reach(start)
    read = 0
    while queue and read < limit:
        name = queue.popleft()
        found = _module_file(name)
        if found is None:
            continue
        read += 1
        for imported in _imports(name, *found):
            reach(imported)
    _keep_imports()
    return read, list(outside)


def _imports_file(key: str) -> Path:
    from evalfleet.server import evalfleet_home

    return evalfleet_home() / "provenance" / f"imports-{key[:32]}.json"


def foreign_imports(module: str, version: str) -> list[str]:
    """Top-level modules outside ``module``'s package that its code reaches inside the package.

    For a package identified by its ``version`` (an installed wheel): what it imports from
    other distributions, a simulator's bindings (``mujoco``, ``Box2D``) above all, shapes its
    returns as its own code does, and a new version of one changes them under the same package
    version. Its source is fixed by its version, so the answer (tens of files parsed, ~0.05-0.2
    s) is kept in ``evalfleet_home()`` under the module, the version and the interpreter.
    """
    top = module.split(".", 1)[0]
    # "stdlib-kept": answers stored before they kept standard-library names are not read.
    key = hashlib.sha256(json.dumps([module, version, sys.version, "stdlib-kept"]).encode()).hexdigest()
    path = _imports_file(key)
    try:
        stored = json.loads(path.read_text())
        if isinstance(stored, dict) and stored.get("key") == key:
            return [str(m) for m in stored["imports"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    read, outside = _walk_imports(module, top, MAX_IMPORTED_MODULES)
    if read >= MAX_IMPORTED_MODULES:
        logger.warning("Read the imports of %d modules of %s from %s and stopped: the packages "
                       "the rest imports are not in the code versions", read, top, module)
    from evalfleet.storage import atomic_write

    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(
            json.dumps({"key": key, "module": module, "version": version, "imports": outside})))
    except OSError as err:  # an unwritable home: walked again by the next process
        logger.debug("could not keep the imports of %s in %s: %s", module, path, err)
    return outside


#: Frameworks whose own imports are not walked (their versions are keyed; an env or a policy
#: reaching torch would otherwise parse hundreds of torch's modules for nothing that shapes returns).
NOT_WALKED = frozenset({"torch", "jax", "jaxlib", "tensorflow", "numpy", "scipy", "pandas"})


def imported_code(modules: Iterable[str], limit: int = MAX_IMPORTED_MODULES, *,
                  versioned_imports: bool = False) -> dict[str, str]:
    """``{top-level module: code version}`` of ``modules`` and of every package their code imports.

    Imports are read from the source (no module is imported, nor asked what it imported: the
    answer is the same whatever this process imported before) and followed through every package
    identified by its source; a package identified by its version is not read further, except
    with ``versioned_imports`` (an env's code): then it adds the versions of the other packages
    its code reaches from the module reached in it (``foreign_imports``: a MuJoCo env of
    gymnasium reaches ``mujoco``), not further, and not for ``NOT_WALKED`` frameworks. The
    standard library is left out (``in_stdlib``: found there, not only named like it). Imports the
    source does not spell (``importlib.import_module`` of a computed name) are not seen. Sorted
    by module name.
    """
    versions: dict[str, str] = {}
    queued: set[str] = set()
    queue: deque[str] = deque()
    walked: set[str] = set()  # modules of version-identified packages whose imports were added
    stdlib: dict[str, bool] = {}  # top-level names met: whether they are left out (``in_stdlib``)

    def reach(name: str, follow_versioned: bool = True) -> None:
        top = name.split(".", 1)[0]
        if top not in stdlib:
            stdlib[top] = not top or top == "__main__" or in_stdlib(top)
        if stdlib[top]:
            return
        if top not in versions:
            try:
                versions[top] = code_version(top)[1]
            except ValueError:  # a spec-less module (``__main__``-like): nothing identifies it
                versions[top] = "unknown"
        if SOURCE_PREFIX not in versions[top]:
            if (versioned_imports and follow_versioned and versions[top] != "unknown"
                    and top not in NOT_WALKED and name not in walked):
                walked.add(name)
                for other in foreign_imports(name, f"{top}=={versions[top]}"):
                    reach(other, follow_versioned=False)
            return
        _enqueue(name, queued, queue)

    starts = list(modules)
    for name in starts:
        reach(name)
    read = 0
    while queue:
        name = queue.popleft()
        found = _module_file(name)
        if found is None:
            continue
        if read == limit:
            logger.warning("Read the imports of %d modules from %s and stopped: those of %r and "
                           "of the modules after it are not in the code versions", limit,
                           ", ".join(starts), name)
            break
        read += 1
        for imported in _imports(name, *found):
            reach(imported)
    _keep_imports()
    return dict(sorted(versions.items()))


#: ``{top-level module: code version}`` as this process first checked it (``stale_code``): in a
#: long-lived worker, the code it imported then, whatever its files hold now.
_seen: dict[str, str] = {}
_seen_lock = threading.Lock()
#: ``{top-level module: wall-clock time}`` no earlier than this process's first import of it
#: (``watch_imports``): a file of it modified later is code this process does not run.
_imported_at: dict[str, float] = {}
_watching_since: float | None = None


class _ImportClock:
    """A ``sys.meta_path`` finder that finds nothing: it notes when a top-level name is first sought."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        top = name.partition(".")[0]
        if top not in _imported_at:
            _imported_at[top] = time.time()


def watch_imports() -> None:
    """From now on, note when this process first imports each top-level module (``stale_code``).

    Modules imported already get the time of this call, the latest their import can have been.
    Idempotent; a dictionary look-up per import, nothing more.
    """
    global _watching_since
    with _seen_lock:
        if _watching_since is not None:
            return
        _watching_since = time.time()
        for name in list(sys.modules):
            _imported_at.setdefault(name.partition(".")[0], _watching_since)
        sys.meta_path.insert(0, _ImportClock())


def _edited_since_import(top: str) -> bool:
    """True when a file of ``top`` was modified after this process imported it (if it knows when)."""
    at = _imported_at.get(top)
    if at is None:
        return False
    for _, path in _source_files(top):
        try:
            if path.stat().st_mtime > at:
                return True
        except OSError:  # removed since: the code imported is not what the files say either
            return True
    return False


def _installed_since_import(top: str) -> bool:
    """True when the built install ``top`` came from was written after this process imported it.

    A reinstall rewrites the distribution's ``RECORD`` (``_record_files``): one ``stat``.
    """
    at, record = _imported_at.get(top), _record_files.get(top)
    if at is None or record is None:
        return False
    try:
        return record.stat().st_mtime > at
    except OSError:  # uninstalled since: the code imported is not what is installed either
        return True


def stale_code(expected: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``{module: (version this process runs, version expected)}`` where they differ.

    ``expected`` is what a cache key names (the driver's reading of the files). A module this
    process has imported is judged by its code version at the first check after its import; a
    long-lived Dask worker keeps running the code it imported even when its files are edited
    since, or it may have another install than the driver's. A module identified by its source
    is stale too when one of its files was modified after this process imported it
    (``watch_imports``, started by ``evalfleet.worker``): a worker that imported it for an earlier
    evaluation and is first asked about it after an edit; a built install, when it was installed
    again after that import. Modules not imported here yet (they
    will be imported from the files as they are now) and ``"unknown"`` versions are not judged.
    """
    out: dict[str, tuple[str, str]] = {}
    for top, want in expected.items():
        if want == "unknown" or top not in sys.modules:
            continue
        with _seen_lock:
            have = _seen.get(top)
        if have is None:
            try:
                have = code_version(top)[1]
            except ValueError:  # a spec-less module: nothing identifies it
                continue
            with _seen_lock:
                have = _seen.setdefault(top, have)
        # The data beside a single-file module is in the key, not in what a worker runs: a log
        # a training script writes beside itself must not restart the workers at every step.
        if have.split(DATA_MARK)[0] != want.split(DATA_MARK)[0]:
            out[top] = (have, want)
        elif SOURCE_PREFIX in want and _edited_since_import(top):
            # Imported before its files changed, first checked after: the version read then is
            # the edited files', not the code running here.
            out[top] = ("the code imported before its files were last modified", want)
        elif RECORD_MARK in want and _installed_since_import(top):
            # The same for a wheel reinstalled (rebuilt under its version) after the import.
            out[top] = ("the code imported before its distribution was last installed", want)
    return out
