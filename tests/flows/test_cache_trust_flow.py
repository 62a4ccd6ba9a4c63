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
    # The one difference: the partial run's episodes come from two runs, and it says which.
    [first] = a["manifest"].pop("computed_by")
    by = b["manifest"].pop("computed_by")
    assert [(r["request_id"], r["episodes"]) for r in by] == [
        (first["request_id"], 40 - errors), ("second", errors)]
    assert by[0]["execution"] == first["execution"]
    for name in a:
        assert a[name] == b[name], name


def test_a_hit_states_the_execution_its_episodes_ran_with(prefect_server, tmp_path, example_policy):
    """A miss with ``workers=1, concurrency=10``, then a full hit asked with ``workers=2,
    concurrency=4``: before, the hit's manifest and its MLflow param said 4 and 2 for episodes
    that ran with 10 and 1 (its own episodes.parquet: 10 sandboxes, worker 0 only). Throughput
    through the flow too: the hit ran nothing (null), a top-up only its own episodes."""
    import json
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from evalfleet.storage import read_episodes

    base = {"policy": example_policy, "episodes": 20, "seed": 3, "output": tmp_path / "out"}
    miss = evaluate(EvalRequest.build(**base, workers=1, concurrency=10))
    hit = evaluate(EvalRequest.build(**base, workers=2, concurrency=4))
    assert (miss.cache["status"], hit.cache["status"]) == ("miss", "hit")
    execution = hit.manifest["execution"]
    assert (execution["concurrency"], execution["workers"]) == (10, 1)
    assert execution == miss.manifest["execution"]
    assert hit.manifest["computed_by"] == miss.manifest["computed_by"]
    [run] = hit.manifest["computed_by"]
    assert (run["request_id"], run["episodes"], run["execution"]) == (miss.request_id, 20, execution)
    assert run["computed_at"].endswith("Z")
    on_disk = json.loads(Path(hit.outputs["report"]).read_text())
    assert on_disk["manifest"]["execution"]["concurrency"] == 10
    assert on_disk["manifest"]["computed_by"][0]["request_id"] == miss.request_id
    params = MlflowClient(hit.outputs["mlflow_uri"]).get_run(hit.outputs["mlflow_run_id"]).data.params
    assert params["concurrency"] == "10"
    assert hit.steps_per_second is None and on_disk["steps_per_second"] is None

    top = evaluate(EvalRequest.build(**dict(base, episodes=30), workers=1, concurrency=4))
    assert (top.cache["status"], top.cache["reused"], top.cache["computed"]) == ("partial", 20, 10)
    assert top.manifest["execution"]["concurrency"] == 4
    assert [(r["request_id"], r["episodes"]) for r in top.manifest["computed_by"]] == [
        (miss.request_id, 20), (top.request_id, 10)]
    rows = read_episodes(top.outputs["episodes"]).to_pydict()
    ran = sum(n for i, n in zip(rows["episode_index"], rows["length"], strict=True) if i >= 20)
    assert top.steps_per_second == ran / top.timings["run_episodes"]
    assert top.episodes_per_second == 10 / top.timings["run_episodes"]
