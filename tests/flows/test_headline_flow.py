"""Policy failures in the headline and coverage on every surface, through the real flow.

One evaluation of a policy that emits an invalid action on its hardest seeds, on an env that
raises on its highest-payoff seeds (``tests.flows.headline_envs``), run from the in-loop
``Evaluator`` with a callback to a loopback trainer; then the same request from the CLI.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from evalfleet.cli import run_cli
from evalfleet.client import Evaluator
from evalfleet.models import EvalRequest
from evalfleet.storage import read_episodes
from flows.eval import evaluate
from tests.integration.policies import mlp

pytestmark = pytest.mark.slow

ENV = "tests.flows.headline_envs:Hurdles-v0"
POLICY = "tests.flows.headline_envs:breaks_on_hard_seeds"
KWARGS = {"broken_above": 0.85}
EPISODES = 60


@pytest.fixture
def trainer() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback endpoint that keeps every JSON body POSTed to it."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/eval", bodies
    finally:
        server.shutdown()
        server.server_close()


def test_policy_failures_count_and_coverage_reaches_every_surface(
    prefect_server, tmp_path, trainer, monkeypatch, capsys
):
    url, bodies = trainer
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "headline-test-secret")
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", "127.0.0.1")  # the trainer listens on loopback
    request = EvalRequest.build(env=ENV, env_kwargs=KWARGS, policy=POLICY, episodes=EPISODES,
                                concurrency=20, output=tmp_path / "out", callback_url=url)
    with Evaluator(policy_factory="tests.integration.policies:mlp", output=tmp_path / "ev",
                   runner=lambda _: evaluate(request)) as ev:
        result = ev.evaluate(mlp(), step=4)
    report = result["report"]

    table = read_episodes(report.outputs["episodes"])
    reasons = np.asarray(table.column("end_reason").to_pylist())
    returns = np.asarray(table.column("return").to_pylist())
    harness, policy = reasons == "env_error", reasons == "invalid_action"
    assert harness.sum() > 0 and policy.sum() > 0
    assert report.mean == pytest.approx(returns[~harness].mean(), rel=1e-12)
    assert report.mean < returns[~harness & ~policy].mean()  # the broken seeds pull it down
    assert (report.scored, report.policy_failures, report.harness_failures) == (
        EPISODES - harness.sum(), policy.sum(), harness.sum())
    coverage = (EPISODES - int(harness.sum())) / EPISODES
    assert report.coverage == coverage
    assert report.success is not None and report.success["n"] == report.scored

    # Evaluator result, report.json, MLflow, Prefect artifacts, callback body.
    assert result["eval/coverage"] == coverage and result["eval/reward"] == report.mean
    saved = json.loads(open(report.outputs["report"]).read())
    assert (saved["coverage"], saved["scored"], saved["policy_failures"]) == (
        coverage, report.scored, report.policy_failures)
    run = MlflowClient(report.outputs["mlflow_uri"]).get_run(report.outputs["mlflow_run_id"])
    assert run.data.metrics["eval/coverage"] == coverage
    assert run.data.metrics["eval/reward"] == pytest.approx(report.mean, rel=1e-12)
    line = f"{coverage:.2%} ({report.scored}/{EPISODES} episodes scored)"
    key = f"eval-{report.policy_sha256[:12]}"
    arts = httpx.post(f"{prefect_server}/artifacts/filter", json={
        "artifacts": {"key": {"any_": [key, f"{key}-report"]}}}).json()
    by_type = {a["type"]: a["data"] for a in arts}
    assert f"| coverage | {line} |" in by_type["markdown"]
    assert {"metric": "coverage", "value": line} in json.loads(by_type["table"])
    assert report.outputs["callback"].startswith("delivered"), report.outputs["callback"]
    assert [b["coverage"] for b in bodies] == [coverage]
    assert bodies[0]["policy_failures"] == report.policy_failures

    # The CLI prints the same coverage line (and exits 0 only because it is told to).
    capsys.readouterr()
    args = ["--env", ENV, "--env-kwargs", json.dumps(KWARGS), "--policy", POLICY, "--episodes",
            str(EPISODES), "--concurrency", "20", "--output", str(tmp_path / "out"), "--quiet"]
    assert run_cli(evaluate, args) == 3  # harness fault: > 5% of episodes failed in the harness
    out = capsys.readouterr()
    assert f"coverage  {line}" in out.out or any(
        r.split(None, 1) == ["coverage", line] for r in out.out.splitlines())
    assert "failed in the harness" in out.err
