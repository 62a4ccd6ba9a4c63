"""Where the flow runs: one Prefect API for every process, and a Dask task runner."""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow_engine
from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

logger = logging.getLogger(__name__)


@contextmanager
def prefect_api() -> Iterator[str]:
    """Yield the Prefect API URL every process of this evaluation uses.

    With ``PREFECT_API_URL`` set, that server is used. Otherwise one local server subprocess is
    started for this evaluation and exported through the environment *before* any Dask worker is
    spawned: Prefect's ephemeral mode would otherwise start one server per worker process.
    """
    url = PREFECT_API_URL.value()
    if url:
        yield url
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start(timeout=120)
    # This server lives only as long as the evaluation: flow heartbeats (zombie detection for
    # long-lived servers) would only add up to a second of thread join per flow run.
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url,
                                         PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield server.api_url
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved
        server.stop()


@contextmanager
def _prompt_heartbeats(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
    """Prefect's flow-run heartbeats, with a thread that stops as soon as the run ends.

    Prefect 3.8's own heartbeat thread sleeps in 1 s steps and the engine joins it when the flow
    ends: up to a second added to every flow run on a long-lived server (heartbeats are on by
    default there), which is most of a warm evaluation's fixed cost. This one emits the same
    events at the same frequency and waits on an event instead of sleeping.
    """
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


def install_prompt_heartbeats() -> bool:
    """Use ``_prompt_heartbeats`` for flow runs of this process; False if Prefect's engine differs."""
    needed = ("_build_heartbeat_event_template", "_emit_flow_run_heartbeat", "heartbeat_seconds")
    engine_cls = getattr(flow_engine, "FlowRunEngine", None)
    if not hasattr(flow_engine, "_send_heartbeats") or engine_cls is None or not all(
            hasattr(engine_cls, name) for name in needed):
        logger.debug("Prefect's flow engine has no heartbeat hook to replace; keeping its own")
        return False
    flow_engine._send_heartbeats = _prompt_heartbeats
    return True


install_prompt_heartbeats()
