"""The webhook receiver end to end: real Prefect server, `evalfleet serve`, a fake trainer."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from deployments import DEPLOYMENT, resolve_secret
from evalfleet.callback import canonical_json, sign

from .conftest import EXAMPLE_POLICY_PATH, Service, TrainerEndpoint

pytestmark = pytest.mark.slow

SHA = hashlib.sha256(Path(EXAMPLE_POLICY_PATH).read_bytes()).hexdigest()


def doc(seed: int, callback_url: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "policy": {"uri": Path(EXAMPLE_POLICY_PATH).as_uri(), "sha256": SHA},
        "env": {"id": "CartPole-v1"},
        "protocol": {"episodes": 12, "seed": seed, "max_steps": 200},
        "training_run_id": "trainer-run-7", "step": seed,
        "callback_url": callback_url,
    }
    body.update(extra)
    return body


def flow_runs(service: Service) -> int:
    api = service.urls["prefect_api"]
    r = httpx.post(f"{api}/flow_runs/count",
                   json={"deployments": {"name": {"any_": [DEPLOYMENT.split("/")[1]]}}}, timeout=10)
    r.raise_for_status()
    return int(r.json())


def test_webhook_to_signed_callback(service: Service, trainer: TrainerEndpoint) -> None:
    # Four deliveries of one request at once (a trainer retrying on a timeout): one evaluation.
    t0 = time.monotonic()
    body = doc(101, trainer.url)
    answers: dict[str, httpx.Response] = {}

    def send(delivery: str) -> None:
        # As a trainer does: a 503 (Prefect's SQLite busy under the four at once, nothing
        # recorded, Retry-After set) is sent again, here a second later.
        for _ in range(6):
            answers[delivery] = service.post(body, delivery_id=delivery)
            if answers[delivery].status_code != 503:
                return
            assert answers[delivery].headers.get("Retry-After") == "5"
            time.sleep(1.0)

    threads = [threading.Thread(target=send, args=(f"delivery-101-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(a.status_code for a in answers.values()) == [200, 200, 200, 202]
    accepted = next(a.json() for a in answers.values() if a.status_code == 202)
    assert {a.json()["id"] for a in answers.values()} == {accepted["id"]}
    assert {a.json()["duplicate"] for a in answers.values()} == {None, "cache_key"}
    assert accepted["flow_run_id"]
    assert accepted["status_url"].endswith(f"/v1/evaluations/{accepted['id']}")
    # A redelivery of the same delivery id: the same evaluation, said so.
    again = service.post(body, delivery_id="delivery-101-0")
    assert again.status_code == 200 and again.json()["id"] == accepted["id"]
    assert again.json()["duplicate"] == "delivery"

    callback = trainer.next(timeout=240)
    latency = time.monotonic() - t0
    print(f"\nwebhook -> signed callback: {latency:.1f} s")
    report = callback["report"]
    assert callback["event"] == "evaluation.completed"
    assert report["request_id"] == accepted["id"] and report["policy_sha256"] == SHA
    assert report["training_run_id"] == "trainer-run-7" and report["step"] == 101
    assert report["episodes"] == 12 and report["outputs"]["mlflow_run_id"]
    # The run's first checkpoint on this protocol: the verdict says so, in the body and the GET.
    assert report["history"]["verdict"] == "first" and report["history"]["best_step"] == 101

    status = service.wait_final(accepted["status_url"])
    assert status["state"] == "COMPLETED"
    assert status["report"]["returns"]["mean"] == report["returns"]["mean"]
    assert status["report"]["outputs"]["callback"].startswith("delivered: HTTP 200")
    assert (status["verdict"], status["best_step"], status["best_policy_sha256"]) == ("first", 101, SHA)
    assert status["alarms"] == report["alarms"] and status["history_alarms"] == []
    assert len(trainer.calls) == 1  # exactly one report: no second run, no duplicate POST
    run = httpx.get(f"{service.urls['prefect_api']}/flow_runs/{accepted['flow_run_id']}").json()
    assert run["state"]["type"] == "COMPLETED"
    assert run["idempotency_key"] == f"evalfleet-{accepted['cache_key']}-0"  # Prefect decides
    assert pq.read_table(report["outputs"]["episodes"]).num_rows == 12
    mlflow_run = MlflowClient(service.mlflow_uri).get_run(report["outputs"]["mlflow_run_id"])
    assert mlflow_run.data.tags["evalfleet.training_run_id"] == "trainer-run-7"


def test_signature_is_required(service: Service) -> None:
    before = flow_runs(service)
    body = canonical_json(doc(103))
    now = int(time.time())
    cases = {
        "missing_signature": {"X-Evalfleet-Signature": ""},
        "invalid_signature": {"X-Evalfleet-Signature": sign(body, "wrong-secret", now)},
        "stale_timestamp": {"X-Evalfleet-Timestamp": str(now - 3600),
                            "X-Evalfleet-Signature": sign(body, service.secret, now - 3600)},
        "missing_timestamp": {"X-Evalfleet-Timestamp": ""},
    }
    for code, headers in cases.items():
        r = service.post(body, headers=headers)
        assert r.status_code == 401, (code, r.text)
        assert r.json()["error"] == "unauthorized" and r.json()["code"] == code
    tampered = service.post(body, headers={"X-Evalfleet-Signature": sign(body + b" ",
                                                                            service.secret, now)})
    assert tampered.status_code == 401
    assert flow_runs(service) == before, "a rejected webhook must not create a flow run"


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [
        (lambda d: d.pop("env"), "env", "'env' is required"),
        (lambda d: d["protocol"].update(episodes=0), "protocol.episodes", "greater than 0"),
        (lambda d: d["policy"].update(sha256="abc"), "policy.sha256", "pattern"),
        (lambda d: d["policy"].update(sha256="0" * 64), "policy.sha256", "not 0000"),
        (lambda d: d["policy"].update(uri="relative/path.pt"), "policy.uri", "absolute"),
        (lambda d: d["policy"].update(uri="s3://bucket/p.pt"), "policy.uri", "scheme"),
        (lambda d: d.update(callback_url="not a url"), "callback_url", "URL"),
        (lambda d: d.update(surprise=1), "surprise", "Extra inputs"),
        (lambda d: d.update(step=-1), "step", "greater than or equal to 0"),
    ],
)
def test_schema_errors_name_the_field(service: Service, mutate: Any, field: str,
                                      reason: str) -> None:
    body = doc(104)
    mutate(body)
    r = service.post(body)
    assert r.status_code == 400, r.text
    answer = r.json()
    assert answer["error"] == "invalid_request" and answer["field"] == field
    assert reason.lower() in answer["reason"].lower(), answer


def test_protocol_errors(service: Service) -> None:
    r = service.post(b"{not json")
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = service.post(doc(105), headers={"X-Evalfleet-Delivery": ""})
    assert r.status_code == 400 and r.json()["field"] == "X-Evalfleet-Delivery"
    big = canonical_json({"pad": "x" * 70_000})
    assert service.post(big).status_code == 413
    # A delivery id reused for a different body is a conflict, not a duplicate.
    first = service.post(doc(101), delivery_id="reused-id")  # the first test's evaluation
    second = service.post(doc(107), delivery_id="reused-id")
    assert second.status_code == 409, (first.text, second.text)
    assert service.get(f"{service.urls['receiver']}/v1/evaluations/nope").status_code == 404


def test_failed_evaluation_is_reported_and_can_be_retried(service: Service,
                                                          trainer: TrainerEndpoint) -> None:
    # Valid schema, but gym.make rejects the kwarg: the flow run fails, the trainer hears of it.
    body = doc(108, trainer.url, env={"id": "CartPole-v1", "kwargs": {"no_such_kwarg": 1}})
    r = service.post(body)
    assert r.status_code == 202, r.text
    failed = trainer.next(timeout=240)
    assert failed["event"] == "evaluation.failed"
    assert failed["report"]["request_id"] == r.json()["id"] and failed["report"]["message"]
    status = service.wait_final(r.json()["status_url"])
    assert status["state"] in ("FAILED", "CRASHED") and status["report"] is None
    # Same cache key after a failure: a new evaluation, not the failed one again.
    retry = service.post(body)
    assert retry.status_code == 202 and retry.json()["id"] != r.json()["id"]


def test_secret_from_a_prefect_secret_block(prefect_server: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.blocks.system import Secret

    name = f"evalfleet-test-{uuid.uuid4().hex[:8]}"
    Secret(value="from-the-block").save(name)
    monkeypatch.delenv("EVALFLEET_TEST_SECRET", raising=False)
    assert resolve_secret("EVALFLEET_TEST_SECRET", name) == "from-the-block"
    monkeypatch.setenv("EVALFLEET_TEST_SECRET", "from-env")
    assert resolve_secret("EVALFLEET_TEST_SECRET", name) == "from-env"  # env wins
    assert resolve_secret("EVALFLEET_TEST_SECRET_UNSET") == ""
