"""A local cluster's scratch space, first on every worker's ``sys.path``, is the driver's alone.

Dask's default is ``<tmp>/dask-scratch-space``, used by whoever made it first. A ``process``
sandbox runs under a uid of its own with the host's ``/tmp``: one that made that folder before
the cluster did (stage 1 describes an env in a sandbox before any cluster starts) owned the
folder the root workers import from first, and could swap in modules of its own.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from evalfleet.cluster import client_for, fleet_cluster

pytestmark = pytest.mark.slow


def _where(dask_worker) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {"local_directory": dask_worker.local_directory, "first_on_path": sys.path[0]}


def test_workers_do_not_use_a_scratch_folder_someone_else_made(tmp_path: Path,
                                                               monkeypatch) -> None:
    planted = tmp_path / "dask-scratch-space"
    planted.mkdir()
    planted.chmod(0o777)  # as a sandbox's uid would leave it: anyone may write
    os.chown(planted, 12345, 12345) if os.geteuid() == 0 else None
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)

    with fleet_cluster(None, 1) as address:
        seen = list(client_for(address).run(_where).values())
        assert len(seen) == 1
        where = seen[0]
        assert planted not in Path(where["local_directory"]).parents, where
        assert not where["first_on_path"].startswith(str(planted)), where
        # above Dask's own dask-scratch-space: a folder private to this uid
        root = Path(where["local_directory"]).parent.parent
        assert root.name.startswith("evalfleet-dask-"), where
        assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.geteuid()
    assert not root.exists(), f"{root} left behind after the cluster closed"
    assert list(planted.iterdir()) == []
