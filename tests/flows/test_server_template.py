"""A new local server starts from the packaged database of its Prefect version, never over one."""

import gzip
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from evalfleet import server
from evalfleet.server import database_template, ensure_server, seed_database, stop_server

MIGRATE = ("import asyncio; from prefect.server.database import provide_database_interface; "
           "asyncio.run(provide_database_interface().create_db())")


def _schema(path: Path) -> tuple[dict[tuple[str, str], list[str]], list[tuple[str]]]:
    """Every table, index and trigger by name, each as its sorted definition lines (two runs of
    Prefect's migrations order a rebuilt table's constraints differently), and the head."""
    with closing(sqlite3.connect(path)) as db:
        objects = {(kind, name): sorted(line.strip().rstrip(",").strip() for line in sql.splitlines())
                   for kind, name, sql in db.execute(
                       "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL")}
        return objects, db.execute("SELECT version_num FROM alembic_version").fetchall()


def _unpacked(template: Path, to: Path) -> Path:
    to.write_bytes(gzip.decompress(template.read_bytes()))
    return to


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private EVALFLEET_HOME whose server is always stopped at teardown."""
    monkeypatch.setenv("EVALFLEET_HOME", str(tmp_path / "efhome"))
    for name in server.DATABASE_URL_ENVS:
        monkeypatch.delenv(name, raising=False)
    yield tmp_path / "efhome"
    stop_server()


@pytest.mark.slow
def test_the_template_is_what_this_prefect_version_migrates_to(tmp_path):
    template = database_template()
    assert template is not None, (
        f"no database template for Prefect {metadata.version('prefect')} in evalfleet/data: "
        "make it with 'python -m evalfleet.server template' after changing Prefect's pin")
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "fresh"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    for name in server.DATABASE_URL_ENVS:
        env.pop(name, None)
    subprocess.run([sys.executable, "-c", MIGRATE], env=env, check=True, timeout=300,
                   capture_output=True)
    fresh_objects, fresh_head = _schema(tmp_path / "fresh" / "prefect.db")
    objects, head = _schema(_unpacked(template, tmp_path / "template.db"))
    assert head == fresh_head and len(head) == 1
    assert objects == fresh_objects  # every table, index and trigger, as Prefect makes them
    with closing(sqlite3.connect(tmp_path / "template.db")) as db:
        assert db.execute("SELECT count(*) FROM block_type").fetchone()[0] > 20
        assert db.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0  # nothing else


@pytest.mark.slow
def _post(api: httpx.Client, path: str, body: dict[str, object]) -> httpx.Response:
    """POST as Prefect's own client does: a 503 (SQLite busy under load) is tried again."""
    for _ in range(10):
        answer = api.post(path, json=body)
        if answer.status_code != 503:
            return answer
        time.sleep(0.5)
    return answer


def test_a_new_home_s_server_starts_from_the_template_and_works(home, monkeypatch):
    seeded: list[bool] = []
    monkeypatch.setattr(server, "seed_database",
                        lambda prefect_home: seeded.append(seed_database(prefect_home)) or seeded[-1])
    state = ensure_server()
    assert seeded == [True]
    template = database_template()
    assert template is not None
    with httpx.Client(base_url=state.url, timeout=30) as api:
        flow = _post(api, "/flows/", {"name": "seeded-home"})
        assert flow.status_code in (200, 201), flow.text
        run = _post(api, "/flow_runs/", {"flow_id": flow.json()["id"], "name": "r", "state": {
            "type": "COMPLETED", "name": "Completed"}})
        assert run.status_code in (200, 201), run.text
        types = _post(api, "/block_types/filter", {})
        assert types.status_code == 200 and len(types.json()) > 20
    with closing(sqlite3.connect(home / "prefect" / "prefect.db")) as db:
        assert db.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 1
    stop_server()
    assert ensure_server().url  # a second start on the same (now used) database
    assert seeded == [True, False]


def test_an_existing_or_configured_database_is_never_replaced(tmp_path, monkeypatch):
    for name in server.DATABASE_URL_ENVS:
        monkeypatch.delenv(name, raising=False)
    mine = tmp_path / "a" / "prefect.db"
    mine.parent.mkdir()
    mine.write_bytes(b"the user's runs")
    assert not seed_database(mine.parent)
    assert mine.read_bytes() == b"the user's runs"
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", "postgresql+asyncpg://db/prefect")
    assert not seed_database(tmp_path / "b")
    assert not (tmp_path / "b" / "prefect.db").exists()


def test_a_damaged_template_leaves_the_database_to_prefect(tmp_path, monkeypatch, capsys):
    for name in server.DATABASE_URL_ENVS:
        monkeypatch.delenv(name, raising=False)
    broken = tmp_path / "prefect-0.db.gz"
    broken.write_bytes(gzip.compress(os.urandom(100_000))[:5000])  # cut short
    monkeypatch.setattr(server, "database_template", lambda: broken)
    assert not seed_database(tmp_path / "home")
    assert not (tmp_path / "home" / "prefect.db").exists()
    assert list((tmp_path / "home").iterdir()) == []  # no part left behind
    assert "template" in capsys.readouterr().err
