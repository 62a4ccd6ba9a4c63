"""An earlier checkpoint whose MLflow run was queued is history too, or the verdict fails closed.

Planted case: step 1 of a training run (the ``careful`` courier policy) is evaluated while the
MLflow store is down, so its run waits in ``OUTPUT/mlflow-pending``; the store comes back for
step 2, a much worse policy (``careless``). Before, step 2's history was read before the queue
was flushed: it had no earlier checkpoint, its verdict was ``first`` and ``--gate`` passed it.
"""

from __future__ import annotations

from pathlib import Path

from evalfleet.cli import EXIT_GATE_UNDECIDED, EXIT_REGRESSION, gate
from evalfleet.models import EvalReport
from evalfleet.tracking import pending_dir
from tests.core.test_history import evaluate_checkpoint


def _checkpoint(tmp: Path, policy: str, step: int, uri: str, run: str) -> EvalReport:
    """Stages 6-7 of one evaluation, logged to ``uri`` or queued when it does not answer."""
    return evaluate_checkpoint(tmp, policy, step, run=run, uri=uri)


def test_a_regression_against_a_queued_checkpoint_is_judged_after_the_queue_is_logged(
        tmp_path, capsys):
    (tmp_path / "store").write_text("")  # the store's folder is a file: the store is down
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    first = _checkpoint(tmp_path, "careful", 1, uri, run="Q")
    assert "mlflow_queued" in first.outputs and first.verdict is None  # its history: unreadable
    (tmp_path / "store").unlink()  # the store is back
    worse = _checkpoint(tmp_path, "careless", 2, uri, run="Q")
    assert worse.verdict == "regression", worse.history
    assert worse.history["compared_with"]["step"] == 1
    assert worse.history["comparison"]["ci"]["high"] < 0
    assert not list(pending_dir(tmp_path).glob("*.json"))  # step 1 was logged first
    assert gate(worse) == EXIT_REGRESSION
    assert "regression against the best checkpoint (step 1)" in capsys.readouterr().err


def test_a_queued_checkpoint_that_stays_queued_leaves_no_verdict_and_the_gate_fails_closed(
        tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    pending_dir(tmp_path).mkdir(parents=True)
    (pending_dir(tmp_path) / "garbled.json").write_text("{not json")  # cannot be logged nor read
    report = _checkpoint(tmp_path, "careless", 2, uri, run="R")
    assert report.verdict is None
    error = report.history["error"]
    assert error.startswith("HistoryIncomplete: 1 earlier evaluation(s) of training run 'R' "
                            "(step unreadable garbled.json) are queued in "), error
    assert "evalfleet mlflow flush --output" in error
    assert any(a.startswith("history_unavailable: ") for a in report.alarms)
    assert gate(report) == EXIT_GATE_UNDECIDED
    assert "history could not be read (HistoryIncomplete" in capsys.readouterr().err
