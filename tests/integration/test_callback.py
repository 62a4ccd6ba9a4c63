"""HMAC signing, verification and the bounded, retrying report callback (real HTTP, 127.0.0.1)."""

from __future__ import annotations

import socket
import time

import pytest

from evalfleet.callback import (
    DELIVERY_HEADER,
    SignatureError,
    post_report,
    send_report_callback,
    sign,
    signed_headers,
    verify,
)

from .conftest import CALLBACK_SECRET, TrainerEndpoint

BODY = b'{"request_id":"abc","returns":{"mean":1.0}}'


def test_sign_verify_round_trip() -> None:
    ts = int(time.time())
    sig = sign(BODY, "k", ts)
    assert sig.startswith("sha256=") and len(sig) == len("sha256=") + 64
    assert verify(BODY, sig, str(ts), "k") == ts
    assert verify(BODY, sig, ts, ["old", "k"]) == ts  # rotation: any accepted secret verifies


@pytest.mark.parametrize(
    ("body", "signature", "timestamp", "reason"),
    [
        (BODY + b" ", "good", "now", "invalid_signature"),
        (BODY, "sha256=" + "0" * 64, "now", "invalid_signature"),
        (BODY, None, "now", "missing_signature"),
        (BODY, "good", None, "missing_timestamp"),
        (BODY, "good", "yesterday", "malformed_timestamp"),
        (BODY, "md5=abc", "now", "malformed_signature"),
        (BODY, "good", "stale", "stale_timestamp"),
        (BODY, "good", "future", "stale_timestamp"),
    ],
)
def test_verify_rejects(body: bytes, signature: str | None, timestamp: str | None,
                        reason: str) -> None:
    now = int(time.time())
    ts = {"now": now, "stale": now - 301, "future": now + 301}.get(str(timestamp), timestamp)
    if signature == "good":
        signature = sign(BODY, "k", int(ts) if isinstance(ts, int) else now)
    with pytest.raises(SignatureError) as info:
        verify(body, signature, ts, "k", now=now)
    assert info.value.reason == reason


def test_verify_refuses_without_secret() -> None:
    with pytest.raises(SignatureError) as info:
        verify(BODY, sign(BODY, "k", 1), 1, "")
    assert info.value.reason == "no_secret"


def test_post_report_delivers_signed(trainer: TrainerEndpoint) -> None:
    result = post_report(trainer.url, {"request_id": "r1", "x": 1}, CALLBACK_SECRET)
    assert result.delivered and result.attempts == 1 and result.status_code == 200
    got = trainer.next(timeout=10)
    assert got["report"] == {"request_id": "r1", "x": 1}
    assert got["delivery"] == "r1:completed" and got["event"] == "evaluation.completed"
    assert result.summary().startswith("delivered: HTTP 200 after 1 attempt")


def test_post_report_retries_transient_failures_with_one_delivery_id(
    trainer: TrainerEndpoint,
) -> None:
    trainer.statuses = [503, 429, 200]
    result = post_report(trainer.url, {"request_id": "r2"}, CALLBACK_SECRET, attempts=5,
                         backoff=0.01)
    assert result.delivered and result.attempts == 3
    assert [c["verified"] for c in trainer.calls] == [True, True, True]  # re-signed each time
    assert {c["headers"][DELIVERY_HEADER] for c in trainer.calls} == {"r2:completed"}


def test_post_report_does_not_retry_a_permanent_refusal(trainer: TrainerEndpoint) -> None:
    trainer.statuses = [400, 200]
    result = post_report(trainer.url, {"request_id": "r3"}, CALLBACK_SECRET, attempts=5,
                         backoff=0.01)
    assert not result.delivered and result.attempts == 1 and result.status_code == 400


def test_post_report_is_bounded_when_nobody_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    slept: list[float] = []
    t0 = time.monotonic()
    result = post_report(f"http://127.0.0.1:{port}/cb", {"request_id": "r4"}, "k", attempts=4,
                         backoff=0.5, max_backoff=1.0, timeout=2, sleep=slept.append)
    assert time.monotonic() - t0 < 5
    assert not result.delivered and result.attempts == 4 and result.status_code is None
    assert slept == [0.5, 1.0, 1.0]  # exponential, capped, none after the last attempt
    assert "ConnectError" in (result.error or "")


def test_post_report_backs_off_between_attempts(trainer: TrainerEndpoint) -> None:
    slept: list[float] = []
    trainer.statuses = [503, 500, 200]
    result = post_report(trainer.url, {"request_id": "r5"}, CALLBACK_SECRET, backoff=0.01,
                         sleep=slept.append)
    assert result.delivered and slept == [0.01, 0.02]


def test_send_report_callback_without_secret_sends_nothing(
    trainer: TrainerEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVALFLEET_CALLBACK_SECRET", raising=False)
    outcome = send_report_callback(trainer.url, {"request_id": "r6"})
    assert outcome.startswith("not sent: EVALFLEET_CALLBACK_SECRET is not set")
    assert trainer.calls == []


def test_send_report_callback_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "k")
    outcome = send_report_callback("http://127.0.0.1:1/cb", {"request_id": "r7"}, attempts=2,
                                   backoff=0.0)
    assert outcome.startswith("failed after 2 attempts")
    assert send_report_callback("not a url", {"request_id": "r8"}, attempts=1).startswith("failed")


def test_signed_headers_carry_everything_a_receiver_checks() -> None:
    h = signed_headers(BODY, "k", delivery_id="d1", timestamp=1_700_000_000)
    assert h[DELIVERY_HEADER] == "d1" and h["X-Evalfleet-Timestamp"] == "1700000000"
    assert verify(BODY, h["X-Evalfleet-Signature"], h["X-Evalfleet-Timestamp"], "k",
                  delivery_id="d1", now=1_700_000_000) == 1_700_000_000
    # The delivery id is signed: the same signature under another id does not verify.
    with pytest.raises(SignatureError) as info:
        verify(BODY, h["X-Evalfleet-Signature"], h["X-Evalfleet-Timestamp"], "k",
               delivery_id="d2", now=1_700_000_000)
    assert info.value.reason == "invalid_signature"
