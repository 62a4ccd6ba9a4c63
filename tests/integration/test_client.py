"""The in-loop Evaluator: argument checks (fast), then real evaluations (slow).

The slow tests evaluate on the service's Dask cluster (warm workers) through the same flow the
CLI runs, and through the served deployment. The default (a LocalCluster of the evaluator's
own) is exercised by ``test_examples.py::test_train_reinforce``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from deployments.runner import DeploymentRunner
from evalfleet.client import (
    EvaluationFailed,
    Evaluator,
    EvaluatorBusy,
    EvaluatorClosed,
    PolicyWriter,
    factory_ref,
    snapshot_weights,
)
from evalfleet.errors import EvalfleetError, OutputsMissing, PolicyError, RequestError
from evalfleet.models import EvalRequest

from .conftest import CALLBACK_SECRET, Service, TrainerEndpoint
from .policies import mlp

FACTORY = "tests.integration.policies:mlp"
KEYS = {"eval/reward", "eval/reward_ci_low", "eval/reward_ci_high", "eval/episode_length",
        "eval/fps", "eval/step", "report"}


def model(seed: int) -> torch.nn.Module:
    m = mlp()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


# ------------------------------------------------------------------------------------ fast


def test_arguments_are_checked_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Choose 'error', 'queue', or 'skip'"):
        Evaluator(busy_policy="drop", output=tmp_path)
    with pytest.raises(TypeError, match="Gymnasium id"):
        Evaluator(env=lambda: None, output=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="set by the Evaluator"):
        Evaluator(policy="x.pt", output=tmp_path)
    with pytest.raises(RequestError, match="'episodes' must be a positive integer"):
        Evaluator(num_episodes=0, output=tmp_path)
    with pytest.raises(PolicyError, match="module-level function"):
        Evaluator(policy_factory=lambda: mlp(), output=tmp_path)


def test_factory_refs() -> None:
    assert factory_ref(mlp) == FACTORY
    assert factory_ref("pkg.mod:fn") == "pkg.mod:fn"
    with pytest.raises(PolicyError, match="module:function"):
        factory_ref("no_colon")


def test_state_dict_needs_a_factory(tmp_path: Path) -> None:
    ev = Evaluator(output=tmp_path, runner=lambda r: pytest.fail("must not run"))
    try:
        with pytest.raises(PolicyError, match="needs 'policy_factory'"):
            ev.trigger_eval(mlp().state_dict(), step=0)
        with pytest.raises(PolicyError, match="nn.Module or a state_dict"):
            ev.trigger_eval([1, 2, 3], step=0)
    finally:
        ev.shutdown()
    with pytest.raises(EvaluatorClosed):
        ev.trigger_eval(mlp(), step=1)


def test_snapshot_is_taken_at_trigger_time(tmp_path: Path) -> None:
    m = model(0)
    snap = snapshot_weights(m)
    expected = PolicyWriter(tmp_path / "a", FACTORY).write(snapshot_weights(model(0)))
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()  # training goes on after trigger_eval returned
    got = PolicyWriter(tmp_path / "b", FACTORY).write(snap)
    assert got.name == expected.name  # named by sha256: the weights of trigger time


def test_busy_policies_without_a_cluster(tmp_path: Path) -> None:
    """A runner that blocks until released: the busy policies, order, on_result's thread."""
    gate = threading.Event()
    seen: list[tuple[int | None, str]] = []

    def runner(request: Any) -> Any:
        gate.wait(timeout=30)
        raise RuntimeError(f"stub for step {request.step}")

    ev = Evaluator(output=tmp_path, policy_factory=FACTORY, runner=runner, busy_policy="error",
                   on_result=lambda r: seen.append((r["eval/step"], threading.current_thread().name)))
    try:
        t0 = time.perf_counter()
        assert ev.trigger_eval(model(0), step=1)
        assert time.perf_counter() - t0 < 0.5  # never blocks on the evaluation
        with pytest.raises(EvaluatorBusy, match="still pending"):
            ev.trigger_eval(model(0), step=2)
        ev.busy_policy = "skip"
        assert ev.trigger_eval(model(0), step=3) is None and ev.skipped == 1
        ev.busy_policy = "queue"
        assert ev.trigger_eval(model(0), step=4)
        assert ev.pending == 2 and ev.poll() is None
        with pytest.raises(TimeoutError, match="still running"):
            ev.wait(timeout=0.2)
        gate.set()
        with pytest.raises(EvaluationFailed, match="stub for step 1"):
            ev.wait(timeout=30)
        with pytest.raises(EvaluationFailed, match="stub for step 4"):
            ev.wait(timeout=30)
        assert ev.wait(timeout=1) is None and ev.pending == 0 and seen == []
    finally:
        gate.set()
        ev.shutdown(timeout=30)


# ------------------------------------------------------------------------------------ slow


@pytest.mark.slow
def test_evaluator_on_the_fleet(service: Service, trainer: TrainerEndpoint, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    # The client runs the flow in this process: it signs callbacks with this process's secret.
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", CALLBACK_SECRET)
    monkeypatch.setenv("EVALFLEET_CALLBACK_ATTEMPTS", "3")
    monkeypatch.setenv("EVALFLEET_CALLBACK_BACKOFF", "0.1")
    trainer.statuses = [500] * 10  # the trainer's callback endpoint is down throughout
    threads: list[str] = []
    extra: list[int] = []

    def on_result(result: dict[str, Any]) -> None:
        threads.append(threading.current_thread().name)

    def metrics_fn(table: pa.Table) -> dict[str, float]:
        extra.append(table.num_rows)
        return {"eval/max_length": float(max(table.column("length").to_pylist()))}

    # The callbacks were asked for and never delivered: shutdown (the with block) says so.
    with pytest.raises(OutputsMissing, match="the callback to the trainer: failed after 3") as missing:
        with Evaluator(env="CartPole-v1", policy_factory=mlp, num_episodes=8, busy_policy="queue",
                       on_result=on_result, metrics_fn=metrics_fn, training_run_id="client-test",
                       dask_address=service.urls["dask"], output=tmp_path / "results",
                       concurrency=8, max_steps=100, seed=3, callback_url=trainer.url) as ev:
            t0 = time.perf_counter()
            request_id = ev.trigger_eval(model(1), step=1)
            trigger_s = time.perf_counter() - t0
            # Blocking, queued behind step 1, same weights: it must give the same numbers.
            blocking = ev.evaluate(model(1), step=2, timeout=240)
            triggered = ev.poll()  # finished before the blocking call started
            assert ev.poll() is None and ev.wait(timeout=1) is None
    assert str(missing.value).count("the callback to the trainer") == 2

    print(f"\ntrigger_eval: {1e3 * trigger_s:.1f} ms")
    assert trigger_s < 0.5
    assert triggered is not None and triggered["report"].request_id == request_id
    assert [triggered["eval/step"], blocking["eval/step"]] == [1, 2]
    for r in (triggered, blocking):
        assert KEYS <= set(r) and r["eval/max_length"] <= 100
        assert r["eval/reward_ci_low"] <= r["eval/reward"] <= r["eval/reward_ci_high"]
        assert r["report"].training_run_id == "client-test" and r["report"].episodes == 8
    assert blocking["report"].policy_sha256 == triggered["report"].policy_sha256
    assert blocking["eval/reward"] == triggered["eval/reward"]  # same weights, same seeds
    assert extra == [8, 8]
    assert threads == ["evalfleet-evaluator"] * 2  # on_result ran on the background thread
    # A failed callback never loses the result: it came back here, and it is on disk and in MLflow.
    for r in (triggered, blocking):
        final = ev.final_report(r["report"].request_id)  # stage 7 ran after the result came back
        outputs = (final.result(timeout=0) if final is not None else r["report"]).outputs
        assert outputs["callback"].startswith("failed after 3 attempts")  # signed, retried
        assert Path(outputs["episodes"]).exists() and Path(outputs["report"]).exists()
        assert MlflowClient(outputs["mlflow_uri"]).get_run(outputs["mlflow_run_id"])
    assert len(trainer.calls) == 6 and all(c["verified"] for c in trainer.calls)


@pytest.mark.slow
def test_evaluator_surfaces_failures(service: Service, tmp_path: Path) -> None:
    with Evaluator(policy_factory="tests.integration.policies:wrong_output", num_episodes=4,
                   dask_address=service.urls["dask"], output=tmp_path) as ev:
        ev.trigger_eval(torch.nn.Linear(4, 3), step=1)
        with pytest.raises(EvalfleetError, match="shape"):
            ev.wait(timeout=120)


@pytest.mark.slow
def test_evaluator_through_the_deployment(service: Service) -> None:
    runner = DeploymentRunner(service.urls["prefect_api"], timeout_s=240)
    # No factory: the module travels as TorchScript, self-contained for any server. The output
    # folder must be readable by both sides: the service's own results folder.
    with Evaluator(num_episodes=8, runner=runner, output=service.output, concurrency=8,
                   max_steps=50) as ev:
        t0 = time.monotonic()
        result = ev.evaluate(model(7), step=9, timeout=300)
    print(f"\nclient via deployment: {time.monotonic() - t0:.1f} s")
    assert result["eval/step"] == 9 and result["report"].episodes == 8
    assert result["report"].manifest["policy"]["format"] == "torchscript"
    assert Path(result["report"].outputs["report"]).is_relative_to(service.output)


@flow(name="evalfleet-unserved")
def unserved(request: dict[str, Any]) -> None:
    """A deployment target no process serves: its flow runs stay scheduled."""


@pytest.mark.slow
def test_deployment_runner_is_bounded_and_idempotent(prefect_server: str, tmp_path: Path) -> None:
    """Nobody serves the deployment: the runner gives up after timeout_s, naming the flow run's
    state and what to check, and a repeated request gets the same flow run, not a second one."""
    deployment_id = unserved.to_deployment(name="nobody").apply()
    runner = DeploymentRunner(prefect_server, "evalfleet-unserved/nobody", timeout_s=1, poll_s=0.2)
    request = EvalRequest.build(policy="x.pt", output=tmp_path)
    ids = []
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(EvaluationFailed, match=r"not finished after 1 s \(state 'Scheduled'\); "
                           r"is 'evalfleet serve' running for 'evalfleet-unserved/nobody'\?") as err:
            runner(request)
        assert 1.0 <= time.monotonic() - t0 < 30
        ids.append(str(err.value).split()[2])
    with get_client(sync_client=True) as client:
        mine = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    assert ids[0] == ids[1] == str(mine[0].id) and len(mine) == 1
    assert set(mine[0].tags) >= {"evalfleet", "client"}
    assert mine[0].parameters["request"]["request_id"] == request.request_id
