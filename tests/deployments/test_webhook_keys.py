"""Which deliveries are one evaluation: the idempotency key over the body."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from deployments.webhook.schema import idempotency_key, parse_body
from evalfleet.callback import canonical_json


def body(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "policy": {"uri": "file:///policies/p.pt", "sha256": "ab" * 32},
        "env": {"id": "CartPole-v1"},
        "protocol": {"episodes": 12, "seed": 3, "max_steps": 200},
    }
    doc.update(extra)
    return doc


def key(doc: dict[str, Any]) -> str:
    return idempotency_key(parse_body(json.dumps(doc).encode()))


def test_the_same_weights_at_another_step_are_another_checkpoint() -> None:
    # Same weights, same protocol, later step: its own history row and callback, not step 10's.
    at_10 = key(body(training_run_id="run-7", step=10))
    assert key(body(training_run_id="run-7", step=10)) == at_10  # a redelivery is one evaluation
    assert key(body(training_run_id="run-7", step=20)) != at_10
    assert key(body(training_run_id="run-8", step=10)) != at_10


def test_a_body_without_training_fields_keeps_its_key() -> None:
    # Keys of bodies that name no training run are what they were (no needless new flow runs).
    before = {"policy_sha256": "ab" * 32, "policy_factory": None, "env": "CartPole-v1",
              "env_kwargs": {}, "seed": 3, "episodes": 12, "max_steps": 200,
              "deterministic": True}
    assert key(body()) == hashlib.sha256(canonical_json(before)).hexdigest()
    assert key(body()) != key(body(step=0))
    assert key(body(callback_url=None)) == key(body())


def test_a_delivery_naming_another_callback_or_experiment_is_another_evaluation() -> None:
    """Answered "duplicate", a redelivery with a new callback URL (the trainer's listener came
    back on another port) never got its callback, and one naming another experiment logged
    nowhere new. The flow's cache still answers its episodes."""
    first = key(body(callback_url="http://127.0.0.1:9001/cb", experiment="exp-A"))
    assert key(body(callback_url="http://127.0.0.1:9001/cb", experiment="exp-A")) == first
    assert key(body(callback_url="http://127.0.0.1:9002/cb", experiment="exp-A")) != first
    assert key(body(callback_url="http://127.0.0.1:9001/cb", experiment="exp-B")) != first


def test_serve_refuses_a_prefect_port_another_server_holds_before_starting_anything(
        tmp_path: Any) -> None:
    # The shared local server `python flows/eval.py` keeps is on 4200, serve's default: serve's
    # health check was answered by it, it said "ready", then its own server failed to bind and
    # the service shut down.
    import io
    import socket

    import pytest

    from deployments.cli import Service, StartupError, build_parser

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = build_parser().parse_args(["--prefect-port", str(port), "--port", "0",
                                          "--state-dir", str(tmp_path / "state")])
        service = Service(args, sink=io.StringIO())
        with pytest.raises(StartupError, match=rf"port {port} on 127.0.0.1 is already in use, so "
                           r"the Prefect server cannot start there .* pass --prefect-port 0"):
            service.start()
        assert service.children == []


def test_serve_and_the_receiver_refuse_settings_no_evaluation_can_use(tmp_path: Any,
                                                                    monkeypatch: Any) -> None:
    # Started with them, the service said "ready" and answered every valid delivery 400, blaming
    # the trainer's body.
    import pytest

    monkeypatch.delenv("PREFECT_API_URL", raising=False)  # restored after: the receiver sets it

    from deployments.cli import build_parser, serve
    from deployments.webhook.cli import build_parser as receiver_parser
    from deployments.webhook.cli import config_from_args

    args = build_parser().parse_args(["--isolation", "bogus", "--state-dir", str(tmp_path / "s"),
                                      "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"the service's settings .* make no valid evaluation: "
                       r".*isolation"):
        serve(args)
    args = receiver_parser().parse_args(["--experiment", "", "--prefect-api-url",
                                         "http://127.0.0.1:9/api", "--output", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=r"make no valid evaluation: 'experiment' is empty"):
        config_from_args(args)
    assert "PREFECT_API_URL" not in os.environ  # refused before it pointed this process anywhere
    assert not (tmp_path / "out").exists() and not (tmp_path / "s").exists()
