"""`evalfleet serve` with planted secrets and an env that tries to leak them: nothing gets out.

The service's process holds the webhook and callback secrets and a cloud key. Its Dask workers
must not hold the service's secrets at all; the planted ``Leak`` env (every variable it sees in
its exception text and its ``info``) runs through a signed webhook, and no secret value may be
in the callback body, the Parquet rows, report.json or any file of the run, or MLflow's database.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from distributed import Client

from tests.sandbox import secret_envs as se

from .conftest import CALLBACK_SECRET, CLOUD_SECRET, EXAMPLE_POLICY_PATH, SECRET, Service, TrainerEndpoint

pytestmark = pytest.mark.slow

PLANTED = {"EVALFLEET_WEBHOOK_SECRET": SECRET, "EVALFLEET_CALLBACK_SECRET": CALLBACK_SECRET,
           "AWS_SECRET_ACCESS_KEY": CLOUD_SECRET}


def _worker_secrets() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in PLANTED}


def test_service_workers_hold_no_service_secret(service: Service) -> None:
    with Client(service.urls["dask"], timeout=30) as client:
        seen = client.run(_worker_secrets)
    assert seen, "no workers"
    for worker, values in seen.items():
        assert values["EVALFLEET_WEBHOOK_SECRET"] is None, worker
        assert values["EVALFLEET_CALLBACK_SECRET"] is None, worker


def test_leaking_env_through_the_service(service: Service, trainer: TrainerEndpoint) -> None:
    sha = hashlib.sha256(Path(EXAMPLE_POLICY_PATH).read_bytes()).hexdigest()
    body = {"policy": {"uri": Path(EXAMPLE_POLICY_PATH).as_uri(), "sha256": sha},
            "env": {"id": se.env_id("Leak")},
            "protocol": {"episodes": 20, "seed": 4, "max_steps": 100},
            "training_run_id": "leak-run", "step": 1, "callback_url": trainer.url}
    answer = service.post(body, delivery_id="leak-delivery-1")
    assert answer.status_code == 202, answer.text
    trainer.next(timeout=240)
    raw = trainer.calls[-1]["body"]
    report = json.loads(raw)
    assert report["isolation"] == "process"  # auto: a foreign env runs in sandboxes
    table = pq.read_table(report["outputs"]["episodes"]).to_pylist()
    failed = [r for r in table if r["end_reason"] == "env_error"]
    assert failed and all("RuntimeError: leaking" in r["error"] for r in failed)

    folder = Path(report["outputs"]["folder"])
    surfaces: list[tuple[str, bytes]] = [("callback body", raw), ("rows", repr(table).encode())]
    surfaces += [(str(p), p.read_bytes()) for p in folder.rglob("*") if p.is_file()]
    surfaces += [(str(p), p.read_bytes()) for p in service.output.rglob("mlflow.db")]
    for where, blob in surfaces:
        for name, value in PLANTED.items():
            assert value.encode() not in blob, f"{name}'s value leaked into {where}"
