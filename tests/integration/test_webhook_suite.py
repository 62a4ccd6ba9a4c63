"""A suite through the webhook: the body's ``suite`` runs every task in the served flow."""

from __future__ import annotations

import pytest

from .conftest import Service
from .test_webhook import doc

pytestmark = pytest.mark.slow

SUITE = {"suite": {"name": "hook", "episodes": 6},
         "task": [{"env": "CartPole-v1", "grid": {"max_episode_steps": [40, 60]},
                   "normalise": {"min": 0, "max": 60}}]}


def test_suite_through_the_webhook(service: Service) -> None:
    bad = service.post(doc(301, suite={"task": [{"env": "CartPole-v1"}]}))
    assert bad.status_code == 400, bad.text
    assert bad.json()["field"] == "suite" and "'episodes' is missing" in bad.json()["reason"]

    refused = service.post(doc(302, suite=SUITE))  # its env, episodes and step cap: ignored
    assert refused.status_code == 400, refused.text
    assert refused.json()["reason"].startswith("'env', 'protocol.episodes', 'protocol.max_steps' "
                                               "cannot be used with 'suite'")
    body = doc(302, suite=SUITE, protocol={"seed": 302})  # the suite names envs and budgets
    del body["env"]
    r = service.post(body)
    assert r.status_code == 202, r.text
    single = service.post(doc(302))  # the same body without the suite is another evaluation
    assert single.json()["id"] != r.json()["id"] and single.json()["duplicate"] is None

    status = service.wait_final(r.json()["status_url"])
    assert status["state"] == "COMPLETED", status
    report = status["report"]
    assert report["suite"] == "hook" and report["normalised"]
    assert [t["name"] for t in report["tasks"]] == ["CartPole-v1[max_episode_steps=40]",
                                                    "CartPole-v1[max_episode_steps=60]"]
    assert [t["episodes"] for t in report["tasks"]] == [6, 6]
    iqm = report["aggregates"]["iqm"]
    assert 0.0 <= iqm["ci"][0] <= iqm["point"] <= iqm["ci"][1] <= 1.0
    assert report["outputs"]["mlflow_run_id"]
