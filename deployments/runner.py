"""An ``Evaluator`` runner that evaluates through the served deployment (``evalfleet serve``).

Use it as ``Evaluator(..., runner=DeploymentRunner("http://HOST:4200/api"))``. Each evaluation is a
flow run created with Prefect's own ``run_deployment`` (idempotent per request id, so a retried
trigger never starts a second run) and waited for by it, bounded by ``timeout_s``.
"""

from __future__ import annotations

import os
from typing import cast

from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments import DEPLOYMENT
from evalfleet.errors import EvalfleetError
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.runners import EvaluationFailed
from evalfleet.storage import run_dir


class DeploymentRunner:
    """Runs each evaluation as a flow run of a served deployment.

    The report is read from ``report.json`` under the request's ``output`` folder, so that folder
    must be shared between this process and the deployment's (same host, or a shared volume);
    the ``Evaluator`` makes it absolute before sending.
    """

    def __init__(
        self,
        api_url: str | None = None,
        deployment: str = DEPLOYMENT,
        *,
        timeout_s: float = 1800.0,
        poll_s: float = 0.5,
    ) -> None:
        url = api_url or os.environ.get("PREFECT_API_URL", "")
        if not url:
            raise EvalfleetError(
                "DeploymentRunner needs a Prefect API: pass api_url='http://HOST:4200/api' or set "
                "PREFECT_API_URL (start one with 'evalfleet serve')."
            )
        if deployment.count("/") != 1:
            raise EvalfleetError(
                f"'deployment' must look like 'flow-name/deployment-name' (got {deployment!r})."
            )
        self.api_url = url.rstrip("/")
        self.deployment = deployment
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    def __call__(self, request: EvalRequest) -> EvalReport:
        """Trigger the deployment and block (bounded by ``timeout_s``) until its report exists."""
        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            # Called from synchronous code, run_deployment returns the FlowRun, not a coroutine.
            flow_run = cast(FlowRun, run_deployment(
                self.deployment,
                parameters={"request": request.model_dump(mode="json")},
                idempotency_key=f"evalfleet-{request.request_id}",
                tags=["evalfleet", "client"],
                timeout=self.timeout_s,
                poll_interval=self.poll_s,
                as_subflow=False,  # a flow run of its own, even when triggered from inside a flow
            ))
        state = flow_run.state
        name = state.name if state is not None else None
        if state is None or not state.is_final():
            raise EvaluationFailed(
                f"flow run {flow_run.id} not finished after {self.timeout_s:.0f} s (state "
                f"{name!r}); is 'evalfleet serve' running for {self.deployment!r}?"
            )
        if not state.is_completed():
            raise EvaluationFailed(f"flow run {flow_run.id} ended {name!r}: {state.message}")
        path = run_dir(request.output, request.request_id) / "report.json"
        try:
            return EvalReport.model_validate_json(path.read_text())
        except OSError as err:
            raise EvaluationFailed(
                f"flow run {flow_run.id} completed but {path} cannot be read ({err}); the output "
                "folder must be shared between this process and the deployment."
            ) from err

    def close(self) -> None:
        """Nothing to release: each call opens and closes its own Prefect client."""


__all__ = ["DeploymentRunner"]
