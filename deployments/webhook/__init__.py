"""The webhook receiver: signed training webhooks in, Prefect flow runs out.

``POST /v1/evaluations`` (body: ``EvaluationCreate``; headers: ``X-Evalfleet-Timestamp``,
``X-Evalfleet-Signature``, ``X-Evalfleet-Delivery``, see ``evalfleet.callback``; the signature
covers ``b"<timestamp>.<delivery>." + body``)::

    401  signature missing, invalid or stale          {"error": "unauthorized", "reason": ...}
    400  body not JSON or not the schema              {"error": "invalid_request", "field", "reason"}
    409  delivery id reused for a different body (on any receiver sharing the Prefect server)
    413  body too large
    503  Prefect unreachable (retry later; nothing was recorded)
    202  new evaluation: {"id", "flow_run_id", "status_url", "state", "duplicate": null}
    200  duplicate delivery, or same cache key as a live evaluation: the same evaluation,
         "duplicate": "delivery" | "cache_key"; never a second run. The report goes to the
         first delivery's callback URL; later duplicates read it from the status URL.
         A cache key whose evaluation FAILED, CRASHED or was CANCELLED may run again.

``GET /v1/evaluations/{id}`` gives the flow run's state and, once completed, the report (also
the report of a run that ended FAILED or CRASHED after writing it, ``report_from_failed_run``
true); it needs the same secret: ``X-Evalfleet-Timestamp`` and ``X-Evalfleet-Signature`` over
``b"<timestamp>.GET /v1/evaluations/<id>"`` (``evalfleet.callback.signed_read_headers``), 401
otherwise. ``GET /healthz`` says whether the receiver, its SQLite store and Prefect answer.

Prefect's idempotency keys decide what is a new flow run (see ``Receiver``), so receivers behind
one load balancer never start two runs for one delivery or one live cache key; a small SQLite
file remembers this receiver's answers. ``policy.uri`` and ``callback_url`` may only reach hosts
the egress policy allows (``evalfleet.egress``: public https by default, private and loopback
targets only when allow-listed, checked on the resolved address the connection then uses);
policies are streamed, size-capped and hashed into a content-addressed folder, so the file a flow
run loads is exactly the one the trainer hashed. Run with ``python -m deployments.webhook`` or
``evalfleet serve``. Several receivers share one Prefect server, and need the same ``--output``
and ``--state-dir`` storage (the flow run reads the policy copy from the receiver that made it).

One module per idea: ``schema`` (the body, its parsing, the error answer), ``store`` (SQLite
memory of answers), ``policy_copy`` (content-addressed policy copies), ``flow_runs`` (Prefect,
through its own client), ``receiver`` (the logic), ``app`` (FastAPI) and ``cli`` (options).
"""

from __future__ import annotations

from deployments.webhook.app import create_app
from deployments.webhook.cli import (
    add_egress_options,
    build_parser,
    config_from_args,
    egress_from_args,
    main,
)
from deployments.webhook.flow_runs import FINAL_STATES, RETRYABLE_STATES, PrefectAPI
from deployments.webhook.policy_copy import fetch_policy
from deployments.webhook.receiver import Receiver, ReceiverConfig
from deployments.webhook.schema import (
    EnvRef,
    EvalProtocol,
    EvaluationCreate,
    PolicyRef,
    Rejected,
    idempotency_key,
    parse_body,
)
from deployments.webhook.store import Evaluation, EvaluationStore

__all__ = [
    "FINAL_STATES",
    "RETRYABLE_STATES",
    "EnvRef",
    "EvalProtocol",
    "Evaluation",
    "EvaluationCreate",
    "EvaluationStore",
    "PolicyRef",
    "PrefectAPI",
    "Receiver",
    "ReceiverConfig",
    "Rejected",
    "add_egress_options",
    "build_parser",
    "config_from_args",
    "create_app",
    "egress_from_args",
    "fetch_policy",
    "idempotency_key",
    "main",
    "parse_body",
]
