"""A baseline equal to the policy, and a cache hit's report, through the real flow."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from evalfleet.models import EvalReport, EvalRequest
from flows.eval import evaluate
from tests.sandbox import faulty_envs

pytestmark = pytest.mark.slow

#: Report fields that may differ between a miss and the hit it filled: when and where it ran.
PER_RUN = ("request_id", "timings", "cache", "outputs", "steps_per_second", "episodes_per_second")


def _evaluate_within(request: EvalRequest, seconds: float) -> EvalReport:
    """``evaluate`` in a thread, failing the test (not hanging it) if it has not returned in time."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["report"] = evaluate(request)
        except BaseException as err:  # handed to the test thread
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"evaluate did not return within {seconds:.0f} s (deadlock?)"
    if "error" in out:
        raise out["error"]
    return out["report"]


def test_baseline_equal_to_the_policy_reuses_its_episodes(prefect_server, tmp_path, example_policy):
    t0 = time.monotonic()
    report = _evaluate_within(EvalRequest.build(
        policy=example_policy, baseline=example_policy, episodes=20, concurrency=10, seed=3,
        output=tmp_path / "out"), seconds=300)
    c = report.comparison
    assert c is not None and c["n"] == 20
    assert c["mean_diff"] == 0.0 and c["ci"]["low"] == 0.0 and c["ci"]["high"] == 0.0
    assert c["verdict"] == "not distinguishable"
    assert c["baseline_policy_sha256"] == report.policy_sha256
    assert time.monotonic() - t0 < 300


def _comparable(report: EvalReport) -> dict[str, Any]:
    data = report.model_dump(mode="json")
    for name in PER_RUN:
        data.pop(name)
    data["manifest"] = {k: v for k, v in data["manifest"].items()
                        if k not in ("request_id", "config", "created", "output")}
    return data


def _raise_on_step(tmp_path: Any, isolation: str) -> EvalRequest:
    """40 episodes of an env that raises on some seeds (env errors, deterministic per seed)."""
    return EvalRequest.build(
        env=faulty_envs.env_id("RaiseOnStep"), policy="tests.sandbox.faulty_envs:balance",
        episodes=40, concurrency=20, output=tmp_path / "out", isolation=isolation)


def test_a_hit_reports_what_the_miss_reported(prefect_server, tmp_path):
    request = _raise_on_step(tmp_path, "inprocess")
    miss = evaluate(request)
    hit = evaluate(request.model_copy(update={"request_id": "second"}))
    assert (miss.cache["status"], hit.cache["status"]) == ("miss", "hit")
    assert miss.failures.get("env_error", 0) >= 1 and miss.failure_clusters
    a, b = _comparable(miss), _comparable(hit)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def test_env_errors_raised_in_sandboxes_run_again_and_report_the_same(prefect_server, tmp_path):
    # In a sandbox an env error may be the confinement's (a refused file or socket): it is not
    # cached, so the second request runs exactly those episodes again, and says so.
    request = _raise_on_step(tmp_path, "process")
    miss = evaluate(request)
    again = evaluate(request.model_copy(update={"request_id": "second"}))
    errors = miss.failures.get("env_error", 0)
    assert errors >= 1 and miss.cache["status"] == "miss"
    assert again.cache["status"] == "partial"
    assert again.cache["reused"] == 40 - errors and again.cache["computed"] == errors, again.cache
    a, b = _comparable(miss), _comparable(again)
    for name in a:
        assert a[name] == b[name], name
