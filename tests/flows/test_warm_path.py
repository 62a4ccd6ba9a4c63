"""The Evaluator's fast path: the numbers first, then every file and record of today's report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

from evalfleet.client import Evaluator
from flows.local_runner import LocalFlowRunner

pytestmark = pytest.mark.slow


def mlp() -> torch.nn.Module:
    """A CartPole policy (module level: the state_dict's factory)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _model(seed: int) -> torch.nn.Module:
    m = mlp()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _mlflow(report: dict) -> tuple[set[str], set[str], str]:
    client = MlflowClient(tracking_uri=report["outputs"]["mlflow_uri"])
    run = client.get_run(report["outputs"]["mlflow_run_id"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    return set(run.data.metrics), artifacts, run.info.status


def test_result_first_then_the_whole_report(prefect_server, tmp_path):
    runner = LocalFlowRunner(workers=1)
    with Evaluator(env="CartPole-v1", policy_factory=mlp, num_episodes=8, concurrency=8,
                   output=tmp_path / "out", runner=runner) as ev:
        fast = ev.evaluate(_model(1), step=1)
        hit = ev.evaluate(_model(1), step=2)  # same weights again: a cache hit on the fast path
        runner.warm = False  # an evaluation through the whole flow, for comparison
        full = ev.evaluate(_model(2), step=3)
        pending = fast["report"].outputs
        # The numbers came before stage 7: the Parquet is there, the rest is announced.
        assert pending["feed_back"] == "pending"
        assert Path(pending["episodes"]).exists()
        assert fast["eval/episodes"] == 8 and fast["eval/step"] == 1
        assert hit["report"].cache["status"] == "hit" and hit["eval/reward"] == fast["eval/reward"]
    # shutdown (the with block) waited for every background stage 7.
    future = ev.final_report(fast["report"].request_id)
    assert future is not None and ev.final_report(full["report"].request_id) is None
    final = future.result(timeout=0)
    assert final.mean == fast["eval/reward"] and final.request_id == fast["report"].request_id
    on_disk = json.loads(Path(pending["report"]).read_text())
    assert on_disk["outputs"]["mlflow_run_id"] == final.outputs["mlflow_run_id"]
    assert on_disk["outputs"]["folder"] == pending["folder"]
    assert on_disk["returns"]["mean"] == fast["eval/reward"]

    # Nothing of the full flow's report is missing: the same files, outputs, MLflow run.
    full_report = full["report"].model_dump(mode="json")
    assert "feed_back" not in full_report["outputs"]
    assert _files(Path(pending["folder"])) == _files(Path(full_report["outputs"]["folder"]))
    assert set(on_disk["outputs"]) == set(full_report["outputs"])
    assert set(on_disk["timings"]) == set(full_report["timings"])
    fast_metrics, fast_artifacts, status = _mlflow(on_disk)
    full_metrics, full_artifacts, _ = _mlflow(full_report)
    assert status == "FINISHED"
    assert fast_metrics == full_metrics and fast_artifacts == full_artifacts
    assert "episodes.parquet" in fast_artifacts and "report.json" in fast_artifacts

    # Prefect has the fast path's stage 7 as a completed flow run of its own.
    async def runs() -> list[str]:
        async with get_client() as client:
            found = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=[f"CartPole-v1-{final.request_id}"])))
            return [r.state_type.value for r in found]

    import asyncio

    assert asyncio.run(runs()) == ["COMPLETED"]


def test_the_verdict_comes_with_the_fast_result(prefect_server, tmp_path):
    # A trainer acts on the verdict (promotion, best checkpoint): it must not arrive "later".
    with Evaluator(env="CartPole-v1", policy_factory=mlp, num_episodes=12, concurrency=12,
                   output=tmp_path / "out", runner=LocalFlowRunner(workers=1),
                   training_run_id="warm-run") as ev:
        first = ev.evaluate(_model(1), step=1)
        second = ev.evaluate(_model(3), step=2)
        assert first["report"].outputs["feed_back"] == "pending"
        assert first["eval/verdict"] == "first"
        # Compared with step 1, whose stage 7 had to log it first.
        assert second["eval/verdict"] in {"new_best", "not_distinguishable", "regression"}
        assert second["report"].history["best_step"] in (1, 2)
    final = ev.final_report(second["report"].request_id)
    assert final is not None
    report = final.result(timeout=0)
    assert report.history == second["report"].history  # computed once, not again in stage 7
    assert [a for a in report.alarms if a in second["report"].alarms] == second["report"].alarms
