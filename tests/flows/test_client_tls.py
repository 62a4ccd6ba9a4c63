"""Prefect's clients share one verified TLS context per CA file (not one per task run)."""

import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.settings import (
    PREFECT_API_TLS_INSECURE_SKIP_VERIFY,
    PREFECT_API_URL,
    temporary_settings,
)

from flows import client_tls

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def made(monkeypatch):
    """Every TLS context the real ``ssl.create_default_context`` makes, from a clean cache."""
    client_tls._verified_context.cache_clear()
    contexts: list[ssl.SSLContext] = []
    real = ssl.create_default_context

    def counting(*args, **kwargs):
        contexts.append(real(*args, **kwargs))
        return contexts[-1]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    # A client is made, never connected: a URL no server answers keeps Prefect from starting one.
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        yield contexts
    client_tls._verified_context.cache_clear()


def _verify(client: SyncPrefectClient) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context  # httpx's connection pool


def test_clients_share_one_verified_context(made):
    assert client_tls.install()
    clients = [get_client(sync_client=True) for _ in range(5)]
    assert len(made) == 1  # Prefect made five clients, each with ssl.create_default_context
    shared = _verify(clients[0])
    assert all(_verify(c) is shared for c in clients)
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname
    assert shared.cert_store_stats()["x509_ca"] > 10  # the CA bundle Prefect names, loaded
    assert client_tls._verified_context.cache_info().currsize == 1


def test_skipping_verification_still_makes_a_context_of_its_own(made):
    assert client_tls.install()
    verified = _verify(get_client(sync_client=True))
    with temporary_settings(updates={PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        insecure = [_verify(get_client(sync_client=True)) for _ in range(2)]
    assert insecure[0] is not insecure[1] and insecure[0].verify_mode == ssl.CERT_NONE
    assert verified.verify_mode == ssl.CERT_REQUIRED and verified.check_hostname  # untouched
    assert len(made) == 3


def test_an_untested_prefect_keeps_its_own_contexts():
    assert not client_tls.installable("4.0.0")
    assert not client_tls.install("4.0.0")


def test_any_task_module_installs_it_where_tasks_run():
    """Workers import a task's module to run it: that import shares the contexts there."""
    code = ("import tasks.run_episodes; from prefect.client import orchestration; "
            "print(type(orchestration.ssl).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-1] == "_SharedContexts"
