"""The receiver's side of Prefect: flow runs of the deployment, through Prefect's own client.

Prefect is imported when a ``PrefectAPI`` is made, not when this module is, so ``evalfleet``'s
command line (which imports the webhook package for its options) stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from deployments import DEPLOYMENT

if TYPE_CHECKING:
    from prefect.client.schemas.filters import DeploymentFilter, FlowRunFilter
    from prefect.client.schemas.objects import FlowRun

T = TypeVar("T")

#: Prefect state types after which a flow run will not change any more.
FINAL_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
#: States whose evaluation a new delivery with the same cache key may replace.
RETRYABLE_STATES = ("FAILED", "CRASHED", "CANCELLED")
#: Calls per read of the Prefect API (a read is always safe to repeat).
READ_ATTEMPTS = 3


def _transient(err: BaseException) -> bool:
    # A busy server's SQLite answers 503 now and then; 4xx will not change on retry.
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code >= 500
    return isinstance(err, httpx.TransportError)


def _busy(err: BaseException) -> bool:
    # What a read retries: the server answered 5xx. A refused connection is not retried here
    # (the client's transport already tried it for ~1.5 s; the server is down, not busy).
    return isinstance(err, httpx.HTTPStatusError) and err.response.status_code >= 500


class PrefectAPI:
    """The calls the receiver makes to a Prefect server, with Prefect's sync client.

    The client's own retry loop (``PREFECT_CLIENT_MAX_RETRIES``: five retries, 2 to 32 s apart,
    about a minute on a 503) is switched off for these calls: a webhook answers 503 quickly and
    the trainer retries. Here, calls retry briefly instead, 0.25 s doubling between them:
    flow-run creation at most 4 calls on 5xx and connection errors (``create_flow_run``), reads
    at most ``READ_ATTEMPTS`` calls on a 5xx answer. A busy server's SQLite answers 503 now and
    then, and one such answer should not turn a delivery into a 503 for the trainer. With
    retries off, Prefect's client still pauses ~2 s after a 408/429/502/503 answer before
    returning it.
    """

    def __init__(self, api_url: str, deployment: str = DEPLOYMENT, timeout: float = 10.0) -> None:
        from prefect.client.orchestration import get_client
        from prefect.context import get_settings_context
        from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES

        self.api_url = api_url.rstrip("/")
        self.deployment = deployment
        current = get_settings_context()
        self._profile = current.profile
        self._settings = current.settings.copy_with_update(
            updates={PREFECT_API_URL: self.api_url, PREFECT_CLIENT_MAX_RETRIES: 0})
        with self._prefect_settings():
            self._client = get_client(httpx_settings={"timeout": timeout}, sync_client=True)
            self._client.__enter__()
        self._deployment_id: UUID | None = None

    @contextmanager
    def _prefect_settings(self) -> Iterator[None]:
        # Settings are read per request from a context variable: enter ours in the calling thread.
        from prefect.context import SettingsContext

        with SettingsContext(profile=self._profile, settings=self._settings):
            yield

    def _call(self, fn: Callable[[], T], attempts: int = 1,
              retry: Callable[[BaseException], bool] = _busy) -> T:
        if attempts > 1:
            retrying = Retrying(stop=stop_after_attempt(attempts),
                                wait=wait_exponential(multiplier=0.25),
                                retry=retry_if_exception(retry), reraise=True)
            return retrying(self._call, fn)
        with self._prefect_settings():
            return fn()

    def healthy(self) -> bool:
        """True when the server answers its health check."""
        return self._call(self._client.api_healthcheck) is None

    def deployment_id(self) -> UUID:
        """The deployment's id (looked up once)."""
        if self._deployment_id is None:
            deployment = self._call(lambda: self._client.read_deployment_by_name(
                self.deployment), READ_ATTEMPTS)
            self._deployment_id = deployment.id
        return self._deployment_id

    def create_flow_run(self, parameters: dict[str, Any], idempotency_key: str,
                        tags: list[str], attempts: int = 4) -> FlowRun:
        """Create a flow run of the deployment; the server de-duplicates on ``idempotency_key``.

        Returns the flow run: the new one, or the one an earlier call (from any process) created
        with the same key, its parameters and tags included. Retried (at most ``attempts``
        calls, 0.25 s doubling between them) on 5xx and connection errors: a busy server's
        SQLite answers 503 now and then, and the idempotency key makes a retry safe even if the
        first call landed. The last failure is raised. A 408/429/502/503 answer adds the ~2 s
        pause of Prefect's client to each attempt (see the class docstring).
        """
        deployment_id = self.deployment_id()
        return self._call(lambda: self._client.create_flow_run_from_deployment(
            deployment_id, parameters=parameters, idempotency_key=idempotency_key, tags=tags),
            attempts, _transient)

    def _filters(self, tags: list[str], states: tuple[str, ...] | None
                 ) -> tuple[FlowRunFilter, DeploymentFilter]:
        from prefect.client.schemas.filters import (
            DeploymentFilter,
            DeploymentFilterId,
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.objects import StateType

        state = None if states is None else FlowRunFilterState(
            type=FlowRunFilterStateType(any_=[StateType(s) for s in states]))
        runs = FlowRunFilter(tags=FlowRunFilterTags(all_=tags), state=state)
        return runs, DeploymentFilter(id=DeploymentFilterId(any_=[self.deployment_id()]))

    def count_flow_runs(self, tags: list[str], states: tuple[str, ...] | None = None) -> int:
        """Flow runs of the deployment carrying every tag in ``tags`` (and in ``states``)."""
        runs, deployments = self._filters(tags, states)
        return self._call(lambda: self._client.count_flow_runs(
            flow_run_filter=runs, deployment_filter=deployments), READ_ATTEMPTS)

    def find_flow_run(self, tags: list[str]) -> FlowRun | None:
        """The oldest flow run of the deployment carrying every tag in ``tags``, if any."""
        from prefect.client.schemas.sorting import FlowRunSort

        runs, deployments = self._filters(tags, None)
        found = self._call(lambda: self._client.read_flow_runs(
            flow_run_filter=runs, deployment_filter=deployments,
            sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=1), READ_ATTEMPTS)
        return found[0] if found else None

    def flow_run(self, flow_run_id: str) -> FlowRun:
        """The flow run with this id."""
        return self._call(lambda: self._client.read_flow_run(UUID(flow_run_id)), READ_ATTEMPTS)

    def ui_url(self, flow_run_id: str) -> str:
        """Link to the flow run in the Prefect UI served next to the API."""
        return f"{self.api_url.removesuffix('/api')}/runs/flow-run/{flow_run_id}"

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.__exit__(None, None, None)
