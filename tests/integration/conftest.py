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
from urllib.parse import urlsplit

import httpx
import pytest

from evalfleet.callback import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    canonical_json,
    signed_headers,
    signed_read_headers,
)
from evalfleet.callback import verify as verify_signature
from evalfleet.egress import ALLOWED_HOSTS_ENV

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_POLICY_PATH = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")
SECRET = "integration-webhook-secret"
CALLBACK_SECRET = "integration-callback-secret"
#: A credential the service's process holds that no evaluation output may ever contain.
CLOUD_SECRET = "integration-aws-secret-access-key"
SERVICE_START_S = 180
#: The fake trainers of these tests listen on 127.0.0.1: allowed explicitly, as an operator would.
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="session", autouse=True)
def _allow_loopback_callbacks() -> Iterator[None]:
    """Flows run in this process (the Evaluator) POST callbacks to 127.0.0.1 trainers."""
    saved = os.environ.get(ALLOWED_HOSTS_ENV)
    os.environ[ALLOWED_HOSTS_ENV] = LOOPBACK
    yield
    if saved is None:
        os.environ.pop(ALLOWED_HOSTS_ENV, None)
    else:
        os.environ[ALLOWED_HOSTS_ENV] = saved


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

    def get(self, status_url: str, *, secret: str | None = None,
            headers: dict[str, str] | None = None) -> httpx.Response:
        """A signed GET of a status URL (``headers`` override the signed ones)."""
        return signed_get(status_url, secret or self.secret, headers)

    def wait_final(self, status_url: str, timeout: float = 240) -> dict[str, Any]:
        """Poll the status URL until the evaluation is final (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status: dict[str, Any] = self.get(status_url).json()
            if status.get("final") and (status["state"] != "COMPLETED" or status["report"]):
                return status
            time.sleep(0.25)
        raise AssertionError(f"{status_url} not final after {timeout} s: {status}")


def signed_get(url: str, secret: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """GET ``url`` signed over ``GET <path>`` as a trainer would."""
    h = signed_read_headers(urlsplit(url).path, secret)
    h.update(headers or {})
    return httpx.get(url, headers=h, timeout=10)


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
             "--startup-timeout", str(SERVICE_START_S), "--drain-timeout", "20",
             "--allow-host", LOOPBACK],
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
                                 self.headers.get(TIMESTAMP_HEADER), CALLBACK_SECRET,
                                 delivery_id=self.headers.get(DELIVERY_HEADER, ""))
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


@dataclass
class ReceiverProcess:
    """One ``python -m deployments.webhook`` process on 127.0.0.1."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    secret: str = SECRET

    def post(self, doc: dict[str, Any] | bytes, *, delivery_id: str | None = None
             ) -> httpx.Response:
        """POST a signed webhook."""
        body = doc if isinstance(doc, bytes) else canonical_json(doc)
        return httpx.post(f"{self.url}/v1/evaluations", content=body, timeout=60,
                          headers=signed_headers(body, self.secret, delivery_id=delivery_id))

    def get(self, status_url: str) -> httpx.Response:
        """A signed GET of a status URL."""
        return signed_get(status_url, self.secret)


@pytest.fixture
def start_receiver(prefect_server: str, tmp_path: Path) -> Iterator[Any]:
    """Start receiver processes: ``start_receiver(*options, state_dir=..., output=...)``.

    The environment carries no allow-list: each test names the hosts it allows, or none.
    """
    started: list[ReceiverProcess] = []

    def start(*options: str, state_dir: Path | None = None,
              output: Path | None = None) -> ReceiverProcess:
        from tests.conftest import free_port

        name = f"receiver{len(started)}"
        port = free_port()
        env = dict(os.environ, EVALFLEET_WEBHOOK_SECRET=SECRET, PREFECT_API_URL=prefect_server)
        env.pop(ALLOWED_HOSTS_ENV, None)
        log = tmp_path / f"{name}.log"
        with log.open("w") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deployments.webhook", "--host", "127.0.0.1",
                 "--port", str(port), "--prefect-api-url", prefect_server,
                 "--state-dir", str(state_dir or tmp_path / name),
                 "--output", str(output or tmp_path / "results"), "--log-level", "warning",
                 *options],
                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        receiver = ReceiverProcess(f"http://127.0.0.1:{port}", proc, log)
        started.append(receiver)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{receiver.url}/healthz", timeout=2).status_code == 200:
                    return receiver
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    yield start
    for receiver in started:
        receiver.proc.terminate()
    for receiver in started:
        try:
            receiver.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            receiver.proc.kill()
            receiver.proc.wait(timeout=5)


@dataclass
class LoopbackServer:
    """A plain HTTP server on 127.0.0.1 serving ``routes`` and recording every request path."""

    url: str
    routes: dict[str, tuple[int, dict[str, str], bytes]]
    requests: list[str] = field(default_factory=list)


@pytest.fixture
def loopback_server() -> Iterator[Any]:
    """Start ``LoopbackServer``s: ``loopback_server({"/path": (status, headers, body)})``."""
    servers: list[ThreadingHTTPServer] = []

    def start(routes: dict[str, tuple[int, dict[str, str], bytes]]) -> LoopbackServer:
        box = LoopbackServer("", routes)

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                box.requests.append(f"{self.command} {self.path}")
                status, headers, body = box.routes.get(self.path, (404, {}, b"not here"))
                self.send_response(status)
                for k, v in headers.items():
                    if k != "Content-Length":
                        self.send_header(k, v)
                if headers.get("Content-Length") != "omit":  # omitted: body ends at close
                    self.send_header("Content-Length", headers.get("Content-Length",
                                                                   str(len(body))))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading (size cap): expected

            do_GET = _answer  # noqa: N815
            do_POST = _answer  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        box.url = f"http://127.0.0.1:{server.server_port}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return box

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
