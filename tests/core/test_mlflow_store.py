"""A new SQLite MLflow store is a copy of an empty one: MLflow's migrations run once per version."""

from __future__ import annotations

import os
from pathlib import Path

import mlflow.store.db.utils
import pytest
from mlflow.tracking import MlflowClient

from evalfleet.tracking import log_evaluation
from tests.core.test_mlflow_queue import REPORT


@pytest.fixture
def migrations(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The stores MLflow built by running its schema migrations, in a fresh evalfleet home."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "home"))
    built: list[str] = []
    real = mlflow.store.db.utils._initialize_tables

    def spy(engine):  # type: ignore[no-untyped-def]
        built.append(str(engine.url))
        return real(engine)

    monkeypatch.setattr(mlflow.store.db.utils, "_initialize_tables", spy)
    return built


def _log(db: Path) -> str:
    return log_evaluation(f"sqlite:///{db}", "evalfleet", REPORT, {"episodes": 4}, [], "run")


def test_new_results_folders_get_their_store_without_migrations(migrations, tmp_path, monkeypatch):
    _log(tmp_path / "a" / "mlflow.db")  # the first store on this machine: the template is made
    assert len(migrations) == 1
    monkeypatch.chdir(tmp_path / "a")
    run_b = _log(tmp_path / "b" / "mlflow.db")
    run_c = _log(tmp_path / "c" / "mlflow.db")
    assert len(migrations) == 1, migrations  # b and c are copies

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}")
    run = client.get_run(run_b)
    assert run.data.metrics["eval/reward"] == 1.0 and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((tmp_path / "b" / "mlartifacts").resolve().as_uri())
    names = sorted(e.name for e in client.search_experiments())
    assert names == ["Default", "evalfleet"]  # nothing of the template's own making
    # MLflow's Default experiment is where MLflow itself would have put it: the working directory.
    assert client.get_experiment("0").artifact_location == str(tmp_path / "a" / "mlruns" / "0")
    other = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}")
    assert [r.info.run_id for r in other.search_runs(["1"])] == [run_c]  # stores are separate


def test_an_existing_store_is_never_replaced(migrations, tmp_path):
    db = tmp_path / "a" / "mlflow.db"
    first = _log(db)
    size = os.path.getsize(db)
    second = _log(db)
    runs = MlflowClient(tracking_uri=f"sqlite:///{db}").search_runs(["1"])
    assert sorted(r.info.run_id for r in runs) == sorted([first, second])
    assert os.path.getsize(db) >= size


def test_an_unwritable_home_falls_back_to_mlflow_building_the_store(migrations, tmp_path, monkeypatch):
    home = tmp_path / "home-file"
    home.write_text("not a folder")
    monkeypatch.setenv("EVALFLEET_HOME", str(home))
    run = _log(tmp_path / "a" / "mlflow.db")
    assert len(migrations) == 1  # MLflow built it, as before
    assert MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}").get_run(run)
