"""The scan of installed distributions is read from a file while ``sys.path`` is unchanged.

A policy or env module that no distribution is named like (this repo's ``envs``, a user's
``my_policies``) made stage 1 and every fresh worker's first shard scan every installed
distribution's metadata (0.5-1 s each). The answer is kept under a key of ``sys.path`` and its
folders' modification times: installing a distribution changes it.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalfleet import provenance

CODE_VERSION = """
import importlib.metadata, json, sys
calls = []
real = importlib.metadata.packages_distributions
def counted():
    calls.append(1)
    return real()
importlib.metadata.packages_distributions = counted
from evalfleet.provenance import code_version
print(json.dumps({"version": code_version(sys.argv[1])[1], "scans": len(calls)}))
"""


def _code_version(module: str, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CODE_VERSION, module], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_second_process_does_not_scan_again(tmp_path: Path) -> None:
    env = dict(os.environ, EVALFLEET_HOME=str(tmp_path / "home"))
    first = _code_version("envs", env)  # this repo's env package: no distribution is named so
    second = _code_version("envs", env)
    assert first["scans"] == 1 and second["scans"] == 0, (first, second)
    assert first["version"] == second["version"]
    assert list((tmp_path / "home" / "provenance").glob("distributions-*.json"))


def test_a_new_distribution_on_the_path_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    assert "zz_planted_mod" not in provenance._distributions()
    time.sleep(0.01)  # a distinct modification time on filesystems with coarse clocks
    info = site / "zz_planted-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: zz-planted\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("zz_planted_mod\n")
    (site / "zz_planted_mod.py").write_text("X = 1\n")
    importlib.invalidate_caches()
    assert provenance._distributions().get("zz_planted_mod") == ["zz-planted"]


def test_a_damaged_file_is_scanned_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(provenance, "_distributions_seen", {})
    want = provenance._distributions()
    [kept] = (tmp_path / "home" / "provenance").glob("distributions-*.json")
    kept.write_text("{not json")
    monkeypatch.setattr(provenance, "_distributions_seen", {})
    assert provenance._distributions() == want
