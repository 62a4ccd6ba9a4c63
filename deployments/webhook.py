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

``GET /v1/evaluations/{id}`` gives the flow run's state and, once completed, the report; it needs
the same secret: ``X-Evalfleet-Timestamp`` and ``X-Evalfleet-Signature`` over
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
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
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
    read_message,
    verify,
)
from evalfleet.egress import (
    ALLOWED_HOSTS_ENV,
    DEFAULT_MAX_DOWNLOAD_BYTES,
    PUBLIC_ENV,
    DownloadError,
    EgressPolicy,
    EgressRefused,
    download,
)
from evalfleet.errors import RequestError
from evalfleet.models import EvalRequest
from evalfleet.storage import run_dir

logger = logging.getLogger("evalfleet.webhook")
T = TypeVar("T")

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
    """Delivery ids and cache keys → evaluations, in SQLite: this receiver's memory of answers.

    Not what keeps runs unique: Prefect's idempotency keys do that across receivers. The store
    answers repeated deliveries without a round trip and detects a delivery id reused for a
    different body.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._lock = threading.Lock()  # one connection, shared by the threadpool
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
                        "INSERT OR IGNORE INTO evaluations VALUES (?, ?, ?, ?, ?)",
                        (evaluation.id, evaluation.cache_key, evaluation.flow_run_id,
                         json.dumps(evaluation.request), evaluation.created_at),
                    )
                self._db.execute("INSERT OR IGNORE INTO deliveries VALUES (?, ?, ?, ?)",
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
                        tags: list[str], attempts: int = 4) -> dict[str, Any]:
        """Create a flow run of the deployment; the server de-duplicates on ``idempotency_key``.

        Returns the flow run: the new one, or the one an earlier call (from any process) created
        with the same key, its parameters and tags included. Retried (bounded) on 5xx and
        connection errors: a busy server's SQLite answers 503 now and then, and the idempotency
        key makes a retry safe even if the first call landed.
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
        run: dict[str, Any] = response.json()
        return run

    def _run_filter(self, tags: list[str], states: tuple[str, ...] | None) -> dict[str, Any]:
        runs: dict[str, Any] = {"tags": {"all_": tags}}
        if states is not None:
            runs["state"] = {"type": {"any_": list(states)}}
        return {"flow_runs": runs, "deployments": {"id": {"any_": [self.deployment_id()]}}}

    def count_flow_runs(self, tags: list[str], states: tuple[str, ...] | None = None) -> int:
        """Flow runs of the deployment carrying every tag in ``tags`` (and in ``states``)."""
        response = self._http.post("/flow_runs/count", json=self._run_filter(tags, states))
        response.raise_for_status()
        return int(response.json())

    def find_flow_run(self, tags: list[str]) -> dict[str, Any] | None:
        """The oldest flow run of the deployment carrying every tag in ``tags``, if any."""
        response = self._http.post("/flow_runs/filter", json={
            **self._run_filter(tags, None), "sort": "EXPECTED_START_TIME_ASC", "limit": 1})
        response.raise_for_status()
        runs: list[dict[str, Any]] = response.json()
        return runs[0] if runs else None

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
    max_policy_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES
    """Larger policy files are refused (downloads stop at this many bytes)."""
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    """Which ``policy.uri`` and ``callback_url`` hosts requests may make the service reach."""
    policy_roots: tuple[Path, ...] = ()
    """Folders ``file://`` policy URIs must lie under (symlinks resolved); empty: any path."""
    request_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``EvalRequest`` fields for every evaluation (e.g. concurrency)."""


def fetch_policy(ref: PolicyRef, folder: Path, max_bytes: int,
                 egress: EgressPolicy | None = None, roots: tuple[Path, ...] = ()) -> Path:
    """Copy the policy at ``ref.uri`` into ``folder/<sha256>.pt``, hashing while it streams.

    http(s) URIs go through ``egress`` (default: public https only): the host is resolved once
    and checked, each redirect hop too, and the transfer stops past ``max_bytes``. Nothing lands
    under its final name unless the sha256 matches ``ref.sha256``. File URIs must lie under one
    of ``roots`` when any are given.
    """
    parts = urlsplit(ref.uri)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as sink:
            if parts.scheme in ("", "file"):
                digest = _copy_file(ref.uri, parts.path if parts.scheme else ref.uri, sink,
                                    max_bytes, roots)
            elif parts.scheme in ("http", "https"):
                try:
                    digest, _ = download(ref.uri, egress or EgressPolicy(), sink,
                                         max_bytes=max_bytes)
                except (EgressRefused, DownloadError) as err:
                    raise Rejected(400, "invalid_request", f"policy.uri refused: {err}",
                                   field_name="policy.uri") from None
            else:
                raise Rejected(400, "invalid_request", f"unsupported URI scheme "
                               f"{parts.scheme!r}; use file:// (storage shared with the "
                               "service) or http(s)://", field_name="policy.uri")
        if digest != ref.sha256:
            raise Rejected(400, "invalid_request", f"sha256 of the bytes at policy.uri is "
                           f"{digest}, not {ref.sha256}: the file changed or the hash is wrong",
                           field_name="policy.sha256")
        dest = folder / f"{digest}.pt"
        os.replace(tmp, dest)  # concurrent writers of the same hash write the same bytes
        return dest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copy_file(uri: str, raw_path: str, sink: Any, max_bytes: int,
               roots: tuple[Path, ...]) -> str:
    path = Path(unquote(raw_path))
    if not path.is_absolute():
        raise Rejected(400, "invalid_request", f"a file policy URI must be absolute (got "
                       f"{uri!r})", field_name="policy.uri")
    real = path.resolve()  # a symlink or '..' must not lead out of the roots
    if roots and not any(real.is_relative_to(root.resolve()) for root in roots):
        raise Rejected(400, "invalid_request", f"{str(path)!r} is outside the folders file "
                       f"policy URIs may name ({', '.join(str(r) for r in roots)}); put the "
                       "policy there or send an https:// URI", field_name="policy.uri")
    digest, size = hashlib.sha256(), 0
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise Rejected(400, "invalid_request", f"policy is more than the "
                                   f"{max_bytes} bytes allowed", field_name="policy.uri")
                digest.update(chunk)
                sink.write(chunk)
    except OSError as err:
        raise Rejected(400, "invalid_request", f"cannot read {str(path)!r}: "
                       f"{err.strerror or err}", field_name="policy.uri") from None
    return digest.hexdigest()


def _tag(kind: str, value: str) -> str:
    # Tags are how any receiver finds a run in Prefect; delivery ids are hashed (any text).
    return f"evalfleet-{kind}:{value}"


class Receiver:
    """The receiver's logic, independent of the HTTP framework (``create_app`` wires it).

    Prefect decides what is a new run, so several receivers behind one load balancer (each
    with its own store) still start one flow run per delivery and per live cache key: the
    flow run is created with idempotency key ``evalfleet-<cache key>-<generation>``, where the
    generation counts this deployment's runs of that cache key that ended FAILED, CRASHED or
    CANCELLED. Concurrent deliveries of one evaluation compute the same key and get the same
    run back from the server; once a run failed, the next delivery gets a new generation and
    a new run; a COMPLETED run keeps answering for its cache key. Every run carries tags with
    its evaluation id, cache key and first delivery id, so any receiver can answer a status
    request or a redelivery for a run another one created.
    """

    def __init__(self, config: ReceiverConfig, prefect: PrefectAPI | None = None) -> None:
        if not config.secrets or not all(config.secrets):
            raise RuntimeError(
                f"no webhook secret: set {WEBHOOK_SECRET_ENV} (or pass --secret-block NAME of a "
                "Prefect Secret block); the receiver refuses to run unauthenticated."
            )
        self.config = config
        self.store = EvaluationStore(config.state_dir / "webhook.sqlite")
        self.prefect = prefect or PrefectAPI(config.prefect_api_url, config.deployment)

    def authenticate(self, message: bytes, headers: dict[str, str]) -> None:
        """Check the HMAC headers over ``message``; raises a 401 ``Rejected``."""
        try:
            verify(message, headers.get(SIGNATURE_HEADER.lower()),
                   headers.get(TIMESTAMP_HEADER.lower()), self.config.secrets,
                   tolerance_s=self.config.tolerance_s)
        except SignatureError as err:
            raise Rejected(401, "unauthorized", str(err), extra={"code": err.reason}) from None

    def create(self, raw: bytes, headers: dict[str, str], base_url: str
               ) -> tuple[int, dict[str, Any]]:
        """Handle one delivery; returns (status, JSON body) or raises ``Rejected``."""
        self.authenticate(raw, headers)
        delivery_id = (headers.get(DELIVERY_HEADER.lower()) or "").strip()
        if not delivery_id or len(delivery_id) > 200:
            raise Rejected(400, "invalid_request", "a unique delivery id (≤ 200 characters) is "
                           "required; retries must reuse it", field_name=DELIVERY_HEADER)
        body = parse_body(raw)
        if body.callback_url is not None:
            try:
                self.config.egress.check(str(body.callback_url))
            except EgressRefused as err:
                raise Rejected(400, "invalid_request", f"callback_url refused: {err}",
                               field_name="callback_url") from None
        body_sha = hashlib.sha256(raw).hexdigest()
        if (known := self._known_delivery(delivery_id, body_sha, base_url)) is not None:
            return 200, known
        policy_path = fetch_policy(body.policy, self.config.state_dir / "policies",
                                   self.config.max_policy_bytes, self.config.egress,
                                   self.config.policy_roots)
        delivery_tag = _tag("delivery", hashlib.sha256(delivery_id.encode()).hexdigest()[:32])
        earlier = self._prefect(lambda: self.prefect.find_flow_run([delivery_tag]))
        if earlier is not None:  # delivered before, to another receiver
            evaluation = self._from_run(earlier)
            self.store.record(delivery_id, body_sha, evaluation, evaluation.id)
            return 200, self._accepted(evaluation, base_url, duplicate="delivery")
        key = idempotency_key(body)
        generation = self._prefect(lambda: self.prefect.count_flow_runs(
            [_tag("key", key)], RETRYABLE_STATES))
        proposed = uuid.uuid4().hex[:16]
        parameters = {"request": self._request(body, policy_path, proposed)}
        tags = ["evalfleet", "webhook", _tag("key", key), _tag("eval", proposed), delivery_tag]
        tags += [f"train:{body.training_run_id}"] if body.training_run_id else []
        run = self._prefect(lambda: self.prefect.create_flow_run(
            parameters, f"evalfleet-{key}-{generation}", tags))
        evaluation = self._from_run(run)
        self.store.record(delivery_id, body_sha, evaluation, evaluation.id)
        if evaluation.id == proposed:
            logger.info("delivery %s: evaluation %s, flow run %s", delivery_id, evaluation.id,
                        evaluation.flow_run_id)
            return 202, self._accepted(evaluation, base_url, duplicate=None)
        duplicate = "delivery" if delivery_tag in (run.get("tags") or []) else "cache_key"
        logger.info("delivery %s: same %s as evaluation %s", delivery_id, duplicate,
                    evaluation.id)
        return 200, self._accepted(evaluation, base_url, duplicate=duplicate)

    def status(self, evaluation_id: str, headers: dict[str, str], base_url: str
               ) -> dict[str, Any]:
        """State of an evaluation and, once completed, its report (signed reads only)."""
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

    @staticmethod
    def _prefect(call: Callable[[], T]) -> T:
        """Run one Prefect API call; its failures become 503 (nothing was recorded)."""
        try:
            return call()
        except httpx.HTTPStatusError as err:
            raise Rejected(503, "unavailable", f"Prefect refused: {err.response.status_code} "
                           f"{err.response.text[:300]}") from None
        except httpx.HTTPError as err:
            raise Rejected(503, "unavailable", f"Prefect API unreachable: {err}") from None

    @staticmethod
    def _from_run(run: dict[str, Any]) -> Evaluation:
        request: dict[str, Any] = (run.get("parameters") or {}).get("request") or {}
        key = next((t.split(":", 1)[1] for t in run.get("tags") or []
                    if t.startswith(_tag("key", ""))), "")
        if not request.get("request_id"):
            raise Rejected(500, "internal", f"flow run {run.get('id')} has no evaluation request")
        return Evaluation(str(request["request_id"]), key, str(run["id"]), request, time.time())

    def _request(self, body: EvaluationCreate, policy_path: Path, evaluation_id: str
                 ) -> dict[str, Any]:
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
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            body = await run_in_threadpool(receiver.status, evaluation_id, headers,
                                           str(request.base_url))
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
    add_egress_options(p)
    p.add_argument("--log-level", default="info")
    return p


def add_egress_options(p: argparse.ArgumentParser) -> None:
    """``--allow-host``, ``--no-public-egress`` and ``--max-policy-bytes`` (receiver and serve)."""
    p.add_argument("--allow-host", action="append", default=None, metavar="HOST[:PORT]|CIDR",
                   help=f"host, address or network that policy.uri / callback_url may reach even "
                   f"if private or loopback, and over http (repeatable; default "
                   f"${ALLOWED_HOSTS_ENV})")
    p.add_argument("--no-public-egress", action="store_true",
                   help=f"reach only allow-listed hosts (default: also public https; "
                   f"${PUBLIC_ENV}=0 does the same)")
    p.add_argument("--max-policy-bytes", type=int, default=DEFAULT_MAX_DOWNLOAD_BYTES,
                   help="largest policy file accepted; downloads stop there")
    p.add_argument("--policy-root", action="append", default=[], metavar="DIR",
                   help="folder file:// policy URIs must lie under (repeatable; default: any)")


def egress_from_args(args: argparse.Namespace) -> EgressPolicy:
    """The egress policy of parsed options, falling back to the environment."""
    env = EgressPolicy.from_env()
    hosts = args.allow_host if args.allow_host is not None else [
        e for e in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if e.strip()]
    try:
        return EgressPolicy.parse(hosts, public=env.public and not args.no_public_egress)
    except EgressRefused as err:
        raise SystemExit(f"evalfleet webhook: {err}") from None


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
        max_policy_bytes=args.max_policy_bytes, egress=egress_from_args(args),
        policy_roots=tuple(Path(r).resolve() for r in args.policy_root),
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
