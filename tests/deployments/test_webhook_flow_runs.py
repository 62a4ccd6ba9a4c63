"""The receiver's Prefect calls against a loopback stand-in that answers 503 on demand.

A real Prefect server cannot be made to fail on cue; this stand-in speaks the routes the
receiver uses, so the retry semantics are pinned: flow-run creation at most 4 calls and reads at
most 3, 0.25 s doubling between them, 5xx and connection errors retried, 4xx not, and Prefect's
own minute-long retry loop switched off (one call per attempt, even on a 503).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from deployments.webhook import PrefectAPI, Receiver, ReceiverConfig, Rejected

DEPLOYMENT_ID = str(uuid.uuid4())


class StandIn(ThreadingHTTPServer):
    """Answers the deployment lookup, and ``create_flow_run`` with the next queued status."""

    statuses: list[int]
    creates: list[tuple[float, dict[str, Any]]]
    read_statuses: list[int]
    reads: list[float]


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/api/health":
            self._answer(200, True)
        elif self.path == "/api/deployments/name/evalfleet-service/evaluate":
            self._answer(200, {"id": DEPLOYMENT_ID, "name": "evaluate",
                               "flow_id": str(uuid.uuid4())})
        else:
            self._answer(404, {"detail": "Not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in ("/api/flow_runs/filter", "/api/flow_runs/count"):
            self.server.reads.append(time.monotonic())
            status = self.server.read_statuses.pop(0) if self.server.read_statuses else 200
            if status >= 300:
                self._answer(status, {"detail": f"stand-in says {status}"})
            else:
                self._answer(200, [] if self.path.endswith("filter") else 0)
            return
        if self.path != f"/api/deployments/{DEPLOYMENT_ID}/create_flow_run":
            self._answer(404, {"detail": "Not found"})
            return
        self.server.creates.append((time.monotonic(), body))
        status = self.server.statuses.pop(0) if self.server.statuses else 201
        if status >= 300:
            self._answer(status, {"detail": f"stand-in says {status}"})
            return
        self._answer(201, {"id": str(uuid.uuid4()), "flow_id": str(uuid.uuid4()), "name": "run",
                           "parameters": body["parameters"], "tags": body["tags"],
                           "idempotency_key": body["idempotency_key"]})


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn(("127.0.0.1", 0), Handler)
    server.statuses, server.creates, server.read_statuses, server.reads = [], [], [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def api(server: StandIn) -> PrefectAPI:
    return PrefectAPI(f"http://127.0.0.1:{server.server_address[1]}/api")


def gaps(server: StandIn) -> list[float]:
    times = [t for t, _ in server.creates]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_create_retries_5xx_with_doubling_backoff(stand_in: StandIn) -> None:
    stand_in.statuses = [500, 500]
    prefect = api(stand_in)
    run = prefect.create_flow_run({"request": {"x": 1}}, "evalfleet-k-0", ["a", "b"])
    prefect.close()
    assert len(stand_in.creates) == 3
    assert run.parameters == {"request": {"x": 1}} and run.tags == ["a", "b"]
    bodies = [b for _, b in stand_in.creates]
    assert {b["idempotency_key"] for b in bodies} == {"evalfleet-k-0"}  # safe to repeat
    first, second = gaps(stand_in)
    assert 0.25 <= first < 0.5 + 0.2 and 0.5 <= second < 1.0 + 0.2


def test_create_gives_up_after_four_calls_and_answers_503(stand_in: StandIn,
                                                          tmp_path: Any) -> None:
    stand_in.statuses = [500] * 10
    prefect = api(stand_in)
    t0 = time.monotonic()
    with pytest.raises(httpx.HTTPStatusError) as info:
        prefect.create_flow_run({}, "evalfleet-k-0", [])
    took = time.monotonic() - t0
    assert info.value.response.status_code == 500
    assert len(stand_in.creates) == 4 and 1.75 <= took < 5  # 0.25 + 0.5 + 1.0 s between calls
    receiver = Receiver(ReceiverConfig(secrets=("k",), prefect_api_url=prefect.api_url,
                                       state_dir=tmp_path, output=tmp_path), prefect)
    stand_in.statuses = [503] * 10
    del stand_in.creates[:]
    with pytest.raises(Rejected) as rejected:
        receiver._prefect(lambda: prefect.create_flow_run({}, "evalfleet-k-0", [], attempts=1))
    assert len(stand_in.creates) == 1  # Prefect's own loop would have made 6 calls over ~a minute
    assert rejected.value.status == 503
    assert rejected.value.body["reason"].startswith("Prefect refused: 503")
    receiver.close()


def test_a_read_retries_a_busy_servers_503_and_gives_up_after_three_calls(
        stand_in: StandIn) -> None:
    # One 503 from a busy server's SQLite must not turn a delivery into a 503 for the trainer.
    prefect = api(stand_in)
    stand_in.read_statuses = [503]
    assert prefect.find_flow_run(["evalfleet-eval:x"]) is None
    stand_in.read_statuses = [502, 500]
    assert prefect.count_flow_runs(["evalfleet-key:k"]) == 0
    assert len(stand_in.reads) == 2 + 3
    del stand_in.reads[:]
    stand_in.read_statuses = [503] * 10
    with pytest.raises(httpx.HTTPStatusError) as info:
        prefect.find_flow_run(["evalfleet-eval:x"])
    assert info.value.response.status_code == 503 and len(stand_in.reads) == 3
    stand_in.read_statuses = [404]  # a 4xx will not change on retry
    del stand_in.reads[:]
    with pytest.raises(httpx.HTTPStatusError):
        prefect.count_flow_runs(["evalfleet-key:k"])
    assert len(stand_in.reads) == 1
    prefect.close()


def test_create_does_not_retry_a_4xx(stand_in: StandIn) -> None:
    stand_in.statuses = [422]
    prefect = api(stand_in)
    with pytest.raises(httpx.HTTPStatusError):
        prefect.create_flow_run({}, "evalfleet-k-0", [])
    prefect.close()
    assert len(stand_in.creates) == 1


def test_unreachable_prefect_is_a_503_not_a_hang(tmp_path: Any) -> None:
    from tests.conftest import free_port

    prefect = PrefectAPI(f"http://127.0.0.1:{free_port()}/api")
    assert prefect.healthy() is False
    receiver = Receiver(ReceiverConfig(secrets=("k",), prefect_api_url=prefect.api_url,
                                       state_dir=tmp_path, output=tmp_path), prefect)
    t0 = time.monotonic()
    with pytest.raises(Rejected) as rejected:
        receiver._prefect(lambda: prefect.find_flow_run(["evalfleet-eval:x"]))
    assert time.monotonic() - t0 < 5
    assert rejected.value.status == 503
    assert rejected.value.body["reason"].startswith("Prefect API unreachable")
    receiver.close()
