"""Real processes on 127.0.0.1: `evalfleet serve` on the session's Prefect server, a fake trainer.

The Prefect server itself is ``tests/conftest.py``'s session ``prefect_server`` fixture (a real
``prefect server start`` with a temporary PREFECT_HOME and analytics off); everything here runs
against it, so the whole suite starts one server.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from evalfleet.callback import SIGNATURE_HEADER, TIMESTAMP_HEADER, canonical_json, signed_headers
from evalfleet.callback import verify as verify_signature

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_POLICY_PATH = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
SECRET = "integration-webhook-secret"
CALLBACK_SECRET = "integration-callback-secret"
#: A credential the service's process holds that no evaluation output may ever contain.
CLOUD_SECRET = "integration-aws-secret-access-key"
SERVICE_START_S = 180


@pytest.fixture(scope="module", autouse=True)
def _flush_prefect_events() -> Iterator[None]:
    """Deliver this process's queued Prefect events while the server still runs.

    Flows run in this process (the Evaluator's local runner) queue events; if they are still
    queued when the session's server stops, the exit hook retries each one for seconds.
    """
    yield
    if "prefect" in sys.modules:
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=10)


@dataclass
class Service:
    """A running `evalfleet serve` and what a trainer needs to talk to it."""

    urls: dict[str, str]
    output: Path
    mlflow_uri: str
    log: Path
    secret: str = SECRET
    callback_secret: str = CALLBACK_SECRET

    def post(self, doc: dict[str, Any] | bytes, *, delivery_id: str | None = None,
             headers: dict[str, str] | None = None, secret: str | None = None) -> httpx.Response:
        """POST a signed webhook (``headers`` override the signed ones)."""
        body = doc if isinstance(doc, bytes) else canonical_json(doc)
        h = signed_headers(body, secret or self.secret, delivery_id=delivery_id)
        h.update(headers or {})
        return httpx.post(self.urls["evaluations"], content=body, headers=h, timeout=30)

    def wait_final(self, status_url: str, timeout: float = 240) -> dict[str, Any]:
        """Poll the status URL until the evaluation is final (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status: dict[str, Any] = httpx.get(status_url, timeout=10).json()
            if status.get("final") and (status["state"] != "COMPLETED" or status["report"]):
                return status
            time.sleep(0.25)
        raise AssertionError(f"{status_url} not final after {timeout} s: {status}")


@pytest.fixture(scope="session")
def service(prefect_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`python -m deployments.cli serve` against the session's Prefect server."""
    base = tmp_path_factory.mktemp("service")
    ready = base / "ready.json"
    output = base / "results"
    mlflow_uri = f"sqlite:///{output / 'mlflow.db'}"
    env = dict(os.environ, EVALFLEET_WEBHOOK_SECRET=SECRET,
               EVALFLEET_CALLBACK_SECRET=CALLBACK_SECRET, EVALFLEET_CALLBACK_ATTEMPTS="3",
               EVALFLEET_CALLBACK_BACKOFF="0.1", PREFECT_API_URL=prefect_server,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", AWS_SECRET_ACCESS_KEY=CLOUD_SECRET)
    log_path = base / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deployments.cli", "--prefect-api-url", prefect_server,
             "--port", "0", "--workers", "2", "--state-dir", str(base / "state"),
             "--output", str(output), "--mlflow-uri", mlflow_uri, "--ready-file", str(ready),
             "--startup-timeout", str(SERVICE_START_S), "--drain-timeout", "20"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            deadline = time.monotonic() + SERVICE_START_S + 30
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"evalfleet serve did not start:\n"
                                       f"{log_path.read_text()[-4000:]}")
                time.sleep(0.25)
            yield Service(json.loads(ready.read_text()), output, mlflow_uri, log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)


@dataclass
class TrainerEndpoint:
    """A fake trainer's callback endpoint: records every POST, answers ``statuses`` in turn."""

    url: str
    statuses: list[int]
    received: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    calls: list[dict[str, Any]] = field(default_factory=list)

    def next(self, timeout: float = 240) -> dict[str, Any]:
        """The next verified callback (bounded wait)."""
        try:
            return self.received.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no callback within {timeout} s (calls: {self.calls})") from None


@pytest.fixture
def trainer() -> Iterator[TrainerEndpoint]:
    """A real HTTP server on 127.0.0.1 that verifies signatures like a trainer would."""
    endpoint = TrainerEndpoint(url="", statuses=[])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            call = {"headers": dict(self.headers), "body": body, "at": time.time()}
            try:
                verify_signature(body, self.headers.get(SIGNATURE_HEADER),
                                 self.headers.get(TIMESTAMP_HEADER), CALLBACK_SECRET)
                call["verified"] = True
            except Exception as err:
                call["verified"] = False
                call["error"] = str(err)
            endpoint.calls.append(call)
            status = endpoint.statuses.pop(0) if endpoint.statuses else 200
            self.send_response(status)
            self.end_headers()
            if status == 200 and call["verified"]:
                endpoint.received.put({"event": self.headers.get("X-Evalfleet-Event"),
                                       "delivery": self.headers.get("X-Evalfleet-Delivery"),
                                       "report": json.loads(body)})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    endpoint.url = f"http://127.0.0.1:{server.server_port}/evalfleet/report"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield endpoint
    server.shutdown()
    server.server_close()
