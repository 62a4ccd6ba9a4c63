"""Signed webhooks in both directions: trainer → receiver, and report → trainer's callback URL.

The scheme (Stripe-style, so a replayed body cannot be re-sent later with a fresh timestamp)::

    X-Evalfleet-Timestamp: 1767225600                    # unix seconds, when it was signed
    X-Evalfleet-Signature: sha256=<hex HMAC-SHA256(secret, b"<timestamp>.<delivery>." + body)>
    X-Evalfleet-Delivery:  <unique id of this delivery; retries reuse it>

The delivery id is signed with the body: receivers de-duplicate on it, so an unsigned one let a
captured request be replayed within the tolerance under a fresh id, as a new delivery (a new
evaluation once the first had failed, and callbacks the trainer never asked for). The split is
unambiguous: the timestamp is digits, a header value holds no line break, and a JSON body never
starts inside the id.

Reads (``GET /v1/evaluations/{id}``) carry no body; they sign the method and the resource path
instead, ``HMAC-SHA256(secret, b"<timestamp>.GET /v1/evaluations/<id>")`` (``sign_read``), so a
captured read signature opens that one evaluation for ``tolerance_s`` and nothing else; and a
JSON POST body can never equal ``GET /...``, so one kind cannot be replayed as the other.

A receiver recomputes the HMAC over the raw body bytes (never over re-serialised JSON), compares
in constant time, and rejects timestamps further than ``tolerance_s`` from its clock. Several
secrets may be accepted at once so a secret can be rotated without downtime.

Prefect-free on purpose: the receiver (``deployments/webhook/``), stage 7 and trainers share it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_result,
    stop_after_attempt,
    wait_exponential,
)

from evalfleet.egress import EgressPolicy, EgressRefused
from evalfleet.errors import EvalfleetError, RequestError
from evalfleet.redaction import redact_json
from evalfleet.storage import json_safe

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Evalfleet-Signature"
TIMESTAMP_HEADER = "X-Evalfleet-Timestamp"
DELIVERY_HEADER = "X-Evalfleet-Delivery"
EVENT_HEADER = "X-Evalfleet-Event"
SIGNATURE_PREFIX = "sha256="
#: How far a signed timestamp may be from the receiver's clock (both directions).
DEFAULT_TOLERANCE_S = 300
#: Environment variable holding the secret that signs report callbacks.
CALLBACK_SECRET_ENV = "EVALFLEET_CALLBACK_SECRET"
REPORT_EVENT = "evaluation.completed"
FAILURE_EVENT = "evaluation.failed"


class SignatureError(EvalfleetError):
    """A signed request is missing its signature, is stale, or does not verify.

    ``reason`` is one of ``missing_signature``, ``missing_timestamp``, ``malformed_timestamp``,
    ``stale_timestamp``, ``malformed_signature``, ``invalid_signature``, ``no_secret``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def signed_message(body: bytes, timestamp: int, delivery_id: str | None = None) -> bytes:
    """What is HMAC-ed: ``b"<timestamp>.<delivery>." + body``, or ``b"<timestamp>." + body``.

    POSTs (webhooks and report callbacks) carry a delivery id and sign it; reads carry none and
    sign ``read_message`` as their body.
    """
    prefix = f"{int(timestamp)}." if delivery_id is None else f"{int(timestamp)}.{delivery_id}."
    return prefix.encode() + body


def sign(body: bytes, secret: str, timestamp: int, delivery_id: str | None = None) -> str:
    """The signature header value for ``body`` (and its ``delivery_id``) signed at ``timestamp``.

    The one signing function of both directions (trainer → receiver, report → trainer).
    """
    if not secret:
        raise SignatureError("no_secret", "cannot sign with an empty secret; set one first.")
    mac = hmac.new(secret.encode(), signed_message(body, timestamp, delivery_id), hashlib.sha256)
    return SIGNATURE_PREFIX + mac.hexdigest()


def verify(
    body: bytes,
    signature: str | None,
    timestamp: str | int | None,
    secrets: str | Iterable[str],
    *,
    delivery_id: str | None = None,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> int:
    """Check a signature header against ``body``; returns the verified timestamp.

    Raises ``SignatureError`` (with a machine-readable ``reason``) on any problem. ``secrets`` may
    hold several secrets (rotation): any one of them verifying is enough. ``delivery_id`` is the
    ``X-Evalfleet-Delivery`` header of a POST (signed with the body); None for a read.
    """
    keys = [secrets] if isinstance(secrets, str) else [s for s in secrets if s]
    if not keys or not all(keys):
        raise SignatureError("no_secret", "the receiver has no secret configured to verify with.")
    if signature is None or not str(signature).strip():
        raise SignatureError("missing_signature", f"missing {SIGNATURE_HEADER} header.")
    if timestamp is None or not str(timestamp).strip():
        raise SignatureError("missing_timestamp", f"missing {TIMESTAMP_HEADER} header.")
    try:
        ts = int(str(timestamp).strip())
    except ValueError:
        raise SignatureError(
            "malformed_timestamp",
            f"{TIMESTAMP_HEADER} must be integer unix seconds (got {str(timestamp)[:40]!r}).",
        ) from None
    clock = time.time() if now is None else now
    if abs(clock - ts) > tolerance_s:
        raise SignatureError(
            "stale_timestamp",
            f"{TIMESTAMP_HEADER} {ts} is {clock - ts:+.0f} s from the receiver's clock (allowed "
            f"±{tolerance_s:.0f} s): re-sign the request now, and check both clocks.",
        )
    value = str(signature).strip()
    if not value.startswith(SIGNATURE_PREFIX):
        raise SignatureError(
            "malformed_signature",
            f"{SIGNATURE_HEADER} must look like 'sha256=<hex>' (got {value[:16]!r}...).",
        )
    for key in keys:
        if hmac.compare_digest(sign(body, key, ts, delivery_id), value):
            return ts
    signed = ("'<timestamp>.' + body" if delivery_id is None else
              f"'<timestamp>.<delivery>.' + body, with the {DELIVERY_HEADER} value sent")
    raise SignatureError(
        "invalid_signature",
        f"{SIGNATURE_HEADER} does not match the body: sign the exact bytes sent, as "
        f"HMAC-SHA256(secret, {signed}).",
    )


def read_message(method: str, path: str) -> bytes:
    """What a body-less request signs in place of a body: ``b"GET /v1/evaluations/<id>"``."""
    return f"{method.upper()} {path}".encode()


def signed_read_headers(path: str, secret: str, *, timestamp: int | None = None
                        ) -> dict[str, str]:
    """Headers for ``GET path`` (``path`` as in the URL, e.g. ``/v1/evaluations/<id>``)."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(read_message("GET", path), secret, ts)}


def signed_headers(
    body: bytes,
    secret: str,
    *,
    delivery_id: str | None = None,
    timestamp: int | None = None,
    event: str | None = None,
) -> dict[str, str]:
    """Headers for POSTing ``body``: JSON content type, timestamp, delivery id and signature.

    The signature covers the timestamp, the delivery id and the body (``sign``).
    """
    ts = int(time.time()) if timestamp is None else int(timestamp)
    delivery = delivery_id or uuid.uuid4().hex
    headers = {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: str(ts),
        SIGNATURE_HEADER: sign(body, secret, ts, delivery),
        DELIVERY_HEADER: delivery,
    }
    if event:
        headers[EVENT_HEADER] = event
    return headers


def canonical_json(data: Mapping[str, Any]) -> bytes:
    """The bytes evalfleet signs and sends for a JSON document.

    Sorted keys, no spaces, strict: a number that is not finite is null (``storage.json_safe``).
    """
    return json.dumps(json_safe(dict(data)), sort_keys=True, separators=(",", ":"), default=str,
                      allow_nan=False).encode()


@dataclass(frozen=True)
class CallbackResult:
    """What happened to one report callback."""

    url: str
    """Where the report was POSTed."""
    delivered: bool
    """True once the receiver answered 2xx."""
    attempts: int
    """HTTP attempts made (≤ the ``attempts`` asked for)."""
    status_code: int | None
    """Status of the last response, None if no response came (connection error, timeout)."""
    error: str | None
    """Why the last attempt failed, None when delivered."""
    seconds: float
    """Wall time spent, retries and back-off included."""
    delivery_id: str
    """The delivery id every attempt carried (receivers deduplicate on it)."""

    def summary(self) -> str:
        """One line for ``EvalReport.outputs['callback']``."""
        tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        if self.delivered:
            return f"delivered: HTTP {self.status_code} after {tries} ({self.seconds:.2f} s)"
        return f"failed after {tries} ({self.seconds:.2f} s): {self.error}"


@dataclass(frozen=True)
class _Attempt:
    """One POST of a report: its status (None without a response) and whether to retry."""

    status_code: int | None
    error: str | None
    retry: bool
    retry_after: float | None = None


def _outcome(state: RetryCallState) -> _Attempt:
    # Attempts never raise (failures are values), so every finished attempt has a result.
    if state.outcome is None:
        raise RuntimeError("no attempt has finished yet")
    result: _Attempt = state.outcome.result()
    return result


def _retryable(status: int) -> bool:
    # 408/429 and 5xx are the receiver saying "later"; other 4xx will not change on retry.
    return status in (408, 425, 429) or status >= 500


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: ignore it and use our own back-off


def post_report(
    url: str,
    report_json: Mapping[str, Any],
    secret: str,
    *,
    attempts: int = 5,
    backoff: float = 0.5,
    max_backoff: float = 8.0,
    timeout: float = 10.0,
    delivery_id: str | None = None,
    event: str = REPORT_EVENT,
    transport: httpx.BaseTransport | None = None,
    sleep: Callable[[float], None] = time.sleep,
    egress: EgressPolicy | None = None,
) -> CallbackResult:
    """POST ``report_json`` to ``url``, HMAC-signed, retrying with exponential back-off.

    At most ``attempts`` requests are made, each bounded by ``timeout`` seconds, with
    ``backoff * 2**i`` seconds (capped at ``max_backoff``, or the server's ``Retry-After`` within
    that cap) between them; so the whole call is bounded too. Each attempt is re-signed with a
    fresh timestamp and carries the same delivery id (default ``<request_id>:<event's last
    word>``, ``event_delivery_id``: a report and a failure notice of one request are two
    deliveries). Never raises for network or HTTP failures:
    the outcome is returned, and the caller decides what a failed callback means.

    ``url`` is checked by ``egress`` (default: ``EgressPolicy.from_env()``) before anything is
    sent: its host is resolved once and every attempt goes to that checked address. A refused
    URL makes no request at all (``attempts`` 0). Redirects are never followed.
    """
    if attempts < 1:
        raise ValueError(f"'attempts' must be >= 1 (got {attempts!r}).")
    body = canonical_json(report_json)
    delivery = delivery_id or event_delivery_id(report_json.get("request_id"), event)
    t0 = time.monotonic()
    try:
        target = (egress or EgressPolicy.from_env()).check(url)
    except EgressRefused as err:
        logger.error("callback to %s refused: %s", url, err)
        return CallbackResult(url, False, 0, None, f"refused: {err}", time.monotonic() - t0,
                              delivery)
    exponential = wait_exponential(multiplier=backoff, max=max_backoff)

    def wait(state: RetryCallState) -> float:
        # The receiver's Retry-After wins over our own back-off, within the same cap.
        hint = _outcome(state).retry_after
        return exponential(state) if hint is None else min(max_backoff, max(0.0, hint))

    def log_retry(state: RetryCallState) -> None:
        wait_s = state.next_action.sleep if state.next_action else 0.0
        logger.warning("callback to %s failed (%s); retry %d/%d in %.1f s", url,
                       _outcome(state).error, state.attempt_number, attempts - 1, wait_s)

    with httpx.Client(timeout=timeout, transport=transport, follow_redirects=False,
                      trust_env=False) as client:

        def attempt() -> _Attempt:
            try:
                headers = signed_headers(body, secret, delivery_id=delivery, event=event)
                response = client.send(target.request(client, "POST", content=body,
                                                      headers=headers))
            except httpx.HTTPError as err:
                return _Attempt(None, f"{type(err).__name__}: {err}", retry=True)
            status = response.status_code
            if 200 <= status < 300:
                return _Attempt(status, None, retry=False)
            return _Attempt(status, f"HTTP {status}: {response.text[:200]}",
                            retry=_retryable(status), retry_after=_retry_after(response))

        retrying = Retrying(stop=stop_after_attempt(attempts), wait=wait,
                            retry=retry_if_result(lambda a: a.retry), sleep=sleep,
                            before_sleep=log_retry, retry_error_callback=_outcome)
        last: _Attempt = retrying(attempt)
    made = int(retrying.statistics["attempt_number"])
    return CallbackResult(url, last.error is None, made, last.status_code, last.error,
                          time.monotonic() - t0, delivery)


def event_delivery_id(request_id: object, event: str) -> str:
    """The delivery id of one event of one evaluation: ``<request_id>:<completed|failed>``.

    Each event of a request has its own id, so a trainer de-duplicating on delivery ids (retries
    reuse them) keeps a failure notice that follows a report, and drops only true repeats. A
    report with no request id gets a random one.
    """
    if not request_id:
        return uuid.uuid4().hex
    return f"{request_id}:{event.rsplit('.', 1)[-1]}"


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        logger.warning("ignoring %s=%r (not a number); using %s", name, os.environ[name], default)
        return default


def check_callback(url: str, *, secret_env: str = CALLBACK_SECRET_ENV) -> None:
    """Stage 1's check of a request's ``callback_url``: it can be signed, and it may be reached.

    A callback that stage 7 could only skip (no secret) or refuse (the egress allow-list) is a
    result the trainer asked for and would never get: the request fails here, before anything is
    spawned, instead of ending with a line in ``outputs['callback']`` and exit 0.
    """
    if not os.environ.get(secret_env, ""):
        raise RequestError(
            f"callback_url {url!r} is set, but {secret_env} is not set in this process: the report "
            f"could not be signed, so it would never be sent. Set {secret_env} to the secret the "
            "trainer verifies with, or drop callback_url."
        )
    try:
        EgressPolicy.from_env().check(url)
    except EgressRefused as err:
        raise RequestError(
            f"callback_url {url!r} cannot be reached from here: {err}. Use a URL the egress "
            "allow-list admits, or drop callback_url."
        ) from err


def send_report_callback(
    url: str,
    report_json: Mapping[str, Any],
    *,
    secret_env: str = CALLBACK_SECRET_ENV,
    attempts: int | None = None,
    backoff: float | None = None,
    event: str = REPORT_EVENT,
) -> str:
    """Stage 7's callback: sign with the secret from ``secret_env`` and POST; never raises.

    ``event`` goes in the ``X-Evalfleet-Event`` header: ``evaluation.completed`` for a report,
    ``evaluation.failed`` for a run that ended without one.

    Returns the line recorded in ``EvalReport.outputs['callback']``. A missing secret means no
    callback at all (an unsigned report would teach trainers to accept unsigned reports).
    Its delivery id is ``event_delivery_id(report_json['request_id'], event)``.
    ``attempts`` and ``backoff`` default to ``$EVALFLEET_CALLBACK_ATTEMPTS`` (5) and
    ``$EVALFLEET_CALLBACK_BACKOFF`` (0.5 s, doubling per retry).
    """
    if attempts is None:
        attempts = max(1, int(_env_number("EVALFLEET_CALLBACK_ATTEMPTS", 5)))
    if backoff is None:
        backoff = max(0.0, _env_number("EVALFLEET_CALLBACK_BACKOFF", 0.5))
    secret = os.environ.get(secret_env, "")
    if not secret:
        logger.error("callback to %s not sent: %s is not set", url, secret_env)
        return f"not sent: {secret_env} is not set (the report is in report.json and MLflow)"
    try:
        # Whatever the body holds (a report, a failed run's message), no secret value leaves.
        result = post_report(url, redact_json(dict(report_json)), secret, attempts=attempts,
                             backoff=backoff, event=event)
    except Exception as err:  # a failing callback must never fail the evaluation
        logger.exception("callback to %s failed", url)
        return f"failed: {type(err).__name__}: {err}"
    if not result.delivered:
        logger.error("callback to %s %s; the report stays in report.json and MLflow",
                     url, result.summary())
    return result.summary()


__all__ = [
    "CALLBACK_SECRET_ENV",
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "FAILURE_EVENT",
    "REPORT_EVENT",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "CallbackResult",
    "SignatureError",
    "canonical_json",
    "check_callback",
    "event_delivery_id",
    "post_report",
    "send_report_callback",
    "read_message",
    "sign",
    "signed_headers",
    "signed_message",
    "signed_read_headers",
    "verify",
]
