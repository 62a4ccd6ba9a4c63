"""A request id the model accepts names Prefect artifacts; a call refused for the UI costs the UI alone."""

import json
import os

import httpx
import pytest

from evalfleet.models import EvalRequest
from flows.api_ledger import ApiLedger, api_ledger, best_effort, run_recorded
from flows.eval import evaluate

POLICY = os.path.join(os.path.dirname(__file__), "..", "..", "evalfleet", "data", "cartpole_mlp.pt")


def test_progress_keys_are_valid_and_distinct_for_every_id_the_model_accepts():
    from flows.progress import progress_key

    ids = ["0123abcd4567ef89", "my_run.1", "my-run-1", "My-Run-1", "my.run.1", "my_run_1", "A", "a"]
    keys = [progress_key(i) for i in ids]
    assert keys[0] == "progress-0123abcd4567ef89"  # the ids evalfleet makes keep their key
    assert keys[2] == "progress-my-run-1"
    assert all(k == k.lower() and set(k) <= set("abcdefghijklmnopqrstuvwxyz0123456789-") for k in keys)
    assert len(set(keys)) == len(ids), keys
    assert keys[1].startswith("progress-my-run-1-")


def test_a_ui_call_prefect_refuses_is_recorded_and_a_flow_error_is_still_raised():
    with api_ledger() as ledger:
        with best_effort("the progress artifact"):
            raise ValueError("Artifact key must only contain lowercase letters, numbers, and dashes")
    assert [what for _, what, _ in ledger.lost] == ["the progress artifact"]
    assert "ValueError: Artifact key must" in ledger.lost[0][2]

    def body() -> int:  # not a UI call: a flow's own error is raised, whatever it is
        raise ValueError("a fault of the flow")

    with api_ledger() as ledger, pytest.raises(ValueError, match="a fault of the flow"):
        run_recorded(body, "the flow run")
    assert ledger.lost == [] and isinstance(ledger, ApiLedger)


def test_the_report_line_tells_a_refused_call_from_an_api_that_did_not_answer():
    with api_ledger() as ledger:
        with best_effort("the progress artifact"):
            raise ValueError("Artifact key must only contain lowercase letters, numbers, and dashes")
    line = ledger.summary()
    assert line is not None and line.startswith("Prefect refused the progress artifact (ValueError: ")
    assert "API failed" not in line and "reconnects" not in line  # it answered: nothing is re-sent

    with api_ledger() as ledger:
        for what in ("a task-run state", "a task-run state"):
            with best_effort(what):
                raise httpx.ConnectError("connection refused")
        with best_effort("the summary artifact"):
            raise ValueError("a value the schema rejects")
    line = ledger.summary()
    assert line is not None and line.startswith("the Prefect API failed (ConnectError: connection refused)")
    assert "not recorded there: 2 a task-run state;" in line and "reconnects" in line
    assert "Prefect refused the summary artifact (ValueError: a value the schema rejects)" in line


@pytest.mark.slow
def test_a_request_id_with_a_dot_and_an_underscore_completes_with_its_report(prefect_server, tmp_path):
    request = EvalRequest.build(policy=POLICY, episodes=8, concurrency=8, workers=1,
                                output=tmp_path / "results", cache="off", request_id="my_run.1")
    report = evaluate(request)  # refused as 'progress-my_run.1' after the cluster had started

    assert report.request_id == "my_run.1" and report.completed == 8
    saved = json.loads(open(report.outputs["report"]).read())
    assert saved["request_id"] == "my_run.1" and saved["completed"] == 8
    assert "prefect_lost" not in report.outputs, report.outputs.get("prefect_lost")
    progress = httpx.post(f"{prefect_server}/artifacts/filter", json={
        "artifacts": {"key": {"like_": "progress-my-run-1-"}}}).json()
    assert len(progress) == 1 and progress[0]["type"] == "progress" and progress[0]["data"] == 100.0
