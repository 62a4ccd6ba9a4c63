"""The receiver does only what it is asked (issue 14, items 5-7): signed reads, no request
forgery through ``policy.uri`` / ``callback_url``, one flow run across several receivers.

Real processes on 127.0.0.1 against the session's Prefect server; the deployment is served by
the ``service`` fixture. Nothing connects anywhere but loopback.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments import DEPLOYMENT
from evalfleet.callback import sign, signed_read_headers

from .conftest import EXAMPLE_POLICY_PATH, ReceiverProcess, Service

pytestmark = pytest.mark.slow

POLICY = Path(EXAMPLE_POLICY_PATH).read_bytes()
SHA = hashlib.sha256(POLICY).hexdigest()


def doc(seed: int, uri: str | None = None, sha: str = SHA, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "policy": {"uri": uri or Path(EXAMPLE_POLICY_PATH).as_uri(), "sha256": sha},
        "env": {"id": "CartPole-v1"},
        "protocol": {"episodes": 12, "seed": seed, "max_steps": 200},
    }
    body.update(extra)
    return body


def runs_tagged(api: str, *tags: str) -> list[dict[str, Any]]:
    r = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={
        "flow_runs": {"tags": {"all_": list(tags)}},
        "deployments": {"name": {"any_": [DEPLOYMENT.split("/")[1]]}}})
    r.raise_for_status()
    runs: list[dict[str, Any]] = r.json()
    return runs


def count_runs(api: str) -> int:
    return len(runs_tagged(api, "evalfleet"))


# ------------------------------------------------------------------------------ item 5: reads


def test_status_needs_a_signature_for_that_evaluation(service: Service) -> None:
    accepted = service.post(doc(301)).json()
    url = accepted["status_url"]
    path = f"/v1/evaluations/{accepted['id']}"
    now = int(time.time())
    cases = {
        "missing_signature": {},
        "invalid_signature": signed_read_headers(path, "wrong-secret"),
        "stale_timestamp": signed_read_headers(path, service.secret, timestamp=now - 3600),
    }
    for code, headers in cases.items():
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 401, (code, r.text)
        assert r.json() == {"error": "unauthorized", "reason": r.json()["reason"], "code": code}
        assert "report" not in r.json() and "state" not in r.json()
    # A valid read signature of one evaluation opens no other one (nor a POST body's).
    replayed = signed_read_headers("/v1/evaluations/0123456789abcdef", service.secret)
    assert httpx.get(url, headers=replayed, timeout=10).status_code == 401
    body_sig = {"X-Evalfleet-Timestamp": str(now), "X-Evalfleet-Signature": sign(b"", service.secret,
                                                                                now)}
    assert httpx.get(url, headers=body_sig, timeout=10).status_code == 401
    # Unknown ids need a signature too (no probing for which ids exist).
    assert httpx.get(f"{service.urls['receiver']}/v1/evaluations/nope").status_code == 401
    ok = service.get(url)
    assert ok.status_code == 200, ok.text
    assert ok.json()["id"] == accepted["id"] and ok.json()["flow_run_id"] == accepted["flow_run_id"]
    assert ok.json()["state"] in ("SCHEDULED", "PENDING", "RUNNING", "COMPLETED")
    assert ok.json()["final"] is (ok.json()["state"] == "COMPLETED")
    # (test_webhook reads completed reports through the same signed GET.)


# ------------------------------------------------------------------------------- item 6: SSRF


def test_policy_and_callback_urls_reach_only_allowed_hosts(
        service: Service, start_receiver: Any, loopback_server: Any, tmp_path: Path) -> None:
    outside = loopback_server({"/p.pt": (200, {}, POLICY), "/cb": (200, {}, b"")})
    wrong = POLICY + b"tampered"
    inside = loopback_server({
        "/p.pt": (200, {}, POLICY),
        "/away": (302, {"Location": f"{outside.url}/p.pt"}, b""),
        "/big": (200, {"Content-Length": "omit"}, POLICY * 3),
        "/wrong": (200, {}, wrong),
    })
    port = inside.url.rsplit(":", 1)[1]
    shared = tmp_path / "shared"  # the only folder file:// URIs may name
    shared.mkdir()
    (shared / "escape.pt").symlink_to(EXAMPLE_POLICY_PATH)
    receiver: ReceiverProcess = start_receiver(
        "--allow-host", f"127.0.0.1:{port}", "--max-policy-bytes", str(len(POLICY) + 100),
        "--policy-root", str(shared), output=service.output)
    before = count_runs(service.urls["prefect_api"])
    cases = [
        # (body, field, reason): loopback port not on the allow-list, before any connection
        (doc(401, f"{outside.url}/p.pt"), "policy.uri", "is a loopback address"),
        # an allowed host redirecting to one that is not: the second hop is refused
        (doc(402, f"{inside.url}/away"), "policy.uri", "is a loopback address"),
        (doc(403, f"{inside.url}/big"), "policy.uri", f"more than the {len(POLICY) + 100} "
                                                      "bytes allowed; download stopped"),
        (doc(404, f"{inside.url}/wrong"), "policy.sha256",
         f"is {hashlib.sha256(wrong).hexdigest()}, not {SHA}"),
        (doc(405, "http://169.254.169.254/latest/meta-data/"), "policy.uri", "cloud metadata"),
        (doc(406, "https://10.0.0.1/p.pt"), "policy.uri", "is a private address"),
        (doc(407, callback_url=f"{outside.url}/cb"), "callback_url", "is a loopback address"),
        (doc(408, callback_url="http://169.254.169.254/"), "callback_url", "cloud metadata"),
        (doc(409, callback_url="http://[fe80::1]/cb"), "callback_url", "link-local"),
        (doc(410, callback_url="https://192.168.1.1/cb"), "callback_url", "private address"),
        (doc(412), "policy.uri", "is outside the folders file policy URIs may name"),
        (doc(413, (shared / "escape.pt").as_uri()), "policy.uri", "is outside the folders"),
    ]
    for body, field, reason in cases:
        r = receiver.post(body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["field"] == field and reason in r.json()["reason"], r.json()
    assert outside.requests == []  # no request reached the host that is not allowed
    assert inside.requests.count("GET /away") == 1 and "GET /big" in inside.requests
    assert count_runs(service.urls["prefect_api"]) == before, "a refusal must start nothing"
    # The allowed host over http, inside the cap and with the right hash: accepted.
    ok = receiver.post(doc(411, f"{inside.url}/p.pt"))
    assert ok.status_code == 202, ok.text
    assert inside.requests[-1] == "GET /p.pt"  # fetched from the checked, pinned address


# ---------------------------------------------------------------------- item 7: idempotency


def fire_together(calls: list[tuple[ReceiverProcess, dict[str, Any], str]]
                  ) -> list[httpx.Response]:
    """POST every (receiver, body, delivery id) at the same moment (threads behind a barrier)."""
    answers: list[httpx.Response | None] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def send(i: int) -> None:
        receiver, body, delivery = calls[i]
        barrier.wait(timeout=30)
        answers[i] = receiver.post(body, delivery_id=delivery)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


def test_two_receivers_start_one_flow_run(service: Service, start_receiver: Any) -> None:
    api = service.urls["prefect_api"]
    # Two receivers, each with its own SQLite store: only the Prefect server is shared.
    a = start_receiver("--mlflow-uri", service.mlflow_uri, output=service.output)
    b = start_receiver("--mlflow-uri", service.mlflow_uri, output=service.output)
    for round_ in range(2):
        # One delivery, received by both at the same moment (a load balancer's retry).
        same = fire_together([(a, doc(500 + round_), f"d-{round_}"),
                              (b, doc(500 + round_), f"d-{round_}")])
        assert sorted(r.status_code for r in same) == [200, 202], [r.text for r in same]
        assert len({r.json()["flow_run_id"] for r in same}) == 1
        assert len({r.json()["id"] for r in same}) == 1
        assert {r.json()["duplicate"] for r in same} == {None, "delivery"}
        key = same[0].json()["cache_key"]
        assert len(runs_tagged(api, f"evalfleet-key:{key}")) == 1
        # Two deliveries of one evaluation (different ids), one to each receiver, at once.
        body = doc(600 + round_)
        two = fire_together([(a, body, f"e-{round_}-a"), (b, body, f"e-{round_}-b")])
        assert sorted(r.status_code for r in two) == [200, 202], [r.text for r in two]
        assert len({r.json()["flow_run_id"] for r in two}) == 1
        assert {r.json()["duplicate"] for r in two} == {None, "cache_key"}
        key = two[0].json()["cache_key"]
        [run] = runs_tagged(api, f"evalfleet-key:{key}")
        # A third delivery to the other receiver while that run is live: still that run.
        late = b.post(body, delivery_id=f"e-{round_}-c")
        assert late.status_code == 200 and late.json()["flow_run_id"] == run["id"]
    # Either receiver answers for an evaluation the other one created (status from Prefect).
    created = next(r for r in two if r.status_code == 202).json()
    for receiver in (a, b):
        status = receiver.get(f"{receiver.url}/v1/evaluations/{created['id']}")
        assert status.status_code == 200 and status.json()["flow_run_id"] == created["flow_run_id"]
    # A redelivery to the receiver that did not create the run: the same run, said so.
    again = b.post(doc(500), delivery_id="d-0")
    assert again.status_code == 200 and again.json()["duplicate"] == "delivery"
    assert len(runs_tagged(api, f"evalfleet-key:{again.json()['cache_key']}")) == 1
