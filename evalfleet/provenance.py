"""Which code a module runs: the version of the distribution that installed it, or its source.

A version identifies code only when the files were installed from a built distribution (a wheel
or sdist copied into site-packages). An editable install (``pip install -e``), a path install
(``pip install ./dir``, PEP 610 ``direct_url.json`` with ``dir_info``), a module imported from a
folder on ``sys.path`` that no distribution installed (this repository's ``envs/``, a user's
``my_envs.py``), or a module that shadows the installed copy all keep their version while their
code changes. Those are identified by the sha256 of the source of every ``.py`` file of their
top-level package instead, so an edit to any helper module changes the answer.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

#: Prefix of a code version given by source rather than by a distribution's version.
SOURCE_PREFIX = "source-sha256:"


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    # Scanning every installed distribution takes ~1 s; once per process is enough.
    return dict(importlib.metadata.packages_distributions())


def distribution_named_like(top: str) -> list[str]:
    """The distribution named like top-level module ``top``, when it ships that module.

    The common case (``gymnasium``, ``ale_py``...) answered without scanning every installed
    distribution; the same name the scan would give.
    """
    try:
        dist = importlib.metadata.distribution(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    tops = set((dist.read_text("top_level.txt") or "").split())
    if not tops:
        tops = {str(f).split("/", 1)[0].removesuffix(".py") for f in dist.files or []}
    return [dist.metadata["Name"]] if top in tops else []


def _source_files(top: str) -> list[tuple[str, Path]]:
    """Every ``.py`` file of top-level module or package ``top`` as imported here, by relative name."""
    spec = importlib.util.find_spec(top)
    if spec is None:
        return []
    if spec.submodule_search_locations:  # a package (regular or namespace): all of its tree
        files: list[tuple[str, Path]] = []
        for location in spec.submodule_search_locations:
            root = Path(location)
            files += [(str(p.relative_to(root)), p) for p in root.rglob("*.py")
                      if "__pycache__" not in p.parts]
        return sorted(files)
    if spec.origin and spec.origin.endswith(".py"):
        return [(Path(spec.origin).name, Path(spec.origin))]
    return []


def source_digest(top: str) -> str | None:
    """sha256 (hex, first 16) over the relative names and bytes of ``top``'s ``.py`` files.

    None when ``top`` has no Python source here (a compiled extension, a frozen module).
    """
    files = _source_files(top)
    if not files:
        return None
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


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


def code_version(module: str) -> tuple[str, str]:
    """``(package, version)`` identifying the code of ``module``'s top-level package.

    A distribution installed from a built archive and actually imported from its files: its name
    and version (the fast path: no file is read). Otherwise the version is the source digest:
    ``"1.2.0+source-sha256:…"`` for an editable/path install, ``"source-sha256:…"`` for code no
    distribution installed.
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
            return name, version
        digest = source_digest(top)
        return name, f"{version}+{SOURCE_PREFIX}{digest}" if digest else version
    digest = source_digest(top)
    return top, f"{SOURCE_PREFIX}{digest}" if digest else "unknown"
