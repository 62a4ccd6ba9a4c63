"""An env that tries to carry the worker's secrets out through every surface, through the flow.

Planted credentials sit in the environment of the driver and of the Dask workers (the cluster
starts after they are planted). The ``Leak`` env puts every variable it sees into its exception
text and into its ``info``. Nothing the evaluation writes may hold a planted value: the Parquet
bytes and rows, report.json, the report page, the MLflow run (its database, params, tags,
metrics, artifact files), the Prefect artifacts, and the body of the signed callback.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from evalfleet.cluster import fleet_cluster
from evalfleet.models import EvalRequest
from evalfleet.sandbox.isolation import available_levels

from . import faulty_envs as fe
from . import secret_envs as se

pytestmark = pytest.mark.slow


def planted_secrets() -> dict[str, str]:
    return {"EVALFLEET_WEBHOOK_SECRET": f"planted-webhook-{secrets.token_hex(12)}",
            "EVALFLEET_CALLBACK_SECRET": f"planted-callback-{secrets.token_hex(12)}",
            "AWS_SECRET_ACCESS_KEY": f"planted/aws+{secrets.token_hex(12)}"}


class CallbackSink:
    """A loopback HTTP endpoint that keeps the raw body of every POST."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/report"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sink() -> Iterator[CallbackSink]:
    s = CallbackSink()
    yield s
    s.close()


def spellings(value: str) -> list[bytes]:
    """The value as raw text, as repr() and JSON write it."""
    return [v.encode() for v in {value, repr(value)[1:-1], json.dumps(value)[1:-1]}]


def assert_clean(where: str, data: bytes | str, planted: dict[str, str]) -> None:
    blob = data.encode() if isinstance(data, str) else data
    for name, value in planted.items():
        for form in spellings(value):
            assert form not in blob, f"{name}'s value leaked into {where}"


LEVELS = ["inprocess"] + [lvl for lvl in ("process",) if available_levels()[lvl] is None]


@pytest.mark.parametrize("isolation", LEVELS)
def test_no_secret_reaches_any_output(isolation: str, prefect_server: str, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      sink: CallbackSink) -> None:
    from flows.eval import evaluate

    planted = planted_secrets()
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("EVALFLEET_ALLOWED_HOSTS", "127.0.0.1")  # the sink listens on loopback
    output = tmp_path / "out"
    with fleet_cluster(None, 2) as address:  # workers inherit the planted environment
        report = evaluate(EvalRequest.build(
            env=se.env_id("Leak"), policy=f"{fe.__name__}:balance", episodes=30, concurrency=6,
            seed=2, isolation=isolation, dask_address=address, output=output,
            callback_url=sink.url, training_run_id="leak-test"))

    assert report.isolation == isolation
    table = pq.read_table(report.outputs["episodes"]).to_pylist()
    failed = [r for r in table if r["end_reason"] == "env_error"]
    finished = [r for r in table if r["end_reason"] != "env_error"]
    assert failed and finished
    assert all("RuntimeError: leaking" in r["error"] for r in failed)
    names = {k for r in finished for k, _ in r["metrics"]}
    if isolation == "inprocess":
        # The env saw the secrets (it runs in the worker); the rows say which were scrubbed.
        assert all("[redacted:AWS_SECRET_ACCESS_KEY]" in r["error"] for r in failed)
        assert "EVALFLEET_WEBHOOK_SECRET=[redacted:EVALFLEET_WEBHOOK_SECRET]" in names
    else:
        # The sandbox never saw them: the allow-list names none of those variables.
        assert not any(n.split("=", 1)[0] in planted for n in names)
        assert any(n.startswith("PATH=") for n in names)
        assert not any(name in r["error"] for r in failed for name in planted)

    # Every file the evaluation wrote: Parquet, report.json, report page, plots, MLflow's
    # SQLite database and artifact copies.
    files = [p for p in output.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(p.suffix == ".parquet" for p in files)
    for path in files:
        assert_clean(str(path.relative_to(output)), path.read_bytes(), planted)
    assert_clean("episode rows", repr(table), planted)
    assert_clean("report.json", Path(report.outputs["report"]).read_text(), planted)

    client = MlflowClient(tracking_uri=report.outputs["mlflow_uri"])
    run = client.get_run(report.outputs["mlflow_run_id"])
    assert_clean("MLflow run", repr((run.data.params, run.data.tags, run.data.metrics)), planted)
    art_dir = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "arts")))
    arts = [p for p in art_dir.rglob("*") if p.is_file()]
    assert any(p.name == "episodes.parquet" for p in arts)
    for path in arts:
        assert_clean(f"MLflow artifact {path.name}", path.read_bytes(), planted)
    rows = pq.read_table(art_dir / "episodes.parquet").to_pylist()
    assert_clean("MLflow episodes.parquet rows", repr(rows), planted)

    key = f"eval-{report.policy_sha256[:12]}"
    found = httpx.post(f"{prefect_server}/artifacts/filter", json={
        "artifacts": {"key": {"any_": [key, f"{key}-report"]}}}).json()
    assert {a["key"] for a in found} == {key, f"{key}-report"}
    assert_clean("Prefect artifacts", json.dumps(found), planted)

    assert len(sink.bodies) == 1, "the callback was not delivered"
    assert json.loads(sink.bodies[0])["request_id"] == report.request_id
    assert_clean("callback body", sink.bodies[0], planted)
