"""Throughput counts the episodes an evaluation ran, over the time it ran them: never cached ones.

Planted stage 6 (``pipeline.summarize``) of a top-up (200 episodes from the cache, 20 run in
0.976 s) and of a full hit (nothing run), read on every surface: report.json, the CLI summary,
the MLflow metrics (a real SQLite store), the Evaluator's result and the report page.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from evalfleet.audit import RoundSchedule
from evalfleet.client import result_from_report
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import Collected, summarize
from evalfleet.records import EpisodeRecord, empty_episodes, records_to_table
from evalfleet.summary import summary_text
from evalfleet.tracking import flatten_metrics

ENV = "CartPole-v1"
RUN_SECONDS = 0.976


def _rows(indices: range, length: int, request_id: str) -> pa.Table:
    """Completed episodes of ``length + i % 7`` steps each, computed by ``request_id``."""
    return records_to_table([
        EpisodeRecord(request_id, "ab" * 32, ENV, "spec", i, 1000 + i, float(length + i % 7),
                      length + i % 7, "terminated", None, None, 0.01, "0", f"sb{i % 10}", "inprocess")
        for i in indices])


def _stage6(tmp_path: Path, cached: pa.Table, fresh: pa.Table, run_seconds: float) -> EvalReport:
    """Stage 6 of an evaluation that took ``cached`` from the cache and ran ``fresh``."""
    episodes = cached.num_rows + fresh.num_rows
    request = EvalRequest(env=ENV, policy="x", episodes=episodes, seed=0, audit=False,
                          output=tmp_path, cache_dir=tmp_path / "cache", request_id="this-run")
    received = SimpleNamespace(env_spec={"env_id": ENV, "max_episode_steps": 500},
                               env_spec_hash="spec", isolation="inprocess",
                               artifact=SimpleNamespace(summary=lambda: {"sha256": "ab" * 32}),
                               cache_key="cd" * 32, cache_ingredients={}, seconds=0.0,
                               device="cpu", device_fallback=None)
    table = pa.concat_tables([cached, fresh]).sort_by("episode_index")
    collected = Collected(table=table, fresh=fresh, audit_rows=empty_episodes(),
                          run_seconds=run_seconds, seconds=0.0, plan_cached=cached.num_rows,
                          plan_seconds=0.0, cache_status="partial" if fresh.num_rows else "hit",
                          cache_corrupt=False)
    return summarize(request, received, RoundSchedule(request), collected)  # type: ignore[arg-type]


def test_a_top_up_reports_the_rate_of_the_episodes_it_ran(tmp_path):
    """Before: all 220 episodes' steps over the 0.976 s the 20 fresh ones took, ~11x too high."""
    cached, fresh = _rows(range(200), 400, "filled-it"), _rows(range(200, 220), 420, "this-run")
    report = _stage6(tmp_path, cached, fresh, RUN_SECONDS)
    fresh_steps = sum(fresh.column("length").to_pylist())
    assert fresh_steps == 8_460
    assert report.cache["status"] == "partial" and report.env_steps == 8_460 + 80_594
    assert report.steps_per_second == fresh_steps / RUN_SECONDS  # 8,668 steps/s, not 91,244
    assert report.episodes_per_second == 20 / RUN_SECONDS
    data = report.model_dump(mode="json")
    assert data["steps_per_second"] == pytest.approx(8_668.03, abs=0.01)
    metrics = flatten_metrics(data)
    assert metrics["eval/fps"] == fresh_steps / RUN_SECONDS
    assert metrics["eval/episodes_per_second"] == 20 / RUN_SECONDS
    assert result_from_report(report, step=None)["eval/fps"] == fresh_steps / RUN_SECONDS
    assert "(8,668 env steps/s in run)" in summary_text(report)


def test_a_full_hit_reports_no_rate_on_any_surface(tmp_path):
    """Before: 88,654 steps over a run stage that ran nothing (floored at 1e-9 s: 8.9e13 steps/s)."""
    from mlflow.tracking import MlflowClient

    from evalfleet.review import report_page
    from evalfleet.storage import write_json
    from evalfleet.tracking import log_evaluation

    report = _stage6(tmp_path, _rows(range(220), 400, "filled-it"), empty_episodes(), 0.0)
    assert report.cache["status"] == "hit" and report.env_steps == 88_654
    assert report.steps_per_second is None and report.episodes_per_second is None
    path = write_json(report.model_dump(mode="json"), tmp_path / "report.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["steps_per_second"] is None and on_disk["episodes_per_second"] is None
    text = summary_text(report)
    assert "no episodes run (cache hit)" in text and "env steps/s" not in text
    result = result_from_report(report, step=3)
    assert result["eval/fps"] is None
    metrics = flatten_metrics(on_disk)
    assert "eval/fps" not in metrics and "eval/episodes_per_second" not in metrics
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = log_evaluation(uri, "evalfleet", on_disk, {"episodes": 220}, [path], "hit")
    logged = MlflowClient(uri).get_run(run_id).data.metrics
    assert "eval/fps" not in logged and "eval/episodes_per_second" not in logged
    assert logged["eval/episodes"] == 220.0  # the run was logged, with its other metrics
    assert report_page(report, [], {}, tmp_path / "report.html").exists()
