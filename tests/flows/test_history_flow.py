"""History through the whole flow: three checkpoints of one training run on the planted Courier.

Step 1 (honest, careful) is the first; step 2 games the reward (tip farming): a new best by
return, with the reward-hacking and action-shift alarms in the callback body, report.json, the
page and MLflow; step 3 (honest but careless) is a significant regression against the best
checkpoint, and ``--gate`` exits ``EXIT_REGRESSION``.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from evalfleet.cli import EXIT_GATE_UNDECIDED, EXIT_OK, EXIT_REGRESSION, run_cli
from evalfleet.models import EvalRequest
from flows.eval import evaluate
from tests.core.courier import ENV_ID

pytestmark = pytest.mark.slow

EPISODES = 30


@pytest.fixture
def trainer() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback endpoint recording the callback bodies it receives."""
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


def _args(tmp_path: Any, policy: str, step: int) -> list[str]:
    return ["--env", ENV_ID, "--policy", f"tests.core.courier:{policy}", "--episodes",
            str(EPISODES), "--concurrency", "10", "--isolation", "inprocess", "--output",
            str(tmp_path / "out"), "--training-run-id", "courier-run", "--step", str(step),
            "--gate", "--quiet", "--no-audit"]


def test_gamed_checkpoint_alarms_everywhere_and_a_regression_gates(
    prefect_server, tmp_path, trainer, monkeypatch, capsys
):
    url, bodies = trainer
    monkeypatch.setenv("EVALFLEET_CALLBACK_SECRET", "history-test-secret")
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", "127.0.0.1")  # the trainer listens on loopback
    assert run_cli(evaluate, _args(tmp_path, "careful", 1)) == EXIT_OK
    assert re.search(r"\nvs best checkpoint +first \(first evaluated checkpoint", capsys.readouterr().out)

    request = EvalRequest.build(env=ENV_ID, policy="tests.core.courier:tip_farmer",
                                episodes=EPISODES, concurrency=10, isolation="inprocess",
                                output=tmp_path / "out", training_run_id="courier-run", step=2,
                                callback_url=url, audit=False)
    gamed = evaluate(request)
    assert gamed.verdict == "new_best"  # by return alone it is the best yet...
    names = [a["alarm"] for a in gamed.history["alarms"]]
    assert names == ["reward_outcome_divergence", "action_distribution_shift"]  # ...but gamed
    [body] = bodies
    # ...so it is no best checkpoint: the best stays step 1, and later steps are judged by it.
    assert body["history"]["verdict"] == "new_best" and body["history"]["best_step"] == 1
    assert body["history"]["best_withheld"] == ["reward_outcome_divergence"]
    assert [a["alarm"] for a in body["history"]["alarms"]] == names
    assert any(a.startswith("reward_outcome_divergence:") for a in body["alarms"])
    saved = json.loads(open(gamed.outputs["report"]).read())
    assert saved["history"]["alarms"][0]["steps"] == [1, 2]
    page = open(gamed.outputs["report_html"]).read()
    assert "Training run so far" in page and 'alt="history"' in page
    run = MlflowClient(gamed.outputs["mlflow_uri"]).get_run(gamed.outputs["mlflow_run_id"])
    assert run.data.tags["evalfleet.verdict"] == "new_best"
    assert run.data.tags["evalfleet.alarm.reward_outcome_divergence"] == "true"
    assert run.data.tags["evalfleet.best"] == "false"
    assert "history.png" in {a.path for a in MlflowClient(gamed.outputs["mlflow_uri"])
                             .list_artifacts(run.info.run_id)}

    capsys.readouterr()
    assert run_cli(evaluate, _args(tmp_path, "careless", 3)) == EXIT_REGRESSION
    err = capsys.readouterr().err
    assert "gate: step 3 is a regression against the best checkpoint (step 1)" in err
    assert f"(exit {EXIT_REGRESSION})" in err


@pytest.mark.parametrize("cap", [200, 500])
def test_one_step_cap_spelled_three_ways_is_one_cache_entry_and_one_protocol(
    prefect_server, tmp_path, example_policy, cap
):
    """Planted: three checkpoints of one run, the step cap given each time another way. The env
    kwarg spelling was keyed apart (a miss) and was another protocol: ``protocol_changed``, and
    ``--gate`` exited 6 on identical episodes."""
    kwarg = ["--env-kwargs", json.dumps({"max_episode_steps": cap})]
    spellings = [["--max-steps", str(cap)], kwarg,
                 [] if cap == 500 else ["--max-steps", str(cap), *kwarg]]
    out = tmp_path / "out"
    for step, spelling in enumerate(spellings, 1):
        args = ["--env", "CartPole-v1", "--policy", example_policy, "--episodes", "12",
                "--concurrency", "12", "--isolation", "inprocess", "--output", str(out),
                "--training-run-id", f"caps-{cap}", "--step", str(step), "--gate", "--quiet",
                "--no-audit", *spelling]
        assert run_cli(evaluate, args) == EXIT_OK, spelling
    reports = sorted((json.loads(p.read_text()) for p in out.glob("runs/*/report.json")),
                     key=lambda r: r["step"])
    assert [r["cache"]["status"] for r in reports] == ["miss", "hit", "hit"]
    assert len({r["cache"]["key"] for r in reports}) == 1
    assert [r["history"]["verdict"] for r in reports] == ["first", "not_distinguishable",
                                                         "not_distinguishable"]
    assert len({r["returns"]["mean"] for r in reports}) == 1
    assert reports[0]["lengths"]["max"] == cap  # the cap shapes these episodes
    assert not any(a.startswith("history_protocol_changed") for r in reports for a in r["alarms"])


def test_a_checkpoint_run_under_other_env_inputs_is_protocol_changed_and_gates_closed(
    prefect_server, tmp_path, monkeypatch
):
    """Planted (audit finding: history protocol): one policy, three checkpoints; step 2's env was
    granted ``EVALFLEET_TEST_GAIN=3`` (``--sandbox-env``), steps 1 and 3 were granted 1. The
    cache keyed them apart, but the history's protocol id left the env's inputs out: step 2 was
    paired with step 1 and passed ``--gate`` (exit 0; the audit's env read the gain: a worse policy
    became ``new_best``), and step 3 was compared with step 2. Now step 2 is ``protocol_changed``
    (exit 6) and step 3 is compared with step 1."""
    out = tmp_path / "out"

    def step(n: int, gain: str) -> int:
        monkeypatch.setenv("EVALFLEET_TEST_GAIN", gain)
        return run_cli(evaluate, [*_args(tmp_path, "careful", n), "--isolation", "process",
                                  "--sandbox-env", "EVALFLEET_TEST_GAIN", "--training-run-id", "gain-run"])

    assert step(1, "1") == EXIT_OK
    assert step(2, "3") == EXIT_GATE_UNDECIDED
    assert step(3, "1") == EXIT_OK
    reports = sorted((json.loads(p.read_text()) for p in out.glob("runs/*/report.json")),
                     key=lambda r: r["step"])
    assert [r["history"]["verdict"] for r in reports] == ["first", "protocol_changed",
                                                         "not_distinguishable"]
    assert reports[2]["history"]["compared_with"]["step"] == 1
    digests = [r["manifest"]["protocol"]["environment_sha256"] for r in reports]
    assert digests[0] == digests[2] != digests[1]
    assert reports[0]["history"]["protocol"] == reports[2]["history"]["protocol"] != reports[1][
        "history"]["protocol"]
    assert any(a.startswith("history_protocol_changed") for a in reports[1]["alarms"])
