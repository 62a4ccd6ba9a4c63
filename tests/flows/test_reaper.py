"""The reaper ends Crashed the Running flow runs of killed drivers: single evaluations and suites.

Before: only ``evalfleet-eval`` runs were looked at, and a suite's flow run carried no driver tag,
so a suite whose driver was SIGKILLed stayed Running in the UI for ever. (That a suite's flow run
now carries its driver's tag, and its task runs none, is asserted by ``test_suite_flow``.)
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from prefect import flow

from flows.reaper import DRIVER_TAG, FLOW_NAMES, driver_tag, reap_dead_drivers

pytestmark = pytest.mark.slow


def dead_tag() -> str:
    """A driver tag of this host whose process has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{DRIVER_TAG}{socket.gethostname()}:{proc.pid}:{int(time.time())}"


def test_killed_suite_and_evaluation_runs_end_crashed_live_ones_stay(prefect_server: str) -> None:
    from prefect import get_client
    from prefect.states import Running

    assert "evalfleet-suite" in FLOW_NAMES
    runs = {}
    with get_client(sync_client=True) as client:
        for name in FLOW_NAMES:
            shape = flow(name=name)(lambda: None)
            for who, tag in (("dead", dead_tag()), ("live", driver_tag())):
                run = client.create_flow_run(shape, name=f"{name}-{who}", tags=[tag], state=Running())
                runs[(name, who)] = run.id
        reaped = set(reap_dead_drivers())
        states = {key: client.read_flow_run(run_id).state for key, run_id in runs.items()}
    for name in FLOW_NAMES:
        dead, live = states[(name, "dead")], states[(name, "live")]
        assert dead is not None and dead.type.value == "CRASHED", (name, dead)
        assert "died without ending this run" in (dead.message or "")
        assert live is not None and live.type.value == "RUNNING", (name, live)
        assert str(runs[(name, "dead")]) in reaped and str(runs[(name, "live")]) not in reaped

