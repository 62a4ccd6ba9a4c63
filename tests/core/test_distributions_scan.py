"""The scan of installed distributions is read from a file while ``sys.path`` is unchanged.

A policy or env module that no distribution is named like (this repo's ``envs``, a user's
``my_policies``) made stage 1 and every fresh worker's first shard scan every installed
distribution's metadata (0.5-1 s each). The answer is kept under a key of the distributions
found and their metadata folders' modification times: installing one changes it, a Dask worker's
new scratch folder on ``sys.path`` does not.
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
    monkeypatch.setattr(provenance, "_distributions_seen", None)
    want = provenance._distributions()
    [kept] = (tmp_path / "home" / "provenance").glob("distributions-*.json")
    kept.write_text("{not json")
    monkeypatch.setattr(provenance, "_distributions_seen", None)
    assert provenance._distributions() == want


def test_a_new_empty_folder_on_the_path_keeps_the_key(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    before = provenance._installed_state()
    scratch = tmp_path / "dask-scratch-space" / "worker-abc123"  # what each Dask worker adds
    scratch.mkdir(parents=True)
    monkeypatch.syspath_prepend(str(scratch))
    importlib.invalidate_caches()
    assert provenance._installed_state() == before


def _scans_on_a_worker() -> int:
    calls = []
    real = importlib.metadata.packages_distributions

    def counted():  # type: ignore[no-untyped-def]
        calls.append(1)
        return real()

    importlib.metadata.packages_distributions = counted  # type: ignore[assignment]
    try:
        provenance.code_version("envs")
    finally:
        importlib.metadata.packages_distributions = real
    return len(calls)


def test_fresh_workers_read_the_scan_a_driver_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evalfleet.cluster import client_for, fleet_cluster

    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(provenance, "_distributions_seen", None)
    provenance.code_version("envs")  # the driver's stage 1
    with fleet_cluster(None, 2, (), single_use=True) as address:  # workers exported the home
        scans = client_for(address).run(_scans_on_a_worker)
    assert sorted(scans.values()) == [0, 0], scans
