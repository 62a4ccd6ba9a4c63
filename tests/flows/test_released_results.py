"""The run stage's and the replays' results are released on the cluster before its workers stop.

``evaluate()`` tells its own workers to stop (``done_with``) once the driver holds what it needs.
A result the scheduler still held for the flow was lost with the first worker to go, and the
scheduler ran that task again on the other one, still up: a shard ran after the policy's release
and ended ``PolicyIntegrityError``, the shard's completed task run turned Failed in Prefect, and
the quiet CLI printed an ERROR line under a correct summary (seen once in a fresh-venv run).
"""

from __future__ import annotations

import pytest

from evalfleet.cluster import client_for
from evalfleet.models import EvalRequest
from flows import eval as eval_module
from flows.eval import evaluate

pytestmark = pytest.mark.slow


def _wanted(dask_scheduler) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(str(key) for key, ts in dask_scheduler.tasks.items() if ts.who_wants)


def test_nothing_is_held_on_the_workers_when_they_are_told_to_stop(prefect_server, tmp_path,
                                                                   example_policy, monkeypatch):
    held: list[list[str]] = []
    real = eval_module.done_with

    def spy(address: str | None) -> bool:
        assert address is not None
        held.append(client_for(address).run_on_scheduler(_wanted))
        return real(address)

    monkeypatch.setattr(eval_module, "done_with", spy)
    report = evaluate(EvalRequest.build(policy=example_policy, episodes=40, concurrency=10,
                                        workers=2, output=tmp_path / "out", cache="off"))
    assert report.scored == 40 and not report.alarms
    assert report.outputs.get("review") is None  # the replays ran on a worker: reviewed
    assert len(held) == 1
    assert [k for k in held[0] if "run_episodes" in k or "replay" in k] == [], held[0]
