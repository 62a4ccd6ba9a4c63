"""Deliveries, replays and failure notices, against an in-memory Prefect that keeps its promises.

The stand-in implements what the receiver relies on from Prefect: ``create_flow_run`` returns
the existing run for a known idempotency key, tag filters match runs carrying every tag, and a
run's state can be set by the test. Two receivers with their own stores share it and the output
folder, as receivers behind one load balancer share a Prefect server.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect.client.schemas.objects import FlowRun, State, StateType

from deployments.webhook import PrefectAPI, Receiver, ReceiverConfig, Rejected
from evalfleet.callback import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    canonical_json,
    signed_headers,
    signed_read_headers,
    verify,
)
from evalfleet.egress import ALLOWED_HOSTS_ENV
from evalfleet.storage import run_dir, write_json

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "evalfleet" / "data" / "cartpole_mlp.pt"
SECRET = "deliveries-webhook-secret"
CALLBACK_SECRET = "deliveries-callback-secret"
BASE = "http://receiver.test"


class MemoryPrefect(PrefectAPI):
    """Flow runs of one deployment, in memory; idempotency keys and tag filters as Prefect's."""

    def __init__(self) -> None:  # no client: nothing leaves the process
        self.api_url = "http://prefect.test/api"
        self.runs: list[FlowRun] = []
        self.lock = threading.Lock()

    def create_flow_run(self, parameters: dict[str, Any], idempotency_key: str,
                        tags: list[str], attempts: int = 4) -> FlowRun:
        with self.lock:
            for run in self.runs:
                if run.idempotency_key == idempotency_key:
                    return run
            run = FlowRun(flow_id=uuid.uuid4(), parameters=parameters, tags=list(tags),
                          idempotency_key=idempotency_key,
                          state=State(type=StateType.SCHEDULED, name="Scheduled"))
            self.runs.append(run)
            return run

    def _matching(self, tags: list[str], states: tuple[str, ...] | None) -> list[FlowRun]:
        return [r for r in self.runs if set(tags) <= set(r.tags)
                and (states is None or (r.state is not None and r.state.type.value in states))]

    def count_flow_runs(self, tags: list[str], states: tuple[str, ...] | None = None) -> int:
        return len(self._matching(tags, states))

    def find_flow_run(self, tags: list[str]) -> FlowRun | None:
        found = self._matching(tags, None)
        return found[0] if found else None

    def flow_run(self, flow_run_id: str) -> FlowRun:
        return next(r for r in self.runs if str(r.id) == flow_run_id)

    def end(self, flow_run_id: str, state: str, message: str | None = None) -> None:
        self.flow_run(flow_run_id).state = State(type=StateType(state), name=state.title(),
                                                 message=message)

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def prefect() -> MemoryPrefect:
    return MemoryPrefect()


def make_receiver(prefect: MemoryPrefect, tmp_path: Path, name: str) -> Receiver:
    config = ReceiverConfig(secrets=(SECRET,), prefect_api_url=prefect.api_url,
                            state_dir=tmp_path / f"state-{name}", output=tmp_path / "results",
                            policy_roots=(POLICY.parent,))
    return Receiver(config, prefect)


@pytest.fixture
def receivers(prefect: MemoryPrefect, tmp_path: Path) -> Iterator[tuple[Receiver, Receiver]]:
    a, b = make_receiver(prefect, tmp_path, "a"), make_receiver(prefect, tmp_path, "b")
    yield a, b
    a.close()
    b.close()


def doc(step: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "policy": {"uri": POLICY.as_uri(), "sha256": hashlib.sha256(POLICY.read_bytes()).hexdigest()},
        "env": {"id": "CartPole-v1"},
        "protocol": {"episodes": 8, "seed": 11, "max_steps": 50},
        "training_run_id": "trainer-run-1",
        "step": step,
    }
    body.update(extra)
    return body


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def post(receiver: Receiver, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """What the app answers: (status, JSON body), a ``Rejected`` as its status and body."""
    try:
        return receiver.create(body, lower(headers), BASE)
    except Rejected as err:
        return err.status, err.body


def get(receiver: Receiver, evaluation_id: str) -> dict[str, Any]:
    headers = signed_read_headers(f"/v1/evaluations/{evaluation_id}", SECRET)
    return receiver.status(evaluation_id, lower(headers), BASE)


# ------------------------------------------------------- a delivery id reused on another receiver


def test_a_delivery_id_reused_for_another_body_is_a_conflict_on_every_receiver(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    """A restarted trainer's delivery counter starts over: step 8 reuses step 7's delivery id.

    Receiver B found step 7's run by the delivery's tag and answered 200 with it, so step 8 was
    never evaluated and its status URL served step 7's numbers; receiver A said 409.
    """
    a, b = receivers
    step7, step8 = canonical_json(doc(7)), canonical_json(doc(8))
    status, first = post(a, step7, signed_headers(step7, SECRET, delivery_id="trainer-1"))
    assert status == 202 and first["step"] == 7 and first["duplicate"] is None

    status, answer = post(b, step8, signed_headers(step8, SECRET, delivery_id="trainer-1"))
    assert status == 409, answer
    assert answer["error"] == "conflict" and "different body" in answer["reason"]
    status, answer = post(a, step8, signed_headers(step8, SECRET, delivery_id="trainer-1"))
    assert status == 409 and answer["error"] == "conflict"
    assert len(prefect.runs) == 1  # nothing was started for the conflicting body

    # A true redelivery to the other receiver is still that evaluation, said so.
    status, again = post(b, step7, signed_headers(step7, SECRET, delivery_id="trainer-1"))
    assert status == 200 and again["id"] == first["id"] and again["duplicate"] == "delivery"
    # Step 8 under a new delivery id is its own evaluation.
    status, new = post(b, step8, signed_headers(step8, SECRET, delivery_id="trainer-2"))
    assert status == 202 and new["step"] == 8 and new["id"] != first["id"]


def test_a_run_made_before_body_tags_is_compared_by_its_cache_key(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    a, b = receivers
    step7, step8 = canonical_json(doc(7)), canonical_json(doc(8))
    status, first = post(a, step7, signed_headers(step7, SECRET, delivery_id="old-1"))
    assert status == 202
    run = prefect.runs[0]
    run.tags = [t for t in run.tags if not t.startswith("evalfleet-body:")]
    assert post(b, step8, signed_headers(step8, SECRET, delivery_id="old-1"))[0] == 409
    status, again = post(b, step7, signed_headers(step7, SECRET, delivery_id="old-1"))
    assert status == 200 and again["id"] == first["id"] and again["duplicate"] == "delivery"


# ------------------------------------------------------------- a replay under a fresh delivery id


def test_a_captured_webhook_replayed_under_a_fresh_delivery_id_is_refused(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    """The delivery id was not signed: after a failed run, each replay of a captured request
    with a new X-Evalfleet-Delivery started a new evaluation (and sent callbacks)."""
    a, b = receivers
    body = canonical_json(doc(3))
    captured = signed_headers(body, SECRET, delivery_id="real-1")
    status, first = post(a, body, captured)
    assert status == 202
    prefect.end(first["flow_run_id"], "FAILED", "the cluster went away")

    for i, receiver in enumerate((a, b, a)):
        replay = dict(captured, **{DELIVERY_HEADER: f"forged-{i}"})
        status, answer = post(receiver, body, replay)
        assert status == 401, answer
        assert answer["error"] == "unauthorized" and answer["code"] == "invalid_signature"
    assert len(prefect.runs) == 1

    # The captured request as sent is a redelivery of the failed run, never a new run.
    for receiver in (a, b):
        status, answer = post(receiver, body, captured)
        assert status == 200 and answer["id"] == first["id"] and answer["duplicate"] == "delivery"
    assert len(prefect.runs) == 1
    # The trainer itself re-sending the request under a new delivery id (newly signed) does
    # start a new evaluation after the failure.
    status, retry = post(b, body, signed_headers(body, SECRET, delivery_id="real-2"))
    assert status == 202 and retry["id"] != first["id"] and len(prefect.runs) == 2


def test_a_webhook_signed_over_the_body_alone_is_refused(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    from evalfleet.callback import sign

    a, _ = receivers
    body = canonical_json(doc(4))
    now = int(time.time())
    headers = {TIMESTAMP_HEADER: str(now), SIGNATURE_HEADER: sign(body, SECRET, now),
               DELIVERY_HEADER: "d-1"}
    status, answer = post(a, body, headers)
    assert status == 401 and answer["code"] == "invalid_signature"
    assert "<delivery>" in answer["reason"] and not prefect.runs


# ---------------------------------------------------- the report of a run that crashed afterwards


def write_report(receiver: Receiver, evaluation_id: str, callback: str | None) -> Path:
    report: dict[str, Any] = {"request_id": evaluation_id, "step": 5, "returns": {"mean": 445.75},
                              "alarms": [], "history": {"verdict": "first", "best_step": 5},
                              "outputs": {"folder": "x"}}
    if callback is not None:
        report["outputs"]["callback"] = callback
    path = run_dir(receiver.config.output, evaluation_id) / "report.json"
    write_json(report, path)
    return path


def test_get_returns_the_report_a_crashed_run_wrote(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    """GET said CRASHED with no report although report.json (and the MLflow run) existed."""
    a, b = receivers
    body = canonical_json(doc(5))
    status, accepted = post(a, body, signed_headers(body, SECRET))
    assert status == 202
    write_report(a, accepted["id"], "delivered: HTTP 200 after 1 attempt (3.01 s)")
    prefect.end(accepted["flow_run_id"], "CRASHED", "the flow-run process was killed")
    for receiver in (a, b):
        answer = get(receiver, accepted["id"])
        assert answer["state"] == "CRASHED" and answer["final"] is True
        assert answer["report"] is not None and answer["report"]["returns"]["mean"] == 445.75
        assert answer["report_from_failed_run"] is True
        assert answer["verdict"] == "first" and answer["best_step"] == 5
        assert "after its report was written" in answer["message"]
        assert "killed" in answer["message"]


def test_get_of_a_failed_run_without_a_report_has_none(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    a, _ = receivers
    body = canonical_json(doc(6))
    status, accepted = post(a, body, signed_headers(body, SECRET))
    prefect.end(accepted["flow_run_id"], "FAILED", "policy returned NaN")
    answer = get(a, accepted["id"])
    assert answer["state"] == "FAILED" and answer["report"] is None
    assert answer["report_from_failed_run"] is False and answer["message"] == "policy returned NaN"


# ------------------------------------------------------------- the failure hook after a report


class Trainer(ThreadingHTTPServer):
    calls: list[dict[str, Any]]


@pytest.fixture
def trainer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Trainer]:
    class Handler(BaseHTTPRequestHandler):
        server: Trainer

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:  # every POST is recorded, verified or not
                verify(body, self.headers.get(SIGNATURE_HEADER), self.headers.get(TIMESTAMP_HEADER),
                       CALLBACK_SECRET, delivery_id=self.headers.get(DELIVERY_HEADER, ""))
                verified = True
            except Exception:
                verified = False
            self.server.calls.append({"event": self.headers.get(EVENT_HEADER),
                                      "delivery": self.headers.get(DELIVERY_HEADER),
                                      "verified": verified, "body": json.loads(body)})
            self.send_response(200 if verified else 401)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = Trainer(("127.0.0.1", 0), Handler)
    server.calls = []
    monkeypatch.setenv(ALLOWED_HOSTS_ENV, "127.0.0.1")
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", CALLBACK_SECRET)
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "1")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def crash(trainer: Trainer, output: Path, request_id: str, state: str = "CRASHED") -> None:
    """Run serve's on_crashed/on_failure hook for a flow run of ``request_id``."""
    from deployments.serve import notify_failure

    url = f"http://127.0.0.1:{trainer.server_address[1]}/cb"
    request = {"request_id": request_id, "callback_url": url, "output": str(output),
               "training_run_id": "trainer-run-1", "step": 5}
    flow_run = SimpleNamespace(id=uuid.uuid4(), parameters={"request": request})
    notify_failure(None, flow_run, State(type=StateType(state), message="killed"))


def test_no_failure_notice_after_a_delivered_report(trainer: Trainer, tmp_path: Path,
                                                    prefect: MemoryPrefect) -> None:
    """Killed after stage 7 delivered the report, the run CRASHED and the hook sent
    evaluation.failed with the report's delivery id: a de-duplicating trainer dropped it, the
    other kind saw "failed" after "completed" and evaluated the step again."""
    receiver = make_receiver(prefect, tmp_path, "a")
    write_report(receiver, "eval-delivered", "delivered: HTTP 200 after 1 attempt (3.01 s)")
    crash(trainer, receiver.config.output, "eval-delivered")
    assert trainer.calls == []
    receiver.close()


def test_a_report_written_but_not_known_delivered_is_sent_again_as_completed(
        trainer: Trainer, tmp_path: Path, prefect: MemoryPrefect) -> None:
    receiver = make_receiver(prefect, tmp_path, "a")
    path = write_report(receiver, "eval-unsure", None)  # killed while the callback was sent
    crash(trainer, receiver.config.output, "eval-unsure")
    assert [(c["event"], c["delivery"], c["verified"]) for c in trainer.calls] == [
        ("evaluation.completed", "eval-unsure:completed", True)]
    assert trainer.calls[0]["body"]["returns"]["mean"] == 445.75
    assert json.loads(path.read_text())["outputs"]["callback"].startswith("delivered")
    receiver.close()


def flush_records(path: Path, run_id: str) -> None:
    """What a flush records in report.json once it logged the queued run (``tracking.flush_pending``)."""
    from evalfleet import tracking
    from evalfleet.storage import report_lock

    with report_lock(path):
        tracking._note_logged(path, "sqlite:///late.db", run_id)


def queued_report(receiver: Receiver, evaluation_id: str) -> Path:
    """A report written by stage 7 whose MLflow run was queued, its queue file logged since."""
    path = write_report(receiver, evaluation_id, None)
    report = json.loads(path.read_text())
    report["outputs"].update(mlflow_error="ConnectionError: planted",
                             mlflow_queued=str(receiver.config.output / "mlflow-pending" / "gone.json"))
    write_json(report, path)
    return path


def test_a_flush_during_the_hooks_callback_keeps_its_run_in_report_json(
        trainer: Trainer, tmp_path: Path, prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """'evalfleet mlflow flush' logged the queued run while the hook sent the report again; the
    hook then wrote back the report it had read before: 'mlflow_queued', no run id, for good."""
    import deployments.serve as serve

    receiver = make_receiver(prefect, tmp_path, "a")
    path = queued_report(receiver, "eval-queued")
    real = serve.send_report_callback

    def flush_meanwhile(url: str, report: dict[str, Any], **kwargs: Any) -> str:
        outcome: str = real(url, report, **kwargs)
        # What a flush records once it logged the queued run (tracking.flush_pending).
        flush_records(path, "late-run-1")
        return outcome

    monkeypatch.setattr(serve, "send_report_callback", flush_meanwhile)
    crash(trainer, receiver.config.output, "eval-queued")
    outputs = json.loads(path.read_text())["outputs"]
    assert outputs["mlflow_run_id"] == "late-run-1" and "mlflow_queued" not in outputs
    assert outputs["mlflow_queued_after"] == "ConnectionError: planted"
    assert outputs["callback"].startswith("delivered")
    assert [c["delivery"] for c in trainer.calls] == ["eval-queued:completed"]
    receiver.close()


def test_a_flush_writing_report_json_as_the_hook_does_loses_neither_write(
        trainer: Trainer, tmp_path: Path, prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the flush read report.json, then the hook wrote its callback outcome, then the
    flush wrote what it read plus its run id: the outcome was lost (unlocked read-and-write)."""
    import deployments.serve as serve
    from evalfleet import tracking

    receiver = make_receiver(prefect, tmp_path, "a")
    path = queued_report(receiver, "eval-straddled")
    read, go = threading.Event(), threading.Event()

    class PausedJson:  # the flush pauses between reading report.json and writing it
        loads = staticmethod(json.loads)

        @staticmethod
        def dumps(*args: Any, **kwargs: Any) -> str:
            read.set()
            go.wait(2)  # the hook's write comes now, or (locked out) after this write
            return json.dumps(*args, **kwargs)

    monkeypatch.setattr(tracking, "json", PausedJson)
    flush = threading.Thread(target=flush_records, args=(path, "late-run-2"))
    real = serve.send_report_callback

    def flush_reads_meanwhile(url: str, report: dict[str, Any], **kwargs: Any) -> str:
        flush.start()
        assert read.wait(10)
        outcome: str = real(url, report, **kwargs)
        return outcome

    monkeypatch.setattr(serve, "send_report_callback", flush_reads_meanwhile)
    crash(trainer, receiver.config.output, "eval-straddled")
    go.set()
    flush.join(10)
    outputs = json.loads(path.read_text())["outputs"]
    assert outputs["callback"].startswith("delivered"), outputs
    assert outputs["mlflow_run_id"] == "late-run-2" and "mlflow_queued" not in outputs
    receiver.close()


def test_a_run_without_a_report_gets_a_failure_notice_with_its_own_delivery_id(
        trainer: Trainer, tmp_path: Path) -> None:
    crash(trainer, tmp_path / "results", "eval-none", state="FAILED")
    assert [(c["event"], c["delivery"], c["verified"]) for c in trainer.calls] == [
        ("evaluation.failed", "eval-none:failed", True)]
    assert trainer.calls[0]["body"]["state"] == "FAILED"
    assert trainer.calls[0]["body"]["request_id"] == "eval-none"


# ------------------------------------------------------- half a training checkpoint


@pytest.mark.parametrize("drop", ["training_run_id", "step"])
def test_a_training_run_id_or_a_step_alone_is_a_bad_request(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect, drop: str) -> None:
    # It was accepted (202) and evaluated with no history and no verdict, and no word of it.
    body = doc(7)
    del body[drop]
    raw = canonical_json(body)
    status, answer = post(receivers[0], raw, signed_headers(raw, SECRET, delivery_id=f"half-{drop}"))
    assert status == 400, answer
    assert answer["error"] == "invalid_request" and "go together" in answer["reason"], answer
    assert not prefect.runs  # nothing was started


# ------------------------------------------------------- one delivery id handled twice at once


class HeldFetch:
    """``fetch_policy`` whose first call waits until ``release`` is set: a slow policy download."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_first: bool = False) -> None:
        import deployments.webhook.receiver as module

        self.real = module.fetch_policy
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0
        self.fail_first = fail_first
        self.lock = threading.Lock()
        monkeypatch.setattr(module, "fetch_policy", self)

    def __call__(self, *args: Any) -> Path:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.entered.set()
            assert self.release.wait(10), "the held fetch was never released"
            if self.fail_first:
                raise Rejected(503, "unavailable", "policy store went away")
        path: Path = self.real(*args)
        return path


def post_in_thread(receiver: Receiver, raw: bytes, delivery_id: str,
                   done: threading.Event | None = None
                   ) -> tuple[threading.Thread, list[tuple[int, dict[str, Any]]]]:
    """``post`` in a thread, as the app's threadpool runs it; its answer lands in the list."""
    answers: list[tuple[int, dict[str, Any]]] = []

    def go() -> None:
        answers.append(post(receiver, raw, signed_headers(raw, SECRET, delivery_id=delivery_id)))
        if done is not None:
            done.set()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, answers


def seen_pending(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set once a delivery finds its id held by one of its body still being handled."""
    seen = threading.Event()
    reserve = getattr(receiver.store, "reserve", None)
    if reserve is None:  # the store before reservations: nothing waits
        return seen

    def spy(delivery_id: str, body_sha256: str) -> tuple[str, str] | None:
        held_by = reserve(delivery_id, body_sha256)
        if held_by is not None and held_by[0] == "":
            seen.set()
        return held_by

    monkeypatch.setattr(receiver.store, "reserve", spy)
    return seen


def test_one_delivery_id_with_two_bodies_at_once_is_one_run_and_a_409(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before the policy fetch and recorded after the run was created, a delivery id
    sent with steps 5 and 6 at once got two 202s and two flow runs; the trainer's retries then
    got 409 for the accepted step 5 and 'duplicate' for step 6."""
    a, _ = receivers
    held = HeldFetch(monkeypatch)
    step5, step6 = canonical_json(doc(5)), canonical_json(doc(6))
    thread, first = post_in_thread(a, step5, "trainer-delivery-42")
    assert held.entered.wait(10)  # step 5 is fetching its policy
    status, answer = post(a, step6, signed_headers(step6, SECRET, delivery_id="trainer-delivery-42"))
    held.release.set()
    thread.join(10)
    assert status == 409, answer
    assert answer["error"] == "conflict" and "different body" in answer["reason"]
    assert first[0][0] == 202 and first[0][1]["step"] == 5
    assert len(prefect.runs) == 1 and held.calls == 1  # step 6's policy was not even fetched

    # The retries agree with the first answers.
    status, again = post(a, step5, signed_headers(step5, SECRET, delivery_id="trainer-delivery-42"))
    assert status == 200 and again["id"] == first[0][1]["id"] and again["duplicate"] == "delivery"
    assert post(a, step6, signed_headers(step6, SECRET, delivery_id="trainer-delivery-42"))[0] == 409
    assert len(prefect.runs) == 1


def test_a_delivery_repeated_while_it_is_handled_waits_and_is_the_duplicate(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The repeat gets the answer it gets after the first one: 200, duplicate, the same id."""
    a, _ = receivers
    held = HeldFetch(monkeypatch)
    step5 = canonical_json(doc(5))
    thread, first = post_in_thread(a, step5, "again-1")
    assert held.entered.wait(10)
    waiting = seen_pending(a, monkeypatch)
    repeat, second = post_in_thread(a, step5, "again-1", done=waiting)  # done: the old code
    assert waiting.wait(10)
    held.release.set()
    thread.join(10)
    repeat.join(10)
    assert first[0][0] == 202 and first[0][1]["duplicate"] is None
    assert second[0][0] == 200, second
    assert second[0][1]["id"] == first[0][1]["id"] and second[0][1]["duplicate"] == "delivery"
    assert len(prefect.runs) == 1 and held.calls == 1


def test_a_delivery_that_failed_while_its_repeat_waited_leaves_the_id_to_the_repeat(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = receivers
    held = HeldFetch(monkeypatch, fail_first=True)
    step5, step6 = canonical_json(doc(5)), canonical_json(doc(6))
    thread, first = post_in_thread(a, step5, "flaky-1")
    assert held.entered.wait(10)
    waiting = seen_pending(a, monkeypatch)
    repeat, second = post_in_thread(a, step5, "flaky-1", done=waiting)
    assert waiting.wait(10)
    held.release.set()
    thread.join(10)
    repeat.join(10)
    assert first[0][0] == 503
    assert second[0][0] == 202 and second[0][1]["step"] == 5, second
    assert len(prefect.runs) == 1 and held.calls == 2
    assert post(a, step6, signed_headers(step6, SECRET, delivery_id="flaky-1"))[0] == 409


def test_a_failed_creation_releases_the_delivery_id(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    a, _ = receivers
    step5 = canonical_json(doc(5))
    real = prefect.create_flow_run

    def down(*args: Any, **kwargs: Any) -> FlowRun:
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(prefect, "create_flow_run", down)
    status, answer = post(a, step5, signed_headers(step5, SECRET, delivery_id="retry-1"))
    assert status == 503 and answer["error"] == "unavailable"
    assert a.store.delivery("retry-1") is None
    monkeypatch.setattr(prefect, "create_flow_run", real)
    status, answer = post(a, step5, signed_headers(step5, SECRET, delivery_id="retry-1"))
    assert status == 202 and len(prefect.runs) == 1


def test_a_reservation_left_by_a_dead_receiver_delays_its_body_once(
        receivers: tuple[Receiver, Receiver], prefect: MemoryPrefect) -> None:
    """Killed between reserving and recording, a receiver leaves the id pending: the same body
    goes on after the wait (Prefect's idempotency key still decides the run), another is a 409."""
    a, _ = receivers
    a.pending_wait_s = 0.2
    step5, step6 = canonical_json(doc(5)), canonical_json(doc(6))
    assert a.store.reserve("orphan-1", hashlib.sha256(step5).hexdigest()) is None
    assert post(a, step6, signed_headers(step6, SECRET, delivery_id="orphan-1"))[0] == 409
    status, answer = post(a, step5, signed_headers(step5, SECRET, delivery_id="orphan-1"))
    assert status == 202 and answer["step"] == 5
    assert a.store.delivery("orphan-1") == (answer["id"], hashlib.sha256(step5).hexdigest())
    status, again = post(a, step5, signed_headers(step5, SECRET, delivery_id="orphan-1"))
    assert status == 200 and again["id"] == answer["id"] and again["duplicate"] == "delivery"
    assert len(prefect.runs) == 1


def test_a_callback_the_hook_could_not_deliver_is_an_alarm_in_the_mlflow_run_too(
        trainer: Trainer, tmp_path: Path, prefect: MemoryPrefect, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook added ``output_missing`` to report.json; the run already logged in MLflow lacked it."""
    from mlflow.tracking import MlflowClient

    receiver = make_receiver(prefect, tmp_path, "a")
    path = write_report(receiver, "eval-unsent", None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("evalfleet"))
    report = json.loads(path.read_text())
    report["outputs"].update(mlflow_uri=uri, mlflow_run_id=run.info.run_id)
    write_json(report, path)
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "not-the-trainers")  # it answers 401
    crash(trainer, receiver.config.output, "eval-unsent")
    final = json.loads(path.read_text())
    assert [a.split(":")[0] for a in final["alarms"]] == ["output_missing"]
    logged = client.get_run(run.info.run_id).data
    assert logged.tags.get("evalfleet.alarm.output_missing") == "true"
    assert logged.metrics["eval/alarm_count"] == 1.0
    receiver.close()
