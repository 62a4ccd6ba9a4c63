"""Where the flow runs: one Prefect API for every process, and a Dask task runner."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from evalfleet import mlflow_logger
from evalfleet.environ import exported
from evalfleet.errors import EvalfleetError
from evalfleet.server import SERVER_MODE_ENV
from evalfleet.tracking import default_tracking_uri
from flows import client_tls, heartbeats

if TYPE_CHECKING:
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import Received

logger = logging.getLogger(__name__)


class PrefectApi:
    """The Prefect API of an evaluation: its URL at once, and ``wait()`` until it answers."""

    def __init__(self, url: str, starting: threading.Thread | None = None) -> None:
        self.url = url
        self._starting = starting
        self.error: BaseException | None = None

    def wait(self) -> str:
        """Block until the server answers (a no-op for a server that was already running)."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if isinstance(self.error, EvalfleetError):  # says itself what failed and what to do
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"the local Prefect server did not start: {self.error}") from self.error
        return self.url


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def prefect_api(wait: bool = True) -> Iterator[PrefectApi]:
    """Yield the Prefect API every process of this evaluation uses.

    With ``PREFECT_API_URL`` set, that server is used. Otherwise the shared local server
    (``evalfleet.server``: started on first use, it stays up for later evaluations), or with
    ``EVALFLEET_SERVER=ephemeral`` one server subprocess for this evaluation only. Either way its
    URL is exported through the environment *before* any Dask worker is spawned: Prefect's
    ephemeral mode would otherwise start one server per worker process. The URL is fixed before
    the server answers, so with ``wait=False`` the caller can start its cluster while the server
    boots, and call ``wait()`` before the first flow run.
    """
    url = PREFECT_API_URL.value()
    if url:
        yield PrefectApi(url)
        return
    if os.environ.get(SERVER_MODE_ENV, "local") != "ephemeral":
        with shared_local_api(wait) as api:
            yield api
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer(port=_free_port())
    api_url = server.api_url

    def start() -> None:
        try:
            server.start(timeout=120)
            if server.api_url != api_url:  # it moved to another port: workers have the old URL
                raise RuntimeError(f"it came up at {server.api_url}, not {api_url}; retry")
        except BaseException as err:  # handed to the caller's wait()
            api.error = err

    starting = threading.Thread(target=start, name="evalfleet-prefect-server", daemon=True)
    api = PrefectApi(api_url, starting)
    try:
        with exported({"PREFECT_API_URL": api_url}):
            starting.start()
            # This server lives only as long as the evaluation: flow heartbeats (zombie detection
            # for long-lived servers) would only add thread work per flow run.
            with temporary_settings(updates={PREFECT_API_URL: api_url,
                                             PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
                if wait:
                    api.wait()
                yield api
    finally:
        _flushed(api)  # while the server still answers
        server.stop()


def start_shared_server() -> None:
    """Start the shared local server now, if this evaluation will use it and none runs.

    Called once the request is valid (stage 1 has resolved the env, read the policy and placed
    inference) and before the policy's check: a first start (~5 s) then boots beside the check,
    the workers' start and the imports instead of after them. ``shared_local_api`` finds it
    booting and waits. Any failure is left to that later claim, which reports it.
    """
    if PREFECT_API_URL.value() or os.environ.get(SERVER_MODE_ENV, "local") == "ephemeral":
        return
    from evalfleet.server import claim_server

    try:
        claim_server()
    except Exception as err:  # noqa: BLE001 - shared_local_api claims again and says what failed
        logger.debug("early start of the local Prefect server failed: %s", err)


@contextmanager
def shared_local_api(wait: bool = True) -> Iterator[PrefectApi]:
    """The shared local server's API for this block: found after a health check, or started."""
    from evalfleet.server import claim_server, mark_used, wait_healthy

    state, ready = claim_server()
    api = PrefectApi(state.url)
    if not ready:
        def boot() -> None:
            try:
                wait_healthy(state)
            except BaseException as err:  # handed to the caller's wait()
                api.error = err

        api._starting = threading.Thread(target=boot, name="evalfleet-prefect-server", daemon=True)
        api._starting.start()
    try:
        with exported({"PREFECT_API_URL": state.url}), \
                temporary_settings(updates={PREFECT_API_URL: state.url}):
            if wait:
                api.wait()
            yield api
        mark_used()  # the CLI leaves its shared logger and fork server behind (``cli.run_eval``)
    finally:
        _flushed(api)  # bounded, rather than at interpreter exit


def _flushed(api: PrefectApi) -> None:
    """Once the server answers, send this process's pending logs and events (bounded)."""
    try:
        api.wait()
        flush_to_api()
    except (RuntimeError, EvalfleetError):
        pass  # already reported to the caller, or the caller failed first


#: Seconds the flush of pending Prefect logs and events may take before the local server stops.
FLUSH_TIMEOUT_S = 10.0


def flush_to_api(timeout: float = FLUSH_TIMEOUT_S) -> None:
    """Send this process's pending Prefect logs and events now, bounded by ``timeout``.

    Prefect sends them from background services that drain at interpreter exit, with no time
    limit: after a per-evaluation server has stopped, that drain retries against a closed port
    (seen: a cold CLI run taking 106 s instead of 31 s). Drained services restart on next use.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=timeout, at_exit=False)
        except Exception as err:  # never let bookkeeping cost the evaluation
            logger.warning("could not flush Prefect %s: %s", service.__name__, err)


heartbeats.install()  # before any flow of this process runs
client_tls.install()  # before any Prefect client of this process is made


#: What the flows' local workers import beside the core's ``WORKER_MODULES``: Prefect's task
#: engine and the stage-4 task (the main module too, which imports these).
FLOW_WORKER_MODULES = ("prefect", "prefect.task_engine", "prefect_dask", "tasks.run_episodes")


def worker_modules(torch: bool) -> tuple[str, ...]:
    """The local workers' fork server's preload; ``torch`` for a cluster running torch policies."""
    return FLOW_WORKER_MODULES + (("torch",) if torch else ())


def worker_preload(received: Received) -> tuple[str, ...]:
    """``worker_modules`` for the policy stage 1 received: torch unless it is a plain callable."""
    return worker_modules(received.artifact.format != "callable")


#: What stages 4 to 7 import on first use (~2.5 s in all): pandas (pyarrow imports it the first
#: time it converts a column, in stage 4's round schedule), statistics, MLflow's SQL store, plots.
LATER_MODULES = ("pandas", "scipy.special", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
                 "evalfleet.plots")


def task_runner(address: str | None) -> Any:
    """The flow's task runner: Dask's on the cluster at ``address``; threads here with none.

    ``prefect_dask`` (and ``distributed`` with it, ~0.2 s) is imported only when there is a
    cluster: a cache hit from the CLI starts none.
    """
    if not address:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner()
    from prefect_dask import DaskTaskRunner

    return DaskTaskRunner(address=address)


class Ahead:
    """What ``evaluate`` starts once stage 1 knows the request is a miss, before its check.

    ``received_before_flow``'s ``on_miss``: called with the ``Received``, it starts stages 6-7's
    imports on a thread (``join`` before the flow) and returns the preload of a local cluster's
    fork server (``worker_preload``).
    """

    def __init__(self, request: EvalRequest) -> None:
        self.request = request
        self.imports: threading.Thread | None = None

    def __call__(self, received: Received) -> tuple[str, ...]:
        """Start the imports and the shared server; the workers' preload for ``received``'s policy."""
        start_shared_server()
        self.imports = import_in_background(later_modules(self.request))
        return worker_preload(received)

    def join(self) -> None:
        """Wait for the imports started, if any."""
        if self.imports is not None:
            self.imports.join()


def later_modules(request: EvalRequest) -> tuple[str, ...]:
    """``LATER_MODULES``, less MLflow's when the shared logger will log the run and no history is read."""
    uri = request.mlflow_uri or default_tracking_uri(request.output)
    if request.training_run_id is None and mlflow_logger.usable() and uri.startswith("sqlite:///"):
        return tuple(m for m in LATER_MODULES if not m.startswith("mlflow."))
    return LATER_MODULES


def import_in_background(modules: tuple[str, ...] = LATER_MODULES) -> threading.Thread:
    """Import ``modules`` on a thread while this one waits (for the cluster to start).

    Join it before the flow runs, so nothing else imports at the same time. A module that
    fails to import here is imported again where it is needed, and fails there with its error.
    """
    import importlib

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - the stage that needs it says why
                logger.debug("background import of %s failed: %s", name, err)

    thread = threading.Thread(target=run, name="evalfleet-imports", daemon=True)
    thread.start()
    return thread
