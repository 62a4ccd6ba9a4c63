"""The flow-run heartbeat replacement: same events, a prompt stop, only on a checked Prefect."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow_engine

from flows import heartbeats


class _Engine:
    """The part of Prefect's ``FlowRunEngine`` the heartbeat context uses, recording emissions."""

    heartbeat_seconds = 30

    def __init__(self) -> None:
        self.flow_run = SimpleNamespace(state=None)
        self.logger = SimpleNamespace(debug=lambda *a, **k: None)
        self.emitted = threading.Event()
        self.count = 0

    def _build_heartbeat_event_template(self) -> tuple[dict[str, Any], list[Any]]:
        return {"prefect.resource.id": "prefect.flow-run.x"}, []

    def _emit_flow_run_heartbeat(self, resource: dict[str, Any], related: list[Any]) -> None:
        self.count += 1
        self.emitted.set()


def test_emits_at_start_and_stops_at_once_when_the_run_ends():
    engine = _Engine()
    with heartbeats.prompt_heartbeats(engine):
        assert engine.emitted.wait(5)
        t0 = time.perf_counter()
    # Prefect 3.8's own thread sleeps in 1 s steps and is joined here (up to 1 s per flow run).
    assert time.perf_counter() - t0 < 0.3
    assert engine.count == 1


def test_heartbeats_off_by_setting_start_no_thread():
    engine = _Engine()
    engine.heartbeat_seconds = None
    with heartbeats.prompt_heartbeats(engine):
        pass
    assert engine.count == 0


def test_installed_only_on_a_checked_prefect(monkeypatch: pytest.MonkeyPatch):
    own = object()
    monkeypatch.setattr(flow_engine, "_send_heartbeats", own)
    assert heartbeats.install("3.9.0") is False
    assert flow_engine._send_heartbeats is own
    monkeypatch.setattr(flow_engine, "_send_heartbeats", lambda engine, join_on_exit=True: None)
    assert heartbeats.install("3.8.8") is True
    assert flow_engine._send_heartbeats is heartbeats.prompt_heartbeats


def test_flows_runtime_installs_it_on_this_prefect():
    import prefect

    import flows.runtime  # noqa: F401 -- installs at import

    if ".".join(prefect.__version__.split(".")[:2]) in heartbeats.TESTED_PREFECT:
        assert flow_engine._send_heartbeats is heartbeats.prompt_heartbeats
