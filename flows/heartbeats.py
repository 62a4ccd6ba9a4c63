"""Prefect's flow-run heartbeats, with a thread that stops as soon as the run ends.

Prefect 3.8's heartbeat thread (``prefect.flow_engine._send_heartbeats``) sleeps in 1 s steps and
the engine joins it when the flow ends: on a long-lived server, where heartbeats are on by default
(``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, 180 s), every flow run waits up to a second for it to
wake (measured: a trivial flow run 1.29 s with it, 0.43 s with this one). Prefect has no public
setting for that wait: the only public lever, ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY=None``, turns the
heartbeats off, and with them the zombie-run detection a long-lived server may rely on (a
per-evaluation server does turn them off, see ``flows.runtime.prefect_api``).

So this module replaces that one private function, and only where it was checked: Prefect
``TESTED_PREFECT`` with the names it uses present. Anywhere else Prefect's own thread stays.
The replacement emits the same events at the same frequency and waits on an event instead of
sleeping.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import prefect
from prefect import flow_engine

logger = logging.getLogger(__name__)

#: Prefect releases (major.minor) whose ``flow_engine._send_heartbeats`` this replaces.
TESTED_PREFECT = ("3.8",)

#: What the replacement uses of Prefect's engine.
_ENGINE_NAMES = ("_build_heartbeat_event_template", "_emit_flow_run_heartbeat", "heartbeat_seconds")


@contextmanager
def prompt_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """``flow_engine._send_heartbeats`` with a stop that wakes the thread at once."""
    seconds = engine.heartbeat_seconds
    if seconds is None:
        yield
        return
    resource, related = engine._build_heartbeat_event_template()
    stop = threading.Event()

    def loop() -> None:
        while True:
            run = engine.flow_run
            if run is not None and run.state is not None and run.state.is_final():
                return
            try:
                engine._emit_flow_run_heartbeat(resource, related)
            except Exception:
                engine.logger.debug("Failed to emit heartbeat", exc_info=True)
            if stop.wait(seconds):
                return

    # The thread must see the caller's settings (API URL), as Prefect's own does.
    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(loop,), name="evalfleet-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        if join_on_exit:
            thread.join(timeout=2)


def replaceable(version: str = prefect.__version__) -> bool:
    """True when Prefect ``version``'s engine is one this module was checked against."""
    engine_cls = getattr(flow_engine, "FlowRunEngine", None)
    return (
        ".".join(version.split(".")[:2]) in TESTED_PREFECT
        and callable(getattr(flow_engine, "_send_heartbeats", None))
        and engine_cls is not None
        and all(hasattr(engine_cls, name) for name in _ENGINE_NAMES)
    )


def install(version: str = prefect.__version__) -> bool:
    """Use ``prompt_heartbeats`` for this process's flow runs; False (Prefect's own) if untested."""
    if not replaceable(version):
        logger.debug("Prefect %s is not one of %s: keeping its own heartbeat thread", version,
                     TESTED_PREFECT)
        return False
    flow_engine._send_heartbeats = prompt_heartbeats
    return True
