"""The cache through the flow: hits spawn nothing, top-ups equal cold runs, one computation per key."""

import json
import subprocess
import sys

import pytest

from evalfleet import pipeline as pipeline_module
from evalfleet.models import EvalRequest
from evalfleet.pipeline import outcome_table
from evalfleet.storage import read_episodes
from flows import eval as eval_module
from flows.eval import evaluate

pytestmark = pytest.mark.slow


def _req(tmp_path, example_policy, **fields):
    return EvalRequest.build(**{"policy": example_policy, "episodes": 30, "concurrency": 12,
                                "seed": 5, "output": tmp_path / "out", **fields})


def test_hit_spawns_nothing_and_top_up_equals_cold(prefect_server, tmp_path, example_policy,
                                                   monkeypatch):
    first = evaluate(_req(tmp_path, example_policy))
    assert first.cache["status"] == "miss" and first.cache["computed"] == 30

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started for a full cache hit")

    def refuse_load(*args, **kwargs):
        raise AssertionError("a full cache hit loaded the policy (importing torch, ~1 s)")

    with monkeypatch.context() as m:
        m.setattr(eval_module, "fleet_cluster", refuse)
        m.setattr(pipeline_module, "check_policy", refuse_load)
        hit = evaluate(_req(tmp_path, example_policy))
    assert hit.cache["status"] == "hit" and hit.cache["reused"] == 30 and hit.cache["computed"] == 0
    assert hit.returns == first.returns
    # The hit's episodes.parquet is its own: its rows join to its report by request id (they
    # carried the first evaluation's), the worker that ran them still named.
    rows = read_episodes(hit.outputs["episodes"])
    assert set(rows.column("request_id").to_pylist()) == {hit.request_id} != {first.request_id}
    assert rows.column("worker").to_pylist() == read_episodes(
        first.outputs["episodes"]).column("worker").to_pylist()

    topped = evaluate(_req(tmp_path, example_policy, episodes=75))
    assert topped.cache["status"] == "partial"
    assert (topped.cache["reused"], topped.cache["computed"]) == (30, 45)
    cold = evaluate(_req(tmp_path, example_policy, episodes=75, cache="off"))
    assert cold.cache["status"] == "off" and cold.cache["computed"] == 75
    assert outcome_table(read_episodes(topped.outputs["episodes"])).equals(
        outcome_table(read_episodes(cold.outputs["episodes"])))
    assert topped.returns == cold.returns

    refreshed = evaluate(_req(tmp_path, example_policy, episodes=20, cache="refresh"))
    assert refreshed.cache["computed"] == 20
    after = evaluate(_req(tmp_path, example_policy, episodes=75))
    assert after.cache["status"] == "partial" and after.cache["reused"] == 20  # replaced, not merged


def test_concurrent_identical_requests_compute_once(prefect_server, tmp_path, example_policy):
    cmd = [sys.executable, "flows/eval.py", "--episodes", "40", "--concurrency", "10",
           "--seed", "3", "--output", str(tmp_path / "out"), "--quiet"]
    procs = [subprocess.Popen(cmd + ["--report", str(tmp_path / f"r{i}.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-3000:]
    caches = sorted((json.loads((tmp_path / f"r{i}.json").read_text())["cache"] for i in range(2)),
                    key=lambda c: c["computed"])
    assert caches[0]["status"] == "hit" and caches[0]["computed"] == 0
    assert caches[1]["status"] == "miss" and caches[1]["computed"] == 40

    ls = subprocess.run([sys.executable, "-m", "flows.console", "cache", "ls", "--output",
                         str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert "1 entries" in ls.stdout and caches[1]["key"][:16] in ls.stdout
    rm = subprocess.run([sys.executable, "-m", "flows.console", "cache", "rm", caches[1]["key"][:10],
                         "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert "removed 1 entries" in rm.stdout
