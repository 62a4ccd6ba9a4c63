"""Webhook bodies that meant something else were accepted (202); each is now a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from deployments.webhook import Receiver
from evalfleet.callback import canonical_json, signed_headers
from evalfleet.models import EvalRequest
from evalfleet.suite import Suite, task_requests

from .test_webhook_deliveries import SECRET, MemoryPrefect, doc, make_receiver, post

MAX_STEP = 2**63 - 1  # int64: MLflow's steps and the episodes' 'step' column
SUITE = {"suite": {"name": "s"}, "task": [{"env": "CartPole-v1", "episodes": 3}]}


@pytest.fixture
def memory() -> MemoryPrefect:
    return MemoryPrefect()


@pytest.fixture
def receiver(memory: MemoryPrefect, tmp_path: Any) -> Iterator[Receiver]:
    r = make_receiver(memory, tmp_path, "a")
    yield r
    r.close()


def deliver(receiver: Receiver, body: dict[str, Any], delivery: str) -> tuple[int, dict[str, Any]]:
    raw = canonical_json(body)
    return post(receiver, raw, signed_headers(raw, SECRET, delivery_id=delivery))


@pytest.mark.parametrize("changes,named", [
    # The audit's body: asked for 7 episodes capped at 20, it ran the suite's 3 at cap 500 (202).
    ({"env": {"id": "Acrobot-v1", "kwargs": {"x": 1}},
      "protocol": {"episodes": 7, "seed": 5, "max_steps": 20}},
     ["env", "protocol.episodes", "protocol.max_steps"]),
    ({"protocol": {"episodes": 100}}, ["protocol.episodes"]),  # the default typed out is given
    ({"protocol": {"max_steps": 20, "seed": 5}}, ["protocol.max_steps"]),
    ({"env": {"id": "CartPole-v1"}}, ["env"]),
])
def test_what_a_suite_sets_is_refused_beside_it(receiver: Receiver, memory: MemoryPrefect,
                                                changes: dict[str, Any], named: list[str]) -> None:
    body = doc(7, suite=SUITE)
    del body["env"], body["protocol"]
    body.update(changes)
    status, answer = deliver(receiver, body, "suite-fields")
    assert status == 400, answer
    assert answer["error"] == "invalid_request" and answer["field"] == named[0], answer
    assert answer["reason"].startswith(
        f"{', '.join(map(repr, named))} cannot be used with 'suite': the body's suite sets each "
        "task's env, env kwargs, episodes and step cap, so they would be ignored. Drop them"), answer
    assert [p["field"] for p in answer["problems"]] == named
    assert not memory.runs  # nothing was started


def test_a_suite_body_without_env_runs_its_tasks_with_the_protocol_seed(
        receiver: Receiver, memory: MemoryPrefect) -> None:
    body = doc(7, suite=SUITE, protocol={"seed": 5, "deterministic": True})
    del body["env"]  # was required, and ignored
    status, answer = deliver(receiver, body, "suite-ok")
    assert status == 202, answer
    parameters = memory.runs[0].parameters
    tasks = task_requests(Suite.model_validate(parameters["suite"]),
                          EvalRequest.model_validate(parameters["request"]))
    assert [(t.env, t.episodes, t.max_steps, t.seed, t.step) for t in tasks] == [
        ("CartPole-v1", 3, None, 5, 7)]


def test_a_body_without_suite_needs_its_env(receiver: Receiver, memory: MemoryPrefect) -> None:
    body = doc(7)
    del body["env"]
    status, answer = deliver(receiver, body, "no-env")
    assert status == 400 and answer["field"] == "env", answer
    assert answer["reason"].startswith("'env' is required"), answer
    assert not memory.runs


def test_a_step_past_int64_is_refused(receiver: Receiver, memory: MemoryPrefect) -> None:
    # Accepted (202), its episodes ran, and stage 7 failed with OverflowError: no report.
    status, answer = deliver(receiver, doc(MAX_STEP + 1), "big-step")
    assert status == 400 and answer["field"] == "step", answer
    assert answer["reason"] == f"Input should be less than or equal to {MAX_STEP}", answer
    assert not memory.runs
    status, answer = deliver(receiver, doc(MAX_STEP), "last-step")
    assert status == 202 and answer["step"] == MAX_STEP, answer


@pytest.mark.parametrize("where", ["protocol.episodes", "protocol.seed", "protocol.max_steps", "step"])
def test_a_bool_for_an_integer_is_refused(receiver: Receiver, memory: MemoryPrefect,
                                          where: str) -> None:
    # 'episodes: true' ran 1 episode and 'step: true' was step 1: pydantic's int took true as 1.
    body = doc(7)
    *parents, name = where.split(".")
    (body[parents[0]] if parents else body)[name] = True
    status, answer = deliver(receiver, body, f"bool-{where}")
    assert status == 400 and answer["field"] == where, answer
    assert answer["reason"] == "must be an integer, not a bool (got true)", answer
    assert not memory.runs
