"""Two checkpoints of one training run evaluated at once, each by its own CLI process.

Step 1 (the careful policy, slowly) starts first; step 2 (careless) starts while step 1 runs and
ends its episodes first. Step 2's stage 7 read a history without step 1: ``first``, and
``--gate`` passed a regression. Now it waits for step 1 to be logged and is judged against it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalfleet.cli import EXIT_OK, EXIT_REGRESSION, run_cli
from flows.eval import evaluate
from tests.core.courier import ENV_ID

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _args(out: Path, policy: str, step: int) -> list[str]:
    return ["--env", ENV_ID, "--policy", f"tests.core.courier:{policy}", "--episodes", "30",
            "--concurrency", "10", "--isolation", "inprocess", "--output", str(out),
            "--training-run-id", "race", "--step", str(step), "--gate", "--quiet", "--no-audit"]


def test_a_later_step_finishing_first_waits_for_the_earlier_one_and_the_gate_sees_it(
        prefect_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "flows" / "eval.py"), *_args(out, "careful_slowly", 1)],
        cwd=ROOT, env={**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not list(out.glob("history-claims/*/*-*.json")):  # step 1 has started
            assert first.poll() is None, first.communicate()[0]
            assert time.monotonic() < deadline, "step 1 never claimed its step"
            time.sleep(0.1)
        code = run_cli(evaluate, _args(out, "careless", 2))
        assert first.poll() is not None  # step 2's verdict waited for step 1's MLflow run
    finally:
        output = first.communicate(timeout=300)[0]
    assert first.returncode == EXIT_OK, output
    err = capsys.readouterr().err
    assert code == EXIT_REGRESSION, err
    assert "gate: step 2 is a regression against the best checkpoint (step 1)" in err
    assert not list(out.glob("history-claims/*/*.json"))  # both released


def test_the_fast_path_holds_its_claim_until_stage_7_releases_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # evaluate_warm handed its claim to the lane with ExitStack.pop_all(): the popped stack was
    # dropped at once, which closed the claim's generator and released it. A later step of the
    # run (another Evaluator, a CLI run) then read its history while this step's stage 7 had
    # not logged it, and neither waited for it nor learnt that its own verdict came first.
    from evalfleet import claims
    from evalfleet.models import EvalRequest
    from evalfleet.pipeline import release_history_claim
    from flows import warm

    request = EvalRequest(env=ENV_ID, policy="tests.core.courier:careless", output=tmp_path,
                          training_run_id="warm-claim", step=3, request_id="warm-3")
    uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setattr(warm, "stages_here", lambda request, address, lane: "stage 7 queued")
    assert warm.evaluate_warm(request, "tcp://nowhere:1", lane=None) == "stage 7 queued"  # type: ignore[arg-type]
    # The claim is the lane's now: a later step sees step 3 in flight until stage 7 releases it.
    assert [c["request_id"] for c in claims.earlier_in_flight(tmp_path, uri, "warm-claim", 4)] \
        == ["warm-3"]
    release_history_claim(request)  # what the lane does once the MLflow run is logged or queued
    assert claims.earlier_in_flight(tmp_path, uri, "warm-claim", 4) == []

    def fails(request: EvalRequest, address: str, lane: object) -> str:
        raise RuntimeError("stage 4 failed")

    monkeypatch.setattr(warm, "stages_here", fails)
    with pytest.raises(RuntimeError, match="stage 4 failed"):
        warm.evaluate_warm(request, "tcp://nowhere:1", lane=None)  # type: ignore[arg-type]
    assert claims.earlier_in_flight(tmp_path, uri, "warm-claim", 4) == []  # nothing queued: released
    # A bad wait setting is refused before the claim, as history_claim refuses it.
    from evalfleet.errors import RequestError

    monkeypatch.setenv(claims.WAIT_ENV, "10m")
    with pytest.raises(RequestError, match=r"^EVALFLEET_HISTORY_WAIT_S='10m'"):
        warm.evaluate_warm(request, "tcp://nowhere:1", lane=None)  # type: ignore[arg-type]
    assert not list(tmp_path.glob("history-claims/*/*.json"))
