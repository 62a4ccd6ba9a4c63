"""Flow runs of killed drivers end Crashed, not Running for ever.

A driver killed with SIGKILL (an OOM kill, a node drain, ``kill -9``) cannot tell Prefect that its
flow run ended: the run stays Running in the UI. Each evaluation's flow run is tagged with its
driver (``evalfleet-driver:HOST:PID:START``, the process start time guarding against pid reuse);
the next evaluation started on that host (``reap_dead_drivers`` in ``flows.eval.evaluate``)
marks every Running or Pending evaluation flow run whose driver process is gone as Crashed, and
their task runs that were still Running too. Runs of drivers on other hosts are left alone.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil

logger = logging.getLogger(__name__)

#: Prefix of the tag naming an evaluation flow run's driver process.
DRIVER_TAG = "evalfleet-driver:"
#: The flows whose runs are reaped: single evaluations and suites.
FLOW_NAMES = ("evalfleet-eval", "evalfleet-suite")


def driver_tag(pid: int | None = None) -> str:
    """The tag of the driver process ``pid`` (this process by default) on this host."""
    proc = psutil.Process(pid or os.getpid())
    return f"{DRIVER_TAG}{socket.gethostname()}:{proc.pid}:{int(proc.create_time())}"


@contextmanager
def untagged_tasks() -> Iterator[None]:
    """Task runs created inside carry no tags (the flow run keeps its own, the driver's).

    Prefect takes a tag concurrency slot (an API round trip with a lease) for every tagged task
    run: seconds per evaluation for a tag only the reaper reads, and only on flow runs.
    """
    from prefect.context import TagsContext

    with TagsContext(current_tags=set()):
        yield


def dead_driver(tags: Iterable[str]) -> str | None:
    """The driver tag among ``tags`` when it names a process of this host that is gone."""
    for tag in tags:
        if not tag.startswith(DRIVER_TAG):
            continue
        try:
            host, pid, started = tag.removeprefix(DRIVER_TAG).rsplit(":", 2)
            if host != socket.gethostname():
                return None
            proc = psutil.Process(int(pid))
            alive = int(proc.create_time()) == int(started) and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            alive = False
        except (ValueError, psutil.Error):
            return None
        return None if alive else tag
    return None


def reap_dead_drivers(limit: int = 200) -> list[str]:
    """Mark evaluation flow runs whose driver on this host died Crashed; returns their ids."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    from flows.api_ledger import replay_pending

    live_states = [StateType.RUNNING, StateType.PENDING]
    reaped: list[str] = []
    with get_client(sync_client=True) as client:
        # First the runs whose driver ended them while the API was down: not Crashed, Completed.
        replay_pending(client)
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=list(FLOW_NAMES))),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=live_states))),
            limit=limit,
        )
        for run in runs:
            tag = dead_driver(run.tags)
            if tag is None:
                continue
            pid = tag.removeprefix(DRIVER_TAG).rsplit(":", 2)[1]
            message = (f"driver process {pid} on {socket.gethostname()} died without ending this "
                       "run (killed); marked Crashed by the next evaluation on that host")
            end_run(client, run.id, Crashed, message)
            reaped.append(str(run.id))
            logger.warning("flow run %s (%s): %s", run.name, run.id, message)
    return reaped


def end_run(client: Any, run_id: Any, state: Callable[..., Any], message: str,
            name: str | None = None) -> None:
    """Set flow run ``run_id`` and its task runs still Running or Pending to ``state(message)``.

    ``name``: the flow run's state name (``Completed(name="Outputs missing")``); its task runs
    keep the state's own.
    """
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    live = [StateType.RUNNING, StateType.PENDING]
    tasks = client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=live))),
    )
    for task_run in tasks:
        client.set_task_run_state(task_run.id, state(message=message), force=True)
    named = {"name": name} if name else {}
    client.set_flow_run_state(run_id, state(message=message, **named), force=True)


def reap_quietly() -> list[str]:
    """``reap_dead_drivers``, never failing the evaluation that calls it."""
    try:
        return reap_dead_drivers()
    except Exception as err:  # bookkeeping of other runs must not cost this one
        logger.warning("could not check for flow runs of killed evaluations: %s", err)
        return []
