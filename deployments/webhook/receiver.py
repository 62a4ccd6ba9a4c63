"""The receiver's logic, independent of the HTTP framework.

It authenticates, validates and de-duplicates deliveries, creates the flow runs, and answers
status reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from deployments import DEPLOYMENT, WEBHOOK_SECRET_ENV
from deployments.webhook.flow_runs import FINAL_STATES, RETRYABLE_STATES, PrefectAPI
from deployments.webhook.policy_copy import fetch_policy
from deployments.webhook.schema import (
    EvaluationCreate,
    Rejected,
    idempotency_key,
    parse_body,
    suite_sets,
)
from deployments.webhook.store import PENDING, Evaluation, EvaluationStore
from evalfleet.callback import (
    DEFAULT_TOLERANCE_S,
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    read_message,
    verify,
)
from evalfleet.egress import DEFAULT_MAX_DOWNLOAD_BYTES, EgressPolicy, EgressRefused
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest, check_training_pair
from evalfleet.storage import run_dir

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

logger = logging.getLogger("evalfleet.webhook")
T = TypeVar("T")
#: How long a delivery waits for one of its id and body handled at once (its policy fetched,
#: its flow run created), and how often it looks.
PENDING_WAIT_S = 30.0
PENDING_POLL_S = 0.05


def check_service_settings(*, isolation: str, output: Path, mlflow_uri: str | None,
                           experiment: str) -> None:
    """The service's own settings make a valid evaluation, or ``SystemExit`` naming the option.

    A service started with ``--isolation bogus`` or an empty ``--experiment`` came up "ready",
    then answered every valid delivery 400, blaming the trainer's body.
    """
    from evalfleet.cli import EXAMPLE_POLICY
    from evalfleet.pipeline import check_folders

    try:
        check_folders(EvalRequest.build(
            env="CartPole-v1", policy=EXAMPLE_POLICY, isolation=isolation, output=output,
            mlflow_uri=mlflow_uri, experiment=experiment))
    except RequestError as err:
        raise SystemExit(f"evalfleet: the service's settings (--isolation, --output, --mlflow-uri, "
                         f"--experiment) make no valid evaluation: {err}") from None


@dataclass(frozen=True)
class ReceiverConfig:
    """Everything the receiver needs; secrets come from the environment or a Secret block."""

    secrets: tuple[str, ...]
    """Accepted webhook secrets (the current one first; more during a rotation)."""
    prefect_api_url: str
    """The Prefect server's API, e.g. http://127.0.0.1:4200/api."""
    state_dir: Path
    """Holds webhook.sqlite and the content-addressed policies/ folder."""
    output: Path
    """Results folder of every evaluation (Parquet, report.json, MLflow default)."""
    deployment: str = DEPLOYMENT
    """``flow-name/deployment-name`` to trigger."""
    mlflow_uri: str | None = None
    """MLflow tracking URI; default ``sqlite:///OUTPUT/mlflow.db``."""
    experiment: str = "evalfleet"
    """MLflow experiment unless the webhook names one."""
    isolation: str = "auto"
    """Sandbox level of every evaluation (a service setting, not the trainer's choice)."""
    tolerance_s: float = DEFAULT_TOLERANCE_S
    """Allowed clock difference of signed timestamps."""
    max_body_bytes: int = 64 * 1024
    """Larger bodies get 413 (policies travel by URI, not in the body)."""
    max_policy_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES
    """Larger policy files are refused (downloads stop at this many bytes)."""
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    """Which ``policy.uri`` and ``callback_url`` hosts requests may make the service reach."""
    policy_roots: tuple[Path, ...] = ()
    """Folders ``file://`` policy URIs must lie under (symlinks resolved); empty: any path."""
    request_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``EvalRequest`` fields for every evaluation (e.g. concurrency)."""


def history_fields(report: dict[str, Any]) -> dict[str, Any]:
    """Verdict, best checkpoint and alarms of a completed evaluation, at the top of a GET answer.

    The same values are in ``report['history']``; a trainer polling for a promotion decision
    reads them here without knowing the report's layout.
    """
    h = report.get("history") or {}
    return {"verdict": h.get("verdict"), "best_step": h.get("best_step"),
            "best_policy_sha256": h.get("best_policy_sha256"),
            "alarms": list(report.get("alarms") or []),
            "history_alarms": [a.get("alarm") for a in h.get("alarms") or []]}


def report_path(output: Path, evaluation_id: str) -> Path:
    """Where an evaluation's report is: ``runs/<id>/report.json``, or a suite's report."""
    path = run_dir(output, evaluation_id) / "report.json"
    suite = run_dir(output, f"suite-{evaluation_id}") / "suite_report.json"
    return suite if not path.exists() and suite.exists() else path


def _tag(kind: str, value: str) -> str:
    # Tags are how any receiver finds a run in Prefect; delivery ids are hashed (any text).
    return f"evalfleet-{kind}:{value}"


def _same_body(run: FlowRun, body_tag: str, key: str) -> bool:
    """Whether ``run``, found by a delivery's tag, was created for this delivery's body.

    Runs carry the tag of their first delivery's body sha256; a run from before that tag
    existed is compared by its cache key (the fields that make an evaluation).
    """
    if any(t.startswith(_tag("body", "")) for t in run.tags):
        return body_tag in run.tags
    return _tag("key", key) in run.tags


class Receiver:
    """The receiver's logic, independent of the HTTP framework (``create_app`` wires it).

    Prefect decides what is a new run, so several receivers behind one load balancer (each
    with its own store) still start one flow run per delivery and per live cache key: the
    flow run is created with idempotency key ``evalfleet-<cache key>-<generation>``, where the
    generation counts this deployment's runs of that cache key that ended FAILED, CRASHED or
    CANCELLED. Concurrent deliveries of one evaluation compute the same key and get the same
    run back from the server; once a run failed, the next delivery gets a new generation and
    a new run; a COMPLETED run keeps answering for its cache key. Every run carries tags with
    its evaluation id, cache key, first delivery id and that delivery's body sha256, so any
    receiver can answer a status request or a redelivery for a run another one created, and
    answers 409 to a delivery id reused for another body, as the receiver that saw it does.
    """

    pending_wait_s: float = PENDING_WAIT_S
    """How long a delivery waits for another one of its id and body being handled at once."""

    def __init__(self, config: ReceiverConfig, prefect: PrefectAPI | None = None) -> None:
        if not config.secrets or not all(config.secrets):
            raise RuntimeError(
                f"no webhook secret: set {WEBHOOK_SECRET_ENV} (or pass --secret-block NAME of a "
                "Prefect Secret block); the receiver refuses to run unauthenticated."
            )
        self.config = config
        self.store = EvaluationStore(config.state_dir / "webhook.sqlite")
        self.prefect = prefect or PrefectAPI(config.prefect_api_url, config.deployment)

    def authenticate(self, message: bytes, headers: dict[str, str],
                     delivery_id: str | None = None) -> None:
        """Check the HMAC headers over ``message`` (and ``delivery_id``); raises a 401 ``Rejected``."""
        try:
            verify(message, headers.get(SIGNATURE_HEADER.lower()),
                   headers.get(TIMESTAMP_HEADER.lower()), self.config.secrets,
                   delivery_id=delivery_id, tolerance_s=self.config.tolerance_s)
        except SignatureError as err:
            raise Rejected(401, "unauthorized", str(err), extra={"code": err.reason}) from None

    def create(self, raw: bytes, headers: dict[str, str], base_url: str
               ) -> tuple[int, dict[str, Any]]:
        """Handle one delivery; returns (status, JSON body) or raises ``Rejected``.

        The delivery id is part of what is signed: de-duplication keys on it, so a captured
        request replayed under a fresh id is a 401, not a new delivery.
        """
        sent_id = headers.get(DELIVERY_HEADER.lower()) or ""
        delivery_id = sent_id.strip()
        if not delivery_id or len(delivery_id) > 200:
            raise Rejected(400, "invalid_request", "a unique delivery id (≤ 200 characters) is "
                           "required; retries must reuse it", field_name=DELIVERY_HEADER)
        self.authenticate(raw, headers, sent_id)
        body = parse_body(raw)
        if body.suite is not None:
            suite_parameter(body.suite)  # a bad suite is a 400 before the policy is fetched
            check_suite_body(body)
        elif body.env is None:
            raise Rejected(400, "invalid_request", "'env' is required (e.g. {\"id\": "
                           "\"CartPole-v1\"}): only a body with a 'suite' leaves it out, its tasks "
                           "naming their envs.", field_name="env")
        if body.callback_url is not None:
            try:
                self.config.egress.check(str(body.callback_url))
            except EgressRefused as err:
                raise Rejected(400, "invalid_request", f"callback_url refused: {err}",
                               field_name="callback_url") from None
        body_sha = hashlib.sha256(raw).hexdigest()
        known, reserved = self._reserve(delivery_id, body_sha, base_url)
        if known is not None:
            return 200, known
        try:
            return self._create(body, delivery_id, body_sha, base_url)
        except BaseException:
            if reserved:  # nothing was recorded: a retry of this delivery id goes through
                self.store.release(delivery_id, body_sha)
            raise

    def status(self, evaluation_id: str, headers: dict[str, str], base_url: str
               ) -> dict[str, Any]:
        """State of an evaluation and, once completed, its report (signed reads only).

        A run that ended FAILED, CRASHED or CANCELLED after stage 7 wrote its report (the
        flow-run process killed while the callback was sent) still has its results: the report
        is returned, with ``report_from_failed_run`` true.
        """
        self.authenticate(read_message("GET", f"/v1/evaluations/{evaluation_id}"), headers)
        evaluation = self.store.get(evaluation_id)
        if evaluation is None and len(evaluation_id) <= 64:  # made by another receiver?
            run = self._prefect(lambda: self.prefect.find_flow_run([_tag("eval", evaluation_id)]))
            evaluation = self._from_run(run) if run is not None else None
        if evaluation is None:
            raise Rejected(404, "not_found", f"no evaluation {evaluation_id!r}")
        out = self._accepted(evaluation, base_url, duplicate=None)
        out.pop("duplicate")
        run = self._prefect(lambda: self.prefect.flow_run(evaluation.flow_run_id))
        state_type = run.state.type.value if run.state is not None else None
        out.update(state=state_type, state_name=run.state.name if run.state else None,
                   message=run.state.message if run.state else None,
                   final=state_type in FINAL_STATES, report=None, report_from_failed_run=False)
        path = report_path(Path(evaluation.request["output"]), evaluation.id)
        if state_type == "COMPLETED":
            try:
                out["report"] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                out["message"] = f"completed, but the report cannot be read from {path}: {err}"
            else:
                out.update(history_fields(out["report"]))
        elif state_type in FINAL_STATES and path.exists():
            try:
                out["report"] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                pass  # a report cut short by the crash: the state says what happened
            else:
                out.update(history_fields(out["report"]), report_from_failed_run=True)
                out["message"] = (f"{state_type} after its report was written ({path}): "
                                  f"{out['message'] or 'no message'}")
        return out

    def healthy(self) -> dict[str, bool]:
        """Whether the store and Prefect answer."""
        return {"store": self.store.ping(), "prefect": self.prefect.healthy()}

    def close(self) -> None:
        """Release the store and the HTTP client."""
        self.store.close()
        self.prefect.close()

    # -- internals ---------------------------------------------------------------------------

    def _create(self, body: EvaluationCreate, delivery_id: str, body_sha: str, base_url: str
                ) -> tuple[int, dict[str, Any]]:
        """Fetch the policy and create (or find) the flow run of a delivery; record it."""
        policy_path = fetch_policy(body.policy, self.config.state_dir / "policies",
                                   self.config.max_policy_bytes, self.config.egress,
                                   self.config.policy_roots)
        delivery_tag = _tag("delivery", hashlib.sha256(delivery_id.encode()).hexdigest()[:32])
        body_tag = _tag("body", body_sha[:32])
        key = idempotency_key(body)
        earlier = self._prefect(lambda: self.prefect.find_flow_run([delivery_tag]))
        if earlier is not None:  # delivered before, to another receiver
            if not _same_body(earlier, body_tag, key):
                raise Rejected(409, "conflict", f"delivery id {delivery_id!r} was already used "
                               "for a different body; use a new delivery id for a new request")
            evaluation = self._from_run(earlier)
            self.store.record(delivery_id, body_sha, evaluation, evaluation.id)
            return 200, self._accepted(evaluation, base_url, duplicate="delivery")
        generation = self._prefect(lambda: self.prefect.count_flow_runs(
            [_tag("key", key)], RETRYABLE_STATES))
        proposed = uuid.uuid4().hex[:16]
        parameters = {"request": self._request(body, policy_path, proposed)}
        if body.suite is not None:
            parameters["suite"] = suite_parameter(body.suite)
        tags = ["evalfleet", "webhook", _tag("key", key), _tag("eval", proposed), delivery_tag,
                body_tag]
        tags += [f"train:{body.training_run_id}"] if body.training_run_id else []
        run = self._prefect(lambda: self.prefect.create_flow_run(
            parameters, f"evalfleet-{key}-{generation}", tags))
        evaluation = self._from_run(run)
        self.store.record(delivery_id, body_sha, evaluation, evaluation.id)
        if evaluation.id == proposed:
            logger.info("delivery %s: evaluation %s, flow run %s", delivery_id, evaluation.id,
                        evaluation.flow_run_id)
            return 202, self._accepted(evaluation, base_url, duplicate=None)
        duplicate = "delivery" if delivery_tag in run.tags else "cache_key"
        logger.info("delivery %s: same %s as evaluation %s", delivery_id, duplicate,
                    evaluation.id)
        return 200, self._accepted(evaluation, base_url, duplicate=duplicate)

    def _reserve(self, delivery_id: str, body_sha: str, base_url: str
                 ) -> tuple[dict[str, Any] | None, bool]:
        """Reserve the delivery id in the store before anything is fetched or created.

        Returns (the 200 answer of a delivery handled already, False), or (None, True) once
        reserved. A delivery id held for another body is a 409 at once; one held by this body
        still being handled is waited for (``pending_wait_s``), so its repeat gets the same
        answer as after it. Past the wait, (None, False): it goes on unreserved, and Prefect's
        idempotency key (the body's cache key) still makes it the same run.
        """
        deadline = time.monotonic() + self.pending_wait_s
        while True:
            held = self.store.reserve(delivery_id, body_sha)
            if held is None:
                return None, True
            evaluation_id, known_sha = held
            if known_sha != body_sha:
                raise Rejected(409, "conflict", f"delivery id {delivery_id!r} was already used "
                               "for a different body; use a new delivery id for a new request")
            if evaluation_id != PENDING:
                return self._known_delivery(delivery_id, evaluation_id, base_url), False
            if time.monotonic() >= deadline:
                logger.warning("delivery %s: still being handled after %.0f s; going on",
                               delivery_id, self.pending_wait_s)
                return None, False
            time.sleep(PENDING_POLL_S)

    def _known_delivery(self, delivery_id: str, evaluation_id: str, base_url: str
                        ) -> dict[str, Any]:
        evaluation = self.store.get(evaluation_id)
        if evaluation is None:  # the store was edited by hand
            raise Rejected(500, "internal", f"delivery {delivery_id!r} points to a missing "
                           f"evaluation {evaluation_id!r}")
        return self._accepted(evaluation, base_url, duplicate="delivery")

    @staticmethod
    def _prefect(call: Callable[[], T]) -> T:
        """Run one Prefect API call; its failures become 503 (nothing was recorded)."""
        from prefect.exceptions import ObjectNotFound

        try:
            return call()
        except (httpx.HTTPStatusError, ObjectNotFound) as err:
            # Prefect's client turns a 404 into ObjectNotFound, keeping the HTTP error.
            http = err if isinstance(err, httpx.HTTPStatusError) else err.http_exc
            response = http.response if isinstance(http, httpx.HTTPStatusError) else None
            status, text = ((response.status_code, response.text[:300]) if response is not None
                            else (404, ""))
            raise Rejected(503, "unavailable", f"Prefect refused: {status} {text}") from None
        except httpx.HTTPError as err:
            raise Rejected(503, "unavailable", f"Prefect API unreachable: {err}") from None

    @staticmethod
    def _from_run(run: FlowRun) -> Evaluation:
        request: dict[str, Any] = (run.parameters or {}).get("request") or {}
        key = next((t.split(":", 1)[1] for t in run.tags if t.startswith(_tag("key", ""))), "")
        if not request.get("request_id"):
            raise Rejected(500, "internal", f"flow run {run.id} has no evaluation request")
        return Evaluation(str(request["request_id"]), key, str(run.id), request, time.time())

    def _request(self, body: EvaluationCreate, policy_path: Path, evaluation_id: str
                 ) -> dict[str, Any]:
        cfg = self.config
        # A suite's base request: its tasks set env, env kwargs, episodes and step cap.
        task: dict[str, Any] = {} if body.env is None else dict(
            env=body.env.id, env_kwargs=body.env.kwargs, episodes=body.protocol.episodes,
            max_steps=body.protocol.max_steps)
        fields: dict[str, Any] = dict(
            **task, policy=str(policy_path), policy_factory=body.policy.factory,
            seed=body.protocol.seed, deterministic=body.protocol.deterministic, isolation=cfg.isolation,
            output=cfg.output.resolve(), mlflow_uri=cfg.mlflow_uri,
            experiment=body.experiment or cfg.experiment, training_run_id=body.training_run_id,
            step=body.step, callback_url=str(body.callback_url) if body.callback_url else None,
            request_id=evaluation_id, outcome_metric=body.outcome_metric,
        )
        fields.update(cfg.request_overrides)
        try:
            request = EvalRequest.build(**fields)
            check_training_pair(request)  # one alone: no history, no verdict, and no word of it
        except RequestError as err:
            raise Rejected(400, "invalid_request", str(err), field_name="body") from None
        return dict(request.model_dump(mode="json"))

    def _accepted(self, evaluation: Evaluation, base_url: str, duplicate: str | None
                  ) -> dict[str, Any]:
        return {
            "id": evaluation.id,
            "flow_run_id": evaluation.flow_run_id,
            "status_url": f"{base_url.rstrip('/')}/v1/evaluations/{evaluation.id}",
            "prefect_url": self.prefect.ui_url(evaluation.flow_run_id),
            "cache_key": evaluation.cache_key,
            "training_run_id": evaluation.request.get("training_run_id"),
            "step": evaluation.request.get("step"),
            "duplicate": duplicate,
        }


def check_suite_body(body: EvaluationCreate) -> None:
    """A 400 for fields of a suite body that its tasks set for themselves (as the CLI's ``--suite``).

    Accepted, each was ignored: a suite asked for 7 episodes capped at 20 ran the suite's 3 at
    the env's cap of 500, answered 202, and the ignored fields still made another idempotency key.
    """
    from evalfleet.suite import refuse_task_settings

    given = suite_sets(body)
    try:
        refuse_task_settings([repr(name) for name in given], "'suite'", "the body's suite")
    except RequestError as err:
        raise Rejected(400, "invalid_request", str(err), field_name=given[0],
                       extra={"problems": [{"field": f, "reason": str(err)} for f in given]}) from None


def suite_parameter(data: dict[str, Any]) -> dict[str, Any]:
    """The flow's ``suite`` parameter from a body's ``suite``; a bad suite is a 400 naming why."""
    from evalfleet.suite import parse_suite

    try:
        return dict(parse_suite(data, "body.suite").model_dump(mode="json"))
    except RequestError as err:
        raise Rejected(400, "invalid_request", str(err), field_name="suite") from None
