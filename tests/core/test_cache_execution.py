"""A report served from the cache states the execution settings its episodes ran with.

Planted evaluations on a real cache (``pipeline.store_in_cache``, ``lookup`` and stage 6's
``summarize``): a miss with ``workers=1, concurrency=10``, then requests with ``workers=2,
concurrency=4`` served from its entry (a full hit, a top-up, a hit over both runs' episodes),
and an entry stored before the cache kept the computing run's settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from evalfleet.audit import RoundSchedule
from evalfleet.cache import MANIFEST
from evalfleet.models import EvalReport, EvalRequest
from evalfleet.pipeline import (
    Collected,
    episode_cache,
    key_held,
    lookup,
    mlflow_params,
    store_in_cache,
    summarize,
)
from evalfleet.records import EpisodeRecord, empty_episodes, records_to_table

ENV = "CartPole-v1"
KEY = "e1" * 32
RECEIVED = SimpleNamespace(env_spec={"env_id": ENV, "max_episode_steps": 500}, env_spec_hash="spec",
                           isolation="inprocess",
                           artifact=SimpleNamespace(summary=lambda: {"sha256": "ab" * 32}),
                           cache_key=KEY, cache_ingredients={}, seconds=0.0, device="cpu",
                           device_fallback=None, replays=None)


def _request(tmp_path: Path, request_id: str, episodes: int, workers: int, concurrency: int) -> EvalRequest:
    return EvalRequest(env=ENV, policy="x", episodes=episodes, seed=0, audit=False, workers=workers,
                       concurrency=concurrency, output=tmp_path, cache_dir=tmp_path / "cache",
                       request_id=request_id)


def _rows(indices: range, request_id: str) -> pa.Table:
    return records_to_table([
        EpisodeRecord(request_id, "ab" * 32, ENV, "spec", i, 1000 + i, 20.0 + i % 5, 20 + i % 5,
                      "terminated", None, None, 0.01, "0", f"sb{i % 10}", "inprocess")
        for i in indices])


def _evaluate(request: EvalRequest) -> EvalReport:
    """Stages 2-6 of ``request`` over the cache: take what it holds, 'run' the rest, store, report."""
    with key_held(request, KEY):
        found = lookup(request, RECEIVED)  # type: ignore[arg-type]
        fresh = _rows(range(request.episodes), request.request_id).filter(
            pa.array([i in set(found.missing) for i in range(request.episodes)]))
        table = pa.concat_tables([found.stored, fresh]).sort_by("episode_index")
        collected = Collected(table=table, fresh=fresh, audit_rows=empty_episodes(), run_seconds=0.5,
                              seconds=0.0, plan_cached=found.stored.num_rows, plan_seconds=0.0,
                              cache_status=found.status, cache_corrupt=False, resumed=found.resumed)
        store_in_cache(request, RECEIVED, collected)  # type: ignore[arg-type]
    return summarize(request, RECEIVED, RoundSchedule(request), collected)  # type: ignore[arg-type]


def _runs(report: EvalReport) -> list[tuple[Any, ...]]:
    return [(r["request_id"], r["episodes"], (r["execution"] or {}).get("concurrency"),
             (r["execution"] or {}).get("workers")) for r in report.manifest["computed_by"]]


def test_a_hit_states_the_execution_of_the_run_that_computed_its_episodes(tmp_path):
    """Before, the hit's manifest said concurrency 4 and workers 2 (its own request's) and so did
    the MLflow param, for episodes that ran with 10 and 1."""
    miss = _evaluate(_request(tmp_path, "computing-run", 20, workers=1, concurrency=10))
    hit_request = _request(tmp_path, "hit-run", 20, workers=2, concurrency=4)
    hit = _evaluate(hit_request)
    assert (miss.cache["status"], hit.cache["status"]) == ("miss", "hit")
    execution = hit.manifest["execution"]
    assert (execution["concurrency"], execution["workers"]) == (10, 1)
    assert mlflow_params(hit_request, hit)["concurrency"] == 10
    # Field by field the miss's: its settings and the run that computed the episodes, by name.
    assert execution == miss.manifest["execution"]
    assert hit.manifest["computed_by"] == miss.manifest["computed_by"]
    assert _runs(hit) == [("computing-run", 20, 10, 1)]
    assert "execution_unknown" not in hit.manifest
    kept = episode_cache(hit_request).executions(KEY)  # in the entry's manifest, by request id
    assert list(kept) == ["computing-run"] and kept["computing-run"]["execution"] == execution

    # A top-up ran 10 episodes with its own settings: its execution, and the cache's run beside it.
    top = _evaluate(_request(tmp_path, "top-up", 30, workers=2, concurrency=4))
    assert top.cache["status"] == "partial"
    assert (top.manifest["execution"]["concurrency"], top.manifest["execution"]["workers"]) == (4, 2)
    assert _runs(top) == [("computing-run", 20, 10, 1), ("top-up", 10, 4, 2)]
    # A hit over both runs' episodes has no one execution to state: null, and why.
    both = _evaluate(_request(tmp_path, "hit-both", 30, workers=3, concurrency=7))
    assert both.cache["status"] == "hit" and both.manifest["execution"] is None
    assert both.manifest["execution_unknown"] == (
        "2 runs computed these episodes, each with its own settings: see computed_by")
    assert _runs(both) == [("computing-run", 20, 10, 1), ("top-up", 10, 4, 2)]
    assert mlflow_params(_request(tmp_path, "hit-both", 30, 3, 7), both)["concurrency"] is None
    # A hit over the first run's episodes only is that run's again.
    first = _evaluate(_request(tmp_path, "hit-first", 12, workers=3, concurrency=7))
    assert first.manifest["execution"] == miss.manifest["execution"]
    assert _runs(first) == [("computing-run", 12, 10, 1)]


def test_a_hit_of_an_entry_stored_without_the_runs_settings_says_it_does_not_know_them(tmp_path):
    """An entry stored by an evalfleet that kept no execution: before (and here, were nothing
    said), the hit stated its own request's settings as the run's."""
    _evaluate(_request(tmp_path, "computing-run", 20, workers=1, concurrency=10))
    manifest = episode_cache(_request(tmp_path, "x", 1, 1, 1)).entry(KEY) / MANIFEST
    data = json.loads(manifest.read_text())
    data.pop("executions", None)  # as an earlier evalfleet wrote it
    manifest.write_text(json.dumps(data))
    hit_request = _request(tmp_path, "hit-run", 20, workers=2, concurrency=4)
    hit = _evaluate(hit_request)
    assert hit.cache["status"] == "hit" and hit.manifest["execution"] is None
    assert hit.manifest["execution_unknown"].startswith(
        "the run that computed these episodes (request computing-run): not kept: the cache entry "
        "was stored by an evalfleet that did not keep")
    [run] = hit.manifest["computed_by"]
    assert (run["request_id"], run["episodes"], run["execution"]) == ("computing-run", 20, None)
    assert run["unknown"].startswith("not kept")
    assert mlflow_params(hit_request, hit)["concurrency"] is None  # never this request's 4


def test_a_request_id_used_again_with_other_settings_does_not_claim_the_first_runs_episodes(tmp_path):
    """Before, the second run's record replaced the first's under their one request id: a later hit
    over both runs' episodes stated concurrency 4 on 2 workers for 20 episodes that ran with 10 on 1."""
    _evaluate(_request(tmp_path, "delivery-7", 20, workers=1, concurrency=10))
    top = _evaluate(_request(tmp_path, "delivery-7", 30, workers=2, concurrency=4))
    assert top.cache["status"] == "partial"
    hit = _evaluate(_request(tmp_path, "hit-run", 30, workers=3, concurrency=7))
    assert hit.cache["status"] == "hit" and hit.manifest["execution"] is None
    [run] = hit.manifest["computed_by"]
    assert (run["request_id"], run["episodes"], run["execution"]) == ("delivery-7", 30, None)
    assert run["unknown"].startswith("unknown: two runs with this request id computed these episodes")
    assert hit.manifest["execution_unknown"].startswith(
        "the run that computed these episodes (request delivery-7): unknown: two runs")
    assert mlflow_params(_request(tmp_path, "hit-run", 30, 3, 7), hit)["concurrency"] is None

    # The same id again with the same settings is one run's settings, as stored.
    again = tmp_path / "again"
    _evaluate(_request(again, "delivery-8", 20, workers=1, concurrency=10))
    _evaluate(_request(again, "delivery-8", 30, workers=1, concurrency=10))
    same = _evaluate(_request(again, "hit-run", 30, workers=3, concurrency=7))
    assert (same.manifest["execution"]["concurrency"], same.manifest["execution"]["workers"]) == (10, 1)


def test_a_request_id_resumed_with_other_settings_does_not_claim_the_interrupted_runs_episodes(tmp_path):
    """An interrupted run persists shard files and no settings; re-run under its id with other
    settings, its resumed episodes were stated as computed with the re-run's (4 on 2 workers)."""
    interrupted = _request(tmp_path, "delivery-9", 20, workers=1, concurrency=10)
    episode_cache(interrupted).persist_shard(KEY, _rows(range(20), "delivery-9"))  # then killed
    rerun = _evaluate(_request(tmp_path, "delivery-9", 30, workers=2, concurrency=4))
    assert rerun.cache["status"] == "partial"
    hit = _evaluate(_request(tmp_path, "hit-run", 30, workers=3, concurrency=7))
    assert hit.cache["status"] == "hit" and hit.manifest["execution"] is None
    [run] = hit.manifest["computed_by"]
    assert (run["request_id"], run["episodes"], run["execution"]) == ("delivery-9", 30, None)
    assert run["unknown"].startswith("unknown: some of these episodes were recovered from an interrupted")

    # Resumed under another id (the CLI's way: each run its own): each run's settings stand.
    other = tmp_path / "other"
    episode_cache(_request(other, "killed", 20, 1, 10)).persist_shard(KEY, _rows(range(20), "killed"))
    _evaluate(_request(other, "resumer", 30, workers=2, concurrency=4))
    both = _evaluate(_request(other, "hit-run", 30, workers=3, concurrency=7))
    assert _runs(both) == [("killed", 20, None, None), ("resumer", 10, 4, 2)]
