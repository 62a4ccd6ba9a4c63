"""Serve the evaluation flow as a deployment: ``python -m deployments.serve --dask-address ADDR``.

``service_flow`` is the deployment's entrypoint (here and in ``deployments/prefect.yaml``): it
runs ``flows.eval.evaluate`` on the service's Dask cluster, so ``eval_flow`` appears as its
subflow with the Dask task runner attached. A flow run started by a worker from an entrypoint
would not keep a task runner set with ``with_options``; a wrapper flow does.

Served deployments poll for scheduled runs every ``PREFECT_RUNNER_POLL_FREQUENCY`` seconds
(10 by default); ``--poll 1`` makes a webhook start its flow run within about a second.
"""

# No ``from __future__ import annotations`` here: Prefect validates the flow's parameters
# against its annotations in the flow-run process, which must see the real classes.
import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from prefect import flow

from deployments import (
    DASK_ADDRESS_ENV,
    DEPLOYMENT_NAME,
    FLOW_NAME,
    at_least_one,
    poll_seconds,
    resolve_secret,
)
from deployments.webhook.receiver import report_path
from evalfleet.callback import CALLBACK_SECRET_ENV, FAILURE_EVENT, REPORT_EVENT, send_report_callback
from evalfleet.errors import RequestError
from evalfleet.models import EvalReport, EvalRequest, with_missing
from evalfleet.storage import report_lock, write_json
from evalfleet.suite import Suite, SuiteReport
from flows.api_ledger import final_state
from flows.eval import evaluate
from flows.suite import evaluate_suite

logger = logging.getLogger("evalfleet.serve")


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """Tell the trainer an evaluation ended without a report (signed, bounded retries).

    Without this, a trainer waiting for the callback of a failed or crashed run would wait
    for its own timeout; with it, it learns at once and from the same channel.

    A run that ended after stage 7 wrote its report (the flow-run process killed while, or
    after, the callback was sent) has results, not a failure: when the report records its
    callback as delivered nothing is sent; otherwise the report is sent again as
    ``evaluation.completed``, with stage 7's delivery id (``<request_id>:completed``), so a
    trainer that got it already drops the repeat. ``evaluation.failed`` (delivery id
    ``<request_id>:failed``) is sent only for a run with no report.
    """
    request = (flow_run.parameters or {}).get("request") or {}
    if isinstance(request, EvalRequest):
        request = request.model_dump(mode="json")
    url = request.get("callback_url")
    if not url:
        return
    request_id = request.get("request_id")
    path = None
    if request.get("output") and request_id:
        path = report_path(Path(request["output"]), str(request_id))
    report = _read_report(path) if path is not None else None
    if path is not None and report is not None:
        sent = str((report.get("outputs") or {}).get("callback") or "")
        if sent.startswith("delivered"):
            logger.info("%s ended %s after its report was delivered (%s): no failure callback",
                        request_id, state.type, sent)
            return
        outcome = send_report_callback(url, report, event=REPORT_EVENT)
        with report_lock(path):  # read again: a flush may have recorded a late MLflow run meanwhile
            report = _read_report(path) or report
            alarms = report.get("alarms") or []
            if not outcome.startswith("delivered"):
                alarms = with_missing(alarms, [f"the callback to the trainer: {outcome}"])
            late = [a for a in alarms if a not in (report.get("alarms") or [])]
            report = {**report, "outputs": {**(report.get("outputs") or {}), "callback": outcome},
                      "alarms": alarms}
            write_json(report, path)
        _log_late_alarms(report, late, path)
        logger.info("report callback for %s (run ended %s after its report): %s", request_id,
                    state.type, outcome)
        return
    outcome = send_report_callback(url, {
        "request_id": request_id,
        "training_run_id": request.get("training_run_id"),
        "step": request.get("step"),
        "state": state.type.value if hasattr(state.type, "value") else str(state.type),
        "message": state.message,
        "flow_run_id": str(flow_run.id),
    }, event=FAILURE_EVENT)
    logger.info("failure callback for %s: %s", request_id, outcome)


def _log_late_alarms(report: dict[str, Any], late: list[str], path: Path) -> None:
    """Tag the evaluation's MLflow run with the alarms this hook added to report.json.

    Its run said less than report.json: no ``output_missing`` tag, one alarm less in
    ``eval/alarm_count``. A run still queued is logged from report.json as it is at its flush.
    """
    outputs = report.get("outputs") or {}
    if not late or not outputs.get("mlflow_run_id") or not outputs.get("mlflow_uri"):
        return
    from evalfleet.tracking import log_late_alarms

    try:
        log_late_alarms(outputs["mlflow_uri"], outputs["mlflow_run_id"], report, late, [path])
    except Exception as err:  # noqa: BLE001 - report.json has them; say so, never raise in a hook
        logger.error("could not tag MLflow run %s with the late alarms %s: %s",
                     outputs["mlflow_run_id"], late, err)


def _read_report(path: Path) -> dict[str, Any] | None:
    """The report stage 7 wrote at ``path``, or None (none written, or unreadable)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) else None


@flow(name=FLOW_NAME, flow_run_name="{request.env}-{request.request_id}", log_prints=False,
      on_failure=[notify_failure], on_crashed=[notify_failure])
def service_flow(request: EvalRequest, suite: Suite | None = None) -> EvalReport | SuiteReport:
    """Evaluate ``request`` on the service's Dask cluster (``$EVALFLEET_DASK_ADDRESS``).

    With a ``suite``, every task of it with ``request``'s policy and protocol (``flows.suite``).
    """
    address = request.dask_address or os.environ.get(DASK_ADDRESS_ENV)
    if not address:
        raise RequestError(
            f"no Dask cluster for the service: set {DASK_ADDRESS_ENV}=tcp://HOST:8786 where the "
            "deployment is served (evalfleet serve does), or put dask_address in the request."
        )
    if suite is not None:
        return final_state(evaluate_suite(suite, request.model_copy(update={"dask_address": address})))
    return final_state(evaluate(request.model_copy(update={"dask_address": address})))


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m deployments.serve``."""
    p = argparse.ArgumentParser(
        prog="python -m deployments.serve",
        description=f"Serve '{FLOW_NAME}/{DEPLOYMENT_NAME}' against $PREFECT_API_URL until "
        "interrupted.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dask-address", default=os.environ.get(DASK_ADDRESS_ENV),
                   help=f"scheduler of the evaluation cluster (default: ${DASK_ADDRESS_ENV})")
    p.add_argument("--name", default=DEPLOYMENT_NAME, help="deployment name")
    p.add_argument("--limit", type=at_least_one, default=2, help="flow runs executing at once")
    p.add_argument("--poll", type=poll_seconds, default=1,
                   help="whole seconds between polls for scheduled runs, >= 1 (Prefect's default is 10)")
    p.add_argument("--callback-secret-block", default=None,
                   help=f"Prefect Secret block signing report callbacks when ${CALLBACK_SECRET_ENV} "
                   "is unset")
    return p


def main(argv: list[str] | None = None) -> int:
    """Serve the deployment until interrupted."""
    from prefect.settings import PREFECT_API_URL, PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not PREFECT_API_URL.value():
        raise SystemExit("evalfleet serve: set PREFECT_API_URL to a running Prefect server; a "
                         "served deployment needs one (evalfleet serve starts one for you).")
    if not args.dask_address:
        raise SystemExit(f"evalfleet serve: pass --dask-address or set {DASK_ADDRESS_ENV}.")
    # Flow runs are child processes: they find the cluster and the callback secret in the env.
    os.environ[DASK_ADDRESS_ENV] = args.dask_address
    secret = resolve_secret(CALLBACK_SECRET_ENV, args.callback_secret_block)
    if secret:
        os.environ[CALLBACK_SECRET_ENV] = secret
    else:
        logger.warning("%s is not set: reports will not be POSTed to callback URLs",
                       CALLBACK_SECRET_ENV)
    with temporary_settings(updates={PREFECT_RUNNER_POLL_FREQUENCY: args.poll}):
        service_flow.serve(
            name=args.name,
            limit=args.limit,
            tags=["evalfleet"],
            description="Evaluate one EvalRequest on the evalfleet Dask cluster. Triggered by the "
            "evalfleet webhook receiver, the Evaluator client, or by hand from the UI.",
            pause_on_shutdown=False,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
