"""A worker's stale-code check judges the code it imported, not the files as they are now.

Planted: a module imported (as a long-lived worker imports ``envs`` for any evaluation), then
edited, then checked for the first time by an evaluation whose key names the edited files. The
worker still runs the old code; before, the check read the edited files at that first look and
passed, and the old code's episodes were stored under the new key.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

import evalfleet.worker  # noqa: F401 - workers import it first: it starts the import clock
from evalfleet.provenance import code_version, stale_code


def _module(folder: Path, text: str) -> tuple[str, Path]:
    name = f"plantedenv_{uuid.uuid4().hex[:10]}"
    path = folder / f"{name}.py"
    path.write_text(text)
    return name, path


def test_a_module_edited_after_its_import_is_stale_at_its_first_check(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name, path = _module(tmp_path, "REWARD = 1.0\n")
    try:
        assert importlib.import_module(name).REWARD == 1.0
        path.write_text("REWARD = 2.0\n")
        later = time.time() + 5  # past any file-system timestamp granularity
        os.utime(path, (later, later))
        want = code_version(name)[1]  # what the driver's key names: the edited file
        assert stale_code({name: want}) == {
            name: ("the code imported before its files were last modified", want)}
        assert sys.modules[name].REWARD == 1.0  # what this process would run under that key
    finally:
        sys.modules.pop(name, None)


def test_a_module_edited_before_its_import_is_not_stale(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name, path = _module(tmp_path, "REWARD = 1.0\n")
    earlier = time.time() - 60
    os.utime(path, (earlier, earlier))
    try:
        importlib.import_module(name)
        assert stale_code({name: code_version(name)[1]}) == {}
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("installed", ["numpy", "gymnasium"])
def test_installed_distributions_are_judged_by_their_version_only(installed):
    version = code_version(installed)[1]
    assert stale_code({installed: version}) == {}


def test_a_wheel_installed_again_after_its_import_is_stale_at_its_first_check(tmp_path, monkeypatch):
    """A wheel rebuilt under its version and installed after this process imported it: the version
    and installed-file record read at the first check are the new build's, not the code running."""
    from tests.core.test_cache_key import _wheel

    name = f"plantedwheel_{uuid.uuid4().hex[:10]}"
    _wheel(tmp_path, name, "1.0", {"__init__.py": "REWARD = 1.0\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert importlib.import_module(name).REWARD == 1.0
        _wheel(tmp_path, name, "1.0", {"__init__.py": "REWARD = 2.0\n"})
        later = time.time() + 5  # past any file-system timestamp granularity
        record = next(tmp_path.glob(f"{name}-*.dist-info")) / "RECORD"
        os.utime(record, (later, later))
        want = code_version(name)[1]  # what the driver's key names: the new build
        assert stale_code({name: want}) == {
            name: ("the code imported before its distribution was last installed", want)}
        assert sys.modules[name].REWARD == 1.0
    finally:
        sys.modules.pop(name, None)
