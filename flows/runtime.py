"""Where the flow runs: one Prefect API for every process, and a Dask task runner."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings


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
