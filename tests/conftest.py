"""Session fixtures: one real Prefect server for every test that runs the flow."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_POLICY = str(ROOT / "evalfleet" / "data" / "cartpole_mlp.pt")

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("EVALFLEET_DASHBOARD", "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session", autouse=True)
def evalfleet_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private EVALFLEET_HOME: a run with no PREFECT_API_URL starts its shared local server
    there (not in the user's ~/.evalfleet), and that server is stopped when the session ends."""
    home = tmp_path_factory.mktemp("evalfleet-home")
    saved = os.environ.get("EVALFLEET_HOME")
    os.environ["EVALFLEET_HOME"] = str(home)
    try:
        yield home
    finally:
        from evalfleet.server import stop_server

        stop_server()
        if saved is None:
            os.environ.pop("EVALFLEET_HOME", None)
        else:
            os.environ["EVALFLEET_HOME"] = saved


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `prefect server start` on 127.0.0.1; PREFECT_API_URL points every process at it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.prefect_servers import PrefectServer

    server = PrefectServer(tmp_path_factory.mktemp("prefect-home"), free_port())
    url = server.start()
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if saved is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = saved
        server.stop()


@pytest.fixture
def example_policy() -> str:
    return EXAMPLE_POLICY
