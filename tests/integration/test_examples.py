"""The training examples, shortened: they run, they log, and evaluation follows training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from .conftest import ROOT, Service

pytestmark = pytest.mark.slow

SMALL = ["--batch", "8", "--eval-episodes", "8", "--timeout", "240"]


def run_example(script: str, args: list[str], env: dict[str, str], timeout: float = 420
                ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def check_mlflow(summary: dict, steps: list[int]) -> None:
    client = MlflowClient(summary["tracking_uri"])
    exp = client.get_experiment_by_name(summary["experiment"])
    runs = client.search_runs([exp.experiment_id],
                              f"tags.`evalfleet.training_run_id` = '{summary['training_run_id']}'")
    assert sorted(int(r.data.tags["evalfleet.step"]) for r in runs) == steps
    assert {r.data.tags.get("mlflow.parentRunId") for r in runs} == {summary["training_run_id"]}
    history = client.get_metric_history(summary["training_run_id"], "eval/reward")
    assert sorted(m.step for m in history) == steps  # the curve is in the training run too
    assert client.get_run(summary["training_run_id"]).info.status == "FINISHED"


def test_train_reinforce(prefect_server: str, tmp_path: Path) -> None:
    # The Evaluator's default: a LocalCluster of its own, whose spawned workers import the
    # example's policy factory from the script's folder.
    summary_path = tmp_path / "summary.json"
    env = dict(os.environ, PREFECT_API_URL=prefect_server)
    proc = run_example("train_reinforce.py", [*SMALL, "--updates", "3", "--output", str(tmp_path / "out"),
                                              "--summary", str(summary_path)], env)
    summary = json.loads(summary_path.read_text())
    rewards = [e["eval/reward"] for e in summary["evals"]]
    assert [e["eval/step"] for e in summary["evals"]] == [1, 2, 3]
    assert rewards[-1] > rewards[0], proc.stdout  # seeded: the evaluated return rises
    assert "evaluated return:" in proc.stdout
    check_mlflow(summary, [1, 2, 3])


def test_train_with_webhook(service: Service, tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    env = dict(os.environ, EVALFLEET_WEBHOOK_SECRET=service.secret,
               EVALFLEET_CALLBACK_SECRET=service.callback_secret)
    proc = run_example("train_with_webhook.py", [
        *SMALL, "--updates", "2", "--receiver-url", service.urls["receiver"],
        "--mlflow-uri", service.mlflow_uri, "--output", str(tmp_path / "out"),
        "--summary", str(summary_path)], env)
    summary = json.loads(summary_path.read_text())
    assert [e["step"] for e in summary["evals"]] == [1, 2]
    assert len(summary["latency_s"]) == 2, proc.stdout  # every report came by signed callback
    assert summary["evals"][-1]["reward"] > summary["evals"][0]["reward"]
    check_mlflow(summary, [1, 2])
