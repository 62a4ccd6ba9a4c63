"""A flow run's final state recorded late (the API lost when it ended) keeps the name it ended under."""

from types import SimpleNamespace

import httpx
import pytest
from prefect import flow

import flows.api_ledger as api_ledger

pytestmark = pytest.mark.slow

MISSING = SimpleNamespace(missing_outputs=["the callback to the trainer: failed after 1 attempt (HTTP 500)"],
                          harness_fault=False, alarms=[], coverage=1.0)
FAULT = SimpleNamespace(missing_outputs=[], harness_fault=True, coverage=0.9,
                        alarms=["recording_incomplete: 3 episodes could not be replayed"])
FINE = SimpleNamespace(missing_outputs=[], harness_fault=False, alarms=[], coverage=1.0)


@pytest.mark.parametrize("report, name, message", [
    (MISSING, "Outputs missing", "the callback to the trainer: failed after 1 attempt (HTTP 500); ended"),
    (FAULT, "Harness fault", "recording_incomplete: 3 episodes could not be replayed; ended"),
    (FINE, "Completed", "ended Completed at "),
])
def test_a_state_queued_while_the_api_was_down_is_replayed_under_its_name(prefect_server, tmp_path,
                                                                          monkeypatch, report, name,
                                                                          message):
    # Replayed plain "Completed" (the queue kept no name): a run whose report the CLI exits 5 or 3
    # on read as a clean one in the UI and the webhook's state_name.
    from prefect import get_client
    from prefect.context import FlowRunContext
    from prefect.states import Running

    monkeypatch.setattr(api_ledger, "pending_dir", lambda: tmp_path / "prefect-pending")
    with get_client(sync_client=True) as client:
        run = client.create_flow_run(flow(name="evalfleet-eval")(lambda: None), name=f"late-{name}",
                                     state=Running())

        def body():  # the flow body returned; then the API went away before its final state
            api_ledger.kept(report)
            raise httpx.ConnectError("All connection attempts failed")

        with monkeypatch.context() as inside, api_ledger.api_ledger() as ledger:
            inside.setattr(FlowRunContext, "get", classmethod(
                lambda cls: SimpleNamespace(flow_run=SimpleNamespace(id=run.id))))  # the run's body
            assert api_ledger.run_recorded(body, "the flow run") is report

        assert api_ledger.replay_pending(client) == [str(run.id)]
        state = client.read_flow_run(run.id).state
    assert state is not None and state.type.value == "COMPLETED"
    assert state.name == name
    assert message in (state.message or "") and "recorded late by the next evaluation" in state.message
    assert not list((tmp_path / "prefect-pending").glob("*.json"))
    assert [what.split(";")[0] for _, what, _ in ledger.lost] == [f"the flow run's final state ({name}"]
