"""The webhook receiver: signed training webhooks in, Prefect flow runs out.

``POST /v1/evaluations`` (body: ``EvaluationCreate``; headers: ``X-Evalfleet-Timestamp``,
``X-Evalfleet-Signature``, ``X-Evalfleet-Delivery``, see ``evalfleet.callback``)::

    401  signature missing, invalid or stale          {"error": "unauthorized", "reason": ...}
    400  body not JSON or not the schema              {"error": "invalid_request", "field", "reason"}
    409  delivery id reused for a different body
    413  body too large
    503  Prefect unreachable (retry later; nothing was recorded)
    202  new evaluation: {"id", "flow_run_id", "status_url", "state", "duplicate": null}
    200  duplicate delivery, or same cache key as a live evaluation: the same evaluation,
         "duplicate": "delivery" | "cache_key"; never a second run. The report goes to the
         first delivery's callback URL; later duplicates read it from the status URL.
         A cache key whose evaluation FAILED, CRASHED or was CANCELLED may run again.

``GET /v1/evaluations/{id}`` gives the flow run's state and, once completed, the report.
``GET /healthz`` says whether the receiver, its SQLite store and Prefect answer.

Delivery ids and cache keys map to evaluations in a small SQLite file; policies are copied into a
content-addressed folder after their sha256 is checked, so the file a flow run loads is exactly
the one the trainer hashed. Run with ``python -m deployments.webhook`` or ``evalfleet serve``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from deployments import (
    DEPLOYMENT,
    WEBHOOK_PREVIOUS_SECRET_ENV,
    WEBHOOK_SECRET_ENV,
    resolve_secret,
)
from evalfleet.callback import (
    DEFAULT_TOLERANCE_S,
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    canonical_json,
    verify,
)
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.storage import run_dir

logger = logging.getLogger("evalfleet.webhook")

#: Prefect state types after which a flow run will not change any more.
FINAL_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
#: States whose evaluation a new delivery with the same cache key may replace.
RETRYABLE_STATES = ("FAILED", "CRASHED", "CANCELLED")


# ------------------------------------------------------------------------------------- schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicyRef(_Strict):
    """Where the policy bytes are and what they hash to."""

    uri: str = Field(min_length=1, description="file:///abs/path, an absolute path, or http(s)://.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Lower-case hex sha256 of the bytes.")
    factory: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'module:function' building the nn.Module when the bytes are a state_dict.",
    )


class EnvRef(_Strict):
    """The evaluation environment."""

    id: str = Field(min_length=1, description="Gymnasium id ('module:EnvId-v0' imports module).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Kwargs for gym.make.")


class EvalProtocol(_Strict):
    """What makes two evaluations comparable: same protocol, same numbers."""

    episodes: int = Field(100, gt=0, le=100_000, description="Episodes (indices 0..episodes-1).")
    seed: int = Field(0, ge=0, description="Base seed of the seed ledger.")
    max_steps: int | None = Field(None, gt=0, description="Step cap; None = the env's own.")
    deterministic: bool = Field(True, description="argmax actions (True) or sampled (False).")


class EvaluationCreate(_Strict):
    """Body of ``POST /v1/evaluations``."""

    policy: PolicyRef
    env: EnvRef
    protocol: EvalProtocol = Field(default_factory=lambda: EvalProtocol.model_validate({}))
    training_run_id: str | None = Field(None, max_length=256, description="Trainer's run id.")
    step: int | None = Field(None, ge=0, description="Training step of these weights.")
    callback_url: AnyHttpUrl | None = Field(None, description="Where the signed report is POSTed.")
    experiment: str | None = Field(None, max_length=256, description="MLflow experiment override.")


def idempotency_key(body: EvaluationCreate) -> str:
    """sha256 over what the trainer said fixes an evaluation's numbers (episodes included).

    Two deliveries with the same key are the same evaluation. It is computed from the body
    alone, so the receiver needs neither torch nor the env's package. ``evalfleet.cache``'s key
    is finer (env spec and package versions, policy output kind) but needs stage 1 to load the
    env and policy; the flow applies it anyway, so a run that slips past this key still reuses
    cached episodes instead of recomputing them.
    """
    doc = {
        "policy_sha256": body.policy.sha256,
        "policy_factory": body.policy.factory,
        "env": body.env.id,
        "env_kwargs": body.env.kwargs,
        "seed": body.protocol.seed,
        "episodes": body.protocol.episodes,
        "max_steps": body.protocol.max_steps,
        "deterministic": body.protocol.deterministic,
    }
    return hashlib.sha256(canonical_json(doc)).hexdigest()


class Rejected(Exception):
    """An HTTP error answer, raised inside the handler and rendered as JSON."""

    def __init__(self, status: int, error: str, reason: str, *, field_name: str | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.body: dict[str, Any] = {"error": error, "reason": reason}
        if field_name is not None:
            self.body["field"] = field_name
        self.body.update(extra or {})


def parse_body(raw: bytes) -> EvaluationCreate:
    """JSON → ``EvaluationCreate``; every problem becomes a 400 naming the field and the reason."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise Rejected(400, "invalid_request", f"body is not JSON: {err}", field_name="body") from None
    try:
        return EvaluationCreate.model_validate(data)
    except ValidationError as err:
        problems = [
            {"field": ".".join(str(p) for p in e["loc"]) or "body", "reason": e["msg"]}
            for e in err.errors()
        ]
        first = problems[0]
        raise Rejected(400, "invalid_request", first["reason"], field_name=first["field"],
                       extra={"problems": problems}) from None


# -------------------------------------------------------------------------------------- store


@dataclass(frozen=True)
class Evaluation:
    """One row of the store: an evaluation and the flow run doing it."""

    id: str
    cache_key: str
    flow_run_id: str
    request: dict[str, Any]
    created_at: float


class EvaluationStore:
    """Delivery ids and cache keys → evaluations, in SQLite (one writer: this receiver)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._lock = threading.Lock()
        with self._lock:
            self._db.executescript(
                """
                CREATE TABLE IF NOT EXISTS evaluations (
                    id TEXT PRIMARY KEY, cache_key TEXT NOT NULL, flow_run_id TEXT NOT NULL,
                    request TEXT NOT NULL, created_at REAL NOT NULL);
                CREATE INDEX IF NOT EXISTS evaluations_by_key ON evaluations (cache_key);
                CREATE TABLE IF NOT EXISTS deliveries (
                    delivery_id TEXT PRIMARY KEY, evaluation_id TEXT NOT NULL,
                    body_sha256 TEXT NOT NULL, received_at REAL NOT NULL);
                """
            )

    def delivery(self, delivery_id: str) -> tuple[str, str] | None:
        """(evaluation id, body sha256) of a known delivery."""
        with self._lock:
            row = self._db.execute(
                "SELECT evaluation_id, body_sha256 FROM deliveries WHERE delivery_id = ?",
                (delivery_id,),
            ).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def by_cache_key(self, key: str) -> list[Evaluation]:
        """Evaluations with this cache key, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, cache_key, flow_run_id, request, created_at FROM evaluations "
                "WHERE cache_key = ? ORDER BY created_at DESC", (key,),
            ).fetchall()
        return [Evaluation(r[0], r[1], r[2], json.loads(r[3]), r[4]) for r in rows]

    def get(self, evaluation_id: str) -> Evaluation | None:
        """The evaluation with this id."""
        with self._lock:
            r = self._db.execute(
                "SELECT id, cache_key, flow_run_id, request, created_at FROM evaluations "
                "WHERE id = ?", (evaluation_id,),
            ).fetchone()
        return Evaluation(r[0], r[1], r[2], json.loads(r[3]), r[4]) if r else None

    def record(self, delivery_id: str, body_sha256: str, evaluation: Evaluation | None,
               evaluation_id: str) -> None:
        """Insert the delivery (and the evaluation if new) in one transaction."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if evaluation is not None:
                    self._db.execute(
                        "INSERT INTO evaluations VALUES (?, ?, ?, ?, ?)",
                        (evaluation.id, evaluation.cache_key, evaluation.flow_run_id,
                         json.dumps(evaluation.request), evaluation.created_at),
                    )
                self._db.execute("INSERT INTO deliveries VALUES (?, ?, ?, ?)",
                                 (delivery_id, evaluation_id, body_sha256, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def ping(self) -> bool:
        """True when the database answers."""
        with self._lock:
            return bool(self._db.execute("SELECT 1").fetchone() == (1,))

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()


# ------------------------------------------------------------------------------------ prefect


class PrefectAPI:
    """The three calls the receiver makes to a Prefect server's REST API."""

    def __init__(self, api_url: str, deployment: str = DEPLOYMENT, timeout: float = 10.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.deployment = deployment
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout)
        self._deployment_id: str | None = None

    def healthy(self) -> bool:
        """True when the server answers its health check."""
        try:
            return bool(self._http.get("/health").status_code == 200)
        except httpx.HTTPError:
            return False

    def deployment_id(self) -> str:
        """The deployment's id (looked up once)."""
        if self._deployment_id is None:
            flow_name, name = self.deployment.split("/")
            response = self._http.get(f"/deployments/name/{flow_name}/{name}")
            response.raise_for_status()
            self._deployment_id = str(response.json()["id"])
        return self._deployment_id

    def create_flow_run(self, parameters: dict[str, Any], idempotency_key: str,
                        tags: list[str], attempts: int = 4) -> str:
        """Create a flow run of the deployment; the server de-duplicates on ``idempotency_key``.

        Retried (bounded) on 5xx and connection errors: a busy server's SQLite answers 503
        now and then, and the idempotency key makes a retry safe even if the first call landed.
        """
        url = f"/deployments/{self.deployment_id()}/create_flow_run"
        body = {"parameters": parameters, "idempotency_key": idempotency_key, "tags": tags}
        for attempt in range(attempts - 1):
            try:
                response = self._http.post(url, json=body)
                if response.status_code < 500:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25 * 2**attempt)
        else:
            response = self._http.post(url, json=body)
        response.raise_for_status()
        return str(response.json()["id"])

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        """The flow run as the API returns it."""
        response = self._http.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def ui_url(self, flow_run_id: str) -> str:
        """Link to the flow run in the Prefect UI served next to the API."""
        return f"{self.api_url.removesuffix('/api')}/runs/flow-run/{flow_run_id}"

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()


# ----------------------------------------------------------------------------------- receiver


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
    max_policy_bytes: int = 2 * 1024**3
    """Larger policy files are refused."""
    request_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``EvalRequest`` fields for every evaluation (e.g. concurrency)."""


def fetch_policy(ref: PolicyRef, folder: Path, max_bytes: int) -> Path:
    """Copy the policy at ``ref.uri`` into ``folder/<sha256>.pt`` after checking its sha256."""
    parts = urlsplit(ref.uri)
    if parts.scheme in ("", "file"):
        path = Path(unquote(parts.path) if parts.scheme else ref.uri)
        if not path.is_absolute():
            raise Rejected(400, "invalid_request", f"a file policy URI must be absolute (got "
                           f"{ref.uri!r})", field_name="policy.uri")
        try:
            size = path.stat().st_size
            if size > max_bytes:
                raise Rejected(400, "invalid_request", f"policy is {size} bytes, more than the "
                               f"{max_bytes} allowed", field_name="policy.uri")
            blob = path.read_bytes()
        except OSError as err:
            raise Rejected(400, "invalid_request", f"cannot read {str(path)!r}: "
                           f"{err.strerror or err}", field_name="policy.uri") from None
    elif parts.scheme in ("http", "https"):
        try:
            with httpx.stream("GET", ref.uri, timeout=30, follow_redirects=True) as response:
                response.raise_for_status()
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise Rejected(400, "invalid_request", f"policy is more than the "
                                       f"{max_bytes} bytes allowed", field_name="policy.uri")
                    chunks.append(chunk)
                blob = b"".join(chunks)
        except httpx.HTTPError as err:
            raise Rejected(400, "invalid_request", f"cannot download {ref.uri!r}: {err}",
                           field_name="policy.uri") from None
    else:
        raise Rejected(400, "invalid_request", f"unsupported URI scheme {parts.scheme!r}; use "
                       "file:// (storage shared with the service) or http(s)://",
                       field_name="policy.uri")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != ref.sha256:
        raise Rejected(400, "invalid_request", f"sha256 of the bytes at policy.uri is {digest}, "
                       f"not {ref.sha256}: the file changed or the hash is wrong",
                       field_name="policy.sha256")
    dest = folder / f"{digest}.pt"
    if not dest.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, dest)  # concurrent writers of the same hash write the same bytes
    return dest


class Receiver:
    """The receiver's logic, independent of the HTTP framework (``create_app`` wires it)."""

    def __init__(self, config: ReceiverConfig, prefect: PrefectAPI | None = None) -> None:
        if not config.secrets or not all(config.secrets):
            raise RuntimeError(
                f"no webhook secret: set {WEBHOOK_SECRET_ENV} (or pass --secret-block NAME of a "
                "Prefect Secret block); the receiver refuses to run unauthenticated."
            )
        self.config = config
        self.store = EvaluationStore(config.state_dir / "webhook.sqlite")
        self.prefect = prefect or PrefectAPI(config.prefect_api_url, config.deployment)
        self._lock = threading.Lock()  # one delivery decided at a time: no double runs

    def create(self, raw: bytes, headers: dict[str, str], base_url: str
               ) -> tuple[int, dict[str, Any]]:
        """Handle one delivery; returns (status, JSON body) or raises ``Rejected``."""
        try:
            verify(raw, headers.get(SIGNATURE_HEADER.lower()), headers.get(TIMESTAMP_HEADER.lower()),
                   self.config.secrets, tolerance_s=self.config.tolerance_s)
        except SignatureError as err:
            raise Rejected(401, "unauthorized", str(err), extra={"code": err.reason}) from None
        delivery_id = (headers.get(DELIVERY_HEADER.lower()) or "").strip()
        if not delivery_id or len(delivery_id) > 200:
            raise Rejected(400, "invalid_request", "a unique delivery id (≤ 200 characters) is "
                           "required; retries must reuse it", field_name=DELIVERY_HEADER)
        body = parse_body(raw)
        body_sha = hashlib.sha256(raw).hexdigest()
        if (known := self._known_delivery(delivery_id, body_sha, base_url)) is not None:
            return 200, known
        policy_path = fetch_policy(body.policy, self.config.state_dir / "policies",
                                   self.config.max_policy_bytes)
        key = idempotency_key(body)
        with self._lock:
            if (known := self._known_delivery(delivery_id, body_sha, base_url)) is not None:
                return 200, known
            live = self._live_evaluation(key)
            if live is not None:
                self.store.record(delivery_id, body_sha, None, live.id)
                logger.info("delivery %s: same cache key as evaluation %s", delivery_id, live.id)
                return 200, self._accepted(live, base_url, duplicate="cache_key")
            evaluation = self._start(body, policy_path, key)
            self.store.record(delivery_id, body_sha, evaluation, evaluation.id)
        logger.info("delivery %s: evaluation %s, flow run %s", delivery_id, evaluation.id,
                    evaluation.flow_run_id)
        return 202, self._accepted(evaluation, base_url, duplicate=None)

    def status(self, evaluation_id: str, base_url: str) -> dict[str, Any]:
        """State of an evaluation and, once completed, its report."""
        evaluation = self.store.get(evaluation_id)
        if evaluation is None:
            raise Rejected(404, "not_found", f"no evaluation {evaluation_id!r}")
        out = self._accepted(evaluation, base_url, duplicate=None)
        out.pop("duplicate")
        try:
            run = self.prefect.flow_run(evaluation.flow_run_id)
        except httpx.HTTPError as err:
            raise Rejected(503, "unavailable", f"Prefect API unreachable: {err}") from None
        state = run.get("state") or {}
        out.update(state=state.get("type"), state_name=state.get("name"),
                   message=state.get("message"), final=state.get("type") in FINAL_STATES,
                   report=None)
        if state.get("type") == "COMPLETED":
            path = run_dir(Path(evaluation.request["output"]), evaluation.id) / "report.json"
            try:
                out["report"] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                out["message"] = f"completed, but the report cannot be read from {path}: {err}"
        return out

    def healthy(self) -> dict[str, bool]:
        """Whether the store and Prefect answer."""
        return {"store": self.store.ping(), "prefect": self.prefect.healthy()}

    def close(self) -> None:
        """Release the store and the HTTP client."""
        self.store.close()
        self.prefect.close()

    # -- internals ---------------------------------------------------------------------------

    def _known_delivery(self, delivery_id: str, body_sha: str, base_url: str
                        ) -> dict[str, Any] | None:
        known = self.store.delivery(delivery_id)
        if known is None:
            return None
        evaluation_id, known_sha = known
        if known_sha != body_sha:
            raise Rejected(409, "conflict", f"delivery id {delivery_id!r} was already used for a "
                           "different body; use a new delivery id for a new request")
        evaluation = self.store.get(evaluation_id)
        if evaluation is None:  # the store was edited by hand
            raise Rejected(500, "internal", f"delivery {delivery_id!r} points to a missing "
                           f"evaluation {evaluation_id!r}")
        return self._accepted(evaluation, base_url, duplicate="delivery")

    def _live_evaluation(self, key: str) -> Evaluation | None:
        for evaluation in self.store.by_cache_key(key):
            try:
                state = (self.prefect.flow_run(evaluation.flow_run_id).get("state") or {})
            except httpx.HTTPStatusError as err:
                if err.response.status_code == 404:
                    continue  # the Prefect database was reset: that run is gone
                raise Rejected(503, "unavailable", f"Prefect API error: {err}") from None
            except httpx.HTTPError as err:
                raise Rejected(503, "unavailable", f"Prefect API unreachable: {err}") from None
            if state.get("type") not in RETRYABLE_STATES:
                return evaluation
        return None

    def _start(self, body: EvaluationCreate, policy_path: Path, key: str) -> Evaluation:
        evaluation_id = uuid.uuid4().hex[:16]
        cfg = self.config
        fields: dict[str, Any] = dict(
            env=body.env.id, env_kwargs=body.env.kwargs, policy=str(policy_path),
            policy_factory=body.policy.factory, episodes=body.protocol.episodes,
            seed=body.protocol.seed, max_steps=body.protocol.max_steps,
            deterministic=body.protocol.deterministic, isolation=cfg.isolation,
            output=cfg.output.resolve(), mlflow_uri=cfg.mlflow_uri,
            experiment=body.experiment or cfg.experiment, training_run_id=body.training_run_id,
            step=body.step, callback_url=str(body.callback_url) if body.callback_url else None,
            request_id=evaluation_id,
        )
        fields.update(cfg.request_overrides)
        try:
            request = EvalRequest.build(**fields)
        except RequestError as err:
            raise Rejected(400, "invalid_request", str(err), field_name="body") from None
        parameters = {"request": request.model_dump(mode="json")}
        tags = ["evalfleet", "webhook"] + ([f"train:{body.training_run_id}"]
                                           if body.training_run_id else [])
        try:
            flow_run_id = self.prefect.create_flow_run(parameters, f"evalfleet-{evaluation_id}",
                                                       tags)
        except httpx.HTTPStatusError as err:
            raise Rejected(503, "unavailable", f"Prefect refused the flow run: "
                           f"{err.response.status_code} {err.response.text[:300]}") from None
        except httpx.HTTPError as err:
            raise Rejected(503, "unavailable", f"Prefect API unreachable: {err}") from None
        return Evaluation(evaluation_id, key, flow_run_id, parameters["request"], time.time())

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


def create_app(config: ReceiverConfig, prefect: PrefectAPI | None = None) -> FastAPI:
    """The FastAPI app around a ``Receiver``."""
    receiver = Receiver(config, prefect)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        receiver.close()

    app = FastAPI(title="evalfleet webhook receiver", version="1", lifespan=lifespan)
    app.state.receiver = receiver

    def _json(status: int, body: dict[str, Any]) -> JSONResponse:
        headers = {"Retry-After": "5"} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.post("/v1/evaluations")
    async def create_evaluation(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            return _json(413, {"error": "too_large", "reason": f"body over "
                               f"{config.max_body_bytes} bytes"})
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            return _json(413, {"error": "too_large", "reason": f"body over "
                               f"{config.max_body_bytes} bytes"})
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            status, body = await run_in_threadpool(receiver.create, raw, headers,
                                                    str(request.base_url))
        except Rejected as err:
            return _json(err.status, err.body)
        return _json(status, body)

    @app.get("/v1/evaluations/{evaluation_id}")
    async def get_evaluation(evaluation_id: str, request: Request) -> JSONResponse:
        try:
            body = await run_in_threadpool(receiver.status, evaluation_id, str(request.base_url))
        except Rejected as err:
            return _json(err.status, err.body)
        return _json(200, body)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        checks = await run_in_threadpool(receiver.healthy)
        return _json(200 if all(checks.values()) else 503, {"ok": all(checks.values()), **checks})

    return app


def build_parser() -> argparse.ArgumentParser:
    """Options of ``python -m deployments.webhook``."""
    p = argparse.ArgumentParser(
        prog="python -m deployments.webhook",
        description=f"Webhook receiver in front of Prefect. Secret: ${WEBHOOK_SECRET_ENV} (and "
        f"${WEBHOOK_PREVIOUS_SECRET_ENV} during a rotation) or --secret-block.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--prefect-api-url", default=os.environ.get("PREFECT_API_URL"),
                   help="Prefect API (default: $PREFECT_API_URL)")
    p.add_argument("--deployment", default=DEPLOYMENT, help="flow-name/deployment-name to trigger")
    p.add_argument("--state-dir", default=".evalfleet", help="SQLite store and policy copies")
    p.add_argument("--output", default="results", help="results folder of the evaluations")
    p.add_argument("--mlflow-uri", default=None, help="MLflow URI (default under --output)")
    p.add_argument("--experiment", default="evalfleet", help="default MLflow experiment")
    p.add_argument("--isolation", default="auto", help="inprocess | process | bwrap | auto")
    p.add_argument("--secret-block", default=None, help="Prefect Secret block with the secret")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> ReceiverConfig:
    """A ``ReceiverConfig`` from parsed options and the environment."""
    if not args.prefect_api_url:
        raise SystemExit("evalfleet webhook: no Prefect API; pass --prefect-api-url or set "
                         "PREFECT_API_URL (the receiver never starts a temporary server).")
    os.environ["PREFECT_API_URL"] = args.prefect_api_url  # for a Secret block lookup
    secrets = tuple(s for s in (resolve_secret(WEBHOOK_SECRET_ENV, args.secret_block),
                                os.environ.get(WEBHOOK_PREVIOUS_SECRET_ENV, "")) if s)
    return ReceiverConfig(
        secrets=secrets, prefect_api_url=args.prefect_api_url, state_dir=Path(args.state_dir),
        output=Path(args.output).resolve(), deployment=args.deployment,
        mlflow_uri=args.mlflow_uri, experiment=args.experiment, isolation=args.isolation,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the receiver with uvicorn until interrupted."""
    import uvicorn

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config_from_args(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
