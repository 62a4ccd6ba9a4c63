"""Stage 2 spawns: each worker's fork server is up before stage 4 runs.

The env's own module is imported where its code may run: in the worker at ``inprocess``; at
``process``, only in the sandboxes (never in the worker, nor in its fork server).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from evalfleet.cluster import client_for, fleet_cluster
from evalfleet.models import EvalRequest
from evalfleet.pipeline import plan, receive, spawn

pytestmark = pytest.mark.slow

ENV_MODULE = "tests.flows.user_envs"


def _sandbox_origin() -> tuple[int, bool]:
    """(fork server processes of this worker, whether the env's module is imported here)."""
    import psutil

    servers = [p for p in psutil.Process().children()
               if "evalfleet.sandbox.forkserver" in " ".join(p.cmdline())]
    return len(servers), ENV_MODULE in sys.modules


@pytest.mark.parametrize(("isolation", "servers"), [("process", 1), ("inprocess", 0)])
def test_stage_two_starts_what_sandboxes_come_from_on_every_worker(
        tmp_path: Path, isolation: str, servers: int) -> None:
    request = EvalRequest.build(env=f"{ENV_MODULE}:Warehouse-v0", policy=f"{ENV_MODULE}:toward_goal",
                                episodes=6, concurrency=3, isolation=isolation, cache="off",
                                output=tmp_path / "out")
    received = receive(request)
    with fleet_cluster(None, 2) as address:
        client = client_for(address)
        before = client.run(_sandbox_origin)
        planned = plan(request, received, address, request.episodes)
        assert list(client.run(_sandbox_origin).values()) == [(0, False)] * 2  # planning spawns none
        planned = spawn(request, received, address, planned)
        after = client.run(_sandbox_origin)
    assert list(before.values()) == [(0, False)] * 2
    assert list(after.values()) == [(servers, isolation == "inprocess")] * 2
    assert sorted(w["worker"] for w in planned.warmed) == ["0", "1"]
    assert {w["isolation"] for w in planned.warmed} == {isolation}
    assert planned.plan.seconds >= max(w["seconds"] for w in planned.warmed)


def test_nothing_to_run_starts_nothing(tmp_path: Path) -> None:
    request = EvalRequest.build(env=f"{ENV_MODULE}:Warehouse-v0", policy=f"{ENV_MODULE}:toward_goal",
                                episodes=4, output=tmp_path / "out")
    received = receive(request)
    planned = plan(request, received, None, 0)
    assert spawn(request, received, None, planned) is planned and planned.warmed == ()
